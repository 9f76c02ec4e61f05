"""An engine's staging of one version: every learner rank's part of every bucket, checked and assembled into whole
tensors before anything is written to the engine."""

from __future__ import annotations

import threading

import numpy as np
import torch

from rlpipe.weightsync.codec import PartHash, check_key, copy_hashed
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.layout import Bucket, SyncPlan


class Staging:
    """One version's tensors, assembled on the engine from every rank's part of every bucket.

    Nothing here touches the engine: a version is handed over only when complete and every checksum matched.
    Parts may arrive in any order and from several threads.

    Every part is copied out of the transport's buffer into memory this staging owns (`owned`), and its checksum is
    taken in the same pass, over each word as it is written there (`codec.copy_hashed`): what the engine later writes
    from is exactly what was checked, whatever happens to the transport's buffer (shared memory the learner writes
    into, the object store) after the part arrived. A later staging may write over the memory (`reuse`: fresh memory
    costs a page fault per 4 KiB); with `reuse` laid out for every tensor of the plan in shared memory (the engine's
    host copy, `HostCopy.staging_memory`), the version is assembled where the engine's workers read it. With
    `whole_buckets` (the transport hands every rank's part of a bucket in one buffer, the rows already in place:
    shared memory) each rank's rows are read where they lie in the bucket's whole tensors.

    The checksums are keyed with the run's secret `key` (codec.py), and stay with the staging: `verify()` checks
    the assembled tensors against them again, before a version kept for rolling back is written back.
    """

    def __init__(
        self,
        plan: SyncPlan,
        version: int,
        key: bytes,
        reuse: dict[str, torch.Tensor] | None = None,
        whole_buckets: bool = False,
    ):
        check_key(key)
        self.plan = plan
        self.version = version
        self.key = key
        self.whole_buckets = whole_buckets
        self.tensors: dict[str, torch.Tensor] = {}
        self.owned: dict[str, torch.Tensor] = {}
        self._reuse = reuse or {}
        self._expected = {
            (bucket.index, rank) for bucket in plan.buckets for rank in range(plan.learner_ranks) if bucket.part_bytes(rank)
        }
        self._received: dict[tuple[int, int], int] = {}  # (bucket, rank) -> the checksum it matched
        self._arriving: set[tuple[int, int]] = set()  # being copied in now
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

    def _rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """The bytes of rows [start, stop) of this staging's tensor `name`, as a writable uint8 array."""
        target = self._owned_tensor(name)
        rows = target if target.dim() == 0 else target[start:stop]
        return rows.reshape(-1).view(torch.uint8).numpy()

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
        with self._lock:
            if (bucket_index, rank) in self._arriving or (bucket_index, rank) in self._received:
                raise SyncError(f"weight sync v{self.version}: bucket {bucket_index} from rank {rank} arrived twice")
            self._arriving.add((bucket_index, rank))
        try:
            actual = self._copy_in(bucket, rank, buffer)
        finally:
            with self._lock:
                self._arriving.discard((bucket_index, rank))
        if actual != expected_checksum:
            raise SyncError(
                f"weight sync v{self.version}: bucket {bucket_index} from learner rank {rank} is corrupt "
                f"(checksum {actual:#018x}, sent {expected_checksum:#018x}); the engine keeps its weights"
            )
        with self._lock:
            self._received[(bucket_index, rank)] = expected_checksum
            self.bytes_received += bucket.part_bytes(rank)

    def _copy_in(self, bucket: Bucket, rank: int, buffer: np.ndarray) -> int:
        """Copy `rank`'s rows of `bucket` from `buffer` into this staging's tensors; the checksum of what was written."""
        data = buffer.reshape(-1).view(np.uint8)
        hasher = PartHash.of_part(self.version, bucket, rank, self.key)
        for piece in bucket.parts[rank]:
            position = piece.bucket_offset if self.whole_buckets else piece.offset
            hasher.add(copy_hashed(data[position : position + piece.nbytes],
                                   self._rows(piece.name, piece.start, piece.stop), hasher.seed, hasher.step,
                                   piece.offset))
        return hasher.digest()

    def verify(self) -> str | None:
        """Check the assembled tensors against the checksums the parts matched on arrival; None if every part is
        intact, else which part changed since. Reads the whole version once (used before a rollback writes it)."""
        with self._lock:
            received = dict(self._received)
        for (bucket_index, rank), digest in sorted(received.items()):
            bucket = self.plan.buckets[bucket_index]
            hasher = PartHash.of_part(self.version, bucket, rank, self.key)
            for piece in bucket.parts[rank]:
                hasher.update(self._rows(piece.name, piece.start, piece.stop), piece.offset)
            if hasher.digest() != digest:
                names = sorted({piece.name for piece in bucket.parts[rank]})
                return (f"bucket {bucket_index} from learner rank {rank} of version {self.version} changed since it "
                        f"was checked ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
        return None

    def missing(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._expected - set(self._received))

    def complete(self) -> dict[str, torch.Tensor]:
        missing = self.missing()
        if missing:
            raise SyncError(
                f"weight sync v{self.version}: {len(missing)} bucket parts never arrived "
                f"(first: bucket {missing[0][0]} from rank {missing[0][1]}); the engine keeps its weights"
            )
        self._reuse = {}  # what it did not use is the receiver's to hand on or free
        return {name: self.tensors[name] for name in self.plan.shapes}
