"""Per-role Python environments (`placement.<role>.python`): what is checked before anything starts."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from rlpipe.config import ConfigError, load_config
from rlpipe.startup.interpreters import interpreter, role_modules
from rlpipe.startup.preflight import check_environment, check_role_environments

OTHER_MINOR = Path("/root/.pyenv/versions/3.12.1/bin/python3.12")


def test_a_venv_folder_names_its_interpreter_and_a_bad_path_is_named(twin_python, tmp_path):
    folder = Path(twin_python).parent.parent
    assert interpreter("placement.reward.python", str(folder)) == twin_python
    assert interpreter("placement.reward.python", twin_python) == twin_python
    with pytest.raises(ConfigError, match=r"^placement.reward.python: .*nothing-here is neither a Python interpreter"):
        interpreter("placement.reward.python", str(tmp_path / "nothing-here"))


def test_an_environment_that_has_what_the_role_needs_passes(twin_python):
    check_environment("placement.reward.python", twin_python, ["ray", "rlpipe.actors.reward"])
    cfg = load_config(None, [f"placement.reward.python={Path(twin_python).parent.parent}"])
    assert check_role_environments(cfg) == {"reward": twin_python}
    assert role_modules(load_config(None, ["learner.device=xla"]))["learner"][-1] == "torch_xla"


def test_a_missing_module_is_named(twin_python):
    with pytest.raises(ConfigError, match=r"^placement.learner.python: .* cannot import torch_xla \(ModuleNotFoundError"):
        check_environment("placement.learner.python", twin_python, ["ray", "torch_xla"])


@pytest.mark.skipif(not OTHER_MINOR.exists(), reason="no Python 3.12 from pyenv on this machine")
def test_another_python_minor_version_is_refused():
    with pytest.raises(ConfigError, match=r"runs Python 3.12; the driver runs 3.11"):
        check_environment("placement.rollout.python", str(OTHER_MINOR), ["json"])


@pytest.mark.skipif(shutil.which("python3", path="/usr/bin") is None, reason="no system Python")
def test_an_environment_without_ray_is_refused():
    system = "/usr/bin/python3"
    if Path(system).resolve() == Path(sys.executable).resolve():
        pytest.skip("the system Python is this one")
    with pytest.raises(ConfigError, match=r"(has no Ray; the driver has Ray)|(runs Python)"):
        check_environment("placement.reward.python", system, ["json"])
