"""Code rewards: run a completion against its tests, HumanEval-style, inside the sandbox (rlpipe/usercode/sandbox.py).

The verdict is the test harness's (rewards/code_harness.py), never the program's exit status: the tests run in a
process of their own, see only the task's entry point from the program (the prompt's helpers they take from the
prompt), and report on a descriptor the model's program does not have, so an early exit, patched builtins, a
helper or builtin of its own or a forged line of output scores 0. The tests reach the harness on a descriptor the
program's process never holds.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path

from rlpipe.usercode import sandbox
from rlpipe.rewards.contract import completion_text, prompt_text

logger = logging.getLogger("rewards")

_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
_HARNESS = Path(__file__).with_name("code_harness.py").read_text()
_UNSAFE = (
    "code_tests runs model-written programs WITHOUT the sandbox (unsafe_no_sandbox: true): they can read and "
    "write this machine's files, reach the network and outlive the call. Only for code you would run yourself."
)


def program(prompt: str, completion: str) -> str:
    """The program to test: a fenced code block from the completion if it has one (a chat model writes the whole
    function), after the prompt's code (its imports and helpers, which a reply holding only the asked-for function
    still calls); else the prompt's function header followed by the completion (a base model continues it)."""
    fenced = _FENCED.search(completion)
    if not fenced:
        return prompt + completion
    code = task_code(prompt)
    return f"{code}\n{fenced.group(1)}" if code else fenced.group(1)


def task_code(prompt: str) -> str:
    """The Python code of a prompt: the prompt itself where it is Python that defines or imports something
    (HumanEval's header and docstring), else its first fenced code block that is; "" where it has none."""
    for candidate in (prompt, *(block.group(1) for block in _FENCED.finditer(prompt))):
        try:
            tree = ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
        if any(isinstance(node, _DEFINITIONS) for node in tree.body):  # not prose that happens to parse
            return candidate
    return ""


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)


def tests_pass(
    prompts: list,
    completions: list,
    test: list[str],
    entry_point: list[str] | None = None,
    cpu_s: int = 5,
    wall_s: float = 10.0,
    memory_mb: int = 512,
    unsafe_no_sandbox: bool = False,
    **_: object,
) -> list[float]:
    """1.0 where every test held, as reported by the harness; else 0.0 — a failed assertion, a crash, a timeout, a
    limit hit. Columns: `test` (and `entry_point`: the tests then end with `check(entry_point)`) from the dataset.
    Raises SandboxUnavailable where the sandbox cannot isolate programs and `unsafe_no_sandbox` is not set.
    A conversation's prompt stands for its last user message."""
    limits = sandbox.Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    entry_points = entry_point or [None] * len(prompts)
    scores = []
    for prompt, completion, tests, entry in zip(prompts, completions, test, entry_points):
        prompt, completion = prompt_text(prompt), completion_text(completion)
        spec = {"test": tests, "entry_point": entry, "task_code": task_code(prompt)}
        scores.append(_score(program(prompt, completion), spec, limits, unsafe_no_sandbox))
    return scores


def _score(source: str, spec: dict, limits: sandbox.Limits, unsafe_no_sandbox: bool) -> float:
    outcome = sandbox.run(
        _HARNESS, limits, files={"program.py": source}, isolated=not unsafe_no_sandbox, private_input=json.dumps(spec)
    )
    return 1.0 if outcome.report == b"passed" and not outcome.timed_out else 0.0


def startup_check(unsafe_no_sandbox: bool = False, **_: object) -> str | None:
    """Called by the reward pool when it starts (RewardRunner): what keeps this reward from running here, if
    anything. Without the sandbox's isolation it refuses, unless the config opts out."""
    if unsafe_no_sandbox:
        logger.warning(_UNSAFE)
        return None
    return sandbox.missing_isolation()


tests_pass.startup_check = startup_check
