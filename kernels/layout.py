"""KV-cache layout, allocation, transfer-job specs and their block-to-row mapping.

One KV tensor ``t`` of a worker lives twice:

* on the GPU as ``int8 (num_gpu_blocks, page_bytes[t])``: row ``b`` is GPU block ``b``;
* on the CPU as ``int8 (num_chunks, page_bytes[t] * blocks_per_chunk)``: row ``c`` is CPU chunk
  ``c``, holding ``blocks_per_chunk`` GPU pages back to back (sub-block ``j`` of chunk ``c``
  starts at byte ``j * page_bytes[t]`` of row ``c``).

Viewing the CPU tensor as ``(num_chunks * blocks_per_chunk, page_bytes[t])`` turns every
sub-block into one *sub-row*: sub-block ``j`` of chunk ``c`` is sub-row ``c * bpc + j``.

A transfer job (:class:`TransferSpec`) names GPU blocks and CPU chunks, both in order, and the
logical index of its first GPU block inside the request. The first
``skip = first_block_index % bpc`` sub-blocks of the first chunk are not part of the job; the
``i``-th GPU block maps to chunk ``cpu_chunks[(skip + i) // bpc]``, sub-block
``(skip + i) % bpc``. :func:`block_rows` validates a spec against a layout and returns the two
row-index tensors (GPU rows, CPU sub-rows) that every copy of the job uses.
"""

from __future__ import annotations

import array
import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "KVLayout",
    "KernelSpecError",
    "TransferSpec",
    "allocate_cpu_kv",
    "allocate_gpu_kv",
    "block_rows",
    "default_device",
]


class KernelSpecError(ValueError):
    """A layout, tensor list or transfer spec is malformed; the message says what is wrong."""


def _check_count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise KernelSpecError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise KernelSpecError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """Page size in bytes of each KV tensor, and GPU blocks per CPU chunk."""

    page_bytes: tuple[int, ...]
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        pages = tuple(self.page_bytes)
        if not pages:
            raise KernelSpecError("page_bytes is empty: a layout needs at least one KV tensor")
        for i, page in enumerate(pages):
            _check_count(f"page_bytes[{i}]", page, 1)
        object.__setattr__(self, "page_bytes", pages)
        _check_count("blocks_per_chunk", self.blocks_per_chunk, 1)

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    def chunk_bytes(self, tensor: int) -> int:
        """Bytes of one CPU chunk row of KV tensor ``tensor``."""
        return self.page_bytes[tensor] * self.blocks_per_chunk

    @property
    def block_bytes(self) -> int:
        """Bytes one GPU block occupies over all KV tensors (what a job moves per block)."""
        return sum(self.page_bytes)


def default_device() -> torch.device:
    """``cuda`` (the current device) when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allocate_gpu_kv(
    layout: KVLayout, num_gpu_blocks: int, device: torch.device | str | None = None
) -> list[torch.Tensor]:
    """One zeroed ``int8 (num_gpu_blocks, page_bytes[t])`` tensor per KV tensor.

    ``device`` defaults to :func:`default_device`; on a machine without CUDA the "GPU" tensors
    live in host memory and the CPU copy engine stands in for the GPU one.
    """
    _check_count("num_gpu_blocks", num_gpu_blocks, 1)
    dev = default_device() if device is None else torch.device(device)
    return [torch.zeros((num_gpu_blocks, page), dtype=torch.int8, device=dev)
            for page in layout.page_bytes]


def allocate_cpu_kv(
    layout: KVLayout, num_chunks: int, pin: bool | None = None
) -> list[torch.Tensor]:
    """One zeroed ``int8 (num_chunks, page_bytes[t] * blocks_per_chunk)`` CPU tensor per KV tensor.

    ``pin`` defaults to ``torch.cuda.is_available()``; pinning without CUDA is an error.
    """
    _check_count("num_chunks", num_chunks, 1)
    pinned = torch.cuda.is_available() if pin is None else pin
    if pinned and not torch.cuda.is_available():
        raise KernelSpecError("pin=True needs CUDA: pinned host memory is a CUDA allocation")
    return [torch.zeros((num_chunks, layout.chunk_bytes(t)), dtype=torch.int8,
                        pin_memory=pinned)
            for t in range(layout.num_tensors)]


_PY_IDS_MAX = 64
"""Id lists up to this long are validated in Python (cheaper than a few tensor ops: a job's
fixed cost), longer ones with tensor ops (no Python work per id)."""


def _id_tensor(name: str, ids: Sequence[int]) -> tuple[tuple[int, ...], torch.Tensor, int]:
    """The ids as a tuple and as a 1-D int64 tensor, and the largest id; rejects non-integers,
    negatives and duplicates."""
    if isinstance(ids, torch.Tensor):
        raise KernelSpecError(f"{name} must be a sequence of ints, not a tensor")
    if len(ids) == 0:
        raise KernelSpecError(f"{name} is empty")
    if len(ids) <= _PY_IDS_MAX and all(type(i) is int for i in ids):
        as_tuple = tuple(ids)
        if min(as_tuple) >= 0 and len(set(as_tuple)) == len(as_tuple):
            # through an int64 array: a third of torch.tensor's cost for a few ids (the
            # tensor keeps the array alive)
            ids_tensor = torch.frombuffer(array.array("q", as_tuple), dtype=torch.int64)
            return as_tuple, ids_tensor, max(as_tuple)
        # a negative or a duplicate: the tensor path below names them
    try:
        t = torch.tensor(ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise KernelSpecError(f"{name} must be a flat sequence of ints: {exc}") from None
    if t.dtype != torch.int64 or t.dim() != 1:
        raise KernelSpecError(f"{name} must be a flat sequence of ints, got {list(ids)[:8]!r}")
    low, high = (int(x) for x in torch.aminmax(t))
    if low < 0:
        bad = [i for i in t.tolist() if i < 0]
        raise KernelSpecError(f"{name} contains negative ids {bad[:8]}")
    if t.numel() > 1 and torch.unique(t).numel() != t.numel():
        dups = sorted(i for i, k in Counter(t.tolist()).items() if k > 1)
        raise KernelSpecError(f"{name} contains duplicate ids {dups[:8]}")
    return tuple(t.tolist()), t, high


@dataclass(frozen=True, init=False)
class TransferSpec:
    """One transfer job: GPU block ids and CPU chunk ids (both in order), and the logical index
    inside the request of the first GPU block (which fixes the first-chunk skip).

    Construction checks what does not depend on the layout (integers, non-empty, no negatives,
    no duplicates); :func:`block_rows` checks the rest (chunk count, id ranges).
    """

    gpu_blocks: tuple[int, ...]
    cpu_chunks: tuple[int, ...]
    first_block_index: int
    _gpu_ids: torch.Tensor = field(repr=False, compare=False)
    _cpu_ids: torch.Tensor = field(repr=False, compare=False)
    _max_ids: tuple[int, int] = field(repr=False, compare=False)

    def __init__(
        self, gpu_blocks: Sequence[int], cpu_chunks: Sequence[int], first_block_index: int = 0
    ) -> None:
        _check_count("first_block_index", first_block_index, 0)
        gpu_tuple, gpu_ids, gpu_max = _id_tensor("gpu_blocks", gpu_blocks)
        cpu_tuple, cpu_ids, cpu_max = _id_tensor("cpu_chunks", cpu_chunks)
        object.__setattr__(self, "gpu_blocks", gpu_tuple)
        object.__setattr__(self, "cpu_chunks", cpu_tuple)
        object.__setattr__(self, "first_block_index", first_block_index)
        object.__setattr__(self, "_gpu_ids", gpu_ids)
        object.__setattr__(self, "_cpu_ids", cpu_ids)
        object.__setattr__(self, "_max_ids", (gpu_max, cpu_max))

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks)

    def skip(self, blocks_per_chunk: int) -> int:
        """Sub-blocks of the first chunk that precede the job's first block."""
        return self.first_block_index % blocks_per_chunk

    def expected_chunks(self, blocks_per_chunk: int) -> int:
        """``ceil((num_blocks + skip) / blocks_per_chunk)``: chunks the job must name."""
        return math.ceil((self.num_blocks + self.skip(blocks_per_chunk)) / blocks_per_chunk)


def block_rows(
    spec: TransferSpec, blocks_per_chunk: int, num_gpu_blocks: int, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``spec`` against a layout; return ``(gpu_rows, cpu_subrows)``.

    Both are 1-D int64 CPU tensors of length ``spec.num_blocks``: GPU block ``gpu_rows[i]``
    corresponds to sub-row ``cpu_subrows[i]`` of the CPU tensor viewed as
    ``(num_chunks * blocks_per_chunk, page_bytes)``. Computed with tensor ops, no per-block loop.
    The tensors may share memory with ``spec``: treat them as read-only.
    """
    bpc = _check_count("blocks_per_chunk", blocks_per_chunk, 1)
    want = spec.expected_chunks(bpc)
    if len(spec.cpu_chunks) != want:
        raise KernelSpecError(
            f"{spec.num_blocks} GPU blocks with first_block_index={spec.first_block_index} "
            f"(skip {spec.skip(bpc)}, {bpc} blocks per chunk) need {want} CPU chunks, "
            f"got {len(spec.cpu_chunks)}")
    gpu_max, cpu_max = spec._max_ids
    if gpu_max >= num_gpu_blocks:
        bad = [b for b in spec.gpu_blocks if b >= num_gpu_blocks]
        raise KernelSpecError(f"gpu_blocks {bad[:8]} out of range [0, {num_gpu_blocks})")
    if cpu_max >= num_chunks:
        bad = [c for c in spec.cpu_chunks if c >= num_chunks]
        raise KernelSpecError(f"cpu_chunks {bad[:8]} out of range [0, {num_chunks})")
    if bpc == 1:
        return spec._gpu_ids, spec._cpu_ids
    # all sub-rows of the named chunks, in order, then drop the skipped head and unused tail
    subrows = (spec._cpu_ids.unsqueeze(1) * bpc + _sub_offsets(bpc)).view(-1)
    return spec._gpu_ids, subrows.narrow(0, spec.skip(bpc), spec.num_blocks)


@functools.cache
def _sub_offsets(blocks_per_chunk: int) -> torch.Tensor:
    return torch.arange(blocks_per_chunk, dtype=torch.int64)
