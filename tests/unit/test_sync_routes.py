"""`sync.transport: auto`: shared memory within a host, the object store across hosts, decided per learner-rank/
engine pair; a forced `shm` across hosts refused before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

from rlpipe.config import ConfigError
from rlpipe.weightsync import Staging, make_transport, plan_routes, plan_sync, stream_parts
from tests.unit.test_weightsync import KEY, _full_tensors, _hf_shapes, _layout, _local_shards


def test_auto_picks_shared_memory_within_a_host_and_the_object_store_across():
    routes = plan_routes("auto", ["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.3", "10.0.0.2"])
    assert routes.pairs == (("shm", "ray", "ray"), ("ray", "ray", "shm"))
    assert routes.to_engines(1) == ["ray", "ray", "shm"] and routes.from_ranks(2) == ["ray", "shm"]
    assert not routes.whole_buckets  # rank 1 cannot write into segments on rank 0's host
    assert routes.counts() == {"sync/pairs_shm": 2.0, "sync/pairs_ray": 4.0}
    assert routes.describe()["learner 1 -> engine 2"] == "shm"
    one_host = plan_routes("auto", ["127.0.0.1"] * 2, ["127.0.0.1"] * 2)
    assert one_host.whole_buckets and one_host.counts() == {"sync/pairs_shm": 4.0, "sync/pairs_ray": 0.0}
    apart = plan_routes("auto", ["10.0.0.1"], ["10.0.0.2"])
    assert apart.pairs == (("ray",),) and not apart.whole_buckets
    # The start-up line's words for them.
    assert one_host.in_words() == "auto: shared memory" and apart.in_words() == "auto: object store"
    assert routes.in_words() == "auto: shared memory for 2 pairs, object store for 4 pairs"
    assert plan_routes("gloo", ["a"], ["b"]).in_words() == "gloo"


def test_routes_know_whether_a_learner_rank_shares_a_host_with_an_engine_whatever_the_transport():
    for transport in ("auto", "ray", "gloo"):
        assert plan_routes(transport, ["a", "b"], ["c", "b"]).shared_host
        assert not plan_routes(transport, ["a", "a"], ["b", "c"]).shared_host
    assert plan_routes("shm", ["a"], ["a"]).shared_host


def test_a_forced_transport_is_used_for_every_pair_and_shm_across_hosts_is_refused_naming_both():
    assert plan_routes("ray", ["a"], ["a", "b"]).pairs == (("ray", "ray"),)
    assert plan_routes("gloo", ["a"], ["b"]).pairs == (("gloo",),)
    assert plan_routes("shm", ["a", "a"], ["a"]).whole_buckets
    with pytest.raises(ConfigError) as refused:
        plan_routes("shm", ["10.0.0.1", "10.0.0.1"], ["10.0.0.1", "10.0.0.2"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("sync.transport: shm")
    assert "learner rank 0 is on 10.0.0.1 and rollout engine 1 on 10.0.0.2" in message


@pytest.fixture
def local_ray():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.parametrize("hosts", [
    (["a", "b"], ["a", "b"]),  # each rank shares a host with one engine: a segment of its own, and the object store
    (["a", "a"], ["a", "b"]),  # both ranks with engine 0: still per-rank parts, since engine 1 needs them apart
    (["a", "a"], ["a", "a"]),  # one host: every rank writes into rank 0's segments, whole buckets, as `shm`
])
@pytest.mark.heavy
def test_each_engine_receives_every_bucket_by_its_own_route(local_ray, hosts):
    learner_hosts, engine_hosts = hosts
    ranks = len(learner_hosts)
    routes = plan_routes("auto", learner_hosts, engine_hosts)
    shapes = _hf_shapes(kv_heads=2)
    full = _full_tensors(shapes)
    plan = plan_sync(shapes, ranks, _layout(1, 2), 30_000)
    senders = [make_transport("auto") for _ in range(ranks)]
    receivers = [make_transport("auto") for _ in engine_hosts]
    try:
        for rank, sender in enumerate(senders):
            sender.set_routes(routes.to_engines(rank), routes.whole_buckets)
        if routes.whole_buckets:
            for sender in senders:
                sender.share_buffers(senders[0].buffer_prefix())
        for engine, receiver in enumerate(receivers):
            receiver.set_routes(routes.from_ranks(engine), routes.whole_buckets)
        parts = [p for rank, sender in enumerate(senders)
                 for p in stream_parts(plan, rank, _local_shards(full, rank, ranks), sender, 1, KEY)]
        for engine, receiver in enumerate(receivers):
            staging = Staging(plan, 1, KEY, whole_buckets=receiver.whole_buckets)
            for part in parts:
                # Each handle carries only what its sender's routes need.
                assert set(part.handle) == set(routes.to_engines(part.rank))
                with receiver.receive(part.handle, part.rank, part.nbytes) as buffer:
                    staging.add(part.bucket, part.rank, buffer, part.checksum)
            received = staging.complete()
            for name, tensor in full.items():
                np.testing.assert_array_equal(received[name].numpy(), tensor.numpy(), err_msg=f"engine {engine}: {name}")
            del received, staging
    finally:
        for transport in [*receivers, *reversed(senders)]:
            transport.close()


@pytest.mark.heavy
def test_a_route_change_starts_the_sender_on_fresh_buffers(local_ray):
    sender = make_transport("auto")
    sender.set_routes(["shm"], whole_buckets=True)
    first = sender.send(sender.allocate(64, bucket=0, version=1))[0]
    sender.set_routes(["shm"], whole_buckets=True)  # unchanged: the same segments
    assert sender.send(sender.allocate(64, bucket=0, version=3))[0] == first
    sender.set_routes(["shm", "ray"], whole_buckets=False)  # an engine moved to another host
    moved = sender.send(sender.allocate(64, bucket=0, version=3))[0]
    assert moved["shm"] != first["shm"] and "ray" in moved
    sender.close()
