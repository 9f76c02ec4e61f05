"""Which chip each TPU process rlpipe starts really opens, found by running the installed packages' own binding code
on the environments rlpipe gives them, on a host whose PCI tree is faked to the described TPU host:

- engines: vllm-torchtpu's single-host preparation (`TpuPlatform._prepare_singlehost_tpu_env`), its worker-process
  shim (`WorkerProc.make_worker_process` as vllm_torchtpu patches it, tensor-parallel engines) and its worker's
  `TPUWorker.init_device` up to the collective set-up; the chip is the LOCAL_RANK torch_tpu then hands libtpu;
- learner ranks: `torch.tpu.distributed.set_tpu_launch_env` (topology given, the host's chip coordinates
  described) and the worker environment vllm-torchtpu's Ray executor builds.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

from rlpipe.config import load_config
from rlpipe.tpu_env import GIVEN, LAYOUT, engine_process_env, keep_only_given_tpu_env, torchtpu_process_env
from rlpipe.tpu_layout import ENGINE_CHIP_COUNTS, slice_shares
from rlpipe.actors.placement import slice_slots

REPO = Path(__file__).resolve().parents[2]
# Every shipped recipe whose learner runs on TPU chips (the others, e.g. default.yaml, are CPU recipes).
TPU_RECIPES = sorted(
    path.name for path in (REPO / "configs").glob("*.yaml")
    if (yaml.safe_load(path.read_text()).get("learner") or {}).get("device") == "tpu"
)
ONE_VM = [  # one v6e-8 VM: 4 learner ranks, one engine of 4 chips
    "placement.learner.tpu=v6e-8", "placement.rollout.tpu=v6e-8", "placement.learner.chips=4",
    "placement.rollout.chips=4", "learner.ranks=4", "rollout.num_engines=1", "rollout.tensor_parallel=4",
    "train.prompts_per_step=24", "train.micro_batch_size=48",
]
# PCI device ids torch_tpu's scan knows (torch_tpu/_internal/utils/hardware.py), by generation.
PCI_DEVICE_ID = {"v4": "0x005e", "v5p": "0x0062", "v5litepod": "0x0063", "v6e": "0x006f"}
# What GKE puts in every container of a TPU slice's node pool: a layout for the whole slice, not for one engine.
GKE_SLICE_ENV = {"TORCH_TPU_TOPOLOGY": "4,4,1", "TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "0",
                 "MASTER_PORT": "12345", "TPU_VISIBLE_CHIPS": "0,1,2,3"}


def fake_pci_tree(root: Path, generation: str, chips: int) -> None:
    """`chips` Google TPU functions under root/sys/bus/pci/devices, each in an IOMMU group with its VFIO node."""
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


# ------------------------------------------------------------------ engines


class _Stop(Exception):
    """Raised where the worker would start its collectives: its environment is complete by then."""


def opened_chip(env: dict[str, str]) -> int:
    """The chip a worker with environment `env` opens: the one `TPU_VISIBLE_CHIPS` and `TPU_VISIBLE_DEVICES` both
    name, where they agree (vllm-torchtpu's pin of a one-chip replica: vllm_torchtpu/worker/tpu_worker.py), else
    `LOCAL_RANK`, which torch_tpu copies into `TPU_VISIBLE_CHIPS` for libtpu
    (vllm_torchtpu/worker/tpu_rank_binding.py)."""
    chip = env.get("TPU_VISIBLE_CHIPS")
    if chip is not None and chip == env.get("TPU_VISIBLE_DEVICES") and chip.isdigit():
        return int(chip)
    return int(env["LOCAL_RANK"])


def engine_worker_chips(env: dict[str, str], tp: int, monkeypatch) -> list[int]:
    """The chip each of an engine's `tp` workers opens, from the environment its actor starts with."""
    return [opened_chip(worker) for worker in engine_worker_envs(env, tp, monkeypatch)]


def engine_worker_envs(env: dict[str, str], tp: int, monkeypatch) -> list[dict[str, str]]:
    """The environment each of an engine's `tp` workers has where it starts its collectives (its chip is bound by
    then), from the environment its actor starts with."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor.multiproc_executor import WorkerProc

    import vllm_torchtpu
    from vllm_torchtpu.platforms.tpu_platform import TpuPlatform
    from vllm_torchtpu.worker import tpu_worker

    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    keep_only_given_tpu_env()
    parallel = ParallelConfig(tensor_parallel_size=tp)
    TpuPlatform._prepare_singlehost_tpu_env(tp)  # in the engine's process, before its workers start
    engine_env = dict(os.environ)

    spawned: list[dict[str, str]] = []
    record = staticmethod(lambda *args, **kwargs: spawned.append(dict(os.environ)))
    monkeypatch.setattr(WorkerProc, "make_worker_process", record)
    monkeypatch.setattr(WorkerProc, "_tpu_global_rank_env_patch", False, raising=False)
    vllm_torchtpu._patch_multiproc_worker_global_rank_env()
    monkeypatch.setattr(tpu_worker, "init_distributed_environment", lambda **kwargs: (_ for _ in ()).throw(_Stop()))

    workers = []
    for local_rank in range(tp):
        os.environ.clear()
        os.environ.update(engine_env)
        if tp > 1:  # a worker process of its own (the multiprocessing executor), through vllm-torchtpu's shim
            WorkerProc.make_worker_process(types.SimpleNamespace(parallel_config=parallel), local_rank, local_rank)
            os.environ.clear()
            os.environ.update(spawned[-1])
        worker = types.SimpleNamespace(
            parallel_config=parallel, rank=local_rank, local_rank=local_rank, devices=None,
            distributed_init_method="tcp://127.0.0.1:29511", vllm_config=None,
        )
        with pytest.raises(_Stop):
            tpu_worker.TPUWorker.init_device(worker)
        workers.append(dict(os.environ))
    return workers


# What pins a one-chip worker to its chip (vllm_torchtpu/worker/tpu_worker.py, the dense data-parallel branch of
# `TPUWorker.init_device`). WORLD_SIZE is left out: a one-worker engine's own preparation removes it
# (`TpuPlatform._prepare_singlehost_tpu_env`), where a replica of a data-parallel engine keeps "1".
ONE_CHIP_PIN = ("TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES", "ALLOW_MULTIPLE_LIBTPU_LOAD", "LOCAL_RANK", "RANK")


def own_replica_env(chip: int, host_chips: int, monkeypatch) -> dict[str, str]:
    """The environment vllm-torchtpu's own worker gives the one-chip replica on `chip` of a data-parallel engine
    spanning the host's `host_chips` chips, where it starts its collectives."""
    from vllm.config import ParallelConfig

    from vllm_torchtpu.worker import tpu_worker

    for name in list(os.environ):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv("TORCH_TPU_DP_MASTER_PORT", "29600")  # what its data-parallel launcher gives every replica
    monkeypatch.setattr(tpu_worker, "init_distributed_environment", lambda **kwargs: (_ for _ in ()).throw(_Stop()))
    parallel = ParallelConfig(tensor_parallel_size=1, data_parallel_size=host_chips, data_parallel_rank=chip)
    worker = types.SimpleNamespace(
        parallel_config=parallel, rank=0, local_rank=0, devices=None,
        distributed_init_method="tcp://127.0.0.1:29511", vllm_config=None,
    )
    with pytest.raises(_Stop):
        tpu_worker.TPUWorker.init_device(worker)
    return dict(os.environ)


ENGINE_CASES = [
    *(pytest.param(recipe, [], id=recipe) for recipe in TPU_RECIPES),
    pytest.param("qwen3-0.6b-gsm8k-v6e.yaml", ONE_VM, id="one-v6e-8-vm"),
]


def _host_chips(recipe: str, overrides: list[str]):
    cfg = load_config(REPO / "configs" / recipe, overrides)
    share = slice_shares(cfg.placement)["rollout"]
    nodes = [{"NodeID": "host", "NodeManagerAddress": "10.0.0.1", "Labels": {}}]
    bundle_nodes = {index: "host" for index in range(share.tslice.hosts)}
    if share.tslice.hosts > 1:
        nodes = [{"NodeID": f"host-{i}", "NodeManagerAddress": f"10.0.0.{i + 1}", "Labels": {}}
                 for i in range(share.tslice.hosts)]
        bundle_nodes = {index: f"host-{index}" for index in range(share.tslice.hosts)}
    slots = slice_slots(share, bundle_nodes, nodes, cfg.rollout.tensor_parallel)
    first_host = [slot for slot in slots if slot.bundle_index == 0]  # every host is laid out alike
    return cfg, share, first_host


@pytest.mark.parametrize("recipe, overrides", ENGINE_CASES)
def test_every_engine_worker_opens_a_chip_of_its_own_share(recipe, overrides, tmp_path, monkeypatch, tpu_device_name):
    from torch_tpu._internal.utils import hardware

    cfg, share, slots = _host_chips(recipe, overrides)
    tp = cfg.rollout.tensor_parallel
    fake_pci_tree(tmp_path, share.tslice.generation, share.tslice.chips_per_host)
    monkeypatch.setattr(hardware, "pathlib", rooted_pathlib(tmp_path))
    own_share = range(share.first_chip, share.first_chip + share.chips_per_host)
    taken: dict[int, int] = {}
    for engine, slot in enumerate(slots):
        chips = engine_worker_chips({**GKE_SLICE_ENV, "PATH": "/usr/bin", **slot.env}, tp, monkeypatch)
        assert len(set(chips)) == tp and all(chip in own_share for chip in chips), (engine, chips)
        for chip in chips:
            assert chip not in taken, f"engines {taken[chip]} and {engine} both open chip {chip}"
            taken[chip] = engine
        if tp > 1:  # its own topology from the chips it has, not the slice's GKE gave the host
            assert os.environ["TORCH_TPU_TOPOLOGY"] == hardware.get_tpu_topology(tp)
    assert sorted(taken) == list(own_share)


ONE_CHIP_ENGINE_CASES = [
    pytest.param(recipe, [], id=recipe) for recipe in TPU_RECIPES
    if load_config(REPO / "configs" / recipe).rollout.tensor_parallel == 1
]


@pytest.mark.parametrize("recipe, overrides", ONE_CHIP_ENGINE_CASES)
def test_one_chip_engines_are_pinned_as_vllm_torchtpu_pins_its_own_one_chip_replicas(recipe, overrides, tmp_path,
                                                                                    monkeypatch, tpu_device_name):
    """Each one-chip engine's worker, from the environment rlpipe gives its actor (a GKE slice's layout inherited
    too), ends with the pin vllm-torchtpu's worker gives its own replica on that chip."""
    from torch_tpu._internal.utils import hardware

    cfg, share, slots = _host_chips(recipe, overrides)
    fake_pci_tree(tmp_path, share.tslice.generation, share.tslice.chips_per_host)
    monkeypatch.setattr(hardware, "pathlib", rooted_pathlib(tmp_path))
    chips = []
    for slot in slots:
        [ours] = engine_worker_envs({**GKE_SLICE_ENV, "PATH": "/usr/bin", **slot.env}, 1, monkeypatch)
        chip = opened_chip(ours)
        theirs = own_replica_env(chip, share.tslice.chips_per_host, monkeypatch)
        assert theirs["TPU_VISIBLE_CHIPS"] == theirs["TPU_VISIBLE_DEVICES"] == str(chip)
        assert {key: ours.get(key) for key in ONE_CHIP_PIN} == {key: theirs.get(key) for key in ONE_CHIP_PIN}
        chips.append(chip)
    assert chips == list(range(share.first_chip, share.first_chip + share.chips_per_host))


def test_the_old_libtpu_style_engine_environment_puts_every_engine_on_the_same_chips(tmp_path, monkeypatch,
                                                                                    tpu_device_name):
    """What engines got before (TPU_VISIBLE_CHIPS lists, libtpu's bounds): vllm-torchtpu ignores it."""
    from torch_tpu._internal.utils import hardware

    fake_pci_tree(tmp_path, "v6e", 8)
    monkeypatch.setattr(hardware, "pathlib", rooted_pathlib(tmp_path))
    old = [{"TPU_VISIBLE_CHIPS": chips, "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": port} for chips, port in (("0,1,2,3", "8476"), ("4,5,6,7", "8480"))]
    assert {tuple(engine_worker_chips(env, 4, monkeypatch)) for env in old} == {(0, 1, 2, 3)}


@pytest.mark.parametrize("generation", sorted(ENGINE_CHIP_COUNTS))
def test_engines_start_only_on_chip_counts_torch_tpu_knows_a_topology_for(generation, tmp_path, monkeypatch):
    from torch_tpu._internal.utils import hardware

    fake_pci_tree(tmp_path, generation, 8)
    monkeypatch.setattr(hardware, "pathlib", rooted_pathlib(tmp_path))
    known = []
    for count in (1, 2, 4, 8):
        try:
            hardware.get_tpu_topology(count)
        except RuntimeError:
            continue
        known.append(count)
    host_chips = 8 if generation in ("v5litepod", "v6e") else 4  # v4 and v5p hosts carry 4 chips
    assert tuple(count for count in known if count <= host_chips) == ENGINE_CHIP_COUNTS[generation]


# ------------------------------------------------------------------ what a TPU actor's process keeps

_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]{2,}$")
# Set by the packages' binding code, yet no layout: libtpu's permission to load in several processes of a host.
NOT_LAYOUT = {"ALLOW_MULTIPLE_LIBTPU_LOAD"}


def _env_names(obj, dict_keys_only: bool = False) -> set[str]:
    """The environment variable names in `obj`'s source: string constants and `envs.NAME` reads (or, for a
    launcher building its workers' environments, the keys of its dict literals)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    names = set()
    for node in ast.walk(tree):
        if dict_keys_only:
            if isinstance(node, ast.Dict):
                names |= {key.value for key in node.keys if isinstance(key, ast.Constant)
                          and isinstance(key.value, str)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
            names.add(node.attr)
    return {name for name in names if _ENV_NAME.match(name)}


def launchers_layout_names() -> set[str]:
    """What the packages' own launchers and binding code set or read to place a process in its job: torch_tpu's
    `set_tpu_launch_env`, vllm-torchtpu's worker binding and its Ray executors' worker environments."""
    import vllm_torchtpu
    from torch.tpu import distributed as tpu_distributed
    from vllm_torchtpu.executors import ray_distributed_executor, ray_distributed_executor_v2
    from vllm_torchtpu.platforms.tpu_platform import TpuPlatform
    from vllm_torchtpu.worker import tpu_rank_binding, tpu_worker

    names = set()
    for code in (tpu_distributed.set_tpu_launch_env, tpu_worker.TPUWorker.init_device,
                 tpu_worker._configure_tpu_process_env, TpuPlatform._prepare_singlehost_tpu_env,
                 vllm_torchtpu._patch_multiproc_worker_global_rank_env, tpu_rank_binding):
        names |= _env_names(code)
    for executor in (ray_distributed_executor, ray_distributed_executor_v2):
        names |= _env_names(executor, dict_keys_only=True)
    assert {"TPU_VISIBLE_CHIPS", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TPU_LOCAL_RANK_OFFSET"} <= names  # still read
    return names


def test_the_worker_hook_drops_every_layout_variable_the_packages_launchers_set_and_nothing_else():
    from vllm_torchtpu import envs

    layout = launchers_layout_names() - NOT_LAYOUT
    assert layout <= LAYOUT, sorted(layout - LAYOUT)
    # vllm-torchtpu's own switches that are no layout (its tuning, its compilation cache), and libtpu's flags.
    tuning = {name for name in envs.environment_variables if name not in LAYOUT} | {"LIBTPU_INIT_ARGS", "XLA_FLAGS"}
    assert {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "TPU_MOE_SEQUENCE_PARALLEL"} <= tuning
    for given in (engine_process_env(2, 1), engine_process_env(4, 4), torchtpu_process_env(["h"], 4, 0, 1)):
        environ = {**{name: "inherited" for name in layout | tuning | NOT_LAYOUT}, **given}
        keep_only_given_tpu_env(environ)
        assert set(environ) == set(given) | tuning | NOT_LAYOUT


# ------------------------------------------------------------------ learner ranks

_LAUNCH_HELPER = textwrap.dedent("""
    import json, pathlib, sys, types
    import torch, torch_tpu
    from torch_tpu._internal.utils import hardware
    from torch_tpu._internal.distributed import distributed
    from torch.tpu import distributed as tpu_distributed
    root, coords, nproc = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    hardware.pathlib = types.SimpleNamespace(Path=lambda p, *r: root / pathlib.Path(p, *r).relative_to("/"))
    distributed._query_local_device_coords = lambda: coords  # what the chips report (a child process on a TPU)
    import os
    before = dict(os.environ)
    tpu_distributed.set_tpu_launch_env(nproc_per_node=nproc)
    print("ENV", json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
""")


def launch_helper_env(tmp_path: Path, generation: str, chips_per_host: int, coords: list[int] | None,
                      env: dict[str, str], ranks_per_host: int | None = None) -> dict[str, str]:
    """What torch_tpu's launch helper sets for `ranks_per_host` ranks (default: one per chip) on a host of
    `chips_per_host` chips of `generation`."""
    root = tmp_path / f"host-{json.dumps(coords)}"
    fake_pci_tree(root, generation, chips_per_host)
    nproc = ranks_per_host or chips_per_host
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCH_HELPER, str(root), json.dumps(coords), str(nproc)],
        env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENV ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][4:])


def ray_executor_worker_keys() -> set[str]:
    """The keys vllm-torchtpu's Ray executor sets in each worker's environment (read from its source: running it
    needs Ray workers on TPU hosts)."""
    from vllm_torchtpu.executors import ray_distributed_executor

    tree = ast.parse(inspect.getsource(ray_distributed_executor))
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "args" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "args"
            and isinstance(t.slice, ast.Constant) for t in node.targets
        ):
            keys |= {t.slice.value for t in node.targets if isinstance(t, ast.Subscript)}
    assert {"NNODES", "NODE_RANK", "MASTER_PORT", "TORCH_TPU_TOPOLOGY"} <= keys  # the executor still builds them
    return keys


# Every host's first chip, in torch_tpu's host order for each multi-host learner slice, as a 2x2-chip host reports it.
def _host_coords(topology: str) -> list[list[int]]:
    dims = [int(d) for d in topology.split("x")] + [1]
    return [[x, y, z, 0] for z in range(0, dims[2]) for y in range(0, dims[1], 2) for x in range(0, dims[0], 2)]


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_learner_ranks_get_what_torch_tpus_launch_helper_and_vllm_torchtpus_executor_give(recipe, tmp_path):
    cfg = load_config(REPO / "configs" / recipe)
    share = slice_shares(cfg.placement)["learner"]
    tslice = share.tslice
    executor_keys = ray_executor_worker_keys() - {"TORCH_TPU_XPROF_SESSION_ID"}
    if tslice.hosts == 1:
        slots = slice_slots(share, {0: "h"}, [{"NodeID": "h", "NodeManagerAddress": "10.0.0.1"}], 1, "tpu")
        theirs = launch_helper_env(tmp_path, tslice.generation, tslice.chips_per_host, None, {}, share.chips_per_host)
        ours = slots[0].env
        assert set(theirs) - {"TORCH_TPU_XPROF_SESSION_ID"} <= set(ours)
        assert ours["TORCH_TPU_TOPOLOGY"] == theirs["TORCH_TPU_TOPOLOGY"]  # the PCI scan's, for the learner's chips
        addresses = "TORCH_TPU_SLICEBUILDER_ADDRESSES"
        assert len(ours[addresses].split(",")) == len(theirs[addresses].split(","))
        assert executor_keys <= set(ours)
        return
    # Bundles land on hosts in an order that is neither the worker ids' nor torch_tpu's.
    coords = _host_coords(tslice.topology)
    bundle_of_host = list(reversed(range(tslice.hosts)))
    nodes = [{"NodeID": f"n{b}", "NodeManagerAddress": f"10.0.{b}.1", "Labels": {"ray.io/tpu-worker-id": str(b)}}
             for b in range(tslice.hosts)]
    host_coords = {bundle_of_host[host]: coords[host] for host in range(tslice.hosts)}
    slots = slice_slots(share, {b: f"n{b}" for b in range(tslice.hosts)}, nodes, 1, "tpu", host_coords)
    names = slots[0].env["TPU_WORKER_HOSTNAMES"]
    for host in (0, tslice.hosts - 1):
        bundle = bundle_of_host[host]
        ours = next(slot.env for slot in slots if slot.bundle_index == bundle)
        given = {"TPU_WORKER_HOSTNAMES": names, "TORCH_TPU_TOPOLOGY": ours["TORCH_TPU_TOPOLOGY"]}
        theirs = launch_helper_env(tmp_path, tslice.generation, tslice.chips_per_host, coords[host], given)
        for key in set(theirs) - {"TORCH_TPU_XPROF_SESSION_ID"}:
            assert ours.get(key) == theirs[key], (key, ours.get(key), theirs[key])
        assert ours["NODE_RANK"] == str(host)  # torch_tpu's topological rank of this host
        assert executor_keys <= set(ours)
        assert set(ours[GIVEN].split(",")) == set(ours)


def test_a_host_without_a_tpu_reports_no_chip_coordinates_and_ranks_follow_worker_ids():
    """Asked on each learner host before the ranks start (actors/placement.py): here there is no chip to ask."""
    from rlpipe.actors.placement import local_chip_coords

    assert local_chip_coords() is None
