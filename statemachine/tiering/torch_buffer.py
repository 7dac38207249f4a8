"""`WorkerCPUBuffer`: the CPU tier's slots as a secondary tier sees them (`PrimaryBuffer`),
over the worker ranks' CPU KV tensors.

In vLLM the CPU tier is one shared memory region that the scheduler process and every worker
map (SR); a secondary tier addresses slot *c* as a view of that region (TB:177-200,
TM:160-167). Here the scheduler, the workers and the tiers live in one process, so the
buffer reads and writes the workers' CPU tensors (`kernels.allocate_cpu_kv`: one
``int8 (num_chunks, page_bytes[t] * blocks_per_chunk)`` tensor per KV tensor) directly: slot
*c* is row *c* of every KV tensor of every rank.

One copy per slot, every rank's bytes in it. A slot's bytes are the rows, rank by rank and,
within a rank, KV tensor by KV tensor (the layout's tensor order: group by group, layer by
layer), concatenated. vLLM's filesystem tier keeps a file per rank instead
(``<base_path>_r<rank>/...``, TF:13): each rank's worker copies its own shard. Keeping every
rank in one copy makes a copy all-or-nothing across ranks (a promotion cannot bring back one
rank's shard without the others), which is what the scheduler-side tiering manager
assumes anyway: it tracks one copy per key, not one per rank. `part` gives one rank's
tensor back out of a slot's bytes, for the byte oracle.

Thread safety: a tier's I/O threads (`statemachine.tiering.io.ThreadedExecutor`) read and
write rows of slots the tiering manager protects (a cascade's slots are pinned, a
promotion's are write pending), while the workers' copies touch other rows; each call copies
one slot's rows, with no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from statemachine.errors import ConfigError

if TYPE_CHECKING:
    from statemachine.worker import Worker


class WorkerCPUBuffer:
    """A `PrimaryBuffer` over ``ranks[r][t]``: rank *r*'s CPU tensor of KV tensor *t*."""

    def __init__(self, ranks: Sequence[Sequence[torch.Tensor]]) -> None:
        if not ranks or not all(ranks):
            raise ConfigError("WorkerCPUBuffer needs at least one rank with one CPU tensor")
        first = ranks[0]
        for r, tensors in enumerate(ranks):
            shapes = [tuple(t.shape) for t in tensors]
            if shapes != [tuple(t.shape) for t in first]:
                raise ConfigError(f"rank {r}'s CPU tensors {shapes} differ from rank 0's")
            for x in tensors:
                if x.dim() != 2 or x.dtype != torch.int8 or x.device.type != "cpu":
                    raise ConfigError("CPU KV tensors must be int8 (num_chunks, chunk_bytes) "
                                      f"tensors on the CPU, got {x.dtype} {tuple(x.shape)} "
                                      f"on {x.device}")
        slots = {x.shape[0] for x in first}
        if len(slots) != 1:
            raise ConfigError(f"CPU tensors with different slot counts {sorted(slots)}")
        self._ranks = [list(tensors) for tensors in ranks]
        self.num_slots: int = slots.pop()
        self._offsets: dict[tuple[int, int], tuple[int, int]] = {}
        offset = 0
        for r, tensors in enumerate(self._ranks):
            for t, tensor in enumerate(tensors):
                self._offsets[r, t] = (offset, tensor.shape[1])
                offset += tensor.shape[1]
        self._slot_bytes = offset

    @classmethod
    def of_workers(cls, workers: Sequence[Worker]) -> WorkerCPUBuffer:
        """Over the CPU tensors of the worker ranks, in rank order."""
        return cls([w.cpu for w in workers])

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_ranks(self) -> int:
        return len(self._ranks)

    def _check(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) \
                or not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot!r} outside [0, {self.num_slots})")

    def read(self, slot: int) -> bytes:
        """Every rank's rows of `slot`, concatenated (a cascade copies them out)."""
        self._check(slot)
        rows = [t[slot] for tensors in self._ranks for t in tensors]
        return torch.cat(rows).numpy().tobytes()

    def write(self, slot: int, data: bytes) -> None:
        """Overwrite every rank's rows of `slot` (a promotion copies into it)."""
        self._check(slot)
        if len(data) != self._slot_bytes:
            raise ValueError(f"slot {slot}: {len(data)} bytes, a slot holds "
                             f"{self._slot_bytes}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.int8)
        for (r, t), (offset, size) in self._offsets.items():
            self._ranks[r][t][slot].copy_(flat[offset:offset + size])

    def part(self, data: bytes, rank: int, tensor: int) -> torch.Tensor:
        """Rank `rank`'s row of KV tensor `tensor` inside a slot's bytes (``int8``)."""
        offset, size = self._offsets[rank, tensor]
        return torch.frombuffer(bytearray(data[offset:offset + size]), dtype=torch.int8)


__all__ = ["WorkerCPUBuffer"]
