"""scripts/setup.sh picks the stack it installs: vLLM and torch for CUDA where nvidia-smi lists a GPU, for CPU
elsewhere (and where nvidia-smi is there but finds no GPU), RLPIPE_STACK choosing otherwise; it says which in one
line. `--which` stops after that line, before anything is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def _which(tmp_path: Path, smi: str | None, **env: str) -> subprocess.CompletedProcess:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    if smi is not None:
        (tools / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (tools / "nvidia-smi").chmod(0o755)
    variables = {key: value for key, value in os.environ.items() if key != "RLPIPE_STACK"}
    variables.update(PATH=f"{tools}:/usr/bin:/bin", RLPIPE_VENV=str(tmp_path / "never-made"), **env)
    return subprocess.run(["bash", str(SETUP), "--which"], env=variables, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("smi, stack", [
    ('[ "$1" = -L ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-0)" && echo "GPU 1: NVIDIA H200 (UUID: GPU-1)"', "cuda"),
    ('echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver."; exit 9', "cpu"),
    ("exit 127", "cpu"),
])
def test_the_stack_follows_what_nvidia_smi_lists(tmp_path, smi, stack):
    done = _which(tmp_path, smi)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlpipe: the {stack} stack: "), lines
    assert ("lists 2 GPU(s)" in lines[0]) == (stack == "cuda")
    assert not (tmp_path / "never-made").exists()


def test_rlpipe_stack_chooses_and_a_wrong_value_is_refused(tmp_path):
    chosen = _which(tmp_path, "exit 127", RLPIPE_STACK="cuda")
    assert chosen.returncode == 0 and "the cuda stack" in chosen.stderr and "RLPIPE_STACK=cuda" in chosen.stderr
    wrong = _which(tmp_path, None, RLPIPE_STACK="gpu")
    assert wrong.returncode == 2 and wrong.stderr.strip() == "rlpipe: RLPIPE_STACK must be cpu or cuda, not 'gpu'"
