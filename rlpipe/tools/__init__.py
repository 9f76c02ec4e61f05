"""Multi-turn episodes with tools, on TRL's contracts (GRPOTrainer's `tools=` and `environment_factory=`), kept as
token ids from start to end.

- Tools are plain functions named by import path; an environment factory is a class whose instances hold one
  episode's state: `reset(**row)` starts the episode (a string it returns is appended to the last user message, as
  TRL does) and its public methods are the episode's tools. Schemas come from signatures and docstrings
  (`transformers.utils.get_json_schema`), as chat templates take them.
- Token-in/token-out: the model's tokens are kept exactly as the engine sampled them, with the engine's log-probs;
  after a turn that calls tools, only the new tool messages are rendered through the chat template (the suffix after
  the rendered history, TRL's `_get_tool_suffix_ids`) and their ids appended with mask 0. Nothing the model produced
  is decoded and tokenized again.
- Every turn submits the next request of every live episode together (`sample_turn`), so the engine batches
  episodes across turns.
- A tool that raises, is unknown, or outlives `rollout.tool_timeout_s` becomes `{"error": ...}` in the conversation
  (TRL's rendering of a failed call); the episode goes on. Calls run on threads of their own (ToolThreads): one past
  its time limit is written off, not waited for.
- The built-in tools, `calculator` and `python` (model-written code in the kernel sandbox, never in this process),
  live in rlpipe/tools/builtins.py; recipes name them here, as `rlpipe.tools:calculator` and `rlpipe.tools:python`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The built-in tools, under the names recipes give them (`rlpipe.tools:python`).
from rlpipe.tools.builtins import PYTHON_LIMITS, ProgramFailed, calculator, python, sandboxed_python  # noqa: F401
from rlpipe.config.errors import ConfigError
from rlpipe.rewards import sandbox

logger = logging.getLogger("rlpipe")

# Qwen/Hermes-style tool calls, the format TRL's response schemas parse for those families.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# Said to a model whose chat template does not render `tools=` (ChatML templates without tool support, e.g.
# SmolLM2's): the tool block Qwen2.5's template writes into the system message, so the model learns one format.
TOOLS_SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolConfigError(ConfigError):
    """A tool or environment factory named in the recipe cannot be used."""


def load_object(path: str, what: str) -> Any:
    """The object an import path `package.module:attribute` names, or one `rlpipe.train` passed by value."""
    from rlpipe.rewards.registry import BY_VALUE_PREFIX, RewardConfigError, load_by_value

    if path.startswith(BY_VALUE_PREFIX):
        try:
            return load_by_value(path)
        except RewardConfigError as err:
            raise ToolConfigError(f"{what}: {str(err).replace('reward function', 'tool', 1)}") from None
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ToolConfigError(f"{what}: {path!r} is not an import path 'package.module:name'")
    try:
        target = importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail with any error
        raise ToolConfigError(f"{what}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise ToolConfigError(f"{what}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, name)
    if not callable(target):
        raise ToolConfigError(f"{what}: {path!r} is not callable")
    return target


def environment_tools(environment: Any) -> list[Callable]:
    """An environment's tools, as TRL takes them: its class's public functions other than reset and get_reward,
    bound to the instance."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """JSON schemas of the tools as chat templates take them (from their signatures and docstrings)."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:  # a verifiers task set's tool carries the schema verifiers advertises (rlpipe/verifiers_env.py)
            schemas.append(getattr(tool, "json_schema", None) or get_json_schema(tool))
        except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
            raise ToolConfigError(f"rollout.tools: {tool.__name__}: no schema from its signature ({err})") from None
    return schemas


def load_tools(
    tool_paths: Sequence[str], *, tool_timeout_s: float | None = None, unsafe_no_sandbox: bool = False
) -> list[Callable]:
    """The tools `rollout.tools` names, with those that run model-written code checked (sandboxed_tools)."""
    return sandboxed_tools([load_object(path, "rollout.tools") for path in tool_paths], tool_timeout_s,
                           unsafe_no_sandbox)


def check_tools(rollout) -> None:
    """The driver's start-up check of `rollout.tools` (a RolloutConfig), before any cluster starts: each loads, and
    one that runs model-written code can run here. Every engine checks again where its tools run."""
    load_tools(rollout.tools, tool_timeout_s=rollout.tool_timeout_s, unsafe_no_sandbox=rollout.unsafe_no_sandbox)


@dataclass
class ToolSet:
    """The recipe's tools and environment factory, loaded (in the engine's process, where episodes run)."""

    tools: list[Callable] = field(default_factory=list)
    environment_factory: Callable | None = None

    @classmethod
    def load(
        cls,
        tool_paths: Sequence[str],
        factory_path: str | None,
        verifiers_tools: str | None = None,
        *,
        tool_timeout_s: float | None = None,
        unsafe_no_sandbox: bool = False,
    ) -> ToolSet:
        """The recipe's tools and factory, loaded and checked: a tool that runs model-written code is refused where
        the sandbox cannot isolate it (unless `unsafe_no_sandbox`) or where `tool_timeout_s` would cut it first."""
        tools = load_tools(tool_paths, tool_timeout_s=tool_timeout_s, unsafe_no_sandbox=unsafe_no_sandbox)
        if verifiers_tools:
            from rlpipe.verifiers_env import taskset_tools  # only a recipe that names a verifiers task set imports it

            tools += taskset_tools(verifiers_tools)
        factory = load_object(factory_path, "rollout.environment_factory") if factory_path else None
        toolset = cls(tools, factory)
        toolset.schemas(toolset.new_environment())  # every schema is read now: a bad docstring fails at start-up
        return toolset

    def __bool__(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None

    def new_environment(self) -> Any:
        if self.environment_factory is None:
            return None
        environment = self.environment_factory()
        if not callable(getattr(environment, "reset", None)):
            raise ToolConfigError("rollout.environment_factory: its instances must define reset(**row), as TRL's do")
        return environment

    def episode_tools(self, environment: Any) -> list[Callable]:
        return self.tools + (environment_tools(environment) if environment is not None else [])

    def schemas(self, environment: Any) -> list[dict]:
        return tool_schemas(self.episode_tools(environment))


# ---------------------------------------------------------------------------------------------- chat template


def render_conversation(tokenizer, messages: list[dict], schemas: list[dict], **template_kwargs) -> list[int]:
    """Token ids of a conversation's prompt with its tools: rendered by the chat template with `tools=`; a template
    that ignores tools gets them in its system message (TOOLS_SYSTEM_BLOCK), so the model is told of them."""

    def render(conversation, **extra) -> str:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **template_kwargs, **extra
        )

    text = render(messages, tools=schemas)
    if schemas and text == render(messages):
        block = TOOLS_SYSTEM_BLOCK.format(tools="\n".join(json.dumps(s) for s in schemas))
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": block}, *messages]
        text = render(messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_suffix_ids(tokenizer, tool_messages: list[dict], **template_kwargs) -> list[int]:
    """The ids that follow a finished assistant turn when `tool_messages` answer it, up to the next assistant
    header: TRL's `_get_tool_suffix_ids` (a minimal conversation rendered with and without the tool messages, the
    shorter cut after its last end-of-sequence token, the difference taken)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]

    def ids(conversation, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix, full = ids(dummy, False), ids(dummy + tool_messages, True)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders a tool message by changing what came before it")
    return full[len(prefix) :]


def parse_tool_calls(text: str) -> dict:
    """An assistant turn as TRL's `parse_response` gives it: {"role": "assistant", "content": ..., "tool_calls":
    [{"type": "function", "function": {"name", "arguments"}}]} when the text holds Qwen-style tool calls. A malformed
    call makes the whole turn plain text, as TRL's fallback does."""
    found = TOOL_CALL.findall(text)
    if not found:
        return {"role": "assistant", "content": text}
    calls = []
    for body in found:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return {"role": "assistant", "content": text}
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return {"role": "assistant", "content": text}
        arguments = call.get("arguments")
        if arguments is None:
            arguments = {}
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    content = text[: text.index("<tool_call>")].strip()
    return {"role": "assistant", "content": content, "tool_calls": calls}


# ---------------------------------------------------------------------------------------------- tool calls


def _invoke(tool: Callable, arguments: Any) -> Any:
    if not isinstance(arguments, dict):
        raise TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    result = tool(**arguments)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable):
    return await awaitable


@dataclass
class ToolCall:
    episode: int
    name: str
    arguments: Any
    tool: Callable | None


MAX_RUNNING_TOOL_CALLS = 8  # tool calls running at once in one engine's process
MAX_STUCK_TOOL_CALLS = 8  # calls past their time limit whose threads still run; with this many, calls are refused


class ToolThreads:
    """The threads tool calls run on: one per call, at most `max_running` running at once. A call past its time
    limit is answered with an error and its thread written off, since Python cannot stop it: it no longer takes a
    running place, so later calls go on, but it counts as stuck until it returns. While `max_stuck` calls are stuck,
    new calls are answered with an error at once, not started: stuck threads share the engine's process (a spinning
    one takes its share of the interpreter from the engine), and an engine that keeps starting them slows unseen.
    The threads are daemons: a stuck one does not hold the process at exit."""

    def __init__(self, max_running: int = MAX_RUNNING_TOOL_CALLS, max_stuck: int = MAX_STUCK_TOOL_CALLS):
        self.max_running, self.max_stuck = max_running, max_stuck
        self._lock = threading.Lock()
        self._stuck: dict[concurrent.futures.Future, str] = {}  # a written-off call's future: its tool's name

    def start(self, call: ToolCall) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(_invoke(call.tool, call.arguments))
            except BaseException as err:  # noqa: BLE001 - a tool's sys.exit too is its failure, never the engine's
                future.set_exception(err)

        threading.Thread(target=work, name=f"rlpipe-tool-{call.name}", daemon=True).start()
        return future

    def stuck(self) -> list[str]:
        """The tools whose written-off calls still run, one name per call."""
        with self._lock:
            for future in [future for future in self._stuck if future.done()]:
                del self._stuck[future]
            return sorted(self._stuck.values())

    def write_off(self, future: concurrent.futures.Future, name: str, timeout_s: float) -> None:
        with self._lock:
            self._stuck[future] = name
        stuck = self.stuck()
        logger.warning(
            "rlpipe: tool %s did not answer within %g s; its thread runs on (%d of %d stuck calls before tools are "
            "refused: %s)", name, timeout_s, len(stuck), self.max_stuck, ", ".join(stuck),
        )

    def refusal(self, name: str) -> str | None:
        """Why a call to `name` is not started now, or None."""
        stuck = self.stuck()
        if len(stuck) < self.max_stuck:
            return None
        return (
            f"Tool {name} not run: {len(stuck)} earlier tool calls are still running past their time limit "
            f"({', '.join(sorted(set(stuck)))})."
        )


TOOL_THREADS = ToolThreads()  # one per process: stuck threads are the process's, whichever episodes started them


def run_tool_calls(
    calls: list[ToolCall], timeout_s: float, threads: ToolThreads = TOOL_THREADS
) -> list[tuple[Any, bool]]:
    """Each call's result and whether it failed. The calls run at once, at most `threads.max_running` together; a
    call that raises, names no tool, is not done within `timeout_s` of its start, or is refused while too many
    earlier calls are stuck (ToolThreads) gives {"error": ...}. Nothing here waits for a call past its time limit.
    Tools that run model-written code belong in the sandbox (`python`), which stops them itself."""
    results: list[tuple[Any, bool] | None] = [None] * len(calls)
    waiting: deque[int] = deque()
    for index, call in enumerate(calls):
        if call.tool is None:
            results[index] = ({"error": f"Tool {call.name} not found."}, True)
        else:
            waiting.append(index)
    running: dict[concurrent.futures.Future, tuple[int, float]] = {}  # a call's future: its index and deadline
    refused_warned = False
    while waiting or running:
        while waiting and len(running) < threads.max_running:
            index = waiting.popleft()
            refused = threads.refusal(calls[index].name)
            if refused is not None:
                if not refused_warned:
                    logger.warning("rlpipe: %s Answering the model with an error until they return.", refused)
                    refused_warned = True
                results[index] = ({"error": refused}, True)
                continue
            running[threads.start(calls[index])] = (index, time.monotonic() + timeout_s)
        if not running:
            break
        first_deadline = min(deadline for _, deadline in running.values())
        concurrent.futures.wait(
            running, timeout=max(0.0, first_deadline - time.monotonic()), return_when=concurrent.futures.FIRST_COMPLETED
        )
        now = time.monotonic()
        for future, (index, deadline) in list(running.items()):
            name = calls[index].name
            if future.done():
                del running[future]
                error = future.exception()
                # The tool's own failure, shown to the model as TRL does.
                results[index] = ({"error": str(error)}, True) if error is not None else (future.result(), False)
            elif deadline <= now:
                del running[future]
                threads.write_off(future, name, timeout_s)
                results[index] = ({"error": f"Tool {name} did not answer within {timeout_s:g} s."}, True)
    return results


# ---------------------------------------------------------------------------------------------- episodes


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
) -> list[Episode]:
    """Play `episodes` to their end. `sample_turn(requests)` samples one turn per (context ids, max tokens) request,
    all of them submitted together. An episode ends when the model's turn calls no tool, is cut at max_tokens,
    reaches max_turns, or when the context would not fit its next turn (those three end with finish_reason
    "length": the episode was cut, not finished)."""
    template_kwargs = template_kwargs or {}
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
        results = run_tool_calls(calls, limits.tool_timeout_s)
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


_STOP_MARGIN_S = 3.0  # past the sandbox's wall limit: killing the program and collecting what it wrote


def sandboxed_tools(tools: list[Callable], tool_timeout_s: float | None, unsafe_no_sandbox: bool) -> list[Callable]:
    """`tools` checked for those that run model-written code (they carry `sandbox_limits`, as `python` does): where
    the sandbox cannot isolate programs here they are refused; with `unsafe_no_sandbox` they run without it,
    with a warning, as the code rewards do with theirs; a `tool_timeout_s` that would end a call before the sandbox
    stops its program is refused."""
    checked = []
    for tool in tools:
        limits = getattr(tool, "sandbox_limits", None)
        if limits is None:
            checked.append(tool)
            continue
        name = tool.__name__
        if tool_timeout_s is not None and limits.wall_s + _STOP_MARGIN_S > tool_timeout_s:
            raise ToolConfigError(
                f"rollout.tool_timeout_s: {tool_timeout_s:g} s would end a call to {name} before its sandbox stops "
                f"the program ({limits.wall_s:g} s wall limit + {_STOP_MARGIN_S:g} s); set it to at least "
                f"{limits.wall_s + _STOP_MARGIN_S:g}"
            )
        if unsafe_no_sandbox:
            logger.warning(
                "rlpipe: tool %s runs model-written programs WITHOUT the sandbox (rollout.unsafe_no_sandbox): they can "
                "read and write this machine's files, reach the network and outlive the call. Only for code you "
                "would run yourself.", name,
            )
            checked.append(tool.without_sandbox())
            continue
        problem = sandbox.missing_isolation() if tool.isolated else "it was built without the sandbox"
        if problem:
            raise ToolConfigError(
                f"rollout.tools: {name} runs model-written code, and {problem}; set rollout.unsafe_no_sandbox=true "
                f"to run it without (unsafe)"
            )
        checked.append(tool)
    return checked
