"""Run the configured reward functions over a batch with time limits and per-sample error accounting.

A function that raises or returns garbage never takes the batch down: its affected samples score None, and the
failure is counted and described in the result. Samples are never silently scored 0.

The functions run in a child process of their own (rewards/child.py), which is killed when a call overruns, so
even a function stuck in C ends at its time limit. Each function is called on the whole batch first, as TRL
calls it; when that call raises or runs out of time it is called once per sample, so a bad sample costs only
itself. A sample whose own call runs out of time scores 0, counted apart from the failures: what the model wrote
cost more than its share of the time, and leaving it unscored would leave it out of the update, so that the policy
would never learn not to write it.

Time is shared by the samples still to score: a call gets the part of the time left before the deadline that its
samples are of them (its time limit, at most), so a few slow samples never leave the later ones without time.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlpipe.usercode.callables import RewardConfigError
from rlpipe.rewards.child import CallFailed, CallTimedOut, ChildProcess, Logged
from rlpipe.rewards.contract import CALL_ARGUMENTS, EPISODE_COLUMNS, SAMPLE_COLUMNS, as_completions, call_arguments
from rlpipe.rewards.contract import trainer_state as start_state
from rlpipe.rewards.specs import LoadedReward, parse_specs

logger = logging.getLogger("rewards")

ModelScoring = Callable[[str, list, list, dict, float], list]
"""How a runner has a model of the scorer role score (a reward model, the judge): (the entry's name, as its scores go
by; prompts; completions as functions get them; the batch's columns; time limit in seconds) -> one score per sample,
as a function returns them; raises CallFailed (rewards/child.py) when the call fails or runs out of time."""


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
    """Non-`score` keys of dict returns and the columns given to `log_extra`, as `"{function}/{key}"`; None where a
    sample lacked the key."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """The numbers given to `log_metric`, by name, one per call that logged it (TRL averages them per step)."""
    timeouts: dict[str, int] = field(default_factory=dict)
    """Samples each function scored 0 because their own call ran out of time (not counted in `failures`)."""


@dataclass
class _Outcome:
    scores: list[float | None]
    extras: dict[str, list]
    failures: int = 0
    first_error: str | None = None
    details: str = ""
    """The traceback of the first error, where the function raised."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    timeouts: int = 0
    """Samples scored 0 because their own call ran out of time."""
    first_timeout: str | None = None


class RewardRunner:
    """Scores batches with a fixed list of reward functions, each called by keyword (rewards/contract.py).

    `specs` are `{"name": "pkg.mod:fn", "weight": 1.0, "kwargs": {}, "group": False}` dicts; every function
    is loaded here so that a bad name fails at startup rather than at the first batch, and its `startup_check`,
    if it has one, says here whether it can run on this machine. A `group` function is
    called once per group with that group's samples only, so it can score completions against each other.

    `columns` names the dataset's columns (the prompt field left out) every batch will carry: each function's
    signature is then checked against exactly the keywords its calls pass, so a function that passes the check
    takes every call, and one that does not is refused here, naming the argument. Without `columns` only what can
    never bind is refused (a required parameter left over may be a column).
    """

    def __init__(
        self,
        specs: list[dict],
        timeout_s: float = 30.0,
        columns: list[str] | None = None,
        *,
        sample_timeout_s: float = 20.0,
        deadline_s: float = 300.0,
        score_with_model: ModelScoring | None = None,
    ):
        limits = {"timeout_s": timeout_s, "sample_timeout_s": sample_timeout_s, "deadline_s": deadline_s}
        for key, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise RewardConfigError(f"reward {key} must be a positive number of seconds, not {value!r}")
        if not specs:
            raise RewardConfigError("no reward functions configured; add {'name': 'pkg.mod:fn'}")
        self.timeout_s = float(timeout_s)
        self.sample_timeout_s = float(sample_timeout_s)
        self.deadline_s = float(deadline_s)
        self.columns = None if columns is None else sorted(set(columns))
        self._rewards = parse_specs(specs, self.columns)
        self.score_with_model = score_with_model
        self._warned: set[str] = set()
        self._warned_timeouts: set[str] = set()
        self.child = ChildProcess(list(dict.fromkeys(reward.path for reward in self._rewards if not reward.model)))
        """Where the functions run; started at the first batch, or by `start`."""

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self._rewards]

    def start(self) -> None:
        """Start the functions' process now, so that it loads them before the first batch comes."""
        self.child.start()

    def close(self) -> None:
        self.child.kill()

    def score(
        self,
        prompts: list,
        completions: list[str],
        columns: dict[str, list] | None = None,
        group_sizes: list[int] | None = None,
        *,
        completion_ids: list[list[int]] | None = None,
        trainer_state: Mapping[str, Any] | None = None,
    ) -> RewardResult:
        """Score a batch; `group_sizes` splits it into consecutive groups (default: one group).

        `prompts` are text or chat messages, per sample; `completions` are the generated texts (functions get them
        as assistant messages where the prompt is a conversation); `columns` the dataset's columns and
        SAMPLE_COLUMNS; `completion_ids` the token ids (None when the caller has none); `trainer_state` a
        TrainerState's fields (default: a run's start).

        Returns within `deadline_s`: a function's batch call has `timeout_s`, each per-sample call after it
        `sample_timeout_s`, each at most its samples' share of the time left (`_TimeShares`); a sample whose own
        call runs out of time scores 0, and what is left unscored at the deadline scores None."""
        columns = dict(columns or {})
        num_samples = len(completions)
        _check_batch_lengths(prompts, completions, columns, completion_ids)
        episode = set(EPISODE_COLUMNS)  # present only where episodes have environments
        if self.columns is not None and set(columns) - episode != {*self.columns, *SAMPLE_COLUMNS} - episode:
            raise ValueError(
                f"the batch's columns ({', '.join(sorted(columns))}) are not those the reward functions were checked "
                f"against ({', '.join(sorted({*self.columns, *SAMPLE_COLUMNS}))})"
            )
        state = dict(trainer_state if trainer_state is not None else start_state())
        windows = _group_windows(group_sizes, num_samples)
        if num_samples == 0:
            nothing = {r.name: 0 for r in self._rewards}
            return RewardResult([], {r.name: [] for r in self._rewards}, nothing, timeouts=dict(nothing))

        shares = _TimeShares(time.monotonic() + self.deadline_s, num_samples * len(self._rewards))
        batch = _Batch(list(prompts), list(completions), completion_ids, columns, state)
        outcomes = {}
        for reward in self._rewards:
            if reward.model:
                outcome = self._score_with_model(reward, batch, num_samples, shares)
            elif reward.group:
                outcome = _merge([self._score_group(reward, batch, window, shares) for window in windows])
            else:
                outcome = self._score_batch(reward, batch, num_samples, shares)
            if outcome.first_error is not None:
                self._log_failure(reward.name, outcome)
            if outcome.first_timeout is not None:
                self._log_timeout(reward.name, outcome)
            outcomes[reward.name] = outcome
        return _combine(self._rewards, outcomes, num_samples)

    def _call(
        self, reward: LoadedReward, arguments: dict[str, Any], limit_s: float, samples: int, shares: _TimeShares
    ) -> tuple[Any, Logged]:
        """`reward` called on `samples` samples, within `limit_s` and their share of the time left."""
        if shares.left() > 0:  # a new process loads the functions first: that is no call's time
            self.child.ready(shares.deadline)
        if shares.left() <= 0:
            raise CallFailed(f"not called: the batch's reward.deadline_s of {self.deadline_s:g}s had passed")
        return self.child.call(reward.path, arguments, shares.limit(limit_s, samples), start_deadline=shares.deadline)

    def _score_batch(self, reward: LoadedReward, batch: _Batch, num_samples: int, shares: _TimeShares) -> _Outcome:
        try:
            value, logged = self._call(reward, batch.arguments(reward.kwargs), self.timeout_s, num_samples, shares)
        except CallFailed as failure:
            logger.debug("reward function %s failed on the batch (%s); calling it per sample", reward.name, failure)
            return self._score_each(reward, batch, num_samples, shares)
        shares.done(num_samples)
        return _with_logged(_validate(reward.name, value, num_samples), logged, reward.name)

    def _score_with_model(
        self, reward: LoadedReward, batch: _Batch, num_samples: int, shares: _TimeShares
    ) -> _Outcome:
        """A model's scores of the whole batch (a reward model's, the judge's), in one call to the scorer role within
        the batch call's time limit; a call that fails or runs out of time leaves the batch unscored (a forward pass
        does not fail for one sample: calling again per sample would only spend the time of the functions after
        it)."""
        if self.score_with_model is None:
            raise RuntimeError(f"{reward.name}: this reward runner has no scorer to call")
        if shares.left() <= 0:
            return _failed_call(num_samples, f"{reward.name}: not called: the batch's reward.deadline_s of "
                                             f"{self.deadline_s:g}s had passed")
        completions = as_completions(batch.prompts, batch.texts)
        limit_s = shares.limit(self.timeout_s, num_samples)
        shares.done(num_samples)
        try:
            columns = {key: values for key, values in batch.columns.items() if key not in EPISODE_COLUMNS}
            values = self.score_with_model(reward.name, batch.prompts, completions, columns, limit_s)
        except CallFailed as failure:
            return _failed_call(num_samples, f"{reward.name}: {failure}", failure)
        return _validate(reward.name, values, num_samples)

    def _score_each(self, reward: LoadedReward, batch: _Batch, num_samples: int, shares: _TimeShares) -> _Outcome:
        parts = []
        for index in range(num_samples):
            arguments = batch.arguments(reward.kwargs, slice(index, index + 1))
            try:
                value, logged = self._call(reward, arguments, self.sample_timeout_s, 1, shares)
            except CallTimedOut as timeout:
                parts.append(_timed_out(f"{reward.name}: {timeout} (sample {index})"))
                continue
            except CallFailed as failure:
                parts.append(_failed_call(1, f"{reward.name}: {failure} (sample {index})", failure))
                continue
            finally:
                shares.done(1)
            parts.append(_with_logged(_validate(reward.name, value, 1, first_index=index), logged, reward.name))
        return _merge(parts)

    def _score_group(self, reward: LoadedReward, batch: _Batch, window: slice, shares: _TimeShares) -> _Outcome:
        # A group function scores completions against each other, so a failing group is not split: it is unscored,
        # whether it raised or ran out of time (no one answer of the group is known to have cost that time).
        size = window.stop - window.start
        try:
            value, logged = self._call(reward, batch.arguments(reward.kwargs, window), self.timeout_s, size, shares)
        except CallFailed as failure:
            where = f"group of samples {window.start}-{window.stop - 1}"
            return _failed_call(size, f"{reward.name}: {failure} ({where})", failure)
        finally:
            shares.done(size)
        return _with_logged(_validate(reward.name, value, size, first_index=window.start), logged, reward.name)

    def _log_failure(self, name: str, outcome: _Outcome) -> None:
        details = f"\n{outcome.details}" if outcome.details else ""
        if name in self._warned:
            logger.debug("reward function failed: %s%s", outcome.first_error, details)
            return
        self._warned.add(name)
        logger.warning(
            "reward function failed: %s (%d of %d samples unscored; later failures of %s are logged at DEBUG)%s",
            outcome.first_error,
            outcome.failures,
            len(outcome.scores),
            name,
            details,
        )

    def _log_timeout(self, name: str, outcome: _Outcome) -> None:
        if name in self._warned_timeouts:
            logger.debug("reward function ran out of time: %s; scored 0", outcome.first_timeout)
            return
        self._warned_timeouts.add(name)
        logger.warning(
            "reward function ran out of time: %s; scored 0 (%d of %d samples; later ones of %s are logged at DEBUG)",
            outcome.first_timeout,
            outcome.timeouts,
            len(outcome.scores),
            name,
        )


class _TimeShares:
    """The time left before `deadline`, shared among the samples still to score (each function's of each sample):
    a call on some samples gets the part of it that they are of those samples, so that however long one call runs,
    every later one still gets its part."""

    def __init__(self, deadline: float, samples: int):
        self.deadline = deadline
        self.samples_left = samples

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, limit_s: float, samples: int) -> float:
        """The time limit of a call on `samples` of the samples still to score: `limit_s` or their share."""
        return min(limit_s, self.left() * samples / max(samples, self.samples_left))

    def done(self, samples: int) -> None:
        """`samples` scored (or given up): the time left is theirs no more."""
        self.samples_left -= samples


@dataclass(frozen=True)
class _Batch:
    prompts: list
    texts: list[str]
    completion_ids: list | None
    columns: dict[str, list]
    state: dict[str, Any]

    def arguments(self, kwargs: Mapping[str, Any], window: slice | None = None) -> dict[str, Any]:
        """The keyword arguments of one call on the batch, or on the samples of `window`."""
        if window is None:
            window = slice(None)
        return call_arguments(
            self.prompts[window],
            self.texts[window],
            None if self.completion_ids is None else self.completion_ids[window],
            {key: values[window] for key, values in self.columns.items()},
            self.state,
            kwargs,
        )


def _group_windows(group_sizes: list[int] | None, num_samples: int) -> list[slice]:
    if group_sizes is None:
        return [slice(0, num_samples)]
    if sum(group_sizes) != num_samples or any(size < 1 for size in group_sizes):
        raise ValueError(f"group sizes {group_sizes} do not split {num_samples} samples into non-empty groups")
    stops = list(itertools.accumulate(group_sizes))
    return [slice(stop - size, stop) for size, stop in zip(group_sizes, stops)]


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
        merged.timeouts += part.timeouts
        if merged.first_error is None and part.first_error is not None:
            merged.first_error, merged.details = part.first_error, part.details
        merged.first_timeout = merged.first_timeout or part.first_timeout
    merged.metrics = _joined_metrics(part.metrics for part in parts)
    return merged


def _validate(name: str, values: Any, num_samples: int, first_index: int = 0) -> _Outcome:
    """The scores of a call on `num_samples` samples, the first of them sample `first_index` of the batch."""
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
                score, problem = _as_score(item["score"], first_index + index)
            else:
                score, problem = None, f"returned a dict without 'score' for sample {first_index + index}"
        else:
            score, problem = _as_score(item, first_index + index)
        outcome.scores[index] = score
        if problem is not None:
            outcome.failures += 1
            outcome.first_error = outcome.first_error or f"{name}: {problem}"
    return outcome


def _with_logged(outcome: _Outcome, logged: Logged, name: str) -> _Outcome:
    """`outcome` with what its call gave `log_extra` (columns of one value per sample of the call) and `log_metric`
    (finite numbers). What does not fit is left out with a warning; it never changes a score."""
    num_samples = len(outcome.scores)
    for column, values in logged.extra.items():
        if len(values) == num_samples:
            outcome.extras[column] = list(values)
        else:
            logger.warning("reward function %s: log_extra(%r, ...) gave %d values for the call's %d samples; left out",
                           name, column, len(values), num_samples)
    for metric, values in logged.metrics.items():
        numbers_given = [float(v) for v in values
                         if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)]
        if len(numbers_given) < len(values):
            logger.warning("reward function %s: log_metric(%r, ...) was given a value that is not a finite number; "
                           "left out", name, metric)
        if numbers_given:
            outcome.metrics.setdefault(_metric_name(metric), []).extend(numbers_given)
    return outcome


def _metric_name(name: str) -> str:
    """`name` as every tracker takes it: letters, digits, `_`, `.` and `-`, the rest `_` (MLflow refuses a run's
    whole batch over one bad name), and never a path step such as `..`."""
    cleaned = re.sub(r"[^\w.\-]", "_", name)
    return cleaned if cleaned.strip(".") else "_" * max(1, len(cleaned))


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


def _failed_call(num_samples: int, message: str, failure: CallFailed | None = None) -> _Outcome:
    return _Outcome([None] * num_samples, {}, num_samples, message, getattr(failure, "details", ""))


def _timed_out(message: str) -> _Outcome:
    """A sample whose own call ran out of time: it scores 0, counted as a timeout, not as a failure."""
    return _Outcome([0.0], {}, timeouts=1, first_timeout=message)


def _combine(rewards: list[LoadedReward], outcomes: dict[str, _Outcome], num_samples: int) -> RewardResult:
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
        timeouts={name: outcome.timeouts for name, outcome in outcomes.items()},
        first_errors={name: outcome.first_error for name, outcome in outcomes.items() if outcome.first_error},
        extras={
            f"{name}/{key}": values for name, outcome in outcomes.items() for key, values in outcome.extras.items()
        },
        metrics=_joined_metrics(outcome.metrics for outcome in outcomes.values()),
    )


def _joined_metrics(parts) -> dict[str, list[float]]:
    """The `log_metric` numbers of several calls (or functions) by name: TRL's metric names are the run's, not a
    function's."""
    joined: dict[str, list[float]] = {}
    for metrics in parts:
        for name, values in metrics.items():
            joined.setdefault(name, []).extend(values)
    return joined


def _check_batch_lengths(
    prompts: list, completions: list[str], columns: dict[str, list], completion_ids: list | None
) -> None:
    # A misaligned batch is the caller's bug, not a reward function's, so it is raised.
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if completion_ids is not None and len(completion_ids) != len(completions):
        raise ValueError(f"{len(completion_ids)} completion_ids but {len(completions)} completions")
    clashing = [column for column in columns if column in CALL_ARGUMENTS]
    if clashing:
        raise ValueError(f"column(s) {', '.join(clashing)} would replace the call's own argument(s) of that name")
    for column, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {column!r} has {len(values)} values for {len(completions)} completions")


class RewardFailure(RuntimeError):
    """A reward function failed on too many samples for too long; the message names it and its first error."""


class FailureWatch:
    """Stops a run whose reward function keeps failing: more than `max_share` of a step's samples unscored by
    one function, or scored 0 because its calls ran out of time, `max_steps` steps in a row. Occasional failures
    only leave samples out; a function that is broken (or too slow for its limits) for good would otherwise train on
    whatever the others say, or on nothing."""

    def __init__(self, max_share: float, max_steps: int):
        self.max_share, self.max_steps = max_share, max_steps
        self.streaks: dict[str, int] = {}

    def update(
        self,
        failures: Mapping[str, int],
        samples: int,
        first_errors: Mapping[str, str],
        timeouts: Mapping[str, int] | None = None,
    ) -> None:
        timeouts = timeouts or {}
        for name in dict.fromkeys([*failures, *timeouts]):
            share = (failures.get(name, 0) + timeouts.get(name, 0)) / max(1, samples)
            self.streaks[name] = self.streaks.get(name, 0) + 1 if share > self.max_share else 0
            if self.streaks[name] >= self.max_steps:
                fallback = "none, its calls ran out of time" if timeouts.get(name) else "no error message"
                error = first_errors.get(name, fallback)
                raise RewardFailure(
                    f"reward function {name} failed on more than {self.max_share:.0%} of the samples for "
                    f"{self.max_steps} steps in a row (raised, gave no score or ran out of time; "
                    f"reward.max_failed_share, reward.max_failed_steps); first error: {error}"
                )
