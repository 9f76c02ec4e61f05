"""Fixtures: a tiny tokenizer with a chat template and tiny random HF models, all built offline."""

from __future__ import annotations

import os

import pytest

# The builders live in bench/ (the e2e bench builds the same tiny model); re-exported for the tests.
from rlpipe.bench.tiny_model import CHATML, SPECIALS, build_tiny_model, build_tokenizer
from tests.tiny_tool_model import build_tiny_tool_model

__all__ = ["CHATML", "SPECIALS", "build_tiny_model", "build_tiny_tool_model", "build_tokenizer"]

pytest_plugins = ["tests.timeline"]  # --timeline FILE: every test phase's timing

# scripts/test.sh runs the suite on two pytest-xdist workers (--dist loadgroup). Tests that start Ray clusters and
# vLLM engines, find processes by name, or leave a dead process's shared memory behind all go to one worker, one
# after another: the integration tests, and any test marked with this group.
MACHINE_WIDE = pytest.mark.xdist_group("machine-wide")
# Integration modules that start no Ray actor and kill no process, and whose shared memory stays their own (named by
# their engine's prefix, freed by live processes): they run as a second group, beside the first on the other worker,
# which would otherwise sit idle once the unit tests are done.
BESIDE_MACHINE_WIDE = {"test_weight_sync.py", "test_tool_formats.py", "test_tpu_contract.py", "test_xla_lane.py",
                       "test_device_check.py"}
# Ray starts its worker processes (every actor) at niceness 15, which with the other worker's tests running would
# starve them; at 0 they share the cores evenly. Read by every Ray node the tests start, in-process or `ray start`.
os.environ.setdefault("RAY_worker_niceness", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "heavy: takes more than ~5 s on the 2-core machine (a compile, spawned ranks, an engine): left out "
        "of the everyday tier, `bash scripts/test.sh --fast` (docs/testing.md)")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("integration"):
            beside = item.path.name in BESIDE_MACHINE_WIDE
            item.add_marker(pytest.mark.xdist_group("engines") if beside else MACHINE_WIDE)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(autouse=True, scope="session")
def _offline():
    # Tests never reach a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_olmo2(tmp_path_factory) -> str:
    """A family rlpipe's decoder does not implement: it trains on transformers' code (model.impl auto)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-olmo2"), "olmo2")


@pytest.fixture(scope="session")
def tiny_tool_model(tmp_path_factory) -> str:
    """A tiny Qwen3 trained to call the calculator on the calculator recipe's questions (configs/calculator.yaml's
    system prompt and prompt suffix): its episodes call the real tool."""
    from pathlib import Path

    import yaml

    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "calculator.yaml").read_text())
    return build_tiny_tool_model(tmp_path_factory.mktemp("tiny-tool-qwen3"), recipe["data"]["system_prompt"],
                                 recipe["data"]["prompt_suffix"])


@pytest.fixture(scope="session")
def twin_python(tmp_path_factory) -> str:
    """A second virtual environment made from this one's base interpreter that sees this one's packages: a distinct
    interpreter (its own sys.executable) for the tests of per-role environments."""
    import subprocess
    import sys
    import sysconfig

    folder = tmp_path_factory.mktemp("twin-env")
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    version = "python%d.%d" % sys.version_info[:2]
    packages = sysconfig.get_paths()["purelib"]
    # A .pth line that starts with `import` runs: addsitedir also reads that folder's own .pth files (editable installs).
    (folder / "lib" / version / "site-packages" / "driver_packages.pth").write_text(
        f"import site; site.addsitedir({packages!r})\n"
    )
    return str(folder / "bin" / "python")
