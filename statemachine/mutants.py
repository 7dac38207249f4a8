"""The mutant catalogue: named faults that can be switched on, each tied to the vLLM PR,
issue or invariant it stands for.

A mutant has an implementation patch (a context manager that replaces one method of the
reference implementation while it is active) and, where the fault can be expressed in the
abstract model, the name of the matching model fault (`spec.model` checks `World.faults`).
The tests assert that with no mutant the checker and the model-based tests pass, and that
with each mutant the checker (for abstract faults) and the model-based tests each find it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from spec import job as J
from spec.model import Fault
from statemachine.config import OffloadingConfig
from statemachine.effects import SchedulerEffects
from statemachine.manager import CPUOffloadingManager
from statemachine.models import JobStatus, RequestState
from statemachine.policies import LRUPolicy
from statemachine.scheduler import OffloadingScheduler

Patch = Callable[[], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    stands_for: str
    description: str
    patch: Patch
    model_fault: Fault | None = None
    """The same fault in the abstract model, if it can be expressed there."""
    data_plane_models: tuple[str, ...] = ()
    """The `kvspec simulate --model` runs that catch it by the data plane alone (the bytes, or a
    store's keys naming another group than its blocks')."""
    data_plane_soak: tuple[str, ...] = ()
    """The data-plane machines (`statemachine.soak.DATA_PLANE_MACHINES`, by class name)
    whose programs catch it in the data-plane soak (`statemachine.soak.soak_data_plane`), by
    the engine's checks, the kernels' or the bytes (`tests/test_soak_driver.py` holds it to
    that): the soak's first failure is on one of them."""

    @property
    def abstract(self) -> bool:
        return self.model_fault is not None


@contextlib.contextmanager
def _replaced(owner: type, name: str, new: Any) -> Iterator[None]:
    old = owner.__dict__[name]
    setattr(owner, name, new)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _patch(owner: type, name: str, make: Callable[[Any], Any]) -> Patch:
    """A patch replacing `owner.name` by `make(original)`."""
    return lambda: _replaced(owner, name, make(owner.__dict__[name]))


def _patch_in(module: str, cls: str, name: str, make: Callable[[Any], Any]) -> Patch:
    """`_patch` of a class imported only when the patch is applied (the kernels' classes:
    the catalogue is read without importing torch)."""
    def patch() -> contextlib.AbstractContextManager[None]:
        owner = getattr(importlib.import_module(module), cls)
        return _replaced(owner, name, make(owner.__dict__[name]))
    return patch


# --- the faulty versions -------------------------------------------------------------
def _keep_transfer_jobs(orig: Any) -> Any:
    def drop_request_jobs(self: SchedulerEffects, req: RequestState, **kw: Any) -> None:
        held = set(req.transfer_jobs)
        orig(self, req, **kw)
        req.transfer_jobs |= held
    return drop_request_jobs


def _noop_effect(orig: Any) -> Any:
    def effect(self: Any, subject: Any, **kw: Any) -> None:
        return None
    return effect


def _signal_always(orig: Any) -> Any:
    def signal_request_finished(self: SchedulerEffects, req: RequestState,
                                **kw: Any) -> None:
        req.finished_signaled = False
        orig(self, req, **kw)
    return signal_request_finished


def _skip_stale_flush(orig: Any) -> Any:
    def add_to_jobs_to_flush(self: SchedulerEffects, job: JobStatus, **kw: Any) -> None:
        if job.state != J.STALE:
            orig(self, job, **kw)
    return add_to_jobs_to_flush


def _count_once(orig: Any) -> Any:
    def _apply_reports(self: OffloadingScheduler, job_id: int, done: int, failed: int,
                       cls: Any) -> None:
        orig(self, job_id, min(done, 1), min(failed, 1), cls)
    return _apply_reports


def _keep_pin(orig: Any) -> Any:
    def complete_in_manager(self: SchedulerEffects, job: JobStatus, **kw: Any) -> None:
        if job.is_store:
            orig(self, job, **kw)
        else:
            self._unmark_chunks_being_loaded(job)
    return complete_in_manager


def _keep_marks(orig: Any) -> Any:
    def _unmark_chunks_being_loaded(self: SchedulerEffects, job: JobStatus) -> None:
        return None
    return _unmark_chunks_being_loaded


def _store_ready_first_ack(orig: Any) -> Any:
    def count_report(self: SchedulerEffects, job: JobStatus, count: int = 1,
                     **kw: Any) -> None:
        if job.is_store and job.state != J.STALE:
            self.s.manager.complete_store(job.keys, job.owner.ctx, success=True)
        orig(self, job, count=count, **kw)
    return count_report


def _signal_at_finish(orig: Any) -> Any:
    def request_finished(self: OffloadingScheduler, request: Any) -> Any:
        out = orig(self, request)
        req = self._req_status.get(request.request_id)
        if req is not None and not req.finished_signaled:
            req.finished_signaled = True
            self.manager.on_request_finished(req.ctx)
        return out
    return request_finished


def _pending_one(orig: Any) -> Any:
    def __post_init__(self: JobStatus) -> None:
        orig(self)
        self.pending_count = 1
    return __post_init__


def _failed_store_kept(orig: Any) -> Any:
    def roll_back_in_manager(self: SchedulerEffects, job: JobStatus, **kw: Any) -> None:
        if job.is_store:
            self.s.manager.complete_store(job.keys, job.owner.ctx, success=True)
        else:
            orig(self, job, **kw)
    return roll_back_in_manager


@contextlib.contextmanager
def _evict_pinned() -> Iterator[None]:
    """Pinned chunks look idle to the eviction policy and count as evictable."""
    ref_cnt = CPUOffloadingManager.__dict__["_ref_cnt"]
    prepare_store = CPUOffloadingManager.__dict__["prepare_store"]

    def fake_ref_cnt(self: CPUOffloadingManager, key: int) -> int:
        return min(int(ref_cnt(self, key)), 0)

    def store(self: CPUOffloadingManager, keys: Any, ctx: Any) -> Any:
        pinned = sum(1 for n in self.chunk_ref_counts().values() if n > 0)
        self._num_evictable += pinned
        try:
            return prepare_store(self, keys, ctx)
        finally:
            self._num_evictable = sum(1 for n in self.chunk_ref_counts().values() if n == 0)

    def never_pinned(self: LRUPolicy, key: int, evictable: bool) -> None:
        if evictable:
            on_evictable(self, key, evictable)

    on_evictable = LRUPolicy.__dict__["on_evictable"]
    with _replaced(CPUOffloadingManager, "_ref_cnt", fake_ref_cnt), \
            _replaced(CPUOffloadingManager, "prepare_store", store), \
            _replaced(LRUPolicy, "on_evictable", never_pinned):
        yield


def _never_blocked(orig: Any) -> Any:
    def _lookup_blocked(self: OffloadingScheduler, req: RequestState) -> bool:
        return False
    return _lookup_blocked


def _never_stale(orig: Any) -> Any:
    def _recving_is_stale(self: OffloadingScheduler, req_id: str, completed: int) -> bool:
        return False
    return _recving_is_stale


def _no_method(orig: Any) -> Any:
    def method(self: Any) -> None:
        return None
    return method


def _window_sources_unfenced(orig: Any) -> Any:
    def register_store_fences(self: SchedulerEffects, job: JobStatus, **kw: Any) -> None:
        fenced = job.fenced_block_ids
        job.fenced_block_ids = frozenset()
        try:
            orig(self, job, **kw)
        finally:
            job.fenced_block_ids = fenced
    return register_store_fences


def _mask_for_edge_hits(orig: Any) -> Any:
    def reachable_blocks(self: OffloadingConfig, group: int, prompt_tokens: int,
                         start_block: int, end_block: int, short_hits: bool = True,
                         shared_prefix_boundary: int = 0) -> tuple[bool, ...] | None:
        mask: tuple[bool, ...] | None = orig(self, group, prompt_tokens, start_block,
                                             end_block, False, shared_prefix_boundary)
        return mask
    return reachable_blocks


def _handoff_store_unfenced(orig: Any) -> Any:
    def build(self: OffloadingScheduler, out: Any) -> None:
        fire = self._fire

        def unfenced(life: Any, subject: Any, trigger: str, **kw: Any) -> str:
            if trigger == "store":
                kw["fenced_block_ids"] = ()
            return fire(life, subject, trigger, **kw)

        self._fire = unfenced  # type: ignore[method-assign]
        try:
            orig(self, out)
        finally:
            del self._fire
    return build


def _reset_keeps_window_blocks(orig: Any) -> Any:
    def reset_store_cursor(self: SchedulerEffects, req: RequestState, **kw: Any) -> None:
        req.next_stored_chunk_idx = 0  # vLLM 0.33.0 (S:2429-2433): the tables stay
        req.lookup_hit_tokens = None
    return reset_store_cursor


def _ignore_first_chunk_skip(orig: Any) -> Any:
    def skip(self: Any, blocks_per_chunk: int) -> int:
        return 0
    return skip


def _patch_global(module: str, name: str, make: Callable[[Any], Any]) -> Patch:
    """`_patch` of a module-level name (a function a module imported by name)."""
    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        mod = importlib.import_module(module)
        old = getattr(mod, name)
        setattr(mod, name, make(old))
        try:
            yield
        finally:
            setattr(mod, name, old)
    return patch


def _load_extent_rounded_down(orig: Any) -> Any:
    def _load_extent(self: OffloadingScheduler, cached: int) -> tuple[int, int]:
        return cached // self.config.block_size, cached // self.config.tokens_per_chunk
    return _load_extent


def _key_without_group(orig: Any) -> Any:
    def offload_key(block_hash: int, group: int, num_groups: int) -> int:
        return int(orig(block_hash, 0, num_groups))
    return offload_key


def _copy_into_first_group(orig: Any) -> Any:
    def _run_group(self: Any, direction: Any, group: int, mapping: Any) -> None:
        orig(self, direction, 0, mapping)
    return _run_group


MUTANTS: tuple[Mutant, ...] = (
    Mutant("reset-keeps-transfer-jobs", "reset", "vLLM PR #48102 (INV-1)",
           "reset_cache clears the job table but leaves the ids in transfer_jobs",
           _patch(SchedulerEffects, "drop_request_jobs", _keep_transfer_jobs),
           Fault.RESET_KEEPS_TRANSFER_JOBS),
    Mutant("reset-skips-flush", "reset", "vLLM PR #41956, INV-16",
           "reset_cache does not flush the jobs alive at the reset",
           _patch(SchedulerEffects, "add_to_jobs_to_flush", _skip_stale_flush),
           Fault.RESET_SKIPS_FLUSH),
    Mutant("reset-keeps-stale-threshold", "reset", "S:2436, INV-4",
           "reset_cache does not advance the stale threshold: late acks of pre-reset jobs "
           "are taken for live ones",
           _patch(OffloadingScheduler, "_advance_stale_threshold", _no_method),
           Fault.RESET_KEEPS_STALE_THRESHOLD),
    Mutant("reset-signals-twice", "reset", "INV-11, M:424-431",
           "reset_cache calls on_request_finished for finished requests already signaled",
           _patch(SchedulerEffects, "signal_request_finished", _signal_always),
           Fault.RESET_SIGNALS_TWICE),
    Mutant("stale-load-failure-ignored", "reset", "INV-20, spec.rules.StaleLoadFailure "
           "(the spec's own rule)",
           "the failure of an async load a reset made stale is only counted against the "
           "fence: the request leaves ORPHANED_LOAD as if the load were good and its failed "
           "KV is taken as computed",
           _patch(SchedulerEffects, "invalidate_orphaned_load", _noop_effect),
           Fault.STALE_LOAD_FAILURE_IGNORED,
           data_plane_soak=("AsyncLoadDataPlaneStateMachine", "TightDataPlaneStateMachine",
                            "DefaultRetentionMambaDataPlaneStateMachine")),
    Mutant("stale-recving-promotes", "reset", "INV-20, spec.request.recving_is_stale (the "
           "spec's timeout path)",
           "the late finished_recving of a timed-out async load is taken for the request's "
           "newer load, which a reset orphaned: the request leaves ORPHANED_LOAD and runs on "
           "blocks that load has not filled (and later fails)",
           _patch(OffloadingScheduler, "_recving_is_stale", _never_stale),
           Fault.STALE_RECVING_PROMOTES,
           data_plane_soak=("AsyncLoadDataPlaneStateMachine",)),
    Mutant("aggregate-counts-once", "accounting", "KU:82-175, C:94-106 (TP acks)",
           "an aggregated report {id: n} counts as one ack: jobs never complete with n > 1",
           _patch(OffloadingScheduler, "_apply_reports", _count_once),
           Fault.AGGREGATE_COUNTS_ONCE),
    Mutant("pending-count-one", "accounting", "S:1491 pending_count = num_workers",
           "jobs wait for one worker only: the other workers' acks arrive for ended jobs",
           _patch(JobStatus, "__post_init__", _pending_one)),
    Mutant("store-ready-on-first-ack", "accounting", "INV-12, S:2283-2287",
           "a store's chunks become loadable at its first ack, while other workers copy",
           _patch(SchedulerEffects, "count_report", _store_ready_first_ack),
           Fault.STORE_READY_ON_FIRST_ACK),
    Mutant("preempt-skips-flush", "fences", "S:2136-2151, INV-15",
           "preemption does not flush the request's jobs: a store reads freed blocks",
           _patch(SchedulerEffects, "flush_request_jobs", _noop_effect),
           Fault.PREEMPT_SKIPS_FLUSH),
    Mutant("realloc-skips-fence", "fences", "S:2153-2165, INV-15, test_fence_at_*",
           "a fenced block re-allocated in this step does not flush the store reading it",
           _patch(OffloadingScheduler, "_flush_reallocated_blocks", _no_method),
           Fault.REALLOC_SKIPS_FENCE),
    Mutant("lookup-ignores-transfer-jobs", "fences", "issue #46014, S:1247-1252",
           "a request still holding flushed jobs is looked up again on re-admission",
           _patch(OffloadingScheduler, "_lookup_blocked", _never_blocked),
           Fault.LOOKUP_IGNORES_TRANSFER_JOBS),
    Mutant("finish-skips-deferred-fence", "fences", "S:2371-2374, INV-7, PR #48596",
           "request_finished does not fence the blocks its in-flight stores read",
           _patch(SchedulerEffects, "register_deferred_fences", _noop_effect),
           Fault.FINISH_SKIPS_DEFERRED_FENCE),
    Mutant("signal-before-final-store", "finish", "B:430-448, INV-10/11",
           "on_request_finished is called at request_finished, before the final store",
           _patch(OffloadingScheduler, "request_finished", _signal_at_finish),
           Fault.SIGNAL_BEFORE_FINAL_STORE),
    Mutant("complete-load-keeps-pin", "manager", "M:247-258, INV-12",
           "a completed load does not unpin its chunks: they can never be evicted",
           _patch(SchedulerEffects, "complete_in_manager", _keep_pin),
           Fault.COMPLETE_LOAD_KEEPS_PIN),
    Mutant("load-keeps-chunks-being-loaded", "manager", "PR #46019, INV-8",
           "a finished load leaves its keys in _chunks_being_loaded: lookups defer forever",
           _patch(SchedulerEffects, "_unmark_chunks_being_loaded", _keep_marks),
           Fault.LOAD_KEEPS_CHUNKS_BEING_LOADED),
    Mutant("failed-store-kept", "manager", "NVIDIA Dynamo #15079",
           "a failed store is completed as successful: chunks nobody wrote become loadable",
           _patch(SchedulerEffects, "roll_back_in_manager", _failed_store_kept)),
    Mutant("evict-pinned-chunks", "manager", "LRU:175-219, INV-12",
           "eviction may take a chunk a live load is reading",
           _evict_pinned,
           Fault.EVICT_PINNED_CHUNKS),
    Mutant("sliding-window-skips-fence", "groups", "S:2002-2051, S:2068-2069, INV-7",
           "a store's sliding-window sources are not fenced at its creation: the core frees "
           "them while the request runs and hands them out, and the store is not flushed",
           _patch(SchedulerEffects, "register_store_fences", _window_sources_unfenced),
           Fault.SLIDING_WINDOW_SKIPS_FENCE,
           data_plane_models=("hybrid", "mamba")),
    Mutant("reset-keeps-stale-window-blocks", "groups", "finding F2 (vLLM 0.33.0, "
           "S:2429-2433), INV-15",
           "a reset puts the store cursor back but keeps the sliding-window ids the core freed: "
           "the next store reads a block another request holds",
           _patch(SchedulerEffects, "reset_store_cursor", _reset_keeps_window_blocks),
           Fault.RESET_KEEPS_STALE_WINDOW_BLOCKS,
           data_plane_models=("hybrid",)),
    Mutant("handoff-store-skips-fence", "groups", "S:1593-1602, INV-15",
           "the store of a Mamba state the core handed off is not fenced at its creation: the "
           "core frees the state block a step later and hands it out, and the store is not "
           "flushed",
           _patch(OffloadingScheduler, "_build_boundary_store_jobs", _handoff_store_unfenced),
           Fault.HANDOFF_STORE_SKIPS_FENCE,
           data_plane_models=("mamba",)),
    Mutant("tail-load-rounds-down", "groups", "S:1393, S:1423-1442, INV-22",
           "a load counts its GPU blocks and chunks with floor division: a partial tail's "
           "key lands in the last complete block, and the block the boundary falls in is "
           "not loaded",
           _patch(OffloadingScheduler, "_load_extent", _load_extent_rounded_down),
           Fault.TAIL_LOAD_ROUNDS_DOWN),
    Mutant("store-mask-ignores-short-hits", "groups", "finding F4 (vLLM 0.33.0, S:1770-1796 "
           "and vllm/v1/core/single_type_kv_cache_manager.py:956-966), INV-23",
           "the store's reachable-block mask counts the blocks a hit ending on a block edge "
           "reads, as vLLM's does: a chunk stored without its leading blocks then serves a "
           "hit one token short of a block edge, whose window reads one block more",
           _patch(OffloadingConfig, "reachable_blocks", _mask_for_edge_hits),
           Fault.STORE_MASK_IGNORES_SHORT_HITS),
    Mutant("keys-without-group-index", "groups", "B:27-42 (make_offload_key)",
           "a chunk key is made from the block hash alone, without its KV cache group: every "
           "group's chunk of a position has one key, so one group's chunk is stored and the "
           "others are loaded from its slot",
           _patch_global("statemachine.scheduler", "offload_key", _key_without_group),
           data_plane_models=("hybrid", "mamba")),
    Mutant("kernel-ignores-first-chunk-skip", "kernels", "GW:629-663 (first-chunk skip)",
           "the copy kernels ignore the first-chunk skip of a range that does not start on a "
           "chunk boundary: loads read the wrong sub-blocks",
           _patch_in("kernels.layout", "Segment", "skip", _ignore_first_chunk_skip),
           data_plane_models=("hybrid",),
           data_plane_soak=("WindowDataPlaneStateMachine",
                            "DefaultRetentionHybridDataPlaneStateMachine",
                            "NarrowWindowDataPlaneStateMachine")),
    Mutant("kernel-copies-into-first-group", "kernels", "GW:597-669 (per-group refs)",
           "the copy kernels copy every KV cache group's blocks in the first group's tensors: "
           "a sliding-window group's pages land in (and are read from) the full-attention "
           "layers",
           _patch_in("kernels.engine", "_Copier", "_run_group", _copy_into_first_group),
           data_plane_models=("hybrid", "mamba")),
)


def by_name(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no mutant {name!r}; known: {', '.join(m.name for m in MUTANTS)}")
