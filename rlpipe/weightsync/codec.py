"""Bucket parts as flat byte buffers: packing a rank's rows on the learner and checksumming them on both sides (the
engine assembles them in staging.py).

A part is the rank's pieces laid end to end in the rollout dtype, no header: the plan says where each piece
sits, so both sides compute the layout and only bytes and a checksum travel. Where the transport gives all ranks
one buffer per bucket (shared memory), each rank instead writes its rows where they belong in the bucket's whole
tensors, and its part is those spans.

The checksum is XXH3-64 over the part's pieces in plan order, seeded with the version, the bucket index and the
sending rank (`part_seed`): a changed, swapped or zeroed word, compensating changes, a truncation, and a buffer
labelled with another bucket, rank or version (a stale one replayed) all change it. Each side takes it where it
touches the bytes anyway, a chunk at a time while the chunk is in cache: the sender while packing, the engine while
copying the part out of the transport's buffer into its own staging copy, the memory the engine writes from.

Packing also refuses non-finite values (`NonFiniteWeights`): a diverged step's weights never leave the learner.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
import torch
import xxhash

from rlpipe.weightsync import native
from rlpipe.weightsync.errors import NonFiniteWeights, SyncError
from rlpipe.weightsync.layout import Bucket

# Bytes copied and hashed at a time: the chunk just copied is hashed while it is still in a core's L2 cache.
CHUNK_BYTES = 1 << 20


def part_seed(version: int, bucket: int, rank: int) -> int:
    """The checksum's seed for `rank`'s part of `bucket` in `version`: the part's identity folded into its hash."""
    return xxhash.xxh3_64_intdigest(struct.pack("<4sQQQ", b"rlws", version, bucket, rank))


def part_hasher(version: int, bucket: int, rank: int) -> xxhash.xxh3_64:
    return xxhash.xxh3_64(seed=part_seed(version, bucket, rank))


def checksum(buffer: np.ndarray, seed: int = 0) -> int:
    return xxhash.xxh3_64_intdigest(_bytes_of(buffer), seed=seed)


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


# The exponent bits of each float dtype the weights travel in, for the native loop: all set means inf or NaN.
_EXPONENT_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00,
                  torch.float64: 0x7FF0000000000000}
# numpy's float dtypes, checked with its vectorized isfinite; bfloat16, which numpy lacks, by its exponent bits.
_NUMPY_FLOATS = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
_BF16_MAGNITUDE, _BF16_INF = np.uint16(0x7FFF), np.uint16(0x7F80)


def first_non_finite(data: np.ndarray, dtype: torch.dtype) -> int | None:
    """The index of the first NaN or inf among the bytes `data` read as `dtype`, or None (also for dtypes that hold
    no such values). One vectorized pass over a chunk in cache; the index is looked for only when there is one."""
    if data.nbytes == 0:
        return None
    if dtype in _NUMPY_FLOATS:
        values = data.view(_NUMPY_FLOATS[dtype])
        if np.isfinite(values).all():
            return None
        return int(np.argmin(np.isfinite(values)))
    if dtype == torch.bfloat16:
        magnitude = data.view(np.uint16) & _BF16_MAGNITUDE
        if magnitude.max() < _BF16_INF:
            return None
        return int(np.argmax(magnitude >= _BF16_INF))
    return None


def _refuse_non_finite(name: str, index: int, rank: int, version: int) -> None:
    raise NonFiniteWeights(
        f"weight sync v{version}: {name} holds NaN or inf (element {index} of learner rank {rank}'s rows); the "
        f"training step that produced version {version} diverged, so its weights are not sent"
    )


def pack_part(
    bucket: Bucket,
    rank: int,
    local: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    out: np.ndarray,
    whole_bucket: bool = False,
    version: int = 0,
) -> int:
    """Write `rank`'s pieces of `bucket` into `out` (uint8), casting to `dtype`; returns the checksum (seeded with
    `version`, the bucket and `rank`). `local[name]` is the rank's shard of that tensor: exactly the rows the plan
    assigns it. `out` is the rank's part (part_bytes long), or with `whole_bucket` the buffer every rank writes its
    rows into (bucket.nbytes long, the whole tensors end to end): then the rows go to their place in their tensor and
    the checksum covers just them (`part_checksum`). Raises `NonFiniteWeights` on a NaN or inf, naming the tensor."""
    copy_check = native.copy_check()
    hasher = part_hasher(version, bucket.index, rank)
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
            # numpy and the native loop run on this thread: torch's copy_ would wake its OpenMP threads, whose
            # spinning takes the cores the receiver needs. The source chunk is hashed first, which brings it into
            # cache; the native loop then copies it with streaming stores (no read of `span`) and checks its values.
            source_bytes = source.view(torch.uint8).numpy()
            step = max(1, CHUNK_BYTES // dtype.itemsize) * dtype.itemsize  # whole values, for the finiteness check
            exponent = _EXPONENT_BITS.get(dtype, 0)
            for start in range(0, len(source_bytes), step):
                chunk, target = source_bytes[start : start + step], span[start : start + step]
                hasher.update(memoryview(chunk))
                if copy_check is not None:
                    suspect = copy_check(chunk, target, dtype.itemsize if exponent else 0, exponent)
                else:
                    np.copyto(target, chunk)
                    suspect = True
                bad = first_non_finite(chunk, dtype) if suspect else None
                if bad is not None:
                    _refuse_non_finite(piece.name, start // dtype.itemsize + bad, rank, version)
            continue
        target = torch.from_numpy(span).view(dtype)
        step = max(1, CHUNK_BYTES // dtype.itemsize)
        for start in range(0, len(source), step):
            target[start : start + step].copy_(source[start : start + step])
            written = span[start * dtype.itemsize : (start + step) * dtype.itemsize]
            hasher.update(memoryview(written))
            bad = first_non_finite(written, dtype)
            if bad is not None:
                _refuse_non_finite(piece.name, start + bad, rank, version)
    return hasher.intdigest()


def copy_hashed(source: np.ndarray, target: np.ndarray, hasher: xxhash.xxh3_64) -> None:
    """Copy the uint8 array `source` into `target` (same length) a chunk at a time, hashing each chunk as written
    into `target`, while it is in cache: the digest covers the bytes where they now lie, not where they came from."""
    for start in range(0, len(source), CHUNK_BYTES):
        written = target[start : start + CHUNK_BYTES]
        np.copyto(written, source[start : start + CHUNK_BYTES])
        hasher.update(memoryview(written))


def part_checksum(bucket: Bucket, rank: int, buffer: np.ndarray, whole_bucket: bool = False, version: int = 0) -> int:
    """The checksum of `rank`'s part of `bucket` in `version`: all of `buffer`, or with `whole_bucket` only that
    rank's rows in the shared buffer. Equal to what `pack_part` returned for intact bytes."""
    hasher = part_hasher(version, bucket.index, rank)
    data = buffer.reshape(-1).view(np.uint8)
    for piece in bucket.parts[rank]:
        position = piece.bucket_offset if whole_bucket else piece.offset
        hasher.update(memoryview(data[position : position + piece.nbytes]))
    return hasher.intdigest()
