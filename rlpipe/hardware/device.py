"""The backend table: for each device kind, its torch device, collective backend, compile backend, sharding scheme
and whether it runs a step lazily, as one recorded program.

The xla row is PyTorch/XLA (torch_xla 2.9, which needs torch 2.9.0 exactly, so it lives in its own environment:
scripts/test-xla.sh). torch_xla is imported only when an xla device is asked for. On xla the learner's step is not
captured by Dynamo: torch 2.9's Dynamo cannot trace `torch.autograd.grad` into a graph (its `trace_autograd_ops`
switch came later), so forward, backward and optimizer would end up in separate graphs. Instead the step runs as
ordinary torch ops on lazy XLA tensors, which record it, and `step_boundary` cuts the record into one XLA program,
compiled once per input shape (XLA caches programs by graph hash) and run once per step. `openxla` stays the
compile backend for `torch.compile` of other code on this device.

The TPU rows follow TorchTPU's documented process model (one process per chip, `tpu` device, `tpu_dist`
collectives, `torch.compile(backend="tpu")`); they have not yet run on TPU hardware. The slices (`tpu_slice`) are
here; each TPU process's environment is in rlpipe/hardware/tpu_env.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from rlpipe.hardware.tpu_env import topology_dims


@dataclass(frozen=True)
class Backend:
    kind: str
    torch_device: str
    dist_backend: str
    compile_backend: str
    # How the learner shards its parameters over several devices (rlpipe/parallel/strategy.py): "simple_fsdp", one
    # process per device in a torch.distributed group, or "xla_spmd", one process annotating an SPMD mesh.
    sharding: str = "simple_fsdp"
    # The device records ops and runs them as one program at `step_boundary` (xla): the learner's step is that
    # record rather than a Dynamo graph, and its shapes must be static (each new one compiles a program of its own),
    # so batches pad to length buckets and never pack.
    lazy: bool = False
    # rlpipe's Pallas kernels run as ops of the device's own bridge to JAX kernels (TorchTPU's `jax_op`), which must
    # be registered before a step that calls them is traced.
    bridged_kernels: bool = False


BACKENDS = {
    "cpu": Backend("cpu", "cpu", "gloo", "inductor"),
    "cuda": Backend("cuda", "cuda", "nccl", "inductor"),
    # Tensors' collectives on TorchTPU's `tpu_dist`, objects' (torch.distributed.checkpoint plans with
    # all_gather_object) on gloo: torch sends an object collective to the group's cpu backend where it has one.
    "tpu": Backend("tpu", "tpu", "cpu:gloo,tpu:tpu_dist", "tpu", bridged_kernels=True),
    "xla": Backend("xla", "xla", "xla", "openxla", sharding="xla_spmd", lazy=True),
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
    if spec.kind == "xla":
        return _torch_xla().device()  # imported on demand: it registers the xla device type with torch
    return torch.device(spec.torch_device)


def learner_processes(kind: str, ranks: int) -> int:
    """The learner's processes (Ray actors) for `learner.ranks`: one per rank in a torch.distributed group, or one
    that drives every rank's device as an SPMD mesh (xla)."""
    return 1 if backend(kind).sharding == "xla_spmd" else ranks


def learner_variables(kind: str, ranks: int) -> dict[str, str]:
    """Environment variables a learner process needs on `kind`: on xla, one PJRT CPU device per rank (read by
    PJRT's CPU client only; a TPU host's devices are its chips)."""
    return {"CPU_NUM_DEVICES": str(ranks)} if kind == "xla" else {}


def device_unavailable(kind: str) -> str | None:
    """Why this process cannot train on a `kind` device, in a few words; None when it can. Asked in the
    learner's own environment before a run starts (rlpipe/startup/preflight.py)."""
    if kind == "cuda" and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    if kind == "xla":
        try:
            import torch_xla
        except ImportError as err:
            return f"cannot import torch_xla ({err})"
        try:
            torch_xla.device()
        except Exception as err:  # PJRT raises RuntimeError or its own types for a client it cannot create
            first = (str(err).strip().splitlines() or [""])[0][:160]
            return f"torch_xla cannot open its PJRT device ({type(err).__name__}: {first})"
    if kind == "tpu":
        try:
            import torch_tpu  # noqa: F401  (registers the tpu device where a chip is present)
        except ImportError as err:
            return f"cannot import torch_tpu ({err})"
        # torch_tpu 0.2.0 keeps torch.tpu.is_available() to itself (it raises when called) and points to this.
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != "tpu":
            return "torch_tpu finds no TPU on this host"
    return None


# The oldest and newest torch (major, minor) the learner has run on: 2.13 in .venv (the cpu and tpu extras: eager and
# captured steps) and 2.9 in .venv-xla (eager steps on xla only). Versions between are taken to work; none outside.
LEARNER_TORCH = ((2, 9), (2, 13))


def torch_unsupported(version: str | None = None) -> str | None:
    """Why the learner does not support this torch version (default: the one imported), in one line; None when it
    does. Asked by scripts/device-check.sh before it runs anything on a machine's own torch."""
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    release = tuple(map(int, found.groups())) if found else None
    low, high = LEARNER_TORCH
    if release is None or not low <= release <= high:
        supported = f"torch {low[0]}.{low[1]} to {high[0]}.{high[1]}"
        return f"torch {version} is outside the versions the learner runs on ({supported})"
    return None


def captured_step_unsupported() -> str | None:
    """Why this torch cannot capture the learner's step (learner.graph) as one graph, or None: the step traces
    `torch.autograd.grad`, which Dynamo does only with its `trace_autograd_ops` switch (torch 2.9 has none)."""
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        version = torch.__version__
        return f"torch {version}: Dynamo lacks trace_autograd_ops, which the captured step (learner.graph) needs"
    return None


# ------------------------------------------------------------------ PyTorch/XLA


def _torch_xla():
    try:
        import torch_xla
    except ImportError as err:
        raise RuntimeError(
            f"learner.device: 'xla' needs torch_xla, which is not importable here ({err}); "
            "it needs torch 2.9.0 exactly, so it has its own environment: bash scripts/test-xla.sh"
        ) from None
    return torch_xla


def step_boundary(device: torch.device) -> None:
    """Run what the step recorded on a lazy device (xla) as one program; nothing to do on eager devices.

    Every live tensor the step wrote (parameters, optimizer state, metrics) is materialised by this one call, so
    the host reads the metrics afterwards without triggering another program. It waits for the program to finish:
    the caller reads its results next anyway, and torch_xla's counters are complete only then.
    """
    if device.type == "xla":
        _torch_xla().sync(wait=True)


@dataclass(frozen=True)
class XlaCounters:
    """torch_xla's process-wide counters, read before and after a stretch of work to see what it cost.

    `executions` counts programs run: a step recorded without a hidden host sync runs exactly one. Every
    `.item()`, `.tolist()`, printed tensor or data-dependent Python branch inside the step forces the record so
    far to run first, so extra executions are the step's hidden syncs. `fallbacks` maps each aten op that XLA
    could not lower (run on the host instead, a sync each time) to its count.
    """

    compiles: int = 0
    executions: int = 0
    transfers_to_host: int = 0
    fallbacks: tuple[tuple[str, int], ...] = ()

    def __sub__(self, earlier: "XlaCounters") -> "XlaCounters":
        before = dict(earlier.fallbacks)
        return XlaCounters(
            self.compiles - earlier.compiles,
            self.executions - earlier.executions,
            self.transfers_to_host - earlier.transfers_to_host,
            tuple((op, n - before.get(op, 0)) for op, n in self.fallbacks if n > before.get(op, 0)),
        )


def xla_counters() -> XlaCounters:
    """The current counts (all zero until torch_xla has been imported, so eager devices pay nothing)."""
    import sys

    if "torch_xla" not in sys.modules:
        return XlaCounters()
    import torch_xla.debug.metrics as metrics

    def samples(name: str) -> int:
        data = metrics.metric_data(name)
        return int(data[0]) if data else 0

    fallbacks = tuple((op, int(metrics.counter_value(op) or 0)) for op in sorted(metrics.executed_fallback_ops()))
    # Programs launched, counted where the lazy tensors' graph is built for a launch (cached or not), in the
    # calling thread; the execution-time metrics are recorded by XLA's own threads, sometimes after a wait returns.
    executions = samples("TensorsGraphSize")
    return XlaCounters(samples("CompileTime"), executions, samples("TransferFromDeviceTime"), fallbacks)


# ------------------------------------------------------------------ TPU slices

# Pod types name v4 and v5p slices by TensorCores (two per chip), v5e (v5litepod) and v6e slices by chips.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
# The usual topology of a slice of N chips, by generation family (2-D for v5e/v6e, 3-D for v4/v5p).
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}
# HBM per chip, GiB (Cloud TPU system-architecture pages: v4 32 GiB, v5p 95 GB, v5e 16 GB, v6e 32 GB).
_HBM_GIB = {"v4": 32, "v5p": 95, "v5litepod": 16, "v6e": 32}


@dataclass(frozen=True)
class TpuSlice:
    """One TPU slice: its pod type (`v6e-16`), topology (`4x4`), hosts and chips per host."""

    pod_type: str
    generation: str
    topology: str
    hosts: int
    chips_per_host: int

    @property
    def chips(self) -> int:
        return self.hosts * self.chips_per_host

    @property
    def hbm_gib(self) -> int:
        return _HBM_GIB[self.generation]

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_gib * 2**30


def tpu_slice(pod_type: str, topology: str | None = None) -> TpuSlice:
    """The slice a pod type names. Hosts carry 4 chips, except single-host v5e/v6e slices of up to 8 chips."""
    generation, _, count = pod_type.strip().lower().rpartition("-")
    generation = {"v5e": "v5litepod", "v5lite": "v5litepod"}.get(generation, generation)
    if generation not in _CORES_PER_CHIP or not count.isdigit() or int(count) % _CORES_PER_CHIP[generation]:
        raise ValueError(
            f"TPU pod type {pod_type!r} is not one of v4-N, v5p-N, v5litepod-N, v6e-N (N: TensorCores for v4/v5p)"
        )
    chips = int(count) // _CORES_PER_CHIP[generation]
    flat = generation in ("v5litepod", "v6e")
    usual = (_TOPOLOGIES_2D if flat else _TOPOLOGIES_3D).get(chips)
    topology = (topology or usual or "").strip().lower()
    if not topology:
        raise ValueError(f"TPU pod type {pod_type!r}: no usual topology for {chips} chips; give one")
    dims = topology_dims(topology)
    if math.prod(dims) != chips or (flat and dims[2] != 1):
        raise ValueError(f"TPU topology {topology!r} does not have the {chips} chips of {pod_type}")
    per_host = chips if flat and chips <= 8 else 4
    return TpuSlice(f"{generation}-{count}", generation, topology, max(1, chips // per_host), min(chips, per_host))
