"""`rlpipe submit`: run a recipe as a Ray job on a cluster (a TPU slice's head, or any Ray cluster) and follow it.

The recipe is checked here first, and the cluster's resources against it (a TPU learner needs TPU chips, the
roles their CPUs), so a typo or the wrong cluster fails before anything is uploaded. The job runs
`python -m rlpipe.cli train RECIPE OVERRIDES ray.address=auto` in the uploaded working directory, so the cluster
runs this checkout's code; weights, run directories, virtual environments and git data are never uploaded. Reward
functions named by file path (`rewards.py:fn`) travel with the working directory: each must be inside it, and not
left out of the upload.
Authentication is Ray's own: with token authentication on (Ray's default), the client sends the token from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, as `ray job submit` does.

Like controller.py and cli.py, this module sits on top of the library and may import ray.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml

from rlpipe.config import Config, load_config
from rlpipe.config.reward import VERL_ADAPTER_NAMES
from rlpipe.config.yaml_bounds import YamlBoundError
from rlpipe.config.yaml_bounds import safe_load as bounded_safe_load
from rlpipe.startup.preflight import check_cluster_resources

# Never uploaded: the cluster has its own environment, and checkpoints or weights would dwarf the code.
DEFAULT_EXCLUDES = [
    ".git", ".venv", ".venv-*", "venv", "runs", "**/__pycache__", "*.safetensors", "*.gguf", "*.bin", "*.pt", "*.distcp",
    "checkpoints", ".pytest_cache",
]
_RUNTIME_ENV_KEYS = {"working_dir", "excludes", "env_vars", "py_modules", "pip", "uv", "conda", "config"}


class SubmitError(RuntimeError):
    """The job could not be submitted or followed; one line naming the cause."""


def runtime_env(working_dir: Path, env_vars: dict[str, str], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's runtime environment: `base` (a runtime-env file) with the working directory, the default
    excludes and `env_vars` added."""
    env = dict(base or {})
    unknown = sorted(set(env) - _RUNTIME_ENV_KEYS)
    if unknown:
        raise SubmitError(f"--runtime-env: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_RUNTIME_ENV_KEYS))}")
    env["working_dir"] = str(working_dir)
    env["excludes"] = sorted(set(env.get("excludes") or []) | set(DEFAULT_EXCLUDES))
    env["env_vars"] = {**(env.get("env_vars") or {}), **env_vars}
    return env


def entrypoint(recipe: Path, working_dir: Path, overrides: list[str]) -> str:
    """The command the job runs, with the recipe named relative to the uploaded working directory."""
    try:
        relative = recipe.resolve().relative_to(working_dir.resolve())
    except ValueError:
        raise SubmitError(
            f"{recipe}: the recipe must be inside the uploaded working directory {working_dir} (--working-dir)"
        ) from None
    words = ["python", "-m", "rlpipe.cli", "train", relative.as_posix(), *overrides, "ray.address=auto"]
    return " ".join(shlex.quote(word) for word in words)


def reward_files(cfg: Config) -> list[Path]:
    """The files reward functions are loaded from (`path/to/file.py:fn`, made absolute by the config), the verl
    adapter's `kwargs.function` included."""
    references = [function.name for function in cfg.reward.functions]
    references += [
        function.kwargs.get("function") for function in cfg.reward.functions if function.name in VERL_ADAPTER_NAMES
    ]
    files = [ref.rpartition(":")[0] for ref in references if isinstance(ref, str)]
    return [Path(file) for file in files if file.endswith(".py")]


def check_reward_files_uploaded(files: list[Path], working_dir: Path, excludes: list[str]) -> None:
    """Each reward file is inside the working directory and Ray uploads it: it matches none of `excludes`, Ray's
    own default excludes, or a .gitignore / .rayignore on its way (Ray's rules, read with Ray's own matchers)."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import _get_excludes, get_excludes_from_ignore_files

    root = working_dir.resolve()
    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    for file in files:
        try:
            relative = file.resolve().relative_to(root)
        except ValueError:
            raise SubmitError(
                f"reward file {file} is outside the uploaded working directory {working_dir} (--working-dir), so "
                f"the cluster would not have it"
            ) from None
        matchers = [_get_excludes(root, [*ray_constants.get_runtime_env_default_excludes(), *excludes])]
        path = root
        for part in relative.parts:
            # As Ray walks the tree: each folder's ignore files apply below it.
            matchers += get_excludes_from_ignore_files(path, include_gitignore=include_gitignore)
            path = path / part
            if any(match(path) for match in matchers):
                raise SubmitError(
                    f"reward file {file} would not be uploaded: {path.relative_to(root)} is excluded (the runtime "
                    f"env's excludes, or a .gitignore / .rayignore; RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 skips .gitignore)"
                )


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SubmitError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def submit(
    address: str,
    recipe: str,
    overrides: list[str],
    working_dir: str = ".",
    env: list[str] = (),
    runtime_env_file: str | None = None,
    follow: bool = True,
    out: TextIO | None = None,
) -> int:
    """Submit the run and, with `follow`, print its logs until it ends; returns the job's exit status (0: it
    succeeded, 1: it failed or was stopped)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    out = out or sys.stdout
    recipe_path, root = Path(recipe), Path(working_dir)
    if not root.is_dir():
        raise SubmitError(f"--working-dir: {working_dir} is not a directory")
    cfg = load_config(recipe_path, overrides)  # a bad recipe fails here, before anything is uploaded
    base = None
    if runtime_env_file:
        try:  # bounded: the runtime env is written out for the cluster, every alias expanded
            base = bounded_safe_load(Path(runtime_env_file).read_text()) or {}
        except (OSError, yaml.YAMLError, RecursionError) as err:
            raise SubmitError(f"--runtime-env: cannot read {runtime_env_file}: {type(err).__name__}") from None
        except YamlBoundError as err:
            raise SubmitError(f"--runtime-env: {runtime_env_file}: {err}") from None
        if not isinstance(base, dict):
            raise SubmitError(f"--runtime-env: {runtime_env_file} must hold a mapping")
    job_env = runtime_env(root, parse_env(list(env)), base)
    command = entrypoint(recipe_path, root, overrides)
    check_reward_files_uploaded(reward_files(cfg), root, job_env["excludes"])
    # A cluster that cannot hold the roles (no TPU resource for a TPU learner, too few CPUs) fails here too.
    check_cluster_resources(cfg, cluster_resources(address), address)
    try:
        client = JobSubmissionClient(address)
        job_id = client.submit_job(entrypoint=command, runtime_env=job_env)
    except Exception as err:  # connection, authentication and upload errors all arrive as plain exceptions
        raise SubmitError(f"Ray cluster at {address}: {_first_line(err)}") from None
    print(f"submitted job {job_id} to {address}: {command}", file=out, flush=True)
    if not follow:
        return 0

    async def copy_logs() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(copy_logs())
    except KeyboardInterrupt:
        client.stop_job(job_id)
        print(f"\nstopped job {job_id}", file=out)
        return 130
    info = client.get_job_info(job_id)
    if info.status == JobStatus.SUCCEEDED:
        print(f"job {job_id} succeeded", file=out)
        return 0
    print(f"job {job_id} {info.status.value.lower()}: {_first_line(info.message or 'no message')}", file=out)
    return 1


def cluster_resources(address: str) -> dict[str, float]:
    """The cluster's total resources over its live nodes, asked of its dashboard (Ray's state API, with the same
    authentication as the jobs API)."""
    from ray.util.state import list_nodes

    try:
        # 10,000 nodes: the most the state API lists by default.
        nodes = list_nodes(address=address, detail=True, limit=10_000, raise_on_missing_output=False)
    except Exception as err:  # connection and authentication errors arrive as plain exceptions, as for jobs
        raise SubmitError(f"Ray cluster at {address}: {_first_line(err)}") from None
    totals: dict[str, float] = {}
    for node in nodes:
        if node.state == "ALIVE":
            for name, amount in (node.resources_total or {}).items():
                totals[name] = totals.get(name, 0.0) + float(amount)
    return totals


def _first_line(err: object) -> str:
    text = str(err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(err, BaseException):
        return f"{type(err).__name__}: {lines[0] if lines else ''}"
    return lines[0] if lines else text


