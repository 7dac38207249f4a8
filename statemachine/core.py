"""What every stand-in for vLLM's core scheduler shares: block hashes, the GPU block pool,
the blocks an admission takes, and the record of one `schedule()` that the connector's
`build_connector_meta` receives.

The stand-ins: `statemachine.engine` (the small engine), `tests/driver.py` (step by step
for the scheduler tests), `bench/scheduler.py` (a seeded trace for both connectors) and the
conformance adapter (which plays the core around vLLM's connector). The abstract model's
core (`spec.model.core`) works on immutable values and picks the lowest free blocks, to keep
its state space canonical; it follows the same state groups of `spec`.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from statemachine.errors import KVSpecError
from statemachine.messages import BlockTable, CachedRequestData, NewRequestData, SchedulerOutput

_HASH_MASK = (1 << 61) - 1


class CoreError(KVSpecError):
    """The core's bookkeeping broke: more blocks asked than free, a block freed twice."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefix_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block given its parent's hash: a function of the whole prefix."""
    return hash((parent, tuple(tokens))) & _HASH_MASK


def block_hashes(tokens: Sequence[int], block_size: int,
                 known: Sequence[int] = ()) -> list[int]:
    """One hash per full block of `tokens`, extending the `known` ones."""
    out = list(known)
    parent = out[-1] if out else 0
    for i in range(len(out), len(tokens) // block_size):
        parent = prefix_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def blocks_needed(tokens: int, block_size: int, held: int) -> int:
    """Blocks to add to a table of `held` blocks so that it holds `tokens` tokens."""
    return max(0, cdiv(tokens, block_size) - held)


class BlockPool:
    """GPU block ids in a FIFO free list, as vLLM's free block queue hands them out: the
    first freed is the first reused. Ids `first` .. `first + num_blocks - 1`.

    The list is the ids never handed out, in order (`_fresh` .. the end, kept as a range, so
    a pool of a million blocks costs nothing to make), then the freed ones in the order they
    were freed."""

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        self.first, self.num_blocks = first, num_blocks
        self._fresh = first
        self._freed: deque[int] = deque()
        self._freed_set: set[int] = set()

    @property
    def _end(self) -> int:
        return self.first + self.num_blocks

    def __len__(self) -> int:
        return self._end - self._fresh + len(self._freed)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(range(self._fresh, self._end), self._freed)

    def __contains__(self, block: object) -> bool:
        try:
            b = operator.index(block)  # type: ignore[arg-type]  # any int-like id
        except TypeError:
            return False
        return self._fresh <= b < self._end or b in self._freed_set

    def allocate(self, n: int) -> list[int]:
        if n > len(self):
            raise CoreError(f"allocate {n} blocks with {len(self)} free")
        take = min(n, self._end - self._fresh)
        out = list(range(self._fresh, self._fresh + take))
        self._fresh += take
        for _ in range(n - take):
            b = self._freed.popleft()
            self._freed_set.discard(b)
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b in self or not self.first <= b < self._end:
                raise CoreError(f"GPU block {b} freed twice (or out of range)")
            self._freed_set.add(b)
            self._freed.append(b)


def as_block_table(table: BlockTable | Sequence[int] | Sequence[Sequence[int]]) -> BlockTable:
    """A copy of a block table as the messages carry it: a flat tuple of ids (one group), or
    one tuple per KV cache group."""
    if all(type(b) is int for b in table):
        return tuple(b for b in table if type(b) is int)
    return tuple(tuple(t) for t in table if not isinstance(t, int))


@dataclass
class CoreStep:
    """One `schedule()` as `build_connector_meta` sees it."""

    new: dict[str, BlockTable] = field(default_factory=dict)
    """First scheduling of a request: its whole block table (one per KV cache group, or one
    flat table for one group)."""
    cached: dict[str, BlockTable] = field(default_factory=dict)
    """Scheduled again, in scheduling order: a request that keeps running with the blocks
    added in this step, or one resumed after a preemption with its whole new table."""
    resumed: set[str] = field(default_factory=set)
    """The requests of `cached` resumed after a preemption."""
    num_scheduled: dict[str, int] = field(default_factory=dict)
    finished: frozenset[str] = frozenset()
    """Requests finished since the previous step."""
    preempted: frozenset[str] = frozenset()
    """Requests the core preempted since the previous step (and did not schedule again in
    this one)."""
    handoffs: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    """The state blocks the core commits in this step, as `(group, block, boundary)`
    (`SchedulerOutput.boundary_state_offloads`)."""

    def scheduler_output(self) -> SchedulerOutput:
        """The project's `SchedulerOutput` of this step."""
        return SchedulerOutput(
            tuple(NewRequestData(r, b) for r, b in self.new.items()),
            tuple(CachedRequestData(r, b, resumed_from_preemption=r in self.resumed)
                  for r, b in self.cached.items()),
            dict(self.num_scheduled), self.finished, self.preempted,
            boundary_state_offloads=dict(self.handoffs))


class StepLedger:
    """The core's record between two `build_connector_meta` calls: which requests it
    scheduled before (so a later scheduling is a resumption), which finished and which it
    preempted since the last step. `close` gives the step and starts the next."""

    def __init__(self) -> None:
        self.scheduled_before: set[str] = set()
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self._step = CoreStep()

    def admit(self, rid: str, table: BlockTable | Sequence[int], tokens: int) -> None:
        """`rid` is scheduled from the waiting queue, with its whole block table."""
        if rid in self.scheduled_before:
            self._step.cached[rid] = as_block_table(table)
            self._step.resumed.add(rid)
        else:
            self._step.new[rid] = as_block_table(table)
        self._step.num_scheduled[rid] = tokens
        self.scheduled_before.add(rid)

    def run(self, rid: str, new_blocks: BlockTable | Sequence[int], tokens: int) -> None:
        """`rid` keeps running, with the blocks added in this step."""
        self._step.cached[rid] = as_block_table(new_blocks)
        self._step.num_scheduled[rid] = tokens

    def finish(self, rid: str) -> None:
        self._finished.add(rid)

    def preempt(self, rid: str) -> None:
        self._preempted.add(rid)

    def has_finished(self) -> bool:
        """Requests finished since the last step: the connector has yet to hear of them."""
        return bool(self._finished)

    def close(self) -> CoreStep:
        step = self._step
        step.finished = frozenset(self._finished)
        step.preempted = frozenset(self._preempted - step.num_scheduled.keys())
        self._finished, self._preempted, self._step = set(), set(), CoreStep()
        return step
