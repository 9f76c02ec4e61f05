"""The engine's written-weights check on a GPU: a parameter on the GPU against the host tensor it was written from
(`rlpipe.rollout.vllm_worker._equal_bytes`, which `WeightWriter._check_written` and the LoRA buffers' check use).
torch.equal refuses the two devices; the check compares on the host."""

from __future__ import annotations

import torch

from rlpipe.rollout.vllm_worker import _equal_bytes


def test_a_gpu_parameter_equals_the_host_tensor_it_holds_and_one_changed_element_differs():
    if not torch.cuda.is_available():  # as conftest.py skips the lane; this module also runs without pytest
        import pytest

        pytest.skip("needs a CUDA GPU")
    given = torch.randn(64, 48, dtype=torch.bfloat16)
    held = torch.zeros(96, 48, dtype=torch.bfloat16, device="cuda")  # a fused parameter: the tensor is rows 32-95
    held[32:] = given.to("cuda")
    try:  # what the check met before it compared on the host
        torch.equal(held[32:], given)
    except RuntimeError:
        pass
    else:
        raise AssertionError("torch.equal compared a GPU tensor with a host tensor")
    assert _equal_bytes(held[32:], given)
    assert not _equal_bytes(held[:64], given)
    changed = given.clone()
    changed[17, 5] += 1
    assert not _equal_bytes(held[32:], changed)


if __name__ == "__main__":  # where pytest is missing (scripts/device-check.sh)
    # A GPU's property: skipped without one, RLPIPE_CHECK_DEVICE=cpu included (the test itself skips through pytest).
    if not torch.cuda.is_available():
        print("SKIPPED: needs a CUDA GPU (torch.cuda.is_available() is False)")
    else:
        test_a_gpu_parameter_equals_the_host_tensor_it_holds_and_one_changed_element_differs()
        print("test_cuda_written_weights: passed")
