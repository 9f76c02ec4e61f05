"""Code rewards: run a completion against its tests, HumanEval-style, inside the sandbox (rewards/sandbox.py)."""

from __future__ import annotations

import re

from rewards.sandbox import Limits, run

_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def program(prompt: str, completion: str, test: str, entry_point: str | None) -> str:
    """The script to run: a fenced code block from the completion if it has one (a chat model writes the whole
    function), else the prompt's function header followed by the completion (a base model continues it); then the
    tests, and `check(entry_point)` when the tests define it, as HumanEval's do."""
    fenced = _FENCED.search(completion)
    body = fenced.group(1) if fenced else prompt + completion
    call = f"\ncheck({entry_point})\n" if entry_point else "\n"
    return f"{body}\n\n{test}\n{call}"


def tests_pass(
    prompts: list[str],
    completions: list[str],
    test: list[str],
    entry_point: list[str] | None = None,
    cpu_s: int = 5,
    wall_s: float = 10.0,
    memory_mb: int = 512,
    **_: object,
) -> list[float]:
    """1.0 where the program exits cleanly (every assertion held), else 0.0 — a crash, a timeout, a limit hit or
    anything the sandbox refused. Columns: `test` (and `entry_point`) from the dataset."""
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    entry_points = entry_point or [None] * len(prompts)
    return [
        1.0 if run(program(p, c, t, e), limits).passed else 0.0
        for p, c, t, e in zip(prompts, completions, test, entry_points)
    ]
