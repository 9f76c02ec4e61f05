"""An engine's end of the weight sync without an engine: the receiver writes a version only whole and checked,
inside the engine's pause, and writes the previous one back when the probe disagrees."""

from __future__ import annotations

import contextlib
import inspect
import time

import pytest
import torch

from rlpipe.weightsync import TRANSPORTS, SyncError, WeightReceiver, make_transport, plan_sync, stream_parts
from tests.unit.test_weightsync import KEY, _full_tensors, _hf_shapes, _layout, _local_shards

PROBE = [3, 1, 4, 1, 5]


class FakeEngine:
    """Records what the receiver writes and answers the probe with a number derived from the weights it holds, so
    a probe disagrees exactly when the weights differ from those the test expects."""

    def __init__(self, initial: dict[str, torch.Tensor]):
        self.initial = initial
        self.held = initial
        self.writes: list[dict[str, torch.Tensor]] = []
        self.paused = False
        self.written_while_paused: list[bool] = []

    def write(self, weights):
        self.written_while_paused.append(self.paused)
        self.held = {name: tensor.clone() for name, tensor in weights.items()}
        self.writes.append(self.held)

    def probe(self, tokens):
        return [0.0] + [answer(self.held)] * (len(tokens) - 1)

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


def answer(weights: dict[str, torch.Tensor]) -> float:
    return float(sum(tensor.double().sum() for tensor in weights.values()))


def expected_for(weights):
    return [0.0] + [answer(weights)] * (len(PROBE) - 1)


@pytest.fixture
def channel():
    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, 2, _layout(1, 2), 30_000)
    sender_transports = [make_transport("shm") for _ in range(2)]
    for transport in sender_transports:
        transport.share_buffers(sender_transports[0].buffer_prefix())
    engine = FakeEngine(_full_tensors(shapes, seed=100))

    def receiver(keep_previous=True):
        return WeightReceiver(make_transport("shm"), write=engine.write, probe=engine.probe,
                              initial_weights=lambda: engine.initial, paused=engine.pause, tolerance=1e-9,
                              exact=True, keep_previous=keep_previous)

    def send(receiving: WeightReceiver, version: int, weights):
        receiving.begin(plan, version, KEY)
        for rank, transport in enumerate(sender_transports):
            for part in stream_parts(plan, rank, _local_shards(weights, rank, 2), transport, version, KEY):
                receiving.receive(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
                part.deliver()
        for transport in sender_transports:
            transport.release()

    yield shapes, engine, receiver, send
    for transport in reversed(sender_transports):
        transport.close()


def test_a_version_is_written_whole_inside_the_pause_once_every_part_arrived(channel):
    shapes, engine, receiver, send = channel
    receiving = receiver()
    first = _full_tensors(shapes, seed=1)
    send(receiving, 1, first)
    assert engine.writes == []  # received and checked, nothing written yet
    result = receiving.commit(1, PROBE, expected_for(first))
    assert receiving.policy_version == 1 and result.probe_max_abs == 0.0
    assert engine.written_while_paused == [True]
    for name, tensor in first.items():
        assert torch.equal(engine.held[name], tensor), name
    receiving.close()


def test_the_start_up_check_leaves_the_first_trained_versions_memory_ready(channel):
    """After the rehearsal (the channel's start-up check, carrying the weights the engine serves) the receiver holds
    memory for the next version, laid out for it and written once, and the first version of training is staged in
    it: that version does not fault in a fresh copy of the weights, a page fault per 4 KiB, inside its step."""
    shapes, engine, receiver, send = channel
    receiving = receiver()
    send(receiving, 1, engine.initial)
    receiving.commit(1, PROBE, expected_for(engine.initial), rehearsal=True)
    assert receiving.policy_version == 0
    spare = receiving._spare_owned
    assert {name: tuple(t.shape) for name, t in spare.items()} == {name: tuple(s) for name, s in shapes.items()}
    assert all(not t.any() for t in spare.values())
    ready = {name: t.data_ptr() for name, t in spare.items()}
    first = _full_tensors(shapes, seed=1)
    send(receiving, 1, first)
    receiving.commit(1, PROBE, expected_for(first))
    assert {name: t.data_ptr() for name, t in receiving._current_owned.items()} == ready
    for name, tensor in first.items():
        assert torch.equal(engine.held[name], tensor), name
    receiving.close()


def test_the_write_and_the_probe_are_timed_apart(channel, monkeypatch):
    """`write_s` is the write alone and `probe_s` the engine's answer to the probe: the two are reported apart."""
    shapes, engine, receiver, send = channel
    write, probe = engine.write, engine.probe
    monkeypatch.setattr(engine, "write", lambda weights: (time.sleep(0.02), write(weights)))
    monkeypatch.setattr(engine, "probe", lambda tokens: (time.sleep(0.5), probe(tokens))[1])
    receiving = receiver()
    first = _full_tensors(shapes, seed=1)
    send(receiving, 1, first)
    result = receiving.commit(1, PROBE, expected_for(first))
    assert 0.02 <= result.write_s < 0.5 <= result.probe_s
    receiving.close()


def test_a_probe_that_disagrees_writes_the_previous_version_back(channel):
    shapes, engine, receiver, send = channel
    receiving = receiver()
    first, second = _full_tensors(shapes, seed=1), _full_tensors(shapes, seed=2)
    send(receiving, 1, first)
    receiving.commit(1, PROBE, expected_for(first))
    send(receiving, 2, second)
    with pytest.raises(SyncError, match=r"v2: .*differ from the learner's .* rolled back to version 1"):
        receiving.commit(2, PROBE, expected_for(first))  # the learner's answer is not that of what arrived
    assert receiving.policy_version == 1 and len(engine.writes) == 3
    for name, tensor in first.items():
        assert torch.equal(engine.held[name], tensor), name
    receiving.close()


def test_the_first_version_rolls_back_to_what_the_engine_loaded(channel):
    shapes, engine, receiver, send = channel
    receiving = receiver()
    send(receiving, 1, _full_tensors(shapes, seed=1))
    with pytest.raises(SyncError, match="rolled back to version 0"):
        receiving.commit(1, PROBE, lambda: expected_for(engine.initial))
    assert receiving.policy_version == 0
    for name, tensor in engine.initial.items():
        assert torch.equal(engine.held[name], tensor), name
    receiving.close()


def test_without_a_kept_version_a_failed_one_leaves_the_engine_refusing(channel):
    shapes, engine, receiver, send = channel
    receiving = receiver(keep_previous=False)
    send(receiving, 1, _full_tensors(shapes, seed=1))

    def lost():
        raise RuntimeError("learner rank 0 died")

    with pytest.raises(SyncError, match="did not arrive .* no previous weights were kept"):
        receiving.commit(1, PROBE, lost)
    assert receiving.unusable and receiving.policy_version == 0
    second = _full_tensors(shapes, seed=2)
    send(receiving, 1, second)  # a later version that checks out makes it usable again
    receiving.commit(1, PROBE, expected_for(second))
    assert receiving.unusable is None and receiving.policy_version == 1
    receiving.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_every_transport_implements_the_whole_interface(name):
    transport = make_transport(name)
    assert not inspect.isabstract(type(transport))
    # The set-up steps a transport has nothing to do for are there all the same, and do nothing.
    transport.set_routes(["shm"], whole_buckets=True)
    transport.share_buffers(None)
    transport.select([0])
    transport.release()
    transport.close()


def test_a_rollback_copy_changed_since_it_arrived_is_never_written_back(channel):
    shapes, engine, receiver, send = channel
    receiving = receiver()
    first, second = _full_tensors(shapes, seed=1), _full_tensors(shapes, seed=2)
    served = []
    write = receiving._write
    receiving._write = lambda weights: (served.append(weights), write(weights))
    send(receiving, 1, first)
    receiving.commit(1, PROBE, expected_for(first))
    name = "model.layers.0.self_attn.q_proj.weight"
    served[0][name].view(torch.int32).view(-1)[7] ^= 1 << 30  # a bit of the kept copy flips while version 1 serves
    send(receiving, 2, second)
    with pytest.raises(SyncError, match=r"v2: .*differ.* copy of version 1 kept for rolling back is corrupt "
                                        r"\(bucket \d+ from learner rank \d+ of version 1 changed .*q_proj"):
        receiving.commit(2, PROBE, expected_for(first))
    assert len(engine.writes) == 2  # the corrupt copy was not written back
    assert receiving.unusable and "corrupt" in receiving.unusable
    receiving.close()


def test_a_probe_that_comes_back_nan_says_so(channel):
    shapes, engine, receiver, send = channel
    engine.probe = lambda tokens: [0.0] + [float("nan")] * (len(tokens) - 1)
    receiving = receiver()
    weights = _full_tensors(shapes, seed=1)
    send(receiving, 1, weights)
    with pytest.raises(SyncError, match=r"v1: after writing, the engine's probe logprobs are not finite \(NaN or inf\)"
                                        r".* rolled back to version 0"):
        receiving.commit(1, PROBE, expected_for(weights))
    receiving.close()
