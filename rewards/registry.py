"""Resolve a reward function from the name written in config.

Accepted names:
  - an import path `"package.module:function"` (the attribute may be dotted: `"mod:Class.method"`),
  - a file path `"path/to/file.py:function"` (as verl names custom reward functions; a relative path is taken from
    the working directory: the config resolves recipe-relative paths before they get here),
  - a built-in short name (see `BUILTIN_REWARDS`),
  - a name registered by an installed package under the entry-point group `rlpipe.rewards`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

ENTRY_POINT_GROUP = "rlpipe.rewards"

# Built-ins are named by import path so that loading `rewards` does not import math-verify or
# reasoning-gym until a config asks for them.
BUILTIN_REWARDS = {
    "numeric_answer": "rlpipe.rewards.math:numeric_answer",
    "exact_match": "rlpipe.rewards.math:exact_match",
    "reasoning_gym": "rlpipe.rewards.reasoning_gym:verifier",
    "code_tests": "rlpipe.rewards.code:tests_pass",
    "format_regex": "rlpipe.rewards.format:regex",
    "format_tags": "rlpipe.rewards.format:tags",
    "overlong": "rlpipe.rewards.shaping:overlong",
    "verl": "rlpipe.rewards.verl:compute_score",
}


class RewardConfigError(ValueError):
    """A reward function named in config cannot be used. The message is one line naming the culprit."""


def load_reward(path: str) -> Callable:
    """Return the callable named by `path` (an import path, file path, built-in name or entry-point name)."""
    if not isinstance(path, str) or not path.strip():
        raise RewardConfigError(
            f"reward name {path!r} is empty or not a string; expected 'package.module:function'"
        )
    path = path.strip()
    if ":" not in path:
        return _load_short_name(path)

    if is_file_reference(path):
        file_name, attribute_path = split_file_reference(path)
        if not attribute_path:
            raise RewardConfigError(f"reward path {path!r} is malformed; expected 'path/to/file.py:function'")
        module = _load_file(path, file_name)
    else:
        module_name, _, attribute_path = path.partition(":")
        if not module_name or not attribute_path:
            raise RewardConfigError(f"reward path {path!r} is malformed; expected 'package.module:function'")
        module = _import(path, module_name)

    target = module
    for attribute in attribute_path.split("."):
        try:
            target = getattr(target, attribute)
        except AttributeError:
            raise RewardConfigError(
                f"reward path {path!r}: {type(target).__name__} {getattr(target, '__name__', '')!r} "
                f"has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise RewardConfigError(f"reward path {path!r}: {type(target).__name__} object is not callable")
    return target


def is_file_reference(path: str) -> bool:
    """Whether `path` names a function in a Python file (`dir/file.py:fn`) rather than in an importable module."""
    return path.strip().rpartition(":")[0].endswith(".py")


def split_file_reference(path: str) -> tuple[str, str]:
    """`("dir/file.py", "fn")` from `"dir/file.py:fn"`."""
    file_name, _, attribute = path.strip().rpartition(":")
    return file_name, attribute


def _import(path: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail to import with any error, not only ImportError
        hint = ""
        if module_name.startswith("rewards.") and isinstance(err, ModuleNotFoundError) and err.name == "rewards":
            hint = f" (rlpipe's built-in rewards are rlpipe.rewards: 'rlpipe.{path}')"
        raise RewardConfigError(
            f"reward path {path!r}: cannot import module {module_name!r}: {describe_error(err)}{hint}"
        ) from err


def _load_file(path: str, file_name: str) -> ModuleType:
    """The module of a Python file, executed once per process (as verl loads a custom reward file: its folder is
    not put on sys.path)."""
    file = Path(file_name).expanduser().resolve()
    if not file.is_file():
        raise RewardConfigError(f"reward path {path!r}: file {str(file)!r} not found")
    # One module per file, under a name no import statement can reach, so two files of one name do not collide.
    module_name = f"rlpipe_reward_file_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"reward path {path!r}: {str(file)!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it, as an import does (dataclasses and pickle look it up)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise RewardConfigError(f"reward path {path!r}: running {str(file)!r} failed: {describe_error(err)}") from err
    return module


def _load_short_name(name: str) -> Callable:
    if name in BUILTIN_REWARDS:
        return load_reward(BUILTIN_REWARDS[name])
    registered = entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not registered:
        raise RewardConfigError(
            f"reward name {name!r} is not a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor registered "
            f"under entry-point group {ENTRY_POINT_GROUP!r}; an import path looks like 'pkg.module:function'"
        )
    entry_point = next(iter(registered))
    try:
        target = entry_point.load()
    except Exception as err:
        raise RewardConfigError(
            f"reward name {name!r}: entry point {entry_point.value!r} failed to load: {describe_error(err)}"
        ) from err
    if not callable(target):
        raise RewardConfigError(f"reward name {name!r}: entry point {entry_point.value!r} is not callable")
    return target


def display_name(path: str) -> str:
    """Short name used in metrics: the function part of an import or file path, or the short name itself."""
    return path.strip().rpartition(":")[2].rpartition(".")[2]


def describe_error(err: BaseException) -> str:
    """`Type: message` on one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"
