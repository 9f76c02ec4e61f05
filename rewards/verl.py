"""Built-in adapter (short name `verl`) running a verl-style `compute_score` unchanged, in either of verl's forms:

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **function_kwargs)
        -> float, or a dict with a "score" key (its other keys are kept as extras)

once per sample, as verl's naive/dapo reward managers call it, or, in the batch form of verl's BatchRewardManager,

    compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...], **function_kwargs)
        -> a list of those, one per sample

once per call. Config kwargs:
  - `function`: its import path or file path `path/to/file.py:fn` (default verl's own
    `verl.utils.reward_score:default_compute_score`);
  - `batch` (None): the batch form, or not; None takes it when the function has a `solution_strs` parameter;
  - `data_source_column` ("data_source"), or `fixed_data_source` for every row of a dataset without that column;
  - `ground_truth_column` ("reward_model.ground_truth": the `ground_truth` key of the `reward_model` column, as verl's
    parquet files hold it; a plain column name works too);
  - `extra_info_column` ("extra_info"; rows without it, or a dataset without it, give {});
  - `function_kwargs` ({}): more keyword arguments, as verl's `custom_reward_function.reward_kwargs`.
`solution_str` is the completion's text. The function gets only those of the four (or their plurals) it takes by
name, unless it takes **kwargs: verl's own scorer files (`gsm8k.py`, `math_reward.py`: `compute_score(solution_str,
ground_truth)`) run as they are. `extra_info` gets verl's two added keys: `num_turns` (the conversation's turns, the
prompt's included: 2 for a single-turn sample, as verl's single-turn agent loop counts) and `rollout_reward_scores`
(scores computed during rollout, by tools in verl; rlpipe computes none, so always {}).
An `async def` compute_score is awaited, per-sample calls concurrently. A sample on which compute_score raises
(verl's default one does for a data_source it does not know) or never returns is unscored alone: the reward runner
calls the adapter again once per sample when a batch call fails, where verl's managers would score it 0.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from rlpipe.usercode.callables import RewardConfigError, load_reward
from rlpipe.rewards.contract import completion_text

VERL_DEFAULT = "verl.utils.reward_score:default_compute_score"
SAMPLE_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_KEYWORDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def compute_score(
    completions: list,
    function: str = VERL_DEFAULT,
    data_source_column: str = "data_source",
    fixed_data_source: str | None = None,
    ground_truth_column: str = "reward_model.ground_truth",
    extra_info_column: str = "extra_info",
    function_kwargs: Mapping[str, Any] | None = None,
    batch: bool | None = None,
    **columns: Any,
) -> list | Any:
    """verl's call(s) on these samples: a list of the function's scores, or, for an async function, an awaitable of
    it."""
    score = _load(function)
    samples = []
    for index, completion in enumerate(completions):
        data_source = fixed_data_source if fixed_data_source is not None else columns[data_source_column][index]
        extra_info = columns[extra_info_column][index] if extra_info_column in columns else None
        samples.append((data_source, completion_text(completion), _lookup(columns, ground_truth_column, index),
                        _verl_extra_info(extra_info, completion)))
    if is_batch_form(score, batch):
        values = dict(zip(BATCH_KEYWORDS, (list(column) for column in zip(*samples)))) if samples else {}
        return score(**_taken(score, {**dict.fromkeys(BATCH_KEYWORDS, []), **values}), **(function_kwargs or {}))
    results = [score(**_taken(score, dict(zip(SAMPLE_KEYWORDS, sample))), **(function_kwargs or {}))
               for sample in samples]
    if any(inspect.isawaitable(result) for result in results):
        return _gather(results)
    return results


def is_batch_form(score: Callable, batch: bool | None = None) -> bool:
    """Whether `score` is called in verl's batch form: `batch` when given, else whether it takes `solution_strs`."""
    if batch is not None:
        return bool(batch)
    try:
        return "solution_strs" in inspect.signature(score).parameters
    except (TypeError, ValueError):
        return False


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
    function: str = VERL_DEFAULT,
    function_kwargs: Mapping[str, Any] | None = None,
    batch: bool | None = None,
    **_: Any,
) -> str | None:
    """The function loads, and takes verl's call with these `function_kwargs`."""
    if batch is not None and not isinstance(batch, bool):
        return f"kwargs.batch must be true, false or null, not {batch!r}"
    try:
        score = _load(function)
    except RewardConfigError as err:
        return f"kwargs.function: {err}"
    try:
        signature = inspect.signature(score)
    except (TypeError, ValueError):
        return None
    names = BATCH_KEYWORDS if is_batch_form(score, batch) else SAMPLE_KEYWORDS
    keywords = [*_taken(score, dict.fromkeys(names)), *(function_kwargs or {})]
    form = "verl's batch form" if names is BATCH_KEYWORDS else "verl"
    if names[1] not in keywords:
        return f"kwargs.function {function!r} takes no {names[1]}, so it cannot be called as {form} calls it"
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        return f"kwargs.function {function!r} cannot be called as {form} calls it ({', '.join(keywords)}): {err}"
    return None


compute_score.columns_read = columns_read
compute_score.startup_check = startup_check


@lru_cache(maxsize=None)
def _load(function: str) -> Callable:
    return load_reward(function)


def _keyword_parameters(score: Callable) -> set[str] | None:
    """The names `score` takes by keyword; None when it takes any (**kwargs) or has no signature to read."""
    try:
        parameters = inspect.signature(score).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {parameter.name for parameter in parameters if parameter.kind in keyword_kinds}


def _taken(score: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """Those of verl's `arguments` that `score` takes by name (all of them where it takes **kwargs)."""
    names = _keyword_parameters(score)
    return arguments if names is None else {key: value for key, value in arguments.items() if key in names}


def _verl_extra_info(extra_info: Any, completion: Any) -> Any:
    """The row's extra_info as verl's reward managers hand it on: a copy of its own per call (the managers add keys,
    and so may the function) with `num_turns` and `rollout_reward_scores` set."""
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        return extra_info
    return {**extra_info, "num_turns": num_turns(completion), "rollout_reward_scores": {}}


def num_turns(completion: Any) -> int:
    """verl's count: the prompt is one turn, each assistant reply one, and each run of tool (or user) messages between
    them one. A text completion, or one assistant message, makes 2."""
    if isinstance(completion, str):
        return 2
    roles = [message.get("role") for message in completion if isinstance(message, Mapping)]
    return 1 + sum(1 for _ in itertools.groupby(roles))


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
