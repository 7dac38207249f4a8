"""The abstract tiering state: what every layer projects onto (the model, the reference
tiering manager, vLLM's `TieringOffloadingManager`), and what the tiering invariants and the
refinement check compare.

Keys are opaque strings (the machine names them); slots are CPU-tier chunk ids; tiers are
indices into the manager's list of secondary tiers. Everything is sorted, so two projections
of the same situation are equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ


@dataclass(frozen=True, order=True)
class CpuChunk:
    """An indexed key of the CPU tier (a key in state ABSENT is not listed)."""

    key: str
    state: str
    """A `cpu_chunk` state other than ABSENT."""
    slot: int
    readers: int = 0
    """ref_cnt when PINNED, else 0."""


@dataclass(frozen=True, order=True)
class TierCopy:
    """A key that a secondary tier holds or is writing (ABSENT is not listed)."""

    tier: int
    key: str
    state: str
    """A `tier_copy` state other than ABSENT."""


@dataclass(frozen=True, order=True)
class TierJobRecord:
    """A tier job that has not ended for good: queued, in the table or quarantined.

    A queued promotion has no id yet (``job_id`` None)."""

    kind: str
    """"cascade" or "promotion"."""
    tier: int
    req_id: str
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    state: str
    job_id: int | None = None


@dataclass(frozen=True, order=True)
class TierRequestRecord:
    req_id: str
    state: str
    """A `tier_request` state in OPEN (ACTIVE or FINISH_PENDING)."""
    pending_stores: int = 0


@dataclass(frozen=True)
class TieringState:
    cpu: tuple[CpuChunk, ...] = ()
    copies: tuple[TierCopy, ...] = ()
    jobs: tuple[TierJobRecord, ...] = ()
    requests: tuple[TierRequestRecord, ...] = ()
    promotions_held: bool = False
    """Set by a reset while secondary tiers exist, cleared by on_reset_flushed (TM:1198-1202)."""
    num_slots: int = 0
    free_slots: int = 0
    """Slots neither indexed nor quarantined."""
    quarantined_slots: frozenset[int] = field(default_factory=frozenset)

    @staticmethod
    def build(*, cpu: list[CpuChunk], copies: list[TierCopy], jobs: list[TierJobRecord],
              requests: list[TierRequestRecord], promotions_held: bool, num_slots: int,
              free_slots: int, quarantined_slots: frozenset[int] = frozenset()
              ) -> TieringState:
        """Sorted, so that equal situations give equal states."""
        return TieringState(tuple(sorted(cpu)), tuple(sorted(copies)),
                            tuple(sorted(jobs, key=_job_order)), tuple(sorted(requests)),
                            promotions_held, num_slots, free_slots, quarantined_slots)

    def chunk(self, key: str) -> CpuChunk | None:
        for c in self.cpu:
            if c.key == key:
                return c
        return None

    def chunk_state(self, key: str) -> str:
        c = self.chunk(key)
        return CC.ABSENT if c is None else c.state

    def copy_state(self, tier: int, key: str) -> str:
        for c in self.copies:
            if c.tier == tier and c.key == key:
                return c.state
        return TC.ABSENT

    def request_state(self, req_id: str) -> str | None:
        """The request's `tier_request` state if it is open, else None (unknown or
        finalized: the projection cannot tell them apart)."""
        for r in self.requests:
            if r.req_id == req_id:
                return r.state
        return None

    def live_jobs(self) -> tuple[TierJobRecord, ...]:
        return tuple(j for j in self.jobs if j.state in TJ.IN_TABLE)


def _job_order(j: TierJobRecord) -> tuple[object, ...]:
    return (j.job_id is None, j.job_id or 0, j.kind, j.tier, j.req_id, j.keys)


__all__ = ["CpuChunk", "TierCopy", "TierJobRecord", "TierRequestRecord", "TieringState"]
