"""Waiting on actor calls (kept free of the actor classes, so any actor can import it cheaply)."""

from __future__ import annotations

import ray


def get_all(refs: list) -> list:
    """`ray.get` that raises as soon as any task fails.

    When one learner rank dies, the others wait in a collective until its timeout; the dead rank's error is
    the one to report, at once.
    """
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(list(refs))


class WorkerLost(RuntimeError):
    """A role's actor died and could not be replaced; a run restarted from its latest checkpoint may go on
    (`rlpipe train --auto-resume`)."""
