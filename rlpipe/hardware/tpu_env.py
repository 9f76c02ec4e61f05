"""The environment of each TPU process rlpipe starts: which chips it opens and how it finds the rest of its job.

Three contracts, each read from the package that consumes it (torch-tpu 0.2.0, vllm-torchtpu 0.29.0, libtpu; the
TPU contract lane feeds these environments through those packages' own code):
- a TorchTPU learner rank (`torchtpu_process_env`): torchrun's variables plus TorchTPU's slice builder, as
  `torch.tpu.distributed.set_tpu_launch_env` derives them; `LOCAL_RANK` is the chip it opens;
- a vLLM engine on TorchTPU (`engine_process_env`): a one-chip engine is pinned as vllm-torchtpu pins each one-chip
  replica of its own (`TPU_VISIBLE_CHIPS` and `TPU_VISIBLE_DEVICES` both name the chip, `ALLOW_MULTIPLE_LIBTPU_LOAD`
  lets the host's other processes load libtpu too); an engine of several chips binds tensor-parallel worker i to
  chip `LOCAL_RANK + offset`, the offset read from `TPU_LOCAL_RANK_OFFSET` by vllm-torchtpu's worker-process shim
  and from `DEBUG_TPU_LOCAL_RANK_OFFSET` by the worker itself (both name the engine's first chip so that every
  stage agrees); vllm-torchtpu picks the engine's own ports and topology when it starts;
- an xla learner (torch_xla on libtpu; `tpu_chip_block_env`): one process for its chips, `TPU_VISIBLE_CHIPS`
  and the process bounds.

A process starts from its host's environment, which on GKE or a TPU VM already holds a slice's layout (GKE injects
`TORCH_TPU_TOPOLOGY`, `TPU_WORKER_HOSTNAMES`, ...); torch_tpu and vllm-torchtpu keep what they find. So each TPU
actor's process first drops the layout variables (`LAYOUT`: ranks, chips, hosts, bounds, ports, topology) that
rlpipe did not give it (`keep_only_given_tpu_env`, run by Ray as the job's worker set-up hook: actors/cluster.py);
every other variable, tuning flags and cache folders among them, stays as the host set it. The hook also points
TorchTPU's compilation cache at the run's folder unless the host names one. This module imports nothing heavy, so
the hook runs before anything imports torch (torch_tpu reads some variables then).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence


# A block of N chips of one host as x,y,z bounds: what torch_tpu's PCI scan reports for N chips of a v5e/v6e host
# (and of up to 4 of a v4/v5p host), and what a slice of them spans.
CHIP_BLOCK_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
# libtpu's first process port; one port per chip of a host.
TPU_BASE_PORT = 8476
# torch_tpu's default first port for its slice builder (TORCH_TPU_BASE_PORT), one port per chip of a host.
TORCHTPU_BASE_PORT = 8070
# torch_tpu's launch helper's rendezvous port (set_tpu_launch_env); its PjRt bootstrap needs one on every rank.
TORCHTPU_MASTER_PORT = 29500
# torch_tpu's host bounds for multi-host slices (x, y, z chips per host), by which it ranks hosts.
TORCHTPU_CHIPS_PER_HOST = (2, 2, 1)

# The variables rlpipe set for a TPU actor, comma-separated; the layout variables it inherited are dropped.
GIVEN = "RLPIPE_TPU_ENV"
# Read once per process by torch_tpu's split compiler: "false" keeps every collective of the learner's captured step
# inside its one program, where XLA schedules them against the compute; with "true", torch_tpu's default, it cuts
# the program at every collective (102 programs for a 2-layer model: tests/tpu_contract/test_step_capture.py).
# vllm-torchtpu sets "false" when it is imported (vllm_torchtpu/env_override.py); a learner imports no
# vllm-torchtpu, hence here.
COLLECTIVES_IN_GRAPH = {"TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS": "false"}
# TorchTPU's on-disk compilation cache (read by torch_tpu, and by vllm-torchtpu's env_override.py, which then turns
# on the in-memory tier it needs): a restarted engine or learner reads its programs back instead of compiling them
# again for minutes. `RLPIPE_COMPILE_CACHE` carries rlpipe's folder for it; a folder the host names wins.
COMPILE_CACHE = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
COMPILE_CACHE_DEFAULT = "RLPIPE_COMPILE_CACHE"
# The in-memory tier the on-disk one needs, as vllm-torchtpu's env_override.py names it.
_COMPILE_CACHE_TIERS = {"TORCH_TPU_TIER2_COMPILATION_CACHE": "tpu_tier2_cache"}
# Where a process sits in its job and how it finds the rest of it: the variables the packages' own launchers set or
# read for that (tests/tpu_contract/test_chip_binding.py reads them from their source). Only these are dropped when
# inherited; tuning (LIBTPU_INIT_ARGS, XLA_FLAGS, TPU_* and TORCH_TPU_* flags), caches and logging are kept.
LAYOUT = frozenset({
    # torchrun's, and torch_tpu's `set_tpu_launch_env` (torch_tpu/_internal/distributed/distributed.py)
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
    "JOB_COMPLETION_INDEX", "TPU_WORKER_HOSTNAMES", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY",
    "TORCH_TPU_BASE_PORT", "TORCH_TPU_DEVICES_PER_HOST", "TORCH_TPU_XPROF_SESSION_ID",
    # libtpu's, as torch_tpu hands them on when it opens its chips, and GKE's and JAX's cluster description
    "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES", "TPU_VISIBLE_DEVICE_PATHS", "TPU_HOST_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_PORT",
    "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_ADDRESSES_PATH", "TPU_WORKER_ID", "TPU_HOSTNAME_OVERRIDE",
    "TPU_TOPOLOGY_WRAP", "TPU_TOPOLOGY_ALT", "CLOUD_TPU_TASK_ID", "MEGASCALE_COORDINATOR_ADDRESS",
    "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_PORT", "MEGASCALE_DEBUG_PORT",
    # vllm-torchtpu's executors and worker binding (vllm_torchtpu/executors/, worker/tpu_rank_binding.py)
    "TPU_NUM_HOSTS", "TPU_LOCAL_RANK_OFFSET", "DEBUG_TPU_LOCAL_RANK_OFFSET", "VLLM_TPU_DEVICE_ORDER",
    "TORCH_TPU_DP_SIZE", "TORCH_TPU_DP_MASTER_ADDR", "TORCH_TPU_DP_MASTER_PORT", "TORCH_TPU_MP_RENDEZVOUS_PORT",
    "TORCH_TPU_SLICE_RANK", "TORCH_TPU_SLICE_LOCAL_RANK", "TORCH_TPU_SLICE_WORLD_SIZE",
    "TORCH_TPU_SLICE_LOCAL_WORLD_SIZE",
})


def _given(env: dict[str, str]) -> dict[str, str]:
    """`env` for one TPU actor, with the collectives flag and the list of what rlpipe set."""
    env = {**COLLECTIVES_IN_GRAPH, **env, "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1"}
    return {**env, GIVEN: ",".join(sorted([*env, GIVEN]))}


def keep_only_given_tpu_env(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Drop the layout variables (`LAYOUT`) rlpipe did not set for this process, and point TorchTPU's compilation
    cache at rlpipe's folder where the host names none; the first thing a TPU actor's process does. Returns the
    names dropped; does nothing outside a TPU actor."""
    if GIVEN not in environ:
        return []
    given = set(environ[GIVEN].split(","))
    dropped = [name for name in environ if name in LAYOUT and name not in given]
    for name in dropped:
        del environ[name]
    folder = environ.get(COMPILE_CACHE_DEFAULT)
    if folder and not environ.get(COMPILE_CACHE) and _made(folder):
        environ[COMPILE_CACHE] = folder
        for name, value in _COMPILE_CACHE_TIERS.items():
            environ.setdefault(name, value)
    return dropped


def _made(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # not writable on this host: TorchTPU then compiles as it does without a cache
        return False
    return True


def compile_cache_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """What tells a TPU actor where TorchTPU's compilation cache goes: the driver's own setting if it has one, else
    a folder of the run (an absolute path: actors do not share the driver's working directory)."""
    folder = os.environ.get(COMPILE_CACHE) or os.path.join(os.path.abspath(run_dir), "tpu_compile_cache")
    return {COMPILE_CACHE_DEFAULT: folder}


# ------------------------------------------------------------------ vLLM engines on TorchTPU


def engine_process_env(first_chip: int, chips: int) -> dict[str, str]:
    """Environment of an engine whose tensor-parallel workers drive `chips` chips of their host from `first_chip`
    on. One chip: pinned as vllm-torchtpu pins a one-chip replica of its own (vllm_torchtpu/worker/tpu_worker.py:
    "TorchTPU only honors the chip pin ... when both agree"), with libtpu allowed to load in the host's other
    processes too (`ALLOW_MULTIPLE_LIBTPU_LOAD`). Several: chip `LOCAL_RANK + first_chip` per worker, as
    vllm-torchtpu binds a tensor-parallel engine's workers. vllm-torchtpu picks the rest (its ports, its topology
    from the chips' PCI scan) when the engine starts."""
    if chips == 1:
        chip = str(first_chip)
        return _given({"TPU_VISIBLE_CHIPS": chip, "TPU_VISIBLE_DEVICES": chip, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    offset = str(first_chip)
    return _given({"TPU_LOCAL_RANK_OFFSET": offset, "DEBUG_TPU_LOCAL_RANK_OFFSET": offset})


# ------------------------------------------------------------------ TorchTPU learner ranks


def host_rank_order(coords: Sequence[Sequence[int] | None], topology: str) -> list[int] | None:
    """The hosts (given by one chip's physical coordinates each) in torch_tpu's NODE_RANK order: host coordinates
    (chip // chips per host) sorted z, then y, then x. None when a host's coordinates are unknown."""
    if any(c is None for c in coords):
        return None
    dims = topology_dims(topology)
    host_grid = [max(1, d // c) for d, c in zip(dims, TORCHTPU_CHIPS_PER_HOST)]
    places = []
    for chip in coords:
        padded = [*chip, 0, 0][:3]
        place = tuple(p // c for p, c in zip(padded, TORCHTPU_CHIPS_PER_HOST))
        if any(p >= g for p, g in zip(place, host_grid)):
            raise ValueError(f"TPU chip coordinates {list(chip)} lie outside topology {topology}")
        places.append(place)
    if len(set(places)) != len(places):
        raise ValueError(f"two hosts report chips of the same TPU host position in topology {topology}")
    return sorted(range(len(coords)), key=lambda host: places[host][::-1])


def torchtpu_process_env(
    host_addresses: list[str], chips_per_host: int, worker_index: int, local_chip: int, topology: str | None = None,
    session_id: str | None = None,
) -> dict[str, str]:
    """Environment of the TorchTPU process (a learner rank) driving chip `local_chip` of host `worker_index`, in a
    job of `chips_per_host` chips on each of the hosts (`host_addresses`, in NODE_RANK order).

    Every key `torch.tpu.distributed.set_tpu_launch_env` sets for a multi-host job, and vllm-torchtpu's Ray
    executor for its workers, with the same values: the slice builder's addresses (one per chip, host by host),
    the topology, NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT; plus torchrun's place of this rank. `topology`: the
    job's chips (the slice's; None: the chips of one host). `session_id`: the profiler session every rank shares.
    """
    hosts = len(host_addresses)
    if not 0 <= worker_index < hosts:
        raise ValueError(f"worker_index {worker_index} is outside the {hosts} hosts")
    if not 0 <= local_chip < chips_per_host:
        raise ValueError(f"local_chip {local_chip} is outside the {chips_per_host} chips of a host")
    if topology is None:
        if hosts != 1:
            raise ValueError(f"a job of {hosts} hosts needs its topology")
        topology_bounds = CHIP_BLOCK_BOUNDS[chips_per_host]
    else:
        topology_bounds = ",".join(str(d) for d in topology_dims(topology))
    addresses = [f"{host}:{TORCHTPU_BASE_PORT + chip}" for host in host_addresses for chip in range(chips_per_host)]
    env = {
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(addresses),
        "TORCH_TPU_TOPOLOGY": topology_bounds,
        "TORCH_TPU_DEVICES_PER_HOST": str(chips_per_host),
        "TPU_WORKER_HOSTNAMES": ",".join(host_addresses),
        "TPU_NUM_HOSTS": str(hosts),
        "NNODES": str(hosts),
        "NODE_RANK": str(worker_index),
        "MASTER_ADDR": host_addresses[0],
        "MASTER_PORT": str(TORCHTPU_MASTER_PORT),
        "WORLD_SIZE": str(hosts * chips_per_host),
        "RANK": str(worker_index * chips_per_host + local_chip),
        "LOCAL_WORLD_SIZE": str(chips_per_host),
        "LOCAL_RANK": str(local_chip),
    }
    if session_id is not None:
        env["TORCH_TPU_XPROF_SESSION_ID"] = session_id
    return _given(env)


# ------------------------------------------------------------------ an xla learner (torch_xla on libtpu)


def tpu_chip_block_env(first_chip: int, chips: int) -> dict[str, str]:
    """Environment of one libtpu process (an xla learner: one SPMD process) driving `chips` chips of its host
    from `first_chip` on, as a job of its own."""
    return _given({
        "TPU_VISIBLE_CHIPS": ",".join(str(chip) for chip in range(first_chip, first_chip + chips)),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": CHIP_BLOCK_BOUNDS[chips],
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(TPU_BASE_PORT + first_chip),
    })


def topology_dims(topology: str) -> tuple[int, int, int]:
    try:
        dims = [int(d) for d in topology.lower().split("x")]
    except ValueError:
        dims = []
    if len(dims) not in (2, 3) or min(dims) < 1:
        raise ValueError(f"TPU topology must look like 2x4 or 2x2x2, got {topology!r}")
    return tuple(dims + [1] * (3 - len(dims)))  # type: ignore[return-value]
