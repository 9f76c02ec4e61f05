"""Shared-memory files are trusted only when they are the run's own.

/dev/shm is writable by every local user, and a name in it can be made by anyone who guesses it first. A file another
user made (or one anybody may read or write) that takes the place of a segment or staging file of the run would let
that user read the weights, or change them between their check and their use. So every process that opens an existing
name (a learner rank attaching to a segment another rank created, an engine attaching to the learner's segment, an
engine's worker mapping the engine's staging file) first checks the very file it opened: a regular file, owned by this
process's user, with no permission for group or others, which is how the run creates its own (mode 0600).
"""

from __future__ import annotations

import os
import stat

from rlpipe.weightsync.errors import SyncError

SHM_DIR = "/dev/shm"


def check_own_file(info: os.stat_result, path: str) -> None:
    """Raise SyncError, in one line naming `path`, unless `info` (the file's fstat) is a regular file of this
    process's user that neither group nor others may read or write."""
    uid = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != uid:
        problem = f"belongs to uid {info.st_uid}, not to the run's uid {uid} (made by another user?)"
    elif mode & 0o077:
        problem = f"has mode {mode:04o}: group or others may use it, where the run's own files are 0600"
    else:
        return
    raise SyncError(f"weight sync: shared-memory file {path} {problem}; refusing to use it")
