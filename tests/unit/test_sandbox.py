"""Model-written code in the sandbox: each hostile program is contained, scored 0, and the caller goes on."""

from __future__ import annotations

import time

import pytest

from rewards import load_reward
from rewards.sandbox import Limits, network_isolated, run

FAST = Limits(cpu_s=2, wall_s=5, memory_mb=256)


def test_ordinary_code_runs_and_sees_only_its_own_directory(tmp_path):
    outcome = run("import os\nopen('out.txt', 'w').write('ok')\nprint(os.listdir('.'), sorted(os.environ))", FAST)
    assert outcome.passed, outcome.stderr
    assert "out.txt" in outcome.stdout
    assert "PATH" not in outcome.stdout and "HOME" not in outcome.stdout  # an empty environment


HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo escaped'])",
    "memory hog": "hog = []\nwhile True:\n    hog.append(bytearray(50 * 2**20))",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "signal the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGTERM)",
    "signal the group": "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "parent's environment": "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
    "ctypes escape": "import ctypes\nctypes.CDLL(None).kill(1, 9)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_is_contained(name, monkeypatch):
    monkeypatch.setenv("RLPIPE_SANDBOX_CANARY", "secret-value")  # what the parent's environment must not leak
    started = time.monotonic()
    outcome = run(HOSTILE[name], FAST)
    assert not outcome.passed, (name, outcome)
    assert time.monotonic() - started < FAST.wall_s + 5
    assert "secret-value" not in outcome.stdout and "escaped" not in outcome.stdout


def test_writing_outside_its_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.remove({str(tmp_path)!r})",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        assert not run(code, FAST).passed
    assert not target.exists() and tmp_path.exists()


def test_a_network_namespace_of_its_own_where_the_kernel_allows():
    if not network_isolated():
        pytest.skip("no network namespace here (the audit hook alone blocks sockets)")
    assert run("print(open('/proc/self/net/dev').read())", FAST).stdout.count(":") == 1  # loopback only


def test_the_code_reward_scores_tests_and_survives_hostile_completions():
    reward = load_reward("code_tests")
    prompt = 'def add(a, b):\n    """Return a + b."""\n'
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    completions = [
        "    return a + b\n",  # a base model continues the prompt
        "```python\ndef add(a, b):\n    return b + a\n```",  # a chat model writes the whole function
        "    return a - b\n",  # wrong
        "    while True:\n        pass\n",  # never ends
        "    import os\n    os.kill(os.getppid(), 9)\n",  # attacks the caller
    ]
    scores = reward([prompt] * 5, completions, test=[test] * 5, entry_point=["add"] * 5, cpu_s=2, wall_s=5)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0]
