"""Placement arithmetic against described clusters: which bundle and chips each actor gets, and its TPU
environment (no TPU here; Ray's own slice helpers serve as the reference for the slice shapes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ray._private.accelerators.tpu import get_chips_per_host, get_num_chips_from_topology
from ray.util.placement_group import PlacementGroup

from rlpipe.actors.placement import (
    SLICE_NAME_LABEL,
    WORKER_ID_LABEL,
    PlacedRole,
    Slot,
    cpu_bundles,
    fallback_slice_bundles,
    slice_slots,
)
from rlpipe.actors.cluster import KEEP_FREED_MEMORY, compute_env
from rlpipe.config import ConfigError, RolePlacement, load_config
from rlpipe.hardware.device import tpu_slice
from rlpipe.hardware.tpu_env import (
    COMPILE_CACHE, COMPILE_CACHE_DEFAULT, GIVEN, engine_process_env, host_rank_order, keep_only_given_tpu_env,
    torchtpu_process_env,
)
from rlpipe.hardware.tpu_layout import SliceShare, slice_problems, slice_shares


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


def _whole(pod_type: str, topology: str | None = None) -> SliceShare:
    tslice = tpu_slice(pod_type, topology)
    return SliceShare(tslice, 0, tslice.chips_per_host)


def test_torchtpu_learner_ranks_follow_tpu_worker_ids_one_process_per_chip():
    bundle_nodes, nodes = _described_slice(4)  # worker 0 sits in the last bundle
    slots = slice_slots(_whole("v6e-16"), bundle_nodes, nodes, chips_per_actor=1, learner_device="tpu", session_id="7")
    assert len(slots) == 16 and [slot.bundle_index for slot in slots[::4]] == [3, 2, 1, 0]
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
    assert (first["MASTER_ADDR"], first["MASTER_PORT"], first["TORCH_TPU_DEVICES_PER_HOST"]) == ("10.0.0.10", "29500", "4")
    assert {slot.env["TORCH_TPU_XPROF_SESSION_ID"] for slot in slots} == {"7"}
    assert all(slot.tpu_chips == 1 and slot.env["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"] == "1" for slot in slots)
    assert first["TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS"] == "false"
    assert set(first[GIVEN].split(",")) == set(first)  # every key rlpipe set, so nothing else survives


def test_learner_hosts_are_ranked_by_their_chips_coordinates_when_known():
    """torch_tpu numbers hosts z-major then y then x by their chips' coordinates; worker ids may disagree."""
    bundle_nodes, nodes = _described_slice(4, shuffled=False)  # bundle b on worker b
    coords = {0: [2, 2, 0, 0], 1: [0, 0, 0, 0], 2: [2, 0, 0, 0], 3: [0, 2, 0, 0]}  # 4x4 of 2x2-chip hosts
    slots = slice_slots(_whole("v6e-16"), bundle_nodes, nodes, 1, learner_device="tpu", host_coords=coords)
    assert [slot.bundle_index for slot in slots[::4]] == [1, 2, 3, 0]
    assert slots[0].env["TPU_WORKER_HOSTNAMES"] == "10.0.0.11,10.0.0.12,10.0.0.13,10.0.0.10"
    unknown = slice_slots(_whole("v6e-16"), bundle_nodes, nodes, 1, learner_device="tpu",
                          host_coords={**coords, 2: None})
    assert [slot.bundle_index for slot in unknown[::4]] == [0, 1, 2, 3]  # by worker id
    with pytest.raises(ValueError, match="outside topology"):
        host_rank_order([[4, 0, 0]], "4x4")


def test_without_worker_labels_bundle_order_sets_the_ranks():
    bundle_nodes, nodes = _described_slice(2)  # v5p-16, 2x2x2: two hosts of 4 chips
    for node in nodes:
        del node["Labels"][WORKER_ID_LABEL]
    slots = slice_slots(_whole("v5p-16"), bundle_nodes, nodes, chips_per_actor=1, learner_device="tpu")
    assert [slot.bundle_index for slot in slots] == [0] * 4 + [1] * 4
    assert slots[0].env["MASTER_ADDR"] == "10.0.0.11"  # bundle 0 is on worker 1's host


def test_an_xla_learner_is_one_process_for_all_its_chips():
    slots = slice_slots(_whole("v5litepod-8"), {0: "node-0"}, _described_slice(1)[1], chips_per_actor=8,
                        learner_device="xla")
    assert len(slots) == 1 and slots[0].tpu_chips == 8
    env = slots[0].env
    assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3,4,5,6,7" and env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1"
    assert env["TPU_PROCESS_BOUNDS"] == "1,1,1"


def test_engines_name_their_first_chip_to_vllm_torchtpus_binding():
    slots = slice_slots(_whole("v6e-8"), {0: "node-0"}, _described_slice(1)[1], chips_per_actor=2)
    assert [slot.env["TPU_LOCAL_RANK_OFFSET"] for slot in slots] == ["0", "2", "4", "6"]
    assert [slot.env["DEBUG_TPU_LOCAL_RANK_OFFSET"] for slot in slots] == ["0", "2", "4", "6"]
    assert all(slot.tpu_chips == 2 and "TPU_VISIBLE_CHIPS" not in slot.env for slot in slots)


def test_one_chip_engines_are_pinned_as_vllm_torchtpu_pins_its_one_chip_replicas():
    """Both chip variables agree (TorchTPU honours the pin only then) and libtpu may load in several processes of a
    host; no offset, which vllm-torchtpu reads as a debugging aid (tests/tpu_contract/test_chip_binding.py runs it)."""
    slots = slice_slots(_whole("v6e-8"), {0: "node-0"}, _described_slice(1)[1], chips_per_actor=1)
    assert [slot.env["TPU_VISIBLE_CHIPS"] for slot in slots] == [str(chip) for chip in range(8)]
    assert all(slot.env["TPU_VISIBLE_DEVICES"] == slot.env["TPU_VISIBLE_CHIPS"] for slot in slots)
    assert all(slot.env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1" and slot.tpu_chips == 1 for slot in slots)
    assert not any("TPU_LOCAL_RANK_OFFSET" in slot.env or "DEBUG_TPU_LOCAL_RANK_OFFSET" in slot.env for slot in slots)


def test_one_tpu_vm_splits_its_chips_between_learner_and_engines():
    cfg = load_config(None, ["placement.learner.tpu=v6e-8", "placement.rollout.tpu=v6e-8", "placement.learner.chips=4",
                             "placement.rollout.chips=4", "learner.ranks=4", "learner.device=tpu",
                             "rollout.num_engines=1", "rollout.tensor_parallel=4", "rollout.dtype=bfloat16"])
    shares = slice_shares(cfg.placement)
    assert (shares["learner"].first_chip, shares["rollout"].first_chip) == (0, 4)
    assert slice_problems(cfg) == []
    nodes = _described_slice(1)[1]
    learners = slice_slots(shares["learner"], {0: "node-0"}, nodes, 1, learner_device="tpu")
    assert [slot.env["LOCAL_RANK"] for slot in learners] == ["0", "1", "2", "3"]
    assert learners[0].env["TORCH_TPU_TOPOLOGY"] == "2,2,1" and learners[0].env["WORLD_SIZE"] == "4"
    engines = slice_slots(shares["rollout"], {0: "node-0"}, nodes, 4)
    assert [slot.env["TPU_LOCAL_RANK_OFFSET"] for slot in engines] == ["4"] and engines[0].tpu_chips == 4


@pytest.mark.parametrize("overrides, message", [
    (["learner.ranks=8"], r"learner.ranks = 8 but placement.learner takes 16 chips of v6e-16 \(4x4\)"),
    (["rollout.num_engines=2"], r"rollout.num_engines x rollout.tensor_parallel = 2 but placement.rollout takes 8"),
    (["rollout.num_engines=1", "rollout.tensor_parallel=8", "placement.rollout.tpu=v6e-16",
      "placement.rollout.topology=4x4", "rollout.num_engines=2"], "engines do not span hosts"),
    (["learner.device=cpu"], "learner.device is 'cpu' but placement.learner.tpu is v6e-16"),
    (["learner.device=xla"], "an xla learner is one process"),
])
def test_impossible_role_and_slice_combinations_are_one_line_each(overrides, message):
    base = ["placement.learner.tpu=v6e-16", "placement.rollout.tpu=v6e-8", "learner.ranks=16", "learner.device=tpu",
            "rollout.num_engines=8", "rollout.dtype=bfloat16"]
    problems = slice_problems(load_config(None, base + overrides))
    assert len(problems) == 1 and re.search(message, problems[0]), problems


@pytest.mark.parametrize("overrides, message", [
    (["placement.learner.chips=4"], "set both"),
    (["placement.learner.chips=4", "placement.rollout.chips=4", "placement.rollout.tpu=v5litepod-8"],
     "name the same slice"),
    (["placement.learner.chips=6", "placement.rollout.chips=4"], "more than the 8 of v6e-8"),
    (["placement.learner.tpu=v6e-16", "placement.rollout.tpu=v6e-16", "placement.learner.chips=2",
      "placement.rollout.chips=2"], "only a one-host slice"),
])
def test_sharing_a_slice_is_checked(overrides, message):
    cfg = load_config(None, ["placement.learner.tpu=v6e-8", "placement.rollout.tpu=v6e-8", "rollout.dtype=bfloat16",
                             *overrides])
    with pytest.raises(ConfigError, match=message):
        slice_shares(cfg.placement)


def test_a_tpu_actor_keeps_only_the_launch_variables_rlpipe_gave_it():
    given = engine_process_env(4, 4)
    inherited = {"TORCH_TPU_TOPOLOGY": "4,4,1", "TPU_WORKER_HOSTNAMES": "a,b", "MASTER_PORT": "1234",
                 "TPU_VISIBLE_CHIPS": "0,1,2,3", "TPU_ACCELERATOR_TYPE": "v6e-16", "HOME": "/root"}
    environ = {**inherited, **given}
    dropped = keep_only_given_tpu_env(environ)
    assert sorted(dropped) == ["MASTER_PORT", "TORCH_TPU_TOPOLOGY", "TPU_VISIBLE_CHIPS", "TPU_WORKER_HOSTNAMES"]
    assert environ == {**given, "TPU_ACCELERATOR_TYPE": "v6e-16", "HOME": "/root"}
    untouched = dict(inherited)
    assert keep_only_given_tpu_env(untouched) == [] and untouched == inherited  # not a TPU actor
    one_chip = engine_process_env(3, 1)
    environ = {**inherited, **one_chip}
    keep_only_given_tpu_env(environ)
    assert environ == {**one_chip, "TPU_ACCELERATOR_TYPE": "v6e-16", "HOME": "/root"}  # its own chip, not the host's


def test_a_tpu_actor_keeps_the_tuning_and_cache_variables_it_inherits():
    """Only layout is dropped: a compilation cache, libtpu's and XLA's flags, vllm-torchtpu's and TorchTPU's own
    switches and libtpu's permission to load in several processes stay as the host set them."""
    kept = {"TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "/cache/tpu", "TORCH_TPU_TIER2_COMPILATION_CACHE": "t2",
            "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true", "XLA_FLAGS": "--xla_dump_to=/d",
            "TPU_MOE_SEQUENCE_PARALLEL": "1", "TPU_PREMAPPED_BUFFER_SIZE": "4294967296",
            "TORCH_TPU_INTERNAL_XLA_OPTIONS": "x", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_NAME": "slice-a"}
    for given in (engine_process_env(0, 2), torchtpu_process_env(["h"], 4, 0, 1)):
        environ = {**kept, **given, "TPU_WORKER_ID": "2", "MEGASCALE_SLICE_ID": "1"}
        assert sorted(keep_only_given_tpu_env(environ)) == ["MEGASCALE_SLICE_ID", "TPU_WORKER_ID"]
        assert environ == {**kept, **given}


def test_tpu_actors_compile_into_a_cache_of_the_run_unless_the_host_names_one(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", raising=False)
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=r", "placement.rollout.tpu=v6e-8",
                             "rollout.dtype=bfloat16", "rollout.num_engines=8"])
    env = compute_env(cfg)
    folder = str(tmp_path / "r" / "tpu_compile_cache")
    assert env[COMPILE_CACHE_DEFAULT] == folder
    environ = {**env, **engine_process_env(0, 1)}
    keep_only_given_tpu_env(environ)
    assert environ[COMPILE_CACHE] == folder and Path(folder).is_dir()  # survives the actor: a restart reads it
    assert environ["TORCH_TPU_TIER2_COMPILATION_CACHE"] == "tpu_tier2_cache"  # the tier the disk one needs
    host = {**env, **engine_process_env(0, 1), COMPILE_CACHE: "/host/cache"}
    keep_only_given_tpu_env(host)
    assert host[COMPILE_CACHE] == "/host/cache"  # the host's own setting wins
    monkeypatch.setenv(COMPILE_CACHE, "/user/cache")
    assert compute_env(cfg)[COMPILE_CACHE_DEFAULT] == "/user/cache"  # so does the driver's
    assert COMPILE_CACHE_DEFAULT not in compute_env(load_config(None, []))  # no TPU role: nothing to cache


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
    # An actor of no GPU is shown none: Ray leaves CUDA_VISIBLE_DEVICES unset at zero GPUs.
    assert cpu["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}}
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
