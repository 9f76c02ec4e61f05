"""tests/xla (the learner on XLA against the CPU eager learner, one program per step, the SPMD mesh) in the
environment that has torch_xla (.venv-xla, `bash scripts/setup-xla.sh`); collected in the main environment they
would be skipped. It starts no Ray cluster and kills nothing, so it runs beside the machine-wide tests
(tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def test_the_xla_learner_tests_pass_in_the_xla_environment(xla_python):
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    done = subprocess.run([xla_python, "-m", "pytest", "tests/xla", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
