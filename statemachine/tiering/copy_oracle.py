"""The byte oracle of the tiers: every copy a cascade publishes, and every copy a promotion
reads back, holds the bytes of its key's blocks (`statemachine.oracle`: a pure function of
the block's token prefix, its layer and its rank).

What a copy must hold comes from the GPU store that filled the CPU slot it was copied from:
when the engine ships a store job it tells the oracle (`note_store`) which rows of which
slot receive which blocks (their prefix hashes), under which key and in which KV cache group.
When a cascade is submitted (`cascade_submitted`, the slot pinned) the slot's truth becomes
the expected content of the key's copy in that tier; the oracle checks it against the bytes
the cascade publishes (`copy_written`) and, later, against the bytes a promotion reads from
the copy (`copy_read`), before they land in a CPU slot. The loads of promoted chunks are then
checked by the engine, as every load is.

Only the rows a GPU store wrote are checked: a sliding window's chunk may leave its leading
rows unwritten (their bytes are whatever the slot held). When several cascades of one key
into one tier are submitted before its copy is published, only the rows all of them wrote
are checked (whichever publishes, those rows are the key's).

`copy_written` and `copy_read` run on a tier's I/O thread when the tier has threads, so they
only record: `take_problems` hands the findings to the engine, which raises
`CorruptedCopy` after the step's tier I/O.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from statemachine.oracle import CorruptedBytes, first_mismatch_rows
from statemachine.policies import OffloadKey
from statemachine.tiering.torch_buffer import WorkerCPUBuffer


@dataclass(frozen=True)
class SlotTruth:
    """What a GPU store wrote into one CPU slot: `key`'s chunk of KV cache group `group`,
    rows ``(row in chunk, prefix hash of the block)``."""

    key: OffloadKey
    group: int
    rows: tuple[tuple[int, int], ...]
    source: str
    """Which store wrote it (for messages)."""

    def common(self, other: SlotTruth) -> SlotTruth:
        """The rows both wrote (same key: same hashes)."""
        mine = dict(self.rows)
        rows = tuple((r, h) for r, h in other.rows if mine.get(r) == h)
        return SlotTruth(self.key, self.group, rows, self.source)


class CorruptedCopy(CorruptedBytes):
    """A tier copy holds other bytes than its key's blocks: a cascade copied the wrong slot or
    a slot already reused, or a copy was damaged in the tier."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        Exception.__init__(self, f"{problems[0]}{more}")


class CopyOracle:
    """Checks the tiers' copies (a `statemachine.tiering.connector.CopyObserver`).
    `tensors_of(group)`: the KV tensor indices of a group; `page_bytes[t]`: a page of KV
    tensor t."""

    def __init__(self, buffer: WorkerCPUBuffer, tensors_of: Callable[[int], Sequence[int]],
                 page_bytes: Sequence[int], blocks_per_chunk: int) -> None:
        self.buffer = buffer
        self.tensors_of = tensors_of
        self.page_bytes = tuple(page_bytes)
        self.blocks_per_chunk = blocks_per_chunk
        self.slot_truth: dict[int, SlotTruth] = {}
        """CPU slot -> what the last GPU store into it wrote."""
        self.copy_truth: dict[tuple[int, OffloadKey], SlotTruth] = {}
        """(tier, key) -> what the tier's copy of the key must hold."""
        self._lock = threading.Lock()
        self._problems: list[str] = []
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ main thread
    def note_store(self, slot: int, truth: SlotTruth) -> None:
        """A GPU store job was shipped that writes `truth` into `slot` (the slot is write
        pending until the store completes: nothing else writes it meanwhile)."""
        self.slot_truth[slot] = truth

    def cascade_submitted(self, tier: int, key: OffloadKey, slot: int, writes: bool) -> None:
        truth = self.slot_truth.get(slot)
        if truth is None or truth.key != key:
            held = "no GPU store's" if truth is None else f"key {truth.key:#x}'s"
            self._problem(f"a cascade to tier {tier} copies slot {slot} as key {key:#x}'s "
                          f"copy, but the slot holds {held} bytes")
            return
        self.stats["cascades_observed"] += 1
        if not writes:
            return
        with self._lock:
            old = self.copy_truth.get((tier, key))
            self.copy_truth[tier, key] = truth if old is None else old.common(truth)

    # ------------------------------------------------------------------ I/O threads
    def copy_written(self, tier: int, key: OffloadKey, data: bytes) -> None:
        with self._lock:
            truth = self.copy_truth.get((tier, key))
        if truth is None:
            self._problem(f"tier {tier} publishes a copy of key {key:#x} that no cascade "
                          "was submitted to write")
            return
        wrong = self._check(data, truth)
        if wrong:
            self._problem(f"tier {tier}: the cascade of key {key:#x} (written by "
                          f"{truth.source}) publishes wrong bytes: {wrong}. The cascade read "
                          "another slot, or a slot reused before it copied (a missing pin)")
        else:
            with self._lock:
                self.stats["copies_written_verified"] += 1

    def copy_read(self, tier: int, key: OffloadKey, data: bytes) -> None:
        with self._lock:
            truth = self.copy_truth.get((tier, key))
        if truth is None:
            self._problem(f"a promotion from tier {tier} reads a copy of key {key:#x} that "
                          "no cascade wrote")
            return
        wrong = self._check(data, truth)
        if wrong:
            self._problem(f"a promotion from tier {tier} reads key {key:#x}'s copy (written "
                          f"by {truth.source}) with wrong bytes: {wrong}")
        else:
            with self._lock:
                self.stats["promoted_copies_verified"] += 1

    # ------------------------------------------------------------------ checks
    def _check(self, data: bytes, truth: SlotTruth) -> str | None:
        """The first wrong row of `data` (a slot's bytes) against `truth`, in words."""
        if len(data) != self.buffer.slot_bytes:
            return f"{len(data)} bytes, a slot holds {self.buffer.slot_bytes}"
        if not truth.rows:
            return None
        rows = [r for r, _ in truth.rows]
        hashes = [h for _, h in truth.rows]
        bpc = self.blocks_per_chunk
        for rank in range(self.buffer.num_ranks):
            for t in self.tensors_of(truth.group):
                page = self.page_bytes[t]
                actual = self.buffer.part(data, rank, t).view(bpc, page)[rows]
                m = first_mismatch_rows(actual, hashes, t, rank)
                if m is not None:
                    return (f"rank {rank}, layer {t}, row {rows[m.position]} of the chunk, "
                            f"offset {m.offset}: expected {m.expected & 0xFF:#04x}, found "
                            f"{m.actual & 0xFF:#04x} ({m.bad_blocks} row(s) differ)")
        return None

    def _problem(self, text: str) -> None:
        with self._lock:
            self._problems.append(text)

    def take_problems(self) -> list[str]:
        with self._lock:
            out, self._problems = self._problems, []
        return out


__all__ = ["CopyOracle", "CorruptedCopy", "SlotTruth"]
