"""The model state seen as `spec.AbstractState` (what the invariants are written over), and
its canonical form (job ids renumbered), the unit of the checker's visited set."""

from __future__ import annotations

from dataclasses import replace

from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK
from spec.model.state import MJob, ModelState
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord


def _held(s: ModelState, table: tuple[int, ...], window_end: int) -> tuple[int, ...]:
    """The blocks of the connector's table the request still holds: a window group's
    positions only in the window of its computed tokens (the core frees those before it);
    no null position."""
    b = s.bounds
    if not b.window_groups():
        return table
    freed = set(b.freed_positions(len(table), window_end))
    return tuple(x for i, x in enumerate(table) if x != NULL_BLOCK and i not in freed)


def abstract(s: ModelState, step_open: bool = False) -> AbstractState:
    """The model state seen as spec.AbstractState (what the invariants are written over)."""
    reqs = []
    core = dict(s.core)
    for q in s.reqs:
        # the connector's table once the core scheduled the request; until then (loading,
        # its table empty since the lookup: vLLM records it at the schedule) the core's
        table = q.blocks or core[q.id].blocks
        if q.state in R.HOLDS_GPU_BLOCKS:
            blocks = _held(s, table, q.window_end)
        elif q.finished:
            # aborted while loading: the core keeps the async load's destinations until it
            # ends, but not those a sliding window had left behind while the request ran
            still = set(_held(s, table, q.window_end))
            blocks = tuple(b for j in s.jobs if j.owner == q.id
                           and R.finished_keeps_destinations(j.kind, j.sync)
                           for b in j.blocks if b in still)
        else:
            blocks = ()
        reqs.append(RequestRecord(q.id, q.state, q.jobs, q.finished, q.signaled,
                                  q.load_invalid, q.hit is not None, tuple(blocks), q.cursor))
    jobs = tuple(JobRecord(j.id, j.kind, j.owner, j.state, j.pending, j.sync, j.failed,
                           frozenset(j.keys), frozenset(j.blocks), j.fenced,
                           j.deferred, j.age or 0, j.flush_requested) for j in s.jobs)
    fence = tuple(HeldJob(j.id, j.kind, j.pending, frozenset(j.keys), frozenset(j.blocks),
                          j.flush_shipped, j.sync) for j in s.held if j.state == J.STALE)
    quarantine = tuple(HeldJob(j.id, j.kind, j.pending, frozenset(j.keys),
                               frozenset(j.blocks), j.flush_shipped, j.sync)
                       for j in s.held if j.state == J.TIMED_OUT)
    return AbstractState(
        num_workers=s.bounds.workers, requests=tuple(sorted(reqs)), jobs=tuple(sorted(jobs)),
        job_counter=s.counter, stale_threshold=s.threshold, reset_fence=fence,
        quarantine=quarantine, chunks_being_loaded=s.being_loaded, chunk_ref_cnt=s.chunks,
        block_fence=s.block_fence, jobs_to_flush=s.to_flush, step_open=step_open,
        reset_since_last_step=s.reset_since_step, finished_signals=s.signals,
        invalid_chunks=s.bad_chunks, misplaced_chunks=s.misplaced,
        unwritten_reads=s.unwritten,
        stores_after_signal=s.stores_after_signal,
    )


def renumbering(s: ModelState) -> dict[int, int]:
    """The canonical id of every job id `s` mentions: dense, in the same order."""
    ids = sorted({j.id for j in (*s.jobs, *s.held)} | {i for r in s.reqs for i in r.jobs}
                 | set(s.to_flush) | {i for _, ids in s.block_fence for i in ids}
                 | {i for i, _ in s.quarantined_blocks})
    return {old: new for new, old in enumerate(ids)}


def canonical(s: ModelState) -> ModelState:
    """The state with job ids renumbered densely (order kept): two states that differ only
    in how many jobs came before are the same state for every property checked. A request's
    `kv_load`, or the core's `load_job`, naming a job that is gone (no report of it can
    come) is dropped."""
    known = {j.id for j in (*s.jobs, *s.held)}
    ren = renumbering(s)
    below = sum(1 for i in ren if i < s.threshold)
    dangling = any(r.kv_load is not None and r.kv_load not in known for r in s.reqs) or any(
        c.load_job is not None and c.load_job not in known for _, c in s.core)
    if all(old == new for old, new in ren.items()) and s.counter == len(ren) \
            and s.threshold == below and not dangling:
        return s

    def j(x: MJob) -> MJob:
        return x._replace(id=ren[x.id])

    return replace(
        s, reqs=tuple(r._replace(jobs=frozenset(ren[i] for i in r.jobs),
                                 kv_load=ren[r.kv_load] if r.kv_load in known else None)
                      for r in s.reqs),
        jobs=tuple(j(x) for x in s.jobs), held=tuple(j(x) for x in s.held),
        counter=len(ren), threshold=below,
        block_fence=tuple((b, frozenset(ren[i] for i in v)) for b, v in s.block_fence),
        to_flush=frozenset(ren[i] for i in s.to_flush),
        quarantined_blocks=tuple((ren[i], v) for i, v in s.quarantined_blocks),
        core=tuple((r, c._replace(load_job=ren[c.load_job] if c.load_job in known else None))
                   for r, c in s.core))
