"""The multi-turn episode loop, engine-free: episodes kept as token ids from start to end (the model's tokens and
log-probs as sampled, the tool messages' rendered ids appended with mask 0), every live episode's next turn sampled
together through a `sample_turn` callable, tool calls run with their deadlines. It imports the rendering and the
calls of this package, nothing of the engine or vLLM, so a scripted engine drives it in tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlpipe.tools.calls import ToolCall, ToolThreads, run_tool_calls
from rlpipe.tools.render import parse_tool_calls, tool_suffix_ids

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
        """The model's and the tools' messages as one text (for logs), the model's tool calls as it wrote them."""

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


def run_episodes(
    episodes: list[Episode],
    sample_turn: Callable[[list[tuple[list[int], int]]], list[Turn]],
    tokenizer,
    limits: EpisodeLimits,
    template_kwargs: dict | None = None,
    threads: ToolThreads | None = None,
) -> list[Episode]:
    """Play `episodes` to their end. `sample_turn(requests)` samples one turn per (context ids, max tokens) request,
    all of them submitted together. An episode ends when the model's turn calls no tool, is cut at max_tokens,
    reaches max_turns, or when the context would not fit its next turn (those three end with finish_reason
    "length": the episode was cut, not finished). Tool calls run on `threads`, the caller's (an engine's runner
    passes its own, so calls stuck in one step count in the next); None: threads of this call alone."""
    template_kwargs = template_kwargs or {}
    threads = threads if threads is not None else ToolThreads()
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
        calling: list[tuple[Episode, dict]] = []
        for episode, turn in zip(live, turns):
            episode.add_model_turn(turn)
            message = parse_tool_calls(turn.text)
            episode.messages.append(message)
            if turn.finish_reason != "stop" or "tool_calls" not in message:
                continue
            if episode.turns >= limits.max_turns:
                episode.finish_reason = "length"
                continue
            calling.append((episode, message))
        calls = [
            ToolCall(index, call["function"]["name"], call["function"]["arguments"],
                     episode.tools.get(call["function"]["name"]))
            for index, (episode, message) in enumerate(calling)
            for call in message["tool_calls"]
        ]
        results = run_tool_calls(calls, limits.tool_timeout_s, threads)
        replies: list[list[dict]] = [[] for _ in calling]
        for call, (result, failed) in zip(calls, results):
            episode = calling[call.episode][0]
            episode.tool_calls += 1
            episode.tool_errors += failed
            replies[call.episode].append({"role": "tool", "name": call.name, "content": str(result)})
        live = []
        for (episode, _), tool_messages in zip(calling, replies):
            suffix = tool_suffix_ids(tokenizer, tool_messages, **template_kwargs)
            # The next turn needs room for at least one token after the tool messages; tool messages that leave
            # none are dropped (the conversation ends with the call), as TRL drops them.
            if episode.length + len(suffix) >= limits.max_model_len:
                episode.finish_reason = "length"
                continue
            episode.messages += tool_messages
            episode.add_tool_ids(suffix)
            live.append(episode)
    return episodes

