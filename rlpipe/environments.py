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
        "learner": ["ray", "actors.learner", _DEVICE_STACK[cfg.learner.device]],
        "rollout": ["ray", "actors.rollout", "vllm"],
        "reward": ["ray", "actors.reward"],
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
