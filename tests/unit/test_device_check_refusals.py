"""scripts/device-check.sh where it cannot check anything: it gives up at once with exit status 2 and the reason as
one line, in its log and as the report's "error". Its full run on the CPU is tests/integration/test_device_check.py.
Also the tests/cuda modules' own runner, which the script uses where pytest is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _device_check(tmp_path, **variables):
    env = {key: value for key, value in os.environ.items() if key != "RLPIPE_CHECK_DEVICE"}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, **variables)
    done = subprocess.run(["bash", "scripts/device-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    return done, json.loads((tmp_path / "device-check.json").read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA GPU here")
def test_without_a_gpu_the_check_gives_up_with_one_line(tmp_path):
    done, report = _device_check(tmp_path)
    assert done.returncode == 2, done.stdout[-3000:]
    assert report == {"error": f"torch {torch.__version__} sees no CUDA GPU; nothing to check "
                               "(RLPIPE_CHECK_DEVICE=cpu checks on the CPU)"}
    assert f"device-check: {report['error']}\n" in done.stdout
    assert "== 1." not in done.stdout  # no part ran


def test_an_unknown_device_is_refused(tmp_path):
    done, report = _device_check(tmp_path, RLPIPE_CHECK_DEVICE="rocm")
    assert done.returncode == 2
    assert report == {"error": "RLPIPE_CHECK_DEVICE=rocm: cuda (the default) or cpu"}


def test_a_cuda_test_module_runs_itself_without_pytest():
    env = {**os.environ, "RLPIPE_CHECK_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.cuda.test_cuda_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.splitlines()[-1] == "2 passed, 0 failed on cpu"
    assert "PASSED test_chunked_logprob_matches_the_reference_in_float32" in done.stdout
