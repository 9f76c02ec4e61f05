"""Callables named in config, resolved from their names: reward functions, and tools and environment factories too.

This module owns how a name becomes a callable in any process (the reward workers, the engines' tool loading, the
driver) and how a function travels by value to them; what reads a config for people (model cards, trackers, logs)
shows such names through `readable`. It imports only the standard library (cloudpickle on use), nothing of rlpipe,
so that rlpipe.rewards, rlpipe.tools and the core all import it without reaching into one another.

Accepted names:
  - an import path `"package.module:function"` (the attribute may be dotted: `"mod:Class.method"`); a module not
    found on sys.path is also looked for in the folders of RLPIPE_REWARD_PATH (`rlpipe train` and `rlpipe.train`
    add the recipe's folder and the current directory, so that a rewards.py there imports in every worker),
  - a file path `"path/to/file.py:function"` (as verl names custom reward functions; a relative path is taken from
    the working directory: the config resolves recipe-relative paths before they get here),
  - a built-in short name (see `BUILTIN_REWARDS`),
  - a name registered by an installed package under the entry-point group `rlpipe.rewards`,
  - a function carried by value, `"by-value:<signature>.<cloudpickle, base64>:<qualified name>"` (`by_value_name`):
    how `rlpipe.train(reward_funcs=[fn])` (and its `tools=`, `environment_factory=`) hands a function defined in the user's own script or notebook to the
    workers; signed with a key of the process that made it, which its local cluster's workers inherit.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import importlib.util
import os
import pickle
import secrets
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

ENTRY_POINT_GROUP = "rlpipe.rewards"
SEARCH_PATH_VARIABLE = "RLPIPE_REWARD_PATH"
BY_VALUE_PREFIX = "by-value:"
# A function carried by value is signed with a key this process makes and its local cluster's workers inherit, so
# that a name copied into a recipe or a checkpoint's config (a file that may come from elsewhere) is never unpickled.
BY_VALUE_KEY_VARIABLE = "RLPIPE_BY_VALUE_KEY"

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
    "verifiers": "rlpipe.data.verifiers:taskset_reward",
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
    if path.startswith(BY_VALUE_PREFIX):
        return load_by_value(path)
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
        return _import_module(module_name)
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


def _import_module(name: str):
    """The module `name`; the folders of RLPIPE_REWARD_PATH are searched after sys.path (appended to it, so that a
    math.py beside a recipe never stands in for the standard library's)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing_top = err.name == name.partition(".")[0]
        folders = [f for f in os.environ.get(SEARCH_PATH_VARIABLE, "").split(os.pathsep) if f and f not in sys.path]
        if not (missing_top and folders):
            raise
    sys.path.extend(folders)
    importlib.invalidate_caches()
    return importlib.import_module(name)


def by_value_name(function: Callable) -> str:
    """The name under which `function` travels by value: cloudpickle's serialization (its code, and the globals and
    closure it uses), so that a function defined in a script's `__main__` or a notebook runs in the reward workers
    and their child processes without being importable there. They must run the same Python minor version (Ray
    requires that of every role's environment anyway) and have cloudpickle installed."""
    import cloudpickle

    module = sys.modules.get(getattr(function, "__module__", None) or "")
    registered = False
    if module is not None and module.__name__ != "__main__" and not importable_everywhere(module):
        cloudpickle.register_pickle_by_value(module)  # a module beside the script: its code goes along
        registered = True
    try:
        payload = cloudpickle.dumps(function)
    finally:
        if registered:
            cloudpickle.unregister_pickle_by_value(module)
    qualified = getattr(function, "__qualname__", None) or type(function).__qualname__
    encoded = base64.urlsafe_b64encode(payload).decode("ascii")
    return f"{BY_VALUE_PREFIX}{_signature(_by_value_key(create=True), payload)}.{encoded}:{qualified.replace(':', '_')}"


def _by_value_key(create: bool = False) -> bytes | None:
    key = os.environ.get(BY_VALUE_KEY_VARIABLE)
    if not key and create:
        key = os.environ[BY_VALUE_KEY_VARIABLE] = secrets.token_hex(32)
    return key.encode("ascii") if key else None


def _signature(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def importable_everywhere(module) -> bool:
    """Whether `module` comes from an installed distribution (site-packages), rlpipe included, which every worker
    imports the same way; a module of the user's own folder does not."""
    if module.__name__.partition(".")[0] == "rlpipe":
        return True
    origin = getattr(module, "__file__", None)
    return origin is None or any(part in ("site-packages", "dist-packages") for part in origin.split(os.sep))


def load_by_value(path: str) -> Callable:
    """The callable a `by_value_name` names, rebuilt once its signature is this run's."""
    signed, _, qualified = path[len(BY_VALUE_PREFIX):].rpartition(":")
    signature, _, blob = signed.partition(".")
    where = f"reward function {qualified or '?'!r} (passed by value)"
    try:
        payload = base64.urlsafe_b64decode(blob.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise RewardConfigError(f"{where}: its serialized form is damaged") from None
    key = _by_value_key()
    if key is None or not hmac.compare_digest(signature, _signature(key, payload)):
        raise RewardConfigError(
            f"{where}: not serialized by this run's own process; a function passed by value is taken only from "
            f"rlpipe.train(reward_funcs=...) in the process that runs it, never from a recipe or checkpoint file"
        )
    try:
        import cloudpickle  # noqa: F401  (the payload's reconstructors live in it)
    except ImportError:
        raise RewardConfigError(
            f"{where}: cloudpickle is not installed in {sys.executable}; install it there, or name the function by "
            f"its import path 'module:function'"
        ) from None
    try:
        target = pickle.loads(payload)
    except Exception as err:
        raise RewardConfigError(
            f"{where}: cannot be rebuilt in {sys.executable} (Python {sys.version_info[0]}.{sys.version_info[1]}): "
            f"{describe_error(err)}"
        ) from err
    if not callable(target):
        raise RewardConfigError(f"{where}: {type(target).__name__} object is not callable")
    return target


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


def shown_name(path: str) -> str:
    """How messages name the function `path` names: the path itself, or for a function carried by value its
    qualified name (not the serialized form)."""
    if isinstance(path, str) and path.strip().startswith(BY_VALUE_PREFIX):
        return f"{path.strip().rpartition(':')[2]} (passed by value)"
    return path


def readable(value):
    """`value` (a config as plain data) with every name of something passed by value replaced by its `shown_name`:
    what model cards, trackers and logs may show."""
    if isinstance(value, str):
        return shown_name(value)
    if isinstance(value, dict):
        return {key: readable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(readable(item) for item in value)
    return value


def describe_error(err: BaseException) -> str:
    """`Type: message` on one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"
