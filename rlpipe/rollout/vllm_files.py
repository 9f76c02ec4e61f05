"""What vLLM leaves in /dev/shm, and how an engine's leftovers are found once it is gone.

vLLM's message queues and its processes' semaphores are files in /dev/shm whose names say nothing of the process that
made them; its own shutdown removes them, a process killed first leaves them. So an engine, once started, records the
names of those that appeared meanwhile in a file of its own (`rlpipe-engine-<pid>`, mode 0600), and the next engine
on the host removes what the records of dead processes name (the rule of rlpipe/orphans.py), touching only the run
user's own files (rlpipe/weightsync/ownership.py).
"""

from __future__ import annotations

import contextlib
import os

from rlpipe.orphans import remove_orphans
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.ownership import SHM_DIR, check_own_file

# vLLM's shared memory: its message queues' segments (Python's SharedMemory names them psm_<hex>) and the named
# semaphores of its processes (multiprocessing's sem.mp-<random>). Neither name says which process made it.
VLLM_FILE_PREFIXES = ("psm_", "sem.mp-")
# The record of one engine's vLLM files, then the engine's process id.
ENGINE_RECORD_PREFIX = "rlpipe-engine-"


def shm_names(directory: str = SHM_DIR) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def _own(path: str) -> bool:
    """Whether `path` is a file of the run's own kind (this user's, 0600), which the engine may remove."""
    try:
        check_own_file(os.lstat(path), path)
    except (OSError, SyncError):
        return False
    return True


def record_engine_files(before: set[str], directory: str = SHM_DIR) -> list[str]:
    """Record the vLLM files that appeared in `directory` since `before` (listed just before the engine started) and
    are this user's, as this process's (`rlpipe-engine-<pid>`, mode 0600); returns their names. A file another engine
    of this user started at the same moment may be among them: removing its name leaves its users' mappings intact."""
    names = sorted(name for name in shm_names(directory) - before
                   if name.startswith(VLLM_FILE_PREFIXES) and _own(os.path.join(directory, name)))
    path = os.path.join(directory, f"{ENGINE_RECORD_PREFIX}{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):  # a dead process's of the same id: its files were swept already
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as record:
        record.write("".join(f"{name}\n" for name in names))
    return names


def remove_engine_files(record: str) -> None:
    """Remove the files `record` (an engine's, see `record_engine_files`) names, then the record. Only the run's own
    are touched: a record, or a file it names, that is not this user's 0600 file is left (OSError)."""
    fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as file:
        try:
            check_own_file(os.fstat(file.fileno()), record)
        except SyncError as err:
            raise PermissionError(str(err)) from None
        names = file.read(1 << 20).split()
    directory = os.path.dirname(record)
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith(VLLM_FILE_PREFIXES) and "/" not in name and _own(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    os.unlink(record)


def sweep_engine_files(directory: str = SHM_DIR) -> list[str]:
    """Remove the vLLM files of this host's engines whose process is gone (killed before their close: with their
    driver, by the OOM killer); returns the records swept."""
    return remove_orphans(directory, ENGINE_RECORD_PREFIX, remove_engine_files)
