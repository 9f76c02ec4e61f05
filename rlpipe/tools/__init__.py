"""Multi-turn episodes with tools, on TRL's contracts (GRPOTrainer's `tools=` and `environment_factory=`), kept as
token ids from start to end.

- Tools are plain functions named by import path; an environment factory is a class whose instances hold one
  episode's state: `reset(**row)` starts the episode (a string it returns is appended to the last user message, as
  TRL does) and its public methods are the episode's tools. Schemas come from signatures and docstrings
  (`transformers.utils.get_json_schema`), as chat templates take them.
- Token-in/token-out: the model's tokens are kept exactly as the engine sampled them, with the engine's log-probs;
  after a turn that calls tools, only the new tool messages are rendered through the chat template (the suffix after
  the rendered history, TRL's `_get_tool_suffix_ids`) and their ids appended with mask 0. Nothing the model produced
  is decoded and tokenized again.
- Every turn submits the next request of every live episode together (`sample_turn`), so the engine batches
  episodes across turns.
- A tool that raises, is unknown, or outlives `rollout.tool_timeout_s` becomes `{"error": ...}` in the conversation
  (TRL's rendering of a failed call); the episode goes on. Calls run on threads of their own (ToolThreads), held by
  the engine's episode runner: one past its time limit is written off, not waited for.
- The built-in tools, `calculator` and `python` (model-written code in the kernel sandbox, never in this process);
  recipes name them here, as `rlpipe.tools:calculator` and `rlpipe.tools:python`.

A module per job: loading.py (the recipe's tools and environment factory, checked), render.py (chat rendering of tool
turns, tool-call parsing), calls.py (calls with deadlines on threads their owner holds), episodes.py (the engine-free
episode loop), runner.py (the engine's episode runner, single- or multi-turn), builtins.py (the built-in tools). This
module gathers their public names for recipes, tests and benchmarks; it imports only its own modules, and not
runner.py, which the engine imports.
"""

from __future__ import annotations

# The built-in tools, under the names recipes give them (`rlpipe.tools:python`).
from rlpipe.tools.builtins import PYTHON_LIMITS, ProgramFailed, calculator, python, sandboxed_python
from rlpipe.tools.calls import MAX_RUNNING_TOOL_CALLS, MAX_STUCK_TOOL_CALLS, ToolCall, ToolThreads, run_tool_calls
from rlpipe.tools.episodes import Episode, EpisodeLimits, Turn, run_episodes
from rlpipe.tools.loading import (
    ToolConfigError,
    ToolSet,
    check_tools,
    environment_tools,
    load_object,
    load_tools,
    sandboxed_tools,
    tool_schemas,
)
from rlpipe.tools.render import (
    MAX_CALL_DEPTH,
    TOOLS_SYSTEM_BLOCK,
    parse_tool_calls,
    render_conversation,
    tool_call_bodies,
    tool_suffix_ids,
)

__all__ = [
    "MAX_CALL_DEPTH", "MAX_RUNNING_TOOL_CALLS", "MAX_STUCK_TOOL_CALLS", "PYTHON_LIMITS", "TOOLS_SYSTEM_BLOCK",
    "Episode", "EpisodeLimits", "ProgramFailed", "ToolCall", "ToolConfigError", "ToolSet", "ToolThreads", "Turn",
    "calculator", "check_tools", "environment_tools", "load_object", "load_tools", "parse_tool_calls", "python",
    "render_conversation", "run_episodes", "run_tool_calls", "sandboxed_python", "sandboxed_tools", "tool_call_bodies",
    "tool_schemas", "tool_suffix_ids",
]
