"""The learner's log-prob kernel on a CUDA GPU: `linear_logprob` (chunked, the fused path the learner runs) against
`reference_linear_logprob` (whole logits, log_softmax, gather) at Qwen3's vocabulary, in value, entropy and the
gradients of both for hidden states and the output projection, in float32 and in bf16. Skipped without a GPU
(conftest.py); RLPIPE_CHECK_DEVICE=cpu runs it on the CPU at a smaller width (tests/cuda/__init__.py). Runs without
pytest too: `python -m tests.cuda.test_cuda_kernels`.

The Pallas implementation (`impl="pallas"`) is not checked here: it is written for TPU (Mosaic), and off TPU it runs
interpreted by JAX on the host, which tests/unit/test_kernels.py checks; its only GPU route would be JAX's Pallas
Triton lowering, a different kernel from the one the TPU runs."""

from __future__ import annotations

import torch

from rlpipe.kernels.logprob import DEFAULT_CHUNK, linear_logprob, reference_linear_logprob
from tests.cuda import DEVICE

VOCAB = 151936  # Qwen3's: 18 whole chunks of DEFAULT_CHUNK and a ragged last one
# A few hundred tokens at Qwen3-0.6B's width on the GPU; the CPU keeps the vocabulary and narrows the rest.
ROWS, WIDTH = (384, 1024) if DEVICE == "cuda" else (48, 64)
NAMES = ("logprob", "entropy", "grad hidden", "grad weight")


def _case(dtype: torch.dtype):
    """Hidden states of unit scale (as after the final norm) and a projection giving logits of a few units, as a
    trained model's are; targets include the first, the last and a chunk-edge token."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, WIDTH, generator=generator)
    weight = torch.randn(VOCAB, WIDTH, generator=generator) * (2.0 / WIDTH**0.5)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[:4] = torch.tensor([0, VOCAB - 1, DEFAULT_CHUNK - 1, DEFAULT_CHUNK])
    # Upstream gradients for both outputs: the loss weighs log-probs, the entropy bonus the entropy.
    upstream = torch.randn(ROWS, generator=generator), torch.randn(ROWS, generator=generator)
    on_device = [t.to(DEVICE) for t in (hidden, weight, targets, *upstream)]
    hidden, weight = (t.to(dtype).requires_grad_() for t in on_device[:2])
    return hidden, weight, *on_device[2:]


def _outputs(fn, hidden, weight, targets, upstream_logprob, upstream_entropy):
    logprob, entropy = fn(hidden, weight, targets)
    loss = (logprob * upstream_logprob).sum() + (entropy * upstream_entropy).sum()
    grads = torch.autograd.grad(loss, (hidden, weight))
    return logprob.detach(), entropy.detach(), *grads


def _largest_gaps(got, want) -> dict[str, tuple[float, float]]:
    """Each output's largest difference, and the largest magnitude of the reference it is measured against."""
    return {
        name: (float((have.float() - expected.float()).abs().max()), float(expected.float().abs().max()))
        for name, have, expected in zip(NAMES, got, want)
    }


def _check(gaps: dict[str, tuple[float, float]], relative: float) -> None:
    for name, (gap, scale) in gaps.items():
        assert gap <= relative * scale, f"{name}: differs by {gap:.3g}, over {relative:g} of its scale {scale:.3g}"


def test_chunked_logprob_matches_the_reference_in_float32():
    case = _case(torch.float32)
    want = _outputs(reference_linear_logprob, *case)
    got = _outputs(linear_logprob, *case)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32 and got[0].device.type == DEVICE
    # Float32 sums in another order (chunks of 8192 with a running logsumexp against one log_softmax): rounding of
    # about 1e-6 of each value's scale; 1e-4 is far above it and far below any indexing or rescaling error.
    _check(_largest_gaps(got, want), 1e-4)


def test_chunked_logprob_in_bf16_is_as_close_to_float32_as_the_reference_in_bf16():
    hidden, weight, *rest = _case(torch.bfloat16)
    truth = _outputs(reference_linear_logprob, hidden.detach().float().requires_grad_(),
                     weight.detach().float().requires_grad_(), *rest)
    reference = _outputs(reference_linear_logprob, hidden, weight, *rest)
    got = _outputs(linear_logprob, hidden, weight, *rest)
    assert got[0].dtype == torch.float32 and got[2].dtype == got[3].dtype == torch.bfloat16
    # bf16 logits and gradient products (8 significant bits) against float32 ones on the same inputs: within 2 % of
    # each output's scale, as tests/unit/test_kernels.py asks at a small vocabulary, for the kernel and for the
    # reference alike; and the kernel against the reference, both in bf16, as close.
    _check(_largest_gaps(got, truth), 0.02)
    _check(_largest_gaps(reference, truth), 0.02)
    _check(_largest_gaps(got, reference), 0.02)


if __name__ == "__main__":  # where pytest is missing: every test, each told its outcome, exit 1 on a failure
    import sys

    from tests.cuda import run_module_tests, skip_without_gpu

    skip_without_gpu()
    sys.exit(run_module_tests(globals()))
