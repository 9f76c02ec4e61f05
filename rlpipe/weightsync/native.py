"""Copy-and-checksum in one pass, in C, compiled on first use with this host's C compiler.

Packing a bucket part is most of a sync's cost on the sender. In numpy it is two passes (copy a chunk, then sum it
while it is in cache) and the copy's stores go through the cache, which first reads every destination line. This
loop reads each source word once, adds it to the checksum and writes it with a streaming store that skips that read,
which beats numpy's copy alone and torch's multi-threaded one (docs/benchmarks.md). The result equals
`codec.checksum`'s arithmetic exactly, so either side may use either path.

The compiler is the one torch's inductor already needs on CPU; the library is built once per source and machine
under `$RLPIPE_CACHE/native`. Without a compiler (or with `RLPIPE_NATIVE=0`) `copy_checksum()` returns None and
the codec uses numpy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

# copy_checksum(src, dst, n, position): copy n bytes and return the sum (mod 2^64) of every byte shifted into its
# place in a little-endian 64-bit word, where byte i sits at `position + i` in the part: over a whole part that is
# the sum of the part's 64-bit words. Works for any position; the fast body needs (dst - position) 8-aligned,
# which holds whenever the part's buffer starts 8-aligned (numpy, shared memory and Ray buffers all do).
_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static uint64_t bytes_sum(const uint8_t *src, uint8_t *dst, size_t n, size_t position) {
    uint64_t acc = 0;
    for (size_t i = 0; i < n; i++) {
        dst[i] = src[i];
        acc += (uint64_t)src[i] << (8 * ((position + i) & 7));
    }
    return acc;
}

#ifdef __cplusplus
extern "C"
#endif
uint64_t copy_checksum(const uint8_t *src, uint8_t *dst, size_t n, size_t position) {
    if ((((uintptr_t)dst - position) & 7) != 0) return bytes_sum(src, dst, n, position);
    /* head: up to the first 64-byte aligned destination address */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    uint64_t acc = bytes_sum(src, dst, head, position);
    src += head; dst += head; n -= head; position += head;
    size_t body = n & ~(size_t)63;
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 128 <= body; i += 128) {
        __m512i x = _mm512_loadu_si512((const void *)(src + i));
        __m512i y = _mm512_loadu_si512((const void *)(src + i + 64));
        _mm512_stream_si512((__m512i *)(dst + i), x);
        _mm512_stream_si512((__m512i *)(dst + i + 64), y);
        a0 = _mm512_add_epi64(a0, x);
        a1 = _mm512_add_epi64(a1, y);
    }
    for (; i < body; i += 64) {
        __m512i x = _mm512_loadu_si512((const void *)(src + i));
        _mm512_stream_si512((__m512i *)(dst + i), x);
        a0 = _mm512_add_epi64(a0, x);
    }
    acc += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
    _mm_sfence();
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (size_t i = 0; i < body; i += 64) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i y = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), x);
        _mm256_stream_si256((__m256i *)(dst + i + 32), y);
        a0 = _mm256_add_epi64(a0, x);
        a1 = _mm256_add_epi64(a1, y);
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a0, a1));
    acc += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    _mm_sfence();
#else
    for (size_t i = 0; i < body; i += 8) {
        uint64_t word;
        memcpy(&word, src + i, 8);
        memcpy(dst + i, &word, 8);
        acc += word;
    }
#endif
    return acc + bytes_sum(src + body, dst + body, n - body, position + body);
}
"""

CopyChecksum = Callable[[np.ndarray, np.ndarray, int], int]


def _cache_dir() -> Path:
    from rlpipe.models.builtin import cache_dir

    return cache_dir() / "native"


def _build(compiler: str) -> Path:
    flags = ["-O3", "-shared", "-fPIC"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags, platform.machine(), platform.node()]).encode())
    library = _cache_dir() / f"copy_checksum-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        source = Path(scratch) / "copy_checksum.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / library.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: processes building at once each publish a whole library
    return library


@functools.cache
def copy_checksum() -> CopyChecksum | None:
    """`fn(source, target, position) -> int`: copy the uint8 array `source` into `target` (same length) and
    return its checksum contribution at `position` in the part; None where no C compiler is available."""
    if os.environ.get("RLPIPE_NATIVE", "1") == "0":
        return None
    compiler = next(filter(None, map(shutil.which, [os.environ.get("CC", "cc"), "gcc", "clang", "g++"])), None)
    if compiler is None:
        return None
    try:
        function = ctypes.CDLL(str(_build(compiler))).copy_checksum
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"weight sync: building the copy-and-checksum loop failed ({error}; "
                      f"{detail.decode(errors='replace').strip()[:200]}); packing uses numpy", stacklevel=2)
        return None
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    def run(source: np.ndarray, target: np.ndarray, position: int) -> int:
        if source.nbytes != target.nbytes or not (source.flags.c_contiguous and target.flags.c_contiguous):
            raise ValueError("copy_checksum needs two contiguous arrays of the same size")
        return function(source.ctypes.data, target.ctypes.data, source.nbytes, position)

    return run
