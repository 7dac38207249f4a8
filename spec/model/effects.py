"""The effects the tables name, as the model executes them on a `World`.

Each function is registered under its effect's name (`@effect`); the interpreter runs a row's
effects in order after the subject's state changed. Effects with nothing to do in the model
are listed by `stateless`. A job effect may fire the owner's trigger (`leave_job_table`) or
another job's (`flush_request_jobs`): nesting goes through `fire` like every move.
"""

from __future__ import annotations

from typing import Any

from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK
from spec.model import truth
from spec.model.core import unquarantine
from spec.model.faults import Fault
from spec.model.interpreter import effect, fire, stateless
from spec.model.state import MJob, ModelError, World, job_of, put_job, put_req, tracked
from spec.rules import FailedLoadLookup, StaleLoadFailure


@effect
def create_request_status(w: World, k: str, **kw: Any) -> None:
    w.signals.setdefault(k, 0)


@effect
def restart_from_token_zero(w: World, k: str, **kw: Any) -> None:
    put_req(w, tracked(w, k)._replace(blocks=(), cursor=0, hit=None, kv_load=None,
                                       window_end=0))


@effect
def record_lookup_hit(w: World, k: str, hit_tokens: int = 0, sync: bool = False,
                      **kw: Any) -> None:
    put_req(w, tracked(w, k)._replace(hit=hit_tokens if hit_tokens > 0 else None,
                        sync_reserved=sync))


@effect
def bypass_offload_lookup(w: World, k: str, **kw: Any) -> None:
    put_req(w, tracked(w, k)._replace(load_invalid=False))


@effect
def create_load_job(w: World, k: str, keys: tuple[int, ...] = (),
                    block_ids: tuple[int, ...] = (), end_chunk: int = 0,
                    sync: bool = False, **kw: Any) -> None:
    w.pending_new = MJob(-1, "load", k, pending=w.bounds.workers, sync=sync, keys=keys,
                         blocks=block_ids, unreported=w.bounds.workers)
    fire(w, "job", -1, "create_load")
    r = tracked(w, k)
    put_req(w, r._replace(hit=None, cursor=end_chunk,
                           kv_load=w.last_job if sync else None))


@effect
def mark_chunks_being_loaded(w: World, k: str, keys: tuple[int, ...] = (), **kw: Any) -> None:
    w.being_loaded.update(keys)


@effect
def record_block_ids(w: World, k: str, block_ids: tuple[int, ...] = (), **kw: Any) -> None:
    put_req(w, tracked(w, k)._replace(blocks=tuple(block_ids)))


@effect
def create_store_job(w: World, k: str, keys: tuple[int, ...] = (),
                     block_ids: tuple[int, ...] = (), fenced_block_ids: tuple[int, ...] = (),
                     end_chunk: int = 0, **kw: Any) -> None:
    fenced = frozenset(fenced_block_ids)
    w.pending_new = MJob(-1, "store", k, pending=w.bounds.workers, keys=keys, blocks=block_ids,
                         deferred=frozenset(block_ids) - fenced, fenced=fenced,
                         unreported=w.bounds.workers)
    fire(w, "job", -1, "create_store")
    put_req(w, tracked(w, k)._replace(cursor=end_chunk))


@effect
def flush_request_jobs(w: World, k: str, **kw: Any) -> None:
    if Fault.PREEMPT_SKIPS_FLUSH in w.faults:
        return
    for jid in sorted(tracked(w, k).jobs - w.batch_loads):
        if jid in w.jobs:
            fire(w, "job", jid, "flush")


def _fence_add(w: World, block: int, jid: int) -> None:
    w.block_fence[block] = w.block_fence.get(block, frozenset()) | {jid}


@effect
def register_deferred_fences(w: World, k: str, **kw: Any) -> None:
    if Fault.FINISH_SKIPS_DEFERRED_FENCE in w.faults:
        return
    for jid in sorted(tracked(w, k).jobs):
        if jid in w.jobs:
            for b in w.jobs[jid].deferred:
                _fence_add(w, b, jid)


@effect
def signal_request_finished(w: World, k: str, **kw: Any) -> None:
    r = tracked(w, k)
    if not r.signaled or Fault.RESET_SIGNALS_TWICE in w.faults:
        put_req(w, r._replace(signaled=True))
        w.signals[k] = w.signals.get(k, 0) + 1


@effect
def delete_request_status(w: World, k: str, **kw: Any) -> None:
    w.reqs.pop(k, None)


@effect
def reset_store_cursor(w: World, k: str, **kw: Any) -> None:
    r = tracked(w, k)
    put_req(w, r._replace(cursor=0, hit=None, blocks=_window_blocks_forgotten(w, k, r.blocks)))


def _window_blocks_forgotten(w: World, k: str, table: tuple[int, ...]) -> tuple[int, ...]:
    """The request's table with the window groups' positions before the window of its
    computed tokens zeroed (the core freed them, and may have handed them out since): with
    the cursor back at 0, a store would read them otherwise. Beyond vLLM 0.33.0, which keeps
    them (RESET_KEEPS_STALE_WINDOW_BLOCKS)."""
    b = w.bounds
    if not b.window_groups() or not table \
            or Fault.RESET_KEEPS_STALE_WINDOW_BLOCKS in w.faults:
        return table
    freed = set(b.freed_positions(len(table), tracked(w, k).window_end))
    return tuple(NULL_BLOCK if i in freed else x for i, x in enumerate(table))


@effect
def drop_request_jobs(w: World, k: str, **kw: Any) -> None:
    held = tracked(w, k).jobs
    for jid in sorted(held):
        if jid in w.jobs:
            fire(w, "job", jid, "reset")
    if k in w.reqs:
        put_req(w, tracked(w, k)._replace(jobs=frozenset()))


@effect
def mark_load_invalid(w: World, k: str, **kw: Any) -> None:
    sticky = w.bounds.rules.failed_load_lookup is FailedLoadLookup.FOR_LIFE
    req = tracked(w, k)
    put_req(w, req._replace(load_invalid=True, load_failed=req.load_failed or sticky))


@effect
def poison_request_stores(w: World, k: str, **kw: Any) -> None:
    for jid in sorted(tracked(w, k).jobs):
        j = w.jobs.get(jid)
        if j is not None and j.kind == "store" and j.state != J.FAILING:
            fire(w, "job", jid, "poison")


@effect
def quarantine_load_blocks(w: World, k: str, job_id: int = -1,
                           gpu_block_ids: tuple[int, ...] = (), **kw: Any) -> None:
    w.quarantined_blocks[job_id] = gpu_block_ids


@effect
def signal_untracked_finished(w: World, k: str, **kw: Any) -> None:
    w.signals[k] = w.signals.get(k, 0) + 1


# -- job effects --------------------------------------------------------------------
@effect
def allocate_job_id(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    w.pending_new = j._replace(id=w.counter)
    w.counter += 1


def _new(w: World) -> MJob:
    assert w.pending_new is not None
    return w.pending_new


@effect
def pin_load_chunks(w: World, k: int, **kw: Any) -> None:
    for c in _new(w).keys:
        if w.chunks.get(c, -1) < 0:
            raise ModelError(f"prepare_load of chunk {c} that is not ready")
        w.chunks[c] += 1


@effect
def enter_job_table(w: World, k: int, **kw: Any) -> None:
    j = truth.new_job(w, _new(w))
    w.pending_new = None
    w.jobs[j.id] = j
    r = tracked(w, j.owner)
    put_req(w, r._replace(jobs=r.jobs | {j.id}))
    w.batch_jobs.add(j.id)
    if j.kind == "load":
        w.batch_loads.add(j.id)
    w.last_job = j.id


@effect
def register_store_fences(w: World, k: int, **kw: Any) -> None:
    jid = w.last_job
    j = w.jobs[jid]
    if Fault.SLIDING_WINDOW_SKIPS_FENCE not in w.faults:
        for b in sorted(j.fenced):  # a sliding-window source: the core may free it any step
            _fence_add(w, b, jid)
    if tracked(w, j.owner).finished:
        for b in sorted(j.deferred):
            _fence_add(w, b, jid)
        if j.deferred & w.batch_alloc:
            fire(w, "job", jid, "flush")


@effect
def put_in_metadata(w: World, k: int, **kw: Any) -> None:
    put_job(w, job_of(w, k)._replace(age=0))


@effect
def add_to_jobs_to_flush(w: World, k: int, **kw: Any) -> None:
    if Fault.RESET_SKIPS_FLUSH in w.faults and job_of(w, k).state == J.STALE:
        return
    put_job(w, job_of(w, k)._replace(flush_requested=True))
    w.to_flush.add(k)


@effect
def count_report(w: World, k: int, count: int = 1, **kw: Any) -> None:
    j = job_of(w, k)
    if Fault.STORE_READY_ON_FIRST_ACK in w.faults and j.kind == "store" and j.state != J.STALE:
        ready = [c for c in j.keys if w.chunks.get(c) == -1]
        for c in ready:
            w.chunks[c] = 0
        truth.published(w, j, ready)
    put_job(w, j._replace(pending=j.pending - count))


@effect
def mark_failed(w: World, k: int, **kw: Any) -> None:
    put_job(w, job_of(w, k)._replace(failed=True))


def _unpin(w: World, keys: tuple[int, ...]) -> None:
    for c in keys:
        if c in w.chunks and w.chunks[c] > 0:
            w.chunks[c] -= 1


def _unmark(w: World, j: MJob) -> None:
    """Only an async load marked its keys as being loaded; only it unmarks them."""
    if not j.sync:
        w.being_loaded.difference_update(j.keys)


@effect
def complete_in_manager(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    if j.kind == "store":
        ready = [c for c in j.keys if w.chunks.get(c) == -1]
        for c in ready:
            w.chunks[c] = 0
        truth.published(w, j, ready)
    else:
        truth.loaded(w, j)
        if Fault.COMPLETE_LOAD_KEEPS_PIN not in w.faults:
            _unpin(w, j.keys)
        if Fault.LOAD_KEEPS_CHUNKS_BEING_LOADED not in w.faults:
            _unmark(w, j)


@effect
def roll_back_in_manager(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    if j.kind == "store":
        for c in j.keys:
            if w.chunks.get(c) == -1:
                del w.chunks[c]
    else:
        _unpin(w, j.keys)
        _unmark(w, j)


@effect
def leave_job_table(w: World, k: int, **kw: Any) -> None:
    if k not in w.jobs:
        return
    j = w.jobs.pop(k)
    r = w.reqs.get(j.owner)
    kept = j.state == J.STALE and Fault.RESET_KEEPS_TRANSFER_JOBS in w.faults
    if r is not None and not kept:  # the fault: vLLM before PR #48102 kept the id
        put_req(w, r._replace(jobs=r.jobs - {k}))
    for b in j.deferred | j.fenced:
        if b in w.block_fence:
            w.block_fence[b] = w.block_fence[b] - {k}
            if not w.block_fence[b]:
                del w.block_fence[b]
    if j.state == J.STALE:
        w.held[k] = j
        return
    if j.state == J.TIMED_OUT:
        w.held[k] = j
    fire(w, "request", j.owner, J.ENDING_TRIGGER[j.kind, j.state], job_id=k,
         gpu_block_ids=j.blocks)


@effect
def enter_timeout_quarantine(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    if j.kind == "store":
        held = 0
        for c in j.keys:
            if w.chunks.get(c) == -1:
                del w.chunks[c]
                held += 1
        put_job(w, j._replace(held_slots=held))
    else:
        _unmark(w, j)


@effect
def release_quarantine(w: World, k: int, **kw: Any) -> None:
    j = w.held.pop(k)
    if j.kind == "load":
        _unpin(w, j.keys)
    unquarantine(w, k)


@effect
def enter_reset_fence(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    w.held[k] = j._replace(held_slots=0)


@effect
def count_stale_report(w: World, k: int, count: int = 1, **kw: Any) -> None:
    j = w.held[k]
    w.held[k] = j._replace(pending=j.pending - count)


@effect
def invalidate_orphaned_load(w: World, k: int, **kw: Any) -> None:
    if w.bounds.rules.stale_load_failure is StaleLoadFailure.FENCE_ONLY:
        return  # the connector keeps no mark; the core hears of it (MCore.recv_failed)
    if Fault.STALE_LOAD_FAILURE_IGNORED in w.faults:
        return
    j = w.held[k]
    owner = w.reqs.get(j.owner)
    if j.kind == "load" and owner is not None and owner.state == R.ORPHANED_LOAD:
        w.reqs[owner.id] = owner._replace(load_invalid=True)


@effect
def invalidate_owner_kv(w: World, k: int, **kw: Any) -> None:
    j = job_of(w, k)
    owner = w.reqs.get(j.owner)
    if j.kind == "load" and j.sync and owner is not None and owner.kv_load == k:
        fire(w, "request", owner.id, "kv_invalidated")


@effect
def leave_reset_fence(w: World, k: int, **kw: Any) -> None:
    w.held.pop(k, None)
    unquarantine(w, k)


stateless("start_deferral_timer", "count_allocation_failure", "promote_after_recving",
          "protect_store_chunks", "extend_fence", "signal_reset_flushed",
          "count_ignored_report")
