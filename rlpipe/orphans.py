"""Leftovers of dead processes: entries of a folder named `<prefix><pid>-...` after the process that made them.

A process killed before its own clean-up (SIGKILL, the OOM killer, a reward call past its time limit, `ray.kill`)
leaves its shared-memory segments, work folders, cgroups or adapter folders behind; the next process to make such
entries removes those whose process is gone. This module owns that rule: an entry is an orphan only where its name
starts with the caller's prefix, the part up to the next "-" is a process id, and no process holds that id (one of
another user's counts as alive). Each caller keeps its own prefix and says how one of its entries is removed. It
imports only the standard library, so the sandbox, the weight-sync transports and the LoRA adapter folders all
import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def process_alive(pid: int) -> bool:
    """Whether a process holds `pid` (another user's included). An id too large for any process counts as alive, so
    that what it names is left alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's; no pid at all
        return True
    return True


def orphans(directory: str, prefix: str) -> list[str]:
    """Names in `directory` of the form `<prefix><pid>-...` (or `<prefix><pid>`) whose process `pid` is gone; none
    where `directory` cannot be listed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not process_alive(int(pid)):
            found.append(name)
    return found


def remove_orphans(directory: str, prefix: str, remove: Callable[[str], object]) -> list[str]:
    """Call `remove` on the path of each of `orphans(directory, prefix)`; returns the names it removed. An entry
    `remove` fails on (OSError: in use after all, a reused pid, not ours to remove) is left where it is."""
    removed = []
    for name in orphans(directory, prefix):
        try:
            remove(os.path.join(directory, name))
        except OSError:
            continue
        removed.append(name)
    return removed
