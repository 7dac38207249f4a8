"""The reference tiering manager, projected onto the abstract tiering state
(`spec.tiering.state.TieringState`) that the model and vLLM's tiering manager project onto.

CPU chunks come from the CPU tier's reference counts (-1: write pending, 0: ready, n > 0:
pinned by n readers, M:214-258), a write-pending key being PROMOTION_QUEUED or PROMOTING when
a queued or submitted promotion writes it; copies come from each tier (`copy_states`); jobs
are the queued promotions, the job table and the quarantined jobs; requests are the open
ones.
"""

from __future__ import annotations

from collections.abc import Callable

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_job as TJ
from spec.tiering.state import (
    CpuChunk,
    TierCopy,
    TieringState,
    TierJobRecord,
    TierRequestRecord,
)
from statemachine.policies import OffloadKey
from statemachine.tiering.manager import TieringManager

KeyName = Callable[[OffloadKey], str]


def project(m: TieringManager, name: KeyName = str) -> TieringState:
    """`m`'s state; `name` gives a key's name in the abstract state."""
    jobs = m.jobs()
    queued = {k for j in jobs if j.is_promotion and j.state == TJ.QUEUED for k in j.keys}
    promoting = {k for j in jobs if j.is_promotion and j.state in TJ.IN_TABLE for k in j.keys}
    cpu: list[CpuChunk] = []
    for key, ref in m.primary.chunk_ref_counts().items():
        slot = m.primary.chunk_id(key)
        assert slot is not None
        if ref < 0:
            state = (CC.PROMOTION_QUEUED if key in queued else
                     CC.PROMOTING if key in promoting else CC.WRITE_PENDING)
        else:
            state = CC.PINNED if ref > 0 else CC.READY
        cpu.append(CpuChunk(name(key), state, slot, max(ref, 0)))
    copies = [TierCopy(i, name(key), state) for i, tier in enumerate(m.tiers)
              for key, state in tier.copy_states().items()]
    records = [TierJobRecord(j.kind, j.tier, j.req_id, tuple(name(k) for k in j.keys),
                             tuple(j.slots), j.state, j.job_id) for j in jobs]
    requests = [TierRequestRecord(r.key, r.state, r.pending_stores) for r in m.open_requests()]
    return TieringState.build(
        cpu=cpu, copies=copies, jobs=records, requests=requests,
        promotions_held=m.promotions_held, num_slots=m.num_slots,
        free_slots=m.primary.num_free_slots(),
        quarantined_slots=m.primary.quarantined_slots)


__all__ = ["project"]
