"""rlpipe's learner side against the installed torch-tpu: the availability check follows torch_tpu's own answer to
whether this host has chips, and the compile backend rlpipe's device table names is registered. The learner ranks'
launch environment is checked in test_chip_binding.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlpipe

# A fresh interpreter in which torch_tpu's loader runs with its PCI scan's chip count replaced (torch_tpu registers
# the `tpu` device, and torch.tpu.is_available() answers, from hardware.get_tpu_device_count()), then rlpipe is asked.
ASK = """
import json, os, sys
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch_tpu's loader runs below, after the count is replaced
import torch
from torch_tpu._internal.utils import hardware
hardware.get_tpu_device_count = lambda: int(sys.argv[1])
from torch_tpu import _loader
_loader.load()
from rlpipe.hardware.device import device_unavailable
print("ANSWER", json.dumps(device_unavailable("tpu")))
"""


def _device_unavailable_with(chips: int) -> str | None:
    checkout = str(Path(rlpipe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", ASK, str(chips)], env=env, capture_output=True, text=True,
                          timeout=300)
    answers = [line for line in done.stdout.splitlines() if line.startswith("ANSWER ")]
    assert done.returncode == 0 and answers, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(answers[-1][len("ANSWER "):])


@pytest.mark.parametrize("chips", [0, 4])
def test_the_tpu_device_is_available_exactly_when_torch_tpu_finds_chips(chips):
    """Both answers, whatever this host has: with torch_tpu's own chip count at 4 its loader registers the `tpu`
    device and rlpipe must train there; at 0 rlpipe must say why not, without raising."""
    answer = _device_unavailable_with(chips)
    assert answer == (None if chips else "torch_tpu finds no TPU on this host")


def test_the_device_tables_compile_backend_is_one_torch_tpu_registers():
    import torch._dynamo
    import torch_tpu  # noqa: F401

    from rlpipe.hardware.device import backend

    assert backend("tpu").compile_backend in torch._dynamo.list_backends(exclude_tags=())
