"""The learner side: pack this rank's part of each bucket and hand it to a transport, two buckets ahead."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlpipe.weightsync.codec import check_key, pack_part
from rlpipe.weightsync.layout import SyncPlan


# Buckets packed ahead of the one being shipped: the packing thread runs on without waiting for the caller's
# hand-offs (each costs a thread wake-up), at the price of this many more buckets of transport buffers.
_PACK_AHEAD = 2
# Buckets of one sender in flight at once: the one being shipped and those packed ahead of it, each with its
# transport buffer (what `rlpipe plan` counts on a host at a sync).
BUCKETS_IN_FLIGHT = _PACK_AHEAD + 1


@dataclass
class OutgoingPart:
    bucket: int
    rank: int
    nbytes: int  # the buffer the engine receives: the part, or the whole bucket when ranks share one
    sent_bytes: int  # this rank's bytes in it
    checksum: int
    handle: Any
    deliver: Callable[[], None]


def stream_parts(
    plan: SyncPlan, rank: int, local: Mapping[str, torch.Tensor], transport, version: int, key: bytes
) -> Iterator[OutgoingPart]:
    """This rank's non-empty parts in bucket order, their checksums keyed with the run's secret `key`. While the
    caller ships one part, the next ones are being packed (cast, copy, checksum, the check for NaN and inf) in a
    worker thread, so packing and transfer overlap. A tensor holding NaN or inf raises `NonFiniteWeights` before its
    bucket leaves the rank."""
    check_key(key)
    buckets = [bucket for bucket in plan.buckets if bucket.part_bytes(rank)]
    dtype = plan.torch_dtype

    def pack(index: int) -> OutgoingPart:
        bucket = buckets[index]
        whole = transport.whole_buckets
        buffer = transport.allocate(bucket.nbytes if whole else bucket.part_bytes(rank), bucket.index, version)
        digest = pack_part(bucket, rank, local, dtype, buffer, whole_bucket=whole, version=version, key=key)
        handle, deliver = transport.send(buffer)
        return OutgoingPart(bucket.index, rank, buffer.nbytes, bucket.part_bytes(rank), digest, handle, deliver)

    if not buckets:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlpipe-pack") as packer:
        upcoming = [packer.submit(pack, index) for index in range(min(_PACK_AHEAD, len(buckets)))]
        for index in range(len(buckets)):
            part = upcoming.pop(0).result()
            if index + _PACK_AHEAD < len(buckets):
                upcoming.append(packer.submit(pack, index + _PACK_AHEAD))
            yield part
