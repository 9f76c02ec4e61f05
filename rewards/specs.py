"""The reward functions a run is configured with: each spec read and checked (its keys, weight and kwargs), its
function loaded and held against the call the reward pool makes (rewards/contract.py) before anything starts, and
the names its scores and failures go by.

An entry may name a reward model instead (TRL's contract; rlpipe/scoring/ runs it): which entries do is read from the
name alone, so that every process decides alike. A name with a `/` and no `:` names a folder (`./rm`, `/models/rm`)
or a Hugging Face Hub id (`org/name`, `org/name@revision`); function references always have a `:` and built-in
names no `/`."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlpipe.usercode.callables import BY_VALUE_PREFIX, RewardConfigError, display_name, load_reward, shown_name
from rlpipe.rewards.contract import CALL_ARGUMENTS, LOG_CALLBACKS, SAMPLE_COLUMNS

_SPEC_KEYS = ("name", "weight", "kwargs", "group")


@dataclass(frozen=True)
class LoadedReward:
    """One configured reward function, loaded and checked against the call the pool makes."""

    name: str
    path: str
    """The name given in config, by which the child process loads the function (the scorer role, a model)."""
    fn: Callable | None
    """None where a model scores (a reward model or the judge, rlpipe/scoring/), in the scorer role."""
    weight: float
    kwargs: dict[str, Any]
    group: bool = False
    """Called once per group (the group's completions of one prompt) instead of once per batch."""

    @property
    def model(self) -> bool:
        return self.fn is None


def parse_specs(specs: list[dict], columns: list[str] | None) -> list[LoadedReward]:
    rewards: list[LoadedReward] = []
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
        taken_by_the_call = [key for key in CALL_ARGUMENTS if key in kwargs]
        if taken_by_the_call:
            raise RewardConfigError(
                f"{where}: 'kwargs' may not set {', '.join(taken_by_the_call)}: every call passes "
                f"{', '.join(CALL_ARGUMENTS)} itself"
            )

        group = spec.get("group", False)
        if not isinstance(group, bool):
            raise RewardConfigError(f"{where}: 'group' must be true or false, got {group!r}")

        if is_model_reward(spec["name"]):  # scored by the scorer role; its folder is checked in the driver
            if kwargs or group:
                raise RewardConfigError(f"{where}: a reward model takes neither kwargs nor group")
            fn = None
        elif spec["name"] == JUDGE:  # the scorer role's judge; its kwargs are checked in the driver
            if group:
                raise RewardConfigError(f"{where}: the judge scores each sample alone; it takes no group")
            fn = None
        else:
            fn = load_reward(spec["name"])
            _check_signature(shown_name(spec["name"]), fn, kwargs, columns)
            _check_startup(shown_name(spec["name"]), fn, kwargs)
            _check_columns_read(shown_name(spec["name"]), fn, kwargs, columns)
        name = _unique(reward_display_name(spec["name"]), taken)
        taken.add(name)
        rewards.append(
            LoadedReward(name=name, path=spec["name"], fn=fn, weight=float(weight), kwargs=dict(kwargs), group=group)
        )
    return rewards


def reward_names(specs: list[dict]) -> list[str]:
    """The names results and failures go by, one per spec, as a RewardRunner of these specs names them."""
    taken: list[str] = []
    for spec in specs:
        taken.append(_unique(reward_display_name(spec["name"]), set(taken)))
    return taken


def reward_display_name(path: str) -> str:
    """The name a reward's scores go by before duplicates are told apart: a function's name, a model's folder."""
    return model_reward_name(path) if is_model_reward(path) else display_name(path)


def call_keywords(columns: list[str] | None, kwargs: Mapping[str, Any]) -> list[str]:
    """The keywords every call of a function with these config `kwargs` passes (the dataset's columns among them
    when they are known)."""
    names = [*CALL_ARGUMENTS, *(columns or []), *SAMPLE_COLUMNS]
    return list(dict.fromkeys([*names, *kwargs]))


JUDGE = "judge"
"""The built-in LLM judge's name (rlpipe/scoring/judge.py): a model served by the scorer role rates each sample."""


def scored_by_a_model(name: object) -> bool:
    """Whether the scorer role scores the entry of this name: a reward model or the judge."""
    return name == JUDGE or is_model_reward(name)


def is_model_reward(name: object) -> bool:
    """Whether a reward.functions name names a reward model (a folder or Hub id) rather than a function."""
    return (
        isinstance(name, str) and "/" in name and ":" not in name and not name.strip().startswith(BY_VALUE_PREFIX)
    )


def model_reward_name(name: str) -> str:
    """The name a reward model's scores go by: its folder's or repository's last part, as TRL names it."""
    return name.strip().rstrip("/").partition("@")[0].rpartition("/")[2] or name


def _check_signature(path: str, fn: Callable, kwargs: Mapping[str, Any], columns: list[str] | None) -> None:
    """Refuse a function that cannot take the call the pool makes: fn(**{keyword: ...}) for exactly the keywords
    of `call_keywords`. With the dataset's columns unknown, a required parameter left unbound may still be a column
    (`answer`), so only what can never bind fails."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature to check
        return
    # TRL's logging callables are given to a function that takes them (rewards/child.py).
    keywords = call_keywords(columns, kwargs) + [name for name in LOG_CALLBACKS if name in signature.parameters]
    try:
        if columns is None:
            signature.bind_partial(**dict.fromkeys(keywords))
        else:
            signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        dataset = "unknown here" if columns is None else ", ".join(columns) or "none"
        fix = (
            "give that parameter a default, or set it in kwargs"
            if str(err).startswith("missing")
            else "end its parameters with **kwargs to take what it does not use"
        )
        raise RewardConfigError(
            f"reward function {path!r} cannot take the call the reward pool makes, by keyword: {err} (it is called "
            f"with {', '.join(CALL_ARGUMENTS)}, the dataset's columns ({dataset}), {', '.join(SAMPLE_COLUMNS)} and "
            f"its kwargs ({', '.join(kwargs) or 'none'}); {fix})"
        ) from None


def _check_columns_read(path: str, fn: Callable, kwargs: Mapping[str, Any], columns: list[str] | None) -> None:
    """A function may carry `columns_read(**kwargs) -> list[str]`: the dataset columns it reads without naming them
    as parameters (the verl adapter, told by its kwargs which columns to read). With the dataset's columns known,
    each must be one of them."""
    read = getattr(fn, "columns_read", None)
    if columns is None or not callable(read):
        return
    missing = [column for column in read(**kwargs) if column not in columns and column not in SAMPLE_COLUMNS]
    if missing:
        raise RewardConfigError(
            f"reward function {path!r} reads column(s) {', '.join(missing)}, which the dataset does not have "
            f"(its columns: {', '.join(columns) or 'none'})"
        )


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
