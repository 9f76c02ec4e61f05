"""Copy, check and hash in one pass, in C, compiled on first use with this host's C compiler.

Packing a bucket part is most of a sync's cost on the sender, and copying it into the engine's staging memory most
of the engine's. In numpy the copy, the check for NaN and inf and the checksum are separate passes, and the copy's
stores go through the cache, which first reads every destination line. This loop reads each source word once, hashes
it and checks its floats' exponent bits while it is in a register, and writes it with a streaming store that skips
that read. The hash is the one of codec.py (`word_sums`), which computes the same value with numpy where this
loop is not available.

The compiler is the one torch's inductor already needs on CPU; the library is built once per source and machine
under `$RLPIPE_CACHE/native`, and loaded from there only where no one else could have put it there (the file and the
folders above it this user's, writable by no one else: rlpipe/models/builtin.py's `cache_problem`); elsewhere it
is built again in a private folder for this process. Without a compiler (or with `RLPIPE_NATIVE=0`)
`copy_hash()` returns None and the codec uses numpy.
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

# copy_hash(src, dst, n, width, mask, seed, step, position, sums): copy n bytes from src to dst (dst NULL: hash only)
# and add to sums[0] the sum mod 2^64 of the 8-byte words of src (the last zero-padded), to sums[1] that of
# lo32(v) * hi32(v) where v = word ^ (seed + (position + offset of the word) * step): codec.py's word sums, whose seed
# and step are secret to the run. Returns 1 when some value, read as floats of `width` bytes (2, 4 or 8; 0: no check)
# whose exponent bits are `mask`, has all of them set (inf or NaN), else 0. Streaming stores need dst aligned past a
# head of whole words (numpy, torch, shared memory and Ray buffers, and the plan's pieces, all give that), else the loop
# stores through the cache.
_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static int word_non_finite(uint64_t word, int width, uint64_t mask) {
    int bad = 0;
    if (width == 0) return 0;
    for (int shift = 0; shift < 64; shift += 8 * width) bad |= ((word >> shift) & mask) == mask;
    return bad;
}

/* Whole or partial (the last, zero-padded) words of [i, end): summed, checked, copied. */
static void scalar_words(const uint8_t *src, uint8_t *dst, size_t i, size_t end, int width, uint64_t mask,
                         uint64_t seed, uint64_t step, uint64_t position, uint64_t *sums, int *bad) {
    for (; i < end; i += 8) {
        size_t length = end - i < 8 ? end - i : 8;
        uint64_t word = 0;
        memcpy(&word, src + i, length);
        if (dst) memcpy(dst + i, src + i, length);
        uint64_t keyed = word ^ (seed + (position + i) * step);
        sums[0] += word;
        sums[1] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
        *bad |= word_non_finite(word, width, mask);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define WIDE 1
#endif

#ifdef __cplusplus
extern "C"
#endif
int copy_hash(const uint8_t *src, uint8_t *dst, size_t n, int width, uint64_t mask, uint64_t seed, uint64_t step,
              uint64_t position, uint64_t *sums) {
    int bad = 0;
    size_t i = 0;
#if defined(WIDE)
    /* 64 bytes a step in one 512-bit register. */
    size_t head = dst ? (64 - ((uintptr_t)dst & 63)) & 63 : 0;
    int streaming = dst != NULL && head % 8 == 0;
    if (!streaming) head = 0;
    if (head + 64 <= n) {
        scalar_words(src, dst, 0, head, width, mask, seed, step, position, sums, &bad);
        i = head;
        __m512i exponent = width == 2 ? _mm512_set1_epi16((short)mask)
                         : width == 4 ? _mm512_set1_epi32((int)mask) : _mm512_set1_epi64((long long)mask);
        __m512i words = _mm512_setzero_si512(), products = _mm512_setzero_si512();
        uint64_t key = seed + (position + i) * step;
        __m512i keys = _mm512_set_epi64((long long)(key + 56 * step), (long long)(key + 48 * step),
                                        (long long)(key + 40 * step), (long long)(key + 32 * step),
                                        (long long)(key + 24 * step), (long long)(key + 16 * step),
                                        (long long)(key + 8 * step), (long long)key);
        __m512i stride = _mm512_set1_epi64((long long)(64 * step));
        uint64_t seen = 0;
        for (; i + 64 <= n; i += 64) {
            __m512i x = _mm512_loadu_si512((const void *)(src + i));
            if (streaming)
                _mm512_stream_si512((void *)(dst + i), x);
            else if (dst)
                _mm512_storeu_si512((void *)(dst + i), x);
            __m512i keyed = _mm512_xor_si512(x, keys);
            products = _mm512_add_epi64(products, _mm512_mul_epu32(keyed, _mm512_srli_epi64(keyed, 32)));
            words = _mm512_add_epi64(words, x);
            keys = _mm512_add_epi64(keys, stride);
            __m512i ex = _mm512_and_si512(x, exponent);
            if (width == 2) seen |= _mm512_cmpeq_epi16_mask(ex, exponent);
            else if (width == 4) seen |= _mm512_cmpeq_epi32_mask(ex, exponent);
            else if (width == 8) seen |= _mm512_cmpeq_epi64_mask(ex, exponent);
        }
        if (streaming) _mm_sfence();
        bad |= seen != 0;
        sums[0] += (uint64_t)_mm512_reduce_add_epi64(words);
        sums[1] += (uint64_t)_mm512_reduce_add_epi64(products);
    }
#elif defined(__AVX2__)
    size_t head = dst ? (32 - ((uintptr_t)dst & 31)) & 31 : 0;
    int streaming = dst != NULL && head % 8 == 0;
    if (!streaming) head = 0;
    if (head + 64 <= n) {
        scalar_words(src, dst, 0, head, width, mask, seed, step, position, sums, &bad);
        i = head;
        __m256i exponent = width == 2 ? _mm256_set1_epi16((short)mask)
                         : width == 4 ? _mm256_set1_epi32((int)mask) : _mm256_set1_epi64x((long long)mask);
        __m256i seen = _mm256_setzero_si256(), words = _mm256_setzero_si256(), products = _mm256_setzero_si256();
        uint64_t key = seed + (position + i) * step;
        __m256i keys_x = _mm256_set_epi64x((long long)(key + 24 * step), (long long)(key + 16 * step),
                                           (long long)(key + 8 * step), (long long)key);
        __m256i half = _mm256_set1_epi64x((long long)(32 * step));
        __m256i stride = _mm256_set1_epi64x((long long)(64 * step));
        for (; i + 64 <= n; i += 64) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i y = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            if (streaming) {
                _mm256_stream_si256((__m256i *)(dst + i), x);
                _mm256_stream_si256((__m256i *)(dst + i + 32), y);
            } else if (dst) {
                _mm256_storeu_si256((__m256i *)(dst + i), x);
                _mm256_storeu_si256((__m256i *)(dst + i + 32), y);
            }
            __m256i kx = _mm256_xor_si256(x, keys_x), ky = _mm256_xor_si256(y, _mm256_add_epi64(keys_x, half));
            products = _mm256_add_epi64(products, _mm256_mul_epu32(kx, _mm256_srli_epi64(kx, 32)));
            products = _mm256_add_epi64(products, _mm256_mul_epu32(ky, _mm256_srli_epi64(ky, 32)));
            words = _mm256_add_epi64(words, _mm256_add_epi64(x, y));
            keys_x = _mm256_add_epi64(keys_x, stride);
            if (width) {
                __m256i ex = _mm256_and_si256(x, exponent), ey = _mm256_and_si256(y, exponent);
                if (width == 2)
                    seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi16(ex, exponent), _mm256_cmpeq_epi16(ey, exponent)));
                else if (width == 4)
                    seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi32(ex, exponent), _mm256_cmpeq_epi32(ey, exponent)));
                else
                    seen = _mm256_or_si256(seen, _mm256_or_si256(_mm256_cmpeq_epi64(ex, exponent), _mm256_cmpeq_epi64(ey, exponent)));
            }
        }
        if (streaming) _mm_sfence();
        bad |= !_mm256_testz_si256(seen, seen);
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, words);
        sums[0] += lanes[0] + lanes[1] + lanes[2] + lanes[3];
        _mm256_storeu_si256((__m256i *)lanes, products);
        sums[1] += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
#endif
    scalar_words(src, dst, i, n, width, mask, seed, step, position, sums, &bad);
    return bad;
}
"""

# (source, target or None, width, mask, seed, step, position) -> ((word sum, product sum), whether some value is inf
# or NaN)
CopyHash = Callable[[np.ndarray, "np.ndarray | None", int, int, int, int, int], tuple[tuple[int, int], bool]]
_MASK64 = (1 << 64) - 1


def _compiler() -> str | None:
    return next(filter(None, map(shutil.which, [os.environ.get("CC", "cc"), "gcc", "clang", "g++"])), None)


_FLAGS = ["-O3", "-shared", "-fPIC"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])


def library_path(compiler: str) -> Path:
    """Where the cache keeps the library this source, compiler and machine build."""
    from rlpipe.models.builtin import cache_dir

    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, platform.machine(), platform.node()]).encode())
    return cache_dir() / "native" / f"copy_hash-{key.hexdigest()[:16]}.so"


def _load(compiler: str) -> ctypes.CDLL:
    """The library from the cache, built there first where missing; built in a private folder where the cache
    cannot be taken as this user's own (cache_problem)."""
    from rlpipe.models.builtin import cache_problem, make_cache_folder

    library = library_path(compiler)
    make_cache_folder(library.parent)
    problem = cache_problem(library.parent)
    if problem is None:
        if library.exists() and cache_problem(library) is None:
            return ctypes.CDLL(str(library))
        _build(compiler, library)  # replaces a library this user cannot vouch for, in a folder that is its own
        return ctypes.CDLL(str(library))
    warnings.warn(f"weight sync: {problem}; the copy-and-hash loop is built in a private folder instead of the "
                  "cache", stacklevel=3)
    with tempfile.TemporaryDirectory(prefix="rlpipe-native-") as private:  # 0700; loaded, the file may go
        return ctypes.CDLL(str(_build(compiler, Path(private) / library.name)))


def _build(compiler: str, library: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        source = Path(scratch) / "copy_hash.c"
        source.write_text(_SOURCE)
        built = Path(scratch) / library.name
        subprocess.run([compiler, *_FLAGS, str(source), "-o", str(built)], check=True, capture_output=True,
                       timeout=120)
        built.chmod(0o755)  # whatever the umask: writable by this user alone
        os.replace(built, library)  # atomic: processes building at once each publish a whole library
    return library


@functools.cache
def copy_hash() -> CopyHash | None:
    """`fn(source, target, width, mask, seed, step, position) -> (sums, non_finite)`: copy the uint8 array `source`
    into `target` (same length; None: hash only), return its word sums (codec.word_sums: `seed` and `step`, and
    `source` starting at byte `position` of its part) and whether some value, read as floats of `width` bytes whose
    exponent bits are `mask`, is inf or NaN (width 0: no check); None where no C compiler is available."""
    if os.environ.get("RLPIPE_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        function = _load(compiler).copy_hash
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        warnings.warn(f"weight sync: building the copy-and-hash loop failed ({error}; "
                      f"{detail.decode(errors='replace').strip()[:200]}); packing and staging use numpy", stacklevel=2)
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64,
                         ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]

    def run(source: np.ndarray, target: np.ndarray | None, width: int, mask: int, seed: int, step: int,
            position: int) -> tuple[tuple[int, int], bool]:
        if not source.flags.c_contiguous or (target is not None and (
                target.nbytes != source.nbytes or not target.flags.c_contiguous)):
            raise ValueError("copy_hash needs contiguous arrays of the same size")
        sums = (ctypes.c_uint64 * 2)(0, 0)
        bad = function(source.ctypes.data, None if target is None else target.ctypes.data, source.nbytes, width,
                       mask, seed & _MASK64, step & _MASK64, position & _MASK64, sums)
        return (int(sums[0]), int(sums[1])), bool(bad)

    return run
