"""Reward functions with known behaviour, loaded by import path in tests/unit/test_rewards.py. Each is written to the
keyword contract (rewards/contract.py): the arguments it uses by name, **_ for the rest."""

import asyncio
import math
import os
import time
from pathlib import Path

SLOW_SECONDS = 3.0
NOT_A_FUNCTION = 42


def length(completions, **_):
    return [float(len(completion)) for completion in completions]


def length_on_some_prompts(prompts, completions, **_):
    """The completion's length for about half of the prompts (by their text), 0 for the others: their groups have no
    signal, so dynamic sampling has to draw more."""
    return [float(len(completion)) if len(str(prompt)) % 2 else 0.0 for prompt, completion in zip(prompts, completions)]


def slow_length(completions, pid_file, seconds, **_):
    """`length`, slowly, after leaving the reward worker's process id in `pid_file` (a test kills the worker
    mid-call): the parent of the process functions run in."""
    Path(pid_file).write_text(str(os.getppid()))
    time.sleep(seconds)
    return length(completions)


def constant(completions, value=1.0, **_):
    return [value] * len(completions)


def with_extras(completions, **_):
    return [{"score": 0.5, "length": len(completion), "format_ok": True} for completion in completions]


def raising(completions, **_):
    return [1.0 / 0 for _ in completions]


def slow(completions, **_):
    time.sleep(SLOW_SECONDS)
    return [1.0] * len(completions)


def short_by_one(completions, **_):
    return [1.0] * (len(completions) - 1)


def nan_first(completions, **_):
    return [math.nan] + [1.0] * (len(completions) - 1)


def none_first(completions, **_):
    return [None] + [1.0] * (len(completions) - 1)


def echo_column(answer, **_):
    return [float(value) for value in answer]


async def async_length(completions, **_):
    await asyncio.sleep(0.01)
    return [float(len(completion)) for completion in completions]


async def async_slow(completions, **_):
    await asyncio.sleep(SLOW_SECONDS)
    return [1.0] * len(completions)


def scalar(**_):
    return 1.0


def rank_in_group(completions, answer, **_):
    """Group-level: 1.0 for the shortest completion of the group, 0.0 for the others; refuses mixed groups."""
    if len(set(answer)) != 1:
        raise ValueError(f"called with samples of several groups: {answer}")
    shortest = min(len(completion) for completion in completions)
    return [{"score": float(len(c) == shortest), "group_size": len(completions)} for c in completions]


def group_failing_on_x(completions, answer, **_):
    """Group-level: raises for the group whose answer is 'x'."""
    if answer[0] == "x":
        raise RuntimeError("cannot score group x")
    return [1.0] * len(completions)


def recording(**kwargs):
    """1.0 per sample, with the call's keyword arguments as the extra `call` (functions run in a process of their
    own, so what they saw comes back with the result; a callable given, by its name)."""
    call = {key: f"callable {value.__name__}" if callable(value) else value for key, value in kwargs.items()}
    return [{"score": 1.0, "call": call} for _ in kwargs["completions"]]


def reads_trainer_state(completions, trainer_state, **_):
    """A curriculum-style reward: the step it was scored at (attribute access, as written for TRL)."""
    return [float(trainer_state.global_step) for _ in completions]


# Signatures for the start-up check against the call (tests/unit/test_rewards.py): each returns 1.0 per sample.


def accuracy(completions, solution, **kwargs):
    """As TRL's accuracy_reward takes its arguments: a dataset column by name, after the completions."""
    return [1.0 for _ in completions]


def no_var_keywords(prompts, completions):
    return [1.0 for _ in completions]


def positional_only(completions, /, **kwargs):
    return [1.0 for _ in kwargs["prompts"]]


def only_var_positional(*args):
    return [1.0]


def keyword_only(*, completions, bonus, **kwargs):
    return [bonus for _ in completions]


def every_argument_by_name(
    prompts, completions, completion_ids, trainer_state, answer, completion_tokens, finish_reason, max_tokens
):
    return [1.0 for _ in completions]


def answer_with_default(completions, answer=None, **kwargs):
    return [1.0 for _ in completions]


# Functions that fail on one kind of sample only: the runner must leave the other samples scored.


def stalls_on(prompts, completions, marker="stall", how="sleep", **_):
    """1.0 per sample; never returns for a sample whose prompt or completion contains `marker`: blocked in C
    (`sleep`), busy in the interpreter (`spin`), or the process exits (`exit`)."""
    for prompt, completion in zip(prompts, completions):
        if marker in f"{prompt}{completion}":
            if how == "exit":
                os._exit(3)
            while True:
                if how == "sleep":
                    time.sleep(3600)
    return [1.0] * len(completions)


def computes_in_c(completions, **_):
    """1.0 per sample; for a completion holding "tower" it first computes 9 ** 9 ** 9, which Python's integers do in C
    from start to end (no signal handler or thread of the interpreter runs until it is done)."""
    base = 9
    for completion in completions:
        if "tower" in completion:
            base ** base ** base
    return [1.0] * len(completions)


def utf8_length(completions, **_):
    """Bytes of each completion in UTF-8: raises on a lone surrogate, which has none."""
    return [float(len(completion.encode("utf-8"))) for completion in completions]


def logs_like_trl(completions, log_extra=None, log_metric=None, **_):
    """TRL's logging contract: a column of one value per sample, and one number per call."""
    log_extra("length", [len(completion) for completion in completions])
    log_metric("calls", 1.0)
    log_metric("mean_length", sum(len(c) for c in completions) / len(completions))
    return [1.0] * len(completions)


def logs_what_does_not_fit(completions, log_extra, log_metric, **_):
    """A column one value short, and metrics that are not finite numbers: left out, the scores kept."""
    log_extra("short", [0] * (len(completions) - 1))
    log_metric("text", "high")
    log_metric("nan", math.nan)
    log_metric("kept", 2)
    log_metric("pass@1 (greedy)", 0.5)  # renamed to what trackers take
    log_metric("..", 1.0)
    return [1.0] * len(completions)


def names_log_metric_only(completions, log_metric, answer=None, completion_ids=None, prompts=None, trainer_state=None,
                          completion_tokens=None, finish_reason=None, max_tokens=None):
    """No **kwargs: given only the callable it names."""
    log_metric("seen", float(len(completions)))
    return [0.0] * len(completions)


def without_log_callbacks(completions, answer=None, completion_ids=None, prompts=None, trainer_state=None,
                          completion_tokens=None, finish_reason=None, max_tokens=None):
    """Neither callable named and no **kwargs: called as before, without them."""
    return [0.0] * len(completions)
