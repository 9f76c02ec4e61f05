"""An engine's staging of one version: every learner rank's part of every bucket, checked and assembled into whole
tensors before anything is written to the engine."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import torch

from rlpipe.weightsync.codec import part_checksum
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.layout import SyncPlan


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
    Without `adopt_buffers`, and with `reuse` laid out for every tensor of the plan in shared memory (the engine's
    host copy, `HostCopy.staging_memory`), each part is copied into that memory as it arrives and its buffer is
    free as soon as `add` returns: the version is assembled where the engine's workers read it.
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
