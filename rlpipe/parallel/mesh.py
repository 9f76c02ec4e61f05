"""The learner's process group and device mesh.

One process per device joins one torch.distributed group; the mesh over it names how parameters are laid out:
`("shard",)` for plain FSDP, `("replicate", "shard")` for hybrid sharding (each replica group holds a full copy
of the model, sharded across its own ranks; gradients are summed across replicas).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARD_DIM = "shard"
REPLICATE_DIM = "replicate"


def init_distributed(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 300,
) -> None:
    """Join the default process group through a TCP rendezvous at master_addr:master_port.

    The explicit timeout matters: with it a rank whose peer died gets an error from its next collective instead of
    waiting forever, so the actor holding it can be restarted.
    """
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised (rank {dist.get_rank()} of {dist.get_world_size()}); "
            "call destroy_distributed() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    host = f"[{master_addr}]" if ":" in master_addr else master_addr  # IPv6 literals need brackets in a URL
    with _gloo_worker_threads(GLOO_WORKER_THREADS if backend == "gloo" else None):
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{host}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )


# ProcessGroupGloo runs queued collectives on a pool of worker threads (2 by default), so collectives that are in
# flight together execute concurrently. Eager SimpleFSDP (and AOT-eager) waits on each gather at its first use,
# so hardly ever has two in flight, but inductor's code for the compiled step issues a layer's all-gathers back to back before
# waiting on any, and leaves every gradient's reduce-scatter in flight until the clipping norm. On this machine
# (torch 2.13 CPU) that crashed a 2-rank 12-layer x 512 step with heap corruption ("malloc(): unaligned tcache
# chunk detected", SIGSEGV/SIGABRT) in 4 of 5 runs, caught by gdb in both gloo worker threads while each ran an
# allgather; with one worker thread 3 runs (19 steps) completed. One worker thread runs the collectives one after
# another, in issue order, still overlapped with the compute.
GLOO_WORKER_THREADS = 1


@contextmanager
def _gloo_worker_threads(threads: int | None) -> Iterator[None]:
    """Within this block the default process group is created as a gloo group with `threads` worker threads.

    `init_process_group` ignores `pg_options` for gloo (torch builds ProcessGroupGloo with default options), so the
    class it calls is swapped for one that passes options; isinstance checks against ProcessGroupGloo still hold.
    """
    if threads is None:
        yield
        return
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo

    class ProcessGroupGlooWithThreads(gloo):
        def __init__(self, store, rank, size, timeout):
            options = gloo._Options()
            options._timeout = timeout
            # As torch's own constructor picks them: the interfaces named in GLOO_SOCKET_IFNAME, else the default.
            interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
            options._devices = [gloo.create_device(interface=name) for name in interfaces] or [
                gloo.create_default_device()
            ]
            options._threads = threads
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = ProcessGroupGlooWithThreads
    try:
        yield
    finally:
        distributed_c10d.ProcessGroupGloo = gloo


def destroy_distributed() -> None:
    """Leave the default process group; does nothing when none is initialised, so cleanup code can always call it."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`. Another process may still take it before the rendezvous
    binds it; callers that cannot tolerate that retry with a new port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def make_mesh(world_size: int, device_type: str = "cpu", replicate: int = 1) -> DeviceMesh:
    """The learner's mesh over the (already initialised) default process group.

    replicate == 1: a 1-D mesh `("shard",)` of world_size ranks. replicate > 1: a 2-D mesh
    `("replicate", "shard")` of shape (replicate, world_size // replicate); ranks that differ only in their
    replicate coordinate hold the same shard.
    """
    if replicate < 1 or world_size < 1 or world_size % replicate:
        raise ValueError(
            f"cannot split world_size={world_size} into replicate={replicate} groups of equal size: "
            "replicate must be a positive divisor of world_size"
        )
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"make_mesh was asked for world_size={world_size} but the process group has {dist.get_world_size()} ranks"
        )
    if replicate == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(
        device_type, (replicate, world_size // replicate), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM)
    )
