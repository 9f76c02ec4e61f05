"""The learner on a CUDA GPU, one rank: the captured graph takes the same float32 updates as eager, bf16 mixed
precision (float32 master weights, bf16 compute) trains, and its step agrees with the float32 step to bf16's
precision. Skipped without a GPU (conftest.py); RLPIPE_CHECK_DEVICE=cpu runs it on the CPU (tests/cuda/__init__.py).
The module needs neither pytest nor Ray nor vLLM: `python -m tests.cuda.test_cuda_learner` runs it where pytest is
missing."""

from __future__ import annotations

import math

import torch

from rlpipe.config import load_config
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.parallel.mesh import destroy_distributed, find_free_port
from tests.batches import four_samples as _batch
from tests.cuda import DEVICE
from tests.weights import whole_weights

MIXED = ("model.dtype=float32", "learner.param_dtype=bfloat16")


def _config(model_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={model_path}",
            f"learner.device={DEVICE}",
            "rollout.group_size=2",
            "train.prompts_per_step=2",
            "train.micro_batch_size=4",
            "train.lr=1e-2",
            "train.steps=4",
            # Rows pad to a bucket; a graph step packing a micro-batch pads its row to micro_batch_size buckets.
            "learner.length_buckets=[32, 64]",
            "data.max_prompt_tokens=16",
            "rollout.max_tokens=16",
            *overrides,
        ],
    )


def _snapshot(learner: Learner) -> dict[str, torch.Tensor]:
    """Whole weights on the host, copied (on the cpu `full_state_dict` hands out the live tensors)."""
    return {name: value.clone() for name, value in whole_weights(learner).items()}


def _largest_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max(float((after[name] - value).abs().max()) for name, value in before.items())


def test_graph_step_equals_eager_step(tiny_qwen3):
    # eps well above float noise: Adam divides by sqrt(v) + eps, so with the default 1e-8 a near-zero gradient's
    # last-bit difference between compiled and eager kernels becomes a full-size step.
    overrides = ("train.adam_eps=1e-4", "algo.kl_beta=0.05")
    eager = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides))
    graph = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *overrides, "learner.graph=true"))
    assert {p.device.type for p in [*eager.model.parameters(), *graph.model.parameters()]} == {DEVICE}
    start = _snapshot(eager)
    for seed in range(3):
        expected = combine_rank_metrics([eager.train_step(_batch(seed))])
        got = combine_rank_metrics([graph.train_step(_batch(seed))])
        for key in ("loss", "kl", "entropy", "grad_norm", "logprob_gap/mean_abs"):
            assert math.isfinite(expected[key]) and abs(got[key] - expected[key]) <= 1e-4, (seed, key, got[key], expected[key])
    trained = _snapshot(eager)
    assert _largest_change(start, trained) > 1e-3  # the updates moved the weights, so equal weights mean something
    for name, tensor in trained.items():
        torch.testing.assert_close(whole_weights(graph)[name], tensor, atol=1e-4, rtol=0)
    # What weight sync and its probe read: host tensors, and the probe's log-probs from the GPU model.
    assert {t.device.type for t in eager.local_weights().values()} == {"cpu"}
    probe = eager.engine.sequence_logprobs(_batch(0).input_ids[0, :8].tolist())
    assert len(probe) == 8 and all(math.isfinite(x) for x in probe)


def test_bf16_mixed_precision_step_trains_float32_master_weights(tiny_qwen3):
    full = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    mixed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *MIXED))
    try:
        mixed.join_process_group("127.0.0.1", find_free_port())
        batch = _batch(0)
        # Computed in bf16: its log-probs miss the float32 learner's by bf16 rounding, far above float32 noise.
        gap = float((mixed.engine.logprobs(batch) - full.engine.logprobs(batch)).abs().max())
        assert 1e-4 < gap < 0.5, gap
        before = _snapshot(mixed)
        metrics = combine_rank_metrics([mixed.train_step(batch)])
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        after = _snapshot(mixed)
        assert _largest_change(before, after) > 1e-3
        masters = list(mixed.model.parameters())
        assert {(p.dtype, p.device.type) for p in masters} == {(torch.float32, DEVICE)}
        optimizer = mixed.engine.step_fn.optimizer
        assert {m.dtype for m in [*optimizer.exp_avg, *optimizer.exp_avg_sq]} == {torch.float32}
        assert {t.dtype for t in after.values()} == {torch.float32}
    finally:
        destroy_distributed()


def test_bf16_mixed_precision_step_agrees_with_the_float32_step(tiny_qwen3):
    """One step from the same weights in bf16 compute and in float32. bf16 keeps 8 significant bits (a relative
    rounding of 2^-9 a value); the bounds leave about 5x room over what a CPU measured for this model and are far
    below what a wrong cast, a skipped scale or a lost gradient gives (differences of order one)."""
    full = Learner.from_config(tiny_qwen3, _config(tiny_qwen3))
    mixed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, *MIXED))
    try:
        mixed.join_process_group("127.0.0.1", find_free_port())
        batch = _batch(0)
        expected_logprobs, got_logprobs = full.engine.logprobs(batch), mixed.engine.logprobs(batch)
        # Every token's log-prob within 2 % of the largest (measured on a CPU: 0.4 %).
        gap, scale = float((got_logprobs - expected_logprobs).abs().max()), float(expected_logprobs.abs().max())
        assert gap <= 0.02 * scale, (gap, scale)
        expected = combine_rank_metrics([full.train_step(batch)])
        got = combine_rank_metrics([mixed.train_step(batch)])
        # loss: a mean of advantage x ratio terms of order one that nearly cancel (advantages sum to 0), so an
        # absolute bound (measured: 4e-6); entropy and gradient norm relative (measured: 4e-7 and 0.4 %).
        assert abs(got["loss"] - expected["loss"]) <= 1e-3, (got["loss"], expected["loss"])
        assert abs(got["entropy"] - expected["entropy"]) <= 5e-3 * abs(expected["entropy"]), (got, expected)
        assert abs(got["grad_norm"] - expected["grad_norm"]) <= 0.03 * expected["grad_norm"], (got, expected)
    finally:
        destroy_distributed()


if __name__ == "__main__":  # where pytest is missing: every test, each told its outcome, exit 1 on a failure
    import os
    import sys
    import tempfile

    from rlpipe.bench.tiny_model import build_tiny_model
    from tests.cuda import run_module_tests, skip_without_gpu

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    skip_without_gpu()
    with tempfile.TemporaryDirectory(prefix="tiny-qwen3-") as folder:
        code = run_module_tests(globals(), build_tiny_model(folder, "qwen3"))
    sys.exit(code)
