"""A job's copies as descriptors: (destination address, source address, bytes) triples.

This is the form a batched copy takes: the CUDA driver's ``cuMemcpyBatchAsync`` (one call
for a whole job: :mod:`kernels.cudriver`) and vLLM 0.33.0's ``swap_blocks_batch`` (three
int64 CPU tensors of addresses and sizes, ``vllm/_custom_ops.py:3039-3065``), which its
offloading worker fills with one descriptor per block and KV tensor
(``vllm/v1/kv_offload/cpu/gpu_worker.py:407-447``).

:class:`DescriptorPlan` holds one KV cache group's tensor pairs (base addresses and row
sizes, planned once per group and direction) and turns a job's :class:`~kernels.copy.RowMapping`
into descriptors with a few tensor ops (no Python work per row or per tensor):

* ``merge_runs=True`` (this project's batched strategy): one descriptor per *pair run* and
  tensor, a run being rows consecutive on both sides (a chunk of several blocks, or blocks
  that happen to be adjacent on both sides, move as one copy);
* ``merge_runs=False`` (vLLM's form): one descriptor per row and tensor.

Every row is checked against its tensor's row count before a descriptor is made: the
addresses go to a DMA engine, so a bad mapping must never reach it. Descriptors are
tensor-major: tensor ``t``'s copies are consecutive, in mapping order.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import native
from kernels.layout import KernelSpecError, RowIds, check_tensor_pairs, row_count, row_tensor

__all__ = ["DescriptorPlan", "Descriptors", "check_rows"]


@dataclass(frozen=True)
class Descriptors:
    """``count`` copies: ``sizes[i]`` bytes from address ``src[i]`` to address ``dst[i]``.

    Three contiguous 1-D int64 CPU tensors (addresses as int64 bit patterns, as vLLM's op and
    the driver's ``CUdeviceptr`` arrays take them). The memory they address must stay alive,
    and these tensors too, until the copies have run (an asynchronous copy may read them
    late: keep them with the job)."""

    dst: torch.Tensor
    src: torch.Tensor
    sizes: torch.Tensor
    nbytes: int

    def __post_init__(self) -> None:
        shape = self.sizes.shape
        for name, t in (("dst", self.dst), ("src", self.src), ("sizes", self.sizes)):
            if t.dtype != torch.int64 or t.shape != shape or len(shape) != 1 or \
                    not t.is_contiguous() or t.is_cuda:
                raise KernelSpecError(f"descriptors: {name} must be a contiguous 1-D int64 CPU "
                                      f"tensor of {shape[0]} entries (what the driver reads)")

    @property
    def count(self) -> int:
        return int(self.sizes.shape[0])

    @staticmethod
    def concat(parts: Sequence[Descriptors]) -> Descriptors:
        """One batch of several groups' descriptors, in order."""
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise KernelSpecError("a batch needs at least one group's descriptors")
        return Descriptors(torch.cat([p.dst for p in parts]), torch.cat([p.src for p in parts]),
                           torch.cat([p.sizes for p in parts]), sum(p.nbytes for p in parts))


def _flat_int64(rows: RowIds) -> bool:
    """Whether the compiled builder reads ``rows`` as they are (an array always can)."""
    return isinstance(rows, array.array) or (rows.dtype == torch.int64 and rows.is_contiguous())


def check_rows(rows: torch.Tensor, num_rows: int, side: str) -> None:
    """Every index of ``rows`` (1-D int64) within ``[0, num_rows)``; else a
    :class:`~kernels.layout.KernelSpecError` naming the first row out of range."""
    lo, hi = torch.aminmax(rows)
    if int(lo) < 0 or int(hi) >= num_rows:
        bad = int(torch.nonzero((rows < 0) | (rows >= num_rows))[0, 0])
        raise KernelSpecError(f"{side} row {int(rows[bad])} at position {bad} is out of range "
                              f"[0, {num_rows}); no descriptor was made")


class DescriptorPlan:
    """One group's tensor pairs, for descriptors: destination and source tensors of rows of
    one page each (contiguous 2-D, any device; each pair's rows of one byte size; all
    destinations of one row count, all sources of one row count, as :mod:`kernels.layout`
    makes them). The tensors must outlive the plan and its descriptors (the plan keeps
    references to them). ``compiled``: build descriptors with the compiled builder
    (:func:`kernels.native.descriptors`; ``None``: where it is available), else with tensor
    ops; both give the same descriptors."""

    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], *,
                 compiled: bool | None = None) -> None:
        sizes = check_tensor_pairs(dst, src, "a descriptor plan")
        self._tensors = (tuple(dst), tuple(src))
        self.dst_base = torch.tensor([t.data_ptr() for t in dst], dtype=torch.int64)[:, None]
        self.src_base = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64)[:, None]
        self.row_bytes = torch.tensor(sizes, dtype=torch.int64)[:, None]
        self.num_tensors = len(dst)
        self.pair_bytes = sum(sizes)
        """Bytes one row pair moves over all tensors."""
        self.dst_num_rows, self.src_num_rows = int(dst[0].shape[0]), int(src[0].shape[0])
        if compiled and not native.available():
            raise KernelSpecError(f"the compiled descriptor builder is unavailable: "
                                  f"{native.unavailable_reason()}")
        use = native.available() if compiled is None else compiled
        self._addresses = native.AddressPlan(dst, src, sizes) if use else None

    def descriptors(self, dst_rows: RowIds, src_rows: RowIds, *,
                    merge_runs: bool = False, rows_checked: bool = False) -> Descriptors:
        """Every tensor's ``dst[dst_rows[i]] <- src[src_rows[i]]`` as descriptors (1-D int64
        row index tensors, or arrays, of one length).

        ``merge_runs``: one descriptor per pair run and tensor (rows consecutive on both
        sides move as one copy); else one per row and tensor (vLLM's form). Built in one call
        of the compiled builder where the plan has it, else with tensor ops. Rows are checked
        against the tensors first, unless ``rows_checked`` says the caller made them from ids
        already checked against them (:func:`~kernels.layout.block_row_ids` does, for the
        engine's jobs)."""
        n = row_count(dst_rows)
        if n == 0 or row_count(src_rows) != n:
            raise KernelSpecError("descriptors need row index tensors of one non-zero length")
        if self._addresses is not None and _flat_int64(dst_rows) and _flat_int64(src_rows):
            return self._compiled(dst_rows, src_rows, n, merge_runs, rows_checked)
        return self._by_tensor_ops(row_tensor(dst_rows), row_tensor(src_rows), merge_runs,
                                   rows_checked)

    def _compiled(self, dst_rows: RowIds, src_rows: RowIds, n: int, merge: bool,
                  rows_checked: bool) -> Descriptors:
        """One call of the compiled builder (the runs found in C)."""
        assert self._addresses is not None
        try:
            dst, src, sizes = native.descriptors(self._addresses, dst_rows, src_rows, merge,
                                                 not rows_checked)
        except native.NativeCopyError as exc:  # the same message as the tensor-op check
            check_rows(row_tensor(dst_rows), self.dst_num_rows, "destination")
            check_rows(row_tensor(src_rows), self.src_num_rows, "source")
            raise KernelSpecError(str(exc)) from None
        return Descriptors(dst, src, sizes, n * self.pair_bytes)

    def _by_tensor_ops(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, merge: bool,
                       rows_checked: bool) -> Descriptors:
        """The same descriptors with tensor ops (no compiler, ``KVSPEC_NATIVE=0``)."""
        n = int(dst_rows.shape[0])
        if not rows_checked:
            check_rows(dst_rows, self.dst_num_rows, "destination")
            check_rows(src_rows, self.src_num_rows, "source")
        starts_dst, starts_src = dst_rows, src_rows
        lengths: torch.Tensor | int = 1
        if merge and n > 1:
            breaks = (torch.diff(dst_rows) != 1) | (torch.diff(src_rows) != 1)
            if not bool(breaks.all()):  # some run longer than one row
                at = torch.cat([torch.zeros(1, dtype=torch.int64),
                                torch.nonzero(breaks).flatten() + 1])
                starts_dst, starts_src = dst_rows[at], src_rows[at]
                ends = torch.cat([at[1:], torch.tensor([n])])
                lengths = (ends - at)[None, :]
        rb = self.row_bytes
        dst = (self.dst_base + starts_dst[None, :] * rb).reshape(-1)
        src = (self.src_base + starts_src[None, :] * rb).reshape(-1)
        sizes = (rb * lengths).expand(-1, int(starts_dst.shape[0])).contiguous().view(-1)
        return Descriptors(dst, src, sizes, n * self.pair_bytes)
