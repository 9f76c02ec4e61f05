"""One host copy per engine at a sync (rlpipe/weightsync/hostcopy.py): what the engine publishes, what its workers
read, and that no shared file outlives a write."""

from __future__ import annotations

import json
import os
import pickle
import re
import uuid

import pytest
import torch

from rlpipe.weightsync import SyncError, make_transport, plan_sync, stream_parts
from rlpipe.weightsync.hostcopy import (
    HostCopy,
    SharedTensor,
    SharedWeights,
    read_shared_weights,
    sees_file,
)
from tests.unit.foreign_files import NOBODY, another_user, make_as_nobody, make_open_to_all
from tests.unit.test_weightsync import KEY


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=generator),
        "b.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "c.weight": torch.randn(300, 129, generator=generator),
    }


def _ours(host: HostCopy, directory: str) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(host.segment_prefix())]


def test_workers_read_the_published_copy_and_the_file_goes_with_the_write(tmp_path):
    weights = _weights()
    host = HostCopy(chunk_bytes=1000, directory=str(tmp_path))
    with host.publish(weights) as shared:
        assert isinstance(shared, SharedWeights) and shared.names == list(weights)
        assert len(_ours(host, str(tmp_path))) == 1
        assert host.bytes_copied == sum(t.numel() * t.element_size() for t in weights.values())
        assert len(pickle.dumps(shared.message())) < 2000  # names, offsets, dtypes, shapes: no tensor bytes
        # vLLM's RPC carries plain values (msgpack): the message survives that.
        assert SharedWeights.from_message(json.loads(json.dumps(shared.message()))) == shared
        with read_shared_weights(shared) as tensors:
            read = {name: tensor.clone() for name, tensor in tensors}
    assert _ours(host, str(tmp_path)) == []
    assert list(read) == list(weights)
    for name, tensor in weights.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_a_write_that_fails_leaves_no_file(tmp_path):
    host = HostCopy(directory=str(tmp_path))
    with pytest.raises(RuntimeError, match="worker died"):
        with host.publish(_weights()):
            raise RuntimeError("worker died")
    assert _ours(host, str(tmp_path)) == []


def test_a_workers_writes_never_reach_the_shared_copy(tmp_path):
    weights = _weights()
    host = HostCopy(directory=str(tmp_path))
    with host.publish(weights) as shared:
        with read_shared_weights(shared) as tensors:
            for _, tensor in tensors:
                tensor.fill_(0)  # a loader that wrote into what it was given
        with read_shared_weights(shared) as tensors:
            assert all(torch.equal(tensor, weights[name]) for name, tensor in tensors)


def test_segments_of_engines_that_died_are_removed(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: no such process
    orphan = tmp_path / f"rlpipe-{dead}-host-0123456789ab"
    orphan.write_bytes(b"x" * 10)
    host = HostCopy(directory=str(tmp_path))
    with host.publish(_weights()):
        pass
    assert not orphan.exists()


def test_a_missing_copy_is_a_sync_error():
    shared = SharedWeights((SharedTensor("w", "/dev/shm/rlpipe-none-host-gone", 0, "float32", (2,)),), 1 << 20)
    with pytest.raises(SyncError, match="is gone"):
        with read_shared_weights(shared) as tensors:
            list(tensors)


def _read_all(path: str) -> list:
    shared = SharedWeights((SharedTensor("w", path, 0, "float32", (2,)),), 1 << 20)
    with read_shared_weights(shared) as tensors:
        return list(tensors)


@another_user
def test_a_worker_refuses_a_copy_another_user_made():
    # Where a file another user made stands for the engine's copy, the worker loads nothing from it.
    path = f"/dev/shm/rlpipe-{os.getpid()}-host-{uuid.uuid4().hex[:12]}"
    make_as_nobody([path], 64)
    try:
        with pytest.raises(SyncError, match=rf"^weight sync: shared-memory file {re.escape(path)} belongs to uid "
                                            rf"{NOBODY}, not to the run's uid {os.geteuid()}"):
            _read_all(path)
    finally:
        os.unlink(path)


def test_a_worker_refuses_a_copy_open_to_group_or_others(tmp_path):
    path = str(tmp_path / "rlpipe-1-host-open")
    make_open_to_all(path, 64)
    with pytest.raises(SyncError, match=rf"^weight sync: shared-memory file {re.escape(path)} has mode 0666"):
        _read_all(path)


def test_a_version_over_shm_is_the_engines_own_checked_copy_whatever_the_segment_holds_later():
    """Over the shm transport the engine copies each part out of the learner's segment into its host copy, checking
    it as it copies: a bit changed in the segment after the part arrived (before the write) reaches nothing the
    workers read."""
    from tests.unit.test_weightsync import _hf_shapes, _layout

    generator = torch.Generator().manual_seed(1)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in _hf_shapes(2).items()}
    plan = plan_sync(_hf_shapes(2), 1, _layout(1, 2), 4096)
    assert len(plan.buckets) > 1
    sender, receiver = make_transport("shm"), make_transport("shm")
    from rlpipe.weightsync.staging import Staging

    host = HostCopy()
    memory = host.staging_memory(dict(plan.shapes), plan.torch_dtype)
    staging = Staging(plan, 1, KEY, reuse=memory, whole_buckets=True)
    try:
        for part in stream_parts(plan, 0, weights, sender, 1, KEY):
            with receiver.receive(part.handle, part.rank, part.nbytes) as buffer:
                staging.add(part.bucket, part.rank, buffer, part.checksum)
            part.deliver()
        for _, view in receiver._attached.values():
            view[:] ^= 0x01  # every byte of the learner's segments changes after arrival
        staged = staging.complete()
        assert staging.verify() is None
        with host.publish(staged) as shared:
            assert host.bytes_copied == 0  # staged where the workers read it
            assert all("-host-" in t.path for t in shared.tensors)
            with read_shared_weights(shared) as tensors:
                assert all(torch.equal(tensor, weights[name]) for name, tensor in tensors)
        del staged, staging, memory
    finally:
        host.close()
        receiver.close()
        sender.close()


def test_a_worker_reads_the_host_copy_only_where_it_finds_the_engines_own_file(tmp_path):
    host = HostCopy(directory=str(tmp_path))
    with host.marker() as (path, device, inode):
        assert sees_file(path, device, inode)
        assert not sees_file(path, device, inode + 1)  # a namesake: another container's /dev/shm, another host
        assert not sees_file(path + "-elsewhere", device, inode)
    assert not sees_file(path, device, inode) and _ours(host, str(tmp_path)) == []


class _ObjectStoreStandIn:
    """A transport like the object store (`ray`): parts arrive as rows in buffers of their own. Keeps a weak
    reference to every buffer it hands out."""

    name = "stand-in"
    whole_buckets = False

    def __init__(self):
        self.handed_out: list = []

    def receive(self, handle, source_rank, nbytes):
        import contextlib
        import weakref

        import numpy as np

        @contextlib.contextmanager
        def buffer():
            received = np.frombuffer(bytearray(handle), dtype=np.uint8)  # a buffer of its own
            self.handed_out.append(weakref.ref(received))
            yield received

        return buffer()

    def close(self):
        pass


class _SenderStandIn:
    """The learner's side of `_ObjectStoreStandIn`: the handle is the part's bytes."""

    whole_buckets = False

    def allocate(self, nbytes, bucket, version):
        import numpy as np

        return np.empty(nbytes, dtype=np.uint8)

    def send(self, buffer):
        return buffer.tobytes(), lambda: None


@pytest.mark.parametrize("ranks", [1, 2])  # one rank: the object store's buffers would be adopted whole
def test_a_version_staged_into_the_host_copy_is_published_without_copying(ranks, tmp_path):
    """Where the workers read a host copy, staging assembles each version in a segment of the engine's: no
    transport buffer is adopted (each is gone once its part is staged), the write copies nothing, a rollback reads
    the previous version where it was staged, and closing the engine leaves no file behind."""
    from rlpipe.weightsync import WeightReceiver
    from tests.unit.test_weightsync import _full_tensors, _hf_shapes, _layout, _local_shards

    shapes = _hf_shapes(kv_heads=2)
    plan = plan_sync(shapes, ranks, _layout(1, 2), 30_000)
    senders = [_SenderStandIn() for _ in range(ranks)]
    transport, host = _ObjectStoreStandIn(), HostCopy(directory=str(tmp_path))
    initial = _full_tensors(shapes, seed=100)
    held, copied, read_from = dict(initial), [], []

    def write(weights):
        with host.publish(weights) as shared:
            copied.append(host.bytes_copied)
            read_from.append({t.path for t in shared.tensors})
            with read_shared_weights(shared) as tensors:
                held.update({name: tensor.clone() for name, tensor in tensors})

    def probe(tokens):
        return [0.0] + [float(sum(t.double().sum() for t in held.values()))] * (len(tokens) - 1)

    def expected(weights):
        return [0.0] + [float(sum(t.double().sum() for t in weights.values()))] * 4

    receiving = WeightReceiver(transport, write=write, probe=probe, initial_weights=lambda: initial,
                               tolerance=1e-9, exact=True, host_memory=lambda: host)

    def send(version, weights):
        receiving.begin(plan, version, KEY)
        for rank, sender in enumerate(senders):
            for part in stream_parts(plan, rank, _local_shards(weights, rank, ranks), sender, version, KEY):
                receiving.receive(version, part.bucket, part.rank, part.handle, part.nbytes, part.checksum)
        staged = receiving._staging.complete()
        assert all(host.holds(tensor) for tensor in staged.values())  # every tensor in the engine's segment
        assert transport.handed_out and all(ref() is None for ref in transport.handed_out)  # none adopted
        transport.handed_out.clear()

    first, second = _full_tensors(shapes, seed=1), _full_tensors(shapes, seed=2)
    send(1, first)
    receiving.commit(1, [1, 2, 3, 4, 5], expected(first), rehearsal=True)
    send(1, first)
    receiving.commit(1, [1, 2, 3, 4, 5], expected(first))
    send(2, second)
    with pytest.raises(SyncError, match="rolled back to version 1"):
        receiving.commit(2, [1, 2, 3, 4, 5], expected(first))
    send(2, second)
    receiving.commit(2, [1, 2, 3, 4, 5], expected(second))
    assert copied == [0] * 5  # four versions and a rollback, none copied at the write
    assert all(torch.equal(held[name], second[name]) for name in second)
    assert all(len(paths) == 1 and "-host-stage-" in next(iter(paths)) for paths in read_from)
    # The served version and the one before it (the rollback copy): two segments, reused version after version.
    assert len({next(iter(paths)) for paths in read_from}) == 2
    assert len(_ours(host, str(tmp_path))) == 2
    receiving.close()
    host.close()
    assert _ours(host, str(tmp_path)) == []
