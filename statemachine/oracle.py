"""The byte oracle: what every KV block must hold, and the check of loaded blocks against it.

The engine's forward-pass stand-in writes into a GPU block, for each KV tensor (layer) of
each worker rank, bytes that are a pure function of (the block's prefix hash, layer, rank,
byte offset): `kv_pattern`. The prefix hash is a function of every token up to the end of
the block, so two blocks hold the same bytes only if they hold the same prefix. A load can
therefore be checked byte for byte: its destination blocks must hold the pattern of the
request's own block hashes; and so can a store: the CPU chunk rows it wrote must hold the
pattern of its request's blocks. A store that copied a block after the block was given to
another request, a load from the wrong CPU chunk, a copy of the wrong sub-block: each puts
other bytes there, and the engine raises `CorruptedBytes` naming the request, the block, the
CPU chunk and the job (for a load, the store job that last wrote its chunk).

The pattern is computed vectorised (one tensor expression for all blocks of a layer) and
without integer overflow (every product stays below 2**62).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from statemachine.errors import KVSpecError

_M31 = 0x7FFFFFFF
_MASK64 = (1 << 64) - 1


def block_seed(prefix_hash: int, layer: int, rank: int) -> int:
    """A 31-bit seed mixing the block's prefix hash, the layer and the worker rank."""
    x = (prefix_hash * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9
         + rank * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    x ^= x >> 32
    return x & _M31


def kv_pattern(seeds: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """``int8 (len(seeds), page_bytes)``: the bytes of one page per seed."""
    offsets = torch.arange(page_bytes, dtype=torch.int64)
    x = (seeds.to(torch.int64).unsqueeze(1) + offsets.unsqueeze(0) * 0x3C6EF35F) & _M31
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _M31
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _M31
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8).view(torch.int8)


def pattern_for(hashes: Sequence[int], layer: int, rank: int, page_bytes: int) -> torch.Tensor:
    """The pages blocks with these prefix hashes must hold in `layer` on worker `rank`."""
    seeds = torch.tensor([block_seed(h, layer, rank) for h in hashes], dtype=torch.int64)
    return kv_pattern(seeds, page_bytes)


class CorruptedBytes(KVSpecError):
    """A block holds other bytes than its prefix says it must: a load delivered wrong data,
    a store copied wrong data into a CPU chunk, or a computed block was overwritten. Names
    the request, the block, the chunk and the job that wrote it."""

    def __init__(self, *, req_id: str, what: str, rank: int, layer: int, block_index: int,
                 gpu_block: int, offset: int, expected: int, actual: int,
                 job_id: int | None = None, chunk: int | None = None,
                 chunk_key: int | None = None, writer: tuple[int, str] | None = None,
                 bad_blocks: int = 1) -> None:
        self.req_id = req_id
        self.what = what
        self.job_id = job_id
        self.rank = rank
        self.layer = layer
        self.block_index = block_index
        self.gpu_block = gpu_block
        self.chunk = chunk
        self.chunk_key = chunk_key
        self.writer_job = writer[0] if writer else None
        self.writer_request = writer[1] if writer else None
        self.bad_blocks = bad_blocks
        key = f" (key {chunk_key:#x})" if chunk_key is not None else ""
        bytes_ = (f"at offset {offset} (expected {expected & 0xFF:#04x}, found "
                  f"{actual & 0xFF:#04x}); {bad_blocks} block(s) differ")
        if what == "stored block":
            text = (f"stored block of request {req_id!r} (store job {job_id}), worker {rank}, "
                    f"layer {layer}: CPU chunk slot {chunk}{key} received wrong bytes for "
                    f"block {block_index} of the request, read from GPU block {gpu_block}, "
                    f"{bytes_}. The store copied its source after the block was reused (a "
                    "missing fence or flush), or the copy read the wrong rows.")
        else:
            job = f" (load job {job_id})" if job_id is not None else ""
            source = ""
            if chunk is not None:
                source = f"; it was loaded from CPU chunk slot {chunk}{key}" + (
                    f", last written by store job {writer[0]} of request {writer[1]!r}"
                    if writer else ", which no store job of this worker ever wrote")
            text = (f"{what} of request {req_id!r}{job}, worker {rank}, layer {layer}: GPU "
                    f"block {gpu_block} (block {block_index} of the request) holds wrong "
                    f"bytes {bytes_}{source}. A store copied its source after the block was "
                    "reused (a missing fence or flush), a copy read or wrote the wrong rows, "
                    "or a late copy landed in a reused block.")
        super().__init__(text)


@dataclass(frozen=True)
class Mismatch:
    """The first wrong block of a check: its position in the list, offset, bytes."""

    position: int
    offset: int
    expected: int
    actual: int
    bad_blocks: int


def first_mismatch_rows(actual: torch.Tensor, hashes: Sequence[int], layer: int,
                        rank: int) -> Mismatch | None:
    """Compare pages (one row per block) with the pattern of `hashes`."""
    if not hashes:
        return None
    expected = pattern_for(hashes, layer, rank, actual.shape[1])
    diff = actual.cpu() != expected
    bad_rows = diff.any(dim=1)
    if not bool(bad_rows.any()):
        return None
    row = int(torch.nonzero(bad_rows)[0])
    offset = int(torch.nonzero(diff[row])[0])
    return Mismatch(row, offset, int(expected[row, offset]), int(actual[row, offset]),
                    int(bad_rows.sum()))


def first_mismatch(gpu: torch.Tensor, block_ids: Sequence[int], hashes: Sequence[int],
                   layer: int, rank: int) -> Mismatch | None:
    """Compare rows `block_ids` of one layer's GPU tensor with the pattern of `hashes`."""
    if not block_ids:
        return None
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=gpu.device)
    return first_mismatch_rows(gpu.index_select(0, index), hashes, layer, rank)
