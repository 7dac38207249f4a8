"""The live side of the monitor: vLLM's scheduler-side connector projected after each hook.

`LiveProjector` reads the fields of a running `OffloadingConnectorScheduler` through
`conformance.projection` (the same abstraction function as the conformance tests; the
release differences live there) and turns each hook call into an `Event` of the log: the
hook's arguments in the schema's terms and the delta of the projected state. It re-projects
only what the hook can have touched (its request; for `build_connector_meta` the requests it
admitted, resumed, preempted or finished and the owners of the jobs it created or flushed;
for `update_connector_output` the owners of the reported jobs; everything for
`reset_cache`), so a step costs what it changed, not what is tracked. `project_all()`
re-projects everything (the monitor's periodic whole check).

What the connector does not keep, the projector observes: each request's core status from
the request itself (`Request.status`), chunk keys interned as small integers on first
sight, the calls of the manager's `on_request_finished` and any `prepare_store` after it
(the manager's two methods wrapped; they call through), each job's kind, keys and whether
its metadata was shipped (from the metadata `build_connector_meta` returns). The GPU block
tables of the core are not observed: INV-15 (GPU data safety) is left to the conformance
machine, which plays the core.

This module does not import vLLM; it reads the objects it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from conformance.projection import (
    JobMemo,
    Observations,
    block_fence_map,
    chunks_being_loaded,
    count_manager_calls,
    fence_of,
    job_state,
    loading_set,
    policy_table,
    project_held,
    project_job,
    project_request,
    step_open,
)
from spec import job as J
from spec.state import JobRecord, RequestRecord, fast_job_record
from statemachine.monitor.log import Delta, Event, connector_meta_args

_CORE_STATUS = {
    "WAITING": "waiting", "WAITING_FOR_FSM": "waiting",
    "WAITING_FOR_STREAMING_REQ": "waiting", "PREEMPTED": "waiting",
    "WAITING_FOR_REMOTE_KVS": "remote", "RUNNING": "running",
}
"""vLLM's `RequestStatus` names -> the core's view the projection reads (finished
statuses are read from `Request.is_finished()`)."""


@dataclass
class LiveObservations(Observations):
    """Observations of a live engine: the core's view read from the request, keys
    interned on first sight."""

    vllm_key: dict[int, Any] = field(default_factory=dict)
    """model key -> vLLM offload key (to read a chunk's pins back)."""
    scheduled: set[str] = field(default_factory=set)
    """The requests the last `SchedulerOutput` scheduled: running until the next one."""
    preempted: set[str] = field(default_factory=set)
    """The requests the last `SchedulerOutput` reported preempted."""
    allocated: set[str] = field(default_factory=set)
    """Requests `update_state_after_alloc` was called for since the last scheduler output:
    the core is scheduling them in this step (their status says so only after the hook)."""
    dirty_signals: set[str] = field(default_factory=set)
    """Requests whose `on_request_finished` count changed since the last projection."""
    loaded: set[str] = field(default_factory=set)
    """Requests whose load `finished_recving` reported: the core moves them out of
    WAITING_FOR_REMOTE_KVS after the connector's hook returns (CS:3569-3575), so they wait."""

    def core_of(self, req_id: str, req: Any) -> str:
        """The core's view, as the connector was told it: running if the last scheduler
        output scheduled the request, `allocated` if this step allocated it (being
        scheduled: a sync load of it runs in this step), waiting if the output preempted it
        or a load of it was just reported; else the request's own status."""
        if req_id in self.preempted:
            return "waiting"
        if req_id in self.scheduled:
            return "running"
        if req_id in self.allocated:
            return "allocated"
        status = getattr(getattr(req, "status", None), "name", "WAITING")
        core = _CORE_STATUS.get(status, "finished" if req.is_finished() else "waiting")
        if core == "remote" and req_id in self.loaded:
            return "waiting"
        self.loaded.discard(req_id)
        return core

    def key(self, vllm_key: Any) -> int:
        raw = bytes(vllm_key)
        k = self.key_of.get(raw)
        if k is None:
            k = self.key_of[raw] = len(self.key_of)
            self.vllm_key[k] = vllm_key
        return k

    def held(self, req_id: str, table: tuple[int, ...] | None = None) -> tuple[int, ...]:
        return ()  # the core's block tables are not observed (see the module docstring)


class LiveProjector:
    """Projects a live `OffloadingConnectorScheduler` after each hook (see the module
    docstring); `event(...)` returns the hook's `Event`."""

    def __init__(self, sched: Any, num_workers: int) -> None:
        self.sched = sched
        self.manager = sched.manager
        self.obs = LiveObservations(num_workers=num_workers)
        if not hasattr(sched, "_reset_fence"):
            self.obs.emulated_fence = {}
        self.requests: dict[str, RequestRecord] = {}
        self.jobs: dict[int, JobRecord] = {}
        self.fence: dict[int, int] = {}
        self.fence_flushed: frozenset[int] = frozenset()
        """The reset fence's jobs a step's metadata told the workers to flush, as last
        projected (a held job's `flushed` changes without its reports due changing)."""
        self.ref_cnt: dict[int, int] = {}
        self.block_fence: dict[int, frozenset[int]] = {}
        self.signals: dict[str, int] = {}
        self.scalars: dict[str, Any] = {}
        self._first: dict[int, JobRecord] = {}
        """Each live job's first projection (its fixed fields)."""
        self.shipped_below = 0
        """Job ids below this were shipped by a `build_connector_meta` (every job a step
        creates is shipped by its step's metadata)."""
        self.seq = 0
        self.step = 0
        self._loading: frozenset[Any] | None = None
        """vLLM's chunks being loaded as last projected (its own keys)."""
        self.has_step_region = hasattr(sched, "_step_region")
        self.in_step = False
        """Where vLLM keeps no step region (before 0.26): a step is open from the first
        lookup or allocation of a step until its `build_connector_meta` returns."""
        self._wrap_manager()

    # -- observation wrappers (they count, then call through) ---------------------------
    def _wrap_manager(self) -> None:
        obs = self.obs
        count_manager_calls(self.manager, obs, lambda rid: rid in self.sched._req_status,
                            on_signal=obs.dirty_signals.add)

    # -- projection ---------------------------------------------------------------------
    def _job(self, jid: int, js: Any) -> JobRecord:
        """The job's record: projected whole the first time; after that only what changes
        over a job's life (state, reports due, flush) is read again (its kind, owner,
        keys and fenced blocks are fixed when vLLM creates it)."""
        obs = self.obs
        first = self._first.get(jid)
        if first is None:
            key_of, key, keys = obs.key_of, obs.key, []
            for k in js.keys:
                i = key_of.get(k) if type(k) is bytes else None  # interned by its bytes
                keys.append(key(k) if i is None else i)
            obs.jobs[jid] = JobMemo("store" if js.is_store else "load", frozenset(keys),
                                    sync=bool(getattr(js, "is_sync_load", False)))
            first = self._first[jid] = project_job(self.sched, obs, jid, js)
        pending = js.pending_count
        state = J.CREATED if jid >= self.shipped_below else job_state(obs, jid, pending)
        flush = jid in obs.flush_requested
        if state == first.state and pending == first.pending_count \
                and flush == first.flush_requested:
            return first
        return fast_job_record(jid, first.kind, first.owner, state, pending, first.sync, False,
                         first.keys, first.blocks, first.fenced_blocks,
                         first.deferred_fence_blocks, first.age, flush)

    def delta(self, requests: Iterable[str], jobs: Iterable[int] = (), *,
              everything: bool = False, fences: bool = True, loads: bool = True) -> Delta:
        """What changed in the records of `requests`, the jobs they hold (before and
        after), `jobs`, jobs created since the last call and their owners (each projected
        once), and the global fields."""
        sched, d = self.sched, Delta()
        status, table = sched._req_status, sched._jobs
        if everything:
            requests = set(status) | set(self.requests)
            jobs = set(table) | set(self.jobs)
        want_jobs = set(jobs)
        counter = int(sched._job_counter)
        last_counter = self.scalars.get("job_counter", 0)
        if counter != last_counter:  # the jobs created since, and their owners' sets
            created = [j for j in range(last_counter, counter) if j in table]
            want_jobs.update(created)
            requests = {*requests, *(table[j].req_id for j in created)}
        for rid in requests:
            old = self.requests.get(rid)
            if old is not None:
                want_jobs |= old.transfer_jobs
            st = status.get(rid)
            new = None if st is None else project_request(sched, self.obs, rid, st)
            if new is not None:
                want_jobs |= new.transfer_jobs
            if new != old:
                d.requests[rid] = new
                if new is None:
                    del self.requests[rid]
                else:
                    self.requests[rid] = new
        keys: set[int] = set()
        for jid in want_jobs:
            old_job = self.jobs.get(jid)
            js = table.get(jid)
            new_job = None if js is None else self._job(jid, js)
            if new_job != old_job:  # a chunk's pins change with the jobs that read it
                for rec in (old_job, new_job):
                    if rec is not None:
                        keys |= rec.keys
                d.jobs[jid] = new_job
                if new_job is None:
                    del self.jobs[jid]
                    self._first.pop(jid, None)
                else:
                    self.jobs[jid] = new_job
        if everything:
            keys |= set(self.ref_cnt)
            chunks = policy_table(self.manager)
            keys |= {self.obs.key(k) for k in chunks}
        self._pins(keys, d)
        self._globals(d, counter, fences or everything, loads or fences or everything)
        return d

    def _pins(self, keys: set[int], d: Delta) -> None:
        if not keys:
            return
        entry_of, vllm_key = policy_table(self.manager).get, self.obs.vllm_key
        last, changed = self.ref_cnt, d.ref_cnt
        for k in keys:
            entry = entry_of(vllm_key[k])
            n = None if entry is None else int(entry.ref_cnt)
            if last.get(k) != n:
                changed[k] = n
                if n is None:
                    last.pop(k, None)
                else:
                    last[k] = n

    def _globals(self, d: Delta, counter: int, fences: bool, loads: bool) -> None:
        """The global fields; the reset fence and the block fence only where `fences` (the
        hooks that can change them: not a lookup or an allocation)."""
        sched, obs = self.sched, self.obs
        self._scalars(d, counter, loads)
        for rid in obs.dirty_signals:
            n = obs.signals.get(rid, 0)
            if self.signals.get(rid) != n:
                d.signals[rid] = self.signals[rid] = n
        obs.dirty_signals.clear()
        if not fences:
            return
        fence = fence_of(sched, obs)
        flushed = frozenset(j for j in fence if j in obs.flush_shipped)
        if fence != self.fence or flushed != self.fence_flushed:
            for jid in set(fence) | set(self.fence):
                if fence.get(jid) != self.fence.get(jid) \
                        or (jid in flushed) != (jid in self.fence_flushed):
                    d.fence[jid] = None if jid not in fence else project_held(
                        obs, jid, fence[jid])
            self.fence, self.fence_flushed = fence, flushed
        fenced = block_fence_map(sched)
        if fenced != self.block_fence:
            for b in set(fenced) | set(self.block_fence):
                if fenced.get(b) != self.block_fence.get(b):
                    d.block_fence[b] = fenced.get(b)
            self.block_fence = fenced

    def _scalars(self, d: Delta, counter: int, loads: bool) -> None:
        """The scalar fields; the chunks being loaded only where `loads` (a load may have
        been created or ended: not on a lookup or a new request)."""
        sched, obs = self.sched, self.obs
        scalars: dict[str, Any] = {
            "job_counter": counter,
            "stale_threshold": int(sched._stale_job_threshold),
            "jobs_to_flush": frozenset(sched._current_batch_jobs_to_flush)
            if sched._current_batch_jobs_to_flush else frozenset(),
            "step_open": step_open(sched) if self.has_step_region else self.in_step,
            "reset_since_last_step": obs.reset_since_last_step,
        }
        if loads or "chunks_being_loaded" not in self.scalars:
            raw = loading_set(sched)
            if raw != self._loading:  # interned again only when vLLM's set changed
                self._loading = frozenset(raw)
                scalars["chunks_being_loaded"] = chunks_being_loaded(sched, obs)
        if len(obs.stores_after_signal) != len(self.scalars.get("stores_after_signal", ())):
            scalars["stores_after_signal"] = frozenset(obs.stores_after_signal)
        elif "stores_after_signal" not in self.scalars:
            scalars["stores_after_signal"] = frozenset()
        for name, value in scalars.items():
            if self.scalars.get(name, _UNSET) != value:
                d.scalars[name] = self.scalars[name] = value

    # -- events -------------------------------------------------------------------------
    def event(self, hook: str, args: dict[str, Any], requests: Iterable[str] = (),
              jobs: Iterable[int] = (), everything: bool = False) -> Event:
        self.seq += 1
        fences = hook not in ("on_new_request", "get_num_new_matched_tokens",
                              "update_state_after_alloc")
        if hook in ("get_num_new_matched_tokens", "update_state_after_alloc"):
            self.in_step = True
        return Event(seq=self.seq, step=self.step, hook=hook, args=args,
                     delta=self.delta(requests, jobs, everything=everything, fences=fences,
                                      loads=hook == "update_state_after_alloc"))

    def owners(self, job_ids: Iterable[int]) -> set[str]:
        """The requests (as last projected) that hold these jobs."""
        out = set()
        for j in job_ids:
            rec = self.jobs.get(j)
            if rec is not None:
                out.add(rec.owner)
        return out

    def args_of_output(self, scheduler_output: Any) -> tuple[dict[str, Any], set[str]]:
        """`build_connector_meta`'s arguments (`statemachine.monitor.log.HOOK_ARGS`) and the
        requests it can move: those admitted, resumed, preempted or finished (the rest keep
        running). Only the requests given blocks cost more than their token count."""
        out = scheduler_output
        cached = out.scheduled_cached_reqs
        scheduled = {rid: int(n) for rid, n in out.num_scheduled_tokens.items()}
        args = connector_meta_args(
            scheduled, ((new.req_id, new.block_ids) for new in out.scheduled_new_reqs),
            zip(cached.req_ids, cached.new_block_ids, strict=True),
            getattr(cached, "resumed_req_ids", None) or (), out.finished_req_ids or (),
            getattr(out, "preempted_req_ids", None) or ())
        self.obs.scheduled = set(scheduled)
        self.obs.recompute -= self.obs.scheduled  # a failed load's request, scheduled again
        self.obs.preempted = set(args["preempted"])
        self.obs.allocated.clear()
        return args, {*args["admitted"], *args["finished"], *args["preempted"]}

    def after_build(self, meta: Any) -> tuple[dict[str, list[int]], set[int]]:
        """What the metadata ships (per kind) and the jobs whose state it moved; marks
        every job created so far as shipped and a new step as begun."""
        store = sorted(int(j) for j in (getattr(meta, "store_jobs", None) or {}))
        load = sorted(int(j) for j in (getattr(meta, "load_jobs", None) or {}))
        flush = sorted(int(j) for j in (getattr(meta, "jobs_to_flush", None) or ()))
        self.obs.flush_requested |= set(flush)
        self.obs.flush_shipped |= set(flush)
        self.shipped_below = int(self.sched._job_counter)
        self.obs.reset_since_last_step = False
        self.in_step = False
        self.step += 1
        return {"store": store, "load": load, "flush": flush}, {*store, *load, *flush}


_UNSET = object()

__all__ = ["LiveObservations", "LiveProjector"]
