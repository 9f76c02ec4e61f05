"""scripts/device-check.sh, the check a CUDA GPU machine runs, run here on the CPU (RLPIPE_CHECK_DEVICE=cpu): every
part runs at a CPU's sizes and passes, and the report holds what a GPU run would report, so the script cannot break
unnoticed where there is no GPU. About a minute on 2 cores (the captured step's compile is most of it). It starts
no Ray cluster and kills nothing but its own parts, so it runs beside the machine-wide tests (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration

# Every test function of the two tests/cuda modules, each of which the log must show passed.
CUDA_TESTS = {
    module: re.findall(r"^def (test_\w+)\(", (ROOT / "tests" / "cuda" / f"{module}.py").read_text(), re.MULTILINE)
    for module in ("test_cuda_learner", "test_cuda_kernels")
}


def test_every_part_of_the_device_check_runs_and_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "RLPIPE_CHECK_DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/device-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["device"] == "cpu" and report["environment"]["torch"] == torch.__version__
    assert report["parts"] == ["cuda_tests", "kernel_tests", "bench_learner"]
    for key in report["parts"]:
        assert report[key]["outcome"] == "passed" and report[key]["exit_code"] == 0, (key, report[key])
    for key, module in (("cuda_tests", "test_cuda_learner"), ("kernel_tests", "test_cuda_kernels")):
        assert re.search(rf"\b{len(CUDA_TESTS[module])} passed\b", report[key]["summary"]), report[key]
    bench = report["bench_learner"]
    assert bench["preset"] == "tiny"
    figures = bench["figures"]
    assert figures["complete"] and figures["device"] == "cpu" and figures["peak_gflops"] > 0
    assert [row["mode"] for row in figures["rows"]] == ["eager"]
    for row in figures["rows"]:
        assert row["tokens_per_s"] > 0 and row["seconds_per_step"] > 0 and 0 < row["mfu"] < 1, row
    log = (tmp_path / "device-check.log").read_text()
    for header in (r"== 1\. tests/cuda: (\S+ )*test_cuda_learner\.py( \S+)* on cpu",
                   r"== 2\. tests/cuda/test_cuda_kernels\.py on cpu",
                   r"== 3\. rlpipe bench learner --device cpu --preset tiny --modes eager", "== summary"):
        assert re.search(f"^{header}", log, re.MULTILINE), header
    for module, names in CUDA_TESTS.items():
        for name in names:
            assert re.search(rf"{module}\.py::{name} PASSED", log), (module, name)
    assert re.search(r"^ +eager: +\d+ tokens/s +MFU", log, re.MULTILINE)
    assert "bench learner (tiny shape, float32): passed" in log
