"""rlpipe from Python: `rlpipe.load_config` and `rlpipe.train`, the same runs as `rlpipe train`, with reward
functions given as callables the way TRL's GRPOTrainer takes `reward_funcs`.

    import rlpipe

    def short(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    summary = rlpipe.train("my_recipe.yaml", reward_funcs=[short, "rlpipe.rewards.math:numeric_answer"],
                           **{"train.steps": 20}, rollout={"group_size": 4})

Overrides are the CLI's dotted keys as keyword arguments (`**{"train.steps": 20}`) or a section as a mapping
(`rollout={"group_size": 4}`); a string value is read as the CLI reads `key=value` text, any other value is taken
as it is. Errors are raised, one line each: ConfigError (a key), RewardConfigError (a reward function),
CheckpointError, HubPushError, and mid-run RewardFailure, WorkerLost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from rlpipe.config import Config, ConfigError, error_line, load_yaml
from rlpipe.config.coerce import OverrideText, build
from rlpipe.config.loading import _set_path, default_recipe, find_recipe

if TYPE_CHECKING:
    from rlpipe.run.progress import RunProgress

RecipeLike = Union[str, os.PathLike, Mapping[str, Any], Config, None]
RewardFunc = Union[Callable[..., Any], str]



def load_config(config: RecipeLike = None, **overrides: Any) -> Config:
    """The checked config of a run: `config` (a recipe path or shipped recipe name, a mapping shaped like a recipe,
    a Config, or None for the default recipe) with `overrides` applied. Raises ConfigError naming the key."""
    tree = _recipe_tree(config)
    for dotted, value in _flatten(overrides):
        _set_path(tree, dotted.split("."), OverrideText(value) if isinstance(value, str) else value, dotted)
    built = build(Config, tree)
    # A reward file named relative to the recipe means the recipe's folder, as `rlpipe train` reads it.
    built.reward.resolve_files(find_recipe(config).parent if isinstance(config, (str, os.PathLike)) else None)
    built.check()
    return built


def train(
    config: RecipeLike = None,
    *,
    reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
    reward_weights: Sequence[float] | None = None,
    tools: Sequence[Callable[..., Any] | str] | None = None,
    environment_factory: type | str | None = None,
    resume: str | None = None,
    auto_resume: bool = False,
    **overrides: Any,
) -> dict:
    """Run GRPO post-training as `rlpipe train` does and return the run's summary (also <run_dir>/summary.json):
    held-out accuracy before and after (`eval_before`, `eval_after`), the export folder, the Hub commit when
    metrics.push_to_hub is set.

    `reward_funcs` replaces reward.functions: each a callable or a name (an import path "module:function", a
    built-in name, or a reward model's folder or Hub id, scored as TRL scores it), with `reward_weights` (default 1.0
    each). A callable from an installed package travels as its
    import path; one defined in your script, notebook or a module beside it travels by value (cloudpickle), so the
    reward workers need neither your files nor PYTHONPATH. A reward module named by import path in a recipe is also
    found in the recipe's folder and in the current directory. `tools` and `environment_factory` replace
    rollout.tools and rollout.environment_factory (TRL's GRPOTrainer arguments of those names; docs/tools.md), each
    a callable or class passed the same way, or an import path. `resume`: "latest" or a checkpoint/run directory;
    `auto_resume`: restart from the latest checkpoint when a worker is lost for good.
    """
    search = [str(Path.cwd())]
    if isinstance(config, (str, os.PathLike)):
        search.insert(0, str(find_recipe(config).resolve().parent))
    add_reward_search_path(*search)
    if reward_funcs is not None:
        overrides = {**overrides, "reward.functions": reward_specs(reward_funcs, reward_weights)}
    elif reward_weights is not None:
        raise ConfigError("reward_weights: given without reward_funcs")
    if tools is not None:
        overrides = {**overrides, "rollout.tools": [_named(tool, f"tools[{i}]") for i, tool in enumerate(tools)]}
    if environment_factory is not None:
        overrides = {**overrides, "rollout.environment_factory": _named(environment_factory, "environment_factory")}
    cfg = load_config(config, **overrides)
    check_by_value_rewards(cfg)
    if cfg.metrics.push_to_hub:
        from rlpipe.run.hub_push import check_can_push

        check_can_push(cfg.metrics.push_to_hub, "metrics.push_to_hub")

    from rlpipe.run.hub_push import after_run

    return after_run(cfg, train_with_restarts(cfg, resume, auto_resume))


def train_with_restarts(
    cfg: Config, resume: str | None, auto_resume: bool, progress: RunProgress | None = None
) -> dict:
    """`rlpipe train` and `rlpipe.train`; with `auto_resume`, a run that loses a worker for good starts again from its
    latest checkpoint (from the beginning when it has none: the run directory then holds only what this run wrote).
    Raises WorkerLost when it gives up. `progress`, where given, holds the step reached and the newest checkpoint
    when it returns or raises."""
    import ray

    from rlpipe.actors.calls import WorkerLost
    from rlpipe.actors.placement import PlacementTimeout
    from rlpipe.training import checkpoint
    from rlpipe.training.checkpoint import CheckpointError
    from rlpipe.run.controller import train
    from rlpipe.run.progress import RunProgress, steps_in_words

    progress = RunProgress() if progress is None else progress
    restarts = 0
    while True:
        try:
            return train(cfg, resume, progress)
        except (WorkerLost, ray.exceptions.RayActorError, PlacementTimeout) as err:
            if isinstance(err, PlacementTimeout) and not restarts:
                raise  # at the run's start: the cluster never had the room this configuration asks for
            first = error_line(err)
            if not auto_resume or restarts == cfg.train.max_auto_resumes:
                raise WorkerLost(first) from err
            restarts += 1
            try:
                resume, where = "latest", checkpoint.resolve(cfg.run_dir).name
            except CheckpointError:
                resume, where = None, "the beginning (no checkpoint yet)"
                cfg.run.overwrite = True
            lost = progress.lost_steps()
            again = f": {steps_in_words(*lost)} run again" if lost else ""
            print(f"rlpipe: {first}; restarting from {where}{again} (auto-resume {restarts} of "
                  f"{cfg.train.max_auto_resumes})", file=sys.stderr)


def reward_specs(funcs: RewardFunc | Sequence[RewardFunc], weights: Sequence[float] | None = None) -> list[dict]:
    """reward.functions entries for `funcs` (callables or names), weighted by `weights` (default 1.0 each)."""
    from rlpipe.usercode.callables import by_value_name

    funcs = [funcs] if callable(funcs) or isinstance(funcs, str) else list(funcs)
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward_funcs")
    specs = []
    for index, (func, weight) in enumerate(zip(funcs, weights)):
        if isinstance(func, str):
            name = func
        elif callable(func):
            name = _import_path(func) or by_value_name(func)
        else:
            raise ConfigError(f"reward_funcs[{index}]: {type(func).__name__} is neither a callable nor a name")
        specs.append({"name": name, "weight": weight})
    return specs


def _named(target: Callable | str, where: str) -> str:
    """How a tool or environment factory given to `train` is named in the config: a name as it is, a callable by
    import path where every worker imports it so, else by value."""
    from rlpipe.usercode.callables import by_value_name

    if isinstance(target, str):
        return target
    if not callable(target):
        raise ConfigError(f"{where}: {type(target).__name__} is neither a callable nor an import path")
    return _import_path(target) or by_value_name(target)


def add_reward_search_path(*folders: str) -> None:
    """Let every process of the run (this one, the reward workers of a local cluster, their child processes) import
    reward modules from `folders` too, after its own sys.path (rlpipe/usercode/callables.py reads RLPIPE_REWARD_PATH)."""
    from rlpipe.usercode.callables import SEARCH_PATH_VARIABLE

    known = [f for f in os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep) if f]
    os.environ[SEARCH_PATH_VARIABLE] = os.pathsep.join(dict.fromkeys([*known, *folders]))


def check_by_value_rewards(cfg: Config) -> None:
    """A reward function passed by value needs cloudpickle where the reward workers run: refused before anything
    starts when placement.reward.python names an environment that lacks it."""
    from rlpipe.usercode.callables import BY_VALUE_PREFIX, shown_name

    by_value = [f.name for f in cfg.reward.functions if f.name.startswith(BY_VALUE_PREFIX)]
    if not by_value or cfg.placement.reward.python is None:
        return
    from rlpipe.startup.interpreters import interpreter
    from rlpipe.startup.preflight import check_environment

    key = "placement.reward.python"
    try:
        check_environment(key, interpreter(key, cfg.placement.reward.python), ["cloudpickle"])
    except ConfigError as err:
        raise ConfigError(
            f"{err} — needed by reward function {shown_name(by_value[0])}; install cloudpickle there, or name the "
            f"function by its import path 'module:function'"
        ) from None


def _import_path(func: Callable) -> str | None:
    """"module:qualname" for a function every worker imports the same way (from an installed package), else None."""
    from rlpipe.usercode.callables import importable_everywhere

    module = sys.modules.get(getattr(func, "__module__", None) or "")
    qualified = getattr(func, "__qualname__", "")
    if module is None or module.__name__ == "__main__" or "<" in qualified or not qualified:
        return None
    if not importable_everywhere(module):
        return None
    target: Any = module
    for part in qualified.split("."):
        target = getattr(target, part, None)
    return f"{module.__name__}:{qualified}" if target is func else None


def _recipe_tree(config: RecipeLike) -> dict:
    import copy

    if config is None:
        return load_yaml(default_recipe())
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return load_yaml(find_recipe(config))
    raise ConfigError(f"config: expected a recipe path, a mapping or a Config, not {type(config).__name__}")


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) pairs; a mapping given for a section (or for a dotted key naming one) is opened up, a
    mapping given for a key that holds mappings (reward.functions' kwargs) is reached by its full dotted key."""
    pairs = []
    for name, value in overrides.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, Mapping) and _is_section(dotted):
            pairs.extend(_flatten(value, f"{dotted}."))
        else:
            pairs.append((dotted, value))
    return pairs


def _is_section(dotted: str) -> bool:
    import dataclasses
    import typing

    node: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
    return dataclasses.is_dataclass(node)
