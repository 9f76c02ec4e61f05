"""SimpleFSDP's layout on xla: the learner sharded over a 2-device SPMD mesh (PJRT's CPU client with two devices)
equals the unsharded CPU eager learner. Runs in a child process: SPMD mode is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla.test_xla_learner import STEPS

ROOT = Path(__file__).resolve().parents[2]


def test_learner_sharded_over_a_two_device_spmd_mesh_equals_one_device(tiny_qwen3):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.xla.spmd_run", tiny_qwen3, "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sharded"] == pytest.approx(result["eager"], abs=1e-5)
    assert len(set(result["eager"])) == STEPS
    assert result["max_weight_difference"] < 1e-5
    # Really sharded: the first parameter (the embedding) and its AdamW moment are split in two along dim 0.
    assert result["parameter_sharding"].startswith("{devices=[2,1]")
    assert result["moment_sharding"].startswith("{devices=[2,1]")
    assert result["graph_breaks"] == 0 and result["executions"] == STEPS
