"""A one-pass gather-scatter row copy for host memory, compiled on first use.

Pure torch has no op that reads rows at scattered indices and writes them at other scattered
indices in one pass: a job scattered on both sides costs a gather into a buffer and a scatter
out of it, two passes over the bytes and two dispatches per KV tensor. This module compiles
(once per machine, into a cache folder) a C function that does it in one pass: for each pair
``memcpy(dst + dst_row * row_bytes, src + src_row * row_bytes, row_bytes)`` (one ``memcpy``
per run of pairs consecutive on both sides), the job split over the process's OpenMP threads
when it is large (torch's own pool: libgomp is loaded once per process, so a job never
competes with torch's workers for the cores; serial where the compiler has no OpenMP, and in
a forked child, where GNU OpenMP cannot run), and stores that bypass the caches when it is
larger than they are. It is
called through ``ctypes`` once per job for all of a worker's KV tensors (:class:`TensorPairs`,
the pointers and row sizes planned once): never a Python loop over rows or tensors.

The same library builds a batched copy's descriptors (:func:`descriptors`: addresses only,
so the tensors may be device memory; a 64-tensor job in one call, about 4x faster than
tensor ops here) and runs them on the host (:func:`copy_descriptors`).

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
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels import toolchain
from kernels.layout import RowIds, check_tensor_pairs, row_buffer

__all__ = [
    "AddressPlan",
    "NativeCopyError",
    "TensorPairs",
    "available",
    "copy_byte_rows",
    "copy_descriptors",
    "copy_rows",
    "descriptors",
    "library_path",
    "unavailable_reason",
]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>
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

/* One thread's share of a job: a pair range of a range of tensors. */
typedef struct {
    char *const *dst;
    const char *const *src;
    const int64_t *row_bytes;
    int64_t num_tensors;
    const int64_t *dst_rows;
    const int64_t *src_rows;
    int64_t begin, end, stream;
} kvspec_share;

static void *kvspec_copy_share(void *arg) {
    const kvspec_share *s = (const kvspec_share *)arg;
    for (int64_t t = 0; t < s->num_tensors; ++t) {
        kvspec_part p = {s->dst[t], s->src[t], s->dst_rows, s->src_rows, s->begin, s->end,
                         s->row_bytes[t], s->stream};
        kvspec_copy_part(&p);
    }
    return 0;
}

#define KVSPEC_MAX_THREADS 16

/* GNU OpenMP cannot run a parallel region in a forked child of a process that ran one (the
   child hangs; torch's own ops too): in any process but the one that loaded this library,
   jobs run serially. */
static pid_t kvspec_loader_pid;
__attribute__((constructor)) static void kvspec_remember_loader(void) {
    kvspec_loader_pid = getpid();
}

/* A whole job in one call: for each of num_tensors tensor pairs (dst[t], src[t], rows of
   row_bytes[t] bytes; every destination tensor has dst_num_rows rows, every source tensor
   src_num_rows), copy src row src_rows[i] to dst row dst_rows[i] for i < n. The pairs are
   checked once for all tensors before any byte moves. Returns 0; or -(i + 1) if pair i
   indexes outside the tensors (nothing is copied then). */
int64_t kvspec_copy_job(int64_t num_tensors, char *const *dst, const char *const *src,
                        const int64_t *row_bytes, int64_t dst_num_rows, int64_t src_num_rows,
                        const int64_t *dst_rows, const int64_t *src_rows, int64_t n,
                        int64_t num_threads, int64_t stream) {
    for (int64_t i = 0; i < n; ++i)
        if (dst_rows[i] < 0 || dst_rows[i] >= dst_num_rows ||
            src_rows[i] < 0 || src_rows[i] >= src_num_rows)
            return -(i + 1);
    if (num_threads > KVSPEC_MAX_THREADS) num_threads = KVSPEC_MAX_THREADS;
    /* as many threads as there are tensors or pairs to share out, whichever is more */
    if (num_threads > n && num_threads > num_tensors)
        num_threads = n > num_tensors ? n : num_tensors;
    if (num_threads < 1 || getpid() != kvspec_loader_pid) num_threads = 1;
    kvspec_share shares[KVSPEC_MAX_THREADS];
    for (int64_t t = 0; t < num_threads; ++t) {
        if (num_tensors >= num_threads) {  /* each thread a share of the tensors, all pairs */
            int64_t a = num_tensors * t / num_threads, b = num_tensors * (t + 1) / num_threads;
            kvspec_share s = {dst + a, src + a, row_bytes + a, b - a, dst_rows, src_rows,
                              0, n, stream};
            shares[t] = s;
        } else {  /* each thread a share of the pairs, every tensor */
            kvspec_share s = {dst, src, row_bytes, num_tensors, dst_rows, src_rows,
                              n * t / num_threads, n * (t + 1) / num_threads, stream};
            shares[t] = s;
        }
    }
    /* With OpenMP, on the process's one OpenMP pool: torch's (libgomp is loaded once), so a
       job never competes with torch's own workers for the cores. Without it: serially. */
#if defined(_OPENMP)
#pragma omp parallel for num_threads(num_threads) schedule(static, 1) if (num_threads > 1)
#endif
    for (int64_t t = 0; t < num_threads; ++t) kvspec_copy_share(&shares[t]);
    return 0;
}

/* A job's tensors, planned once (TensorPairs): kvspec_copy_job's first six arguments. */
typedef struct {
    int64_t num_tensors;
    char *const *dst;
    const char *const *src;
    const int64_t *row_bytes;
    int64_t dst_num_rows, src_num_rows;
} kvspec_plan;

int64_t kvspec_copy_planned(const kvspec_plan *p, const int64_t *dst_rows,
                            const int64_t *src_rows, int64_t n, int64_t num_threads,
                            int64_t stream) {
    return kvspec_copy_job(p->num_tensors, p->dst, p->src, p->row_bytes, p->dst_num_rows,
                           p->src_num_rows, dst_rows, src_rows, n, num_threads, stream);
}

/* A job's copies as descriptors over a plan's tensors (addresses only: the tensors may be in
   device memory, nothing is dereferenced), tensor by tensor: one per run of rows consecutive
   on both sides when merge is set, else one per row. With check set, every row is checked
   against the tensors first. Returns the number of descriptors written (at most
   num_tensors * n); or -(i + 1) if pair i indexes outside the tensors (nothing written). */
int64_t kvspec_descriptors(const kvspec_plan *p, const int64_t *dst_rows,
                           const int64_t *src_rows, int64_t n, int64_t merge, int64_t check,
                           int64_t *out_dst, int64_t *out_src, int64_t *out_sizes) {
    if (check)
        for (int64_t i = 0; i < n; ++i)
            if (dst_rows[i] < 0 || dst_rows[i] >= p->dst_num_rows ||
                src_rows[i] < 0 || src_rows[i] >= p->src_num_rows)
                return -(i + 1);
    int64_t k = 0;
    for (int64_t t = 0; t < p->num_tensors; ++t) {
        const int64_t rb = p->row_bytes[t];
        const int64_t dst = (int64_t)(intptr_t)p->dst[t], src = (int64_t)(intptr_t)p->src[t];
        int64_t i = 0;
        while (i < n) {
            int64_t j = i + 1;
            if (merge)
                while (j < n && dst_rows[j] == dst_rows[j - 1] + 1 &&
                       src_rows[j] == src_rows[j - 1] + 1)
                    ++j;
            out_dst[k] = dst + dst_rows[i] * rb;
            out_src[k] = src + src_rows[i] * rb;
            out_sizes[k] = (j - i) * rb;
            ++k;
            i = j;
        }
    }
    return k;
}

/* A batch of descriptors (the form of a batched DMA): sizes[i] bytes from address src[i] to
   address dst[i], for i < n. The caller made every address from checked rows. */
void kvspec_copy_descriptors(int64_t n, const int64_t *dst, const int64_t *src,
                             const int64_t *sizes) {
    for (int64_t i = 0; i < n; ++i)
        memcpy((char *)(intptr_t)dst[i], (const char *)(intptr_t)src[i], (size_t)sizes[i]);
}
"""

_FLAGS = ["-O2", "-shared", "-fPIC", "-fopenmp"]
_SERIAL_FLAGS = ["-O2", "-shared", "-fPIC"]
PARALLEL_MIN_BYTES = 1024 * 1024
"""Jobs of at least this many bytes (over all their tensors) are split over threads. On the
OpenMP pool a split costs little (torch's workers are often still spinning): a vLLM-shaped
store of 2 MiB (one chunk over 64 tensors) gains 1.6x at 1 MiB against the 4 MiB threshold
that per-job thread creation needed."""
STREAM_MIN_BYTES = 16 * 1024 * 1024
"""Jobs of at least this many bytes (over all their tensors) write with non-temporal stores
(x86): their source and destination together outgrow a 32 MiB last-level cache, where
reading each destination line before writing it costs a third of the traffic; smaller jobs
stay in cache, where ordinary stores are faster. Measured on the 2-core development machine:
4 KiB x 4096 rows (16 MiB) +17%, 256 KiB x 256 rows (64 MiB) +42%; 4 KiB x 512 rows (2 MiB)
-18%, and a vLLM-shaped store of 8 MiB (4 chunks over 64 tensors of 32 KiB pages) -48%. Such
jobs also prefetch the next scattered row's first page while copying one (+6 to 18% at
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
    lib = None
    for flags in (_FLAGS, _SERIAL_FLAGS):  # without OpenMP (no libgomp): serial jobs
        try:
            lib = ctypes.CDLL(str(toolchain.build("kvspec_native", {"kvspec_native.c": _SOURCE},
                                                  flags, timeout=120)))
            break
        except toolchain.NoCompiler as exc:
            _reason = str(exc)
            return None
        except (toolchain.ToolchainError, OSError) as exc:
            _reason = f"build or load failed: {exc}"
    if lib is None:
        return None
    planned = lib.kvspec_copy_planned
    planned.restype = ctypes.c_int64
    planned.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_int64]
    made = lib.kvspec_descriptors
    made.restype = ctypes.c_int64
    made.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p]
    batch = lib.kvspec_copy_descriptors
    batch.restype = None
    batch.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
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


class _Plan(ctypes.Structure):
    """``kvspec_plan``: a job's tensors as the C copy takes them."""

    _fields_ = [("num_tensors", ctypes.c_int64), ("dst", ctypes.c_void_p),
                ("src", ctypes.c_void_p), ("row_bytes", ctypes.c_void_p),
                ("dst_num_rows", ctypes.c_int64), ("src_num_rows", ctypes.c_int64)]


class AddressPlan:
    """Tensors' base addresses and row sizes for :func:`descriptors` (any device: only
    addresses are computed). The tensors must outlive the plan."""

    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor],
                 row_bytes: Sequence[int]) -> None:
        n = len(dst)
        self._dst = (ctypes.c_void_p * n)(*(t.data_ptr() for t in dst))
        self._src = (ctypes.c_void_p * n)(*(t.data_ptr() for t in src))
        self._row_bytes = (ctypes.c_int64 * n)(*row_bytes)
        self.num_tensors = n
        self.dst_num_rows, self.src_num_rows = int(dst[0].shape[0]), int(src[0].shape[0])
        self._plan = _Plan(n, ctypes.addressof(self._dst), ctypes.addressof(self._src),
                           ctypes.addressof(self._row_bytes), self.dst_num_rows,
                           self.src_num_rows)
        self.address = ctypes.addressof(self._plan)


def descriptors(plan: AddressPlan, dst_rows: RowIds, src_rows: RowIds,
                merge: bool, check: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A job's descriptors over ``plan`` in one call: ``(dst, src, sizes)``, contiguous int64
    (see ``kvspec_descriptors``); the row indices are contiguous 1-D int64 tensors or arrays
    of one length. Raises :class:`NativeCopyError` naming the first row out of range when ``check``
    (no descriptor is made)."""
    dst_address, n = row_buffer(dst_rows)
    most = plan.num_tensors * n
    out = torch.empty(3, most, dtype=torch.int64)
    base = out.data_ptr()
    count = _library().kvspec_descriptors(
        plan.address, dst_address, row_buffer(src_rows)[0], n, merge, check,
        base, base + 8 * most, base + 16 * most)
    if count < 0:
        i = -count - 1
        raise NativeCopyError(
            f"row pair {i}: source row {int(src_rows[i])} of {plan.src_num_rows} -> "
            f"destination row {int(dst_rows[i])} of {plan.dst_num_rows} is out of range; "
            "no descriptor was made")
    dst, src, sizes = out[:, :count].unbind()
    return dst, src, sizes


class TensorPairs:
    """A job's plan, made once per worker and direction: the (destination, source) tensor
    pairs of every KV tensor, their data pointers and row sizes in C arrays. A job is then one
    call (:meth:`copy`) whatever the number of tensors: no Python work per tensor or per row.

    Every tensor is a contiguous 2-D CPU tensor; each pair shares its row size in bytes; all
    destinations have the same number of rows, and all sources (the layout of
    :mod:`kernels.layout`: every KV tensor has the same blocks and chunks). The tensors must
    outlive the plan (it keeps references to them)."""

    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        sizes = check_tensor_pairs(dst, src, "the native copy", host_only=True)
        self._tensors = (tuple(dst), tuple(src))
        self._addresses = AddressPlan(dst, src, sizes)
        self.num_tensors = len(dst)
        self.pair_bytes = sum(sizes)
        """Bytes one row pair moves over all tensors."""
        self.dst_num_rows, self.src_num_rows = int(dst[0].shape[0]), int(src[0].shape[0])

    def copy(self, dst_rows: RowIds, src_rows: RowIds, num_threads: int | None = None) -> None:
        """Every tensor's ``dst[dst_rows[i]] = src[src_rows[i]]`` in one call. The indices
        are contiguous 1-D int64 CPU tensors or ``array('q')``s of equal length (not checked
        here: the callers build them so); their ranges are checked in C, before any byte
        moves."""
        dst_address, n = row_buffer(dst_rows)
        nbytes = n * self.pair_bytes
        threads = 1
        if nbytes >= PARALLEL_MIN_BYTES:
            threads = num_threads if num_threads is not None else torch.get_num_threads()
        status = _library().kvspec_copy_planned(
            self._addresses.address, dst_address, row_buffer(src_rows)[0], n,
            max(1, threads), nbytes >= STREAM_MIN_BYTES)
        if status < 0:
            i = -status - 1
            raise NativeCopyError(
                f"row pair {i}: source row {int(src_rows[i])} of {self.src_num_rows} -> "
                f"destination row {int(dst_rows[i])} of {self.dst_num_rows} is out of range; "
                "nothing was copied")


def copy_rows(dst: torch.Tensor, src: torch.Tensor, dst_rows: torch.Tensor,
              src_rows: torch.Tensor, num_threads: int | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for all ``i``, in one pass.

    ``dst`` and ``src``: contiguous 2-D CPU tensors with rows of the same byte size (any
    dtype); ``dst_rows`` / ``src_rows``: contiguous 1-D int64 CPU tensors of equal length.
    ``num_threads``: default torch's intra-op thread count, used for jobs of at least
    :data:`PARALLEL_MIN_BYTES`. Raises :class:`NativeCopyError` naming the first pair out of
    range (nothing copied), ``RuntimeError`` if the library is unavailable.
    """
    _library()
    for idx in (dst_rows, src_rows):
        if idx.dtype != torch.int64 or idx.dim() != 1 or not idx.is_contiguous() or \
                idx.device.type != "cpu":
            raise ValueError("row indices must be contiguous 1-D int64 CPU tensors")
    if int(src_rows.shape[0]) != int(dst_rows.shape[0]):
        raise ValueError("row index tensors differ in length")
    TensorPairs([dst], [src]).copy(dst_rows, src_rows, num_threads)


def copy_byte_rows(dst: torch.Tensor, src: torch.Tensor, dst_rows: RowIds,
                   src_rows: RowIds) -> None:
    """:func:`copy_rows` for callers that already hold valid indices (contiguous 1-D int64
    tensors or arrays of equal length: :mod:`kernels.copy` guarantees this), through a
    one-pair plan (which checks the tensors); row ranges are checked in C."""
    TensorPairs([dst], [src]).copy(dst_rows, src_rows)


def copy_descriptors(dst: torch.Tensor, src: torch.Tensor, sizes: torch.Tensor) -> None:
    """``sizes[i]`` bytes from host address ``src[i]`` to host address ``dst[i]`` for all ``i``
    (contiguous 1-D int64 CPU tensors of equal length), in one call: the host stand-in for a
    batched DMA. The addresses are trusted: :class:`kernels.descriptors.DescriptorPlan` makes
    them from checked rows."""
    _library().kvspec_copy_descriptors(int(sizes.shape[0]), dst.data_ptr(), src.data_ptr(),
                                       sizes.data_ptr())
