"""Reward functions with known behaviour, loaded by import path in tests/unit/test_rewards.py."""

import asyncio
import math
import os
import time
from pathlib import Path

SLOW_SECONDS = 3.0
NOT_A_FUNCTION = 42


def length(prompts, completions, **_):
    return [float(len(completion)) for completion in completions]


def slow_length(prompts, completions, pid_file, seconds, **_):
    """`length`, slowly, after leaving this worker's process id in `pid_file` (a test kills the worker mid-call)."""
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(seconds)
    return length(prompts, completions)


def constant(prompts, completions, value=1.0, **_):
    return [value] * len(completions)


def with_extras(prompts, completions, **_):
    return [{"score": 0.5, "length": len(completion), "format_ok": True} for completion in completions]


def raising(prompts, completions, **_):
    return [1.0 / 0 for _ in completions]


def slow(prompts, completions, **_):
    time.sleep(SLOW_SECONDS)
    return [1.0] * len(completions)


def short_by_one(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def nan_first(prompts, completions, **_):
    return [math.nan] + [1.0] * (len(completions) - 1)


def none_first(prompts, completions, **_):
    return [None] + [1.0] * (len(completions) - 1)


def echo_column(prompts, completions, answer, **_):
    return [float(value) for value in answer]


async def async_length(prompts, completions, **_):
    await asyncio.sleep(0.01)
    return [float(len(completion)) for completion in completions]


async def async_slow(prompts, completions, **_):
    await asyncio.sleep(SLOW_SECONDS)
    return [1.0] * len(completions)


def scalar(prompts, completions, **_):
    return 1.0


def rank_in_group(prompts, completions, answer, **_):
    """Group-level: 1.0 for the shortest completion of the group, 0.0 for the others; refuses mixed groups."""
    if len(set(answer)) != 1:
        raise ValueError(f"called with samples of several groups: {answer}")
    shortest = min(len(completion) for completion in completions)
    return [{"score": float(len(c) == shortest), "group_size": len(completions)} for c in completions]


def group_failing_on_x(prompts, completions, answer, **_):
    """Group-level: raises for the group whose answer is 'x'."""
    if answer[0] == "x":
        raise RuntimeError("cannot score group x")
    return [1.0] * len(completions)
