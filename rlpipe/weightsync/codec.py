"""Bucket parts as flat byte buffers: packing a rank's rows on the learner, checking and assembling on the engine.

A part is the rank's pieces laid end to end in the rollout dtype, no header: the plan says where each piece
sits, so both sides compute the layout and only bytes and a checksum travel.

The checksum is the sum of the buffer's 64-bit words (the tail zero-padded) modulo 2^64, mixed with the length:
it reads memory at bandwidth speed (crc32 here runs at about a sixth of memcpy and would dominate the transfer),
and any changed word, truncation or zeroed span changes it. It guards against transport faults, not tampering.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from rlpipe.weightsync.plan import Bucket, SyncPlan

_MASK = (1 << 64) - 1


class SyncError(RuntimeError):
    """A weight update that must not be applied (or was rolled back); the message says which check failed."""


def checksum(buffer: np.ndarray) -> int:
    running = _RunningChecksum(buffer)
    running.advance(buffer.nbytes)
    return running.finish()


class _RunningChecksum:
    """`checksum` of a buffer that is being filled front to back, taken in step with the filling: each span is
    summed right after it was written, while it is still in cache, so the checksum costs almost no memory traffic."""

    def __init__(self, buffer: np.ndarray):
        self.data = buffer.reshape(-1).view(np.uint8)
        self.done = 0  # bytes summed so far; always a multiple of 8
        self.total = 0

    def advance(self, written: int) -> None:
        """The buffer's first `written` bytes are final."""
        upto = written // 8 * 8
        if upto > self.done:
            self.total += int(self.data[self.done : upto].view(np.uint64).sum(dtype=np.uint64))
            self.done = upto

    def finish(self) -> int:
        self.advance(len(self.data))
        if self.done < len(self.data):
            tail = np.zeros(8, dtype=np.uint8)
            tail[: len(self.data) - self.done] = self.data[self.done :]
            self.total += int(tail.view(np.uint64)[0])
        return (self.total + len(self.data) * 0x9E3779B97F4A7C15) & _MASK


# Packing copies this many bytes at a time and sums them straight away (see _RunningChecksum).
_PACK_CHUNK_BYTES = 4 << 20


def pack_part(bucket: Bucket, rank: int, local: Mapping[str, torch.Tensor], dtype: torch.dtype, out: np.ndarray) -> int:
    """Write `rank`'s pieces of `bucket` into `out` (uint8, part_bytes long), casting to `dtype`; returns the
    checksum. `local[name]` is the rank's shard of that tensor: exactly the rows the plan assigns it."""
    target = torch.from_numpy(out) if len(out) else None
    running = _RunningChecksum(out)
    chunk = max(1, _PACK_CHUNK_BYTES // dtype.itemsize)
    for piece in bucket.parts[rank]:
        shard = local[piece.name]
        if shard.numel() * dtype.itemsize != piece.nbytes:
            rows = shard.shape[0] if shard.dim() else 1
            raise SyncError(
                f"{piece.name}: rank {rank} holds {rows} rows of shape {tuple(shard.shape)} but the sync plan "
                f"expects {piece.stop - piece.start} rows; the plan no longer matches the learner's sharding"
            )
        source = shard.detach().reshape(-1)
        view = target[piece.offset : piece.offset + piece.nbytes].view(dtype)
        if source.dtype == dtype:  # a plain memcpy on this thread: torch's copy_ would wake its OpenMP threads,
            source, view = source.numpy(), view.numpy()  # whose spinning takes the cores the receiver needs
            copy = np.copyto
        else:
            copy = torch.Tensor.copy_
        for start in range(0, len(source), chunk):
            copy(view[start : start + chunk], source[start : start + chunk])
            running.advance(piece.offset + min(start + chunk, len(source)) * dtype.itemsize)
    return running.finish()


class Staging:
    """One version's tensors, assembled on the engine from every rank's part of every bucket.

    Nothing here touches the engine: a version is handed over only when complete and every checksum matched.
    Parts may arrive in any order and from several threads.

    With `adopt_buffers` (the transport's received buffers stay valid and unchanged while this version may still be
    needed), a tensor whose rows all arrive in one part is used in place, as a view of that buffer, instead of
    being copied: with one learner rank that is every tensor, and the engine's side of the transfer is just the
    checksum. Tensors assembled from several ranks' rows are copied into memory this staging owns (`owned`), which
    a later staging may write over (`reuse`: fresh memory costs a page fault per 4 KiB).
    """

    def __init__(
        self, plan: SyncPlan, version: int, reuse: dict[str, torch.Tensor] | None = None, adopt_buffers: bool = False
    ):
        self.plan = plan
        self.version = version
        self.adopt_buffers = adopt_buffers
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
        size = bucket.part_bytes(rank)
        if buffer.nbytes != size:
            raise SyncError(
                f"weight sync v{self.version}: bucket {bucket_index} from rank {rank} has {buffer.nbytes} bytes, "
                f"the plan says {size}"
            )
        actual = checksum(buffer)
        if actual != expected_checksum:
            raise SyncError(
                f"weight sync v{self.version}: bucket {bucket_index} from learner rank {rank} is corrupt "
                f"(checksum {actual:#018x}, sent {expected_checksum:#018x}); the engine keeps its weights"
            )
        with warnings.catch_warnings():  # buffers from the object store are read-only; they are only read here
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(buffer.reshape(-1).view(np.uint8))
        dtype = self.plan.torch_dtype
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
        with self._lock:
            if (bucket_index, rank) in self._received:
                raise SyncError(f"weight sync v{self.version}: bucket {bucket_index} from rank {rank} arrived twice")
            self._received.add((bucket_index, rank))
            self.bytes_received += size

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
