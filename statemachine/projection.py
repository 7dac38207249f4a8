"""`project(scheduler)`: the live scheduler and manager seen as a `spec.AbstractState`.

This is the abstraction function of the refinement check: the invariants of `spec` are
evaluated on it, and model-based tests compare it with the abstract model stepped by the
same events. It reads, never writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from spec import request as R
from spec.groups import NULL_BLOCK
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord
from statemachine.models import JobStatus, RequestState

if TYPE_CHECKING:
    from statemachine.scheduler import OffloadingScheduler



def _in_window(s: OffloadingScheduler, req: RequestState,
               tables: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The blocks of `tables` the core still gives the request: a sliding-window group
    holds only the blocks in the window of its computed tokens (the core freed the others);
    no null position."""
    cfg = s.config
    return tuple(b for g, table in enumerate(tables)
                 for p, b in enumerate(table)
                 if b != NULL_BLOCK and p >= cfg.skipped_blocks(g, req.scheduled_end))


def _gpu_blocks(s: OffloadingScheduler, req: RequestState) -> tuple[int, ...]:
    # the connector's tables once the core scheduled the request; until then (loading, its
    # tables empty since the lookup: vLLM records them at the schedule) the allocation
    tables = req.group_block_ids if any(req.group_block_ids) else req.load_tables
    if req.state in R.HOLDS_GPU_BLOCKS:
        return _in_window(s, req, tables)
    if req.is_finished:
        # aborted while loading: the core keeps the async load's destinations until it
        # ends, but not those a sliding window had left behind while the request ran
        still = set(_in_window(s, req, tables))
        held: list[int] = []
        for jid in sorted(req.transfer_jobs):
            job = s.jobs.get(jid)
            if job is not None and R.finished_keeps_destinations(job.kind, job.sync):
                held.extend(b for b in job.gpu_block_ids if b in still)
        return tuple(held)
    return ()


def _job_record(s: OffloadingScheduler, job: JobStatus) -> JobRecord:
    return JobRecord(
        id=job.job_id, kind=job.kind, owner=job.owner.req_id, state=job.state,
        pending_count=job.pending_count, sync=job.sync, failed=job.failed,
        keys=frozenset(job.keys), blocks=frozenset(job.gpu_block_ids),
        fenced_blocks=job.fenced_block_ids,
        deferred_fence_blocks=job.deferred_fence_block_ids,
        age=0 if job.shipped_step is None else s.step_index - job.shipped_step,
        flush_requested=job.flush_requested,
    )


def _held(job: JobStatus, due: int) -> HeldJob:
    return HeldJob(job.job_id, job.kind, due, frozenset(job.keys), frozenset(job.gpu_block_ids),
                   job.flush_shipped, job.sync)


def project(s: OffloadingScheduler) -> AbstractState:
    requests = tuple(sorted(
        RequestRecord(
            id=r.req_id, state=r.state, transfer_jobs=frozenset(r.transfer_jobs),
            finished=r.is_finished, finished_signaled=r.finished_signaled,
            load_invalid=r.loaded_tokens_invalid,
            lookup_hit_pending=r.lookup_hit_tokens is not None,
            gpu_blocks=_gpu_blocks(s, r), store_cursor=r.next_stored_chunk_idx,
        ) for r in s.requests.values()))
    fence_jobs = s._fenced_jobs
    return AbstractState(
        num_workers=s.config.num_workers,
        requests=requests,
        jobs=tuple(sorted(_job_record(s, j) for j in s.jobs)),
        job_counter=s.jobs.job_counter,
        stale_threshold=s.jobs.stale_threshold,
        reset_fence=tuple(sorted(
            _held(fence_jobs[jid], due) if jid in fence_jobs else HeldJob(jid, "store", due)
            for jid, due in s.fence.entries.items())),
        quarantine=tuple(sorted(_held(j, j.pending_count) for j in s.jobs.quarantine.values())),
        chunks_being_loaded=frozenset(s.chunks_being_loaded),
        chunk_ref_cnt=tuple(sorted(s.manager.chunk_ref_counts().items())),
        block_fence=tuple(sorted((b, frozenset(ids)) for b, ids in s.block_fence.items())),
        jobs_to_flush=frozenset(s.jobs_to_flush),
        step_open=s.step_open,
        reset_since_last_step=s.reset_since_last_step,
        finished_signals=tuple(sorted(s.manager.finished_signals.items())),
        stores_after_signal=tuple(sorted(s.manager.stores_after_finish)),
    )
