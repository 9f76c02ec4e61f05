"""The backend table and the TPU per-process environment (derived here; not run on TPU hardware)."""

import pytest

from rlpipe.device import backend, tpu_process_env, tpu_slice_envs


def test_backend_table():
    assert (backend("cpu").dist_backend, backend("cpu").compile_backend) == ("gloo", "inductor")
    assert (backend("cuda").dist_backend, backend("cuda").compile_backend) == ("nccl", "inductor")
    tpu = backend("tpu")
    assert (tpu.torch_device, tpu.dist_backend, tpu.compile_backend) == ("tpu", "tpu_dist", "tpu")
    assert backend("xla").compile_backend == "openxla"
    # Only xla records ops for a program run at the step's end (static shapes, no packing).
    assert [kind for kind in ("cpu", "cuda", "tpu", "xla") if backend(kind).lazy] == ["xla"]
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        backend("gpu")


def test_single_host_v6e_8_one_process_per_chip():
    envs = tpu_slice_envs(["10.0.0.2"], "2,4,1")
    assert len(envs) == 8
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == [str(i) for i in range(8)]
    assert [e["TPU_PROCESS_PORT"] for e in envs] == [str(8476 + i) for i in range(8)]
    assert [e["CLOUD_TPU_TASK_ID"] for e in envs] == [str(i) for i in range(8)]
    first = envs[0]
    assert first["TPU_PROCESS_BOUNDS"] == "2,4,1"
    assert first["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert first["TPU_HOST_BOUNDS"] == "1,1,1"
    assert first["TPU_PROCESS_ADDRESSES"].split(",")[:2] == ["10.0.0.2:8476", "10.0.0.2:8477"]
    assert len({e["TPU_PROCESS_ADDRESSES"] for e in envs}) == 1  # every process sees the same list
    assert first["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"] == "1"


def test_multi_host_v5e_16_orders_ranks_by_host_then_chip():
    hosts = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    env = tpu_process_env(hosts, "2,2,1", worker_index=2, local_chip=3)
    assert env["CLOUD_TPU_TASK_ID"] == "11"
    assert env["TPU_HOST_BOUNDS"] == "1,1,4" and env["TPU_PROCESS_BOUNDS"] == "2,2,4"
    addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
    assert len(addresses) == 16 and addresses[11] == "10.0.0.4:8479"


def test_bad_placements_are_named():
    with pytest.raises(ValueError, match="outside the 4 chips"):
        tpu_process_env(["h"], "2,2,1", 0, 4)
    with pytest.raises(ValueError, match="three positive integers"):
        tpu_process_env(["h"], "2,2", 0, 0)
    with pytest.raises(ValueError, match="outside the 1 hosts"):
        tpu_process_env(["h"], "2,2,1", 1, 0)


def test_hosts_tile_the_slices_topology():
    hosts = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
    env = tpu_process_env(hosts, "2,2,1", worker_index=1, local_chip=0, topology="4x4")
    assert env["TPU_HOST_BOUNDS"] == "2,2,1" and env["TPU_PROCESS_BOUNDS"] == "4,4,1"
    v5p = tpu_process_env(hosts * 2, "2,2,1", worker_index=7, local_chip=3, topology="2x4x4")
    assert v5p["TPU_HOST_BOUNDS"] == "1,2,4" and v5p["CLOUD_TPU_TASK_ID"] == "31"
    with pytest.raises(ValueError, match="4 hosts of 2,2,1 chips do not tile topology 2x4"):
        tpu_process_env(hosts, "2,2,1", 0, 0, topology="2x4")
