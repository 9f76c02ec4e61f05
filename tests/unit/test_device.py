"""The backend table, and a TorchTPU process environment refusing a place outside its job."""

import pytest

from rlpipe.hardware.device import backend
from rlpipe.hardware.tpu_env import torchtpu_process_env


def test_backend_table():
    assert (backend("cpu").dist_backend, backend("cpu").compile_backend) == ("gloo", "inductor")
    assert (backend("cuda").dist_backend, backend("cuda").compile_backend) == ("nccl", "inductor")
    tpu = backend("tpu")
    assert (tpu.torch_device, tpu.compile_backend) == ("tpu", "tpu")
    # Tensors on TorchTPU's collectives, objects (a checkpoint's plans) on gloo: tests/tpu_contract/test_checkpoint.py
    assert tpu.dist_backend == "cpu:gloo,tpu:tpu_dist"
    assert backend("xla").compile_backend == "openxla"
    # Only xla records ops for a program run at the step's end (static shapes, no packing).
    assert [kind for kind in ("cpu", "cuda", "tpu", "xla") if backend(kind).lazy] == ["xla"]
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        backend("gpu")


def test_bad_torchtpu_placements_are_named():
    with pytest.raises(ValueError, match="outside the 4 chips"):
        torchtpu_process_env(["h"], 4, 0, 4)
    with pytest.raises(ValueError, match="outside the 1 hosts"):
        torchtpu_process_env(["h"], 4, 1, 0)
    with pytest.raises(ValueError, match="needs its topology"):
        torchtpu_process_env(["h", "i"], 4, 1, 0)


def test_torch_versions_outside_the_learners_are_named_in_one_line():
    from rlpipe.hardware.device import captured_step_unsupported, torch_unsupported

    for version in ("2.9.0", "2.13.0+cpu", "2.11.1+cu128"):
        assert torch_unsupported(version) is None, version
    for version in ("2.8.2+cu126", "2.14.0", "3.0.0", "unknown"):
        message = torch_unsupported(version)
        assert message == f"torch {version} is outside the versions the learner runs on (torch 2.9 to 2.13)"
    assert torch_unsupported() is None and captured_step_unsupported() is None  # this environment's torch
