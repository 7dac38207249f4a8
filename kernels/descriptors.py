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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.layout import KernelSpecError, check_tensor_pairs

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
        n = int(self.sizes.shape[0])
        for name in ("dst", "src", "sizes"):
            t: torch.Tensor = getattr(self, name)
            if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or \
                    t.device.type != "cpu" or int(t.shape[0]) != n:
                raise KernelSpecError(f"descriptors: {name} must be a contiguous 1-D int64 CPU "
                                      f"tensor of {n} entries (what the driver reads)")

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
    references to them)."""

    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        sizes = check_tensor_pairs(dst, src, "a descriptor plan")
        self._tensors = (tuple(dst), tuple(src))
        self.dst_base = torch.tensor([t.data_ptr() for t in dst], dtype=torch.int64)[:, None]
        self.src_base = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64)[:, None]
        self.row_bytes = torch.tensor(sizes, dtype=torch.int64)[:, None]
        self.num_tensors = len(dst)
        self.pair_bytes = sum(sizes)
        """Bytes one row pair moves over all tensors."""
        self.max_row_bytes = max(sizes)
        self.dst_num_rows, self.src_num_rows = int(dst[0].shape[0]), int(src[0].shape[0])
        self.devices = frozenset(t.device for t in (*dst, *src))

    def descriptors(self, dst_rows: torch.Tensor, src_rows: torch.Tensor,
                    run_starts: Sequence[int] | None = None, *,
                    rows_checked: bool = False) -> Descriptors:
        """Every tensor's ``dst[dst_rows[i]] <- src[src_rows[i]]`` as descriptors.

        ``run_starts``: the positions where pair runs start (``0`` first, increasing), so
        that each run is one descriptor per tensor; ``None``: one descriptor per row and
        tensor (vLLM's form). Rows are checked against the tensors first, unless
        ``rows_checked`` says the caller made them from ids already checked against them
        (:func:`~kernels.layout.block_rows` does, for the engine's jobs)."""
        n = int(dst_rows.shape[0])
        if n == 0 or int(src_rows.shape[0]) != n:
            raise KernelSpecError("descriptors need row index tensors of one non-zero length")
        if not rows_checked:
            check_rows(dst_rows, self.dst_num_rows, "destination")
            check_rows(src_rows, self.src_num_rows, "source")
        if run_starts is None:
            starts_dst, starts_src = dst_rows, src_rows
            lengths: torch.Tensor | int = 1
        else:
            if not run_starts or run_starts[0] != 0:
                raise KernelSpecError("pair runs start at position 0")
            if len(run_starts) == n:
                starts_dst, starts_src, lengths = dst_rows, src_rows, 1
            else:
                at = torch.tensor(run_starts, dtype=torch.int64)
                starts_dst, starts_src = dst_rows[at], src_rows[at]
                ends = torch.tensor([*run_starts[1:], n], dtype=torch.int64)
                lengths = (ends - at)[None, :]
        rb = self.row_bytes
        dst = (self.dst_base + starts_dst[None, :] * rb).reshape(-1)
        src = (self.src_base + starts_src[None, :] * rb).reshape(-1)
        sizes = (rb * lengths).expand(-1, int(starts_dst.shape[0])).contiguous().view(-1)
        return Descriptors(dst, src, sizes, n * self.pair_bytes)
