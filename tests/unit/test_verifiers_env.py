"""verifiers task sets as prompts and rewards (rlpipe/data/verifiers.py), on real task sets built with the installed
verifiers package (tests/unit/verifiers_tasksets.py)."""

from __future__ import annotations

import asyncio

import pytest

from rlpipe.bench.tiny_model import build_tokenizer
from rlpipe.config import DataConfig, RolloutConfig
from rlpipe.data.prompts import load_rows, reward_columns
from rlpipe.rewards.runner import RewardRunner
from rlpipe.tools import ToolSet, render_conversation, run_episodes
from rlpipe.data.verifiers import episode_trace, taskset_reward, tasks
from tests.unit.test_data import _config_error
from tests.unit.test_tools import LIMITS, ScriptedEngine, _episode, call_text

SUMS = "tests.unit.verifiers_tasksets:sums"
REWARD = "verifiers"  # the built-in name of rlpipe.data.verifiers:taskset_reward
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
WITH_TOOL = [
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "content": "5"},
    {"role": "assistant", "content": "It is 5"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _verifiers_cfg(taskset: str = SUMS, eval_size: int = 1) -> DataConfig:
    cfg = DataConfig(source="verifiers", verifiers_taskset=taskset, prompt_field="prompt", eval_size=eval_size)
    cfg.check()
    return cfg


def test_tasks_become_chat_prompts_with_their_own_columns():
    train, held_out = load_rows(_verifiers_cfg(), seed=0)
    assert [row["answer"] for row in train] == ["5", "17"] and [row["answer"] for row in held_out] == ["8"]
    assert train[1]["prompt"] == [
        {"role": "system", "content": "Answer with the number last."},
        {"role": "user", "content": "What is 10 + 7?"},
    ]
    assert train[1]["info"] == {"terms": [10, 7]}
    assert reward_columns(train, "prompt") == ["answer", "info", "verifiers_idx", "verifiers_taskset"]
    assert [row["verifiers_idx"] for row in train + held_out] == [0, 1, 2]


def test_the_tasks_own_rewards_weighted_as_verifiers_weights_them():
    train, _ = load_rows(_verifiers_cfg(), seed=0)
    prompts = [row["prompt"] for row in train] * 2
    completions = [WITH_TOOL, [{"role": "assistant", "content": "17"}], [{"role": "assistant", "content": "6"}], "16"]
    scores = asyncio.run(taskset_reward(prompts, completions, [SUMS] * 4, [0, 1, 0, 1]))
    # correct (weight 1) + used_tool (weight 0.5)
    assert scores == [1.5, 1.0, 0.0, 0.0]


@pytest.mark.heavy
def test_the_reward_through_the_reward_runner():
    train, _ = load_rows(_verifiers_cfg(), seed=0)
    runner = RewardRunner([{"name": REWARD, "weight": 2.0}], columns=reward_columns(train, "prompt"))
    try:
        columns = {name: [row[name] for row in train] for name in reward_columns(train, "prompt")}
        columns |= {"completion_tokens": [3, 1], "finish_reason": ["stop", "stop"], "max_tokens": [16, 16]}
        result = runner.score([row["prompt"] for row in train], ["The sum is 5", "16"], columns)
    finally:
        runner.close()
    assert result.first_errors == {}
    assert result.totals == [2.0, 0.0]


def test_a_trace_holds_the_episode_as_verifiers_reads_it():
    task = tasks(SUMS)[0]
    trace = episode_trace(task, [{"role": "user", "content": "What is 2 + 3?"}], WITH_TOOL)
    assert trace.last_reply == "It is 5"
    assert [message.role for message in trace.messages] == ["user", "assistant", "tool", "assistant"]
    assert trace.num_turns == 2
    call = trace.assistant_messages[0].tool_calls[0]
    assert (call.name, call.arguments) == ("calculator", '{"expression": "2 + 3"}')
    assert trace.tool_messages[0].tool_call_id == call.id


def test_what_rlpipe_cannot_play_is_refused_in_one_line():
    message = _config_error(lambda: load_rows(_verifiers_cfg("tests.unit.verifiers_tasksets:with_setup", 0), 0))
    assert "SetupTaskset" in message and "Task.setup" in message
    message = _config_error(lambda: load_rows(_verifiers_cfg("tests.unit.verifiers_tasksets:missing", 0), 0))
    assert message.startswith("data.verifiers_taskset:") and "missing" in message
    message = _config_error(lambda: load_rows(_verifiers_cfg("rlpipe.tools:calculator", 0), 0))
    assert "not a verifiers Taskset" in message or "cannot load" in message
    # An id names an installed task set (vf.load_taskset); verifiers' own multi-line report comes on one line.
    message = _config_error(lambda: load_rows(_verifiers_cfg("openenv", 0), 0))
    assert message.startswith("data.verifiers_taskset: 'openenv': cannot load it (ValidationError")
    assert "base_url" in message
    assert "taskset 'no-such-set' not found" in _config_error(lambda: load_rows(_verifiers_cfg("no-such-set", 0), 0))
    assert "eval_size" in _config_error(lambda: load_rows(_verifiers_cfg(eval_size=3), 0))
    assert "data.verifiers_taskset" in _config_error(DataConfig(source="verifiers").check)


def test_the_task_sets_tools_run_in_an_episode_and_its_rewards_score_it(tokenizer):
    toolset = ToolSet.load([], None, SUMS)
    assert [schema["function"]["name"] for schema in toolset.schemas(None)] == ["arithmetic_add", "arithmetic_divide"]
    assert toolset.schemas(None)[0] == {"type": "function", "function": {
        "name": "arithmetic_add", "description": "Add two integers.",
        "parameters": {"type": "object", "title": "addArguments", "required": ["a", "b"], "properties": {
            "a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}},
    }}
    assert "arithmetic_divide" in tokenizer.decode(
        render_conversation(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}], toolset.schemas(None))
    )
    episode = _episode(tokenizer, "A", toolset.tools)
    engine = ScriptedEngine(tokenizer, {episode.prompt_ids[0]: [
        call_text("arithmetic_add", a=2, b=3) + call_text("arithmetic_divide", a=1, b=0), "The sum is 5",
    ]})
    run_episodes([episode], engine, tokenizer, LIMITS)
    answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert answers[0] == "5" and answers[1].startswith("{'error': ") and "division by zero" in answers[1]
    assert (episode.tool_calls, episode.tool_errors) == (2, 1)
    prompt = load_rows(_verifiers_cfg(), seed=0)[0][0]["prompt"]
    assert asyncio.run(taskset_reward([prompt], [episode.messages], [SUMS], [0])) == [1.5]


def test_tools_verifiers_serves_with_state_are_refused():
    message = _config_error(lambda: ToolSet.load([], None, "tests.unit.verifiers_tasksets:with_setup"))
    assert message.startswith("rollout.verifiers_tools:") and "CountingTools keeps episode state" in message
    assert "rollout.verifiers_tools" in _config_error(RolloutConfig(verifiers_tools="").check)
    assert RolloutConfig(verifiers_tools=SUMS).multi_turn
