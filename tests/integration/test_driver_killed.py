"""The driver of a real run is killed (SIGKILL) after a checkpoint; `rlpipe train --resume` continues the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe import checkpoint

pytestmark = pytest.mark.integration

STEPS = 4


def _command(run_root: Path, model_path: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "rlpipe.cli", "train",
        f"run.output_dir={run_root}", "run.name=killed", f"model.path={model_path}",
        "rollout.group_size=4", "rollout.max_tokens=12", "rollout.max_model_len=128", "data.max_prompt_tokens=112",
        "data.size=32", "data.eval_size=0", f"train.steps={STEPS}", "train.prompts_per_step=2",
        "train.micro_batch_size=4", "train.checkpoint_every=1", "ray.num_cpus=4",
        "metrics.tensorboard=false", "metrics.plot=false", "metrics.export=false", *extra,
    ]


def _latest_step(run_dir: Path) -> int:
    try:
        return checkpoint.read_trainer_state(checkpoint.resolve(run_dir))["step"]
    except checkpoint.CheckpointError:  # nothing saved yet
        return 0


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_for_checkpoint(driver: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while _latest_step(run_dir) < step:
        assert driver.poll() is None, f"the driver ended (exit {driver.returncode}) before checkpoint {step}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {timeout_s:g} s"
        time.sleep(0.2)


def test_a_killed_driver_is_resumed_by_train_resume(tmp_path, tiny_qwen3):
    run_dir = tmp_path / "runs" / "killed"
    # Its own session, so the Ray processes it started can be cleaned up after the kill (a killed driver cannot).
    driver = subprocess.Popen(
        _command(tmp_path / "runs", tiny_qwen3), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_checkpoint(driver, run_dir, step=2)
        os.kill(driver.pid, signal.SIGKILL)  # the driver alone, wherever it is in step 3 (or saving it)
        driver.wait(timeout=30)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_at = _latest_step(run_dir)
    assert 2 <= killed_at < STEPS  # a checkpoint interrupted mid-write is never the one "latest" names
    # The kill may cut the last line short; the checkpointed steps' lines were written before their checkpoint.
    kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:killed_at]]

    resumed = subprocess.run(
        _command(tmp_path / "runs", tiny_qwen3, "--resume"), capture_output=True, text=True, timeout=600,
        start_new_session=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # every step once, none lost or repeated
    assert records[:killed_at] == kept  # continued, not restarted: the checkpointed steps' records (timings too)
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
    state = checkpoint.read_trainer_state(checkpoint.resolve(run_dir))
    assert state["step"] == STEPS and state["policy_version"] == STEPS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-4
