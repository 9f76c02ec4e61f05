"""A TPU actor's process starts from the launch variables rlpipe gives it, not the host's: a real local Ray cluster
started as `rlpipe train` starts it, with a TPU placement in the recipe, and a slice's layout in the environment the
cluster inherits (as GKE puts it in every container of a TPU node pool)."""

from __future__ import annotations

import os

import pytest

from rlpipe.actors.cluster import start_ray
from rlpipe.config import load_config
from rlpipe.tpu_env import engine_process_env

pytestmark = pytest.mark.integration

# What this module saw when a Ray worker imported it to run the actor below: before any test code ran there.
ENVIRONMENT_AT_IMPORT = dict(os.environ)
GKE_SLICE_ENV = {"TORCH_TPU_TOPOLOGY": "4,4,1", "TPU_WORKER_HOSTNAMES": "a,b,c,d", "MASTER_PORT": "12345"}


class Seen:
    def at_import(self) -> dict[str, str]:
        seen = ENVIRONMENT_AT_IMPORT.items()
        return {k: v for k, v in seen if k in GKE_SLICE_ENV or k.startswith(("TPU_", "DEBUG_"))}


def test_tpu_actors_drop_the_inherited_slice_layout_before_anything_is_imported(monkeypatch, ray_cluster):
    import ray

    for name, value in GKE_SLICE_ENV.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(None, ["ray.num_cpus=2", "placement.rollout.tpu=v6e-8", "rollout.dtype=bfloat16",
                             "rollout.num_engines=8"])
    start_ray(cfg)
    actor = ray.remote(Seen)
    engine = actor.options(num_cpus=0, runtime_env={"env_vars": engine_process_env(4)}).remote()
    assert ray.get(engine.at_import.remote()) == {"TPU_LOCAL_RANK_OFFSET": "4", "DEBUG_TPU_LOCAL_RANK_OFFSET": "4"}
    other = actor.options(num_cpus=0).remote()  # not a TPU actor: left as it was
    assert ray.get(other.at_import.remote()) == GKE_SLICE_ENV
