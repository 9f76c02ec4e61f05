"""The learner's parallelism: process group and device mesh (mesh.py), SimpleFSDP parameter sharding
(simple_fsdp.py)."""

from rlpipe.parallel.mesh import destroy_distributed, find_free_port, init_distributed, make_mesh
from rlpipe.parallel.simple_fsdp import (
    MixedPrecision,
    gathering_disabled,
    shard_model,
)

__all__ = [
    "MixedPrecision",
    "destroy_distributed",
    "find_free_port",
    "gathering_disabled",
    "init_distributed",
    "make_mesh",
    "shard_model",
]
