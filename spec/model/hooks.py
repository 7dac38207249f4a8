"""The connector's hooks as the model runs them: what each vLLM hook decides and which
trigger it fires (the tables do the rest).

`lookup` is get_num_new_matched_tokens, `alloc` update_state_after_alloc, `build_meta`
build_connector_meta (with the stores it creates), `report` update_connector_output for one
job, `finish` request_finished, `reset` reset_cache.
"""

from __future__ import annotations

from spec import job as J
from spec import request as R
from spec.model import truth
from spec.model.faults import Fault
from spec.model.interpreter import EFFECTS, fire
from spec.model.state import ModelError, World, put_job, put_req, tracked


def _open(w: World) -> None:
    w.step_open = True


def lookup(w: World, r: str, local: int = 0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens (S:1210-1277)."""
    req = tracked(w, r)
    if req.state in R.SCHEDULED:
        fire(w, "request", r, "preempt")
        w.preempted_early.add(r)
        req = tracked(w, r)
    _open(w)
    if req.state == R.PREEMPTED_FLUSHING and Fault.LOOKUP_IGNORES_TRANSFER_JOBS not in w.faults:
        fire(w, "request", r, "lookup_blocked")
        return None, False
    if req.state in R.MUST_RECOMPUTE:
        fire(w, "request", r, "lookup_resolved")
        return 0, False
    keys = w.keys_of(r)
    n_tokens = w.template(r).tokens
    end, defer = local, False
    for c in range(local, min(len(keys), n_tokens - 1)):
        ref = w.chunks.get(keys[c])
        if ref is None:
            break
        if ref == -1 or keys[c] in w.being_loaded:
            defer = True
        end = c + 1
    if defer:
        fire(w, "request", r, "lookup_deferred")
        return None, False
    hit = end - local
    sync = w.bounds.sync_loads and hit > 0
    fire(w, "request", r, "lookup_resolved", hit_tokens=hit, sync=sync)
    return hit, bool(hit) and not sync


def alloc(w: World, r: str, blocks: tuple[int, ...], hit: int, local: int = 0) -> None:
    """update_state_after_alloc (S:1351-1500)."""
    if hit == 0:
        w.batch_alloc.update(blocks)
        put_req(w, tracked(w, r)._replace(hit=None))
        return
    req = tracked(w, r)
    trigger = "load_sync" if req.sync_reserved else "load_async"
    keys = tuple(w.keys_of(r)[local:local + hit])
    w.batch_alloc.update(blocks)
    fire(w, "request", r, trigger, keys=keys, block_ids=tuple(blocks[local:local + hit]),
         first_block_index=local, sync=req.sync_reserved, block_table=tuple(blocks))


def build_meta(w: World, new: dict[str, tuple[int, ...]], cached: dict[str, tuple[int, ...]],
               sched: dict[str, int], finished: frozenset[str],
               preempted: frozenset[str]) -> None:
    """build_connector_meta (S:2103-2196), same order as the implementation."""
    _open(w)
    for r, blocks in [*new.items(), *cached.items()]:
        w.batch_alloc.update(blocks)
        cur = tracked(w, r)
        table = blocks if r in new else (*cur.blocks, *blocks)
        if cur.state in R.SCHEDULED:
            put_req(w, cur._replace(blocks=table))
        else:  # the table says from where a request may be scheduled
            fire(w, "request", r, "schedule", block_ids=table)
    for r in sorted(preempted - w.preempted_early):
        opt = w.reqs.get(r)
        if opt is not None and opt.state in R.SCHEDULED:
            fire(w, "request", r, "preempt")
    for b in sorted(w.batch_alloc):
        if Fault.REALLOC_SKIPS_FENCE in w.faults:
            break
        for jid in sorted(w.block_fence.get(b, frozenset())):
            if jid in w.jobs:
                fire(w, "job", jid, "flush")
    limit = w.bounds.timeout_steps  # after scheduling, preemption and fences, as the impl
    if limit is not None:
        for jid in sorted(w.jobs):
            aged = w.jobs.get(jid)
            if aged is not None and aged.age is not None and aged.age >= limit:
                truth.failed_copy(w, jid)  # its data never confirmed
                fire(w, "job", jid, "time_out")
    for r in [*sched, *sorted(finished)]:
        opt = w.reqs.get(r)
        if opt is not None and opt.state in R.STORE_CANDIDATES:
            _store(w, r, sched.get(r, 0))
    for jid in sorted(w.batch_jobs):
        shipped = w.jobs.get(jid)
        if shipped is not None and shipped.state in J.TO_SHIP:
            fire(w, "job", jid, "ship")
    for r in sorted(finished):
        opt = w.reqs.get(r)
        if opt is not None and opt.state == R.FINISHED_PENDING_FINAL:
            fire(w, "request", r, "finalize")
    _end_step(w)


def _store(w: World, r: str, scheduled: int) -> None:
    req = tracked(w, r)
    if req.load_invalid:
        return  # no store reads KV that a failed load invalidated
    core = w.core[r]
    t = w.template(r)
    if req.finished:
        tokens = core.computed if core.aborted else max(t.tokens, t.tokens - 1)
    else:
        tokens = core.computed + scheduled
    keys = w.keys_of(r)
    n = min(tokens, len(keys), len(req.blocks))
    start = req.cursor
    if start >= n:
        return
    offered = keys[start:n]
    candidates = [c for c in offered if c not in w.chunks]
    if not candidates:
        put_req(w, req._replace(cursor=n))
        return
    if req.signaled:
        w.stores_after_signal.append(r)
    free = (w.bounds.cpu_chunks - len(w.chunks)
            - sum(j.held_slots for j in w.held.values()))
    need = len(candidates) - free
    if need > 0:
        pinned_ok = Fault.EVICT_PINNED_CHUNKS in w.faults
        evictable = sorted(c for c, ref in w.chunks.items()
                           if (ref == 0 or (pinned_ok and ref > 0)) and c not in offered)
        if need > len(evictable):
            fire(w, "request", r, "store_alloc_failed")
            return
        victims = w.choose_victims(evictable, need)
        for c in victims:
            del w.chunks[c]
    for c in candidates:
        w.chunks[c] = -1
    positions = {c: start + i for i, c in enumerate(offered)}
    blocks = tuple(req.blocks[positions[c]] for c in candidates)
    fire(w, "request", r, "store", keys=tuple(candidates), block_ids=blocks, end_chunk=n)


def _end_step(w: World) -> None:
    for jid in w.to_flush:
        j = w.jobs.get(jid) or w.held.get(jid)
        if j is not None:
            put_job(w, j._replace(flush_shipped=True))
    w.to_flush.clear()
    limit = w.bounds.timeout_steps
    for jid, j in list(w.jobs.items()):
        if j.age is not None:  # steps since shipped, capped where it stops mattering
            w.jobs[jid] = j._replace(age=min(j.age + 1, limit) if limit else 1)
    for r, req in list(w.reqs.items()):
        if req.hit is not None or req.sync_reserved:
            w.reqs[r] = req._replace(hit=None, sync_reserved=False)
    w.batch_jobs.clear()
    w.batch_loads.clear()
    w.batch_alloc.clear()
    w.preempted_early.clear()
    w.reset_since_step = False
    w.step_open = False


def report(w: World, jid: int, done: int, failed: int) -> None:
    """update_connector_output for one job's reports (S:2218-2310)."""
    if Fault.AGGREGATE_COUNTS_ONCE in w.faults:  # a summed count {id: n} taken as one report
        done, failed = min(done, 1), min(failed, 1)
    if jid not in w.jobs and jid not in w.held:
        raise ModelError(f"job {jid} is due no report")
    stale = jid in w.held and w.held[jid].state == J.STALE
    if done:
        fire(w, "job", jid, "ack", count=done)
    if failed:
        fire(w, "job", jid, "fail", count=failed)
    if stale:
        fire(w, "fence", None, "stale_report")


def finish(w: World, r: str) -> None:
    if r not in w.reqs:
        fire(w, "request", r, "finish_untracked")
        return
    put_req(w, tracked(w, r)._replace(finished=True))
    fire(w, "request", r, "finish")
    if Fault.SIGNAL_BEFORE_FINAL_STORE in w.faults:
        EFFECTS["signal_request_finished"](w, r)


def reset(w: World) -> None:
    live = len(w.jobs) + sum(1 for j in w.held.values() if j.state == J.TIMED_OUT)
    for r in sorted(w.reqs):
        held = w.reqs[r].jobs
        if held and Fault.RESET_KEEPS_TRANSFER_JOBS in w.faults:
            # vLLM before PR #48102: the jobs leave the table, the request is left as it
            # was, its transfer_jobs naming them (it waits for ends no report can bring)
            for jid in sorted(held & w.jobs.keys()):
                fire(w, "job", jid, "reset")
            put_req(w, tracked(w, r)._replace(cursor=0, hit=None))  # S:2429-2433 did that
            continue
        fire(w, "request", r, "reset")
    for jid in sorted(j.id for j in w.held.values() if j.state == J.TIMED_OUT):
        fire(w, "job", jid, "reset")
    w.chunks.clear()
    if Fault.RESET_KEEPS_STALE_THRESHOLD not in w.faults:
        w.threshold = w.counter
    fire(w, "fence", None, "reset", live_jobs=live)
    w.being_loaded.clear()
    w.block_fence.clear()
    w.reset_since_step = True

