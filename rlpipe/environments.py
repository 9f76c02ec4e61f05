"""Each role's Python environment: the interpreter its actors run under (`placement.<role>.python`), checked before
anything starts. On a TPU slice the learner's stack (TorchTPU or torch_xla with libtpu) and vLLM for TPU cannot
share one environment, so each role may name its own; Ray starts that role's actors with it (runtime_env
`py_executable`). An environment must run the driver's Python minor version and Ray version (Ray's own wire
format needs both) and import what its role runs: rlpipe's code and the role's device stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from rlpipe.config import Config, ConfigError
from rlpipe.device import learner_env, learner_processes

# What a probe prints: the interpreter's Python version, its Ray version and the modules it cannot import.
_PROBE = """
import importlib, json, sys
from importlib import metadata
missing = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as err:
        missing[name] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
try:
    ray = metadata.version("ray")
except metadata.PackageNotFoundError:
    ray = None
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "ray": ray, "missing": missing}))
"""
_DEVICE_STACK = {"cpu": "torch", "cuda": "torch", "xla": "torch_xla", "tpu": "torch_tpu"}


def role_modules(cfg: Config) -> dict[str, list[str]]:
    """The modules each role's actors import: the actor code and the role's own stack."""
    return {
        "learner": ["ray", "rlpipe.actors.learner", _DEVICE_STACK[cfg.learner.device]],
        "rollout": ["ray", "rlpipe.actors.rollout", "vllm"],
        "reward": ["ray", "rlpipe.actors.reward"],
    }


def interpreter(key: str, path: str) -> str:
    """The interpreter `path` names: itself, or `bin/python` of a virtual environment folder."""
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "bin" / "python"
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise ConfigError(f"{key}: {path} is neither a Python interpreter nor a virtual environment folder")
    return str(candidate.absolute())  # not resolved: a venv's python is a link whose location makes it the venv's


def check_environment(key: str, python: str, modules: list[str], timeout_s: float = 180.0) -> None:
    """Raise a one-line ConfigError unless `python` runs this Python minor version and Ray version and imports
    every one of `modules` (imported for real, in a child process, with this process's environment)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{key}: {python} did not import {', '.join(modules)} within {timeout_s:.0f} s") from None
    except OSError as err:
        raise ConfigError(f"{key}: cannot run {python} ({err.strerror})") from None
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"{key}: {python} failed to start ({last[:200]})") from None
    ours = "%d.%d" % sys.version_info[:2]
    if report["python"] != ours:
        raise ConfigError(f"{key}: {python} runs Python {report['python']}; the driver runs {ours}, and Ray needs the same")
    ray_version = metadata.version("ray")
    if report["ray"] != ray_version:
        found = f"Ray {report['ray']}" if report["ray"] else "no Ray"
        raise ConfigError(f"{key}: {python} has {found}; the driver has Ray {ray_version}, and the roles need the same")
    if report["missing"]:
        name, reason = next(iter(report["missing"].items()))
        raise ConfigError(f"{key}: {python} cannot import {name} ({reason})")


def check_role_environments(cfg: Config) -> dict[str, str]:
    """Check every role that names its own environment; returns role -> interpreter for those roles."""
    chosen = {}
    modules = role_modules(cfg)
    for role in ("learner", "rollout", "reward"):
        path = getattr(cfg.placement, role).python
        if path is None:
            continue
        key = f"placement.{role}.python"
        chosen[role] = interpreter(key, path)
        check_environment(key, chosen[role], modules[role])
    return chosen


def check_learner_device(cfg: Config, python: str | None, timeout_s: float = 180.0) -> None:
    """Raise a one-line ConfigError unless the learner's environment (`python`, None: the driver's) has a
    `learner.device` to train on, asked there with the environment a learner actor gets. This machine's
    environment is the one that counts for a run on its own local cluster; a run that joins a cluster
    (`ray.address`) checks that cluster's resources instead (`check_cluster_resources`)."""
    kind = cfg.learner.device
    if kind == "cpu":
        return
    where = f"placement.learner.python {python}" if python else f"the driver's environment {sys.executable}"
    question = (
        "import json, sys; from rlpipe.device import device_unavailable; "
        "print(json.dumps(device_unavailable(sys.argv[1])))"
    )
    env = {**os.environ, **learner_env(kind, cfg.learner.ranks)}
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", question, kind],
            capture_output=True, text=True, timeout=timeout_s, check=False, env=env,
        )
        reason = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        reason = f"no answer within {timeout_s:.0f} s"
    except (IndexError, ValueError):
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    if reason:
        hint = "" if python else "; placement.learner.python names an environment that has it"
        raise ConfigError(f"learner.device: {kind!r} is not available to {where}: {reason}{hint}")


def actors_needed(cfg: Config) -> int:
    """The CPU bundles the roles reserve off TPU slices: one per learner process, rollout engine and reward worker."""
    return learner_processes(cfg.learner.device, cfg.learner.ranks) + cfg.rollout.num_engines + cfg.reward.num_workers


def check_cluster_resources(cfg: Config, resources: dict[str, float], address: str | None = None) -> None:
    """Raise a one-line ConfigError unless `resources` (a cluster's totals, as `ray.cluster_resources()` gives
    them) can hold the roles: their CPUs, a GPU per cuda learner rank, TPU chips where a device or slice needs
    them. `address` names a cluster the run is submitted to; None: the one the run is on. Custom resources and
    slice shapes are the placement's to check (it waits for them, then says which)."""
    where = f"the cluster at {address}" if address else "the cluster"
    tpu_keys = [key for key, wanted in (("learner.device", cfg.learner.device == "tpu"),
                                        ("placement.learner.tpu", cfg.placement.learner.tpu),
                                        ("placement.rollout.tpu", cfg.placement.rollout.tpu)) if wanted]
    on_tpu = bool(tpu_keys)
    needed = actors_needed(cfg)
    if not on_tpu and resources.get("CPU", 0) < needed:
        own = not (address or cfg.ray.address)  # a cluster the run starts itself has ray.num_cpus CPUs
        key = "ray.num_cpus" if own else "learner.ranks / rollout.num_engines / reward.num_workers"
        raise ConfigError(
            f"{key}: {where} has {resources.get('CPU', 0):g} CPUs but the roles need {needed} "
            f"(one each per learner process, rollout engine and reward worker)"
        )
    if cfg.learner.device == "cuda" and resources.get("GPU", 0) < cfg.learner.ranks:
        raise ConfigError(
            f"learner.device: 'cuda' needs {cfg.learner.ranks} GPU(s) (learner.ranks), {where} has "
            f"{resources.get('GPU', 0):g}"
        )
    if on_tpu and not resources.get("TPU", 0):
        raise ConfigError(
            f"{tpu_keys[0]}: the run needs TPU chips, {where} has no TPU resource "
            f"(resources: {', '.join(sorted(k for k in resources if not k.startswith('node:')))})"
        )
