"""Copy-and-check in one pass, in C, compiled on first use with this host's C compiler.

Packing a bucket part is most of a sync's cost on the sender. In numpy the copy and the check for NaN and inf are two
passes, and the copy's stores go through the cache, which first reads every destination line. This loop reads each
source word once, checks its floats' exponent bits and writes it with a streaming store that skips that read, which
beats numpy's copy alone and torch's multi-threaded one (docs/benchmarks.md). The checksum (XXH3, codec.py) is taken
over each chunk just before it is copied, while the chunk is in cache.

The compiler is the one torch's inductor already needs on CPU; the library is built once per source and machine
under `$RLPIPE_CACHE/native`. Without a compiler (or with `RLPIPE_NATIVE=0`) `copy_check()` returns None and
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

# copy_check(src, dst, n, width, mask): copy n bytes; return 1 when some value among them, read as floats of `width`
# bytes (2, 4 or 8; 0: no check) whose exponent bits are `mask`, has all of them set (inf or NaN), else 0. The values
# start at src; the streaming stores need dst 32-byte aligned past a head that is a whole number of values (numpy,
# shared memory and Ray buffers, and the plan's pieces, all give that), else the loop stores through the cache.
_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static int scalar_non_finite(const uint8_t *p, size_t n, int width, uint64_t mask) {
    int bad = 0;
    if (width == 0) return 0;
    for (size_t i = 0; i + (size_t)width <= n; i += (size_t)width) {
        uint64_t value = 0;
        memcpy(&value, p + i, (size_t)width);
        bad |= (value & mask) == mask;
    }
    return bad;
}

#ifdef __cplusplus
extern "C"
#endif
int copy_check(const uint8_t *src, uint8_t *dst, size_t n, int width, uint64_t mask) {
    int bad = 0;
    size_t i = 0;
#if defined(__AVX2__)
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    int streaming = width == 0 || head % (size_t)width == 0;
    if (!streaming) head = 0;
    if (head > n) head = n;
    memcpy(dst, src, head);
    bad |= scalar_non_finite(src, head, width, mask);
    i = head;
    __m256i exponent = width == 2 ? _mm256_set1_epi16((short)mask)
                     : width == 4 ? _mm256_set1_epi32((int)mask) : _mm256_set1_epi64x((long long)mask);
    __m256i seen = _mm256_setzero_si256();
    for (; i + 64 <= n; i += 64) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i y = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        if (streaming) {
            _mm256_stream_si256((__m256i *)(dst + i), x);
            _mm256_stream_si256((__m256i *)(dst + i + 32), y);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + i), x);
            _mm256_storeu_si256((__m256i *)(dst + i + 32), y);
        }
        __m256i ex = _mm256_and_si256(x, exponent), ey = _mm256_and_si256(y, exponent);
        if (width == 2)
            seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi16(ex, exponent), _mm256_cmpeq_epi16(ey, exponent)));
        else if (width == 4)
            seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi32(ex, exponent), _mm256_cmpeq_epi32(ey, exponent)));
        else if (width == 8)
            seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi64(ex, exponent), _mm256_cmpeq_epi64(ey, exponent)));
    }
    _mm_sfence();
    bad |= !_mm256_testz_si256(seen, seen);
#endif
    memcpy(dst + i, src + i, n - i);
    return bad | scalar_non_finite(src + i, n - i, width, mask);
}
"""

CopyCheck = Callable[[np.ndarray, np.ndarray, int, int], bool]


def _cache_dir() -> Path:
    from rlpipe.models.builtin import cache_dir

    return cache_dir() / "native"


def _build(compiler: str) -> Path:
    flags = ["-O3", "-shared", "-fPIC"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *flags, platform.machine(), platform.node()]).encode())
    library = _cache_dir() / f"copy_check-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        source = Path(scratch) / "copy_check.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / library.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built)], check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: processes building at once each publish a whole library
    return library


@functools.cache
def copy_check() -> CopyCheck | None:
    """`fn(source, target, width, mask) -> bool`: copy the uint8 array `source` into `target` (same length) and say
    whether some value among them, read as floats of `width` bytes whose exponent bits are `mask`, is inf or NaN
    (width 0: copy only); None where no C compiler is available."""
    if os.environ.get("RLPIPE_NATIVE", "1") == "0":
        return None
    compiler = next(filter(None, map(shutil.which, [os.environ.get("CC", "cc"), "gcc", "clang", "g++"])), None)
    if compiler is None:
        return None
    try:
        function = ctypes.CDLL(str(_build(compiler))).copy_check
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"weight sync: building the copy-and-check loop failed ({error}; "
                      f"{detail.decode(errors='replace').strip()[:200]}); packing uses numpy", stacklevel=2)
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64]

    def run(source: np.ndarray, target: np.ndarray, width: int, mask: int) -> bool:
        if source.nbytes != target.nbytes or not (source.flags.c_contiguous and target.flags.c_contiguous):
            raise ValueError("copy_check needs two contiguous arrays of the same size")
        return bool(function(source.ctypes.data, target.ctypes.data, source.nbytes, width, mask))

    return run
