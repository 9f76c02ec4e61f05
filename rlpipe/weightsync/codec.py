"""Bucket parts as flat byte buffers: packing a rank's rows on the learner and checksumming them on both sides (the
engine assembles them in staging.py).

A part is the rank's pieces laid end to end in the rollout dtype, no header: the plan says where each piece
sits, so both sides compute the layout and only bytes and a checksum travel. Where the transport gives all ranks
one buffer per bucket (shared memory), each rank instead writes its rows where they belong in the bucket's whole
tensors, and its part is those spans.

The checksum is keyed with a secret of the run and the part's identity, and built from two sums over the 8-byte words
of each piece (the piece's last one zero-padded), both modulo 2^64: the words themselves, and for each word v = word
XOR (seed + position * step), where position is the word's byte position in the part, the product of v's low and
high 32 bits (XXH3's accumulator step). The seed and the odd step are the part's (`part_keys`: BLAKE2b, keyed with the
run's 16-byte secret `key`, of the version, the bucket index and the sending rank). The two sums, the part's length
and the seed are mixed into the checksum at the end (`PartHash`). A single changed word always changes the first sum;
swapped words, compensating changes (which leave the first sum alone), a truncation, and a buffer labelled with
another bucket, rank or version (a stale one replayed; other keys) change the second. The checksum then fails but
for a small chance, estimated (not proven) at 2^-32 for the least favourable words.

The secret (`new_sync_key`) is drawn once per run by the sync channel's driver and travels with each version's calls
over Ray, never into a file: someone who can change a part's bytes in shared memory but cannot read that secret does
not know any word's key, so cannot pick filler words that bring both sums back. It is not a cryptographic MAC: that
a change goes unnoticed but for about 2^-32 a try is an estimate for sums of this kind, not a proof (a MAC gives 2^-64
or better, proven), and each try that fails stops the sync with an error. Whoever holds the secret can forge any part.
Summed word by word, the checksum is taken in the same pass as the copy on both sides, while each word is in a
register (`native.copy_hash`): the sender while packing, the engine while copying the part out of the transport's
buffer into its own staging copy, the memory the engine writes from. Without the native loop numpy computes the same
sums (`word_sums`), so sender and engine agree whichever each has.

Packing also refuses non-finite values (`NonFiniteWeights`): a diverged step's weights never leave the learner.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Mapping

import numpy as np
import torch

from rlpipe.weightsync import native
from rlpipe.weightsync.errors import NonFiniteWeights, SyncError
from rlpipe.weightsync.layout import Bucket

# Without the native loop, bytes copied and hashed at a time: the chunk just copied is hashed while it is still in a
# core's L2 cache. Rounded down to whole words, so that every chunk but a piece's last starts and ends on the word grid.
CHUNK_BYTES = 1 << 20

_MASK64 = (1 << 64) - 1
_GOLDEN, _MIX = 0x9E3779B97F4A7C15, 0xFF51AFD7ED558CCD
_LOW32 = np.uint64(0xFFFFFFFF)

Sums = tuple[int, int]  # (the words' sum, the keyed products' sum), each modulo 2^64


KEY_BYTES = 16


def new_sync_key() -> bytes:
    """A fresh secret for a run's checksums: drawn by the sync channel, sent with every version over Ray."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"weight sync: the checksum key must be {KEY_BYTES} random bytes (codec.new_sync_key), "
                         f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '-'}")


def part_keys(version: int, bucket: int, rank: int, key: bytes) -> tuple[int, int]:
    """The checksum's seed and odd step for `rank`'s part of `bucket` in `version` under the run's secret `key`: the
    part's identity folded into its hash, and nothing about either known without the secret."""
    check_key(key)
    identity = struct.pack("<4sQQQ", b"rlws", version, bucket, rank)
    seed, step = struct.unpack("<QQ", hashlib.blake2b(identity, key=key, digest_size=16).digest())
    return seed, step | 1


def _mix(x: int) -> int:
    """A bijective 64-bit mix (xorshift, multiply by an odd constant, xorshift) of a Python int."""
    x ^= x >> 32
    x = (x * _MIX) & _MASK64
    return x ^ (x >> 29)


def word_sums(data: np.ndarray, seed: int, step: int, position: int) -> Sums:
    """Over the 8-byte little-endian words of the uint8 array `data` (the last zero-padded), which starts at byte
    `position` of its part: the sum of the words, and the sum of lo32(v) * hi32(v) where v = word ^ (seed +
    (position + 8 i) * step), both modulo 2^64. Additive over spans that start on the word grid: a part is summed
    piece by piece, chunk by chunk."""
    whole = len(data) // 8 * 8
    words = data[:whole].view("<u8").astype(np.uint64)  # a copy: aligned, native order, and free to change in place
    if whole < len(data):
        tail = np.zeros(8, dtype=np.uint8)
        tail[: len(data) - whole] = data[whole:]
        words = np.concatenate([words, tail.view("<u8").astype(np.uint64)])
    keyed = np.arange(len(words), dtype=np.uint64)
    keyed *= np.uint64(8 * step & _MASK64)
    keyed += np.uint64((seed + position * step) & _MASK64)
    keyed ^= words
    products = (keyed & _LOW32) * (keyed >> np.uint64(32))  # numpy's uint64 arithmetic wraps modulo 2^64
    return int(words.sum(dtype=np.uint64)), int(products.sum(dtype=np.uint64))


def _add(a: Sums, b: Sums) -> Sums:
    return (a[0] + b[0]) & _MASK64, (a[1] + b[1]) & _MASK64


def _hash_only(data: np.ndarray, seed: int, step: int, position: int) -> Sums:
    hasher = native.copy_hash()
    if hasher is not None:
        return hasher(data, None, 0, 0, seed, step, position)[0]
    total = (0, 0)
    for start in range(0, len(data), _chunk_bytes()):
        total = _add(total, word_sums(data[start : start + _chunk_bytes()], seed, step, position + start))
    return total


def _chunk_bytes() -> int:
    return max(8, CHUNK_BYTES // 8 * 8)


class PartHash:
    """The checksum of one part, summed a span at a time: `add(sums)` a span's `word_sums` (or `update` its bytes);
    `digest()` mixes the sums with the part's length and seed."""

    def __init__(self, seed: int, step: int, nbytes: int):
        self.seed, self.step, self.nbytes, self.sums = seed, step, nbytes, (0, 0)

    @classmethod
    def of_part(cls, version: int, bucket: Bucket, rank: int, key: bytes) -> PartHash:
        return cls(*part_keys(version, bucket.index, rank, key), bucket.part_bytes(rank))

    def add(self, sums: Sums) -> None:
        self.sums = _add(self.sums, sums)

    def update(self, data: np.ndarray, position: int) -> None:
        """Hash the uint8 array `data`, which lies at byte `position` of the part."""
        self.add(_hash_only(data, self.seed, self.step, position))

    def digest(self) -> int:
        # For given products, a bijection of the words' sum: a single changed word always changes the checksum.
        words, products = self.sums
        return _mix(_mix(_mix((products + self.seed + self.nbytes * _GOLDEN) & _MASK64) ^ words))


def checksum(buffer: np.ndarray, seed: int = 0, step: int = _GOLDEN) -> int:
    """The checksum of `buffer` as one part in one piece (unkeyed unless given a part's `seed` and `step`)."""
    data = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
    hasher = PartHash(seed, step, data.nbytes)
    hasher.update(data, 0)
    return hasher.digest()


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
    *,
    key: bytes,
) -> int:
    """Write `rank`'s pieces of `bucket` into `out` (uint8), casting to `dtype`; returns the checksum (keyed with the
    run's secret `key`, `version`, the bucket and `rank`). `local[name]` is the rank's shard of that tensor: exactly
    the rows the plan assigns it. `out` is the rank's part (part_bytes long), or with `whole_bucket` the buffer every
    rank writes its rows into (bucket.nbytes long, the whole tensors end to end): then the rows go to their place in
    their tensor and the checksum covers just them. Raises `NonFiniteWeights` on a NaN or inf, naming the tensor."""
    copy_hash = native.copy_hash()
    hasher = PartHash.of_part(version, bucket, rank, key)
    exponent = _EXPONENT_BITS.get(dtype, 0)
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
        if source.dtype == dtype and copy_hash is not None:
            # One pass on this thread (torch's copy_ would wake its OpenMP threads, whose spinning takes the cores
            # the receiver needs): each word is read once, hashed and checked, and stored without reading `span`.
            source_bytes = source.view(torch.uint8).numpy()
            sums, suspect = copy_hash(source_bytes, span, dtype.itemsize if exponent else 0, exponent,
                                      hasher.seed, hasher.step, piece.offset)
            hasher.add(sums)
            bad = first_non_finite(source_bytes, dtype) if suspect else None
            if bad is not None:
                _refuse_non_finite(piece.name, bad, rank, version)
            continue
        # Cast (or numpy) a chunk at a time, each hashed and checked as written, while it is in cache.
        target = torch.from_numpy(span).view(dtype)
        step = _chunk_bytes() // dtype.itemsize
        for start in range(0, len(source), step):
            if source.dtype == dtype:  # numpy on this thread, as above
                np.copyto(target[start : start + step].view(torch.uint8).numpy(),
                          source[start : start + step].view(torch.uint8).numpy())
            else:
                target[start : start + step].copy_(source[start : start + step])
            written = span[start * dtype.itemsize : (start + step) * dtype.itemsize]
            hasher.update(written, piece.offset + start * dtype.itemsize)
            bad = first_non_finite(written, dtype)
            if bad is not None:
                _refuse_non_finite(piece.name, start + bad, rank, version)
    return hasher.digest()


def copy_hashed(source: np.ndarray, target: np.ndarray, seed: int, step: int, position: int) -> Sums:
    """Copy the uint8 array `source` into `target` (same length) and return the `word_sums` of what was written
    (`source` lying at byte `position` of its part): in one pass with the native loop, else a chunk at a time, each
    hashed where it now lies while it is in cache."""
    copy_hash = native.copy_hash()
    if copy_hash is not None:
        return copy_hash(source, target, 0, 0, seed, step, position)[0]
    total = (0, 0)
    for start in range(0, len(source), _chunk_bytes()):
        written = target[start : start + _chunk_bytes()]
        np.copyto(written, source[start : start + _chunk_bytes()])
        total = _add(total, word_sums(written, seed, step, position + start))
    return total
