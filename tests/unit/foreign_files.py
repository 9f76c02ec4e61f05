"""Files in shared memory that are not the run's own: made by another user (where this machine lets a test act as
one) or left open to everyone, as a neighbour on the host would make them to read or change the weights."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

NOBODY = 65534
# Acting as another user needs root (to change uid) and util-linux's setpriv.
another_user = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                  reason="acting as another user needs root and setpriv")


def make_as_nobody(paths: list[str], size: int) -> None:
    """Create `paths` as uid/gid 65534 with mode 0666 and `size` zero bytes each, as another local user would."""
    script = 'umask 000 && for path in "$@"; do truncate -s "$SIZE" "$path"; done'
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script, "sh",
                    *paths], env={"SIZE": str(size), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}, check=True)
    for path in paths:
        info = os.stat(path)
        assert (info.st_uid, info.st_mode & 0o777) == (NOBODY, 0o666), path


def make_open_to_all(path: str, size: int) -> None:
    """Create `path` as this user, but with mode 0666."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    try:
        os.fchmod(fd, 0o666)  # whatever the umask
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def untouched(path: str, size: int) -> bool:
    """Whether `path` still holds `size` zero bytes, as it was made."""
    with open(path, "rb") as file:
        return file.read() == bytes(size)
