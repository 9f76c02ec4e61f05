"""Waiting on actor calls (kept free of the actor classes, so any actor can import it cheaply).

Every wait has a deadline: an actor that neither answers nor dies (a hung library call, a lost child process) ends
the wait with `CallTimeout`, naming the role and the call, instead of holding the run forever.
"""

from __future__ import annotations

import time

import ray

from rlpipe.config import error_line


class WorkerLost(RuntimeError):
    """A role's actor died and could not be replaced; a run restarted from its latest checkpoint may go on
    (`rlpipe train --auto-resume`)."""


class CallTimeout(WorkerLost):
    """A call to a role's actor passed its deadline: the actor is taken as lost (`--auto-resume` applies)."""

    def __init__(self, role: str, call: str, timeout_s: float, setting: str):
        super().__init__(f"{role} did not answer {call} within {timeout_s:g} s ({setting})")
        self.role, self.call, self.timeout_s, self.setting = role, call, timeout_s, setting

    def __reduce__(self):  # raised inside an actor too: Ray pickles it
        return CallTimeout, (self.role, self.call, self.timeout_s, self.setting)


def get_all(refs: list, timeout_s: float | None = None, role: str = "an actor", call: str = "a call",
            setting: str = "the call's deadline", arrivals: dict | None = None) -> list:
    """`ray.get` that raises as soon as any task fails, and `CallTimeout` (naming `role`, `call` and the `setting`
    the deadline comes from) when they have not all finished within `timeout_s` (None: no deadline). `arrivals`,
    where given, gets the `time.monotonic()` at which each ref was seen finished.

    When one learner rank dies, the others wait in a collective until its timeout; the dead rank's error is
    the one to report, at once.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise CallTimeout(role, call, timeout_s, setting)
        if arrivals is not None:
            arrivals[ready[0]] = time.monotonic()
        ray.get(ready)
    return ray.get(list(refs))


def settle(refs: list, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for calls whose results no longer matter and drop their errors: a call left
    unwaited that later fails is reported by Ray on the terminal as an unhandled error, after the real one."""
    if not refs:
        return
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001 - the failure that matters was raised already
            pass


def backoff_s(retry: int, first_s: float, max_s: float) -> float:
    """The wait before retry number `retry` (1 for the first): `first_s`, doubling with each retry, at most `max_s`.
    A cause that clears within seconds (a busy host, a slow disk) gets them; one that does not is not hammered."""
    return min(first_s * 2.0 ** (retry - 1), max_s)


def reason(err: BaseException) -> str:
    """One line saying why a call failed (`error_line`): for an error raised inside an actor, that error's own rather
    than Ray's header naming the task."""
    cause = getattr(err, "cause", None)
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return error_line(cause)
    return error_line(err)
