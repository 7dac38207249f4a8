"""The kernels' byte oracle: a per-block Python loop, independent of the vectorised code,
shared by the CPU and the CUDA kernel tests. It always returns CPU tensors."""

from __future__ import annotations

import torch

from kernels import TransferSpec


def positions(spec: TransferSpec, bpc: int) -> list[tuple[int, int, int]]:
    """(gpu_block, chunk, sub_block) for every block of the job."""
    skip = spec.first_block_index % bpc
    return [(b, spec.cpu_chunks[(skip + i) // bpc], (skip + i) % bpc)
            for i, b in enumerate(spec.gpu_blocks)]


def sub_block(cpu: torch.Tensor, chunk: int, sub: int, page: int) -> torch.Tensor:
    return cpu[chunk, sub * page:(sub + 1) * page]


def oracle_store(gpu: list[torch.Tensor], cpu: list[torch.Tensor], spec: TransferSpec,
                 bpc: int) -> list[torch.Tensor]:
    out = [c.to("cpu", copy=True) for c in cpu]
    for g, c in zip(gpu, out, strict=True):
        page = g.shape[1]
        for b, chunk, sub in positions(spec, bpc):
            sub_block(c, chunk, sub, page).copy_(g[b].cpu())
    return out


def oracle_load(gpu: list[torch.Tensor], cpu: list[torch.Tensor], spec: TransferSpec,
                bpc: int) -> list[torch.Tensor]:
    out = [g.to("cpu", copy=True) for g in gpu]
    for g, c in zip(out, cpu, strict=True):
        page = g.shape[1]
        for b, chunk, sub in positions(spec, bpc):
            g[b].copy_(sub_block(c.cpu(), chunk, sub, page))
    return out
