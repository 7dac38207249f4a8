"""The abstract model: the lifecycle, executed on immutable values, for exhaustive checking.

A `ModelState` is a hashable value: the connector's requests and jobs (as in
`spec.state.AbstractState`), the manager's chunks, the reset fence, the timeout quarantine,
plus the little the invariants do not speak of but the semantics need (store cursors, a
small core scheduler: which request waits, loads, runs, which GPU blocks are free).

Every move goes through the tables. `fire()` interprets them: it finds the row for the
subject's state and trigger, evaluates the row's guards (the functions of `GUARDS`, by the
names the table gives), sets the destination and runs the row's effects (the functions of
`EFFECTS`, by name). So the action set of the model is the set of table transitions, and a
table edit changes the model. The engine-level events (`Event`) decide which trigger fires,
as the hooks of the implementation do; each event also records the hook calls it stands for
(`Call`), which the refinement tests replay against an implementation.

Granularity: one token is one GPU block is one chunk (block_size 1, blocks_per_chunk 1); the
chunk key of request template `t` at position `c` is `key(t.family, c)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from spec import fence as F
from spec import job as J
from spec import request as R
from spec.schema import MachineSpec, guard_name, guard_negated
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord

# ============================================================================ config
CoreStatus = Literal["waiting", "remote", "running", "finished"]


@dataclass(frozen=True)
class Template:
    """A request the environment may send: its id, its prefix family and prompt length."""

    req_id: str
    family: int
    tokens: int


def key(family: int, position: int) -> int:
    """The chunk key at `position` of a prompt of `family` (shared prefixes share keys)."""
    return family * 1000 + position + 1


@dataclass(frozen=True)
class Bounds:
    """What the environment may do; the state space is finite under these bounds."""

    requests: int = 2
    tokens: int = 2
    shared_prefix: bool = True
    workers: int = 2
    cpu_chunks: int = 2
    gpu_blocks: int = 4
    resets: int = 1
    failures: int = 1
    preemptions: int = 1
    timeout_steps: int | None = None
    sync_loads: bool = False
    partial_reports: bool = True
    families: int | None = None
    """Distinct prompt prefixes (request i has family i % families); None: from
    shared_prefix (one family, or one per request)."""
    stray_reports: bool = False
    """Also send a report for a stale job that already drained (a confused worker)."""

    def templates(self) -> tuple[Template, ...]:
        def family(i: int) -> int:
            if self.families is not None:
                return i % self.families
            return 0 if self.shared_prefix else i

        return tuple(Template(f"r{i}", family(i), self.tokens) for i in range(self.requests))


# ============================================================================ records
class MReq(NamedTuple):
    id: str
    state: str = R.ABSENT
    jobs: frozenset[int] = frozenset()
    finished: bool = False
    signaled: bool = False
    load_invalid: bool = False
    hit: int | None = None
    sync_reserved: bool = False
    blocks: tuple[int, ...] = ()
    cursor: int = 0
    local: int = 0
    kv_load: int | None = None
    """The sync load the request's KV depends on, until its next restart."""


class MJob(NamedTuple):
    id: int
    kind: Literal["load", "store"]
    owner: str
    state: str = J.UNALLOCATED
    pending: int = 0
    sync: bool = False
    failed: bool = False
    keys: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    deferred: frozenset[int] = frozenset()
    age: int | None = None
    flush_requested: bool = False
    flush_shipped: bool = False
    held_slots: int = 0
    unreported: int = 0
    """The environment's truth: workers that have not reported this job yet (the scheduler's
    `pending` should equal it; a fault in the accounting makes them differ)."""


class MCore(NamedTuple):
    """The core scheduler's view of one request."""

    status: CoreStatus = "waiting"
    computed: int = 0
    blocks: tuple[int, ...] = ()
    aborted: bool = False
    loading: int = 0
    """Tokens an async load brings (WAITING_FOR_REMOTE_KVS)."""


@dataclass(frozen=True)
class ModelState:
    bounds: Bounds
    reqs: tuple[MReq, ...] = ()
    jobs: tuple[MJob, ...] = ()
    held: tuple[MJob, ...] = ()
    """Jobs out of the table still due reports: STALE (fence) or TIMED_OUT (quarantine)."""
    counter: int = 0
    threshold: int = 0
    fence_state: str = F.FENCE_IDLE
    chunks: tuple[tuple[int, int], ...] = ()
    being_loaded: frozenset[int] = frozenset()
    block_fence: tuple[tuple[int, frozenset[int]], ...] = ()
    to_flush: frozenset[int] = frozenset()
    reset_since_step: bool = False
    signals: tuple[tuple[str, int], ...] = ()
    quarantined_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    core: tuple[tuple[str, MCore], ...] = ()
    pending_finished: frozenset[str] = frozenset()
    pending_preempted: frozenset[str] = frozenset()
    free_blocks: frozenset[int] = frozenset()
    budget: tuple[int, int, int] = (0, 0, 0)
    """Environment events used so far: resets, failures, preemptions."""
    stores_after_signal: tuple[str, ...] = ()


# ============================================================================ the world
class ModelError(Exception):
    """The model hit something the spec forbids: a trigger with no row (or no guard
    combination) in the subject's state, a manager contract broken. A finding."""


class NotEnabled(ModelError):
    """The environment cannot send this event in this state (not a finding)."""


@dataclass
class World:
    """A mutable working copy of a ModelState for the duration of one event."""

    bounds: Bounds
    reqs: dict[str, MReq]
    jobs: dict[int, MJob]
    held: dict[int, MJob]
    counter: int
    threshold: int
    fence_state: str
    chunks: dict[int, int]
    being_loaded: set[int]
    block_fence: dict[int, frozenset[int]]
    to_flush: set[int]
    reset_since_step: bool
    signals: dict[str, int]
    quarantined_blocks: dict[int, tuple[int, ...]]
    core: dict[str, MCore]
    pending_finished: set[str]
    pending_preempted: set[str]
    free_blocks: set[int]
    budget: list[int]
    faults: frozenset[str] = frozenset()
    """Named faults switched on (the mutant catalogue); empty for the spec itself."""
    step_open: bool = False
    batch_jobs: set[int] = field(default_factory=set)
    batch_loads: set[int] = field(default_factory=set)
    batch_alloc: set[int] = field(default_factory=set)
    preempted_early: set[str] = field(default_factory=set)
    stores_after_signal: list[str] = field(default_factory=list)
    fired: list[tuple[str, int]] = field(default_factory=list)
    """(machine, transition index) of every row fired: the coverage."""
    moves: list[tuple[str, Any, str, str, str]] = field(default_factory=list)
    """(machine, subject, source, destination, trigger) of every row fired, in order."""

    @classmethod
    def thaw(cls, s: ModelState) -> World:
        return cls(s.bounds, {r.id: r for r in s.reqs}, {j.id: j for j in s.jobs},
                   {j.id: j for j in s.held}, s.counter, s.threshold, s.fence_state,
                   dict(s.chunks), set(s.being_loaded), dict(s.block_fence), set(s.to_flush),
                   s.reset_since_step, dict(s.signals), dict(s.quarantined_blocks),
                   dict(s.core), set(s.pending_finished), set(s.pending_preempted),
                   set(s.free_blocks), list(s.budget),
                   stores_after_signal=list(s.stores_after_signal))

    def freeze(self) -> ModelState:
        return ModelState(
            self.bounds, tuple(sorted(self.reqs.values(), key=lambda r: r.id)),
            tuple(sorted(self.jobs.values(), key=lambda j: j.id)),
            tuple(sorted(self.held.values(), key=lambda j: j.id)), self.counter,
            self.threshold, self.fence_state, tuple(sorted(self.chunks.items())),
            frozenset(self.being_loaded),
            tuple(sorted((b, ids) for b, ids in self.block_fence.items() if ids)),
            frozenset(self.to_flush), self.reset_since_step, tuple(sorted(self.signals.items())),
            tuple(sorted(self.quarantined_blocks.items())), tuple(sorted(self.core.items())),
            frozenset(self.pending_finished), frozenset(self.pending_preempted),
            frozenset(self.free_blocks), (self.budget[0], self.budget[1], self.budget[2]),
            tuple(sorted(self.stores_after_signal)))

    # -- subjects by machine ------------------------------------------------------
    def get(self, machine: str, k: Any) -> Any:
        if machine == "request":
            return self.reqs.get(k, MReq(k))
        if machine == "job":
            found = self.jobs.get(k) or self.held.get(k)
            if found is None and self.pending_new is not None and self.pending_new.id == k:
                return self.pending_new
            return found
        return self.fence_state

    def put(self, machine: str, subject: Any) -> None:
        if machine == "request":
            if subject.state != R.ABSENT or subject.id in self.reqs:
                self.reqs[subject.id] = subject  # delete_request_status removes it
        elif machine == "job":
            _set_job(self, subject)

    def template(self, req_id: str) -> Template:
        for t in self.bounds.templates():
            if t.req_id == req_id:
                return t
        raise ModelError(f"no request template {req_id!r}")

    def keys_of(self, req_id: str) -> list[int]:
        t = self.template(req_id)
        return [key(t.family, c) for c in range(t.tokens)]

    keep_inside: bool = False
    inside: list[tuple[Call, AbstractState]] = field(default_factory=list)
    """With `apply(..., inside=True)`: (hook call, abstract state) at each hook that returns
    inside a step (lookup, allocation), before the step's build_connector_meta."""
    pending_new: MJob | None = None
    last_job: int = -1
    """The id of the job that entered the table last."""
    victim_choice: tuple[int, ...] | None = None
    """Eviction victims to take (an implementation's observed choice); default: lowest keys."""

    def choose_victims(self, evictable: list[int], need: int) -> list[int]:
        if self.victim_choice is None:
            return evictable[:need]
        chosen = [c for c in self.victim_choice if c in evictable][:need]
        if len(chosen) != need:
            raise ModelError(f"eviction of {self.victim_choice} is not allowed: evictable "
                             f"{evictable}, need {need}")
        return chosen


# ============================================================================ the interpreter
Guard = Callable[[World, Any, dict[str, Any]], bool]
Effect = Callable[..., None]

MACHINES: dict[str, MachineSpec] = {"request": R.REQUEST_MACHINE, "job": J.JOB_MACHINE,
                                    "fence": F.FENCE_MACHINE}


def _state_of(subject: Any) -> str:
    return subject if isinstance(subject, str) else str(subject.state)


_ROWS: dict[tuple[str, str, str], list[tuple[int, Any]]] = {}


def _rows(machine: str, state: str, trigger: str) -> list[tuple[int, Any]]:
    found = _ROWS.get((machine, state, trigger))
    if found is None:
        found = [(i, t) for i, t in enumerate(MACHINES[machine].transitions)
                 if t.trigger == trigger and state in t.sources]
        _ROWS[(machine, state, trigger)] = found
    return found


def fire(w: World, machine: str, k: Any, trigger: str, **kw: Any) -> str:
    """Move subject `k` of `machine` by `trigger`, through the table; returns the new state."""
    subject = w.get(machine, k)
    state = _state_of(subject)
    for index, t in _rows(machine, state, trigger):
        if all(GUARDS[machine][guard_name(g)](w, subject, kw) != guard_negated(g)
               for g in t.guards):
            dest: str = t.dest_from(state)
            w.fired.append((machine, index))
            w.moves.append((machine, k, state, dest, trigger))
            if machine == "fence":
                w.fence_state = dest
            else:
                w.put(machine, subject._replace(state=dest))
            for e in t.effects:
                EFFECTS[e](w, k, **kw)
            return dest
    raise ModelError(f"{machine} {k!r} in {state}: no {trigger!r} transition")


# ============================================================================ guards
GUARDS: dict[str, dict[str, Guard]] = {
    "request": {
        "other_jobs_remain": lambda w, r, kw: bool(r.jobs),
        "has_transfer_jobs": lambda w, r, kw: bool(r.jobs),
        "load_invalid": lambda w, r, kw: bool(r.load_invalid),
    },
    "job": {
        "owner_has_no_jobs": lambda w, j, kw: not w.get("request", j.owner).jobs,
        "reports_complete": lambda w, j, kw: int(kw.get("count", 1)) >= j.pending,
    },
    "fence": {
        "has_live_jobs": lambda w, f, kw: int(kw.get("live_jobs", 0)) > 0,
        "fence_empties": lambda w, f, kw: not any(j.state == J.STALE for j in w.held.values()),
    },
}


# ============================================================================ effects
def _req(w: World, k: str) -> MReq:
    r = w.reqs.get(k)
    if r is None:
        raise ModelError(f"request {k!r} is not tracked")
    return r


def _set_req(w: World, r: MReq) -> None:
    w.reqs[r.id] = r


def _job(w: World, k: int) -> MJob:
    j = w.jobs.get(k) or w.held.get(k) or (w.pending_new if w.pending_new
                                            and w.pending_new.id == k else None)
    if j is None:
        raise ModelError(f"job {k} unknown")
    return j


def _set_job(w: World, j: MJob) -> None:
    if j.id in w.jobs:
        w.jobs[j.id] = j
    elif j.id in w.held:
        w.held[j.id] = j
    else:
        w.pending_new = j


def _noop(w: World, k: Any, **kw: Any) -> None:
    return None


def create_request_status(w: World, k: str, **kw: Any) -> None:
    w.signals.setdefault(k, 0)


def restart_from_token_zero(w: World, k: str, **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(blocks=(), cursor=0, hit=None, kv_load=None))


def record_lookup_hit(w: World, k: str, hit_tokens: int = 0, sync: bool = False,
                      **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(hit=hit_tokens if hit_tokens > 0 else None,
                        sync_reserved=sync))


def bypass_offload_lookup(w: World, k: str, **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(load_invalid=False))


def create_load_job(w: World, k: str, keys: tuple[int, ...] = (),
                    block_ids: tuple[int, ...] = (), first_block_index: int = 0,
                    sync: bool = False, block_table: tuple[int, ...] = (), **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(blocks=block_table))
    w.pending_new = MJob(-1, "load", k, pending=w.bounds.workers, sync=sync, keys=keys,
                         blocks=block_ids, unreported=w.bounds.workers)
    fire(w, "job", -1, "create_load")
    r = _req(w, k)
    _set_req(w, r._replace(hit=None, cursor=first_block_index + len(block_ids),
                           kv_load=w.last_job if sync else None))


def mark_chunks_being_loaded(w: World, k: str, keys: tuple[int, ...] = (), **kw: Any) -> None:
    w.being_loaded.update(keys)


def record_block_ids(w: World, k: str, block_ids: tuple[int, ...] = (), **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(blocks=tuple(block_ids)))


def create_store_job(w: World, k: str, keys: tuple[int, ...] = (),
                     block_ids: tuple[int, ...] = (), end_chunk: int = 0, **kw: Any) -> None:
    w.pending_new = MJob(-1, "store", k, pending=w.bounds.workers, keys=keys, blocks=block_ids,
                         deferred=frozenset(block_ids), unreported=w.bounds.workers)
    fire(w, "job", -1, "create_store")
    _set_req(w, _req(w, k)._replace(cursor=end_chunk))


def flush_request_jobs(w: World, k: str, **kw: Any) -> None:
    if "preempt-skips-flush" in w.faults:
        return
    for jid in sorted(_req(w, k).jobs - w.batch_loads):
        if jid in w.jobs:
            fire(w, "job", jid, "flush")


def _fence_add(w: World, block: int, jid: int) -> None:
    w.block_fence[block] = w.block_fence.get(block, frozenset()) | {jid}


def register_deferred_fences(w: World, k: str, **kw: Any) -> None:
    if "finish-skips-deferred-fence" in w.faults:
        return
    for jid in sorted(_req(w, k).jobs):
        if jid in w.jobs:
            for b in w.jobs[jid].deferred:
                _fence_add(w, b, jid)


def signal_request_finished(w: World, k: str, **kw: Any) -> None:
    r = _req(w, k)
    if not r.signaled or "reset-signals-twice" in w.faults:
        _set_req(w, r._replace(signaled=True))
        w.signals[k] = w.signals.get(k, 0) + 1


def delete_request_status(w: World, k: str, **kw: Any) -> None:
    w.reqs.pop(k, None)


def reset_store_cursor(w: World, k: str, **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(cursor=0, hit=None))


def drop_request_jobs(w: World, k: str, **kw: Any) -> None:
    held = _req(w, k).jobs
    for jid in sorted(held):
        if jid in w.jobs:
            fire(w, "job", jid, "reset")
    if k in w.reqs:
        kept = held if "reset-keeps-transfer-jobs" in w.faults else frozenset()
        _set_req(w, _req(w, k)._replace(jobs=kept))


def mark_load_invalid(w: World, k: str, **kw: Any) -> None:
    _set_req(w, _req(w, k)._replace(load_invalid=True))


def poison_request_stores(w: World, k: str, **kw: Any) -> None:
    for jid in sorted(_req(w, k).jobs):
        j = w.jobs.get(jid)
        if j is not None and j.kind == "store" and j.state != J.FAILING:
            fire(w, "job", jid, "poison")


def quarantine_load_blocks(w: World, k: str, job_id: int = -1,
                           gpu_block_ids: tuple[int, ...] = (), **kw: Any) -> None:
    w.quarantined_blocks[job_id] = gpu_block_ids


def signal_untracked_finished(w: World, k: str, **kw: Any) -> None:
    w.signals[k] = w.signals.get(k, 0) + 1


# -- job effects --------------------------------------------------------------------
def allocate_job_id(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    w.pending_new = j._replace(id=w.counter)
    w.counter += 1


def _new(w: World) -> MJob:
    assert w.pending_new is not None
    return w.pending_new


def pin_load_chunks(w: World, k: int, **kw: Any) -> None:
    for c in _new(w).keys:
        if w.chunks.get(c, -1) < 0:
            raise ModelError(f"prepare_load of chunk {c} that is not ready")
        w.chunks[c] += 1


def enter_job_table(w: World, k: int, **kw: Any) -> None:
    j = _new(w)
    w.pending_new = None
    w.jobs[j.id] = j
    r = _req(w, j.owner)
    _set_req(w, r._replace(jobs=r.jobs | {j.id}))
    w.batch_jobs.add(j.id)
    if j.kind == "load":
        w.batch_loads.add(j.id)
    w.last_job = j.id


def register_store_fences(w: World, k: int, **kw: Any) -> None:
    jid = w.last_job
    j = w.jobs[jid]
    if _req(w, j.owner).finished:
        for b in sorted(j.deferred):
            _fence_add(w, b, jid)
        if j.deferred & w.batch_alloc:
            fire(w, "job", jid, "flush")


def put_in_metadata(w: World, k: int, **kw: Any) -> None:
    _set_job(w, _job(w, k)._replace(age=0))


def add_to_jobs_to_flush(w: World, k: int, **kw: Any) -> None:
    if "reset-skips-flush" in w.faults and _job(w, k).state == J.STALE:
        return
    _set_job(w, _job(w, k)._replace(flush_requested=True))
    w.to_flush.add(k)


def count_report(w: World, k: int, count: int = 1, **kw: Any) -> None:
    j = _job(w, k)
    if "store-ready-on-first-ack" in w.faults and j.kind == "store" and j.state != J.STALE:
        for c in j.keys:
            if w.chunks.get(c) == -1:
                w.chunks[c] = 0
    _set_job(w, j._replace(pending=j.pending - count))


def mark_failed(w: World, k: int, **kw: Any) -> None:
    _set_job(w, _job(w, k)._replace(failed=True))


def _unpin(w: World, keys: tuple[int, ...]) -> None:
    for c in keys:
        if c in w.chunks and w.chunks[c] > 0:
            w.chunks[c] -= 1


def _unmark(w: World, j: MJob) -> None:
    """Only an async load marked its keys as being loaded; only it unmarks them."""
    if not j.sync:
        w.being_loaded.difference_update(j.keys)


def complete_in_manager(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    if j.kind == "store":
        for c in j.keys:
            if w.chunks.get(c) == -1:
                w.chunks[c] = 0
    else:
        if "complete-load-keeps-pin" not in w.faults:
            _unpin(w, j.keys)
        if "load-keeps-chunks-being-loaded" not in w.faults:
            _unmark(w, j)


def roll_back_in_manager(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    if j.kind == "store":
        for c in j.keys:
            if w.chunks.get(c) == -1:
                del w.chunks[c]
    else:
        _unpin(w, j.keys)
        _unmark(w, j)


def leave_job_table(w: World, k: int, **kw: Any) -> None:
    if k not in w.jobs:
        return
    j = w.jobs.pop(k)
    r = w.reqs.get(j.owner)
    if r is not None:
        _set_req(w, r._replace(jobs=r.jobs - {k}))
    for b in j.deferred:
        if b in w.block_fence:
            w.block_fence[b] = w.block_fence[b] - {k}
            if not w.block_fence[b]:
                del w.block_fence[b]
    if j.state == J.STALE:
        w.held[k] = j
        return
    if j.state == J.TIMED_OUT:
        w.held[k] = j
    trigger = "store_ended" if j.kind == "store" else {
        J.COMPLETED: "load_ended", J.FAILED: "load_failed", J.TIMED_OUT: "load_timed_out",
    }[j.state]
    fire(w, "request", j.owner, trigger, job_id=k, gpu_block_ids=j.blocks)


def enter_timeout_quarantine(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    if j.kind == "store":
        held = 0
        for c in j.keys:
            if w.chunks.get(c) == -1:
                del w.chunks[c]
                held += 1
        _set_job(w, j._replace(held_slots=held))
    else:
        _unmark(w, j)


def release_quarantine(w: World, k: int, **kw: Any) -> None:
    j = w.held.pop(k)
    if j.kind == "load":
        _unpin(w, j.keys)
    w.quarantined_blocks.pop(k, None)


def enter_reset_fence(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    w.held[k] = j._replace(held_slots=0)


def count_stale_report(w: World, k: int, count: int = 1, **kw: Any) -> None:
    j = w.held[k]
    w.held[k] = j._replace(pending=j.pending - count)


def invalidate_orphaned_load(w: World, k: int, **kw: Any) -> None:
    j = w.held[k]
    owner = w.reqs.get(j.owner)
    if j.kind == "load" and owner is not None and owner.state == R.ORPHANED_LOAD:
        w.reqs[owner.id] = owner._replace(load_invalid=True)


def invalidate_owner_kv(w: World, k: int, **kw: Any) -> None:
    j = _job(w, k)
    owner = w.reqs.get(j.owner)
    if j.kind == "load" and j.sync and owner is not None and owner.kv_load == k:
        fire(w, "request", owner.id, "kv_invalidated")


def leave_reset_fence(w: World, k: int, **kw: Any) -> None:
    w.held.pop(k, None)
    w.quarantined_blocks.pop(k, None)


EFFECTS: dict[str, Effect] = {
    name: fn for name, fn in globals().items()
    if callable(fn) and not name.startswith("_") and name in {
        e.name for m in MACHINES.values() for e in m.effects}
}
# effects with no state in the model (statistics, slot bookkeeping the model keeps implicit)
for _name in ("start_deferral_timer", "count_allocation_failure", "promote_after_recving",
              "protect_store_chunks", "extend_fence", "signal_reset_flushed",
              "count_ignored_report", "ship_marker"):
    EFFECTS.setdefault(_name, _noop)


# ============================================================================ the hooks
def _open(w: World) -> None:
    w.step_open = True


def lookup(w: World, r: str, local: int = 0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens (S:1210-1277)."""
    req = _req(w, r)
    if req.state in (R.RUNNING, R.STORING, R.LOADING_SYNC):
        fire(w, "request", r, "preempt")
        w.preempted_early.add(r)
        req = _req(w, r)
    _open(w)
    if req.state == R.PREEMPTED_FLUSHING and "lookup-ignores-transfer-jobs" not in w.faults:
        fire(w, "request", r, "lookup_blocked")
        return None, False
    if req.state in (R.RECOMPUTE, R.TIMED_OUT):
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
        _set_req(w, _req(w, r)._replace(hit=None))
        return
    req = _req(w, r)
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
        cur = _req(w, r)
        table = blocks if r in new else (*cur.blocks, *blocks)
        if cur.state == R.IDLE:
            fire(w, "request", r, "schedule", block_ids=table)
        elif cur.state in (R.RUNNING, R.STORING, R.LOADING_SYNC):
            _set_req(w, cur._replace(blocks=table))
        else:
            raise ModelError(f"request {r!r} scheduled in {cur.state}")
    for r in sorted(preempted - w.preempted_early):
        opt = w.reqs.get(r)
        if opt is not None and opt.state in (R.RUNNING, R.STORING, R.LOADING_SYNC):
            fire(w, "request", r, "preempt")
    for b in sorted(w.batch_alloc):
        if "realloc-skips-fence" in w.faults:
            break
        for jid in sorted(w.block_fence.get(b, frozenset())):
            if jid in w.jobs:
                fire(w, "job", jid, "flush")
    limit = w.bounds.timeout_steps  # after scheduling, preemption and fences, as the impl
    if limit is not None:
        for jid in sorted(w.jobs):
            aged = w.jobs.get(jid)
            if aged is not None and aged.age is not None and aged.age >= limit:
                fire(w, "job", jid, "time_out")
    for r in [*sched, *sorted(finished)]:
        opt = w.reqs.get(r)
        if opt is not None and opt.state in (R.RUNNING, R.STORING, R.LOADING_SYNC,
                                             R.FINISHED_PENDING_FINAL):
            _store(w, r, sched.get(r, 0))
    for jid in sorted(w.batch_jobs):
        shipped = w.jobs.get(jid)
        if shipped is not None and shipped.state in (J.CREATED, J.FLUSH_REQUESTED):
            fire(w, "job", jid, "ship")
    for r in sorted(finished):
        opt = w.reqs.get(r)
        if opt is not None and opt.state == R.FINISHED_PENDING_FINAL:
            fire(w, "request", r, "finalize")
    _end_step(w)


def _store(w: World, r: str, scheduled: int) -> None:
    req = _req(w, r)
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
        _set_req(w, req._replace(cursor=n))
        return
    if req.signaled:
        w.stores_after_signal.append(r)
    free = (w.bounds.cpu_chunks - len(w.chunks)
            - sum(j.held_slots for j in w.held.values()))
    need = len(candidates) - free
    if need > 0:
        pinned_ok = "evict-pinned-chunks" in w.faults
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
            _set_job(w, j._replace(flush_shipped=True))
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
    if "aggregate-counts-once" in w.faults:  # a summed count {id: n} taken as one report
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
    _set_req(w, _req(w, r)._replace(finished=True))
    fire(w, "request", r, "finish")
    if "signal-before-final-store" in w.faults:
        signal_request_finished(w, r)


def reset(w: World) -> None:
    live = len(w.jobs) + sum(1 for j in w.held.values() if j.state == J.TIMED_OUT)
    for r in sorted(w.reqs):
        fire(w, "request", r, "reset")
    for jid in sorted(j.id for j in w.held.values() if j.state == J.TIMED_OUT):
        fire(w, "job", jid, "reset")
    w.chunks.clear()
    if "reset-keeps-stale-threshold" not in w.faults:
        w.threshold = w.counter
    fire(w, "fence", None, "reset", live_jobs=live)
    w.being_loaded.clear()
    w.block_fence.clear()
    w.reset_since_step = True


# ============================================================================ events
@dataclass(frozen=True)
class Call:
    """One hook call an event stands for, with the answer the model expects."""

    hook: str
    args: tuple[Any, ...]
    answer: Any = None


@dataclass(frozen=True)
class Event:
    kind: Literal["arrive", "step", "report", "finish", "abort", "preempt", "reset"]
    req: str | None = None
    job: int | None = None
    count: int = 0
    failed: bool = False

    def __str__(self) -> str:
        if self.kind == "step":
            return f"step(admit={self.req})" if self.req else "step()"
        if self.kind == "report":
            what = "fail" if self.failed else "ack"
            return f"{what}(job {self.job}, count {self.count})"
        return f"{self.kind}({self.req})" if self.req else f"{self.kind}()"


def parse_events(text: str) -> list[Event]:
    """The inverse of `str(Event)` over a `;`-separated program:
    ``"arrive(r0) ; step(admit=r0) ; ack(job 0, count 2) ; reset()"`` -> events."""
    out: list[Event] = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        m = re.fullmatch(r"(\w+)\((.*)\)", item)
        if m is None:
            raise ValueError(f"not an event: {item!r}")
        kind, arg = m.group(1), m.group(2).strip()
        if kind == "step":
            out.append(Event("step", arg.split("=", 1)[1] if arg else None))
        elif kind in ("ack", "fail"):
            nums = re.fullmatch(r"job (\d+), count (\d+)", arg)
            if nums is None:
                raise ValueError(f"not a report: {item!r}")
            out.append(Event("report", job=int(nums.group(1)), count=int(nums.group(2)),
                             failed=kind == "fail"))
        elif kind in ("arrive", "finish", "abort", "preempt", "reset"):
            out.append(Event(kind, arg or None))  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown event kind {kind!r} in {item!r}")
    return out


def initial(bounds: Bounds) -> ModelState:
    return ModelState(bounds, free_blocks=frozenset(range(bounds.gpu_blocks)))


def _behind_a_sync_load(w: World, j: MJob) -> bool:
    """An earlier sync load of the same request still has reports due. A worker waits for a
    sync load before the step's forward pass and reports it in that step (W:256-270,
    W:286-329), before any later job of the request, which it submits in a later step
    (W:272-284): so no worker reports a later job first."""
    return any(o.owner == j.owner and o.kind == "load" and o.sync and o.id < j.id
               and o.unreported > 0 for o in (*w.jobs.values(), *w.held.values()))


def _free(w: World, blocks: tuple[int, ...]) -> None:
    quarantined = {b for bs in w.quarantined_blocks.values() for b in bs}
    w.free_blocks.update(b for b in blocks if b not in quarantined)


def _core_sync(w: World) -> None:
    """The core's reaction to what the connector decided: an async load ended (the request
    waits with its loaded tokens), failed or timed out (recompute from scratch), a sync load
    failed under a running request (preempt it), an aborted load ended (free its blocks)."""
    for r, c in list(w.core.items()):
        req = w.reqs.get(r)
        state = req.state if req is not None else R.ABSENT
        if c.status == "remote":
            if state == R.IDLE:
                w.core[r] = c._replace(status="waiting", computed=c.loading, loading=0)
            elif state in (R.RECOMPUTE, R.TIMED_OUT):
                _free(w, c.blocks)
                w.core[r] = MCore("waiting")
        elif c.status == "running":
            invalid = req is not None and req.load_invalid
            if state in (R.RECOMPUTE, R.TIMED_OUT) or (state == R.PREEMPTED_FLUSHING
                                                       and invalid):
                _free(w, c.blocks)
                w.core[r] = MCore("waiting")
        elif c.status == "finished" and c.blocks:
            loading = req is not None and any(
                w.jobs[j].kind == "load" for j in req.jobs if j in w.jobs)
            if not loading:
                _free(w, c.blocks)
                w.core[r] = c._replace(blocks=())


def _inside(w: World, call: Call) -> None:
    """Keep the abstract state as the hook `call` left it, inside the step."""
    if w.keep_inside:
        w.inside.append((call, abstract(w.freeze(), step_open=True)))


def apply(s: ModelState, ev: Event, faults: frozenset[str] = frozenset(),
          victims: tuple[int, ...] | None = None,
          inside: bool = False) -> tuple[ModelState, list[Call], World]:
    """The state after `ev`, the hook calls it stands for, and the working world (for its
    coverage record). NotEnabled: the environment cannot send `ev` here; any other
    ModelError: the spec (or a fault) breaks on it. With `inside`, the world also keeps the
    abstract state after each hook that returns inside a step (`World.inside`), where the
    implementation checks the invariants too."""
    w = World.thaw(s)
    w.faults = faults
    w.victim_choice = victims
    w.keep_inside = inside
    calls: list[Call] = []
    b = s.bounds
    if ev.kind == "arrive":
        assert ev.req is not None
        if ev.req in w.core:
            raise NotEnabled("already arrived")
        w.core[ev.req] = MCore()
        fire(w, "request", ev.req, "add")
        calls.append(Call("on_new_request", (ev.req,)))
    elif ev.kind == "step":
        new: dict[str, tuple[int, ...]] = {}
        cached: dict[str, tuple[int, ...]] = {}
        sched: dict[str, int] = {}
        if ev.req is not None:
            r = ev.req
            c = w.core.get(r)
            if c is None or c.status != "waiting":
                raise NotEnabled("not waiting")
            tokens = w.template(r).tokens
            if not c.blocks:
                hit, is_async = lookup(w, r)
                calls.append(Call("get_num_new_matched_tokens", (r, 0), (hit, is_async)))
                _inside(w, calls[-1])
                if hit is not None and len(w.free_blocks) >= tokens:
                    blocks = tuple(sorted(w.free_blocks)[:tokens])
                    w.free_blocks.difference_update(blocks)
                    alloc(w, r, blocks, hit)
                    calls.append(Call("update_state_after_alloc", (r, blocks, hit)))
                    _inside(w, calls[-1])
                    if hit and is_async:
                        w.core[r] = MCore("remote", 0, blocks, loading=hit)
                    else:
                        w.core[r] = MCore("running", hit, blocks)
                        new[r] = blocks
                        sched[r] = 1
            else:  # an async load ended: it runs now, without a lookup
                w.core[r] = c._replace(status="running")
                new[r] = c.blocks
                sched[r] = 1
        for r, c in sorted(w.core.items()):
            if c.status == "running" and r not in sched and c.computed < w.template(r).tokens:
                cached[r] = ()
                sched[r] = 1
        fin, pre = frozenset(w.pending_finished), frozenset(w.pending_preempted)
        build_meta(w, new, cached, sched, fin, pre)
        computed = {r: (c.computed, c.aborted) for r, c in w.core.items()}
        calls.append(Call("build_connector_meta", (dict(new), dict(cached), dict(sched),
                                                   fin, pre, computed)))
        for r, n in sched.items():
            c = w.core[r]
            w.core[r] = c._replace(computed=min(c.computed + n, w.template(r).tokens))
        w.pending_finished.clear()
        w.pending_preempted.clear()
        _core_sync(w)
    elif ev.kind == "report" and ev.job is not None and ev.job < w.threshold and \
            ev.job not in w.held:
        if not b.stray_reports:
            raise NotEnabled("no stray reports in these bounds")
        fire(w, "fence", None, "drained_report", count=ev.count)
        calls.append(Call("update_connector_output", (ev.job, ev.count, 0, frozenset())))
    elif ev.kind == "report":
        assert ev.job is not None
        due = (w.jobs.get(ev.job) or w.held.get(ev.job))
        if due is None or (due.age is None and ev.job in w.jobs):
            raise NotEnabled("not shipped")
        if ev.count < 1 or ev.count > due.unreported:
            raise NotEnabled("count")
        if _behind_a_sync_load(w, due):
            raise NotEnabled("each worker reports a request's sync load before its later jobs")
        if ev.count > due.pending:
            raise ModelError(f"job {ev.job}: {ev.count} reports from the workers but only "
                             f"{due.pending} due by the scheduler's count (over-ack)")
        if ev.failed:
            if w.budget[1] >= b.failures:
                raise NotEnabled("failure budget")
            w.budget[1] += 1
        owner = due.owner
        completes = ev.count == due.unreported and due.kind == "load" and not due.sync
        report(w, ev.job, 0 if ev.failed else ev.count, ev.count if ev.failed else 0)
        for table in (w.jobs, w.held):
            if ev.job in table:
                table[ev.job] = table[ev.job]._replace(
                    unreported=table[ev.job].unreported - ev.count)
        recving = {owner} if completes and w.core.get(owner, MCore()).status in (
            "remote", "finished") else set()
        if recving and owner in w.reqs and w.reqs[owner].state == R.ORPHANED_LOAD:
            fire(w, "request", owner, "load_recving")
        calls.append(Call("update_connector_output", (ev.job, 0 if ev.failed else ev.count,
                                                      ev.count if ev.failed else 0,
                                                      frozenset(recving))))
        _core_sync(w)
    elif ev.kind == "abort" and ev.req not in w.core:
        assert ev.req is not None  # aborted before the connector ever saw it
        w.core[ev.req] = MCore("finished", aborted=True)
        finish(w, ev.req)
        calls.append(Call("request_finished", (ev.req, True)))
    elif ev.kind in ("finish", "abort"):
        assert ev.req is not None
        r = ev.req
        c = w.core.get(r)
        if c is None or c.status == "finished":
            raise NotEnabled("not live")
        if ev.kind == "finish" and (c.status != "running" or c.computed < w.template(r).tokens):
            raise NotEnabled("not done")
        keep = c.status == "remote"
        if not keep:
            _free(w, c.blocks)
        w.core[r] = MCore("finished", c.computed, c.blocks if keep else (), ev.kind == "abort")
        finish(w, r)
        calls.append(Call("request_finished", (r, ev.kind == "abort")))
        w.pending_finished.add(r)
    elif ev.kind == "preempt":
        assert ev.req is not None
        r = ev.req
        c = w.core.get(r)
        if c is None or c.status != "running":
            raise NotEnabled("not running")
        if w.budget[2] >= b.preemptions:
            raise NotEnabled("preemption budget")
        w.budget[2] += 1
        _free(w, c.blocks)
        w.core[r] = MCore("waiting")
        w.pending_preempted.add(r)
    elif ev.kind == "reset":
        if w.budget[0] >= b.resets:
            raise NotEnabled("reset budget")
        w.budget[0] += 1
        reset(w)
        calls.append(Call("reset_cache", ()))
        _core_sync(w)
    return w.freeze(), calls, w


def events(s: ModelState) -> Iterator[Event]:
    """Every event the environment may send in `s` (the checker tries each)."""
    b = s.bounds
    core = dict(s.core)
    for t in b.templates():
        if t.req_id not in core:
            yield Event("arrive", t.req_id)
            yield Event("abort", t.req_id)
    yield Event("step")
    for r, c in sorted(core.items()):
        if c.status == "waiting":
            yield Event("step", r)
        if c.status == "running":
            if c.computed >= b.tokens:
                yield Event("finish", r)
            yield Event("preempt", r)
        if c.status != "finished":
            yield Event("abort", r)
    for j in (*s.jobs, *s.held):
        if j.age is None and j.state not in (J.STALE, J.TIMED_OUT):
            continue
        if j.unreported == 0:
            continue
        counts = sorted({1, j.unreported}) if b.partial_reports else [j.unreported]
        for n in counts:
            yield Event("report", job=j.id, count=n)
            yield Event("report", job=j.id, count=n, failed=True)
    if b.stray_reports:
        for jid in range(s.threshold):
            if all(j.id != jid for j in s.held):
                yield Event("report", job=jid, count=1)
                break
    yield Event("reset")


def successors(s: ModelState, faults: frozenset[str] = frozenset(),
               inside: bool = False) -> Iterator[
        tuple[Event, ModelState | ModelError, list[Call], World | None]]:
    """(event, next state or the ModelError it raised, calls, world) for every enabled event."""
    for ev in events(s):
        try:
            nxt, calls, w = apply(s, ev, faults, inside=inside)
        except NotEnabled:
            continue
        except ModelError as exc:
            yield ev, exc, [], None
            continue
        yield ev, nxt, calls, w


# ============================================================================ projection
def abstract(s: ModelState, step_open: bool = False) -> AbstractState:
    """The model state seen as spec.AbstractState (what the invariants are written over)."""
    reqs = []
    for q in s.reqs:
        if q.state in (R.RUNNING, R.STORING, R.LOADING_SYNC, R.LOADING_ASYNC,
                       R.ORPHANED_LOAD):
            blocks = q.blocks
        elif q.finished:  # aborted while loading: the load's destination stays held
            blocks = tuple(b for j in s.jobs if j.owner == q.id and j.kind == "load"
                           for b in j.blocks)
        else:
            blocks = ()
        reqs.append(RequestRecord(q.id, q.state, q.jobs, q.finished, q.signaled,
                                  q.load_invalid, q.hit is not None, tuple(blocks)))
    jobs = tuple(JobRecord(j.id, j.kind, j.owner, j.state, j.pending, j.sync, j.failed,
                           frozenset(j.keys), frozenset(j.blocks), frozenset(),
                           j.deferred, j.age or 0, j.flush_requested) for j in s.jobs)
    fence = tuple(HeldJob(j.id, j.kind, j.pending, frozenset(j.keys), frozenset(j.blocks),
                          j.flush_shipped) for j in s.held if j.state == J.STALE)
    quarantine = tuple(HeldJob(j.id, j.kind, j.pending, frozenset(j.keys),
                               frozenset(j.blocks), j.flush_shipped)
                       for j in s.held if j.state == J.TIMED_OUT)
    return AbstractState(
        num_workers=s.bounds.workers, requests=tuple(sorted(reqs)), jobs=tuple(sorted(jobs)),
        job_counter=s.counter, stale_threshold=s.threshold, reset_fence=fence,
        quarantine=quarantine, chunks_being_loaded=s.being_loaded, chunk_ref_cnt=s.chunks,
        block_fence=s.block_fence, jobs_to_flush=s.to_flush, step_open=step_open,
        reset_since_last_step=s.reset_since_step, finished_signals=s.signals,
        stores_after_signal=s.stores_after_signal,
    )


def canonical(s: ModelState) -> ModelState:
    """The state with job ids renumbered densely (order kept): two states that differ only
    in how many jobs came before are the same state for every property checked."""
    ids = sorted({j.id for j in (*s.jobs, *s.held)} | {i for r in s.reqs for i in r.jobs}
                 | set(s.to_flush) | {i for _, ids in s.block_fence for i in ids}
                 | {i for i, _ in s.quarantined_blocks})
    below = sum(1 for i in ids if i < s.threshold)
    ren = {old: new for new, old in enumerate(ids)}
    if all(old == new for old, new in ren.items()) and s.counter == len(ids) \
            and s.threshold == below:
        return s

    def j(x: MJob) -> MJob:
        return x._replace(id=ren[x.id])

    return replace(
        s, reqs=tuple(r._replace(jobs=frozenset(ren[i] for i in r.jobs)) for r in s.reqs),
        jobs=tuple(j(x) for x in s.jobs), held=tuple(j(x) for x in s.held),
        counter=len(ids), threshold=below,
        block_fence=tuple((b, frozenset(ren[i] for i in v)) for b, v in s.block_fence),
        to_flush=frozenset(ren[i] for i in s.to_flush),
        quarantined_blocks=tuple((ren[i], v) for i, v in s.quarantined_blocks))


def coverage_universe() -> set[tuple[str, int]]:
    return {(m, i) for m, spec in MACHINES.items() for i in range(len(spec.transitions))}


__all__ = ["Bounds", "Call", "Event", "ModelError", "ModelState", "NotEnabled", "Template",
           "abstract", "apply", "canonical", "coverage_universe", "events", "fire", "initial",
           "key", "parse_events", "successors"]
