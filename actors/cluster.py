"""The Ray cluster a run uses, and the environment of the actors that compute on it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray._private import ray_constants

from rlpipe.config import Config
from rlpipe.startup.preflight import actors_needed
from rlpipe.hardware.tpu_env import compile_cache_env

# glibc serves large blocks by mmap and gives freed memory back to the kernel, so every training step and every
# weight write would fault its memory in again, zeroed by the kernel (docs/benchmarks.md has the cost). The
# thresholds hold for the main thread's heap only: other threads get arenas of their own, made of 64 MiB heaps
# that glibc unmaps as soon as they are empty (and blocks larger than that mmapped), whatever the thresholds. An
# engine runs its weight writes and generation on such threads (the actor's concurrency groups), and vLLM's reload
# allocates every layer anew, hence one arena for all threads.
KEEP_FREED_MEMORY = (
    "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296:glibc.malloc.arena_max=1"
)


def compute_env(cfg: Config | None = None) -> dict[str, str]:
    """The environment of the actors that compute (learner ranks, engines). Ray sets OMP_NUM_THREADS to an
    actor's logical CPU share (1); the roles take turns in synchronous mode, so each may use every core while it
    runs. Freed memory stays in the process, unless GLIBC_TUNABLES is already set (then it is left as it is). With a
    role on a TPU slice, TorchTPU's compilation cache goes to a folder of the run (rlpipe/hardware/tpu_env.py), so that a
    restarted actor does not compile its programs again."""
    env = {
        "OMP_NUM_THREADS": str(os.cpu_count() or 1),
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", KEEP_FREED_MEMORY),
    }
    if cfg is not None and (cfg.placement.learner.tpu is not None or cfg.placement.rollout.tpu is not None):
        env.update(compile_cache_env(cfg.run_dir))
    return env


def job_runtime_env(cfg: Config) -> dict | None:
    """The run's Ray job environment: with a role on a TPU slice, every worker process first drops the TPU launch
    variables it inherited and rlpipe did not give it (rlpipe/hardware/tpu_env.py) — before anything imports torch, since
    torch_tpu reads some of them when it is imported."""
    if cfg.placement.learner.tpu is None and cfg.placement.rollout.tpu is None:
        return None
    return {"worker_process_setup_hook": "rlpipe.hardware.tpu_env.keep_only_given_tpu_env"}


def start_ray(cfg: Config) -> None:
    """Join `ray.address`, or start a private local cluster bound to loopback."""
    if ray.is_initialized():
        return
    with keeping_sigterm_handler():
        _init_ray(cfg)


@contextmanager
def keeping_sigterm_handler() -> Iterator[None]:
    """Put back the SIGTERM handler the caller installed (`rlpipe train`'s, which ends the run as Ctrl-C does) once
    `ray.init` is done: it installs handlers of its own, the last of them its core worker's, which aborts the
    process where it stands. Without a handler of the caller's, Ray's stays."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _init_ray(cfg: Config) -> None:
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True, runtime_env=job_runtime_env(cfg))
        return
    # Ray rewrites a node address of 127.0.0.1 to the machine's outward address unless it runs in its
    # single-machine mode (the one it uses on macOS), which keeps every service on loopback. The flag is read
    # at import time: the environment carries it to Ray's own processes, the constant covers this one.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Token authentication on every service: Ray 2.60 turns it on for a new local cluster while RAY_AUTH_MODE is
    # unset (and writes a token to ~/.ray/auth_token if there is none). It is left to Ray rather than set here:
    # Ray caches the mode per process and refreshes that cache only when it sets the variable itself.
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    if auth_mode is not None and auth_mode.lower() != "token":
        logging.getLogger("rlpipe").warning(
            "RAY_AUTH_MODE=%s: the local Ray cluster runs without token authentication", auth_mode
        )
    ray.init(
        address="local",  # never silently join a cluster named by RAY_ADDRESS
        num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, actors_needed(cfg)),
        include_dashboard=cfg.ray.dashboard,
        dashboard_host="127.0.0.1",
        dashboard_port=cfg.ray.dashboard_port,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        runtime_env=job_runtime_env(cfg),
    )
