"""rlpipe's learner side against the installed torch-tpu on a host without a TPU: the availability check answers
instead of raising, and the compile backend rlpipe's device table names is registered. The learner ranks' launch
environment is checked in test_chip_binding.py."""

from __future__ import annotations

import torch


def test_the_tpu_device_is_reported_unavailable_without_raising():
    from rlpipe.device import device_unavailable

    assert device_unavailable("tpu") == "torch_tpu finds no TPU on this host"


def test_the_device_tables_compile_backend_is_one_torch_tpu_registers():
    import torch._dynamo
    import torch_tpu  # noqa: F401

    from rlpipe.device import backend

    assert backend("tpu").compile_backend in torch._dynamo.list_backends(exclude_tags=())
