"""prime-rl's `verifiers` (0.4) task sets as an rlpipe prompt source and reward (data.source: verifiers).

A verifiers environment is a task set (the data: typed tasks with a prompt, and `@vf.reward` methods that score a
trace) played by a harness (the agent loop: a program whose model calls verifiers intercepts). rlpipe's engine is the
agent loop here, so it takes the task set: its tasks become prompt rows, and `taskset_reward` scores each completion
with the task's own rewards, weighted and summed as verifiers sums them (`Task.score`, `Trace.reward`); the tools of
its shared tool servers are served in the engine's process (`taskset_tools`). What needs a verifiers runtime, a
container, episode state kept by verifiers or a tool server per episode is refused at start-up in one line.
Imported only when a recipe uses it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json

from rlpipe.config.errors import ConfigError, one_line
from rlpipe.optional import optional_source
from rlpipe.rewards.contract import RESERVED_COLUMNS

TASKSET_COLUMN = "verifiers_taskset"
INDEX_COLUMN = "verifiers_idx"


def _verifiers():
    return optional_source("verifiers.v1", "verifiers", "verifiers")


def load_taskset(spec: str, where: str = "data.verifiers_taskset"):
    """The task set `spec` names: an import path 'package.module:function' of a function returning a vf.Taskset, or
    the id of an installed verifiers task set (vf.load_taskset)."""
    vf = _verifiers()
    where = f"{where}: {spec!r}"
    try:
        if ":" in spec:
            module_name, _, name = spec.partition(":")
            target = importlib.import_module(module_name)
            for part in name.split("."):
                target = getattr(target, part)
            taskset = target()
        else:
            from verifiers.v1.utils.loaders import taskset_config_type

            taskset = vf.load_taskset(taskset_config_type(spec)(id=spec))
    except ConfigError:
        raise
    except Exception as err:  # the user's module or the task set's constructor may fail with any error
        raise ConfigError(f"{where}: cannot load it ({type(err).__name__}: {one_line(err)})") from None
    if not isinstance(taskset, vf.Taskset):
        raise ConfigError(f"{where}: returned a {type(taskset).__name__}, not a verifiers Taskset")
    return taskset


def refusal(taskset) -> str | None:
    """Why rlpipe cannot play this task set with its own episode loop, or None when it can."""
    vf = _verifiers()
    task_type = type(taskset).task_type()
    name = f"task set {type(taskset).__name__} (tasks {task_type.__name__})"
    if getattr(task_type, "NEEDS_CONTAINER", False):
        return f"{name} needs a container per task, which rlpipe's episodes do not run"
    if taskset.INFINITE:
        return f"{name} is infinite; rlpipe reads a task set's tasks once, at start-up"
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(task_type, hook) is not getattr(vf.Task, hook):
            return f"{name} overrides Task.{hook}, which runs in a verifiers runtime rlpipe does not have"
    return None


class TasksetTool:
    """One tool of a task set's shared tool server (Taskset.toolsets), served in this process: its MCP server is
    built as verifiers builds it (`Toolset.register`), the model sees the schema verifiers advertises (the server's
    name, `_`, the tool's), and a call goes through the server (arguments validated, content as text)."""

    def __init__(self, server, raw_name: str, schema: dict):
        self.server = server
        self.raw_name = raw_name
        self.json_schema = schema
        self.__name__ = schema["function"]["name"]

    async def __call__(self, **arguments):
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        result = await self.server.call_tool(self.raw_name, arguments)
        content = mcp_content_to_chat_content(result.content)
        if result.is_error:
            raise RuntimeError(content)
        return content


def _toolset_refusal(toolset) -> str | None:
    from verifiers.v1.mcp.server import ServerBase
    from verifiers.v1.state import state_cls

    vf = _verifiers()
    name = f"tool server {type(toolset).__name__}"
    if state_cls(type(toolset)) is not vf.State:
        return f"{name} keeps episode state (its State), which verifiers syncs over a channel rlpipe does not run"
    if getattr(toolset.config, "url", None):
        return f"{name} is remote (config.url); rlpipe serves task set tools in its own process only"
    for hook in ("setup", "setup_task"):
        if getattr(type(toolset), hook) is not getattr(ServerBase, hook):
            return f"{name} overrides {hook}, which rlpipe does not run"
    return None


async def _served_tools(toolsets) -> list[TasksetTool]:
    from mcp.server.mcpserver import MCPServer

    tools = []
    for toolset in toolsets:
        server = MCPServer(toolset.server_name or None)
        toolset.register(server)
        for tool in await server.list_tools():
            full = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            schema = {"name": full, "description": tool.description or "", "parameters": tool.input_schema}
            tools.append(TasksetTool(server, tool.name, {"type": "function", "function": schema}))
    return tools


def taskset_tools(spec: str, where: str = "rollout.verifiers_tools") -> list[TasksetTool]:
    """The tools of the task set's shared tool servers (Taskset.toolsets), each `@vf.tool` method one rlpipe tool."""
    taskset = load_taskset(spec, where)
    toolsets = taskset.toolsets(taskset.config)
    problem = next((p for p in map(_toolset_refusal, toolsets) if p), None)
    if problem:
        raise ConfigError(f"{where}: {spec!r}: {problem}")
    tools = asyncio.run(_served_tools(toolsets))
    if not tools:
        raise ConfigError(f"{where}: {spec!r} serves no tools (Taskset.toolsets); leave it unset")
    return tools


def _task_refusal(task) -> str | None:
    name = f"task {task.data.idx} ({type(task).__name__})"
    if task.toolsets(task.config):
        return (
            f"{name} starts tool servers per episode (Task.toolsets), which rlpipe does not run; serve them from "
            "Taskset.toolsets (rollout.verifiers_tools)"
        )
    if task.config.judges:
        return f"{name} has judges (task.judges), which call a model rlpipe does not serve"
    for fn in task.hooks("reward"):
        runtime = inspect.signature(fn).parameters.get("runtime")
        if runtime is not None and runtime.default is inspect.Parameter.empty:
            return f"{name}: reward {fn.__name__} needs a verifiers runtime (its runtime argument); rlpipe has none"
    return None


@functools.cache
def tasks(spec: str) -> list:
    """The task set's tasks, in its order (each with its `idx`), checked; loaded once per process."""
    taskset = load_taskset(spec)
    problem = refusal(taskset)
    loaded = list(taskset)
    problem = problem or next((p for p in map(_task_refusal, loaded) if p), None)
    if problem:
        raise ConfigError(f"data.verifiers_taskset: {spec!r}: {problem}")
    if not loaded:
        raise ConfigError(f"data.verifiers_taskset: {spec!r} has no tasks")
    return loaded


def _prompt_messages(data) -> list[dict]:
    prompt = data.prompt
    if prompt is None:
        raise ConfigError(f"data.verifiers_taskset: task {data.idx} has no prompt; rlpipe's episodes start from one")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        message.model_dump(mode="json", exclude_none=True) for message in prompt
    ]
    if data.system_prompt and not any(message["role"] == "system" for message in messages):
        messages = [{"role": "system", "content": data.system_prompt}, *messages]
    return messages


def _row(spec: str, task, prompt_field: str) -> dict:
    """A task as a dataset row: its chat prompt, the task set and index the reward finds it by, and its own fields
    beyond verifiers' TaskData (`answer`, `info`, ...) as the columns reward functions receive."""
    from verifiers.v1.task import TaskData

    data = task.data
    own = {
        name: value
        for name, value in data.model_dump(mode="json").items()
        if name not in TaskData.model_fields and name not in RESERVED_COLUMNS and name != prompt_field
    }
    return {prompt_field: _prompt_messages(data), **own, TASKSET_COLUMN: spec, INDEX_COLUMN: data.idx}


def taskset_rows(spec: str, prompt_field: str, eval_size: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): the task set's tasks, the last eval_size held out (as data.source=file)."""
    rows = [_row(spec, task, prompt_field) for task in tasks(spec)]
    if eval_size and eval_size >= len(rows):
        raise ConfigError(f"data.eval_size: {eval_size} leaves no training rows in {spec} ({len(rows)} tasks)")
    cut = len(rows) - eval_size
    return rows[:cut], rows[cut:]


def _tool_call(index: int, call: dict):
    from verifiers.v1.types import ToolCall

    function = call.get("function", call)
    arguments = function.get("arguments", {})
    return ToolCall(
        id=call.get("id") or f"call_{index}",
        name=function["name"],
        arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
    )


def _message(message: dict, call_ids: list[str]):
    """An rlpipe (TRL) chat message as verifiers' typed message; a tool message answers the oldest unanswered call."""
    from verifiers.v1 import types

    role = message["role"]
    if role == "assistant":
        calls = [_tool_call(len(call_ids) + i, call) for i, call in enumerate(message.get("tool_calls") or [])]
        call_ids.extend(call.id for call in calls)
        return types.AssistantMessage(content=message.get("content"), tool_calls=calls or None)
    if role == "tool":
        call_id = message.get("tool_call_id") or (call_ids.pop(0) if call_ids else "call")
        return types.ToolMessage(tool_call_id=call_id, content=str(message["content"]), name=message.get("name"))
    if role == "system":
        return types.SystemMessage(content=message["content"])
    return types.UserMessage(content=message["content"])


def episode_trace(task, prompt: str | list[dict], completion: str | list[dict]):
    """A verifiers Trace of one sample: the prompt's messages, then the completion's, the model's marked sampled."""
    vf = _verifiers()
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    prompt_messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    completion_messages = (
        [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    )
    call_ids: list[str] = []
    nodes = []
    for sampled, message in [(False, m) for m in prompt_messages] + [(True, m) for m in completion_messages]:
        nodes.append(
            MessageNode(
                parent=len(nodes) - 1 if nodes else None,
                message=_message(message, call_ids),
                sampled=sampled and message["role"] == "assistant",
            )
        )
    return vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
        is_completed=True,
        ok=True,
    )


async def taskset_reward(prompts, completions, verifiers_taskset, verifiers_idx, **kwargs) -> list[float]:
    """The task's own `@vf.reward` methods (and rewards its config plugs in) on each sample, weighted and summed as
    verifiers sums them; each method gets what it asks for by name (`task`: the task's data, `trace`)."""
    by_index = {spec: {task.data.idx: task for task in tasks(spec)} for spec in set(verifiers_taskset)}
    task_list = [by_index[spec][index] for spec, index in zip(verifiers_taskset, verifiers_idx)]
    traces = [episode_trace(task, prompt, done) for task, prompt, done in zip(task_list, prompts, completions)]
    await asyncio.gather(*(task.score(trace) for task, trace in zip(task_list, traces)))
    return [trace.reward for trace in traces]
