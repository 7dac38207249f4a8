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
row-index tensors (GPU rows, CPU sub-rows) that every copy of the job uses;
:func:`block_row_ids` gives the same rows as the engine keeps them (int64 arrays for a short
job: no tensor is made where the compiled copy runs it).

KV cache groups (a hybrid model: full attention beside sliding-window layers). A layout names
the KV tensors of each group (:attr:`KVLayout.groups`); a job of several groups lists its GPU
blocks group by group, with vLLM's ``group_sizes`` (blocks of each group) and
``block_indices`` (each group's first logical block index), and its CPU chunks in the same
order, each group taking ``cdiv(size + skip, bpc)`` chunks with its own first-chunk skip
``block_indices[g] % bpc`` (vLLM 0.33.0: ``vllm/v1/kv_offload/cpu/gpu_worker.py:597-669``).
A group's blocks are copied in that group's tensors only: a block id names a row of every
tensor, but the core hands it to one group at a time.
"""

from __future__ import annotations

import array
import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

__all__ = [
    "KVLayout",
    "KernelSpecError",
    "RowIds",
    "Segment",
    "TransferSpec",
    "allocate_cpu_kv",
    "allocate_gpu_kv",
    "block_row_ids",
    "block_rows",
    "check_tensor_pairs",
    "default_device",
    "row_buffer",
    "row_count",
    "row_span",
    "row_tensor",
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
    """Page size in bytes of each KV tensor, GPU blocks per CPU chunk, and the KV tensors of
    each KV cache group."""

    page_bytes: tuple[int, ...]
    blocks_per_chunk: int
    groups: tuple[tuple[int, ...], ...] = ()
    """Per KV cache group, in group order, the indices of its tensors in `page_bytes`; every
    tensor belongs to at least one group. Empty (the default): one group of every tensor."""

    def __post_init__(self) -> None:
        pages = tuple(self.page_bytes)
        if not pages:
            raise KernelSpecError("page_bytes is empty: a layout needs at least one KV tensor")
        for i, page in enumerate(pages):
            _check_count(f"page_bytes[{i}]", page, 1)
        object.__setattr__(self, "page_bytes", pages)
        _check_count("blocks_per_chunk", self.blocks_per_chunk, 1)
        groups = tuple(tuple(g) for g in self.groups) or (tuple(range(len(pages))),)
        for g, tensors in enumerate(groups):
            if not tensors:
                raise KernelSpecError(f"group {g} has no KV tensor")
            for t in tensors:
                if type(t) is not int or not 0 <= t < len(pages):
                    raise KernelSpecError(f"group {g} names tensor {t!r}; the layout has "
                                          f"tensors 0..{len(pages) - 1}")
            if len(set(tensors)) != len(tensors):
                raise KernelSpecError(f"group {g} names a tensor twice: {tensors}")
        orphans = set(range(len(pages))) - {t for g in groups for t in g}
        if orphans:
            raise KernelSpecError(f"tensors {sorted(orphans)} belong to no group")
        object.__setattr__(self, "groups", groups)

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_block_bytes(self, group: int) -> int:
        """Bytes one GPU block of `group` occupies over the group's tensors."""
        return self._group_block_bytes[group]

    @functools.cached_property
    def _group_block_bytes(self) -> tuple[int, ...]:
        """`group_block_bytes` of every group, summed once (a job's bytes are counted per
        job)."""
        return tuple(sum(self.page_bytes[t] for t in g) for g in self.groups)

    def chunk_bytes(self, tensor: int) -> int:
        """Bytes of one CPU chunk row of KV tensor ``tensor``."""
        return self.page_bytes[tensor] * self.blocks_per_chunk

    @property
    def block_bytes(self) -> int:
        """Bytes one GPU block occupies over all KV tensors (what a one-group job moves per
        block)."""
        return sum(self.page_bytes)

    def job_bytes(self, spec: TransferSpec) -> int:
        """Bytes `spec` moves: each group's blocks over that group's tensors."""
        per_block = self._group_block_bytes
        if len(spec.segments) == 1:
            seg = spec.segments[0]
            return seg.size * per_block[seg.group]
        return sum(seg.size * per_block[seg.group] for seg in spec.segments)


def check_tensor_pairs(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], what: str,
                       *, host_only: bool = False) -> list[int]:
    """Destination and source tensors of a whole-row copy (a compiled job, a batch of
    descriptors): as many of each and at least one, contiguous 2-D (in host memory where
    ``host_only``), each pair's rows of one byte size, all destinations of one row count and
    all sources of one. Returns each pair's row size in bytes; a :class:`KernelSpecError`
    naming ``what`` otherwise."""
    if len(dst) != len(src) or not dst:
        raise KernelSpecError(f"{what} needs as many source as destination tensors, at least "
                              "one")
    for t in (*dst, *src):
        if t.dim() != 2 or not t.is_contiguous() or (host_only and t.device.type != "cpu"):
            raise KernelSpecError(f"{what} needs contiguous 2-D{' CPU' if host_only else ''} "
                                  "tensors")
    sizes = [int(d.shape[1]) * d.element_size() for d in dst]
    if sizes != [int(s.shape[1]) * s.element_size() for s in src]:
        raise KernelSpecError(f"{what}: source and destination rows differ in size")
    if len({int(d.shape[0]) for d in dst}) != 1 or len({int(s.shape[0]) for s in src}) != 1:
        raise KernelSpecError(f"{what}: the destination (or source) tensors differ in row count")
    return sizes


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
"""Id lists up to this long are validated in Python, and a job of up to this many blocks has
its rows computed in Python (cheaper than a few tensor ops: a job's fixed cost); longer ones
with tensor ops (no Python work per id)."""

RowIds: TypeAlias = "torch.Tensor | array.array[int]"
"""A job's row indices: a contiguous 1-D int64 CPU tensor, or an ``array('q')`` (what the
short jobs keep: no tensor made for a job that the compiled copy runs). :func:`row_tensor`
gives either as a tensor, :func:`row_buffer` its address and length."""


def row_tensor(rows: RowIds) -> torch.Tensor:
    """``rows`` as a 1-D int64 tensor (an array's is a view of its buffer, keeping it alive)."""
    if isinstance(rows, array.array):
        return torch.frombuffer(rows, dtype=torch.int64)
    return rows


def row_buffer(rows: RowIds) -> tuple[int, int]:
    """The address of ``rows``' first element and their count (for the compiled copy)."""
    if isinstance(rows, array.array):
        return rows.buffer_info()
    return rows.data_ptr(), int(rows.shape[0])


def row_count(rows: RowIds) -> int:
    """How many rows ``rows`` holds (a tensor's ``len`` is a slow Python method)."""
    if isinstance(rows, array.array):
        return len(rows)
    return int(rows.shape[0])


def row_span(rows: RowIds, start: int, size: int) -> RowIds:
    """Rows ``start .. start + size - 1`` (a tensor's are a view, an array's a copy)."""
    if isinstance(rows, array.array):
        return rows[start:start + size]
    return rows.narrow(0, start, size)


def _id_array(name: str, ids: Sequence[int]) -> tuple[tuple[int, ...], array.array[int], int]:
    """The ids as a tuple and as an ``array('q')``, and the largest id; rejects
    non-integers, negatives and duplicates."""
    kind = type(ids)
    if (kind is list or kind is tuple) and 0 < len(ids) <= _PY_IDS_MAX \
            and all(type(i) is int for i in ids):  # the usual case, checked in Python
        as_tuple = tuple(ids)
        if min(as_tuple) >= 0 and len(set(as_tuple)) == len(as_tuple):
            return as_tuple, array.array("q", as_tuple), max(as_tuple)
        # a negative or a duplicate: the tensor path below names them
    if isinstance(ids, torch.Tensor):
        raise KernelSpecError(f"{name} must be a sequence of ints, not a tensor")
    if len(ids) == 0:
        raise KernelSpecError(f"{name} is empty")
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
    as_tuple = tuple(t.tolist())
    return as_tuple, array.array("q", as_tuple), high


@dataclass(frozen=True)
class Segment:
    """The blocks of one KV cache group inside a job: `size` blocks from position `start` of
    the job's GPU block list, the first of them logical block `first_block_index` of the
    request."""

    group: int
    start: int
    size: int
    first_block_index: int

    def skip(self, blocks_per_chunk: int) -> int:
        """Sub-blocks of the group's first chunk that precede its first block."""
        return self.first_block_index % blocks_per_chunk

    def num_chunks(self, blocks_per_chunk: int) -> int:
        """``ceil((size + skip) / blocks_per_chunk)``: CPU chunks the group takes."""
        return math.ceil((self.size + self.skip(blocks_per_chunk)) / blocks_per_chunk)


@functools.lru_cache(maxsize=4096)
def _one_group(num_blocks: int, first_block_index: int) -> tuple[Segment, ...]:
    """The segments of a job of one group (a value: shared by the jobs of that shape)."""
    return (Segment(0, 0, num_blocks, first_block_index),)


def _check_group_layout(num_blocks: int, first_block_index: int,
                        group_sizes: Sequence[int] | None,
                        block_indices: Sequence[int] | None) -> tuple[Segment, ...]:
    if group_sizes is None and block_indices is None:
        return _one_group(num_blocks, first_block_index)
    if group_sizes is None or block_indices is None:
        raise KernelSpecError("group_sizes and block_indices go together (one entry per KV "
                              "cache group)")
    sizes, starts = tuple(group_sizes), tuple(block_indices)
    if not sizes or len(sizes) != len(starts):
        raise KernelSpecError(f"group_sizes {sizes} and block_indices {starts} must have one "
                              "entry per KV cache group, as many of each")
    for g, (size, start) in enumerate(zip(sizes, starts, strict=True)):
        _check_count(f"group_sizes[{g}]", size, 0)
        _check_count(f"block_indices[{g}]", start, 0)
    if sum(sizes) != num_blocks:
        raise KernelSpecError(f"group_sizes {sizes} add up to {sum(sizes)}, but the job names "
                              f"{num_blocks} GPU blocks")
    segments, position = [], 0
    for g, (size, start) in enumerate(zip(sizes, starts, strict=True)):
        if size:
            segments.append(Segment(g, position, size, start))
        position += size
    first = segments[0]
    if first_block_index not in (0, first.first_block_index):
        raise KernelSpecError("with group_sizes, block_indices give each group's first block "
                              f"index; first_block_index={first_block_index} contradicts "
                              f"block_indices[{first.group}]={first.first_block_index}")
    return tuple(segments)


@dataclass(frozen=True, init=False)
class TransferSpec:
    """One transfer job: GPU block ids and CPU chunk ids (both in order), and the logical index
    inside the request of the first GPU block (which fixes the first-chunk skip).

    With several KV cache groups, `group_sizes` and `block_indices` (vLLM's names) say how
    many of the GPU blocks belong to each group, group by group, and each group's first
    logical block index; `segments` lists the groups that have blocks.

    Construction checks what does not depend on the layout (integers, non-empty, no negatives,
    no duplicates, group sizes that add up); :func:`block_rows` checks the rest (chunk count,
    id ranges).
    """

    gpu_blocks: tuple[int, ...]
    cpu_chunks: tuple[int, ...]
    first_block_index: int
    """The logical index of the job's first GPU block (its first group's)."""
    segments: tuple[Segment, ...]
    _gpu_ids: array.array[int] = field(repr=False, compare=False)
    _cpu_ids: array.array[int] = field(repr=False, compare=False)
    _max_ids: tuple[int, int] = field(repr=False, compare=False)

    def __init__(
        self, gpu_blocks: Sequence[int], cpu_chunks: Sequence[int], first_block_index: int = 0,
        *, group_sizes: Sequence[int] | None = None, block_indices: Sequence[int] | None = None,
    ) -> None:
        _check_count("first_block_index", first_block_index, 0)
        gpu_tuple, gpu_ids, gpu_max = _id_array("gpu_blocks", gpu_blocks)
        cpu_tuple, cpu_ids, cpu_max = _id_array("cpu_chunks", cpu_chunks)
        segments = _check_group_layout(len(gpu_tuple), first_block_index, group_sizes,
                                       block_indices)
        vars(self).update(  # a frozen value: its fields set once, here (one call, not seven)
            gpu_blocks=gpu_tuple, cpu_chunks=cpu_tuple,
            first_block_index=segments[0].first_block_index, segments=segments,
            _gpu_ids=gpu_ids, _cpu_ids=cpu_ids, _max_ids=(gpu_max, cpu_max))

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_blocks)

    def skip(self, blocks_per_chunk: int) -> int:
        """Sub-blocks of the first chunk that precede the job's first block."""
        return self.segments[0].skip(blocks_per_chunk)

    def expected_chunks(self, blocks_per_chunk: int) -> int:
        """Chunks the job must name: ``ceil((size + skip) / blocks_per_chunk)`` per group."""
        if blocks_per_chunk == 1:
            return len(self.gpu_blocks)
        return sum(seg.num_chunks(blocks_per_chunk) for seg in self.segments)

    def chunk_position(self, block_position: int, blocks_per_chunk: int) -> int:
        """The position in `cpu_chunks` of the chunk holding the block at `block_position`
        of `gpu_blocks`."""
        first_chunk = 0
        for seg in self.segments:
            if block_position < seg.start + seg.size:
                return first_chunk + (seg.skip(blocks_per_chunk) + block_position - seg.start) \
                    // blocks_per_chunk
            first_chunk += seg.num_chunks(blocks_per_chunk)
        raise IndexError(f"block position {block_position} of a {self.num_blocks}-block job")


def block_rows(
    spec: TransferSpec, blocks_per_chunk: int, num_gpu_blocks: int, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``spec`` against a layout; return ``(gpu_rows, cpu_subrows)``.

    Both are 1-D int64 CPU tensors of length ``spec.num_blocks``: GPU block ``gpu_rows[i]``
    corresponds to sub-row ``cpu_subrows[i]`` of the CPU tensor viewed as
    ``(num_chunks * blocks_per_chunk, page_bytes)``. The tensors may share memory with
    ``spec``: treat them as read-only. :func:`block_row_ids` gives the same rows without
    making tensors where the job is short.
    """
    gpu_rows, cpu_rows = block_row_ids(spec, blocks_per_chunk, num_gpu_blocks, num_chunks)
    return row_tensor(gpu_rows), row_tensor(cpu_rows)


def block_row_ids(
    spec: TransferSpec, blocks_per_chunk: int, num_gpu_blocks: int, num_chunks: int
) -> tuple[RowIds, RowIds]:
    """:func:`block_rows`'s rows as :data:`RowIds`: the spec's own arrays with one block per
    chunk; computed in Python for a job of up to :data:`_PY_IDS_MAX` blocks, else with
    tensor ops (one op per KV cache group of the job, no per-block loop)."""
    bpc = _check_count("blocks_per_chunk", blocks_per_chunk, 1)
    want = spec.expected_chunks(bpc)
    if len(spec.cpu_chunks) != want:
        layout = ", ".join(f"group {s.group}: {s.size} from index {s.first_block_index} "
                           f"(skip {s.skip(bpc)})" for s in spec.segments)
        raise KernelSpecError(
            f"{spec.num_blocks} GPU blocks ({layout}; {bpc} blocks per chunk) need {want} CPU "
            f"chunks, got {len(spec.cpu_chunks)}")
    gpu_max, cpu_max = spec._max_ids
    if gpu_max >= num_gpu_blocks:
        bad = [b for b in spec.gpu_blocks if b >= num_gpu_blocks]
        raise KernelSpecError(f"gpu_blocks {bad[:8]} out of range [0, {num_gpu_blocks})")
    if cpu_max >= num_chunks:
        bad = [c for c in spec.cpu_chunks if c >= num_chunks]
        raise KernelSpecError(f"cpu_chunks {bad[:8]} out of range [0, {num_chunks})")
    if bpc == 1:
        return spec._gpu_ids, spec._cpu_ids
    # per group: the sub-rows of its blocks, from its first chunk's skipped head on
    position = 0
    if spec.num_blocks <= _PY_IDS_MAX:
        chunks, rows = spec.cpu_chunks, array.array("q")
        for seg in spec.segments:
            skip = seg.skip(bpc)
            rows.extend(chunks[position + k // bpc] * bpc + k % bpc
                        for k in range(skip, skip + seg.size))
            position += seg.num_chunks(bpc)
        return spec._gpu_ids, rows
    all_chunks = row_tensor(spec._cpu_ids)
    parts: list[torch.Tensor] = []
    for seg in spec.segments:
        n = seg.num_chunks(bpc)
        chunks_t = all_chunks if len(spec.segments) == 1 else all_chunks.narrow(0, position, n)
        subrows = (chunks_t.unsqueeze(1) * bpc + _sub_offsets(bpc)).view(-1)
        parts.append(subrows.narrow(0, seg.skip(bpc), seg.size))
        position += n
    return spec._gpu_ids, parts[0] if len(parts) == 1 else torch.cat(parts)


@functools.cache
def _sub_offsets(blocks_per_chunk: int) -> torch.Tensor:
    return torch.arange(blocks_per_chunk, dtype=torch.int64)
