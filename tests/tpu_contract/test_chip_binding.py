"""Which chip each TPU process rlpipe starts really opens, found by running the installed packages' own binding code
on the environments rlpipe gives them, on a host whose PCI tree is faked to the described TPU host (the machinery is
rlpipe/tpu/hosts.py's, which `rlpipe rehearse` runs on a recipe's slices):

- engines: vllm-torchtpu's single-host preparation (`TpuPlatform._prepare_singlehost_tpu_env`), its worker-process
  shim (`WorkerProc.make_worker_process` as vllm_torchtpu patches it, tensor-parallel engines) and its worker's
  `TPUWorker.init_device` up to the collective set-up; the chip is the LOCAL_RANK torch_tpu then hands libtpu;
- learner ranks: `torch.tpu.distributed.set_tpu_launch_env` (topology given, the host's chip coordinates
  described) and the worker environment vllm-torchtpu's Ray executor builds.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from rlpipe.config import load_config
from rlpipe.hardware.tpu_env import GIVEN, LAYOUT, engine_process_env, keep_only_given_tpu_env, torchtpu_process_env
from rlpipe.hardware.tpu_layout import ENGINE_CHIP_COUNTS, slice_shares
from rlpipe.actors.placement import slice_slots
from rlpipe.tpu.hosts import (
    GKE_SLICE_ENV, ONE_CHIP_PIN, engine_worker_chips, engine_worker_envs, launch_envs, opened_chip, own_replica_env,
    slice_host_coords, tpu_host,
)

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
def test_every_engine_worker_opens_a_chip_of_its_own_share(recipe, overrides, tpu_device_name):
    from torch_tpu._internal.utils import hardware

    cfg, share, slots = _host_chips(recipe, overrides)
    tp = cfg.rollout.tensor_parallel
    own_share = range(share.first_chip, share.first_chip + share.chips_per_host)
    taken: dict[int, int] = {}
    with tpu_host(share.tslice.generation, share.tslice.chips_per_host):
        for engine, slot in enumerate(slots):
            workers = engine_worker_envs({**GKE_SLICE_ENV, "PATH": "/usr/bin", **slot.env}, tp)
            chips = [opened_chip(worker) for worker in workers]
            assert len(set(chips)) == tp and all(chip in own_share for chip in chips), (engine, chips)
            for chip in chips:
                assert chip not in taken, f"engines {taken[chip]} and {engine} both open chip {chip}"
                taken[chip] = engine
            if tp > 1:  # its own topology from the chips it has, not the slice's GKE gave the host
                assert workers[-1]["TORCH_TPU_TOPOLOGY"] == hardware.get_tpu_topology(tp)
    assert sorted(taken) == list(own_share)


ONE_CHIP_ENGINE_CASES = [
    pytest.param(recipe, [], id=recipe) for recipe in TPU_RECIPES
    if load_config(REPO / "configs" / recipe).rollout.tensor_parallel == 1
]


@pytest.mark.parametrize("recipe, overrides", ONE_CHIP_ENGINE_CASES)
def test_one_chip_engines_are_pinned_as_vllm_torchtpu_pins_its_own_one_chip_replicas(recipe, overrides,
                                                                                    tpu_device_name):
    """Each one-chip engine's worker, from the environment rlpipe gives its actor (a GKE slice's layout inherited
    too), ends with the pin vllm-torchtpu's worker gives its own replica on that chip."""
    cfg, share, slots = _host_chips(recipe, overrides)
    chips = []
    with tpu_host(share.tslice.generation, share.tslice.chips_per_host):
        for slot in slots:
            [ours] = engine_worker_envs({**GKE_SLICE_ENV, "PATH": "/usr/bin", **slot.env}, 1)
            chip = opened_chip(ours)
            theirs = own_replica_env(chip, share.tslice.chips_per_host)
            assert theirs["TPU_VISIBLE_CHIPS"] == theirs["TPU_VISIBLE_DEVICES"] == str(chip)
            assert {key: ours.get(key) for key in ONE_CHIP_PIN} == {key: theirs.get(key) for key in ONE_CHIP_PIN}
            chips.append(chip)
    assert chips == list(range(share.first_chip, share.first_chip + share.chips_per_host))


def test_the_old_libtpu_style_engine_environment_puts_every_engine_on_the_same_chips(tpu_device_name):
    """What engines got before (TPU_VISIBLE_CHIPS lists, libtpu's bounds): vllm-torchtpu ignores it."""
    old = [{"TPU_VISIBLE_CHIPS": chips, "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": port} for chips, port in (("0,1,2,3", "8476"), ("4,5,6,7", "8480"))]
    with tpu_host("v6e", 8):
        assert {tuple(engine_worker_chips(env, 4)) for env in old} == {(0, 1, 2, 3)}


@pytest.mark.parametrize("generation", sorted(ENGINE_CHIP_COUNTS))
def test_engines_start_only_on_chip_counts_torch_tpu_knows_a_topology_for(generation):
    from torch_tpu._internal.utils import hardware

    known = []
    with tpu_host(generation, 8):
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


@pytest.mark.parametrize("recipe", TPU_RECIPES)
def test_learner_ranks_get_what_torch_tpus_launch_helper_and_vllm_torchtpus_executor_give(recipe):
    cfg = load_config(REPO / "configs" / recipe)
    share = slice_shares(cfg.placement)["learner"]
    tslice = share.tslice
    executor_keys = ray_executor_worker_keys() - {"TORCH_TPU_XPROF_SESSION_ID"}
    if tslice.hosts == 1:
        slots = slice_slots(share, {0: "h"}, [{"NodeID": "h", "NodeManagerAddress": "10.0.0.1"}], 1, "tpu")
        [theirs] = launch_envs(tslice.generation, tslice.chips_per_host, [None], {}, share.chips_per_host)
        ours = slots[0].env
        assert set(theirs) - {"TORCH_TPU_XPROF_SESSION_ID"} <= set(ours)
        assert ours["TORCH_TPU_TOPOLOGY"] == theirs["TORCH_TPU_TOPOLOGY"]  # the PCI scan's, for the learner's chips
        addresses = "TORCH_TPU_SLICEBUILDER_ADDRESSES"
        assert len(ours[addresses].split(",")) == len(theirs[addresses].split(","))
        assert executor_keys <= set(ours)
        return
    # Bundles land on hosts in an order that is neither the worker ids' nor torch_tpu's.
    coords = slice_host_coords(tslice.topology)
    bundle_of_host = list(reversed(range(tslice.hosts)))
    nodes = [{"NodeID": f"n{b}", "NodeManagerAddress": f"10.0.{b}.1", "Labels": {"ray.io/tpu-worker-id": str(b)}}
             for b in range(tslice.hosts)]
    host_coords = {bundle_of_host[host]: coords[host] for host in range(tslice.hosts)}
    slots = slice_slots(share, {b: f"n{b}" for b in range(tslice.hosts)}, nodes, 1, "tpu", host_coords)
    names = slots[0].env["TPU_WORKER_HOSTNAMES"]
    given = {"TPU_WORKER_HOSTNAMES": names, "TORCH_TPU_TOPOLOGY": slots[0].env["TORCH_TPU_TOPOLOGY"]}
    checked = (0, tslice.hosts - 1)
    launched = launch_envs(tslice.generation, tslice.chips_per_host, [coords[host] for host in checked], given,
                           tslice.chips_per_host)
    for host, theirs in zip(checked, launched):
        bundle = bundle_of_host[host]
        ours = next(slot.env for slot in slots if slot.bundle_index == bundle)
        assert ours["TORCH_TPU_TOPOLOGY"] == given["TORCH_TPU_TOPOLOGY"]
        for key in set(theirs) - {"TORCH_TPU_XPROF_SESSION_ID"}:
            assert ours.get(key) == theirs[key], (key, ours.get(key), theirs[key])
        assert ours["NODE_RANK"] == str(host)  # torch_tpu's topological rank of this host
        assert executor_keys <= set(ours)
        assert set(ours[GIVEN].split(",")) == set(ours)


def test_a_host_without_a_tpu_reports_no_chip_coordinates_and_ranks_follow_worker_ids():
    """Asked on each learner host before the ranks start (actors/placement.py): here there is no chip to ask."""
    from rlpipe.actors.placement import local_chip_coords

    assert local_chip_coords() is None
