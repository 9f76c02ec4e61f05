"""An engine's end of the weight sync without an engine: the receiver writes a version only whole and checked,
inside the engine's pause, and writes the previous one back when the probe disagrees."""

from __future__ import annotations

import contextlib
import inspect
import os
import time

import pytest
import torch

from rlpipe.weightsync import TRANSPORTS, SyncError, WeightReceiver, make_transport, plan_sync, stream_parts
from rlpipe.weightsync.hostcopy import HostCopy
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


def _shared_receiver(engine, host):
    return WeightReceiver(make_transport("shm"), write=lambda w: engine.write(w), probe=lambda t: engine.probe(t),
                          initial_weights=lambda: engine.initial, paused=engine.pause, tolerance=1e-9, exact=True,
                          host_memory=lambda: host)


def test_a_staged_copy_changed_in_its_file_after_the_check_is_never_served(channel, tmp_path):
    """Staged where the engine's workers read it (a file of the engine's in shared memory), a version can be changed
    through that file after its parts were checked and before the workers read it. The probe sees only what its
    tokens touch (here nothing of the change); the receiver checks the staged copy again once the write has read it,
    and writes the previous version back."""
    shapes, engine, _, send = channel
    host = HostCopy(directory=str(tmp_path))
    receiving = _shared_receiver(engine, host)
    first = _full_tensors(shapes, seed=1)
    send(receiving, 1, first)
    staged = receiving._staging.tensors
    name = "model.layers.0.self_attn.q_proj.weight"
    path, offset = host._in_staging(staged[name])
    assert path.startswith(str(tmp_path))
    write = engine.write

    def changed_before_the_workers_read(weights):
        # What another process of the run's user can do: open the file by its name and rewrite one byte.
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, offset + 3)[0] ^ 0x40]), offset + 3)
        finally:
            os.close(fd)
        write(weights)

    engine.write = changed_before_the_workers_read
    engine.probe = lambda tokens: expected_for(first)  # blind to the change, as a sequence that never uses it
    with pytest.raises(SyncError, match=r"v1: the staged copy another process can map changed since it was checked "
                                        r"\(bucket \d+ .*q_proj.*\).* rolled back to version 0"):
        receiving.commit(1, PROBE, expected_for(first))
    assert receiving.policy_version == 0
    for tensor_name, tensor in engine.initial.items():
        assert torch.equal(engine.held[tensor_name], tensor), tensor_name
    # Left alone, the same kind of version is served: the check passes on an intact copy.
    engine.write = write
    second = _full_tensors(shapes, seed=2)
    engine.probe = lambda tokens: expected_for(second)
    send(receiving, 2, second)
    receiving.commit(2, PROBE, expected_for(second))
    assert receiving.policy_version == 2
    receiving.close()
    host.close()


def test_a_mean_checked_probe_refuses_one_token_far_off(channel):
    """A bf16 engine's probe is checked on its mean gap. A gross corruption that only a few of a long sequence's
    tokens see (a weight blown up to 1e36) moves those by nats and the mean hardly at all: the largest gap has a
    bound of its own, MEAN_PROBE_MAX_FACTOR times the tolerance."""
    shapes, engine, _, send = channel
    tokens = list(range(200))
    reference = [0.0] + [-1.0] * (len(tokens) - 1)
    receiving = WeightReceiver(make_transport("shm"), write=engine.write, probe=lambda t: engine.probe(t),
                               initial_weights=lambda: engine.initial, paused=engine.pause, tolerance=0.15,
                               exact=False)
    clean = [0.0] + [-1.0 + (0.3 if i % 7 == 0 else 0.01) for i in range(1, len(tokens))]  # a clean bf16 sync
    engine.probe = lambda _: clean
    send(receiving, 1, _full_tensors(shapes, seed=1))
    assert receiving.commit(1, tokens, reference).probe_max_abs == pytest.approx(0.3)
    far_off = list(clean)
    far_off[150] = -9.0  # one token 8 nats off: the mean moves by 0.04
    engine.probe = lambda _: far_off
    send(receiving, 2, _full_tensors(shapes, seed=2))
    with pytest.raises(SyncError, match=r"v2: .*differ from the learner's by 8 \(max over tokens\) > "
                                        r"10 x sync.probe_tolerance 0.15.* rolled back to version 1"):
        receiving.commit(2, tokens, reference)
    assert receiving.policy_version == 1
    receiving.close()
