"""The TPU contract lane, from the main suite: the tpu extra resolves with pip's resolver for Python 3.12 (the cuda
extra, which no CPU machine installs, for this Python), and tests/tpu_contract (rlpipe's TPU code against the
installed torch-tpu and vllm-torchtpu) passes in .venv-tpu (Python 3.12, the `tpu` extra; bash scripts/setup-tpu.sh
builds it, and so does scripts/test.sh). Without that environment these tests are skipped, unless
RLPIPE_REQUIRE_TPU_ENV=1 (set by scripts/test.sh) makes that a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.integration.conftest import ROOT, lane_python

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tpu_python() -> str:
    return lane_python("RLPIPE_TPU_VENV", ".venv-tpu", "RLPIPE_REQUIRE_TPU_ENV", "setup-tpu.sh")


# The set-up installs the other extras itself (scripts/setup.sh: cpu, bench, reasoning-gym, humaneval together;
# setup-xla.sh: xla), and an install of several extras resolving means each of them resolves alone; tpu's wheels
# are for Python 3.12, which setup-tpu.sh may not find; cuda is what setup.sh installs on a GPU machine only.
@pytest.mark.parametrize("extra", ["tpu", "cuda"])
def test_every_extra_resolves_for_its_python(extra, tpu_python, tmp_path):
    # pip reads each candidate's metadata through HTTP range requests (fast-deps) instead of downloading whole wheels:
    # the registry serves no separate metadata files, and the xla extra's full download (torch's CUDA build and its
    # nvidia-* libraries) is several GB of temporary files. One at a time, nothing cached.
    python = tpu_python if extra == "tpu" else sys.executable  # tpu's wheels are Python 3.12 only
    report = tmp_path / "report.json"
    done = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--no-cache-dir",
         "--use-feature=fast-deps", "--dry-run", "--ignore-installed", "--report", str(report), f"{ROOT}[{extra}]"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][extra]
    for wanted in map(Requirement, pins):
        found = resolved.get(canonicalize_name(wanted.name))
        assert found is not None and wanted.specifier.contains(found, prereleases=True), (wanted, found)


def test_rlpipes_tpu_code_against_the_installed_tpu_packages(tpu_python):
    done = subprocess.run([tpu_python, "-m", "pytest", "tests/tpu_contract", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
