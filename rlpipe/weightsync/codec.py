"""Bucket parts as flat byte buffers: packing a rank's rows on the learner and checksumming them on both sides (the
engine assembles them in staging.py).

A part is the rank's pieces laid end to end in the rollout dtype, no header: the plan says where each piece
sits, so both sides compute the layout and only bytes and a checksum travel. Where the transport gives all ranks
one buffer per bucket (shared memory), each rank instead writes its rows where they belong in the bucket's whole
tensors, and its part is those spans.

The checksum is the sum of the part's 64-bit words (the tail zero-padded) modulo 2^64, mixed with the length —
taken over the rank's spans in place when ranks share a buffer: it reads memory at bandwidth speed (crc32 runs at a
fraction of memcpy's speed and would dominate the transfer: docs/benchmarks.md), and any changed word, truncation or
zeroed span changes it. It guards against transport faults, not tampering. The sender takes it while copying
(`native.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rlpipe.weightsync import native
from rlpipe.weightsync.errors import SyncError
from rlpipe.weightsync.layout import Bucket

_MASK = (1 << 64) - 1


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


# Without the native loop, packing copies this many bytes at a time and sums them while they are still in a core's
# L2 cache (larger chunks pack slower where L2 is 1 MiB: docs/benchmarks.md).
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
