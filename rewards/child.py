"""The process reward functions run in: one persistent child of each reward worker, killed and started again when a
call overruns its time limit.

A thread cannot stop a function stuck in C (sympy computing `9^(9^(9^9))` never returns to the interpreter, so
neither a signal nor a timeout thread reaches it); killing its process can. The worker keeps this child for all
its calls, so a call costs a round trip through two pipes, not a process start.

Protocol: the parent writes length-prefixed pickles to the child's request pipe and reads one reply per request
from its reply pipe (file descriptors named on the child's command line; its stdout and stderr stay the worker's,
for whatever the functions print). The first request is the list of function names to load; the child answers
it when they are loaded. Then each request is `(name, kwargs)` and its reply `("value", result, logged)` or
`("error", "Type: message", traceback)`; `logged` holds what the call passed to TRL's `log_extra` and `log_metric`
(`Logged`), which the child gives every function that takes them.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import logging.config
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import weakref
from typing import Any, NamedTuple

from rlpipe.usercode.callables import describe_error, load_reward, shown_name
from rlpipe.rewards.contract import LOG_CALLBACKS

_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1
_LAUNCH = "import sys; from rlpipe.rewards.child import serve; serve(*map(int, sys.argv[1:4]))"


class Logged(NamedTuple):
    """What one call logged: `extra` columns (each the values given, in order) and `metrics` (each the numbers given)."""

    extra: dict[str, list]
    metrics: dict[str, list]


class CallFailed(Exception):
    """A call that did not come back: it overran its time limit, or the child died. The message says which."""


class CallTimedOut(CallFailed):
    """A call that overran its time limit (the child was killed): what it was given cost that much, where a CallFailed
    of another kind is the function's or the process's own failure."""


class ChildProcess:
    """The parent's side: start the child, call a function in it within a time limit, kill it when it overruns.

    `names` are the import paths (or built-in names) of the functions the child loads, once, when it starts.
    """

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.starts = 0
        """How many times a child was started (the first start, then one after each kill)."""
        self._process: subprocess.Popen | None = None
        self._requests = self._replies = -1
        self._ready = False
        self._load_error: str | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the child if none runs; it loads the functions while the caller goes on."""
        if self._process is not None:
            return
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        # The child imports as the parent does: the same sys.path, whatever PYTHONPATH or a test runner put there.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        try:
            self._process = subprocess.Popen(
                # -P: nothing of the working directory's (a math.py) goes before the path handed over.
                [sys.executable, "-P", "-c", _LAUNCH, str(request_read), str(reply_write), str(os.getpid())],
                stdin=subprocess.DEVNULL, pass_fds=(request_read, reply_write), env=env, start_new_session=True,
            )
        finally:
            os.close(request_read)
            os.close(reply_write)
        os.set_blocking(request_write, False)
        os.set_blocking(reply_read, False)
        self._requests, self._replies = request_write, reply_read
        self._ready, self._load_error = False, None
        self.starts += 1
        self._finalizer = weakref.finalize(self, _stop, self._process, request_write, reply_read)
        _write_message(self._requests, pickle.dumps(self.names), deadline=time.monotonic() + 60)

    def call(self, name: str, kwargs: dict[str, Any], timeout_s: float, start_deadline: float) -> tuple[Any, Logged]:
        """`name(**kwargs)` in the child: its value and what it logged, or the exception it raised as
        `CallFailed("Type: message")` with the traceback's text as `details`. Raises CallTimedOut after `timeout_s`
        (the child is then killed), CallFailed when the child dies. A child still starting may take until
        `start_deadline` (time.monotonic()) to load the functions before the call's own `timeout_s` begins."""
        self.ready(start_deadline)
        # A child that took long to start leaves the call only what remains of the caller's own deadline.
        deadline = min(time.monotonic() + timeout_s, start_deadline)
        try:
            _write_message(self._requests, _dumps((name, kwargs)), deadline)
            reply = pickle.loads(_read_message(self._replies, deadline))
        except TimeoutError:
            self.kill()
            raise CallTimedOut(f"timed out after {timeout_s:.3g}s") from None
        except (OSError, EOFError) as err:
            raise self._died(err) from None
        if reply[0] == "value":
            return reply[1], Logged(*reply[2])
        failure = CallFailed(reply[1])
        failure.details = reply[2]
        raise failure

    def ready(self, start_deadline: float) -> None:
        """Start the child if none runs and wait until it has loaded the functions, until `start_deadline`
        (time.monotonic()); raises CallFailed when it cannot load them, or not in time."""
        self.start()
        if not self._ready:
            self._await_ready(start_deadline)
        if self._load_error is not None:
            raise CallFailed(self._load_error)

    def kill(self) -> None:
        """End the child and everything in its process group now; the next call starts a new one."""
        if self._finalizer is not None:
            self._finalizer()
        self._process, self._finalizer, self._ready = None, None, False

    close = kill

    def _await_ready(self, start_deadline: float) -> None:
        try:
            reply = pickle.loads(_read_message(self._replies, start_deadline))
        except TimeoutError:
            self.kill()
            raise CallFailed("the reward process did not load the functions in time") from None
        except (OSError, EOFError) as err:
            raise self._died(err) from None
        self._ready, self._load_error = True, reply

    def _died(self, err: BaseException) -> CallFailed:
        process = self._process
        code = None if process is None else process.poll()
        if process is not None and code is None:
            time.sleep(0.05)  # the pipe closes a moment before the exit status is there
            code = process.poll()
        self.kill()
        if code is None:
            how = "closed its pipes"
        else:
            how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
        cause = "" if isinstance(err, EOFError) else f" ({describe_error(err)})"
        return CallFailed(f"the reward process {how} during the call{cause}")


def _stop(process: subprocess.Popen, *fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _dumps(request) -> bytes:
    """A request for the child: by cloudpickle where installed (an episode's environment may be an instance of a
    class the user's script passed by value, which plain pickle names by a module the child cannot import); the
    child reads either with pickle."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(request)
    return cloudpickle.dumps(request)


def _write_message(fd: int, payload: bytes, deadline: float) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        _wait(fd, deadline, for_writing=True)
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue


def _read_message(fd: int, deadline: float) -> bytes:
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return _read_exactly(fd, size, deadline)


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        _wait(fd, deadline, for_writing=False)
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError("the reward process closed its reply pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, deadline: float, for_writing: bool) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    readable, writable, _ = select.select([] if for_writing else [fd], [fd] if for_writing else [], [], left)
    if not readable and not writable:
        raise TimeoutError


# ------------------------------------------------------------------------------------------------- the child


def serve(request_fd: int, reply_fd: int, parent_pid: int) -> None:
    """The child's loop: load the functions, then answer calls until the parent closes the request pipe."""
    _die_with_parent(parent_pid)
    # A function's records go where the worker's do (its logging configuration, handed down), else its warnings and
    # errors to the worker's stderr.
    inherited = os.environ.get("RLPIPE_LOGGING_CONFIG")
    if inherited:
        logging.config.dictConfig(json.loads(inherited))
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    for fd in (request_fd, reply_fd):  # a reward function's own subprocesses do not inherit the pipes
        os.set_inheritable(fd, False)
    requests, replies = os.fdopen(request_fd, "rb"), os.fdopen(reply_fd, "wb")
    names = pickle.loads(_receive(requests))
    functions, load_error = {}, None
    for name in names:
        try:
            functions[name] = load_reward(name)
        except Exception as err:
            load_error = load_error or f"{shown_name(name)}: {describe_error(err)}"
    callbacks = {name: _log_callbacks_taken(function) for name, function in functions.items()}
    _send(replies, pickle.dumps(load_error))
    while True:
        try:
            name, kwargs = pickle.loads(_receive(requests))
        except EOFError:
            return
        logged = Logged({}, {})
        given = {"log_extra": _log_extra(logged), "log_metric": _log_metric(logged)}
        kwargs = {**kwargs, **{callback: given[callback] for callback in callbacks.get(name, ())}}
        try:
            reply = ("value", _call(functions[name], kwargs), tuple(logged))
        # BaseException too: user code may raise SystemExit or KeyboardInterrupt, which must not end the child.
        except BaseException as err:
            reply = ("error", describe_error(err), traceback.format_exc())
        try:
            payload = pickle.dumps(reply)
        except Exception as err:
            payload = pickle.dumps(("error", f"its result cannot be sent back: {describe_error(err)}", ""))
        _send(replies, payload)


def _log_callbacks_taken(function: Any) -> tuple[str, ...]:
    """Which of TRL's `log_extra` and `log_metric` `function` takes: those it names, or both where it takes
    **kwargs (TRL's contract); a function that does neither is called without them."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return LOG_CALLBACKS
    return tuple(p.name for p in parameters if p.name in LOG_CALLBACKS)


def _log_extra(logged: Logged):
    def log_extra(column: str, values: list) -> None:
        """A column of the samples' table: one value per sample of this call, in order."""
        logged.extra.setdefault(str(column), []).extend(values)

    return log_extra


def _log_metric(logged: Logged):
    def log_metric(name: str, value: float) -> None:
        """A number, averaged with the step's other calls into the step's metric `reward/logged/<name>`."""
        logged.metrics.setdefault(str(name), []).append(value)

    return log_metric


def _call(function: Any, kwargs: dict[str, Any]) -> Any:
    value = function(**kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _die_with_parent(parent_pid: int) -> None:
    # The kernel kills the child when the worker goes, even while a function holds the interpreter in C.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed request pipe still ends an idle child
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _receive(stream: Any) -> bytes:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError
    return payload


def _send(stream: Any, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()
