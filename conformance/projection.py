"""vLLM's live scheduler-side objects seen as a `spec.AbstractState`.

The abstraction function of the conformance check. It reads vLLM's fields (S:348-493,
S:558-671; each state's predicate is in the tables) and never writes them:

Abstract field: vLLM 0.33.0 field [vLLM 0.25.1 name where it differs]
- requests, transfer_jobs: `_req_status[id].transfer_jobs`
- finished_signaled: `RequestOffloadState.finished_signaled` [no field: False]
- jobs, pending_count: `_jobs[id]` (`TransferJobStatus`)
- deferred fence blocks: `deferred_fence_block_ids` [`non_sliding_window_block_ids`]
- job_counter, stale_threshold: `_job_counter`, `_stale_job_threshold`
- reset_fence: `_reset_fence` (id -> reports due) [none: see below]
- chunks_being_loaded: `_chunks_being_loaded` [`_blocks_being_loaded`]
- chunk_ref_cnt: `manager._policy.chunks[key].ref_cnt` [`manager._policy.blocks`]
- block_fence: `_block_id_to_pending_jobs`
- jobs_to_flush: `_current_batch_jobs_to_flush`
- step_open: `_step_region is not None` [no step lock: False]

What vLLM does not keep, the adapter observes at the hooks and passes in `Observations`:
- the core scheduler's side of each request (waiting, running, waiting for a remote load,
  finished; its GPU block table), which the adapter plays;
- each job's GPU blocks and whether a flush of it was shipped (read from the metadata that
  `build_connector_meta` returned);
- how often `manager.on_request_finished` was called per request, and any `prepare_store`
  after it (counted by wrapping the two manager methods; the wrappers only count);
- for vLLM without a reset fence (0.25.1): the reports still due for each job that was live
  at a reset, counted down from the acks the adapter delivered. 0.25.1 ignores those acks
  (any id below the threshold); the spec keeps them in the fence. This is the documented
  translation that lets the same machine run against 0.25.1 (CONFORMANCE.md).

Model granularity: one model token is one vLLM block of `block_size` tokens; a chunk is
`blocks_per_chunk` of them; a model GPU block `b` is vLLM block `b + 1` (vLLM's block 0 is
the null block, the model's `NULL_BLOCK`); a chunk's offload key (block hash and group)
maps back to the model key `spec.model.key(family, position, group, groups)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spec import job as J
from spec import request as R
from spec.groups import freed_positions
from spec.state import (
    AbstractState,
    HeldJob,
    JobRecord,
    RequestRecord,
    fast_job_record,
    fast_request_record,
)


@dataclass
class JobMemo:
    """What the adapter saw of a job while it was live (vLLM forgets it at a reset)."""

    kind: str
    keys: frozenset[int]
    blocks: frozenset[int] = frozenset()
    sync: bool = False


@dataclass
class Observations:
    """The facts vLLM's connector does not keep, observed by the adapter at the hooks."""

    num_workers: int
    key_of: dict[bytes, int] = field(default_factory=dict)
    """vLLM offload key -> model chunk key."""
    core_status: dict[str, str] = field(default_factory=dict)
    """The core's view: waiting / remote / running / finished (a live monitor also
    says `allocated`: being scheduled in this step)."""
    core_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """vLLM GPU block ids the core holds for the request."""
    final_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The core's table of each finished request as it finished."""
    jobs: dict[int, JobMemo] = field(default_factory=dict)
    flush_requested: set[int] = field(default_factory=set)
    flush_shipped: set[int] = field(default_factory=set)
    signals: dict[str, int] = field(default_factory=dict)
    stores_after_signal: list[str] = field(default_factory=list)
    reset_since_last_step: bool = False
    emulated_fence: dict[int, int] | None = None
    """Only for vLLM without `_reset_fence`: stale job id -> reports still due."""
    groups: tuple[str, ...] = ("full",)
    """The KV cache groups' kinds (the core's tables are flat, group by group)."""
    sliding_window: int = 1
    """The window of a sliding-window group, in model tokens."""
    tokens_per_block: int = 1
    """Model tokens per GPU block."""
    recompute: set[str] = field(default_factory=set)
    """Requests whose async load a worker failed (0.34.0+), not scheduled since: the spec's
    RECOMPUTE, which every lookup answers 0 until the core schedules the request. vLLM
    keeps `load_failed` for the request's life, which the spec's rule for 0.34.0 states
    (`spec.rules.FailedLoadLookup.FOR_LIFE`: the model's `MReq.load_failed`, not a state)."""
    invalid_loads: set[str] = field(default_factory=set)
    """The same requests, not looked up since: the spec's `load_invalid` (which a lookup
    clears and a finish keeps)."""
    window_end: dict[str, int] = field(default_factory=dict)
    """Model tokens computed once each request's last scheduled step ran: the core frees a
    window group's blocks before that window (the adapter plays the core)."""

    def core_of(self, req_id: str, req: Any) -> str:
        """The core's view of the request (waiting / remote / running / finished): what the
        adapter played; a live monitor reads it from the request itself."""
        return self.core_status.get(req_id, "waiting")

    def key(self, vllm_key: Any) -> int:
        """The model chunk key of a vLLM offload key."""
        try:
            return self.key_of[bytes(vllm_key)]
        except KeyError:
            raise KeyError(f"vLLM offload key {bytes(vllm_key).hex()[:16]}... maps to no "
                           "model chunk") from None

    def held(self, req_id: str, table: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The model blocks the core still gives `req_id` (of `table`, by default the core's
        table now): no null block, and a window group's positions only in the window."""
        if table is None:
            table = self.core_blocks.get(req_id, ())
        freed = set(freed_positions(self.groups, self.sliding_window, self.tokens_per_block,
                                    len(table), self.window_end.get(req_id, 0)))
        return tuple(model_block(b) for i, b in enumerate(table) if b != 0 and i not in freed)


def count_manager_calls(manager: Any, obs: Observations, tracked: Callable[[str], bool],
                        around_store: Callable[[Callable[[], Any]], Any] | None = None,
                        on_signal: Callable[[str], None] | None = None) -> None:
    """Wraps the manager's `on_request_finished` (where the release has one: 0.22 has none)
    and `prepare_store` so that they count into `obs` what vLLM's connector does not keep:
    each request's `on_request_finished` calls (`obs.signals`; `on_signal(req_id)` hears of
    each) and any `prepare_store` for a request after it while `tracked(req_id)`
    (`obs.stores_after_signal`). `around_store(call)` runs each `prepare_store` (the
    adapter records the store's victims there). The wrappers call through unchanged."""
    finished = getattr(manager, "on_request_finished", None)
    prepare_store = manager.prepare_store

    def req_id_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        for a in (*args, *kwargs.values()):
            rid = getattr(a, "req_id", None)
            if isinstance(rid, str):
                return rid
        return None

    def on_request_finished(*args: Any, **kwargs: Any) -> Any:
        rid = req_id_of(args, kwargs)
        if rid is not None:
            obs.signals[rid] = obs.signals.get(rid, 0) + 1
            if on_signal is not None:
                on_signal(rid)
        assert finished is not None
        return finished(*args, **kwargs)

    def counted_prepare_store(*args: Any, **kwargs: Any) -> Any:
        rid = req_id_of(args, kwargs)
        if rid is not None and obs.signals.get(rid, 0) and tracked(rid):
            obs.stores_after_signal.append(rid)
        if around_store is None:
            return prepare_store(*args, **kwargs)
        return around_store(lambda: prepare_store(*args, **kwargs))

    if finished is not None:
        manager.on_request_finished = on_request_finished
    manager.prepare_store = counted_prepare_store


def model_block(vllm_block: int) -> int:
    return int(vllm_block) - 1


def vllm_block(model_block_id: int) -> int:
    return int(model_block_id) + 1


def _first(obj: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return default


def _keys(obs: Observations, keys: Any) -> frozenset[int]:
    return frozenset(obs.key(k) for k in keys or ())


def _blocks(ids: Any) -> frozenset[int]:
    return frozenset(model_block(b) for b in (ids or ()) if int(b) != 0)


def job_state(obs: Observations, job_id: int, pending: int, failed: bool = False) -> str:
    """A shipped job's state: failing (a worker failed it, 0.34.0+), flush requested,
    partially acknowledged, or shipped."""
    if failed:
        return J.FAILING
    if job_id in obs.flush_requested:
        return J.FLUSH_REQUESTED
    if pending < obs.num_workers:
        return J.PARTIALLY_ACKED
    return J.SHIPPED


def _request_state(sched: Any, obs: Observations, req_id: str, st: Any,
                   finished: bool | None = None) -> str:
    if st.req.is_finished() if finished is None else finished:
        return R.FINISHED_DRAINING if getattr(st, "finished_signaled", False) \
            else R.FINISHED_PENDING_FINAL
    held = st.transfer_jobs
    sync_load = False
    if held:
        table = sched._jobs
        for jid in held:
            j = table.get(jid)
            if j is not None and not j.is_store:
                if not getattr(j, "is_sync_load", False):
                    return R.LOADING_ASYNC
                sync_load = True
    core = obs.core_of(req_id, st.req)
    if sync_load:  # a sync load: waited on in its step while the core runs the request (or is
        # allocating it, as a live monitor sees it at update_state_after_alloc); once the
        # core preempted it, the load is flushed with the request's stores
        return R.LOADING_SYNC if core in ("running", "allocated") else R.PREEMPTED_FLUSHING
    if core == "running":
        return R.STORING if st.transfer_jobs else R.RUNNING
    if core == "remote" and not st.transfer_jobs:
        return R.ORPHANED_LOAD
    if st.transfer_jobs:
        # waiting with jobs: every one flushed as the core preempted it, or none: the store
        # of the state its async load ended on, which the core handed off as it cached the
        # loaded blocks without scheduling it (nothing flushes that store while it waits)
        if all(j in obs.flush_requested for j in st.transfer_jobs):
            return R.PREEMPTED_FLUSHING
        return R.WAITING_STORING
    if getattr(st, "deferred_lookup_start_time", None) is not None:
        return R.LOOKUP_DEFERRED
    if req_id in obs.recompute and getattr(st, "load_failed", False):
        return R.RECOMPUTE
    return R.IDLE


def _load_invalid(obs: Observations, req_id: str, st: Any) -> bool:
    """A load of the request failed (0.34.0+: vLLM's `load_failed`) and no lookup has
    answered 0 for it since (the spec's `load_invalid`, which a finish keeps)."""
    return req_id in obs.invalid_loads and bool(getattr(st, "load_failed", False))


def _store_cursor(st: Any) -> int | None:
    """The store cursor of vLLM's first KV group (`next_stored_chunk_idx`, S:334-345), or
    None where the release has no such field."""
    groups = getattr(st, "group_states", None)
    if not groups:
        return None
    cursor = getattr(groups[0], "next_stored_chunk_idx", None)
    return int(cursor) if cursor is not None else None


def project_job(sched: Any, obs: Observations, jid: int, js: Any) -> JobRecord:
    """One job of vLLM's `_jobs` (a `TransferJobStatus`)."""
    memo = obs.jobs.get(jid)
    deferred = _first(js, "deferred_fence_block_ids", "non_sliding_window_block_ids")
    fenced = _first(js, "fenced_block_ids", "sliding_window_block_ids")
    failed = bool(getattr(js, "failed", False))
    return fast_job_record(
        jid, "store" if js.is_store else "load", js.req_id,
        job_state(obs, jid, js.pending_count, failed), js.pending_count,
        bool(getattr(js, "is_sync_load", False)), failed,
        memo.keys if memo else _keys(obs, js.keys),  # a job's keys are fixed
        memo.blocks if memo else frozenset(), _blocks(fenced), _blocks(deferred),
        1, jid in obs.flush_requested)


def project_request(sched: Any, obs: Observations, req_id: str, st: Any) -> RequestRecord:
    """One tracked request of vLLM's `_req_status` (a `RequestOffloadState`)."""
    finished = bool(st.req.is_finished())
    state = _request_state(sched, obs, req_id, st, finished)
    if state in R.HOLDS_GPU_BLOCKS:
        gpu = obs.held(req_id)
    elif finished:
        # aborted while loading: the async load's blocks stay held, but not those its
        # window had left behind while the request ran
        still = set(obs.held(req_id, obs.final_blocks.get(req_id, ())))
        gpu = tuple(b for j in sorted(st.transfer_jobs) if j in sched._jobs
                    and R.finished_keeps_destinations(
                        "store" if sched._jobs[j].is_store else "load",
                        bool(_first(sched._jobs[j], "is_sync_load", default=False)))
                    for b in sorted(obs.jobs[j].blocks if j in obs.jobs else ())
                    if b in still)
    else:
        gpu = ()
    return fast_request_record(
        req_id, state, frozenset(st.transfer_jobs), finished,
        bool(getattr(st, "finished_signaled", False)), _load_invalid(obs, req_id, st), False,
        gpu, _store_cursor(st))


def fence_of(sched: Any, obs: Observations) -> dict[int, int]:
    """The reset fence: stale job id -> reports still due (emulated where vLLM keeps none)."""
    fence_src = _first(sched, "_reset_fence")
    if fence_src is None:
        fence_src = obs.emulated_fence or {}
    return dict(fence_src)


def project_held(obs: Observations, jid: int, due: int) -> HeldJob:
    """One entry of the reset fence."""
    memo = obs.jobs.get(jid)
    return HeldJob(
        id=jid, kind="load" if memo is not None and memo.kind == "load" else "store",
        reports_due=int(due), keys=memo.keys if memo else frozenset(),
        blocks=memo.blocks if memo else frozenset(), flushed=jid in obs.flush_shipped,
        sync=memo.sync if memo else False)


def policy_table(manager: Any) -> Any:
    """The manager's chunk table (offload key -> entry with `ref_cnt`)."""
    return _first(manager._policy, "chunks", "blocks")


def loading_set(sched: Any) -> Any:
    """vLLM's set of the offload keys its async loads read."""
    return _first(sched, "_chunks_being_loaded", "_blocks_being_loaded") or set()


def chunks_being_loaded(sched: Any, obs: Observations) -> frozenset[int]:
    return _keys(obs, loading_set(sched))


def block_fence(sched: Any) -> tuple[tuple[int, frozenset[int]], ...]:
    """vLLM's `_block_id_to_pending_jobs` in model blocks."""
    return tuple(sorted(block_fence_map(sched).items()))


def block_fence_map(sched: Any) -> dict[int, frozenset[int]]:
    """`block_fence` as a map (model block -> job ids), unsorted."""
    return {int(b) - 1: frozenset(ids) for b, ids in sched._block_id_to_pending_jobs.items()}


def step_open(sched: Any) -> bool:
    return _first(sched, "_step_region") is not None


def project(setup: Any, obs: Observations) -> AbstractState:
    """The abstract state of vLLM's scheduler-side connector (`setup` a `VLLMSetup`)."""
    sched = setup.scheduler
    jobs = [project_job(sched, obs, jid, js) for jid, js in sched._jobs.items()]
    requests = [project_request(sched, obs, req_id, st)
                for req_id, st in sched._req_status.items()]
    fence = [project_held(obs, jid, due) for jid, due in fence_of(sched, obs).items()]
    table = policy_table(setup.manager)
    ref_cnt = tuple(sorted((obs.key(k), int(c.ref_cnt)) for k, c in table.items()))
    return AbstractState(
        num_workers=obs.num_workers,
        requests=tuple(sorted(requests)),
        jobs=tuple(sorted(jobs)),
        job_counter=int(sched._job_counter),
        stale_threshold=int(sched._stale_job_threshold),
        reset_fence=tuple(sorted(fence)),
        chunks_being_loaded=chunks_being_loaded(sched, obs),
        chunk_ref_cnt=ref_cnt,
        block_fence=block_fence(sched),
        jobs_to_flush=frozenset(sched._current_batch_jobs_to_flush),
        step_open=step_open(sched),
        reset_since_last_step=obs.reset_since_last_step,
        finished_signals=tuple(sorted((r, n) for r, n in obs.signals.items() if n)),
        stores_after_signal=tuple(sorted(obs.stores_after_signal)),
    )


__all__ = ["JobMemo", "Observations", "block_fence", "block_fence_map", "chunks_being_loaded",
           "count_manager_calls", "fence_of", "job_state", "loading_set", "model_block",
           "policy_table", "project", "project_held", "project_job", "project_request",
           "step_open", "vllm_block"]
