"""A TPU actor's process starts from the launch variables rlpipe gives it, not the host's: a real local Ray cluster
started as `rlpipe train` starts it, with a TPU placement in the recipe, and a slice's layout in the environment the
cluster inherits (as GKE puts it in every container of a TPU node pool). The host's tuning is kept, and TorchTPU's
compilation cache goes to the run's folder."""

from __future__ import annotations

import os

import pytest

from rlpipe.actors.cluster import compute_env, start_ray
from rlpipe.config import load_config
from rlpipe.hardware.tpu_env import engine_process_env

pytestmark = pytest.mark.integration

# What this module saw when a Ray worker imported it to run the actor below: before any test code ran there.
ENVIRONMENT_AT_IMPORT = dict(os.environ)
GKE_SLICE_ENV = {"TORCH_TPU_TOPOLOGY": "4,4,1", "TPU_WORKER_HOSTNAMES": "a,b,c,d", "MASTER_PORT": "12345"}
HOST_TUNING = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true"}


class Seen:
    def at_import(self) -> dict[str, str]:
        seen = ENVIRONMENT_AT_IMPORT.items()
        return {k: v for k, v in seen if k in GKE_SLICE_ENV or k in HOST_TUNING
                or k.startswith(("TPU_", "DEBUG_", "ALLOW_MULTIPLE_LIBTPU", "TORCH_TPU_TIER"))}


def test_tpu_actors_drop_the_inherited_slice_layout_before_anything_is_imported(monkeypatch, ray_cluster, tmp_path):
    import ray

    for name, value in {**GKE_SLICE_ENV, **HOST_TUNING}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", raising=False)
    cfg = load_config(None, ["ray.num_cpus=2", "placement.rollout.tpu=v6e-8", "rollout.dtype=bfloat16",
                             "rollout.num_engines=8", f"run.output_dir={tmp_path}", "run.name=r"])
    start_ray(cfg)
    actor = ray.remote(Seen)
    env = {**compute_env(cfg), **engine_process_env(4, 1)}
    engine = actor.options(num_cpus=0, runtime_env={"env_vars": env}).remote()
    assert ray.get(engine.at_import.remote()) == {
        "TPU_VISIBLE_CHIPS": "4", "TPU_VISIBLE_DEVICES": "4", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **HOST_TUNING,
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": str(tmp_path / "r" / "tpu_compile_cache"),
        "TORCH_TPU_TIER2_COMPILATION_CACHE": "tpu_tier2_cache",
    }
    other = actor.options(num_cpus=0).remote()  # not a TPU actor: left as it was
    assert ray.get(other.at_import.remote()) == {**GKE_SLICE_ENV, **HOST_TUNING}
