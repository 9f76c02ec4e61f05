"""Each role's Python environment: the interpreter its actors run under (`placement.<role>.python`), and how to ask it
a question before anything starts. On a TPU slice the learner's stack (TorchTPU or torch_xla with libtpu) and vLLM
for TPU cannot share one environment, so each role may name its own; Ray starts that role's actors with it
(runtime_env `py_executable`). An environment must run the driver's Python minor version and Ray version (Ray's
own wire format needs both) and import what its role runs: rlpipe's code and the role's device stack. The checks
built on these probes are in rlpipe/startup/preflight.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from rlpipe.config import Config, ConfigError
from rlpipe.hardware.device import learner_variables

# What a probe prints: the interpreter's Python version, its Ray version and the modules it cannot import.
_IMPORTS_QUESTION = """
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
# What the device question prints: why the device kind in argv[1] cannot be used there, or null.
_DEVICE_QUESTION = (
    "import json, sys; from rlpipe.hardware.device import device_unavailable; print(json.dumps(device_unavailable(sys.argv[1])))"
)
_DEVICE_STACK = {"cpu": "torch", "cuda": "torch", "xla": "torch_xla", "tpu": "torch_tpu"}


class NoAnswer(RuntimeError):
    """The interpreter printed no answer; the message is the last line of its stderr."""


def role_modules(cfg: Config) -> dict[str, list[str]]:
    """The modules each role's actors import: the actor code and the role's own stack."""
    return {
        "learner": ["ray", "rlpipe.actors.learner", _DEVICE_STACK[cfg.learner.device]],
        "rollout": ["ray", "rlpipe.actors.rollout", "vllm"],
        "reward": ["ray", "rlpipe.actors.reward"],
        "scorer": ["ray", "rlpipe.actors.scorer", "transformers"],
    }


def interpreter(key: str, path: str) -> str:
    """The interpreter `path` names: itself, or `bin/python` of a virtual environment folder."""
    candidate = Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "bin" / "python"
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise ConfigError(f"{key}: {path} is neither a Python interpreter nor a virtual environment folder")
    return str(candidate.absolute())  # not resolved: a venv's python is a link whose location makes it the venv's


def ask_interpreter(python: str, program: str, args: list[str], timeout_s: float, env: dict | None = None) -> Any:
    """What `python -c program *args` prints last, as JSON. Raises NoAnswer when it prints none (it failed to
    start, or crashed), subprocess.TimeoutExpired and OSError as subprocess.run does."""
    done = subprocess.run(
        [python, "-c", program, *args], capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise NoAnswer((done.stderr.strip().splitlines() or ["no output"])[-1][:200]) from None


def ask_imports(python: str, modules: list[str], timeout_s: float) -> dict:
    """{"python": its minor version, "ray": its Ray version or None, "missing": module -> why it does not import},
    each module imported for real in `python`, with this process's environment."""
    return ask_interpreter(python, _IMPORTS_QUESTION, modules, timeout_s)


def ask_device(python: str, kind: str, ranks: int, timeout_s: float) -> str | None:
    """Why `python` cannot train on a learner device of `kind` (None: it can), asked with the environment a learner
    actor of `ranks` gets."""
    return ask_interpreter(python, _DEVICE_QUESTION, [kind], timeout_s, {**os.environ, **learner_variables(kind, ranks)})
