"""Bucket parts as flat byte buffers: packing a rank's rows on the learner, checking and assembling on the engine.

A part is the rank's pieces laid end to end in the rollout dtype, no header: the plan says where each piece
sits, so both sides compute the layout and only bytes and a checksum travel. Where the transport gives all ranks
one buffer per bucket (shared memory), each rank instead writes its rows where they belong in the bucket's whole
tensors, and its part is those spans.

The checksum is the sum of the part's 64-bit words (the tail zero-padded) modulo 2^64, mixed with the length —
taken over the rank's spans in place when ranks share a buffer: it reads memory at bandwidth speed (crc32 here
runs at about a sixth of memcpy and would dominate the transfer), and any changed word, truncation or zeroed span
changes it. It guards against transport faults, not tampering. The sender takes it while copying (`native.py`).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from rlpipe.weightsync import native
from rlpipe.weightsync.plan import Bucket, SyncPlan

_MASK = (1 << 64) - 1


class SyncError(RuntimeError):
    """A weight update that must not be applied (or was rolled back); the message says which check failed."""


def checksum(buffer: np.ndarray) -> int:
    data = buffer.reshape(-1).view(np.uint8)
    return _finish(_positional_sum(data, 0), data.nbytes)


def _finish(total: int, nbytes: int) -> int:
    return (total + nbytes * 0x9E3779B97F4A7C15) & _MASK


def _positional_sum(data: np.ndarray, position: int) -> int:
    """The sum of the bytes `data` (uint8) each shifted into its place in a little-endian 64-bit word, where
    `data[0]` sits at byte `position` of the part. Over a whole part: the sum of its words, the tail zero-padded.
    Additive over consecutive spans, so a part can be summed piece by piece as it is written."""
    total, head = 0, min(len(data), -position % 8)
    for i in range(head):
        total += int(data[i]) << 8 * ((position + i) % 8)
    body = (len(data) - head) // 8 * 8
    total += int(data[head : head + body].view(np.uint64).sum(dtype=np.uint64))
    for i in range(head + body, len(data)):
        total += int(data[i]) << 8 * ((position + i) % 8)
    return total & _MASK


# Without the native loop, packing copies this many bytes at a time and sums them while they are still in cache
# (in this CPU's 1 MiB L2; 4 MiB chunks packed a third slower).
_PACK_CHUNK_BYTES = 1 << 20


def pack_part(
    bucket: Bucket,
    rank: int,
    local: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    out: np.ndarray,
    whole_bucket: bool = False,
) -> int:
    """Write `rank`'s pieces of `bucket` into `out` (uint8), casting to `dtype`; returns the checksum.
    `local[name]` is the rank's shard of that tensor: exactly the rows the plan assigns it. `out` is the rank's
    part (part_bytes long), or with `whole_bucket` the buffer every rank writes its rows into (bucket.nbytes long,
    the whole tensors end to end): then the rows go to their place in their tensor and the checksum covers just
    them (`part_checksum`)."""
    fused = native.copy_checksum()
    total = 0
    for piece in bucket.parts[rank]:
        shard = local[piece.name]
        if shard.numel() * dtype.itemsize != piece.nbytes:
            rows = shard.shape[0] if shard.dim() else 1
            raise SyncError(
                f"{piece.name}: rank {rank} holds {rows} rows of shape {tuple(shard.shape)} but the sync plan "
                f"expects {piece.stop - piece.start} rows; the plan no longer matches the learner's sharding"
            )
        source = shard.detach().reshape(-1)
        position = piece.bucket_offset if whole_bucket else piece.offset
        span = out[position : position + piece.nbytes]
        if source.dtype == dtype:
            # numpy's copy and the native loop run on this thread: torch's copy_ would wake its OpenMP threads,
            # whose spinning takes the cores the receiver needs
            source_bytes = source.view(torch.uint8).numpy()
            if fused is not None:
                total += fused(source_bytes, span, position)
                continue
            copy, source, target, scale = np.copyto, source_bytes, span, 1
        else:
            copy, target, scale = torch.Tensor.copy_, torch.from_numpy(span).view(dtype), dtype.itemsize
        step = max(1, _PACK_CHUNK_BYTES // scale)
        for start in range(0, len(source), step):
            copy(target[start : start + step], source[start : start + step])
            written = span[start * scale : (start + step) * scale]
            total += _positional_sum(written, position + start * scale)
    return _finish(total, bucket.part_bytes(rank))


def part_checksum(bucket: Bucket, rank: int, buffer: np.ndarray, whole_bucket: bool = False) -> int:
    """The checksum of `rank`'s part of `bucket`: all of `buffer`, or with `whole_bucket` only that rank's rows in
    the shared buffer. Equal to what `pack_part` returned for intact bytes."""
    if not whole_bucket:
        return checksum(buffer)
    data = buffer.reshape(-1).view(np.uint8)
    total = 0
    for piece in bucket.parts[rank]:
        total += _positional_sum(data[piece.bucket_offset : piece.bucket_offset + piece.nbytes], piece.bucket_offset)
    return _finish(total, bucket.part_bytes(rank))


class Staging:
    """One version's tensors, assembled on the engine from every rank's part of every bucket.

    Nothing here touches the engine: a version is handed over only when complete and every checksum matched.
    Parts may arrive in any order and from several threads.

    With `adopt_buffers` (the transport's received buffers stay valid and unchanged while this version may still be
    needed), a tensor whose rows all arrive in one part is used in place, as a view of that buffer, instead of
    being copied: with one learner rank that is every tensor, and the engine's side of the transfer is just the
    checksum. Tensors assembled from several ranks' rows are copied into memory this staging owns (`owned`), which
    a later staging may write over (`reuse`: fresh memory costs a page fault per 4 KiB). With `whole_buckets`
    (the transport hands every rank's part of a bucket in one buffer, the rows already in place: shared memory)
    the bucket's tensors are used in place once every rank's rows in it checked out, whatever the rank count.
    """

    def __init__(
        self,
        plan: SyncPlan,
        version: int,
        reuse: dict[str, torch.Tensor] | None = None,
        adopt_buffers: bool = False,
        whole_buckets: bool = False,
    ):
        self.plan = plan
        self.version = version
        self.adopt_buffers = adopt_buffers
        self.whole_buckets = whole_buckets
        self.tensors: dict[str, torch.Tensor] = {}
        self.owned: dict[str, torch.Tensor] = {}
        self._reuse = reuse or {}
        self._expected = {
            (bucket.index, rank) for bucket in plan.buckets for rank in range(plan.learner_ranks) if bucket.part_bytes(rank)
        }
        self._received: set[tuple[int, int]] = set()
        self.bytes_received = 0
        self._lock = threading.Lock()

    def _owned_tensor(self, name: str) -> torch.Tensor:
        with self._lock:
            if name not in self.owned:
                shape, reused = tuple(self.plan.shapes[name]), self._reuse.get(name)
                fits = reused is not None and tuple(reused.shape) == shape and reused.dtype == self.plan.torch_dtype
                self.owned[name] = reused if fits else torch.empty(shape, dtype=self.plan.torch_dtype)
                self.tensors[name] = self.owned[name]
            return self.owned[name]

    def add(self, bucket_index: int, rank: int, buffer: np.ndarray, expected_checksum: int) -> None:
        if not 0 <= bucket_index < len(self.plan.buckets) or not 0 <= rank < self.plan.learner_ranks:
            raise SyncError(f"weight sync v{self.version}: no bucket {bucket_index} from rank {rank} in the plan")
        bucket = self.plan.buckets[bucket_index]
        size = bucket.nbytes if self.whole_buckets else bucket.part_bytes(rank)
        if buffer.nbytes != size:
            raise SyncError(
                f"weight sync v{self.version}: bucket {bucket_index} from rank {rank} has {buffer.nbytes} bytes, "
                f"the plan says {size}"
            )
        actual = part_checksum(bucket, rank, buffer, self.whole_buckets)
        if actual != expected_checksum:
            raise SyncError(
                f"weight sync v{self.version}: bucket {bucket_index} from learner rank {rank} is corrupt "
                f"(checksum {actual:#018x}, sent {expected_checksum:#018x}); the engine keeps its weights"
            )
        with warnings.catch_warnings():  # buffers from the object store are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(buffer.reshape(-1).view(np.uint8))
        dtype = self.plan.torch_dtype
        if self.whole_buckets:
            self._arrived(bucket_index, rank, bucket.part_bytes(rank))
            senders = {r for r in range(self.plan.learner_ranks) if bucket.part_bytes(r)}
            with self._lock:
                if not senders <= {r for b, r in self._received if b == bucket_index}:
                    return
            for name, offset in zip(bucket.names, bucket.tensor_offsets):
                shape = tuple(self.plan.shapes[name])
                whole = source[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                if self.adopt_buffers:
                    with self._lock:
                        self.tensors[name] = whole
                else:
                    self._owned_tensor(name).copy_(whole)
            return
        for piece in bucket.parts[rank]:
            shape = tuple(self.plan.shapes[piece.name])
            rows = source[piece.offset : piece.offset + piece.nbytes].view(dtype)
            whole = not shape or (piece.start == 0 and piece.stop == shape[0])
            if whole and self.adopt_buffers:
                with self._lock:
                    self.tensors[piece.name] = rows.view(shape)
                continue
            target = self._owned_tensor(piece.name)
            part = target if target.dim() == 0 else target[piece.start : piece.stop]
            part.copy_(rows.view(part.shape))
        self._arrived(bucket_index, rank, size)

    def _arrived(self, bucket_index: int, rank: int, nbytes: int) -> None:
        with self._lock:
            if (bucket_index, rank) in self._received:
                raise SyncError(f"weight sync v{self.version}: bucket {bucket_index} from rank {rank} arrived twice")
            self._received.add((bucket_index, rank))
            self.bytes_received += nbytes

    def missing(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._expected - self._received)

    def complete(self) -> dict[str, torch.Tensor]:
        missing = self.missing()
        if missing:
            raise SyncError(
                f"weight sync v{self.version}: {len(missing)} bucket parts never arrived "
                f"(first: bucket {missing[0][0]} from rank {missing[0][1]}); the engine keeps its weights"
            )
        return {name: self.tensors[name] for name in self.plan.shapes}
