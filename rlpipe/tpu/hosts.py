"""Each TPU actor's environment, as rlpipe derives it for a recipe's slices, fed through the TPU packages' own binding
and launch code on hosts described to them as the recipe's:

- learner ranks: torch_tpu's launch helper (`torch.tpu.distributed.set_tpu_launch_env`) on every learner host, the
  slice's topology given and the host's chip coordinates reported; `LOCAL_RANK` is the chip a rank opens;
- engines: vllm-torchtpu's single-host preparation (`TpuPlatform._prepare_singlehost_tpu_env`), its worker-process
  shim (tensor-parallel engines) and its worker's `TPUWorker.init_device` up to the collective set-up, where a
  worker's chip is bound.

`tpu_host` presents a TPU host to torch_tpu's hardware scan (a PCI tree in a temporary folder), so the packages'
chip counting and topology look-ups run here as on the host. Each actor starts from a GKE slice's layout (GKE puts
one in every container of a TPU node pool), which its process drops first (`keep_only_given_tpu_env`). Needs the
`tpu` extra (torch-tpu, vllm-torchtpu); both are imported where used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from rlpipe.hardware.tpu_env import (
    TORCHTPU_CHIPS_PER_HOST, engine_process_env, host_rank_order, keep_only_given_tpu_env, topology_dims,
    torchtpu_process_env,
)
from rlpipe.hardware.tpu_layout import SliceShare, slice_shares

LEARNER_RANKS = "environments: learner ranks"
ENGINES = "environments: engines"
# PCI device ids torch_tpu's scan knows (torch_tpu/_internal/utils/hardware.py), by rlpipe's generation names.
PCI_DEVICE_ID = {"v4": "0x005e", "v5p": "0x0062", "v5litepod": "0x0063", "v6e": "0x006f"}
# What GKE puts in every container of a TPU slice's node pool: a layout for the whole slice, not for one actor.
GKE_SLICE_ENV = {"TORCH_TPU_TOPOLOGY": "4,4,1", "TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "0",
                 "MASTER_PORT": "12345", "TPU_VISIBLE_CHIPS": "0,1,2,3"}
# What pins a one-chip worker to its chip (vllm_torchtpu/worker/tpu_worker.py, the dense data-parallel branch of
# `TPUWorker.init_device`). WORLD_SIZE is left out: a one-worker engine's own preparation removes it
# (`TpuPlatform._prepare_singlehost_tpu_env`), where a replica of a data-parallel engine keeps "1".
ONE_CHIP_PIN = ("TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES", "ALLOW_MULTIPLE_LIBTPU_LOAD", "LOCAL_RANK", "RANK")
# The profiler session every rank of one job shares (placement gives each job its own).
SESSION_ID = "1"
# Set by torch_tpu's launch helper with a value of its own making (a timestamp): compared across ranks, not with it.
_OWN_VALUE = {"TORCH_TPU_XPROF_SESSION_ID"}
# The rendezvous a worker is handed by vLLM's executor; the worker stops before it connects.
_INIT_METHOD = "tcp://127.0.0.1:29511"


# ------------------------------------------------------------------ a TPU host


def fake_pci_tree(root: Path, generation: str, chips: int) -> None:
    """`chips` Google TPU functions under root/sys/bus/pci/devices, each in an IOMMU group with its VFIO node: what
    torch_tpu's scan counts as chips."""
    if generation not in PCI_DEVICE_ID:
        raise ValueError(f"no TPU host of generation {generation!r} to describe (known: {', '.join(PCI_DEVICE_ID)})")
    for chip in range(chips):
        device = root / "sys/bus/pci/devices" / f"0000:00:{chip + 4:02x}.0"
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x1ae0\n")
        (device / "device").write_text(PCI_DEVICE_ID[generation] + "\n")
        group = root / "sys/kernel/iommu_groups" / str(chip)
        group.mkdir(parents=True)
        (device / "iommu_group").symlink_to(group)
        (root / "dev/vfio").mkdir(parents=True, exist_ok=True)
        (root / "dev/vfio" / str(chip)).write_text("")


def rooted_pathlib(root: Path) -> types.SimpleNamespace:
    """A `pathlib` for torch_tpu's hardware module whose absolute paths lie under `root`."""
    return types.SimpleNamespace(Path=lambda path, *rest: root / Path(path, *rest).relative_to("/"))


@contextlib.contextmanager
def _pci_root(generation: str, chips: int) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"rlpipe-{generation}-host-") as folder:
        fake_pci_tree(Path(folder), generation, chips)
        yield Path(folder)


@contextlib.contextmanager
def tpu_host(generation: str, chips: int) -> Iterator[Path]:
    """Within it, torch_tpu's hardware scan (and vllm-torchtpu's, which is torch_tpu's) finds a TPU host of
    `generation` (rlpipe's name: v4, v5p, v5litepod, v6e) with `chips` chips; yields the folder standing for `/`."""
    from torch_tpu._internal.utils import hardware

    with _pci_root(generation, chips) as root, mock.patch.object(hardware, "pathlib", rooted_pathlib(root)):
        yield root


# ------------------------------------------------------------------ what a process is given


def inherited(given: dict[str, str]) -> dict[str, str]:
    """The environment a TPU actor starts with on a GKE slice: the slice's layout, rlpipe's `given` on top."""
    return {**GKE_SLICE_ENV, "PATH": "/usr/bin", **given}


def actor_process_env(given: dict[str, str]) -> dict[str, str]:
    """The environment a TPU actor's process works with: what it `inherited`, less the layout rlpipe did not give
    (dropped as the actor's process starts)."""
    environ = inherited(given)
    keep_only_given_tpu_env(environ)
    return environ


def opened_chip(env: dict[str, str]) -> int:
    """The chip a process with environment `env` opens: the one `TPU_VISIBLE_CHIPS` and `TPU_VISIBLE_DEVICES` both
    name, where they agree (vllm-torchtpu's pin of a one-chip replica: vllm_torchtpu/worker/tpu_worker.py), else
    `LOCAL_RANK`, which torch_tpu copies into `TPU_VISIBLE_CHIPS` for libtpu
    (vllm_torchtpu/worker/tpu_rank_binding.py)."""
    chip = env.get("TPU_VISIBLE_CHIPS")
    if chip is not None and chip == env.get("TPU_VISIBLE_DEVICES") and chip.isdigit():
        return int(chip)
    return int(env["LOCAL_RANK"])


# ------------------------------------------------------------------ engines


class _Stop(Exception):
    """Raised where a worker would start its collectives: its environment is complete by then."""


def _stop(**kwargs) -> None:
    raise _Stop()


def _worker(parallel, rank: int) -> types.SimpleNamespace:
    """What `TPUWorker.init_device` reads of its worker up to the collective set-up."""
    return types.SimpleNamespace(parallel_config=parallel, rank=rank, local_rank=rank, devices=None,
                                 distributed_init_method=_INIT_METHOD, vllm_config=None)


def _init_device(worker) -> None:
    from vllm_torchtpu.worker import tpu_worker

    try:
        tpu_worker.TPUWorker.init_device(worker)
    except _Stop:
        return
    raise RuntimeError("vllm-torchtpu's TPUWorker.init_device no longer reaches init_distributed_environment")


def _name_tpu_device() -> None:
    """`TPUWorker.init_device` makes a `tpu` device, a name torch_tpu gives PrivateUse1 on a TPU host only."""
    import torch

    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")


def engine_worker_envs(env: dict[str, str], tp: int) -> list[dict[str, str]]:
    """The environment each of an engine's `tp` workers has where it starts its collectives (its chip is bound by
    then), from the environment its actor starts with (`env`). Run within `tpu_host`; os.environ is as before after."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor.multiproc_executor import WorkerProc

    import vllm_torchtpu
    from vllm_torchtpu.platforms.tpu_platform import TpuPlatform
    from vllm_torchtpu.worker import tpu_worker

    _name_tpu_device()
    parallel = ParallelConfig(tensor_parallel_size=tp)
    spawned: list[dict[str, str]] = []

    def record(*args, **kwargs) -> None:  # the executor's spawn, as the environment the worker process gets
        spawned.append(dict(os.environ))

    workers = []
    with contextlib.ExitStack() as scoped:
        scoped.enter_context(mock.patch.dict(os.environ, clear=True))
        scoped.enter_context(mock.patch.object(WorkerProc, "make_worker_process", staticmethod(record)))
        scoped.enter_context(mock.patch.object(WorkerProc, "_tpu_global_rank_env_patch", False, create=True))
        scoped.enter_context(mock.patch.object(tpu_worker, "init_distributed_environment", _stop))
        os.environ.update(env)
        keep_only_given_tpu_env()  # the actor's first step (Ray's worker set-up hook)
        TpuPlatform._prepare_singlehost_tpu_env(tp)  # in the engine's process, before its workers start
        engine_env = dict(os.environ)
        vllm_torchtpu._patch_multiproc_worker_global_rank_env()  # its shim, around the recorder
        for local_rank in range(tp):
            os.environ.clear()
            os.environ.update(engine_env)
            if tp > 1:  # a worker process of its own (the multiprocessing executor), through vllm-torchtpu's shim
                WorkerProc.make_worker_process(types.SimpleNamespace(parallel_config=parallel), local_rank, local_rank)
                os.environ.clear()
                os.environ.update(spawned[-1])
            _init_device(_worker(parallel, local_rank))
            workers.append(dict(os.environ))
    return workers


def engine_worker_chips(env: dict[str, str], tp: int) -> list[int]:
    """The chip each of an engine's `tp` workers opens, from the environment its actor starts with."""
    return [opened_chip(worker) for worker in engine_worker_envs(env, tp)]


def own_replica_env(chip: int, host_chips: int) -> dict[str, str]:
    """The environment vllm-torchtpu's own worker gives the one-chip replica on `chip` of a data-parallel engine
    spanning the host's `host_chips` chips, where it starts its collectives. Run within `tpu_host`."""
    from vllm.config import ParallelConfig

    from vllm_torchtpu.worker import tpu_worker

    _name_tpu_device()
    parallel = ParallelConfig(tensor_parallel_size=1, data_parallel_size=host_chips, data_parallel_rank=chip)
    with mock.patch.dict(os.environ, clear=True), \
            mock.patch.object(tpu_worker, "init_distributed_environment", _stop):
        # what its data-parallel launcher gives every replica
        os.environ.update({"PATH": "/usr/bin", "TORCH_TPU_DP_MASTER_PORT": "29600"})
        _init_device(_worker(parallel, 0))
        return dict(os.environ)


def host_engine_variables(share: SliceShare, tp: int) -> list[tuple[int, dict[str, str]]]:
    """(first chip, environment given) of each engine on one host of the rollout's share, as placement gives them:
    every host alike (actors/placement.py's `slice_slots`)."""
    first = share.first_chip
    return [(chip, engine_process_env(chip, tp)) for chip in range(first, first + share.chips_per_host, tp)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM's start-up log (vllm-torchtpu's too), a few lines per worker, kept to errors while workers are fed."""
    import vllm.logger  # noqa: F401  (configures the "vllm" logger when first imported: before its level is set)

    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _chips(chips: list[int]) -> str:
    return f"chip {chips[0]}" if len(chips) == 1 else f"chips {','.join(str(chip) for chip in chips)}"


def check_engine_variables(cfg) -> tuple[bool, str]:
    """Every engine on a host of the recipe's rollout slice, its actor's environment through vllm-torchtpu's binding:
    each worker opens a chip of the rollout's share no other opens, an engine's workers consecutive chips, a
    tensor-parallel engine's workers one topology of their own chips (torch_tpu's), a one-chip engine the pin
    vllm-torchtpu gives its own one-chip replica on that chip."""
    from torch_tpu._internal.utils import hardware

    share = slice_shares(cfg.placement)["rollout"]
    tslice, tp = share.tslice, cfg.rollout.tensor_parallel
    own = range(share.first_chip, share.first_chip + share.chips_per_host)
    taken: dict[int, int] = {}
    problems: list[str] = []
    with tpu_host(tslice.generation, tslice.chips_per_host), _quiet():
        topology = hardware.get_tpu_topology(tp) if tp > 1 else None
        for engine, (first_chip, given) in enumerate(host_engine_variables(share, tp)):
            where = f"engine {engine} (given {_chips(list(range(first_chip, first_chip + tp)))})"
            try:
                workers = engine_worker_envs(inherited(given), tp)
                chips = [opened_chip(worker) for worker in workers]
            except Exception as error:  # noqa: BLE001 (the package refused this environment: that is the finding)
                problems.append(f"{where}: {_one_line(error)}")
                continue
            for chip in chips:
                if chip in taken:
                    problems.append(f"engines {taken[chip]} and {engine} both open chip {chip}")
                taken.setdefault(chip, engine)
            if not all(chip in own for chip in chips):
                problems.append(f"{where} opens {_chips(chips)}, outside the rollout's {own.start}-{own.stop - 1}")
            if chips != list(range(chips[0], chips[0] + tp)):
                problems.append(f"{where}: its workers open {_chips(chips)}, not {tp} consecutive chips")
            if tp > 1:  # the engine's own slice: its chips' topology (torch_tpu's), one address per worker
                seen = {(w.get("TORCH_TPU_TOPOLOGY"), w.get("TORCH_TPU_SLICEBUILDER_ADDRESSES")) for w in workers}
                found, addresses = next(iter(seen))
                if len(seen) != 1 or found != topology or len((addresses or "").split(",")) != tp:
                    problems.append(f"{where}: its workers' topology and slice builder {sorted(map(str, seen))} are "
                                    f"not one slice of {tp} chips ({topology}, torch_tpu's)")
            else:
                theirs = own_replica_env(chips[0], tslice.chips_per_host)
                pin = {key: theirs.get(key) for key in ONE_CHIP_PIN}
                ours = {key: workers[0].get(key) for key in ONE_CHIP_PIN}
                if ours != pin:
                    problems.append(f"{where}: pinned as {ours}, vllm-torchtpu's own replica on chip {chips[0]} as "
                                    f"{pin}")
    idle = [chip for chip in own if chip not in taken]
    if idle and not problems:
        problems.append(f"no engine opens {_chips(idle)} of the rollout's share")
    if problems:
        return False, "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    engines = len(own) // tp
    how = "vllm-torchtpu's one-chip replica pin" if tp == 1 else f"topology {topology} per engine"
    return True, (f"{engines} engine(s) of {tp} chip(s) on each of {tslice.hosts} {tslice.pod_type} host(s) open "
                  f"chips {own.start}-{own.stop - 1}, each its own, consecutive per engine ({how})")


# ------------------------------------------------------------------ learner ranks

# Runs torch_tpu's launch helper once per host in a process forked after the imports: the helper memoizes what it
# reads and resolves (torch_tpu's GetEnvOnce, env_utils), so every host needs a process of its own. Each line on stdin
# is one question (the PCI root standing for `/`, the hosts' chip coordinates, ranks per host); its answer ends with
# a line of its own.
_LAUNCH_HELPER = textwrap.dedent("""
    import json, os, pathlib, sys, types
    import torch, torch_tpu
    from torch_tpu._internal.utils import hardware
    from torch_tpu._internal.distributed import distributed
    from torch.tpu import distributed as tpu_distributed
    for question in sys.stdin:
        root, hosts, nproc = json.loads(question)
        root = pathlib.Path(root)
        hardware.pathlib = types.SimpleNamespace(Path=lambda p, *r: root / pathlib.Path(p, *r).relative_to("/"))
        for index, coords in enumerate(hosts):
            sys.stdout.flush()
            pid = os.fork()
            if pid:
                os.waitpid(pid, 0)
                continue
            try:
                distributed._query_local_device_coords = lambda: coords  # what the host's chips report
                before = dict(os.environ)
                tpu_distributed.set_tpu_launch_env(nproc_per_node=nproc)
                out = {"env": {k: v for k, v in os.environ.items() if before.get(k) != v}}
            except Exception as error:
                out = {"error": f"{type(error).__name__}: {error}"}
            print("HOST", index, json.dumps(out), flush=True)
            os._exit(0)
        print("ANSWERED", flush=True)
""")


def launch_envs(generation: str, chips_per_host: int, hosts: list[list[int] | None], env: dict[str, str],
                ranks_per_host: int | None = None) -> list[dict[str, str]]:
    """What torch_tpu's launch helper sets on each of `hosts` (given by their first chip's coordinates; None: it
    reports none) for `ranks_per_host` ranks (None: its default), a host having `chips_per_host` chips of
    `generation`, with `env` the job's environment. Raises ValueError with the helper's refusal."""
    # The helper's process spends ~10 s importing torch_tpu; its answer depends on the arguments alone, so one
    # process asks once for each (a rehearsal and its checks ask again for the same hosts).
    key = (generation, chips_per_host, json.dumps(hosts), json.dumps(env, sort_keys=True), ranks_per_host)
    if key not in _LAUNCHED:
        _LAUNCHED[key] = _run_launch_helper(generation, chips_per_host, hosts, env, ranks_per_host)
    return [dict(host_env) for host_env in _LAUNCHED[key]]


_LAUNCHED: dict[tuple, list[dict[str, str]]] = {}


def _run_launch_helper(generation: str, chips_per_host: int, hosts: list[list[int] | None], env: dict[str, str],
                       ranks_per_host: int | None) -> list[dict[str, str]]:
    with LaunchHelper(env) as helper:
        return helper.ask(generation, chips_per_host, hosts, ranks_per_host)


class LaunchHelper:
    """torch_tpu's launch helper in a process of its own, started with a job's environment `env` (what the helper
    reads of it is read once per process), which answers questions about hosts until closed."""

    def __init__(self, env: dict[str, str]):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # the imports' warnings, unread unless the process ends
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH_HELPER],
            env={"PATH": os.environ.get("PATH", "/usr/bin"), "TPU_SKIP_MDS_QUERY": "1", **env},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        )

    def ask(self, generation: str, chips_per_host: int, hosts: list[list[int] | None],
            ranks_per_host: int | None, timeout_s: float = 600) -> list[dict[str, str]]:
        """What the helper sets on each of `hosts` (see `launch_envs`). Raises ValueError with the helper's refusal,
        RuntimeError when its process ended (or was ended after `timeout_s`) before answering."""
        found = {}
        with _pci_root(generation, chips_per_host) as root:
            watchdog = threading.Timer(timeout_s, self.process.kill)
            watchdog.start()
            try:
                self.process.stdin.write(json.dumps([str(root), hosts, ranks_per_host]) + "\n")
                self.process.stdin.flush()
                for line in self.process.stdout:
                    if line.startswith("HOST "):
                        _, index, out = line.split(" ", 2)
                        found[int(index)] = json.loads(out)
                    elif line.startswith("ANSWERED"):
                        break
            except OSError:  # its stdin closed: the process has ended
                pass
            finally:
                watchdog.cancel()
        if len(found) != len(hosts):
            with contextlib.suppress(subprocess.TimeoutExpired):  # its output ended: so has the process, or nearly
                self.process.wait(timeout=10)
            self._stderr.seek(0)
            tail = [line for line in self._stderr.read().splitlines() if line.strip()][-1:] or ["no output"]
            raise RuntimeError(f"torch_tpu's launch helper ended (exit {self.process.returncode}): {tail[0]}")
        for index in range(len(hosts)):
            if "error" in found[index]:
                raise ValueError(f"torch_tpu's set_tpu_launch_env on host {index}: {found[index]['error']}")
        return [found[index]["env"] for index in range(len(hosts))]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # the end of its questions
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self._stderr.close()

    def __enter__(self) -> LaunchHelper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def slice_host_coords(topology: str) -> list[list[int]]:
    """Each host's first chip's coordinates, in torch_tpu's host order (z, then y, then x), for a slice of
    `topology` whose hosts hold a block of torch_tpu's host bounds each (2x2x1 chips)."""
    dims = topology_dims(topology)
    step = TORCHTPU_CHIPS_PER_HOST
    return [[x, y, z, 0] for z in range(0, dims[2], step[2]) for y in range(0, dims[1], step[1])
            for x in range(0, dims[0], step[0])]


def learner_rank_envs(share: SliceShare) -> list[tuple[list[int] | None, list[dict[str, str]]]]:
    """Each learner host's chip coordinates (None on a one-host slice) and the environments rlpipe gives its ranks
    there, as placement derives them (actors/placement.py's `slice_slots`): Ray hands the hosts over in an order of
    its own (here the reverse of torch_tpu's), rlpipe ranks them by their chips' coordinates."""
    tslice = share.tslice
    if tslice.hosts == 1:
        coords: list[list[int] | None] = [None]
        order = [0]
    else:
        coords = list(reversed(slice_host_coords(tslice.topology)))
        order = host_rank_order(coords, tslice.topology)
        if order is None or len(coords) != tslice.hosts:
            raise ValueError(f"{tslice.pod_type}: {len(coords)} hosts of 2x2 chips in {tslice.topology}, "
                             f"not its {tslice.hosts}")
    addresses = [f"10.0.{bundle}.1" for bundle in order]
    topology = None if share.shared else tslice.topology
    hosts = []
    for host, bundle in enumerate(order):
        ranks = [torchtpu_process_env(addresses, share.chips_per_host, host, chip, topology, SESSION_ID)
                 for chip in range(share.first_chip, share.first_chip + share.chips_per_host)]
        hosts.append((coords[bundle], ranks))
    return hosts


# What every rank of one job must hold alike: its place in the slice and how it meets the others.
_SLICE_KEYS = ("WORLD_SIZE", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "MASTER_ADDR", "MASTER_PORT",
               "NNODES", "TPU_WORKER_HOSTNAMES", "TORCH_TPU_XPROF_SESSION_ID")


def check_learner_environments(cfg) -> tuple[bool, str]:
    """Every learner rank's environment against torch_tpu's launch helper on each host of the learner's slice: the
    ranks agree on the slice (world size, topology, slice builder and rendezvous addresses) as the helper derives it
    for that host (its NODE_RANK from the host's chip coordinates), and each opens a chip of the learner's share of
    its host that no other rank there opens."""
    if cfg.learner.device != "tpu":
        return False, f"learner.device is {cfg.learner.device!r}: only TorchTPU learner ranks are rehearsed"
    share = slice_shares(cfg.placement)["learner"]
    tslice = share.tslice
    hosts = [(coords, [actor_process_env(env) for env in ranks]) for coords, ranks in learner_rank_envs(share)]
    ranks = [env for _, host_ranks in hosts for env in host_ranks]
    problems: list[str] = []
    for key in _SLICE_KEYS:
        values = {env.get(key) for env in ranks}
        if None in values:
            problems.append(f"{key} is missing on some ranks")
        elif len(values) != 1:
            problems.append(f"the ranks disagree on {key} ({len(values)} values)")
    first = ranks[0]
    addresses = first.get("TORCH_TPU_SLICEBUILDER_ADDRESSES", "").split(",")
    if first.get("WORLD_SIZE") != str(len(ranks)) or len(addresses) != len(ranks):
        problems.append(f"{len(ranks)} ranks but WORLD_SIZE {first.get('WORLD_SIZE')} and {len(addresses)} "
                        "slice builder addresses")
    if sorted(int(env["RANK"]) for env in ranks) != list(range(len(ranks))):
        problems.append(f"RANK is not 0-{len(ranks) - 1}, each once")
    own = range(share.first_chip, share.first_chip + share.chips_per_host)
    for host, (_, host_ranks) in enumerate(hosts):
        chips = [opened_chip(env) for env in host_ranks]
        if len(set(chips)) != len(chips) or not all(chip in own for chip in chips):
            problems.append(f"the ranks of host {host} open {_chips(chips)}, not each its own of chips "
                            f"{own.start}-{own.stop - 1}")
    if tslice.hosts == 1:
        given, coords, per_host = {}, [None], share.chips_per_host
    else:  # the slice's hosts and topology, as a multi-host job gives them to the helper
        given = {key: first[key] for key in ("TPU_WORKER_HOSTNAMES", "TORCH_TPU_TOPOLOGY")}
        coords, per_host = [host_coords for host_coords, _ in hosts], None
    try:
        theirs_by_host = launch_envs(tslice.generation, tslice.chips_per_host, coords, given, per_host)
    except (ValueError, RuntimeError) as error:
        return False, _one_line(error)
    for host, ((_, host_ranks), theirs) in enumerate(zip(hosts, theirs_by_host)):
        ours = host_ranks[0]
        if tslice.hosts == 1:  # its addresses are ports it picks on this host: compared by count
            theirs_count = len(theirs.get("TORCH_TPU_SLICEBUILDER_ADDRESSES", "").split(","))
            if theirs.get("TORCH_TPU_TOPOLOGY") != ours.get("TORCH_TPU_TOPOLOGY") or theirs_count != len(addresses):
                problems.append(f"topology {ours.get('TORCH_TPU_TOPOLOGY')} of {len(addresses)} addresses, torch_tpu's "
                                f"{theirs.get('TORCH_TPU_TOPOLOGY')} of {theirs_count}")
            missing = sorted(set(theirs) - set(ours) - _OWN_VALUE)
            if missing:
                problems.append(f"the ranks lack {', '.join(missing)}, which torch_tpu's launch helper sets")
            continue
        differ = sorted(key for key in set(theirs) - _OWN_VALUE if any(env.get(key) != theirs[key]
                                                                        for env in host_ranks))
        if differ:
            key, more = differ[0], f" (and {', '.join(differ[1:])})" if differ[1:] else ""
            problems.append(f"host {host} (first chip at {coords[host]}): {key} {ours.get(key)!r} where torch_tpu's "
                            f"launch helper sets {theirs[key]!r}{more}")
    if problems:
        return False, "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    how = ("NODE_RANK as torch_tpu ranks hosts by their chips' coordinates" if tslice.hosts > 1
           else "as torch_tpu's launch helper derives it for their chips")
    return True, (f"{len(ranks)} ranks on {tslice.hosts} {tslice.pod_type} host(s), chips {own.start}-{own.stop - 1} "
                  f"each: one chip each, one slice (topology {first['TORCH_TPU_TOPOLOGY']}, {len(addresses)} "
                  f"addresses) {how}")


# ------------------------------------------------------------------ the checks


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def environment_checks(cfg) -> list[tuple[str, bool, str]]:
    """(name, passed, reason) for each TPU role of the recipe `cfg`: its actors' environments through the TPU
    packages' own launch and binding code on the recipe's hosts. os.environ is as before after."""
    shares = slice_shares(cfg.placement)
    checks = []
    for name, role, check in ((LEARNER_RANKS, "learner", check_learner_environments),
                              (ENGINES, "rollout", check_engine_variables)):
        if role not in shares:
            continue
        try:
            passed, reason = check(cfg)
        except Exception as error:  # noqa: BLE001 (a check that raises has failed; the others still run)
            passed, reason = False, _one_line(error)
        checks.append((name, passed, reason))
    return checks
