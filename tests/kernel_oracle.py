"""The kernels' byte oracle: a per-block Python loop, independent of the vectorised code,
shared by the CPU and the CUDA kernel tests. It always returns CPU tensors."""

from __future__ import annotations

import torch

from kernels import TransferSpec


def group_positions(spec: TransferSpec, bpc: int) -> list[tuple[int, int, int, int]]:
    """(group, gpu_block, chunk, sub_block) for every block of the job: each group's blocks
    in order, each group starting a fresh chunk at its own skip."""
    out: list[tuple[int, int, int, int]] = []
    block = chunk = 0
    for seg in spec.segments:
        skip = seg.first_block_index % bpc
        for i in range(seg.size):
            out.append((seg.group, spec.gpu_blocks[block + i],
                        spec.cpu_chunks[chunk + (skip + i) // bpc], (skip + i) % bpc))
        block += seg.size
        chunk += -(-(seg.size + skip) // bpc)
    return out


def positions(spec: TransferSpec, bpc: int) -> list[tuple[int, int, int]]:
    """(gpu_block, chunk, sub_block) for every block of a one-group job."""
    return [(b, chunk, sub) for _, b, chunk, sub in group_positions(spec, bpc)]


def sub_block(cpu: torch.Tensor, chunk: int, sub: int, page: int) -> torch.Tensor:
    return cpu[chunk, sub * page:(sub + 1) * page]


def _in_group(groups: tuple[tuple[int, ...], ...] | None, group: int, tensor: int) -> bool:
    return groups is None or tensor in groups[group]


def oracle_store(gpu: list[torch.Tensor], cpu: list[torch.Tensor], spec: TransferSpec,
                 bpc: int, groups: tuple[tuple[int, ...], ...] | None = None
                 ) -> list[torch.Tensor]:
    """The CPU tensors after the store; `groups`: the tensors of each KV cache group (None:
    one group of every tensor)."""
    out = [c.to("cpu", copy=True) for c in cpu]
    for t, (g, c) in enumerate(zip(gpu, out, strict=True)):
        page = g.shape[1]
        for group, b, chunk, sub in group_positions(spec, bpc):
            if _in_group(groups, group, t):
                sub_block(c, chunk, sub, page).copy_(g[b].cpu())
    return out


def oracle_load(gpu: list[torch.Tensor], cpu: list[torch.Tensor], spec: TransferSpec,
                bpc: int, groups: tuple[tuple[int, ...], ...] | None = None
                ) -> list[torch.Tensor]:
    out = [g.to("cpu", copy=True) for g in gpu]
    for t, (g, c) in enumerate(zip(out, cpu, strict=True)):
        page = g.shape[1]
        for group, b, chunk, sub in group_positions(spec, bpc):
            if _in_group(groups, group, t):
                g[b].copy_(sub_block(c.cpu(), chunk, sub, page))
    return out
