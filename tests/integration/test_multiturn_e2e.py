"""The calculator recipe (configs/calculator.yaml) through `rlpipe train` on a tiny model trained to call its tool:
multi-turn episodes with the real calculator in asynchronous mode on a sharded learner, resumed exactly, and with an
engine killed while its episodes are in flight."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rlpipe.config import load_config
from rlpipe.run.controller import train

pytestmark = pytest.mark.integration

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "calculator.yaml"


@pytest.fixture
def recipe(tmp_path) -> Path:
    """The calculator recipe as the tiny tool model takes it: without worked example conversations before the question
    (`data.example_messages`, for a model never trained to call the tool; this one was, on the recipe's system prompt
    and questions alone, and its context stays short)."""
    import yaml

    tree = yaml.safe_load(RECIPE.read_text())
    tree["data"].pop("example_messages", None)
    path = tmp_path / "calculator.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _overrides(run_dir, model_path, name: str) -> list[str]:
    return [
        f"run.output_dir={run_dir}",
        f"run.name={name}",
        f"model.path={model_path}",
        "data.size=16",
        "data.eval_size=4",
        "data.max_prompt_tokens=96",  # the tiny tokenizer's prompts: about 55 tokens
        "rollout.group_size=4",
        "rollout.max_tokens=40",  # a turn: the tool call is about 30 of the tiny tokenizer's tokens
        "rollout.max_model_len=192",  # the episode: prompt (about 55), the call, the tool message, the answer
        "rollout.tool_parser=hermes",  # the tiny template lists the tools' names and teaches no format itself
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.lr=1e-3",
        "ray.num_cpus=6",  # one local cluster serves every test of this module
        "metrics.tensorboard=false",
        "metrics.plot=false",
        "metrics.export=false",
        # The recipe's verifier, and the episode's length in tokens, so that samples of a group differ even where none
        # answers right.
        "reward.functions=[{name: 'rlpipe.rewards.reasoning_gym:verifier'}, "
        "{name: 'tests.unit.trl_doc_rewards:token_count_reward', weight: 0.01}]",
    ]


def _read(run_dir, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def _check_episodes(run_dir) -> None:
    """The steps' episodes called the real calculator; the learner's log-probs of the model's tokens (tool tokens
    masked) agree with the engine's where both hold the same weights, and every sync checked out."""
    records = _read(run_dir, "metrics.jsonl")
    for record in records:
        assert record["tool_call_rate"] > 0 and record["tool_calls"] > 0
        assert record["turns/mean"] > 1
        assert record["sync/probe_max_abs"] < 1e-4  # float32 engine and learner: the default tolerance
        assert record["sync/policy_shift"] > 0  # the steps trained
    # Step 1 samples from the starting weights, which learner and engine share: their log-probs of every model token
    # agree as in single-turn runs (tool tokens, which the engine never sampled, carry no log-prob and are masked).
    assert records[0]["logprob_gap/max_abs"] < 1e-3
    samples = _read(run_dir, "samples.jsonl")
    assert samples and all(len(s["conversations"]) == len(s["turns"]) == len(s["tool_calls"]) for s in samples)
    calls = [(message, reply) for s in samples for conversation in s["conversations"]
             for message, reply in zip(conversation, conversation[1:]) if message.get("tool_calls")]
    assert calls, "no logged episode called a tool"
    for sample in samples:  # the logged text shows each call
        for text, conversation in zip(sample["completions"], sample["conversations"]):
            assert text.count("<tool_call>") >= sum(len(m.get("tool_calls", [])) for m in conversation)
    from rlpipe.tools import calculator

    for message, reply in calls:  # the tool message holds what the real calculator answers to the call
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "calculator" and reply["role"] == "tool"
        try:
            expected = calculator(**call["function"]["arguments"])
        except Exception as err:
            expected = str({"error": str(err)})
        assert reply["content"] == expected


def _kill_the_engine_while_it_generates(killed: list[int]) -> None:
    """SIGKILL the rollout engine's process once it runs a generate call (Ray titles a worker process after the method
    it runs; the run under test is the only one on the machine)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::RolloutActor.generate"):
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
                    return
            except OSError:  # gone meanwhile
                continue
        time.sleep(0.01)


def test_the_calculator_recipe_trains_asynchronously_on_two_learner_ranks_through_an_engine_restart(
        tmp_path, recipe, tiny_tool_model, ray_cluster):
    """The recipe's episodes (with the tiny tool model) for 2 steps in asynchronous mode (step 2's episodes are
    generated by version 0 while step 1 trains), on a sharded learner of 2 ranks, with the Dr. GRPO loss. The only
    engine is killed while it plays step 1's episodes: a new engine takes its place and plays them again from their
    start, and the run completes."""
    killed: list[int] = []
    killer = threading.Thread(target=_kill_the_engine_while_it_generates, args=(killed,), daemon=True)
    killer.start()
    cfg = load_config(recipe, _overrides(tmp_path / "runs", tiny_tool_model, "async") + [
        "data.eval_size=0",  # step 1's episodes are the engine's first generation
        "train.max_staleness=1",
        "algo.tis_cap=2.0",
        "learner.ranks=2",
        "algo.loss=dr_grpo",
    ])
    train(cfg)
    killer.join(timeout=5)
    assert killed, "the engine was never killed"
    run_dir = tmp_path / "runs" / "async"
    _check_episodes(run_dir)
    first, second = _read(run_dir, "metrics.jsonl")
    assert first["rollout/restarts"] == second["rollout/restarts"] == 1
    assert first["samples_trained"] == second["samples_trained"] == 8  # every episode of step 1 was played again
    assert "rollout engine 0 died" in (run_dir / "logs" / "run.log").read_text()
    # Every episode records the policy version that sampled it; a sync waits for the episodes in flight, so an episode
    # is one version's from its first token to its last.
    assert first["staleness/max"] == 0 and second["staleness/max"] == second["staleness/mean"] == 1


def test_a_run_with_tools_resumed_from_a_checkpoint_repeats_the_uninterrupted_run(tmp_path, recipe, tiny_tool_model,
                                                                                  ray_cluster):
    """2 steps in one go, checkpointed after each, against a run resumed from its step-1 checkpoint (`--resume PATH`
    under another run.name): step 2's episodes (their conversations and tool calls) and its metrics are the same,
    held-out figures included; the held-out evaluation reports how many greedy episodes called the tool."""
    base = _overrides(tmp_path / "runs", tiny_tool_model, "whole") + ["train.checkpoint_every=1"]
    summary = train(load_config(recipe, base))
    assert [point["step"] for point in summary["eval"]] == [0, 2]
    assert all(0 <= point["tool_call_rate"] <= 1 for point in summary["eval"])
    assert summary["eval"][0]["tool_call_rate"] > 0  # the tiny model calls the tool before any training
    whole_dir, resumed_dir = tmp_path / "runs" / "whole", tmp_path / "runs" / "resumed"
    train(load_config(recipe, [*base, "run.name=resumed"]), resume=str(whole_dir / "checkpoints" / "step_000001"))

    _check_episodes(resumed_dir)
    whole, resumed = _read(whole_dir, "metrics.jsonl"), _read(resumed_dir, "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2]  # step 1's record from the checkpoint, step 2 run again
    timing = ("time/", "tokens_per_s/", "sync/transfer_s", "sync/write_s", "sync/probe_s", "sync/reference_s")
    compared = [key for key in whole[1] if not key.startswith(timing)]
    assert {"loss", "reward/mean", "tool_call_rate", "turns/mean", "eval/tool_call_rate"} <= set(compared)
    assert set(compared) <= set(resumed[1])
    for key in compared:
        assert resumed[1][key] == pytest.approx(whole[1][key], rel=1e-6, abs=1e-7), key
    step_two = [[s for s in _read(folder, "samples.jsonl") if s["step"] == 2] for folder in (whole_dir, resumed_dir)]
    assert step_two[0] and step_two[0] == step_two[1]
