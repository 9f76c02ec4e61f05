"""The learner on a CUDA GPU, one rank: the captured graph takes the same float32 updates as eager, and bf16 mixed
precision (float32 master weights, bf16 compute) trains. Skipped without a GPU (conftest.py). The module needs
neither pytest nor Ray nor vLLM: `python -m tests.cuda.test_cuda_learner` runs it where pytest is missing."""

from __future__ import annotations

import math

import torch

from rlpipe.config import load_config
from rlpipe.training.learner import Learner, combine_rank_metrics
from rlpipe.parallel.mesh import destroy_distributed, find_free_port
from tests.batches import four_samples as _batch
from tests.weights import whole_weights

DEVICE = "cuda"


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
    mixed = Learner.from_config(tiny_qwen3, _config(tiny_qwen3, "model.dtype=float32", "learner.param_dtype=bfloat16"))
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


if __name__ == "__main__":  # where pytest is missing: every test, each told its outcome, exit 1 on a failure
    import os
    import sys
    import tempfile
    import traceback

    from rlpipe.bench.tiny_model import build_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        print("SKIPPED: needs a CUDA GPU (torch.cuda.is_available() is False)")
        sys.exit(0)
    model = build_tiny_model(tempfile.mkdtemp(prefix="tiny-qwen3-"), "qwen3")
    tests = {name: test for name, test in globals().items() if name.startswith("test_") and callable(test)}
    failed = []
    for name, test in tests.items():
        try:
            test(model)
            print(f"PASSED {name}", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            failed.append(name)
    print(f"{len(tests) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)
