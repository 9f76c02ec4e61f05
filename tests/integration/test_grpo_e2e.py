"""Two real GRPO steps: Ray actors, a vLLM engine, the torch learner and reward workers, on tiny random models."""

from __future__ import annotations

import json

import pytest

from rlpipe.config import load_config
from rlpipe.controller import train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    yield
    ray.shutdown()


def _overrides(run_dir, model_path) -> list[str]:
    return [
        f"run.output_dir={run_dir}",
        f"model.path={model_path}",
        "rollout.group_size=4",
        "rollout.max_tokens=12",
        "rollout.max_model_len=128",
        "data.max_prompt_tokens=112",
        "data.eval_size=4",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.micro_batch_size=4",
        "train.lr=1e-3",
        "ray.num_cpus=4",
        "metrics.tensorboard=true",
    ]


def _read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir, summary):
    records = _read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # The engine now holds exactly the learner's weights ...
        assert record["sync/probe_max_abs"] < 1e-4
        # ... and they are new weights: the sampled tokens' logprobs moved.
        assert record["sync/policy_shift"] > 1e-3
        assert record["policy_version"] == record["step"]
        assert record["samples_trained"] == 8
        for key in ("reward/mean", "accuracy", "completion_len/mean", "truncated_fraction", "clip_fraction",
                    "entropy", "logprob_gap/mean_abs", "logprob_gap/max_abs", "time/generate", "time/reward",
                    "time/train", "time/sync", "tokens_per_s/generate"):
            assert key in record, key
    # Step 1 samples from the starting weights, which learner and engine share: their logprobs agree.
    assert records[0]["logprob_gap/max_abs"] < 1e-3
    assert (run_dir / "curves.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    from rlpipe.models import load_model

    exported = load_model(summary["export"])
    assert sum(p.numel() for p in exported.parameters()) > 0


def test_qwen3_from_jsonl(tmp_path, tiny_qwen3, ray_cluster):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Calculate {a} + {a + 3}.", "answer": str(2 * a + 3)})
                              for a in range(24)))
    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_qwen3) + [
        "run.name=qwen3",
        "data.source=file",
        f"data.path={data}",
        "reward.functions=[{name: 'rewards.math:numeric_answer'}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
    ])
    summary = train(cfg)
    run_dir = tmp_path / "runs" / "qwen3"
    _check_run(run_dir, summary)
    record = _read_metrics(run_dir)[0]
    assert "reward/numeric_answer" in record and "reward/length" in record


def test_llama_from_reasoning_gym(tmp_path, tiny_llama, ray_cluster):
    cfg = load_config(None, _overrides(tmp_path / "runs", tiny_llama) + [
        "run.name=llama",
        "data.size=32",
        "algo.kl_beta=0.05",
        "reward.functions=[{name: reasoning_gym}, {name: 'tests.unit.reward_fixtures:length', weight: 0.01}]",
    ])
    summary = train(cfg)
    run_dir = tmp_path / "runs" / "llama"
    _check_run(run_dir, summary)
    assert "kl" in _read_metrics(run_dir)[1]
