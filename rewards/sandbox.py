"""Running model-written code: a separate process that cannot reach the network, the host's files or its parent.

Layers, each of which alone stops the common attacks, so that one gap is not a hole:
- **Process**: a fresh interpreter (`python -I`: no user site, no PYTHON* variables) in a new session, with an
  empty environment, a fresh temporary working directory (deleted afterwards), and resource limits: CPU time,
  address space, file size, no core files, and (for non-root users) a process count.
- **Network namespace**: the child unshares its network namespace (as root, or in a user namespace where the
  kernel allows it): it sees only a loopback device that is down.
- **Audit hook** (`sys.addaudithook`, installed before the code runs and impossible to remove from Python): refuses
  sockets, process creation (fork, exec, subprocess, posix_spawn), signals to any process but itself, writes and
  deletions outside the working directory, reads under /proc other than /proc/self, and ctypes (the way around
  the other checks).
- **Wall time**: the whole process group is killed when the time is up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    processes: int = 32  # enforced by the kernel only for non-root users; the audit hook refuses new processes anyway
    output_kb: int = 64


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the wall-time limit
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs inside the sandbox before the user's code; kept free of imports beyond the standard library.
_BOOT = r'''
import ctypes, json, os, resource, sys

# Confinement first, in this process before any user code (not in a preexec_fn, which may deadlock a threaded
# parent between fork and exec).
_limits = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_CPU, (_limits["cpu_s"], _limits["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (_limits["memory_mb"] * 2**20,) * 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (_limits["file_mb"] * 2**20,) * 2)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.getuid() != 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (_limits["processes"],) * 2)
_libc = ctypes.CDLL(None, use_errno=True)
if _libc.unshare(0x40000000) != 0:  # CLONE_NEWNET (as root), else inside a new user namespace where allowed
    _libc.unshare(0x10000000 | 0x40000000)
del _libc

_root = os.path.realpath(os.getcwd())
_self = os.getpid()
_NO_PROCESSES = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
                 "pty.spawn", "os.startfile"}
_NO_NETWORK = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.__new__"}
_PATH_CHANGES = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                 "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.chdir"}

def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except Exception:
        return False
    return real == _root or real.startswith(_root + os.sep)

def _hook(event, args):
    if event in _NO_PROCESSES or event in _NO_NETWORK or event.startswith("ctypes."):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in ("os.kill", "os.killpg", "signal.pthread_kill") and not (event == "os.kill" and args[0] == _self):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in _PATH_CHANGES and args and not isinstance(args[0], int) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the working directory")
    if event == "open" and args and not isinstance(args[0], int):
        path, mode, flags = args[0], args[1] or "r", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)
        real = os.path.realpath(os.fsdecode(path))
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing {real} outside the working directory")
        if real.startswith("/proc/") and not real.startswith(f"/proc/{_self}/") and not real.startswith("/proc/self/"):
            raise PermissionError(f"sandbox: reading {real}")

sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]  # the code sees a plain script invocation
with open("main.py") as _file:
    _code = compile(_file.read(), "main.py", "exec")
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


def run(code: str, limits: Limits = Limits(), stdin: str = "") -> Outcome:
    """Run `code` as a Python script under the sandbox; never raises for what the code does."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-sandbox-") as workdir:
        Path(workdir, "main.py").write_text(code)
        Path(workdir, "_boot.py").write_text(_BOOT)
        process = subprocess.Popen(
            [sys.executable, "-I", "_boot.py", json.dumps(asdict(limits))],
            cwd=workdir,
            env={},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: killed as one, and kill(0, ...) never reaches us
        )
        try:
            stdout, stderr = process.communicate(stdin.encode(), timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
            timed_out = True
        cap = limits.output_kb * 1024
        return Outcome(
            None if timed_out else process.returncode,
            stdout[:cap].decode(errors="replace"),
            stderr[-cap:].decode(errors="replace"),
            timed_out,
        )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass


def network_isolated() -> bool:
    """Whether sandboxed code gets a network namespace of its own on this machine (else only the hook guards)."""
    probe = "print(sorted(line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]))"
    outcome = run(probe, Limits(wall_s=30))
    return outcome.passed and outcome.stdout.strip() == "['lo']"
