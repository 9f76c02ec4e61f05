"""code_tests scores what the tests say, through the harness's own channel: each known way of scoring without
solving the problem gets 0, beside a correct solution that gets 1."""

from __future__ import annotations

import logging

import pytest

from rlpipe.rewards import RewardConfigError, RewardRunner, load_reward, sandbox

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
TESTS = (
    "def check(candidate):\n"
    "    assert abs(candidate(0.25, 0.5) - 0.75) < 1e-9  # TESTS-CANARY\n"
    "    assert candidate(2, 3) == 5\n"
    "    assert candidate(-1, 1) == 0\n"
    "    assert candidate(10, 5) == 15\n"
)
WRONG = "    return a - b\n"

HACKS = {
    "exit before the tests": WRONG + "import sys\nsys.exit(0)\n",
    "exit during the tests": "    import os\n    os._exit(0)\n",
    "patched builtins": "    return int(a + b)\nimport builtins\nbuiltins.abs = lambda x: 0\n",  # wrong for floats
    "always-equal result": (
        "    class Equal(int):\n        def __eq__(self, other):\n            return True\n"
        "        def __sub__(self, other):\n            return 0\n    return Equal(0)\n"
    ),
    "monkeypatched checker": WRONG + (
        "import atexit, os, threading\n"
        "def patch():\n    while 'check' not in globals():\n        pass\n    globals()['check'] = lambda candidate: None\n"
        "threading.Thread(target=patch, daemon=True).start()\n"
        "atexit.register(os._exit, 0)\n"
    ),
    "forged report": WRONG + (
        "import os\nprint('passed')\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, b'passed')\n    except OSError:\n        pass\n"
        "for pid in os.listdir('/proc'):\n    for fd in (os.listdir(f'/proc/{pid}/fd') if pid.isdigit() else []):\n"
        "        try:\n            with open(f'/proc/{pid}/fd/{fd}', 'wb') as out:\n                out.write(b'passed')\n"
        "        except OSError:\n            pass\n"
    ),
    "peeking at the tests": WRONG + (
        "import glob, os\n"
        "for path in glob.glob('/sandbox/*') + glob.glob('/proc/*/fd/*') + glob.glob('/proc/*/cmdline'):\n"
        "    try:\n        if os.path.isfile(path):\n            print(open(path, errors='replace').read(), flush=True)\n"
        "    except OSError:\n        pass\n"
    ),
}


@pytest.fixture(scope="module")
def tests_pass():
    if sandbox.missing_isolation():
        pytest.fail(sandbox.missing_isolation())
    return load_reward("code_tests")


def score(tests_pass, completions, **kwargs):
    return tests_pass(prompts=[PROMPT] * len(completions), completions=completions, test=[TESTS] * len(completions),
                      entry_point=["add"] * len(completions), cpu_s=2, wall_s=5, **kwargs)


def test_correct_solutions_pass_and_wrong_ones_fail(tests_pass):
    completions = ["    return a + b\n", "```python\ndef add(a, b):\n    return b + a\n```", WRONG, "    while True:\n        pass\n"]
    assert score(tests_pass, completions) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_a_hack_scores_zero(tests_pass, hack):
    assert score(tests_pass, [HACKS[hack]]) == [0.0]


def test_the_program_never_sees_the_tests(tests_pass, monkeypatch):
    seen = []
    run = sandbox.run
    monkeypatch.setattr(sandbox, "run", lambda *args, **kwargs: seen.append(run(*args, **kwargs)) or seen[-1])
    score(tests_pass, [HACKS["peeking at the tests"]])
    assert seen[0].stdout and "TESTS-CANARY" not in seen[0].stdout


def test_tests_receive_plain_values_only(tests_pass):
    # A program's exception crosses as the built-in type; an object it made does not cross at all.
    tests = "def check(candidate):\n    try:\n        candidate(0, 0)\n    except ZeroDivisionError:\n        return\n    assert False\n"
    raising = "    return a / b\n"
    returns_object = "    return object()\n"
    assert load_reward("code_tests")(prompts=[PROMPT] * 2, completions=[raising, returns_object], test=[tests] * 2,
                                     entry_point=["add"] * 2) == [1.0, 0.0]


def test_the_reward_pool_refuses_to_start_without_the_sandbox(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "missing_isolation", lambda: "code sandbox unavailable: bwrap not found")
    with pytest.raises(RewardConfigError, match="code_tests.*cannot run here: code sandbox unavailable: bwrap"):
        RewardRunner([{"name": "code_tests"}])

    with caplog.at_level(logging.WARNING, logger="rewards"):
        runner = RewardRunner([{"name": "code_tests", "kwargs": {"unsafe_no_sandbox": True}}])
    assert "WITHOUT the sandbox" in caplog.text
    monkeypatch.setattr(sandbox, "_checked_python", lambda: pytest.fail("the opt-out must not use the sandbox"))
    result = runner.score([PROMPT] * 2, ["    return a + b\n", WRONG], {"test": [TESTS] * 2, "entry_point": ["add"] * 2})
    assert result.totals == [1.0, 0.0]
