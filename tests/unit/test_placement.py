"""Placement arithmetic against described clusters: which bundle and chips each actor gets, and its TPU
environment (no TPU here; Ray's own slice helpers serve as the reference for the slice shapes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ray._private.accelerators.tpu import get_chips_per_host, get_num_chips_from_topology
from ray.util.placement_group import PlacementGroup

from rlpipe.actors.placement import (
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
    PlacedRole,
    Slot,
    check_slice_counts,
    cpu_bundles,
    fallback_slice_bundles,
    slice_slots,
)
from rlpipe.actors.cluster import KEEP_FREED_MEMORY, compute_env
from rlpipe.config import ConfigError, RolePlacement
from rlpipe.device import tpu_slice


@pytest.mark.parametrize(
    "pod_type, topology",
    [("v6e-8", None), ("v6e-16", None), ("v6e-64", None), ("v5litepod-8", None), ("v5litepod-4", None),
     ("v5p-8", None), ("v5p-16", None), ("v5p-64", None), ("v4-8", None), ("v4-32", None), ("v6e-4", "2x2")],
)
def test_slice_shapes_agree_with_rays_tpu_helpers(pod_type, topology):
    tslice = tpu_slice(pod_type, topology)
    assert tslice.chips == get_num_chips_from_topology(tslice.topology)
    assert tslice.chips_per_host == get_chips_per_host(tslice.topology, tslice.generation)
    assert tslice.hosts * tslice.chips_per_host == tslice.chips


def test_bad_slices_are_named():
    with pytest.raises(ValueError, match="not one of"):
        tpu_slice("v5p-7")
    with pytest.raises(ValueError, match="does not have the 8 chips of v6e-8"):
        tpu_slice("v6e-8", "4x4")


def _described_slice(hosts: int, shuffled: bool = True) -> tuple[dict[int, str], list[dict]]:
    """A slice whose bundles landed on hosts in a different order from their TPU worker ids."""
    worker_of_bundle = list(reversed(range(hosts))) if shuffled else list(range(hosts))
    nodes = [
        {
            "NodeID": f"node-{worker}",
            "NodeManagerAddress": f"10.0.0.{10 + worker}",
            "Labels": {SLICE_NAME_LABEL: "slice-a", WORKER_ID_LABEL: str(worker)},
            "Resources": {"TPU": 4.0, "CPU": 180.0},
        }
        for worker in range(hosts)
    ]
    return {bundle: f"node-{worker}" for bundle, worker in enumerate(worker_of_bundle)}, nodes


def test_learner_ranks_follow_tpu_worker_ids_one_process_per_chip():
    tslice = tpu_slice("v6e-16")  # 4x4: four hosts of 2x2 chips
    bundle_nodes, nodes = _described_slice(4)
    slots = slice_slots(tslice, bundle_nodes, nodes, chips_per_actor=1, learner_device="xla")  # libtpu's contract
    assert len(slots) == 16
    # Rank r drives chip r % 4 of TPU worker r // 4; worker 0 sits in the last bundle here.
    assert [slot.bundle_index for slot in slots[::4]] == [3, 2, 1, 0]
    assert [slot.env["TPU_VISIBLE_CHIPS"] for slot in slots[:5]] == ["0", "1", "2", "3", "0"]
    assert [slot.env["CLOUD_TPU_TASK_ID"] for slot in slots] == [str(rank) for rank in range(16)]
    first = slots[0].env
    assert first["TPU_PROCESS_ADDRESSES"].split(",")[:5] == [
        "10.0.0.10:8476", "10.0.0.10:8477", "10.0.0.10:8478", "10.0.0.10:8479", "10.0.0.11:8476"
    ]
    assert first["TPU_HOST_BOUNDS"] == "2,2,1" and first["TPU_PROCESS_BOUNDS"] == "4,4,1"
    assert first["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"
    assert all(slot.tpu_chips == 1 and slot.env["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"] == "1" for slot in slots)


def test_without_worker_labels_bundle_order_sets_the_ranks():
    tslice = tpu_slice("v5p-16")  # 2x2x2: two hosts of 4 chips
    bundle_nodes, nodes = _described_slice(2)
    for node in nodes:
        del node["Labels"][WORKER_ID_LABEL]
    slots = slice_slots(tslice, bundle_nodes, nodes, chips_per_actor=1, learner_device="xla")
    assert [slot.bundle_index for slot in slots] == [0] * 4 + [1] * 4
    assert slots[0].env["TPU_PROCESS_ADDRESSES"].startswith("10.0.0.11:8476")  # bundle 0 is on worker 1's host


def test_torchtpu_learner_ranks_get_torchtpus_own_process_contract():
    tslice = tpu_slice("v6e-16")  # 4x4: four hosts of 2x2 chips
    bundle_nodes, nodes = _described_slice(4)
    slots = slice_slots(tslice, bundle_nodes, nodes, chips_per_actor=1, learner_device="tpu")
    assert [slot.env["RANK"] for slot in slots] == [str(rank) for rank in range(16)]
    assert [slot.env["LOCAL_RANK"] for slot in slots[:5]] == ["0", "1", "2", "3", "0"]  # the chip torch_tpu opens
    assert [slot.env["NODE_RANK"] for slot in slots[::4]] == ["0", "1", "2", "3"]
    addresses = {slot.env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for slot in slots}
    assert len(addresses) == 1  # the same list on every rank
    assert addresses.pop().split(",")[:5] == [
        "10.0.0.10:8070", "10.0.0.10:8071", "10.0.0.10:8072", "10.0.0.10:8073", "10.0.0.11:8070"
    ]
    first = slots[0].env
    assert (first["TORCH_TPU_TOPOLOGY"], first["WORLD_SIZE"], first["NNODES"]) == ("4,4,1", "16", "4")
    assert first["MASTER_ADDR"] == "10.0.0.10" and "TPU_PROCESS_ADDRESSES" not in first


def test_one_chip_engines_are_jobs_of_their_own_not_ranks_of_the_slice():
    slots = slice_slots(tpu_slice("v6e-8"), {0: "node-0"}, _described_slice(1)[1], chips_per_actor=1)
    assert [slot.env["TPU_VISIBLE_CHIPS"] for slot in slots] == [str(chip) for chip in range(8)]
    assert all("TPU_PROCESS_ADDRESSES" not in slot.env and slot.env["TPU_PROCESS_BOUNDS"] == "1,1,1" for slot in slots)


def test_rollout_engines_take_tensor_parallel_chips_of_one_host():
    tslice = tpu_slice("v6e-8")  # one host of 8 chips
    slots = slice_slots(tslice, {0: "node-0"}, _described_slice(1)[1], chips_per_actor=4)
    assert [slot.env["TPU_VISIBLE_CHIPS"] for slot in slots] == ["0,1,2,3", "4,5,6,7"]
    assert {slot.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for slot in slots} == {"2,2,1"}
    assert [slot.env["TPU_PROCESS_PORT"] for slot in slots] == ["8476", "8480"]
    assert all(slot.tpu_chips == 4 and slot.bundle_index == 0 for slot in slots)


def test_actor_counts_must_fill_the_slice():
    check_slice_counts("learner", tpu_slice("v6e-16"), 16, 1)
    with pytest.raises(ConfigError, match=r"learner.ranks: 8 chips, but placement.learner.tpu v6e-16 \(4x4\) has 16"):
        check_slice_counts("learner", tpu_slice("v6e-16"), 8, 1)
    with pytest.raises(ConfigError, match="rollout.num_engines x rollout.tensor_parallel: 4 chips"):
        check_slice_counts("rollout", tpu_slice("v6e-8"), 2, 2)
    with pytest.raises(ConfigError, match="engines do not span hosts"):
        check_slice_counts("rollout", tpu_slice("v6e-16"), 2, 8)


def test_fallback_bundles_pin_every_host_to_the_head_hosts_slice():
    tslice = tpu_slice("v6e-16")
    head = {"NodeManagerAddress": "10.0.0.10", "Labels": {SLICE_NAME_LABEL: "slice-b", WORKER_ID_LABEL: "0"}}
    bundles, selectors = fallback_slice_bundles(tslice, head)
    assert bundles == [{"CPU": 1.0, "TPU": 4.0}] * 4 and selectors == [{SLICE_NAME_LABEL: "slice-b"}] * 4
    with pytest.raises(ConfigError, match="has no ray.io/tpu-slice-name label"):
        fallback_slice_bundles(tslice, {"NodeManagerAddress": "10.0.0.9", "Labels": {}})


def test_cpu_bundles_and_actor_options():
    spec = RolePlacement(resources={"learner_host": 1}, strategy="SPREAD")
    assert cpu_bundles(spec, 2) == [{"CPU": 1.0, "learner_host": 1.0}] * 2
    assert cpu_bundles(spec, 1, gpus=1) == [{"CPU": 1.0, "GPU": 1.0, "learner_host": 1.0}]  # learner.device: cuda
    group = PlacedRole("learner", PlacementGroup.empty(), [Slot(0), Slot(1, {"TPU_VISIBLE_CHIPS": "3"}, tpu_chips=1)])
    cpu = group.options(0, {"OMP_NUM_THREADS": "2"})
    assert cpu["num_cpus"] == 1 and cpu["scheduling_strategy"].placement_group_bundle_index == 0
    assert cpu["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "2"}}
    tpu = group.options(1, {"OMP_NUM_THREADS": "2"})
    assert tpu["num_cpus"] == 0 and tpu["resources"] == {"TPU": 1}
    assert tpu["runtime_env"]["env_vars"] == {"OMP_NUM_THREADS": "2", "TPU_VISIBLE_CHIPS": "3"}
    assert tpu["scheduling_strategy"].placement_group_bundle_index == 1


# Resident memory after 256 MiB are written and freed, in MiB: one block, or (on_thread) 16 blocks of 16 MiB
# allocated and freed on a thread other than the main one.
_RESIDENT_AFTER_FREE = """
import ctypes, os, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def churn(count, size):
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(ctypes.c_void_p(block))
if sys.argv[1] == "thread":
    worker = threading.Thread(target=churn, args=(16, 16 << 20))
    worker.start()
    worker.join()
else:
    churn(1, 256 << 20)
print(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20)
"""


def _resident_after_free(tunables: str | None, on_thread: bool = False) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    where = "thread" if on_thread else "main"
    return int(subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_FREE, where], env=env, capture_output=True,
                              text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_compute_actors_keep_freed_memory(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert compute_env()["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY
    # glibc gives the block back to the kernel by default; with the setting it stays for the next allocation.
    assert _resident_after_free(None) < 128 <= _resident_after_free(KEEP_FREED_MEMORY)
    # Also when another thread frees it (an engine writes weights on its sync thread): without one arena for all
    # threads, glibc unmaps a thread's emptied heaps whatever the thresholds.
    assert _resident_after_free(KEEP_FREED_MEMORY.rpartition(":")[0], on_thread=True) < 128
    assert _resident_after_free(KEEP_FREED_MEMORY, on_thread=True) >= 128
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert compute_env()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"  # the user's own is kept


class _Engine:
    """An engine handle whose calls fail as a lost host's do: unavailable `unavailable` times, then dead."""

    def __init__(self, unavailable: int):
        import ray

        self.answers = [ray.exceptions.ActorUnavailableError("RPC error: Socket closed", None)] * unavailable
        self.answers.append(ray.exceptions.ActorDiedError())
        self.policy_version = self

    def remote(self):
        return self.answers.pop(0)


class _Group:
    def __init__(self, placed: bool):
        self.placed, self.waited = placed, None

    def wait(self, timeout_seconds):
        self.waited = timeout_seconds
        return self.placed


@pytest.mark.parametrize("placed", [True, False])
def test_a_lost_hosts_engine_is_replaced_once_it_is_declared_dead_and_there_is_room(monkeypatch, placed):
    """EnginePool._wait_for_room waits while the engine is only unavailable (its host not yet declared dead), then
    for the rollout placement group to be placed again; without room it stops the run in one line."""
    import ray

    from rlpipe.actors.calls import WorkerLost
    from rlpipe.actors.engine_pool import EnginePool
    from rlpipe.config import load_config

    def get(answer, timeout=None):
        raise answer

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr("rlpipe.actors.engine_pool.time.sleep", lambda seconds: None)
    cfg = load_config(None, ["placement.rollout.resources={rollout_slot: 1}", "ray.placement_timeout_s=30"])
    pool = EnginePool(cfg, PlacedRole("rollout", _Group(placed), [Slot(0)]), "model", None, note=print)
    engine = _Engine(unavailable=3)
    if placed:
        pool._wait_for_room(0, engine)
    else:
        with pytest.raises(WorkerLost) as lost:
            pool._wait_for_room(0, engine)
        assert str(lost.value) == (
            "rollout engine 0 lost its host and no live node has room for it (placement.rollout.resources "
            "{'rollout_slot': 1}) within 30 s (ray.placement_timeout_s)"
        )
    assert engine.answers == []  # asked until it was declared dead
    assert 0 < pool.placement.group.waited <= 30
