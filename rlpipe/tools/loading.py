"""The recipe's tools and environment factory, loaded and checked: import paths (or callables `rlpipe.train` passed
by value) resolved, schemas read from signatures and docstrings, and the tools that run model-written code refused
where the sandbox cannot isolate them. It owns `ToolSet` and `ToolConfigError`; it imports rlpipe's config errors,
the sandbox and the by-value registry of rlpipe.rewards, and transformers and rlpipe.data.verifiers only where a
recipe needs them, never the engine or the episode loop."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlpipe.usercode import sandbox
from rlpipe.config.errors import ConfigError

logger = logging.getLogger("rlpipe")


class ToolConfigError(ConfigError):
    """A tool or environment factory named in the recipe cannot be used."""


def load_object(path: str, what: str) -> Any:
    """The object an import path `package.module:attribute` names, or one `rlpipe.train` passed by value."""
    from rlpipe.usercode.callables import BY_VALUE_PREFIX, RewardConfigError, load_by_value

    if path.startswith(BY_VALUE_PREFIX):
        try:
            return load_by_value(path)
        except RewardConfigError as err:
            raise ToolConfigError(f"{what}: {str(err).replace('reward function', 'tool', 1)}") from None
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ToolConfigError(f"{what}: {path!r} is not an import path 'package.module:name'")
    try:
        target = importlib.import_module(module_name)
    except Exception as err:  # the user's module may fail with any error
        raise ToolConfigError(f"{what}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise ToolConfigError(f"{what}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, name)
    if not callable(target):
        raise ToolConfigError(f"{what}: {path!r} is not callable")
    return target


def environment_tools(environment: Any) -> list[Callable]:
    """An environment's tools, as TRL takes them: its class's public functions other than reset and get_reward,
    bound to the instance."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """JSON schemas of the tools as chat templates take them (from their signatures and docstrings)."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:  # a verifiers task set's tool carries the schema verifiers advertises (rlpipe/data/verifiers.py)
            schemas.append(getattr(tool, "json_schema", None) or get_json_schema(tool))
        except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
            raise ToolConfigError(f"rollout.tools: {tool.__name__}: no schema from its signature ({err})") from None
    return schemas


def load_tools(
    tool_paths: Sequence[str], *, tool_timeout_s: float | None = None, unsafe_no_sandbox: bool = False
) -> list[Callable]:
    """The tools `rollout.tools` names, with those that run model-written code checked (sandboxed_tools)."""
    return sandboxed_tools([load_object(path, "rollout.tools") for path in tool_paths], tool_timeout_s,
                           unsafe_no_sandbox)


def check_tools(rollout) -> None:
    """The driver's start-up check of `rollout.tools` (a RolloutConfig), before any cluster starts: each loads, and
    one that runs model-written code can run here. Every engine checks again where its tools run."""
    load_tools(rollout.tools, tool_timeout_s=rollout.tool_timeout_s, unsafe_no_sandbox=rollout.unsafe_no_sandbox)


@dataclass
class ToolSet:
    """The recipe's tools and environment factory, loaded (in the engine's process, where episodes run)."""

    tools: list[Callable] = field(default_factory=list)
    environment_factory: Callable | None = None

    @classmethod
    def load(
        cls,
        tool_paths: Sequence[str],
        factory_path: str | None,
        verifiers_tools: str | None = None,
        *,
        tool_timeout_s: float | None = None,
        unsafe_no_sandbox: bool = False,
    ) -> ToolSet:
        """The recipe's tools and factory, loaded and checked: a tool that runs model-written code is refused where
        the sandbox cannot isolate it (unless `unsafe_no_sandbox`) or where `tool_timeout_s` would cut it first."""
        tools = load_tools(tool_paths, tool_timeout_s=tool_timeout_s, unsafe_no_sandbox=unsafe_no_sandbox)
        if verifiers_tools:
            from rlpipe.data.verifiers import taskset_tools  # only a recipe that names a verifiers task set imports it

            tools += taskset_tools(verifiers_tools)
        factory = load_object(factory_path, "rollout.environment_factory") if factory_path else None
        toolset = cls(tools, factory)
        toolset.schemas(toolset.new_environment())  # every schema is read now: a bad docstring fails at start-up
        return toolset

    def __bool__(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None

    def new_environment(self) -> Any:
        if self.environment_factory is None:
            return None
        environment = self.environment_factory()
        if not callable(getattr(environment, "reset", None)):
            raise ToolConfigError("rollout.environment_factory: its instances must define reset(**row), as TRL's do")
        return environment

    def episode_tools(self, environment: Any) -> list[Callable]:
        return self.tools + (environment_tools(environment) if environment is not None else [])

    def schemas(self, environment: Any) -> list[dict]:
        return tool_schemas(self.episode_tools(environment))



_STOP_MARGIN_S = 3.0  # past the sandbox's wall limit: killing the program and collecting what it wrote


def sandboxed_tools(tools: list[Callable], tool_timeout_s: float | None, unsafe_no_sandbox: bool) -> list[Callable]:
    """`tools` checked for those that run model-written code (they carry `sandbox_limits`, as `python` does): where
    the sandbox cannot isolate programs here they are refused; with `unsafe_no_sandbox` they run without it,
    with a warning, as the code rewards do with theirs; a `tool_timeout_s` that would end a call before the sandbox
    stops its program is refused."""
    checked = []
    for tool in tools:
        limits = getattr(tool, "sandbox_limits", None)
        if limits is None:
            checked.append(tool)
            continue
        name = tool.__name__
        if tool_timeout_s is not None and limits.wall_s + _STOP_MARGIN_S > tool_timeout_s:
            raise ToolConfigError(
                f"rollout.tool_timeout_s: {tool_timeout_s:g} s would end a call to {name} before its sandbox stops "
                f"the program ({limits.wall_s:g} s wall limit + {_STOP_MARGIN_S:g} s); set it to at least "
                f"{limits.wall_s + _STOP_MARGIN_S:g}"
            )
        if unsafe_no_sandbox:
            logger.warning(
                "rlpipe: tool %s runs model-written programs WITHOUT the sandbox (rollout.unsafe_no_sandbox): they can "
                "read and write this machine's files, reach the network and outlive the call. Only for code you "
                "would run yourself.", name,
            )
            checked.append(tool.without_sandbox())
            continue
        problem = sandbox.missing_isolation() if tool.isolated else "it was built without the sandbox"
        if problem:
            raise ToolConfigError(
                f"rollout.tools: {name} runs model-written code, and {problem}; set rollout.unsafe_no_sandbox=true "
                f"to run it without (unsafe)"
            )
        checked.append(tool)
    return checked
