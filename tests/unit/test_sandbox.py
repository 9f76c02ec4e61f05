"""Model-written code in the sandbox: each attack is checked from the host side, where it would have done harm.

Every attack program starts with UNHOOK, which switches off the former sandbox's audit hook (its block-lists lived in
the sandboxed interpreter); it does nothing now, and shows that these tests fail against a Python-level sandbox.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlpipe.usercode import sandbox
from rlpipe.usercode.sandbox import Limits, SandboxUnavailable, run

FAST = Limits(cpu_s=2, wall_s=5, memory_mb=256, file_mb=4, scratch_mb=8, processes=16)
MARGIN_S = 3  # the wall limit plus this bounds every call

UNHOOK = """
import sys
_boot = sys.modules["__main__"]
if hasattr(_boot, "_NO_PROCESSES"):
    for _name in ("_NO_PROCESSES", "_NO_NETWORK", "_PATH_CHANGES"):
        getattr(_boot, _name).clear()
    _boot._inside = lambda path: True
    _boot._self = {pid}
"""


def attack(code: str, pid: int = 0, limits: Limits = FAST) -> sandbox.Outcome:
    started = time.monotonic()
    outcome = run(UNHOOK.format(pid=pid) + code, limits)
    assert time.monotonic() - started < limits.wall_s + MARGIN_S
    return outcome


@pytest.fixture(autouse=True)
def _isolation_here():
    if sandbox.missing_isolation():
        pytest.fail(sandbox.missing_isolation())  # this machine is where the sandbox is tested: no skipping


def test_ordinary_code_runs_with_its_files_and_a_scratch_folder():
    outcome = run(
        "import os\nopen('out.txt', 'w').write('ok')\nprint(os.getcwd(), open('/sandbox/data.txt').read(), "
        "os.listdir('.'), sorted(os.environ))\nos.write(3, b'report')",
        FAST,
        files={"data.txt": "given"},
    )
    assert outcome.passed, outcome.stderr
    cwd, data, listing, environment = outcome.stdout.split(" ", 3)
    assert (cwd, data, listing) == ("/tmp", "given", "['out.txt']")
    # Empty but for what bwrap (PWD) and Python's C-locale coercion (LC_CTYPE) set.
    assert set(ast.literal_eval(environment)) <= {"PWD", "LC_CTYPE"}
    assert outcome.report == b"report"


def test_host_files_are_out_of_sight(tmp_path):
    (tmp_path / "secret.txt").write_text("host-secret")
    paths = [str(tmp_path / "secret.txt"), __file__, "/root", "/etc/passwd", "/work"]
    outcome = attack(
        "import os\nfor path in " + repr(paths) + ":\n"
        "    try:\n        print(path, open(path).read() if os.path.isfile(path) else os.listdir(path))\n"
        "    except OSError as error:\n        print(path, type(error).__name__)\n"
    )
    assert outcome.passed, outcome.stderr
    assert "host-secret" not in outcome.stdout and "UNHOOK" not in outcome.stdout
    shown = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in outcome.stdout.splitlines()}
    assert all(shown[path] == "FileNotFoundError" for path in paths if path != "/root")
    assert shown["/root"] in ("FileNotFoundError", "['.pyenv']")  # at most the interpreter, where it lives there


def test_writes_stay_in_the_scratch_folder(tmp_path):
    targets = [str(tmp_path / "escaped.txt"), "/sandbox/x", "/usr/lib/x", "/x", "/dev/shm/x", "/proc/sys/kernel/x"]
    outcome = attack(
        "written = []\nfor path in " + repr(targets) + ":\n"
        "    try:\n        open(path, 'w').write('x')\n        written.append(path)\n"
        "    except OSError:\n        pass\nprint(written)\n"
    )
    assert outcome.stdout.strip() == "[]", outcome
    assert not (tmp_path / "escaped.txt").exists()


def test_a_host_process_cannot_be_killed():
    victim = subprocess.Popen(["sleep", "30"])
    try:
        attack(
            f"import os, signal, subprocess\n"
            f"for kill in (lambda: os.kill({victim.pid}, 9), lambda: subprocess.run(['kill', '-9', '{victim.pid}']),\n"
            f"             lambda: signal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)):\n"
            f"    try:\n        kill()\n    except Exception as error:\n        print(error)\n",
            pid=victim.pid,
        )
        time.sleep(0.2)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_the_hosts_environment_and_processes_are_out_of_sight(monkeypatch):
    monkeypatch.setenv("RLPIPE_SANDBOX_CANARY", "secret-value")  # a child of this process would inherit it
    child = subprocess.Popen(["sleep", "30"])
    try:
        outcome = attack(
            "import os\nprint(sorted(name for name in os.listdir('/proc') if name.isdigit()))\n"
            f"for pid in ('1', '{os.getpid()}', '{child.pid}'):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
            "    except OSError as error:\n        print(type(error).__name__)\n",
            pid=child.pid,
        )
    finally:
        child.kill()
        child.wait()
    assert outcome.passed, outcome.stderr
    assert "secret-value" not in outcome.stdout
    assert outcome.stdout.splitlines()[0] == "['1', '2']"  # bwrap's init and the program: nothing else


def test_no_network_not_even_the_hosts_loopback():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        host_network = f"/proc/{os.getpid()}/ns/net"  # this test's: the host's network namespace
        outcome = attack(
            "import ctypes, os, subprocess, sys\n"
            "for enter in (  # the host's network namespace: by nsenter, then by setns itself\n"
            f"    lambda: subprocess.run(['nsenter', '--net={host_network}', sys.executable, '-c', {connect!r}]),\n"
            f"    lambda: ctypes.CDLL(None).setns(os.open('{host_network}', os.O_RDONLY), 0x40000000),\n"
            "):\n"
            "    try:\n        enter()\n    except Exception as error:\n        print(error)\n"
            + connect + "\n"
        )
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert "connected" not in outcome.stdout and not outcome.passed


def test_no_shell_and_no_programs_but_python():
    outcome = attack(
        "import os, subprocess\n"
        "for command in (['/bin/sh', '-c', 'echo escaped'], ['sh', '-c', 'echo escaped'], ['ls', '/']):\n"
        "    try:\n        subprocess.run(command)\n    except OSError as error:\n        print(type(error).__name__)\n"
        "print(os.system('echo escaped'))\n"
    )
    assert "escaped" not in outcome.stdout
    assert outcome.stdout.split()[:3] == ["FileNotFoundError"] * 3


def test_the_kernels_risky_calls_are_refused():
    outcome = attack(
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, call in (('ptrace', lambda: libc.ptrace(16, 1, 0, 0)), ('unshare', lambda: libc.unshare(0x10000000)),\n"
        "                   ('mount', lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))):\n"
        "    print(name, call(), errno.errorcode[ctypes.get_errno()])\n"
    )
    assert outcome.stdout.splitlines() == ["ptrace -1 EPERM", "unshare -1 EPERM", "mount -1 EPERM"], outcome


def test_a_thousand_forks_stop_at_the_process_limit():
    outcome = attack(
        "import os, time\nstarted = 0\nfor _ in range(1000):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    started += 1\nprint(started)\n"
    )
    assert outcome.passed, outcome.stderr
    assert int(outcome.stdout) < FAST.processes


def test_a_gigabyte_of_files_stops_at_the_scratch_cap():
    outcome = attack(
        "import os\nwritten = 0\nchunk = b'x' * 2**20\n"
        "for index in range(1024):\n    try:\n        with open(f'f{index}', 'wb') as file:\n"
        "            for _ in range(2):\n                file.write(chunk)\n                file.flush()\n"
        "                written += 1\n    except OSError:\n        break\nprint(written)\n"
        "try:\n    open('big', 'wb').write(b'x' * 2**30)\nexcept (OSError, MemoryError) as error:\n"
        "    print(type(error).__name__)\n"
    )
    lines = outcome.stdout.split()
    assert int(lines[0]) <= FAST.scratch_mb, outcome
    assert lines[1] in ("OSError", "MemoryError")


def test_flooding_output_costs_the_caller_no_more_than_the_cap():
    # In a fresh interpreter, so that its peak memory is this call's alone: VmHWM, which a new program starts
    # afresh (ru_maxrss would keep the forking pytest worker's). 256 MiB on each of stdout and stderr.
    script = (
        "from rlpipe.usercode.sandbox import Limits, run\n"
        "outcome = run('import os\\nchunk = b\"x\" * 2**20\\nfor _ in range(256):\\n    os.write(1, chunk)\\n"
        "    os.write(2, chunk)', Limits(wall_s=60))\n"
        "peak_kb = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "print(len(outcome.stdout), len(outcome.stderr), outcome.returncode, peak_kb // 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 0, result.stderr
    stdout_kept, stderr_kept, returncode, peak_mb = result.stdout.split()
    assert (stdout_kept, stderr_kept, returncode) == (str(64 * 1024), str(64 * 1024), "0"), result.stdout
    assert int(peak_mb) < 150  # where all of it was kept, 512 MiB or more


@pytest.mark.parametrize("ends", ["exits", "runs past the wall limit"])
def test_nothing_it_started_outlives_the_call(ends):
    token = uuid.uuid4().hex
    outcome = attack(
        "import os, sys, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        + ("while True:\n    pass\n" if ends != "exits" else ""),
        limits=Limits(cpu_s=5, wall_s=2),
    )
    assert outcome.timed_out == (ends != "exits")
    time.sleep(0.2)
    survivors = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, token)]
    assert survivors == []


def _cmdline_has(pid: str, token: str) -> bool:
    try:
        return token.encode() in Path("/proc", pid, "cmdline").read_bytes()
    except OSError:
        return False


def test_an_endless_program_is_stopped_at_the_wall_limit():
    outcome = attack("while True:\n    pass", limits=Limits(cpu_s=30, wall_s=1))
    assert outcome.timed_out and outcome.returncode is None


def test_without_isolation_code_is_refused_with_what_is_missing(monkeypatch):
    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: "/nonexistent/bwrap")
    sandbox._check_isolation.cache_clear()
    try:
        problem = sandbox.missing_isolation()
        assert problem.startswith("code sandbox unavailable:") and "bwrap" in problem
        with pytest.raises(SandboxUnavailable, match="bwrap"):
            run("print(1)", FAST)
        assert run("print(1)", FAST, isolated=False).stdout == "1\n"  # the explicit opt-out
    finally:
        sandbox._check_isolation.cache_clear()


def test_the_probe_shows_every_layer():
    python, problem = sandbox._check_isolation()
    assert problem is None
    outcome = sandbox._run(sandbox._ISOLATION_CHECK, FAST, "", {}, python)
    seen = json.loads(outcome.stdout)
    assert seen["uid"] == sandbox.SANDBOX_UID and seen["pid"] == 2 and seen["seccomp"] == 2
    assert seen["network"] == ["lo"] and not seen["sysctl writable"]
    assert seen["bounding capabilities"] == 0 and seen["scratch inodes"] == [f"nr_inodes={Limits().scratch_files}"]
    assert seen["init seccomp"] == 2  # bwrap's init: a program can write into its memory (same uid, dumpable)


def test_memory_no_rlimit_counts_is_refused():
    # memfd, SysV shared memory, message queues and semaphores, socket buffers: kernel memory outside the address
    # space and /tmp; a program once held 960 MiB in memfds with a 509 MiB limit.
    outcome = attack(
        "import ctypes, errno, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(name, call):\n    try:\n        result = call()\n"
        "        print(name, result, errno.errorcode.get(ctypes.get_errno()) if result == -1 else 'made')\n"
        "    except OSError as error:\n        print(name, -1, errno.errorcode[error.errno])\n"
        "attempt('memfd', lambda: os.memfd_create('hog'))\n"
        "attempt('shmget', lambda: libc.shmget(0, 2**27, 0o1600))\n"
        "attempt('msgget', lambda: libc.msgget(0, 0o1600))\n"
        "attempt('semget', lambda: libc.semget(0, 1, 0o1600))\n"
        "attempt('socketpair', lambda: socket.socketpair())\n"
        "attempt('socket', lambda: socket.socket())\n"
    )
    refused = [f"{name} -1 EPERM" for name in ("memfd", "shmget", "msgget", "semget", "socketpair", "socket")]
    assert outcome.stdout.splitlines() == refused, outcome


def _whole_sandbox_bound():
    parents, problem = sandbox._cgroup_parents()
    if parents is None:
        pytest.fail(f"no cgroup per call here ({problem}); as root on this machine there is one")


def test_memory_is_bounded_for_the_sandbox_as_a_whole():
    # Four processes of 120 MiB each, every one within its own address-space limit: together past memory_mb. Each
    # holds its memory for 6 s, so that all four overlap even on a loaded machine (where, holding it 3 s, the first
    # had once exited before the last allocated).
    _whole_sandbox_bound()
    outcome = attack(
        "import os, time\nfor index in range(4):\n    if os.fork() == 0:\n"
        "        hog = bytearray(120 * 2**20)\n        print('allocated', index, flush=True)\n"
        "        time.sleep(6)\n        os._exit(0)\n"
        "finished = sum(os.waitstatus_to_exitcode(os.wait()[1]) == 0 for _ in range(4))\nprint('finished', finished)\n",
        limits=Limits(cpu_s=5, wall_s=12, memory_mb=256, processes=16),
    )
    # At most two of them fit at once; which are killed is the kernel's choice (one that already allocated and said
    # so, at times), so what is counted is how many finished, not how many allocated.
    finished = [int(line.split()[1]) for line in outcome.stdout.splitlines() if line.startswith("finished")]
    assert finished in ([], [0], [1], [2]), outcome


def test_many_empty_files_stop_at_the_memory_limit():
    # Empty files cost no tmpfs blocks, only inodes and directory entries: kernel memory (250k of them: 215-260 MiB
    # in a 32 MB /tmp). The call's cgroup counts it too.
    _whole_sandbox_bound()
    outcome = attack(
        "made = 0\nwhile made < 300_000:\n    open(f'f{made}', 'w').close()\n    made += 1\n"
        "    if made % 10_000 == 0:\n        print(made, flush=True)\n",
        limits=Limits(cpu_s=20, wall_s=20, memory_mb=64, scratch_files=1_000_000),  # no inode count to stop it first
    )
    made = [int(line) for line in outcome.stdout.split()]
    assert outcome.returncode == 128 + 9 and max(made, default=0) < 150_000, outcome  # killed: out of memory


def test_many_empty_files_stop_at_the_inode_count():
    # Whether or not there is a call cgroup: /tmp's own inode count (bwrap's tmpfs has none: 300,000 empty files,
    # about 250 MiB of kernel memory, fitted in its 32 MB).
    outcome = attack(
        "import errno\nmade = 0\ntry:\n    while made < 300_000:\n        open(f'f{made}', 'w').close()\n"
        "        made += 1\nexcept OSError as error:\n    print(errno.errorcode[error.errno])\nprint(made)\n",
        limits=Limits(cpu_s=5, wall_s=10, scratch_files=1000),
    )
    assert outcome.stdout.split() == ["ENOSPC", "999"], outcome  # the folder itself is the thousandth


def test_what_a_process_killed_mid_call_left_behind_is_removed_by_the_next(monkeypatch):
    # A reward call past its time limit ends its whole process, the sandbox's cleanup with it: its work folder and
    # its call's cgroups stay. Named after that process, they are removed by the next process that makes some.
    _whole_sandbox_bound()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process holds now
    monkeypatch.setattr(sandbox, "_swept", set())
    parents, _ = sandbox._cgroup_parents()
    temp = Path(sandbox.tempfile.gettempdir())
    left = [temp / f"rlpipe-sandbox-{gone.pid}-{uuid.uuid4().hex[:12]}"] + [
        Path(parent, f"rlpipe-sandbox-{gone.pid}-{uuid.uuid4().hex[:12]}") for parent in parents.values()]
    mine = temp / f"rlpipe-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # a live process's: kept
    for folder in left + [mine]:
        folder.mkdir()
    (left[0] / "main.py").write_text("print('the program of a killed call')")
    assert attack("print('ok')").stdout == "ok\n"
    assert [folder for folder in left if folder.exists()] == [] and mine.exists()
    mine.rmdir()


def test_no_other_user_can_read_the_program_while_it_runs(monkeypatch):
    """The program's folder is 0700 and its files 0600, owned by whoever runs it (bwrap as SANDBOX_UID when this
    worker is root): another user on the host, here uid 12345, cannot list or read them while it runs."""
    seen = {}
    start = sandbox._start

    def look_while_it_runs(python, workdir, *args):
        process = start(python, workdir, *args)
        folder = Path(workdir)
        seen["modes"] = {path.name: (path.stat().st_mode & 0o7777, path.stat().st_uid)
                         for path in [folder, *sorted(folder.iterdir())]}
        other = subprocess.run(["cat", str(folder / "main.py"), str(folder / "data.txt")], capture_output=True,
                               text=True, user=12345, group=12345, extra_groups=[])
        seen["another user"] = other.returncode, other.stdout
        return process

    monkeypatch.setattr(sandbox, "_start", look_while_it_runs)
    outcome = run("print(open('/sandbox/data.txt').read())", FAST, files={"data.txt": "the program's own data"})
    assert outcome.passed and outcome.stdout == "the program's own data\n", outcome
    owner = sandbox.SANDBOX_UID if os.geteuid() == 0 else os.getuid()
    folder = next(name for name in seen["modes"] if name.startswith("rlpipe-sandbox-"))
    assert seen["modes"] == {folder: (0o700, owner), "data.txt": (0o600, owner), "main.py": (0o600, owner)}
    assert seen["another user"] == (1, "")
