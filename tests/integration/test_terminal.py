"""What `rlpipe train` prints: rlpipe's own lines on the terminal, every process's INFO in <run_dir>/logs/run.log, and
an engine's error still on the terminal. Each run is the CLI in a process of its own, as a user runs it."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RLPIPE_LINES = ("... ", "roles: ", "weight sync (", "held-out accuracy", "step ", "checkpoint saved", "done in ")


def logging_reward(prompts, completions, **_):
    """`length`, logging an INFO and an ERROR record as a library in a worker would."""
    library = logging.getLogger("vllm.rlpipe_test")
    library.info("INFO-MARKER from a reward worker")
    library.error("ERROR-MARKER from a reward worker")
    return [float(len(completion)) for completion in completions]


def _train(tmp_path, model_path, *overrides) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlpipe.cli", "train", f"run.output_dir={tmp_path / 'runs'}", f"model.path={model_path}",
         "rollout.group_size=4", "rollout.max_tokens=12", "rollout.max_model_len=128", "data.max_prompt_tokens=112",
         "data.size=32", "data.eval_size=4", "train.steps=2", "train.prompts_per_step=2", "train.micro_batch_size=4",
         "ray.num_cpus=4", "metrics.export=false", *overrides],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )


def test_the_terminal_shows_rlpipes_lines_and_the_log_file_the_rest(tmp_path, tiny_qwen3):
    # vLLM's reload (what MoE and quantized engines always use) logs warnings known to be harmless: hidden here.
    done = _train(tmp_path, tiny_qwen3, "run.name=quiet", "sync.engine_write=reload",
                  f"reward.functions=[{{name: '{__name__}:logging_reward'}}]")
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout.splitlines(), done.stderr
    # stdout: rlpipe's lines only — the start-up summary, a line per step, the notes and the final line.
    assert all(line.startswith(RLPIPE_LINES) for line in out), done.stdout
    assert [line.split(" |")[0] for line in out if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    roles = next(line for line in out if line.startswith("roles: "))
    assert "learner 1 rank" in roles and "rollout 1 engine" in roles and "reward 1 worker" in roles
    log_file = tmp_path / "runs" / "quiet" / "logs" / "run.log"
    assert out[-1].startswith("done in ") and out[-1].endswith(f"full log in {log_file}")
    # stderr: no INFO from vLLM, Ray or transformers, none of the known-harmless warnings; a library's error does show.
    assert not re.search(r"\bINFO\b", err), err
    for harmless in ("Failed to load weights", "Enforce eager set", "Token authentication is enabled",
                     "torch.distributed.reduce_op", "assuming the intent is to save in a single process",
                     "Loading safetensors checkpoint shards"):
        assert harmless not in err, harmless
    assert "ERROR vllm.rlpipe_test: ERROR-MARKER from a reward worker" in err
    # The log file: every process's INFO, the harmless warnings, and rlpipe's own lines.
    log = log_file.read_text()
    for line in ("driver INFO ray._private.worker: Started a local Ray instance.",
                 "rollout-0 INFO vllm.v1.engine.core: Initializing a V1 LLM engine",
                 "rollout-0 WARNING vllm.model_executor.model_loader.reload.layerwise: RotaryEmbedding: Failed to load",
                 "reward-0 INFO vllm.rlpipe_test: INFO-MARKER from a reward worker",
                 "driver INFO rlpipe.progress: step 2/2 |"):
        assert line in log, line


def test_an_engine_that_fails_to_start_says_why_on_the_terminal(tmp_path, tiny_qwen3):
    # vLLM refuses a context longer than the model's positions (512) when it builds the engine.
    done = _train(tmp_path, tiny_qwen3, "run.name=refused", "rollout.max_model_len=1024")
    assert done.returncode == 1
    assert "User-specified max_model_len (1024) is greater than the derived max_model_len" in done.stderr
    assert "rlpipe: the roles did not start; `rlpipe train --verbose` shows every process's log" in done.stderr
