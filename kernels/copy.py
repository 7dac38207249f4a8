"""Batched copies of a job's pages between GPU block rows and CPU chunk sub-rows.

A copy is a *row mapping*: destination row ``dst[i]`` receives source row ``src[i]``, for all
``i`` at once. The work is issued as whole-job tensor ops, chosen from the mapping's shape:

=============  ==============================================================================
strategy       when / how
=============  ==============================================================================
``SLICE``      both sides are one run of consecutive rows: one ``copy_`` (a DMA on CUDA)
``GATHER``     destination is one run: ``torch.index_select(src, 0, idx, out=dst[a:b])``
``SCATTER``    source is one run: ``dst.index_copy_(0, idx, src[a:b])``
``TWO_PASS``   both scattered: ``index_select`` into a workspace, then ``index_copy_`` from it
``DST_RUNS``   both scattered, large pages: ``GATHER`` per destination run (``copy_`` if 1 row)
``SRC_RUNS``   both scattered, large pages: ``SCATTER`` per source run (``copy_`` if 1 row)
``PAIR_RUNS``  one ``copy_`` per run consecutive on both sides (CUDA: DMA; no host mapping)
``NATIVE``     host memory: the compiled one-pass gather-scatter of :mod:`kernels.native`
               (one call per job and tensor; one ``memcpy`` per run; threads for large jobs)
``BATCH_DMA``  one batch of descriptors per job, one per pair run and tensor: on CUDA one
               ``cuMemcpyBatchAsync`` (:mod:`kernels.cudriver`, the op vLLM runs); on host
               memory a compiled loop over the same descriptors (a stand-in, by choice only)
=============  ==============================================================================

Pure torch has no single-pass "gather and scatter" op, so a mapping scattered on both sides
costs two memory passes (``TWO_PASS``: about half the bandwidth of one contiguous copy). On
host memory the compiled ``NATIVE`` copy does it in one pass and is the default wherever it
could be built; the torch strategies below remain the fallback (no compiler, or
``KVSPEC_NATIVE=0``) and are what CUDA uses. When
the runs are large (``CopyPolicy.run_min_bytes`` per run on average, 128 KiB on CPU), one call
per run beats a second pass: the per-call overhead (a few microseconds) is small against the
bytes each call moves. Such loops are over runs of at least that many bytes, never a per-block
loop over small pages.

Rows are viewed with the widest integer-like dtype dividing the page size (16 bytes:
``complex128`` on CPU, 8 bytes: ``int64`` on CUDA), because ``index_copy_`` is elementwise and
an ``int8`` element per iteration is ~10x slower. All element copies are bitwise moves (no
arithmetic), so any byte pattern, NaN payloads included, round-trips exactly.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from kernels import cudriver, native
from kernels.descriptors import DescriptorPlan, Descriptors
from kernels.layout import (
    KernelSpecError,
    KVLayout,
    RowIds,
    TransferSpec,
    block_rows,
    row_count,
    row_span,
    row_tensor,
)

__all__ = [
    "CopyPolicy",
    "RowMapping",
    "RowTensor",
    "Strategy",
    "Workspace",
    "batch_unavailable",
    "check_kv_tensors",
    "choose_strategy",
    "copy_blocks_to_chunks",
    "copy_chunks_to_blocks",
    "copy_rows",
    "host_view_on_device",
    "native_plan",
    "run_batch",
]

_WIDE_DTYPES: dict[int, torch.dtype] = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.int8,
}


class Strategy(enum.Enum):
    SLICE = "slice"
    GATHER = "gather"
    SCATTER = "scatter"
    TWO_PASS = "two_pass"
    DST_RUNS = "dst_runs"
    SRC_RUNS = "src_runs"
    PAIR_RUNS = "pair_runs"
    NATIVE = "native"
    BATCH_DMA = "batch_dma"


_PY_ANALYSIS_MAX = 128  # mappings up to this long are analyzed in Python, longer ones in torch

_Side = Literal["src", "dst", "pair"]


class RowMapping:
    """``dst[i] <- src[i]`` for every ``i``: two 1-D int64 CPU index tensors, and their runs.

    A *run* is a maximal stretch of positions whose rows are consecutive (``r, r+1, ...``) on
    one side (``src``/``dst`` runs) or on both sides at once (pair runs). Run structure is
    computed on first use and cached, so all the KV tensors of a job share it. Short mappings
    are analyzed in Python (cheaper than a few tensor ops), long ones with tensor ops. The
    index tensors are treated as read-only. A job's mapping (:meth:`of_block_rows`) may hold
    its rows as arrays (:data:`~kernels.layout.RowIds`): the compiled copy reads them as they
    are (:attr:`src_ids`, :attr:`dst_ids`), and :attr:`src` and :attr:`dst` make the tensors
    only when a torch strategy asks.
    """

    __slots__ = ("_breaks", "_device_cache", "_lists", "_tensors", "dst_ids", "src_ids")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.dim() != 1 or src.shape != dst.shape or src.dtype != torch.int64 or \
                dst.dtype != torch.int64 or src.device.type != "cpu" or dst.device.type != "cpu":
            raise KernelSpecError("a row mapping needs two 1-D int64 CPU tensors of equal length")
        if src.numel() == 0:
            raise KernelSpecError("a row mapping needs at least one row")
        self._set(src.contiguous(), dst.contiguous())

    def _set(self, src: RowIds, dst: RowIds) -> None:
        self.src_ids, self.dst_ids = src, dst
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lists: tuple[list[int], list[int]] | None = None
        self._breaks: dict[_Side, list[int]] | None = None
        self._device_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def of_block_rows(cls, src: RowIds, dst: RowIds) -> RowMapping:
        """The mapping of two outputs of :func:`~kernels.layout.block_row_ids` (already 1-D,
        int64, CPU, contiguous, non-empty and of equal length: not checked again, since
        this runs once per submitted job)."""
        mapping = cls.__new__(cls)
        mapping._set(src, dst)
        return mapping

    @property
    def src(self) -> torch.Tensor:
        """The source rows as a tensor."""
        return self._as_tensors()[0]

    @property
    def dst(self) -> torch.Tensor:
        """The destination rows as a tensor."""
        return self._as_tensors()[1]

    def _as_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tensors is None:
            self._tensors = (row_tensor(self.src_ids), row_tensor(self.dst_ids))
        return self._tensors

    def part(self, start: int, size: int) -> RowMapping:
        """Positions ``start .. start + size - 1`` of this mapping (one KV cache group's rows
        of a job); tensors are shared, arrays copied (a short job's)."""
        return RowMapping.of_block_rows(row_span(self.src_ids, start, size),
                                        row_span(self.dst_ids, start, size))

    def __len__(self) -> int:
        return row_count(self.src_ids)

    def lists(self) -> tuple[list[int], list[int]]:
        """``(src, dst)`` as Python lists (cached)."""
        if self._lists is None:
            self._lists = (self.src_ids.tolist(), self.dst_ids.tolist())
        return self._lists

    def breaks(self, side: _Side) -> list[int]:
        """Positions ``i`` where row ``i + 1`` of ``side`` does not follow row ``i`` (cached)."""
        if self._breaks is None:
            self._breaks = {}
        found = self._breaks.get(side)
        if found is None:
            n = len(self)
            if n <= _PY_ANALYSIS_MAX:
                src, dst = self.lists()
                found = [i for i in range(n - 1)
                         if (side != "dst" and src[i + 1] - src[i] != 1)
                         or (side != "src" and dst[i + 1] - dst[i] != 1)]
            else:
                if side == "pair":
                    brk = (torch.diff(self.src) != 1) | (torch.diff(self.dst) != 1)
                else:
                    brk = torch.diff(self.src if side == "src" else self.dst) != 1
                found = torch.nonzero(brk).flatten().tolist()
            self._breaks[side] = found
        return found

    def runs(self, side: _Side) -> list[tuple[int, int]]:
        """``(position, length)`` of each run of ``side``."""
        bounds = [0, *(b + 1 for b in self.breaks(side)), len(self)]
        return [(bounds[k], bounds[k + 1] - bounds[k]) for k in range(len(bounds) - 1)]

    @property
    def num_src_runs(self) -> int:
        return len(self.breaks("src")) + 1

    @property
    def num_dst_runs(self) -> int:
        return len(self.breaks("dst")) + 1

    @property
    def num_pair_runs(self) -> int:
        if not self.breaks("src") and not self.breaks("dst"):
            return 1
        return len(self.breaks("pair")) + 1

    @property
    def first_src(self) -> int:
        return self.lists()[0][0] if self._lists is not None else int(self.src_ids[0])

    @property
    def first_dst(self) -> int:
        return self.lists()[1][0] if self._lists is not None else int(self.dst_ids[0])

    def inverse(self) -> RowMapping:
        """The mapping copying the other way (``src[i] <- dst[i]``)."""
        return RowMapping(self.dst, self.src)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` on ``device``; uploads are asynchronous on the current stream."""
        if device.type == "cpu":
            return self.src, self.dst
        if self._device_cache is None:
            self._device_cache = {}
        cached = self._device_cache.get(device)
        if cached is None:
            both = torch.stack([self.src, self.dst])
            if torch.cuda.is_available():
                both = both.pin_memory()
            moved = both.to(device, non_blocking=True)
            cached = (moved[0], moved[1])
            self._device_cache[device] = cached
        return cached


@dataclass(frozen=True)
class CopyPolicy:
    """How :func:`copy_rows` picks a strategy.

    ``index_kernels``: index ops can address both sides (same device, or host memory mapped
    into the GPU address space); without it only slice copies (``SLICE``/``PAIR_RUNS``) run.
    ``run_min_bytes``: average bytes per run at or above which per-run copies replace
    ``TWO_PASS`` (``None``: never). ``runs_by_dma``: per-run copies are slice ``copy_`` calls over
    pair runs (CUDA: DMA engines) instead of index ops over one side's runs (CPU).
    ``workspace_bytes``: ``TWO_PASS`` works in tiles of at most this many bytes (``None``:
    one tile, workspace freshly allocated). ``native``: host-memory copies that are not one
    slice use the compiled one-pass copy of :mod:`kernels.native` when it is available (the
    other fields then only matter where it is not; a CUDA engine switches it off).

    ``batch_dma``: a job is one batch of copy descriptors (``BATCH_DMA``, ahead of every
    other strategy): on CUDA one ``cuMemcpyBatchAsync``, which must then be available; on
    host memory the compiled loop over them (a stand-in). ``batch_merge_runs``: one
    descriptor per pair run and tensor (``False``: one per row and tensor, vLLM's form).
    ``batch_index_below``: loads whose pages are all smaller than this many bytes, of at
    least :data:`BATCH_INDEX_MIN_ROWS` rows, use index kernels instead (when
    ``index_kernels``; ``None``: never), the split vLLM 0.33.0 makes for its Triton kernel
    (:data:`BATCH_INDEX_BELOW`, ``vllm/v1/kv_offload/cpu/gpu_worker.py:39-65``). It is off by
    default: that kernel is one launch for a whole job, where this project's index kernels
    are two launches per KV tensor (128 for a load over 64 tensors), so the split is a
    setting to measure (``bench/kernels.py`` on CUDA), not one to take over unmeasured.
    ``load_src_order_any``: a batched load lets the driver read its (host) source in any
    order (``cudriver.SrcAccessOrder.ANY``), as vLLM's loads do.
    """

    index_kernels: bool = True
    run_min_bytes: int | None = 128 * 1024
    runs_by_dma: bool = False
    workspace_bytes: int | None = 64 * 1024 * 1024
    native: bool = True
    batch_dma: bool = False
    batch_merge_runs: bool = True
    batch_index_below: int | None = None
    load_src_order_any: bool = True

    @staticmethod
    def for_device(device: torch.device, host_mapped: bool = True) -> CopyPolicy:
        """The default policy: measured on a 2-core CPU; on CUDA every job one batch of the
        driver's where it has one (vLLM's op), the H200's measured choices without it."""
        if device.type == "cpu":
            return CopyPolicy()
        return CopyPolicy(index_kernels=host_mapped, run_min_bytes=1024 * 1024,
                          runs_by_dma=True, workspace_bytes=None, native=False,
                          batch_dma=cudriver.batch_copy() is not None)


BATCH_INDEX_BELOW = 28 * 1024
"""vLLM 0.33.0's ``THRESHOLD_BYTES``: below this page size its loads of at least
:data:`BATCH_INDEX_MIN_ROWS` descriptors run as an SM kernel rather than a batched DMA
(``vllm/v1/kv_offload/cpu/swap_blocks_triton.py:20-21``)."""
BATCH_INDEX_MIN_ROWS = 16
"""vLLM 0.33.0's ``MIN_N``: fewer descriptors than this always go to the batched DMA."""


def _native_applies(policy: CopyPolicy) -> bool:
    return policy.native and policy.index_kernels and native.available()


def native_plan(dst: Sequence[RowTensor], src: Sequence[RowTensor],
                policy: CopyPolicy) -> native.TensorPairs | None:
    """One job's copy of every tensor pair as one native call (planned once; reused for
    every job of the same tensors), where the policy takes the native copy and every tensor
    is host memory; else None (copy tensor by tensor with :func:`copy_rows`)."""
    if not _native_applies(policy) or any(t.data.device.type != "cpu" for t in (*dst, *src)):
        return None
    return native.TensorPairs([t.data for t in dst], [t.data for t in src])


def choose_strategy(mapping: RowMapping, row_bytes: int, policy: CopyPolicy, *,
                    load: bool = False) -> Strategy:
    """The strategy :func:`copy_rows` uses for ``mapping`` with rows of ``row_bytes`` bytes
    (for a job of several tensors: the largest); ``load``: the copy goes host to device."""
    if policy.batch_dma and not (
            load and policy.index_kernels and policy.batch_index_below is not None
            and row_bytes < policy.batch_index_below and len(mapping) >= BATCH_INDEX_MIN_ROWS):
        return Strategy.BATCH_DMA
    if _native_applies(policy):
        return Strategy.NATIVE  # before any run analysis: the C loop merges runs itself
    if mapping.num_src_runs == 1 and mapping.num_dst_runs == 1:
        return Strategy.SLICE  # consecutive on both sides
    if not policy.index_kernels:
        return Strategy.PAIR_RUNS
    if mapping.num_dst_runs == 1:
        return Strategy.GATHER
    if mapping.num_src_runs == 1:
        return Strategy.SCATTER
    total = len(mapping) * row_bytes
    if policy.run_min_bytes is not None:
        if policy.runs_by_dma:
            if total >= policy.run_min_bytes * mapping.num_pair_runs:
                return Strategy.PAIR_RUNS
        elif total >= policy.run_min_bytes * min(mapping.num_dst_runs, mapping.num_src_runs):
            if mapping.num_dst_runs <= mapping.num_src_runs:
                return Strategy.DST_RUNS
            return Strategy.SRC_RUNS
    return Strategy.TWO_PASS


def _wide_dtype(t: torch.Tensor, max_itemsize: int) -> torch.dtype:
    row_bytes = int(t.shape[1])
    for size, dtype in _WIDE_DTYPES.items():
        if size <= max_itemsize and row_bytes % size == 0 and t.storage_offset() % size == 0 \
                and t.stride(0) % size == 0 and t.data_ptr() % size == 0:
            return dtype
    return torch.int8


def _byte_rows(t: torch.Tensor, page_bytes: int) -> torch.Tensor:
    if t.dtype != torch.int8 or t.dim() != 2 or not t.is_contiguous():
        raise KernelSpecError("KV tensors must be contiguous 2-D int8 tensors")
    if t.shape[1] % page_bytes != 0:
        raise KernelSpecError(f"row of {t.shape[1]} bytes is not a multiple of page {page_bytes}")
    return t.view(-1, page_bytes)


@dataclass(frozen=True)
class RowTensor:
    """One side of a copy: one KV tensor seen as rows of one page each.

    ``rows``: the rows in the widest element dtype dividing the page, addressed by index
    kernels (for pinned host memory on CUDA: that memory mapped into the device address
    space). ``data``: the memory itself as ``int8 (rows, page)``, for slice copies (a DMA on
    CUDA; split over threads on CPU).
    """

    rows: torch.Tensor
    data: torch.Tensor

    @staticmethod
    def of(t: torch.Tensor, page_bytes: int, *, mapped: torch.Tensor | None = None,
           max_itemsize: int = 16) -> RowTensor:
        """Rows of ``t`` (``int8``, each row a multiple of ``page_bytes``): a GPU block tensor,
        or a CPU chunk tensor (whose sub-blocks become rows). ``mapped``: ``t`` mapped into the
        compute device's address space, when ``t`` is host memory and the device is CUDA."""
        data = _byte_rows(t, page_bytes)
        kernel = data if mapped is None else _byte_rows(mapped, page_bytes)
        return RowTensor(kernel.view(_wide_dtype(kernel, max_itemsize)), data)

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])


class _HostArray:
    """``__cuda_array_interface__`` over pinned host memory (device pointer == host pointer
    under unified addressing); keeps the host tensor alive while a view exists."""

    def __init__(self, t: torch.Tensor) -> None:
        self.owner = t
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(t.shape),
            "typestr": "|i1",
            "data": (t.data_ptr(), False),
            "version": 2,
            "strides": None,
        }


def _alias_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A ``device`` tensor over ``t``'s memory (non-owning: ``t`` must outlive it)."""
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is not None:
        storage = construct(t.data_ptr(), device, t.numel() * t.element_size())
        alias = torch.empty(0, dtype=t.dtype, device=device)
        return alias.set_(storage, 0, t.shape, t.stride())
    return torch.as_tensor(_HostArray(t))  # older torch: needs numpy installed


@functools.cache
def _host_mapping_works(device: torch.device) -> bool:
    """Probe once per device: write a pinned buffer on the host, read it back through a mapped
    view with an index kernel (what the copies use)."""
    try:
        probe = torch.arange(64, dtype=torch.int8).pin_memory()
        view = _alias_on_device(probe, device)
        seen = torch.index_select(view, 0, torch.arange(64, device=device)).cpu()
        return view.device == device and torch.equal(seen, probe)
    except (RuntimeError, TypeError, ValueError):
        return False


def host_view_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing pinned host tensor ``t`` (zero-copy), or ``None`` if unavailable.

    With unified addressing a pinned host pointer is also a device pointer, so index kernels on
    the GPU can read and write host memory directly over the bus: a scattered copy is a couple
    of kernels instead of one DMA per block. The mapping is probed once per device; if the probe
    fails, or ``t`` is not pinned, this returns ``None`` and callers fall back to slice copies.
    The view does not own the memory: keep ``t`` alive while it is used.
    """
    if device.type != "cuda" or t.device.type != "cpu" or not t.is_pinned():
        return None
    if t.dtype != torch.int8 or not t.is_contiguous() or not _host_mapping_works(device):
        return None
    try:
        view = _alias_on_device(t, device)
    except (RuntimeError, TypeError, ValueError):
        return None
    return view if view.device == device else None


class Workspace:
    """A reusable buffer for ``TWO_PASS`` tiles (avoids the page faults of fresh buffers)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.int8)
        self._view: tuple[tuple[int, int, torch.dtype, torch.device], torch.Tensor] | None = None

    def rows(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """An ``(n, like.shape[1])`` tensor of ``like``'s dtype and device (contents undefined)."""
        key = (n, int(like.shape[1]), like.dtype, like.device)
        if self._view is not None and self._view[0] == key:
            return self._view[1]
        need = n * int(like.shape[1]) * like.element_size()
        if self._buf.numel() < need or self._buf.device != like.device:
            self._buf = torch.empty(need, dtype=torch.int8, device=like.device)
        view = self._buf[:need].view(like.dtype).view(n, int(like.shape[1]))
        self._view = (key, view)
        return view


def _copy_run(dst: torch.Tensor, d: int, src: torch.Tensor, s: int, length: int) -> None:
    """Byte rows ``src[s:s+length]`` to ``dst[d:d+length]`` with one ``copy_`` (a DMA on CUDA;
    split over threads on CPU even for a single row, as int8 counts elements by bytes)."""
    if length == 1:
        dst[d].copy_(src[s], non_blocking=True)
    else:
        dst[d:d + length].copy_(src[s:s + length], non_blocking=True)


def copy_rows(
    dst: RowTensor,
    src: RowTensor,
    mapping: RowMapping,
    policy: CopyPolicy,
    workspace: Workspace | None = None,
) -> Strategy:
    """Copy ``src`` row ``mapping.src[i]`` to ``dst`` row ``mapping.dst[i]`` for all ``i``.

    Issued on the current stream (asynchronous on CUDA, synchronous on CPU). Returns the
    strategy used. ``dst`` and ``src`` must share row size and dtype.
    """
    if dst.rows.dtype != src.rows.dtype or dst.row_bytes != src.row_bytes:
        raise KernelSpecError("source and destination rows differ in size or dtype")
    load = src.data.device.type == "cpu" and dst.data.device.type != "cpu"
    strategy = choose_strategy(mapping, dst.row_bytes, policy, load=load)
    if strategy is Strategy.BATCH_DMA:
        plan = DescriptorPlan([dst.data], [src.data])
        run_batch(batch_descriptors([plan], [mapping], policy), dst.data.device
                  if dst.data.device.type != "cpu" else src.data.device, load, policy)
        return strategy
    if strategy is Strategy.NATIVE:
        if dst.data.device.type != "cpu" or src.data.device.type != "cpu":
            raise KernelSpecError("the native copy addresses host memory only")
        native.copy_byte_rows(dst.data, src.data, mapping.dst_ids, mapping.src_ids)
        return strategy
    n = len(mapping)
    s0, d0 = mapping.first_src, mapping.first_dst
    if strategy is Strategy.SLICE:
        _copy_run(dst.data, d0, src.data, s0, n)
        return strategy
    if strategy is Strategy.PAIR_RUNS:
        s_host, d_host = mapping.lists()
        for pos, length in mapping.runs("pair"):
            _copy_run(dst.data, d_host[pos], src.data, s_host[pos], length)
        return strategy
    src_idx, dst_idx = mapping.indices(dst.rows.device)
    if strategy is Strategy.GATHER:
        torch.index_select(src.rows, 0, src_idx, out=dst.rows.narrow(0, d0, n))
    elif strategy is Strategy.SCATTER:
        dst.rows.index_copy_(0, dst_idx, src.rows.narrow(0, s0, n))
    elif strategy in (Strategy.DST_RUNS, Strategy.SRC_RUNS):
        s_host, d_host = mapping.lists()
        side: Literal["src", "dst"] = "dst" if strategy is Strategy.DST_RUNS else "src"
        dst_data, src_data = dst.data, src.data
        for pos, length in mapping.runs(side):
            if length == 1:  # the common case when both sides are scattered: one row copy
                dst_data[d_host[pos]].copy_(src_data[s_host[pos]], non_blocking=True)
            elif side == "dst":
                torch.index_select(src.rows, 0, src_idx.narrow(0, pos, length),
                                   out=dst.rows.narrow(0, d_host[pos], length))
            else:
                dst.rows.index_copy_(0, dst_idx.narrow(0, pos, length),
                                     src.rows.narrow(0, s_host[pos], length))
    else:
        _two_pass(dst.rows, dst_idx, src.rows, src_idx, policy, workspace)
    return strategy


def batch_descriptors(plans: Sequence[DescriptorPlan], mappings: Sequence[RowMapping],
                      policy: CopyPolicy, *, rows_checked: bool = False) -> Descriptors:
    """One batch: each group's plan over its part of the job's mapping, in order
    (``rows_checked``: as :meth:`DescriptorPlan.descriptors`)."""
    return Descriptors.concat([
        plan.descriptors(m.dst_ids, m.src_ids, merge_runs=policy.batch_merge_runs,
                         rows_checked=rows_checked)
        for plan, m in zip(plans, mappings, strict=True)])


@functools.cache
def _attributes(device: int, order: cudriver.SrcAccessOrder,
                store: bool) -> cudriver.CUmemcpyAttributes:
    return cudriver.BatchCopy.attributes(order, device, store)


def batch_unavailable(device: torch.device) -> str | None:
    """Why a batched copy cannot run on ``device`` (``None`` where it can): on the host its
    stand-in needs the compiled copy, on CUDA the driver needs ``cuMemcpyBatchAsync``."""
    if device.type == "cpu":
        if native.available():
            return None
        return (f"policy.batch_dma on host memory needs the compiled copy (it runs the "
                f"stand-in of a batched copy): {native.unavailable_reason()}")
    if cudriver.batch_copy() is not None:
        return None
    return (f"policy.batch_dma needs the CUDA driver's cuMemcpyBatchAsync: "
            f"{cudriver.unavailable_reason()}")


def run_batch(batch: Descriptors, device: torch.device, load: bool, policy: CopyPolicy) -> None:
    """Issue ``batch`` on ``device``'s current stream: one ``cuMemcpyBatchAsync`` on CUDA (its
    source in any order for a load where the policy allows it, else in stream order), the
    compiled loop over the descriptors on the host. Keep ``batch`` alive until it has run."""
    why = batch_unavailable(device)
    if why is not None:
        raise KernelSpecError(why)
    if device.type == "cpu":
        native.copy_descriptors(batch.dst, batch.src, batch.sizes)
        return
    op = cudriver.batch_copy()
    assert op is not None  # batch_unavailable said so
    order = (cudriver.SrcAccessOrder.ANY if load and policy.load_src_order_any
             else cudriver.SrcAccessOrder.STREAM)
    index = device.index if device.index is not None else torch.cuda.current_device()
    op(batch, torch.cuda.current_stream(device).cuda_stream, _attributes(index, order, not load))


def _two_pass(
    dst: torch.Tensor,
    dst_idx: torch.Tensor,
    src: torch.Tensor,
    src_idx: torch.Tensor,
    policy: CopyPolicy,
    workspace: Workspace | None,
) -> None:
    """Gather into a workspace, scatter from it; in tiles of ``policy.workspace_bytes``."""
    n = int(src_idx.shape[0])
    row_bytes = int(src.shape[1]) * src.element_size()
    if policy.workspace_bytes is None:
        dst.index_copy_(0, dst_idx, torch.index_select(src, 0, src_idx))
        return
    tile = max(1, min(n, policy.workspace_bytes // row_bytes))
    ws = workspace if workspace is not None else Workspace()
    if tile == n:  # the usual case: the whole job in one gather and one scatter
        buf = ws.rows(n, src)
        torch.index_select(src, 0, src_idx, out=buf)
        dst.index_copy_(0, dst_idx, buf)
        return
    buf = ws.rows(tile, src)
    for pos in range(0, n, tile):
        k = min(tile, n - pos)
        part = buf.narrow(0, 0, k)
        torch.index_select(src, 0, src_idx.narrow(0, pos, k), out=part)
        dst.index_copy_(0, dst_idx.narrow(0, pos, k), part)


def check_kv_tensors(
    gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor],
    blocks_per_chunk: int,
) -> tuple[list[int], int, int]:
    """Validate a worker's KV tensor lists; return ``(page_bytes, num_gpu_blocks, num_chunks)``."""
    if len(gpu_tensors) == 0:
        raise KernelSpecError("no KV tensors given")
    if len(gpu_tensors) != len(cpu_tensors):
        raise KernelSpecError(
            f"{len(gpu_tensors)} GPU tensors but {len(cpu_tensors)} CPU tensors")
    if blocks_per_chunk < 1:
        raise KernelSpecError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
    pages: list[int] = []
    num_blocks = num_chunks = -1
    for t, (g, c) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
        for name, x in (("GPU", g), ("CPU", c)):
            if x.dtype != torch.int8 or x.dim() != 2 or not x.is_contiguous():
                raise KernelSpecError(
                    f"{name} tensor {t} must be a contiguous 2-D int8 tensor, "
                    f"got {x.dtype} {tuple(x.shape)}")
        if c.device.type != "cpu":
            raise KernelSpecError(f"CPU tensor {t} is on {c.device}")
        if g.device != gpu_tensors[0].device:
            raise KernelSpecError(f"GPU tensor {t} is on {g.device}, tensor 0 on "
                                  f"{gpu_tensors[0].device}")
        page = int(g.shape[1])
        if int(c.shape[1]) != page * blocks_per_chunk:
            raise KernelSpecError(
                f"CPU tensor {t} rows are {c.shape[1]} bytes; expected page {page} x "
                f"{blocks_per_chunk} blocks per chunk = {page * blocks_per_chunk}")
        if num_blocks not in (-1, int(g.shape[0])):
            raise KernelSpecError(f"GPU tensor {t} has {g.shape[0]} blocks, tensor 0 has "
                                  f"{num_blocks}")
        if num_chunks not in (-1, int(c.shape[0])):
            raise KernelSpecError(f"CPU tensor {t} has {c.shape[0]} chunks, tensor 0 has "
                                  f"{num_chunks}")
        num_blocks, num_chunks = int(g.shape[0]), int(c.shape[0])
        pages.append(page)
    return pages, num_blocks, num_chunks


def _copy_job(
    gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor],
    spec: TransferSpec, blocks_per_chunk: int, store: bool, policy: CopyPolicy | None,
    groups: Sequence[Sequence[int]],
) -> int:
    pages, num_blocks, num_chunks = check_kv_tensors(gpu_tensors, cpu_tensors, blocks_per_chunk)
    layout = KVLayout(tuple(pages), blocks_per_chunk, tuple(tuple(g) for g in groups))
    if spec.segments[-1].group >= layout.num_groups:
        raise KernelSpecError(f"the job names blocks of KV cache group "
                              f"{spec.segments[-1].group}; the layout has {layout.num_groups} "
                              "groups")
    gpu_rows, cpu_rows = block_rows(spec, blocks_per_chunk, num_blocks, num_chunks)
    mapping = RowMapping(gpu_rows, cpu_rows) if store else RowMapping(cpu_rows, gpu_rows)
    device = gpu_tensors[0].device
    same = device.type == "cpu"
    pol = policy if policy is not None else CopyPolicy.for_device(device, host_mapped=False)
    if not same and pol.native:
        pol = replace(pol, native=False)  # the compiled copy is host-only
    if not same and pol.index_kernels:
        raise KernelSpecError("index kernels across devices need the CopyEngine's host mapping")
    itemsize = 16 if same else 8
    gpu = [RowTensor.of(g, page, max_itemsize=itemsize)
           for g, page in zip(gpu_tensors, pages, strict=True)]
    cpu = [RowTensor.of(c, page, max_itemsize=itemsize)
           for c, page in zip(cpu_tensors, pages, strict=True)]
    dst_all, src_all = (cpu, gpu) if store else (gpu, cpu)
    workspace = Workspace()
    for seg in spec.segments:  # each group's rows in that group's tensors
        rows = mapping if len(spec.segments) == 1 else mapping.part(seg.start, seg.size)
        dst = [dst_all[t] for t in layout.groups[seg.group]]
        src = [src_all[t] for t in layout.groups[seg.group]]
        plan = native_plan(dst, src, pol)
        if plan is not None:
            plan.copy(rows.dst, rows.src)
            continue
        for d, s in zip(dst, src, strict=True):
            copy_rows(d, s, rows, pol, workspace)
    return layout.job_bytes(spec)


def copy_blocks_to_chunks(
    gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor],
    spec: TransferSpec, blocks_per_chunk: int, policy: CopyPolicy | None = None,
    *, groups: Sequence[Sequence[int]] = (),
) -> int:
    """Store: copy the job's GPU blocks into their CPU chunk sub-blocks, each KV cache
    group's blocks in that group's tensors (``groups`` as :attr:`KVLayout.groups`; default:
    one group of every tensor).

    Synchronous on CPU tensors; with CUDA GPU tensors the slice copies are issued on the
    current stream (use :class:`~kernels.engine.CopyEngine` for scattered jobs on CUDA).
    Returns the bytes copied.
    """
    return _copy_job(gpu_tensors, cpu_tensors, spec, blocks_per_chunk, True, policy, groups)


def copy_chunks_to_blocks(
    cpu_tensors: Sequence[torch.Tensor], gpu_tensors: Sequence[torch.Tensor],
    spec: TransferSpec, blocks_per_chunk: int, policy: CopyPolicy | None = None,
    *, groups: Sequence[Sequence[int]] = (),
) -> int:
    """Load: copy the job's CPU chunk sub-blocks into their GPU blocks, each KV cache group's
    blocks in that group's tensors.

    Same conventions as :func:`copy_blocks_to_chunks`. Returns the bytes copied.
    """
    return _copy_job(gpu_tensors, cpu_tensors, spec, blocks_per_chunk, False, policy, groups)
