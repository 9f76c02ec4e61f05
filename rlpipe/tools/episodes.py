"""The multi-turn episode loop, engine-free: episodes kept as token ids from start to end (the model's tokens and
log-probs as sampled, the tool messages' rendered ids appended with mask 0), every live episode's next turn sampled
together through a `sample_turn` callable, tool calls run with their deadlines and their limits per turn and per
episode. Whatever a turn holds, it is its own episode's outcome, never the loop's failure. It imports the rendering
and the calls of this package and the tool limits' defaults of rlpipe's config, nothing of the engine or vLLM, so a
scripted engine drives it in tests."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlpipe.config.rollout import MAX_TOOL_CALLS_PER_TURN, MAX_TOOL_TIME_PER_EPISODE_S
from rlpipe.tools.calls import ToolCall, ToolThreads, error_text, run_tool_calls
from rlpipe.tools.formats import TurnReader
from rlpipe.tools.render import parse_tool_calls, tool_suffix_ids

logger = logging.getLogger("rlpipe")


@dataclass
class Turn:
    """What the engine returned for one request: the sampled ids with their log-probs, the text, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class Episode:
    """One sample's conversation as ids: `prompt_ids`, then `token_ids` (the model's turns and the tool messages in
    order), with `mask` 1 on the model's tokens and 0 on the tools', and the engine's log-probs (0.0 on tool
    tokens). `messages` is the conversation after the prompt, as reward functions get it."""

    prompt_ids: list[int]
    tools: dict[str, Callable]
    environment: Any = None
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0  # how long its tool calls ran, added up
    finish_reason: str = "stop"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def add_model_turn(self, turn: Turn) -> None:
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.token_ids)
        self.turns += 1
        self.finish_reason = turn.finish_reason

    def add_tool_ids(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    @property
    def text(self) -> str:
        """The model's and the tools' messages as one text (for logs), the model's tool calls as Hermes blocks (the
        format the model wrote them in is in its token ids)."""

        def shown(message: dict) -> str:
            calls = "".join(
                f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                "</tool_call>"
                for c in message.get("tool_calls", [])
            )
            return f"[{message['role']}] {message.get('content', '')}{calls}".rstrip()

        return "\n".join(shown(m) for m in self.messages)


@dataclass
class EpisodeLimits:
    max_turns: int  # model turns per episode
    max_tokens: int  # per model turn
    max_model_len: int  # the episode's whole context: prompt, every turn, every tool message
    tool_timeout_s: float
    max_tool_calls_per_turn: int = MAX_TOOL_CALLS_PER_TURN  # a turn's later calls are answered with an error
    max_tool_time_s: float = MAX_TOOL_TIME_PER_EPISODE_S  # an episode's tool seconds, added up; then calls are refused


def run_episodes(
    episodes: list[Episode],
    sample_turn: Callable[[list[tuple[list[int], int]]], list[Turn]],
    tokenizer,
    limits: EpisodeLimits,
    template_kwargs: dict | None = None,
    threads: ToolThreads | None = None,
    read_turn: TurnReader | None = None,
) -> list[Episode]:
    """Play `episodes` to their end. `sample_turn(requests)` samples one turn per (context ids, max tokens) request,
    all of them submitted together. An episode ends when the model's turn calls no tool, is cut at max_tokens,
    reaches max_turns, or when the context would not fit its next turn or the chat template cannot render its tool
    messages (those ending with finish_reason "length": the episode was cut, not finished). Tool calls run on
    `threads`, the caller's (an engine's runner passes its own, so calls stuck in one step count in the next); None:
    threads of this call alone. `read_turn(text, token_ids)` reads a turn's tool calls in the model's format
    (rlpipe/tools/formats.py `turn_reader`; None: Hermes, `parse_tool_calls`). Only `sample_turn` (the engine) may
    raise out of here: a turn that cannot be read is plain text, a call that cannot run or whose result cannot be
    written is an error message the model reads."""
    template_kwargs = template_kwargs or {}
    threads = threads if threads is not None else ToolThreads()
    read_turn = read_turn or _hermes
    live = list(episodes)
    while live:
        for episode in live:
            if episode.length >= limits.max_model_len:  # a prompt that leaves no room (its tools' schemas)
                episode.finish_reason = "length"
        live = [episode for episode in live if episode.length < limits.max_model_len]
        if not live:
            break
        requests = [
            (episode.prompt_ids + episode.token_ids, min(limits.max_tokens, limits.max_model_len - episode.length))
            for episode in live
        ]
        turns = sample_turn(requests)
        calling = [
            (episode, message) for episode, turn in zip(live, turns)
            if (message := _take_turn(episode, turn, limits, read_turn)) is not None
        ]
        replies = _answer_calls(calling, limits, threads)
        live = [
            episode for (episode, _), tool_messages in zip(calling, replies)
            if _append_tool_messages(episode, tool_messages, tokenizer, limits, template_kwargs)
        ]
    return episodes


def _take_turn(episode: Episode, turn: Turn, limits: EpisodeLimits, read_turn: TurnReader) -> dict | None:
    """Add the model's turn to its episode: the turn's message when its tool calls are to be answered, else None
    (the episode ends there)."""
    episode.add_model_turn(turn)
    message = _read_turn(turn, read_turn)
    episode.messages.append(message)
    if turn.finish_reason != "stop" or "tool_calls" not in message:
        return None
    if episode.turns >= limits.max_turns:
        episode.finish_reason = "length"
        return None
    return message


def _hermes(text: str, token_ids: list[int]) -> dict:
    return parse_tool_calls(text)


def _read_turn(turn: Turn, read_turn: TurnReader) -> dict:
    """The turn's message as `read_turn` reads it; a turn it fails on is plain text, as a malformed call makes it."""
    try:
        return read_turn(turn.text, turn.token_ids)
    except Exception:  # noqa: BLE001 - whatever the model wrote is its sample's outcome, never the step's
        return {"role": "assistant", "content": turn.text}


def _answer_calls(calling: list[tuple[Episode, dict]], limits: EpisodeLimits, threads: ToolThreads) -> list[list[dict]]:
    """Each calling episode's tool messages, one per call in order. The calls within their episode's limits run, all
    episodes' together; a turn's calls past max_tool_calls_per_turn, and every call of an episode whose tools have
    run max_tool_time_s, are answered with an error and not run."""
    calls: list[ToolCall] = []
    results: list[tuple[Any, bool] | None] = []  # None: to run
    for index, (episode, message) in enumerate(calling):
        for number, call in enumerate(message["tool_calls"]):
            name = call["function"]["name"]
            calls.append(ToolCall(index, name, call["function"]["arguments"], episode.tools.get(name)))
            results.append(_refusal(name, number, episode.tool_seconds, limits))
    to_run = [i for i, result in enumerate(results) if result is None]
    for i, result in zip(to_run, run_tool_calls([calls[i] for i in to_run], limits.tool_timeout_s, threads)):
        results[i] = result
    replies: list[list[dict]] = [[] for _ in calling]
    for call, (result, failed) in zip(calls, results):
        episode = calling[call.episode][0]
        content, unwritable = _content(result)
        episode.tool_calls += 1
        episode.tool_errors += failed or unwritable
        episode.tool_seconds += call.seconds
        replies[call.episode].append({"role": "tool", "name": call.name, "content": content})
    return replies


def _refusal(name: str, number: int, spent_s: float, limits: EpisodeLimits) -> tuple[dict, bool] | None:
    """The error that answers a turn's call number `number` (from 0) without running it, or None: it runs."""
    if number >= limits.max_tool_calls_per_turn:
        cap = limits.max_tool_calls_per_turn
        return {"error": f"Tool {name} not run: more than {cap} tool calls in one turn."}, True
    if spent_s >= limits.max_tool_time_s:
        return {"error": f"Tool {name} not run: this episode's tool calls have taken {spent_s:.1f} s of the "
                         f"{limits.max_tool_time_s:g} s they may take."}, True
    return None


def _content(result: Any) -> tuple[str, bool]:
    """A tool message's content, str(result) as TRL writes it, and whether it is an error in its place: a result
    whose str() fails (its own __str__, an integer past Python's digit limit, nesting past the recursion limit)."""
    try:
        return str(result), False
    except Exception as err:  # noqa: BLE001 - the tool's result is its sample's outcome, never the step's
        return str({"error": f"the tool's result could not be written as text ({type(err).__name__})"}), True


def _append_tool_messages(episode: Episode, tool_messages: list[dict], tokenizer, limits: EpisodeLimits,
                          template_kwargs: dict) -> bool:
    """Append the tool messages' ids (mask 0): whether the episode goes on. Tool messages that leave no room for one
    more token, or that the chat template cannot render, are dropped and the conversation ends with the call
    (`length`), as TRL drops those that do not fit."""
    try:
        suffix = tool_suffix_ids(tokenizer, tool_messages, **template_kwargs)
    except Exception as err:  # noqa: BLE001 - a tool message is its sample's outcome, never the step's
        logger.warning("rlpipe: an episode ends at tool messages the chat template cannot render (%s: %.200s)",
                       type(err).__name__, error_text(err))
        episode.finish_reason = "length"
        return False
    if episode.length + len(suffix) >= limits.max_model_len:
        episode.finish_reason = "length"
        return False
    episode.messages += tool_messages
    episode.add_tool_ids(suffix)
    return True
