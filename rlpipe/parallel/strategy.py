"""How a learner spreads its model over devices, one object per scheme, chosen once from the device table.

A strategy knows where tensors live and how parameters are split; the train engine calls it at fixed points and
never asks which one it has (what the device itself implies, such as static shapes on a lazy device, it reads from
the backend table, rlpipe/hardware/device.py):
- `join(address, port)`: form the process group, if the scheme has one (every rank at the same time);
- `load(model, weights)`: give a model built on `meta` its weights (`CheckpointWeights`), each rank reading only
  what it keeps, laid out as the scheme splits parameters — before `join` where the scheme has no group, after it
  where it has one (the policy, and any frozen copy);
- `shard_state(tensors)`: lay optimizer state out like the parameters it belongs to;
- `place(micro)`: a micro-batch (rlpipe/training/forward.py `MicroBatch`) on the device, split where the scheme splits rows;
- `full_tensors(model)` / `full_state_dict(model)` / `local_weights(model)`: whole tensors on the host one at a time,
  or all at once (collectives where sharded: every rank takes part), or this rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rlpipe.types import MicroBatch


class Unsharded:
    """One process, one device, whole parameters."""

    needs_process_group = False
    rank, world_size = 0, 1

    def __init__(self, device: torch.device):
        self.device = device

    def join(self, master_addr: str, master_port: int) -> None:
        pass

    def load(self, model: nn.Module, weights) -> None:
        weights.load_into(model, self.device)

    def shard_state(self, tensors) -> None:
        pass

    def place(self, micro: MicroBatch) -> MicroBatch:
        """The micro-batch moved to the device."""
        return micro.to(self.device)

    def full_tensors(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in model.state_dict().items():
            yield name, value.cpu()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return dict(self.full_tensors(model))

    def local_weights(self, model: nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        """This rank's part of every state-dict entry `keep` accepts (all without it), on the host: only those are
        copied there."""
        return {name: value.cpu() for name, value in model.state_dict().items() if keep is None or keep(name)}


class SimpleFSDP(Unsharded):
    """Ranks of a torch.distributed group, each holding Shard(0) of every parameter as a DTensor and gathering it on
    use (rlpipe/parallel/simple_fsdp.py); also the way to compute in another dtype than the master weights' (one
    rank with mixed precision)."""

    needs_process_group = True

    def __init__(self, device, kind: str, rank: int, world_size: int, precision, timeout_s: float):
        super().__init__(device)
        self.kind, self.rank, self.world_size = kind, rank, world_size
        self.precision, self.timeout_s = precision, timeout_s
        self.mesh = None

    def join(self, master_addr: str, master_port: int) -> None:
        from rlpipe.hardware.device import backend
        from rlpipe.parallel.mesh import init_distributed, make_mesh

        table = backend(self.kind)
        init_distributed(
            table.dist_backend, self.rank, self.world_size, master_addr, master_port, timeout_s=self.timeout_s
        )
        self.mesh = make_mesh(self.world_size, table.torch_device)

    def load(self, model: nn.Module, weights) -> None:
        from rlpipe.parallel.simple_fsdp import shard_model

        shard_model(model, self.mesh, self.precision, weights)

    def full_tensors(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        from rlpipe.parallel.simple_fsdp import full_tensors

        for name, value in full_tensors(model):
            yield name, value.cpu()

    def local_weights(self, model: nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        state = model.state_dict()
        return {name: (value.to_local() if isinstance(value, DTensor) else value).cpu() for name, value in state.items()
                if keep is None or keep(name)}


class XlaSpmd(Unsharded):
    """One process driving several XLA devices as an SPMD mesh: parameters, optimizer state and each micro-batch's
    rows are annotated Shard(0) and XLA's partitioner places the collectives (see rlpipe/parallel/simple_fsdp.py
    for why not one process per device). The mesh must exist before any XLA tensor does, so it is made here."""

    def __init__(self, device_kind: str, devices: int):
        from rlpipe.hardware.device import torch_device
        from rlpipe.parallel.simple_fsdp import xla_spmd_mesh

        self.mesh = xla_spmd_mesh(devices)
        super().__init__(torch_device(device_kind))

    def load(self, model: nn.Module, weights) -> None:
        # One process feeds every device of the mesh: whole tensors, one at a time, each laid out over the mesh as
        # it arrives, so that no device holds more than its shards and one tensor.
        weights.load_into(model, self.device, placed=lambda param: self.shard_state([param]))

    def shard_state(self, tensors) -> None:
        from rlpipe.parallel.simple_fsdp import shard_dim0_spmd

        shard_dim0_spmd(list(tensors), self.mesh)

    def place(self, micro: MicroBatch) -> MicroBatch:
        moved = super().place(micro)
        self.shard_state(moved.tensors())
        return moved


def choose_strategy(learner, master_dtype: torch.dtype, rank: int = 0, world_size: int = 1):
    """The strategy for a `learner` config section and this process's place in the group."""
    from rlpipe.hardware.device import backend, torch_device
    from rlpipe.parallel.simple_fsdp import MixedPrecision

    table = backend(learner.device)
    if table.sharding == "xla_spmd":
        if world_size > 1:
            raise ValueError(f"learner.device: {learner.device!r} runs one learner process that shards over its devices")
        return XlaSpmd(learner.device, learner.ranks) if learner.ranks > 1 else Unsharded(torch_device(learner.device))
    param_dtype = getattr(torch, learner.param_dtype) if learner.param_dtype else master_dtype
    # A learner actor sees the one GPU its placement bundle holds (Ray sets CUDA_VISIBLE_DEVICES); processes started
    # otherwise may see all of them, one per rank.
    local = rank % torch.cuda.device_count() if table.kind == "cuda" and torch.cuda.device_count() > 1 else 0
    device = torch_device(learner.device, local)
    if world_size == 1 and param_dtype == master_dtype:
        return Unsharded(device)
    precision = MixedPrecision(param_dtype=param_dtype, reduce_dtype=getattr(torch, learner.reduce_dtype))
    return SimpleFSDP(device, learner.device, rank, world_size, precision, learner.collective_timeout_s)
