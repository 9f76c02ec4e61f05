"""Where the roles' actors run: one Ray placement group per role, built from `placement.<role>` in the config.

On CPU/GPU nodes a role's group has one bundle per actor — a CPU plus the role's custom resources — placed with
the role's strategy, so `placement.learner.resources: {learner_host: 1}` puts every learner rank on nodes that
advertise `learner_host`. A role with `placement.<role>.tpu` reserves a whole TPU slice instead (one bundle
per host) and runs one actor per chip (TorchTPU learner ranks), per host (an xla learner, one SPMD process) or per
`rollout.tensor_parallel` chips (engines), each with the TPU environment of its chips (rlpipe/hardware/tpu_env.py). Learner
and rollout ask for a slice each, or share the chips of one TPU VM (`placement.<role>.chips`, rlpipe/hardware/tpu_layout.py).

The TPU path follows Ray's documented slice API (`ray.util.tpu.SlicePlacementGroup`; on older Rays the
`TPU-<pod type>-head` resource plus per-host bundles); it has not run on TPU hardware yet. The arithmetic is
unit-tested against described clusters, and which chip each actor then opens is found in the TPU contract lane by
the TPU packages' own binding code (tests/tpu_contract/test_chip_binding.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlpipe.config import ConfigError, RolePlacement
from rlpipe.hardware.device import TpuSlice
from rlpipe.startup.interpreters import interpreter
from rlpipe.hardware.tpu_env import engine_process_env, host_rank_order, torchtpu_process_env, tpu_chip_block_env
from rlpipe.hardware.tpu_layout import SliceShare

SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"


@dataclass
class Slot:
    """Where one actor goes: a bundle of its role's placement group, and the environment it needs there."""

    bundle_index: int
    env: dict[str, str] = field(default_factory=dict)
    tpu_chips: int = 0
    gpus: float = 0  # a fraction shares one GPU


@dataclass
class PlacedRole:
    """A role's placement group and one slot per actor, in rank order."""

    role: str
    group: PlacementGroup
    slots: list[Slot]
    head_groups: list[PlacementGroup] = field(default_factory=list)  # slice reservations to release with it
    share: SliceShare | None = None  # the TPU chips it runs on
    python: str | None = None  # the interpreter the role's actors run under (placement.<role>.python); None: Ray's

    def options(self, index: int, env: dict[str, str] | None = None) -> dict[str, Any]:
        """`.options(...)` for the actor in slot `index`, adding `env` to its environment."""
        slot = self.slots[index]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=slot.bundle_index)
        runtime_env: dict[str, Any] = {"env_vars": {**(env or {}), **slot.env}}
        if self.python:
            runtime_env["py_executable"] = self.python
        options: dict[str, Any] = {"scheduling_strategy": strategy, "runtime_env": runtime_env}
        if slot.tpu_chips:  # actors share a host's bundle, so they take chips, not the host's CPU
            options.update(num_cpus=0, resources={"TPU": slot.tpu_chips})
        else:
            # A GPU actor's GPU comes with its bundle; Ray makes it the one device the actor sees. Ray leaves the
            # variable unset for an actor of no GPU, which would then see (and take) every GPU of its node.
            options.update(num_cpus=1, num_gpus=slot.gpus)
            if not slot.gpus:
                runtime_env["env_vars"]["CUDA_VISIBLE_DEVICES"] = ""
        return options

    def hosts(self) -> list[str]:
        """The node address of each slot's bundle, in slot order: where Ray placed (or will place) each actor."""
        bundle_nodes = placement_group_table(self.group)["bundles_to_node_id"]
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [addresses[bundle_nodes[slot.bundle_index]] for slot in self.slots]

    def remove(self) -> None:
        for group in [self.group, *self.head_groups]:
            try:
                remove_placement_group(group)
            except Exception:  # already gone with a lost node or a shut-down cluster
                pass


def place_role(
    role: str, spec: RolePlacement, actors: int, timeout_s: float, chips_per_actor: int = 1,
    gpus_per_actor: float = 0, learner_device: str | None = None, share: SliceShare | None = None,
    sharing: PlacedRole | None = None, paired: int = 0,
) -> PlacedRole:
    """Reserve the placement for `actors` actors of `role` (each with `gpus_per_actor` GPUs, a fraction a share of
    one), waiting at most `timeout_s` for it. `sharing`: the other role's placement whose bundles this role's actors
    join: on a TPU slice when both share one host's chips (`share`, the chips this role takes,
    rlpipe/hardware/tpu_layout.py), else engines sharing the learner ranks' GPUs (actor i in rank i's bundle); `paired`:
    how many of this role's bundles (the first) also hold such an engine, each reserving a whole GPU and a CPU more
    (rlpipe/hardware/gpu_layout.py). `learner_device`: the learner's `learner.device` (the learner role only), which
    decides the process contract its ranks get."""
    if share is not None:
        placed = _place_on_slice(role, share, actors, timeout_s, chips_per_actor, learner_device, spec.python, sharing)
    elif sharing is not None:
        placed = PlacedRole(role, sharing.group, [Slot(index, gpus=gpus_per_actor) for index in range(actors)])
    else:
        bundles = cpu_bundles(spec, actors, gpus_per_actor, paired)
        group = placement_group(bundles, strategy=spec.strategy, name=f"rlpipe-{role}")
        _wait(group, role, timeout_s, f"{actors} bundle(s) of {bundles[0]} ({spec.strategy})")
        placed = PlacedRole(role, group, [Slot(index, gpus=gpus_per_actor) for index in range(actors)])
    if spec.python:
        placed.python = interpreter(f"placement.{role}.python", spec.python)
    return placed


def cpu_bundles(spec: RolePlacement, actors: int, gpus: float = 0, paired: int = 0) -> list[dict[str, float]]:
    """One bundle per actor: a CPU, its GPUs and the role's resources; with `paired`, every bundle holds a whole GPU
    (rank and engine share it) and the first `paired` a CPU for the engine too."""
    custom = {str(k): float(v) for k, v in spec.resources.items()}
    bundles = []
    for index in range(actors):
        gpu = 1.0 if paired else float(gpus)
        bundles.append({"CPU": 2.0 if index < paired else 1.0, **({"GPU": gpu} if gpu else {}), **custom})
    return bundles


class PlacementTimeout(ConfigError):
    """The cluster could not place a role in time: a configuration error at a run's start; when an auto-resumed run
    starts again, most likely a lost host not back yet (rlpipe train waits for it with another attempt)."""


def _wait(group: PlacementGroup, role: str, timeout_s: float, wanted: str) -> None:
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        available = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
        raise PlacementTimeout(
            f"placement.{role}: the cluster cannot place {wanted} within {timeout_s:g} s "
            f"(ray.placement_timeout_s); available: {available}"
        )


# ------------------------------------------------------------------ TPU slices


def slice_slots(
    share: SliceShare, bundle_nodes: dict[int, str], nodes: list[dict], chips_per_actor: int,
    learner_device: str | None = None, host_coords: dict[int, list[int] | None] | None = None,
    session_id: str | None = None,
) -> list[Slot]:
    """Every actor's slot on the chips `share` gives a role, in rank order: host by host, then chip by chip.

    Hosts are ordered as torch_tpu ranks them (by their chips' coordinates, `host_coords` per bundle) where those
    are known, else by TPU worker id where the nodes carry it, else by bundle index. `bundle_nodes` maps bundle
    index to node id (`placement_group_table`); `nodes` is `ray.nodes()`. `learner_device`: the slots are learner
    processes — one per chip on `tpu` (TorchTPU's contract), one per host on `xla` (libtpu's, all the host's chips);
    None: rollout engines of `chips_per_actor` chips each.
    """
    tslice = share.tslice
    by_id = {node["NodeID"]: node for node in nodes}
    if len(bundle_nodes) != tslice.hosts:
        raise ValueError(f"{tslice.pod_type} has {tslice.hosts} hosts but the placement has {len(bundle_nodes)} bundles")

    def worker_order(bundle: int) -> tuple[int, int]:
        worker_id = by_id[bundle_nodes[bundle]].get("Labels", {}).get(WORKER_ID_LABEL)
        return (int(worker_id) if worker_id is not None else bundle, bundle)

    bundles = sorted(bundle_nodes, key=worker_order)
    if host_coords is not None:
        order = host_rank_order([host_coords.get(bundle) for bundle in bundles], tslice.topology)
        bundles = bundles if order is None else [bundles[index] for index in order]
    addresses = [by_id[bundle_nodes[bundle]]["NodeManagerAddress"] for bundle in bundles]
    topology = None if share.shared else tslice.topology
    slots = []
    for host, bundle in enumerate(bundles):
        for first_chip in range(share.first_chip, share.first_chip + share.chips_per_host, chips_per_actor):
            if learner_device == "tpu":  # the learner takes a host's first chips: LOCAL_RANK is the chip
                env = torchtpu_process_env(addresses, share.chips_per_host, host, first_chip, topology, session_id)
            elif learner_device is not None:
                env = tpu_chip_block_env(first_chip, chips_per_actor)
            else:  # an engine: a job of its own on a few chips of one host
                env = engine_process_env(first_chip, chips_per_actor)
            slots.append(Slot(bundle, env, chips_per_actor))
    return slots


def fallback_slice_bundles(tslice: TpuSlice, head_node: dict) -> tuple[list[dict], list[dict[str, str]]]:
    """Per-host bundles for the slice whose head host is `head_node`, for Rays without `SlicePlacementGroup`:
    every bundle must land on a host carrying that slice's name label."""
    name = head_node.get("Labels", {}).get(SLICE_NAME_LABEL)
    if not name:
        raise ConfigError(
            f"TPU host {head_node.get('NodeManagerAddress')} has no {SLICE_NAME_LABEL} label; cannot find its slice"
        )
    bundles = [{"CPU": 1.0, "TPU": float(tslice.chips_per_host)} for _ in range(tslice.hosts)]
    return bundles, [{SLICE_NAME_LABEL: name} for _ in range(tslice.hosts)]


def _place_on_slice(
    role: str, share: SliceShare, actors: int, timeout_s: float, chips_per_actor: int, learner_device: str | None,
    python: str | None, sharing: PlacedRole | None,
) -> PlacedRole:
    if actors * chips_per_actor != share.chips:  # rlpipe/hardware/tpu_layout.py's slice_problems stops such a run first
        raise ConfigError(f"placement.{role}: {actors} actors of {chips_per_actor} chips on {share.chips} chips")
    tslice = share.tslice
    if sharing is not None:  # the other role reserved this one-host slice: take the rest of its chips
        group, head_groups = sharing.group, []
    else:
        group, head_groups = _reserve_slice(role, tslice, timeout_s)
    bundle_nodes = {int(k): v for k, v in placement_group_table(group)["bundles_to_node_id"].items()}
    coords = _host_coords(group, bundle_nodes, python) if learner_device == "tpu" and tslice.hosts > 1 else None
    slots = slice_slots(share, bundle_nodes, ray.nodes(), chips_per_actor, learner_device, coords, str(time.time_ns()))
    return PlacedRole(role, group, slots, head_groups, share=share)


def _reserve_slice(role: str, tslice: TpuSlice, timeout_s: float) -> tuple[PlacementGroup, list[PlacementGroup]]:
    """A placement group of one bundle per host of a whole slice, and the head reservations to release with it."""
    wanted = f"a {tslice.pod_type} slice ({tslice.topology}: {tslice.hosts} host(s) x {tslice.chips_per_host} chips)"
    head_groups: list[PlacementGroup] = []
    try:
        from ray.util.tpu import SlicePlacementGroup
    except ImportError:  # Ray before slice placement groups: reserve the head host, then the rest of its slice
        head = placement_group([{f"TPU-{tslice.pod_type}-head": 1.0}], name=f"rlpipe-{role}-head")
        _wait(head, role, timeout_s, f"the head host of {wanted}")
        head_groups.append(head)
        nodes = {node["NodeID"]: node for node in ray.nodes()}
        head_node = nodes[placement_group_table(head)["bundles_to_node_id"][0]]
        bundles, selectors = fallback_slice_bundles(tslice, head_node)
        group = placement_group(bundles, strategy="STRICT_SPREAD", name=f"rlpipe-{role}", bundle_label_selector=selectors)
    else:
        reservation = SlicePlacementGroup(
            topology=tslice.topology,
            accelerator_version=tslice.generation,
            resources_per_bundle={"CPU": 1.0, "TPU": float(tslice.chips_per_host)},
            name=f"rlpipe-{role}",
            chips_per_vm=tslice.chips_per_host,
            head_reservation_timeout_s=timeout_s,
        )
        group, head_groups = reservation.placement_group, list(reservation.head_placement_groups)
    _wait(group, role, timeout_s, wanted)
    return group, head_groups


def local_chip_coords() -> list[int] | None:
    """The physical coordinates of this host's first TPU chip, as torch_tpu's launch helper finds them (in a child
    process, so this one never holds the chips); None without a TPU."""
    from torch_tpu._internal.distributed.distributed import _query_local_device_coords

    return _query_local_device_coords()


def _host_coords(
    group: PlacementGroup, bundle_nodes: dict[int, str], python: str | None
) -> dict[int, list[int] | None]:
    """Each bundle's host's chip coordinates, asked on that host in the learner's environment before any rank
    holds its chips: torch_tpu numbers hosts (NODE_RANK) by them, and the ranks must agree."""
    ask = ray.remote(local_chip_coords)
    refs = {
        bundle: ask.options(
            num_cpus=0,
            runtime_env={"py_executable": python} if python else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
        ).remote()
        for bundle in bundle_nodes
    }
    return {bundle: ray.get(ref) for bundle, ref in refs.items()}
