"""A one-pass gather-scatter row copy for host memory, compiled on first use.

Pure torch has no op that reads rows at scattered indices and writes them at other scattered
indices in one pass: a job scattered on both sides costs a gather into a buffer and a scatter
out of it, two passes over the bytes and two dispatches per KV tensor. This module compiles
(once per machine, into a cache folder) a C function that does it in one pass: for each pair
``memcpy(dst + dst_row * row_bytes, src + src_row * row_bytes, row_bytes)`` (one ``memcpy``
per run of pairs consecutive on both sides), the pairs split over a few POSIX threads when
the job is large, and stores that bypass the caches when it is larger than they are. It is
called through ``ctypes`` with the tensors' data pointers, once per job and tensor: never a
Python loop over rows.

Every row index is bounds-checked in C before any byte moves (an out-of-range index returns
an error and copies nothing), so a bad mapping cannot write outside the tensors.

No compiler, a failed build, or ``KVSPEC_NATIVE=0`` in the environment: :func:`available`
is ``False`` and :mod:`kernels.copy` uses its pure-torch strategies. The cache folder is
``$KVSPEC_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/kvoffload-spec``, else
``~/.cache/kvoffload-spec``; the library's name carries a hash of the source and the
compiler command, so an edit rebuilds it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from kernels import toolchain

__all__ = [
    "NativeCopyError",
    "available",
    "copy_byte_rows",
    "copy_rows",
    "library_path",
    "unavailable_reason",
]

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct {
    char *dst;
    const char *src;
    const int64_t *dst_rows;
    const int64_t *src_rows;
    int64_t begin, end, row_bytes, stream;
} kvspec_part;

/* A copy whose stores bypass the caches (x86 non-temporal stores): for jobs larger than the
   caches this saves reading each destination line before writing it. memcpy elsewhere. */
static void kvspec_copy(char *dst, const char *src, int64_t bytes, int64_t stream) {
#if defined(__SSE2__)
    if (stream && ((uintptr_t)dst & 15) == 0) {
        int64_t lines = bytes / 64;
        __m128i *d = (__m128i *)dst;
        const __m128i *s = (const __m128i *)src;
        for (int64_t i = 0; i < lines; ++i) {
            __m128i a = _mm_loadu_si128(s + 4 * i), b = _mm_loadu_si128(s + 4 * i + 1);
            __m128i c = _mm_loadu_si128(s + 4 * i + 2), e = _mm_loadu_si128(s + 4 * i + 3);
            _mm_stream_si128(d + 4 * i, a);
            _mm_stream_si128(d + 4 * i + 1, b);
            _mm_stream_si128(d + 4 * i + 2, c);
            _mm_stream_si128(d + 4 * i + 3, e);
        }
        memcpy(dst + lines * 64, src + lines * 64, (size_t)(bytes - lines * 64));
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, (size_t)bytes);
}

/* Pairs consecutive on both sides (a run) are copied with one memcpy. */
static void *kvspec_copy_part(void *arg) {
    const kvspec_part *p = (const kvspec_part *)arg;
    int64_t i = p->begin;
    while (i < p->end) {
        int64_t j = i + 1;
        while (j < p->end && p->dst_rows[j] == p->dst_rows[j - 1] + 1 &&
               p->src_rows[j] == p->src_rows[j - 1] + 1)
            ++j;
        if (p->stream && j < p->end) {
            /* DRAM-bound: start reading the next run's first page while this one copies
               (the hardware prefetcher cannot guess a scattered row) */
            const char *next = p->src + p->src_rows[j] * p->row_bytes;
            int64_t ahead = p->row_bytes < 4096 ? p->row_bytes : 4096;
            for (int64_t off = 0; off < ahead; off += 64) __builtin_prefetch(next + off, 0, 0);
        }
        kvspec_copy(p->dst + p->dst_rows[i] * p->row_bytes,
                    p->src + p->src_rows[i] * p->row_bytes, (j - i) * p->row_bytes, p->stream);
        i = j;
    }
#if defined(__SSE2__)
    if (p->stream) _mm_sfence();  /* streamed stores are visible before the copy returns */
#endif
    return 0;
}

/* Copy src row src_rows[i] to dst row dst_rows[i] for i < n, rows of row_bytes bytes.
   Returns 0; or -(i + 1) if pair i indexes outside either tensor (nothing is copied then). */
int64_t kvspec_copy_rows(char *dst, int64_t dst_num_rows, const char *src,
                         int64_t src_num_rows, const int64_t *dst_rows,
                         const int64_t *src_rows, int64_t n, int64_t row_bytes,
                         int64_t num_threads, int64_t stream) {
    for (int64_t i = 0; i < n; ++i)
        if (dst_rows[i] < 0 || dst_rows[i] >= dst_num_rows ||
            src_rows[i] < 0 || src_rows[i] >= src_num_rows)
            return -(i + 1);
    if (num_threads > 16) num_threads = 16;
    if (num_threads > n) num_threads = n;
    if (num_threads <= 1) {
        kvspec_part whole = {dst, src, dst_rows, src_rows, 0, n, row_bytes, stream};
        kvspec_copy_part(&whole);
        return 0;
    }
    pthread_t threads[16];
    kvspec_part parts[16];
    int started[16];
    for (int64_t t = 0; t < num_threads; ++t) {
        kvspec_part p = {dst, src, dst_rows, src_rows, n * t / num_threads,
                         n * (t + 1) / num_threads, row_bytes, stream};
        parts[t] = p;
        started[t] = t > 0 && pthread_create(&threads[t], 0, kvspec_copy_part, &parts[t]) == 0;
    }
    kvspec_copy_part(&parts[0]);
    for (int64_t t = 1; t < num_threads; ++t) {
        if (started[t]) pthread_join(threads[t], 0);
        else kvspec_copy_part(&parts[t]);  /* no thread: do that part here */
    }
    return 0;
}
"""

_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread"]
PARALLEL_MIN_BYTES = 4 * 1024 * 1024
"""Jobs (per tensor) of at least this many bytes are split over threads."""
STREAM_MIN_BYTES = 8 * 1024 * 1024
"""Jobs (per tensor) of at least this many bytes write with non-temporal stores (x86): larger
than the caches, where reading each destination line before writing it costs a third of the
traffic; smaller jobs stay in cache, where ordinary stores are faster. Measured on the 2-core
development machine: 4 KiB x 4096 rows +17%, 256 KiB x 256 rows +42%, 4 KiB x 512 rows -18%.
Such jobs also prefetch the next scattered row's first page while copying one (+6 to 18% at
4 KiB x 4096 over streaming alone, medians of 30 interleaved runs)."""


class NativeCopyError(ValueError):
    """A row index outside the tensor it addresses (nothing was copied)."""


def library_path() -> Path | None:
    """Where the compiled library lives (or would), ``None`` without a compiler."""
    return toolchain.library_path("kvspec_native", {"kvspec_native.c": _SOURCE}, _FLAGS)


_reason: str = ""


@functools.cache
def _load() -> ctypes.CDLL | None:
    global _reason
    if os.environ.get("KVSPEC_NATIVE", "1") == "0":
        _reason = "switched off by KVSPEC_NATIVE=0"
        return None
    try:
        lib = ctypes.CDLL(str(toolchain.build("kvspec_native", {"kvspec_native.c": _SOURCE},
                                              _FLAGS, timeout=120)))
    except toolchain.NoCompiler as exc:
        _reason = str(exc)
        return None
    except (toolchain.ToolchainError, OSError) as exc:
        _reason = f"build or load failed: {exc}"
        return None
    fn = lib.kvspec_copy_rows
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64]
    return lib


def _library() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"native copy unavailable: {_reason}")
    return lib


def available() -> bool:
    """Whether the compiled copy can be used (built on first call)."""
    return _load() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is ``False`` (empty when it is ``True``)."""
    _load()
    return _reason


def copy_rows(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
              src_rows: torch.Tensor, num_threads: int | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for all ``i``, in one pass.

    ``dst`` and ``src``: contiguous 2-D CPU tensors with rows of the same byte size (any
    dtype); ``dst_rows`` / ``src_rows``: contiguous 1-D int64 CPU tensors of equal length.
    ``num_threads``: default torch's intra-op thread count, used for jobs of at least
    :data:`PARALLEL_MIN_BYTES`. Raises :class:`NativeCopyError` naming the first pair out of
    range (nothing copied), ``RuntimeError`` if the library is unavailable.
    """
    lib = _library()
    for t in (dst, src):
        if t.device.type != "cpu" or t.dim() != 2 or not t.is_contiguous():
            raise ValueError("native copy needs contiguous 2-D CPU tensors")
    row_bytes = int(dst.shape[1]) * dst.element_size()
    if int(src.shape[1]) * src.element_size() != row_bytes:
        raise ValueError("source and destination rows differ in size")
    for idx in (dst_rows, src_rows):
        if idx.dtype != torch.int64 or idx.dim() != 1 or not idx.is_contiguous() or \
                idx.device.type != "cpu":
            raise ValueError("row indices must be contiguous 1-D int64 CPU tensors")
    n = int(dst_rows.shape[0])
    if int(src_rows.shape[0]) != n:
        raise ValueError("row index tensors differ in length")
    _call(lib, dst, src, dst_rows, src_rows, n, row_bytes, num_threads)


def copy_byte_rows(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
                   src_rows: torch.Tensor) -> None:
    """:func:`copy_rows` for callers that already hold valid arguments: contiguous ``int8``
    2-D tensors of equal row size, and contiguous 1-D int64 index tensors of equal length
    (:mod:`kernels.copy` guarantees this). Row ranges are still checked, in C."""
    lib = _library()
    _call(lib, dst, src, dst_rows, src_rows, dst_rows.shape[0], dst.shape[1], None)


def _call(lib: ctypes.CDLL, dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
          src_rows: torch.Tensor, n: int, row_bytes: int, num_threads: int | None) -> None:
    threads = 1
    if n * row_bytes >= PARALLEL_MIN_BYTES:
        threads = num_threads if num_threads is not None else torch.get_num_threads()
    status = lib.kvspec_copy_rows(dst.data_ptr(), dst.shape[0], src.data_ptr(), src.shape[0],
                                  dst_rows.data_ptr(), src_rows.data_ptr(), n, row_bytes,
                                  max(1, threads), n * row_bytes >= STREAM_MIN_BYTES)
    if status < 0:
        i = -status - 1
        raise NativeCopyError(
            f"row pair {i}: source row {int(src_rows[i])} of {int(src.shape[0])} -> "
            f"destination row {int(dst_rows[i])} of {int(dst.shape[0])} is out of range; "
            "nothing was copied")
