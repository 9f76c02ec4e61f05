"""SimpleFSDP's layout on xla: the learner sharded over a 2-device SPMD mesh (PJRT's CPU client with two devices)
equals the unsharded CPU eager learner, in full fine-tuning and with LoRA adapters. Runs in a child process: SPMD
mode is process-wide."""

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
    full, lora = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert (full["lora"], lora["lora"]) == (False, True)
    # With LoRA only the adapters train and hold AdamW moments: A and B of the 7 projections of each of 2 layers.
    assert full["trained"] == full["moments"] and lora["trained"] == lora["moments"] == 2 * 7 * 2
    for result in (full, lora):
        assert result["sharded"] == pytest.approx(result["eager"], abs=1e-5)
        assert len(set(result["eager"])) == STEPS
        # The whole weights, with LoRA the base with the adapters merged in.
        assert result["max_weight_difference"] < 1e-5
        # Really sharded: the first parameter (the embedding, frozen with LoRA) and the first trained one's AdamW
        # moment (the embedding's, or lora_A's of the first layer) are split in two along dim 0.
        assert result["parameter_sharding"].startswith("{devices=[2,1]")
        assert result["moment_sharding"].startswith("{devices=[2,1]")
        assert result["graph_breaks"] == 0 and result["executions"] == STEPS
