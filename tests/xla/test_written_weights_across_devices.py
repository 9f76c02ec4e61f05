"""The engine's written-weights check (`rlpipe.rollout.vllm_worker._equal_bytes`) across two devices: a parameter on
an accelerator against the host tensor it was written from, as on a GPU engine. XLA's CPU client is the second
device these machines have; tests/cuda runs the same on a GPU."""

from __future__ import annotations

import torch

from rlpipe.hardware.device import torch_device
from rlpipe.rollout.vllm_worker import _equal_bytes


def test_a_device_parameter_equals_the_host_tensor_it_holds_and_one_changed_element_differs():
    device = torch_device("xla")
    given = torch.randn(64, 48, dtype=torch.bfloat16)
    held = torch.zeros(96, 48, dtype=torch.bfloat16, device=device)  # a fused parameter: the tensor is rows 32-95
    held[32:] = given.to(device)
    assert held.device.type == "xla"
    assert _equal_bytes(held[32:], given)
    assert not _equal_bytes(held[:64], given)
    changed = given.clone()
    changed[17, 5] += 1
    assert not _equal_bytes(held[32:], changed)
    assert not _equal_bytes(held[32:].float(), given)  # another dtype is another tensor
