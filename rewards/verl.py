"""Built-in adapter (short name `verl`) running a verl-style `compute_score` unchanged, once per sample:

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **function_kwargs)
        -> float, or a dict with a "score" key (its other keys are kept as extras)

as verl's reward managers call it. Config kwargs:
  - `function`: its import path (default verl's own `verl.utils.reward_score:default_compute_score`);
  - `data_source_column` ("data_source"), or `fixed_data_source` for every row of a dataset without that column;
  - `ground_truth_column` ("reward_model.ground_truth": the `ground_truth` key of the `reward_model` column, as verl's
    parquet files hold it; a plain column name works too);
  - `extra_info_column` ("extra_info"; rows without it, or a dataset without it, give {});
  - `function_kwargs` ({}): more keyword arguments, as verl's `custom_reward_function.reward_kwargs`.
`solution_str` is the completion's text. An `async def` compute_score is awaited, the samples concurrently.
A sample on which compute_score raises (verl's default one does for a data_source it does not know) or never
returns is unscored alone: the reward runner calls the adapter again once per sample when a batch call fails,
where verl's managers would score it 0.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from rlpipe.rewards.contract import completion_text
from rlpipe.rewards.registry import RewardConfigError, load_reward

VERL_DEFAULT = "verl.utils.reward_score:default_compute_score"


def compute_score(
    completions: list,
    function: str = VERL_DEFAULT,
    data_source_column: str = "data_source",
    fixed_data_source: str | None = None,
    ground_truth_column: str = "reward_model.ground_truth",
    extra_info_column: str = "extra_info",
    function_kwargs: Mapping[str, Any] | None = None,
    **columns: Any,
) -> list | Any:
    """One `function(...)` per sample; a list of its results, or, for an async function, an awaitable of it."""
    score = _load(function)
    results = []
    for index, completion in enumerate(completions):
        data_source = fixed_data_source if fixed_data_source is not None else columns[data_source_column][index]
        extra_info = columns[extra_info_column][index] if extra_info_column in columns else None
        # verl's managers add keys to extra_info: each call gets a copy of its own.
        extra_info = dict(extra_info) if isinstance(extra_info, Mapping) else {} if extra_info is None else extra_info
        results.append(
            score(
                data_source=data_source,
                solution_str=completion_text(completion),
                ground_truth=_lookup(columns, ground_truth_column, index),
                extra_info=extra_info,
                **(function_kwargs or {}),
            )
        )
    if any(inspect.isawaitable(result) for result in results):
        return _gather(results)
    return results


def columns_read(
    data_source_column: str = "data_source",
    fixed_data_source: str | None = None,
    ground_truth_column: str = "reward_model.ground_truth",
    **_: Any,
) -> list[str]:
    """The dataset columns the adapter needs with these kwargs (RewardRunner checks them at start-up)."""
    needed = [] if fixed_data_source is not None else [data_source_column]
    return [*needed, ground_truth_column.split(".", 1)[0]]


def startup_check(
    function: str = VERL_DEFAULT, function_kwargs: Mapping[str, Any] | None = None, **_: Any
) -> str | None:
    """The function loads, and takes verl's call with these `function_kwargs`."""
    try:
        score = _load(function)
    except RewardConfigError as err:
        return f"kwargs.function: {err}"
    try:
        signature = inspect.signature(score)
    except (TypeError, ValueError):
        return None
    keywords = ["data_source", "solution_str", "ground_truth", "extra_info", *(function_kwargs or {})]
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        return f"kwargs.function {function!r} cannot be called as verl calls it ({', '.join(keywords)}): {err}"
    return None


compute_score.columns_read = columns_read
compute_score.startup_check = startup_check


@lru_cache(maxsize=None)
def _load(function: str) -> Callable:
    return load_reward(function)


def _lookup(columns: Mapping[str, list], path: str, index: int) -> Any:
    """`column` or `column.key.key...`: a column's value for one row, or a key inside it."""
    column, *keys = path.split(".")
    value = columns[column][index]
    for key in keys:
        value = value[key]
    return value


async def _gather(results: list) -> list:
    async def value(result: Any) -> Any:
        return await result if inspect.isawaitable(result) else result

    return list(await asyncio.gather(*(value(result) for result in results)))
