"""Run the configured reward functions over a batch with a time limit and per-function error accounting.

A function that raises, hangs or returns garbage never takes the batch down: its affected samples score
None, and the failure is counted and described in the result. Samples are never silently scored 0.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
import numbers
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlpipe.rewards.registry import RewardConfigError, describe_error, display_name, load_reward

logger = logging.getLogger("rewards")

_SPEC_KEYS = ("name", "weight", "kwargs", "group")
SAMPLE_COLUMNS = ("completion_tokens", "finish_reason", "max_tokens")
"""Columns the reward pool adds to the dataset's for every sample: the completion's length in tokens, why it
ended ("stop" or "length") and the length limit it was sampled under. Datasets may not use these names."""


@dataclass
class RewardResult:
    """Scores of one batch. Lists are aligned with the batch's samples."""

    totals: list[float | None]
    """Weighted sum over functions; None where any function could not score the sample."""
    per_function: dict[str, list[float | None]]
    failures: dict[str, int]
    """Samples each function failed to score in this call (0 for functions that scored everything)."""
    first_errors: dict[str, str] = field(default_factory=dict)
    """One line per function that failed in this call, starting with the function's name."""
    extras: dict[str, list] = field(default_factory=dict)
    """Non-`score` keys of dict returns, as `"{function}/{key}"`; None where a sample lacked the key."""


@dataclass(frozen=True)
class _Reward:
    name: str
    fn: Callable
    weight: float
    kwargs: dict[str, Any]
    group: bool = False
    """Called once per group (the group's completions of one prompt) instead of once per batch."""


@dataclass
class _Outcome:
    scores: list[float | None]
    extras: dict[str, list]
    failures: int = 0
    first_error: str | None = None
    exception: BaseException | None = None


class RewardRunner:
    """Scores batches with a fixed list of reward functions.

    `specs` are `{"name": "pkg.mod:fn", "weight": 1.0, "kwargs": {}, "group": False}` dicts; every function
    is loaded here so that a bad name fails at startup rather than at the first batch, and its `startup_check`,
    if it has one, says here whether it can run on this machine. A `group` function is
    called once per group with that group's samples only, so it can score completions against each other.
    """

    def __init__(self, specs: list[dict], timeout_s: float = 30.0):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not timeout_s > 0:
            raise RewardConfigError(f"reward timeout_s must be a positive number of seconds, not {timeout_s!r}")
        if not specs:
            raise RewardConfigError("no reward functions configured; add {'name': 'pkg.mod:fn'}")
        self.timeout_s = float(timeout_s)
        self._rewards = _parse_specs(specs)
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self._rewards]

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list] | None = None,
        group_sizes: list[int] | None = None,
    ) -> RewardResult:
        """Score a batch; `group_sizes` splits it into consecutive groups (default: one group)."""
        columns = dict(columns or {})
        num_samples = len(completions)
        _check_batch_lengths(prompts, completions, columns)
        windows = _group_windows(group_sizes, num_samples)
        if num_samples == 0:
            return RewardResult([], {r.name: [] for r in self._rewards}, {r.name: 0 for r in self._rewards})

        # Functions run concurrently, each in its own daemon thread, so the batch waits at most
        # `timeout_s` in total and a hung function cannot keep the process from exiting.
        calls = [
            _ThreadedCall(reward, prompts, completions, columns, self.timeout_s, windows) for reward in self._rewards
        ]
        deadline = time.monotonic() + self.timeout_s
        for call in calls:
            call.start()
        for call in calls:
            call.join(max(0.0, deadline - time.monotonic()))

        outcomes = {call.reward.name: self._collect(call, num_samples) for call in calls}
        return _combine(self._rewards, outcomes, num_samples)

    def _collect(self, call: _ThreadedCall, num_samples: int) -> _Outcome:
        name = call.reward.name
        if call.is_alive() or call.timed_out:
            outcome = _failed_call(num_samples, f"{name}: timed out after {self.timeout_s:g}s")
        elif call.error is not None:
            outcome = _failed_call(num_samples, f"{name}: {describe_error(call.error)}", call.error)
        elif call.reward.group:
            outcome = _merge([_group_outcome(name, part, window) for part, window in zip(call.value, call.windows)])
        else:
            outcome = _validate(name, call.value, num_samples)
        if outcome.first_error is not None:
            self._log_failure(name, outcome)
        return outcome

    def _log_failure(self, name: str, outcome: _Outcome) -> None:
        if name in self._warned:
            logger.debug("reward function failed: %s", outcome.first_error, exc_info=outcome.exception)
            return
        self._warned.add(name)
        logger.warning(
            "reward function failed: %s (%d of %d samples unscored; later failures of %s are logged at DEBUG)",
            outcome.first_error,
            outcome.failures,
            len(outcome.scores),
            name,
            exc_info=outcome.exception,
        )


class _TimedOut(Exception):
    """Raised inside the worker thread when an awaitable outlives the time limit."""


class _ThreadedCall:
    """One call of one reward function in a daemon thread.

    A synchronous function that overruns cannot be stopped from here: the thread is abandoned and keeps
    running until the function returns (isolating it in a killable subprocess is the sandbox's job).
    Coroutines are cancelled at the time limit.
    """

    def __init__(
        self,
        reward: _Reward,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        timeout_s: float,
        windows: list[slice],
    ):
        self.reward = reward
        self.windows = windows
        self.value: Any = None
        self.error: BaseException | None = None
        self.timed_out = False
        self._timeout_s = timeout_s
        # Each function gets its own list copies: functions run concurrently and may mutate their inputs.
        self._args = (list(prompts), list(completions))
        # `kwargs` from config win over a dataset column of the same name.
        self._kwargs = {**{key: list(values) for key, values in columns.items()}, **reward.kwargs}
        self._thread = threading.Thread(target=self._run, name=f"reward-{reward.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            if not self.reward.group:
                self.value = self._call(*self._args, **self._kwargs)
                return
            # One failing group unscores that group only; the deadline covers all groups together.
            deadline = time.monotonic() + self._timeout_s
            self.value = []
            for window in self.windows:
                self._timeout_s = max(0.0, deadline - time.monotonic())
                try:
                    part = self._call(
                        *(values[window] for values in self._args),
                        **{
                            key: values if key in self.reward.kwargs else values[window]
                            for key, values in self._kwargs.items()
                        },
                    )
                except _TimedOut:
                    raise
                except BaseException as err:  # as below: user code may raise SystemExit
                    part = err
                self.value.append(part)
        except _TimedOut:
            self.timed_out = True
        # BaseException too: a SystemExit raised by user code would otherwise end the thread silently.
        except BaseException as err:
            self.error = err

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        value = self.reward.fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await_within(value, self._timeout_s))
        return value


def _group_windows(group_sizes: list[int] | None, num_samples: int) -> list[slice]:
    if group_sizes is None:
        return [slice(0, num_samples)]
    if sum(group_sizes) != num_samples or any(size < 1 for size in group_sizes):
        raise ValueError(f"group sizes {group_sizes} do not split {num_samples} samples into non-empty groups")
    stops = list(itertools.accumulate(group_sizes))
    return [slice(stop - size, stop) for size, stop in zip(group_sizes, stops)]


def _group_outcome(name: str, value: Any, window: slice) -> _Outcome:
    size = window.stop - window.start
    if isinstance(value, BaseException):
        where = f"group of samples {window.start}-{window.stop - 1}"
        return _failed_call(size, f"{name}: {describe_error(value)} ({where})", value)
    return _validate(name, value, size)


def _merge(parts: list[_Outcome]) -> _Outcome:
    """Outcomes of consecutive groups as one outcome of the whole batch."""
    merged = _Outcome(scores=[], extras={})
    for part in parts:
        for key in part.extras.keys() - merged.extras.keys():
            merged.extras[key] = [None] * len(merged.scores)
        for key, values in merged.extras.items():
            values.extend(part.extras.get(key, [None] * len(part.scores)))
        merged.scores.extend(part.scores)
        merged.failures += part.failures
        if merged.first_error is None and part.first_error is not None:
            merged.first_error, merged.exception = part.first_error, part.exception
    return merged


async def _await_within(awaitable: Awaitable, timeout_s: float) -> Any:
    # asyncio.wait instead of wait_for: a TimeoutError raised by the user's own code must stay an error,
    # distinguishable from running out of time.
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise _TimedOut
    return task.result()


def _validate(name: str, values: Any, num_samples: int) -> _Outcome:
    if not isinstance(values, (list, tuple)):
        return _failed_call(
            num_samples, f"{name}: returned {type(values).__name__}, expected a list of {num_samples} scores"
        )
    if len(values) != num_samples:
        return _failed_call(num_samples, f"{name}: returned {len(values)} values for {num_samples} samples")

    outcome = _Outcome(scores=[None] * num_samples, extras={})
    for index, item in enumerate(values):
        if isinstance(item, Mapping):
            for key, extra in item.items():
                if key != "score":
                    outcome.extras.setdefault(str(key), [None] * num_samples)[index] = extra
            if "score" in item:
                score, problem = _as_score(item["score"], index)
            else:
                score, problem = None, f"returned a dict without 'score' for sample {index}"
        else:
            score, problem = _as_score(item, index)
        outcome.scores[index] = score
        if problem is not None:
            outcome.failures += 1
            outcome.first_error = outcome.first_error or f"{name}: {problem}"
    return outcome


def _as_score(value: Any, index: int) -> tuple[float | None, str | None]:
    if value is None:
        return None, f"returned None for sample {index}"
    if not isinstance(value, numbers.Real):
        return None, f"returned {type(value).__name__} {value!r:.60} for sample {index}, expected a number"
    score = float(value)
    if math.isnan(score):
        return None, f"returned NaN for sample {index}"
    if math.isinf(score):
        return None, f"returned {score} for sample {index}"
    return score, None


def _failed_call(num_samples: int, message: str, exception: BaseException | None = None) -> _Outcome:
    return _Outcome([None] * num_samples, {}, num_samples, message, exception)


def _combine(rewards: list[_Reward], outcomes: dict[str, _Outcome], num_samples: int) -> RewardResult:
    totals: list[float | None] = []
    for index in range(num_samples):
        scores = [outcomes[reward.name].scores[index] for reward in rewards]
        if any(score is None for score in scores):
            totals.append(None)
        else:
            totals.append(sum(reward.weight * score for reward, score in zip(rewards, scores)))
    return RewardResult(
        totals=totals,
        per_function={name: outcome.scores for name, outcome in outcomes.items()},
        failures={name: outcome.failures for name, outcome in outcomes.items()},
        first_errors={name: outcome.first_error for name, outcome in outcomes.items() if outcome.first_error},
        extras={
            f"{name}/{key}": values for name, outcome in outcomes.items() for key, values in outcome.extras.items()
        },
    )


def _parse_specs(specs: list[dict]) -> list[_Reward]:
    rewards: list[_Reward] = []
    taken: set[str] = set()
    for index, spec in enumerate(specs):
        where = f"reward spec #{index} {spec!r}"
        if not isinstance(spec, Mapping):
            raise RewardConfigError(f"{where}: expected a mapping with keys {', '.join(_SPEC_KEYS)}")
        unknown = sorted(str(key) for key in spec if key not in _SPEC_KEYS)
        if unknown:
            raise RewardConfigError(
                f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_SPEC_KEYS)}"
            )
        if "name" not in spec:
            raise RewardConfigError(f"{where}: missing 'name' (e.g. 'rlpipe.rewards.math:numeric_answer')")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardConfigError(f"{where}: 'weight' must be a finite number, got {weight!r}")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
            raise RewardConfigError(f"{where}: 'kwargs' must be a mapping with string keys, got {kwargs!r}")

        group = spec.get("group", False)
        if not isinstance(group, bool):
            raise RewardConfigError(f"{where}: 'group' must be true or false, got {group!r}")

        fn = load_reward(spec["name"])
        _check_signature(spec["name"], fn, kwargs)
        _check_startup(spec["name"], fn, kwargs)
        name = _unique(display_name(spec["name"]), taken)
        taken.add(name)
        rewards.append(_Reward(name=name, fn=fn, weight=float(weight), kwargs=dict(kwargs), group=group))
    return rewards


def _check_signature(path: str, fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """A function is called as fn(prompts, completions, **columns, **kwargs), the columns always including
    SAMPLE_COLUMNS: refuse one that could never take that call. A parameter left unbound may still be a dataset
    column (`answer`), so only what can never bind fails here."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature to check
        return
    try:
        signature.bind_partial([], [], **{**{column: [] for column in SAMPLE_COLUMNS}, **kwargs})
    except TypeError as err:
        raise RewardConfigError(
            f"reward function {path!r} cannot be called as fn(prompts, completions, **columns, **kwargs) "
            f"({', '.join(SAMPLE_COLUMNS)} are always among the columns; end its parameters with **_): {err}"
        ) from None


def _check_startup(path: str, fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """A function may carry `startup_check(**kwargs) -> str | None`: what keeps it from running on this machine
    (code_tests: no sandbox). Called here, in the driver before the cluster starts and in every reward worker."""
    check = getattr(fn, "startup_check", None)
    if callable(check):
        problem = check(**kwargs)
        if problem:
            raise RewardConfigError(f"reward function {path!r} cannot run here: {problem}")


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    suffix = 2
    while f"{name}_{suffix}" in taken:
        suffix += 1
    return f"{name}_{suffix}"


def _check_batch_lengths(prompts: list[str], completions: list[str], columns: dict[str, list]) -> None:
    # A misaligned batch is the caller's bug, not a reward function's, so it is raised.
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    for column, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {column!r} has {len(values)} values for {len(completions)} completions")


class RewardFailure(RuntimeError):
    """A reward function failed on too many samples for too long; the message names it and its first error."""


class FailureWatch:
    """Stops a run whose reward function keeps failing: more than `max_share` of a step's samples unscored by
    one function, `max_steps` steps in a row. Occasional failures only leave samples out; a function that is
    broken for good would otherwise train on whatever the others say, or on nothing."""

    def __init__(self, max_share: float, max_steps: int):
        self.max_share, self.max_steps = max_share, max_steps
        self.streaks: dict[str, int] = {}

    def update(self, failures: Mapping[str, int], samples: int, first_errors: Mapping[str, str]) -> None:
        for name, failed in failures.items():
            share = failed / max(1, samples)
            self.streaks[name] = self.streaks.get(name, 0) + 1 if share > self.max_share else 0
            if self.streaks[name] >= self.max_steps:
                error = first_errors.get(name, "no error message")
                raise RewardFailure(
                    f"reward function {name} failed on more than {self.max_share:.0%} of the samples for "
                    f"{self.max_steps} steps in a row (reward.max_failed_share, reward.max_failed_steps); "
                    f"first error: {error}"
                )
