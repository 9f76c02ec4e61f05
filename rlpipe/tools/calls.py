"""Running tool calls with deadlines: each call on a thread of its own, a bounded number at once, a call past its time
limit answered with an error and written off, and new calls refused while too many written-off ones still run. The
threads belong to a `ToolThreads` its owner holds (the engine's episode runner, one per engine); there is no
process-wide pool. It imports nothing of rlpipe."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("rlpipe")

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
    seconds: float = 0.0  # how long it ran, set by run_tool_calls (its time limit for one written off; 0 if not run)


def error_text(error: BaseException) -> str:
    """What the model is shown of a tool's exception: its message, or its type where the message cannot be had (an
    exception's own __str__ may raise)."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - any failure of the tool's own code is the tool's
        return f"{type(error).__name__} (its message could not be read)"


MAX_RUNNING_TOOL_CALLS = 8  # tool calls running at once in one engine's process
MAX_STUCK_TOOL_CALLS = 8  # calls past their time limit whose threads still run; with this many, calls are refused


class ToolThreads:
    """The threads tool calls run on: one per call, at most `max_running` running at once. A call past its time
    limit is answered with an error and its thread written off, since Python cannot stop it: it no longer takes a
    running place, so later calls go on, but it counts as stuck until it returns. While `max_stuck` calls are stuck,
    new calls are answered with an error at once, not started: stuck threads share the engine's process (a spinning
    one takes its share of the interpreter from the engine), and an engine that keeps starting them slows unseen.
    The threads are daemons: a stuck one does not hold the process at exit. An engine's episode runner holds one
    for the engine's life, so its stuck calls count whichever episodes started them."""

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


def run_tool_calls(calls: list[ToolCall], timeout_s: float, threads: ToolThreads) -> list[tuple[Any, bool]]:
    """Each call's result and whether it failed. The calls run at once, at most `threads.max_running` together; a
    call that raises, names no tool, is not done within `timeout_s` of its start, is refused while too many
    earlier calls are stuck (ToolThreads), or gets no thread gives {"error": ...}. Each call's `seconds` is set to how
    long it ran. Nothing here waits for a call past its time limit.
    Tools that run model-written code belong in the sandbox (`python`), which stops them itself."""
    results: list[tuple[Any, bool] | None] = [None] * len(calls)
    waiting: deque[int] = deque()
    for index, call in enumerate(calls):
        if call.tool is None:
            results[index] = ({"error": f"Tool {call.name} not found."}, True)
        else:
            waiting.append(index)
    running: dict[concurrent.futures.Future, tuple[int, float, float]] = {}  # a call's future: index, start, deadline
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
            started = time.monotonic()  # before the thread starts: a call's seconds are never less than it ran
            try:
                future = threads.start(calls[index])
            except RuntimeError as err:  # the process can start no more threads: this call is answered, not run
                results[index] = ({"error": f"Tool {calls[index].name} not run: {error_text(err)}."}, True)
                continue
            running[future] = (index, started, started + timeout_s)
        if not running:
            break
        first_deadline = min(deadline for _, _, deadline in running.values())
        concurrent.futures.wait(
            running, timeout=max(0.0, first_deadline - time.monotonic()), return_when=concurrent.futures.FIRST_COMPLETED
        )
        now = time.monotonic()
        for future, (index, started, deadline) in list(running.items()):
            name = calls[index].name
            if future.done():
                del running[future]
                calls[index].seconds = now - started
                error = future.exception()
                # The tool's own failure, shown to the model as TRL does.
                results[index] = ({"error": error_text(error)}, True) if error is not None else (future.result(), False)
            elif deadline <= now:
                del running[future]
                calls[index].seconds = timeout_s
                threads.write_off(future, name, timeout_s)
                results[index] = ({"error": f"Tool {name} did not answer within {timeout_s:g} s."}, True)
    return results

