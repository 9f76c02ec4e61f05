"""Families rlpipe's decoder does not implement, trained end to end on transformers' code (model.impl: auto): Ray
actors, a vLLM engine serving the family, the learner on transformers' modeling code, the checked weight sync every
step, an export that transformers and vLLM load, and an exact resume."""

from __future__ import annotations

import json

import pytest

from rlpipe.bench.tiny_model import build_tiny_model
from rlpipe.config import load_config
from rlpipe.run.controller import train
from tests.integration.test_grpo_e2e import _check_export

pytestmark = pytest.mark.integration


def _overrides(run_dir, model_path, name: str) -> list[str]:
    return [
        f"run.output_dir={run_dir}",
        f"run.name={name}",
        f"model.path={model_path}",
        "rollout.group_size=4",
        "rollout.max_tokens=12",
        "rollout.max_model_len=128",
        "data.max_prompt_tokens=112",
        "data.eval_size=0",
        "train.steps=3",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.lr=1e-3",
        "ray.num_cpus=6",  # one local cluster serves every test of this module
        "sync.probe_tolerance=1e-5",
        "sync.bucket_mb=0.05",  # several buckets even for a tiny model
        "metrics.tensorboard=false",
        "metrics.plot=false",
        # A random model's completions all run to max_tokens: their length in characters still differs.
        "reward.functions=[{name: 'tests.unit.trl_doc_rewards:reward_len'}]",
    ]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["olmo2", "gemma3_text", "phi3", "glm4"])
def test_a_family_rlpipe_does_not_implement_trains_with_every_sync_checked_and_exports(tmp_path, family, ray_cluster):
    model = build_tiny_model(tmp_path / "model", family)
    summary = train(load_config(None, _overrides(tmp_path / "runs", model, family)))
    records = _metrics(tmp_path / "runs" / family)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-5  # the start-up rehearsal
    for record in records:
        # vLLM's model for the family holds exactly the learner's weights after every sync ...
        assert record["sync/probe_max_abs"] < 1e-5 and record["sync/bytes"] > 0, record
        assert record["policy_version"] == record["step"]
        # ... and the log-probs it sampled with are the learner's own (transformers' code against vLLM's).
        assert record["logprob_gap/max_abs"] < 1e-4, record
    assert max(r["sync/policy_shift"] for r in records) > 1e-3  # the weights moved
    _check_export(summary["export"])


def test_a_run_of_a_new_family_resumed_from_its_checkpoint_repeats_the_uninterrupted_run(tmp_path, ray_cluster):
    model = build_tiny_model(tmp_path / "model", "olmo2")
    base = _overrides(tmp_path / "runs", model, "whole") + ["metrics.export=false"]
    train(load_config(None, base))
    split = [*base[:1], "run.name=split", *base[2:]]
    train(load_config(None, [*split, "train.steps=2"]))
    train(load_config(None, split), resume="latest")
    whole, resumed = _metrics(tmp_path / "runs" / "whole"), _metrics(tmp_path / "runs" / "split")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    timing = ("time/", "tokens_per_s/", "sync/transfer_s", "sync/write_s", "sync/probe_s", "sync/reference_s")
    for uninterrupted, again in zip(whole[1:], resumed[1:], strict=True):
        compared = [key for key in uninterrupted if not key.startswith(timing)]
        assert "loss" in compared and "sync/policy_shift" in compared
        for key in compared:
            assert again[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-7), (again["step"], key)


def test_lora_on_a_new_family_syncs_the_adapters_alone_and_vllm_serves_them(tmp_path, ray_cluster):
    model = build_tiny_model(tmp_path / "model", "olmo2")
    overrides = _overrides(tmp_path / "runs", model, "lora") + ["train.steps=2", "learner.lora.rank=2", "train.lr=1e-2",
                                                                "metrics.export=false"]
    summary = train(load_config(None, overrides))
    records = _metrics(tmp_path / "runs" / "lora")
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-5
    for record in records:
        # The adapters alone travel (a few KB, not the model's weights) and the engine's answers are the learner's.
        assert 0 < record["sync/bytes"] < 100_000 and record["sync/probe_max_abs"] < 1e-5, record
    assert max(r["sync/policy_shift"] for r in records) > 1e-3


def test_rlpipe_bench_agreement_compares_a_new_familys_engine_with_its_learner(tmp_path):
    """vLLM rewrites a family's transformers classes in the process whose engine serves them through its Transformers
    backend: the learner's model is built and run in a process of its own."""
    from bench.agreement import bench_agreement

    (row,) = bench_agreement(build_tiny_model(tmp_path / "model", "olmo2"), ["vllm"], ["float32"], 2, 2, 8)
    assert row["tokens"] > 0 and row["max_abs"] < 1e-4, row
