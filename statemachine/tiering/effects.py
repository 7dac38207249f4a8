"""The effects named in the tier-job and tiering-request tables, as methods: the lifecycles call
them, nothing else does.

Each method implements one effect of `spec.tiering.tier_job` or `spec.tiering.tier_request`,
under the same name, with the subject first. A `TieringManager` owns one `TieringEffects`, the
host of its two lifecycles, which works on the manager's tables (``self.m``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from statemachine.tiering.models import TierJob, TierRequest

if TYPE_CHECKING:
    from statemachine.tiering.manager import TieringManager


class TieringEffects:
    def __init__(self, manager: TieringManager) -> None:
        self.m = manager

    # ================================================================ tier-job effects
    def reserve_promotion(self, job: TierJob, **_: Any) -> None:
        """The (tier, request) entry of _pending_load_submissions (TM:727-737); the caller
        appends each reserved key and slot."""
        self.m._pending.setdefault(job.tier, {})[job.req_id] = job

    def allocate_tier_job_id(self, job: TierJob, **_: Any) -> None:
        """(TM:434-438)"""
        job.job_id = self.m._job_id_counter
        self.m._job_id_counter += 1

    def enter_tier_job_table(self, job: TierJob, **_: Any) -> None:
        """(TM:440-443)"""
        assert job.job_id is not None
        self.m._jobs[job.job_id] = job
        job.submit_step = self.m.step

    def submit_io(self, job: TierJob, **_: Any) -> None:
        """submit_load / submit_store (TB:226-277, TM:761, TM:975)."""
        tier = self.m.tiers[job.tier]
        if job.is_promotion:
            tier.submit_load(job.transfer_job())
            self.m.stats["promotions"] += 1
        else:
            tier.submit_store(job.transfer_job())
            self.m.stats["cascades"] += 1

    def queue_result(self, job: TierJob, **_: Any) -> None:
        """The tier queued the job's result (TP:190-194); the manager only notes it."""
        self.m.stats["io_reports"] += 1

    def apply_result(self, job: TierJob, **_: Any) -> None:
        """Out of the table; a cascade's pins released (complete_read, TM:543-548), a
        promotion's keys published or freed (complete_write, TM:460-499)."""
        assert job.job_id is not None and job.result is not None
        del self.m._jobs[job.job_id]
        if job.is_promotion:
            self.m._complete_promotion(job, job.result)
        else:
            self.m.primary.complete_read(job.keys, job.ctx)
            job.pins_held = False

    def count_failure(self, job: TierJob, **_: Any) -> None:
        """(TM:559-587; back-pressure is out of scope)"""
        self.m.stats["promotion_failures" if job.is_promotion else "cascade_failures"] += 1

    def quarantine_job(self, job: TierJob, **_: Any) -> None:
        """Out of the table; a promotion's write-pending keys leave the CPU tier's index,
        their slots quarantined on the job's behalf; a cascade keeps its pins (beyond
        vLLM)."""
        assert job.job_id is not None
        del self.m._jobs[job.job_id]
        self.m._quarantined[job.job_id] = job
        if job.is_promotion:
            slots = self.m.primary.quarantine_store(job.keys)
            self.m._hold_slots(job, slots)
            self.m._drop_load_sources(job.req_id, job.keys, job.tier)

    def suspect_tier(self, job: TierJob, **_: Any) -> None:
        """Lookups skip the tier while it holds a quarantined job (beyond vLLM): the
        quarantine itself makes it suspect; counted here."""
        self.m.stats["tiers_suspected"] += 1

    def release_quarantine(self, job: TierJob, **_: Any) -> None:
        """The late result is discarded: the job's pins dropped (if the CPU tier still has
        its keys) or its quarantined slots freed (beyond vLLM)."""
        assert job.job_id is not None
        del self.m._quarantined[job.job_id]
        if job.pins_held:
            self.m.primary.complete_read(job.keys, job.ctx)
            job.pins_held = False
        self.m._release_slots(job)
        self.m.stats["late_results"] += 1

    def drop_reservation(self, job: TierJob, **_: Any) -> None:
        """(TM:1171-1174) The CPU tier's reset frees the reserved slots."""
        del self.m._pending[job.tier][job.req_id]
        if not self.m._pending[job.tier]:
            del self.m._pending[job.tier]
        self.m.stats["dropped_promotions"] += 1

    # ================================================================ request effects
    def register_request(self, req: TierRequest, **_: Any) -> None:
        """(TM:1025-1035)"""
        self.m._requests[req.key] = req
        self.m._finalized.discard(req.key)

    def count_pending_store(self, req: TierRequest, **_: Any) -> None:
        """(TM:862-864)"""
        req.pending_stores += 1

    def count_store_completed(self, req: TierRequest, **_: Any) -> None:
        """(TM:979-983)"""
        req.pending_stores -= 1

    def mark_finished(self, req: TierRequest, **_: Any) -> None:
        """(TM:1051-1054)"""
        req.is_finished = True

    def finalize_in_tiers(self, req: TierRequest, **_: Any) -> None:
        """Every tier's on_request_finished; the record goes (TM:1074-1080)."""
        for tier in self.m.tiers:
            tier.on_request_finished(req.key)
        self.m._load_sources.pop(req.key, None)
        del self.m._requests[req.key]
        self.m._finalized.add(req.key)

    def clear_pending_stores(self, req: TierRequest, **_: Any) -> None:
        """(TM:1178-1181)"""
        req.pending_stores = 0


__all__ = ["TieringEffects"]
