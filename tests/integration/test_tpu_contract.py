"""The TPU contract lane, from the main suite: every extra resolves with pip's resolver for its own Python, and
tests/tpu_contract (rlpipe's TPU code against the installed torch-tpu and vllm-torchtpu) passes in .venv-tpu
(Python 3.12, the `tpu` extra; bash scripts/setup-tpu.sh builds it, and so does scripts/test.sh). Without that
environment these tests are skipped, unless RLPIPE_REQUIRE_TPU_ENV=1 (set by scripts/test.sh) makes that a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tpu_python() -> str:
    python = Path(os.environ.get("RLPIPE_TPU_VENV", ROOT / ".venv-tpu")) / "bin" / "python"
    if not python.is_file():
        message = f"no TPU contract environment at {python.parent.parent} (bash scripts/setup-tpu.sh builds it)"
        if os.environ.get("RLPIPE_REQUIRE_TPU_ENV") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return str(python)


@pytest.mark.parametrize("extra", ["tpu", "cpu", "xla", "bench"])
def test_every_extra_resolves_for_its_python(extra, tpu_python):
    python = tpu_python if extra == "tpu" else sys.executable  # tpu's wheels are Python 3.12 only
    done = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--dry-run", "--ignore-installed",
         f"{ROOT}[{extra}]"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_rlpipes_tpu_code_against_the_installed_tpu_packages(tpu_python):
    done = subprocess.run([tpu_python, "-m", "pytest", "tests/tpu_contract", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
