"""The effects named in the tables, as methods: the lifecycles call them, nothing else does.

Each method is the implementation of one effect of `spec.request`, `spec.job` or
`spec.fence`, under the same name, with the subject first and the trigger's keyword
arguments after it. An `OffloadingScheduler` owns one `SchedulerEffects`, the host of its
lifecycles, which works on the scheduler's tables (`self.s`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK
from spec.rules import FailedLoadLookup, StaleLoadFailure
from statemachine.messages import CPULoadStoreSpec, GPULoadStoreSpec, TransferJob
from statemachine.models import JobStatus, RequestState, ResetFence

if TYPE_CHECKING:
    from statemachine.scheduler import OffloadingScheduler


class SchedulerEffects:
    def __init__(self, scheduler: OffloadingScheduler) -> None:
        self.s = scheduler

    # ================================================================ request effects
    def create_request_status(self, req: RequestState, **_: Any) -> None:
        req.ctx = self.s.manager.on_new_request(req.req_id)
        self.s._req_status[req.req_id] = req

    def restart_from_token_zero(self, req: RequestState, **_: Any) -> None:
        req.set_tables(((),) * self.s.config.num_groups)
        req.load_tables = ()
        req.scheduled_end = 0
        req.next_stored_chunk_idx = 0
        req.lookup_hit_tokens = None
        req.kv_load_id = None

    def start_deferral_timer(self, req: RequestState, **_: Any) -> None:
        if req.deferred_lookup_since_step is None:
            req.deferred_lookup_since_step = self.s.step_index
        self.s.stats["lookups_deferred"] += 1

    def record_lookup_hit(self, req: RequestState, hit_tokens: int = 0, sync: bool = False,
                          **_: Any) -> None:
        req.deferred_lookup_since_step = None
        req.num_hit_chunks = hit_tokens // self.s.config.tokens_per_chunk
        req.lookup_hit_tokens = hit_tokens if hit_tokens > 0 else None
        req.sync_load_reserved = sync
        self.s.stats["lookups"] += 1
        if hit_tokens:
            self.s.stats["lookup_hits"] += 1
        if sync:
            self.s._batch_sync_load_bytes += hit_tokens * self.s.config.kv_bytes_per_token

    def bypass_offload_lookup(self, req: RequestState, **_: Any) -> None:
        req.loaded_tokens_invalid = False
        req.deferred_lookup_since_step = None
        self.s.stats["lookups_bypassed"] += 1

    def create_load_job(self, req: RequestState, keys: tuple[int, ...] = (),
                        block_ids: tuple[int, ...] = (), first_block_index: int = 0,
                        group_sizes: tuple[int, ...] = (), block_indices: tuple[int, ...] = (),
                        end_chunk: int = 0, sync: bool = False,
                        block_table: tuple[tuple[int, ...], ...] = (), **_: Any) -> None:
        req.load_tables = block_table  # the core holds them; the table waits for the schedule
        job = JobStatus(-1, req, "load", self.s.config.num_workers, sync=sync, keys=keys,
                        gpu_block_ids=block_ids, first_block_index=first_block_index,
                        group_sizes=group_sizes, block_indices=block_indices)
        self.s._jobs_life.add(job)
        self.s._fire(self.s._jobs_life, job, "create_load")
        if sync:
            req.kv_load_id = job.job_id
        req.loaded_from_offload = True
        req.lookup_hit_tokens = None
        # CHUNK_LEVEL policy: loaded chunks are not stored again (S:1471-1472)
        req.next_stored_chunk_idx = end_chunk

    def mark_chunks_being_loaded(self, req: RequestState, keys: tuple[int, ...] = (),
                                 **_: Any) -> None:
        self.s.chunks_being_loaded.update(keys)

    def record_block_ids(self, req: RequestState,
                         block_ids: tuple[tuple[int, ...], ...] = (), **_: Any) -> None:
        req.set_tables(block_ids)

    def create_store_job(self, req: RequestState, keys: tuple[int, ...] = (),
                         chunk_ids: tuple[int, ...] = (), block_ids: tuple[int, ...] = (),
                         first_block_index: int = 0, fenced_block_ids: tuple[int, ...] = (),
                         group_sizes: tuple[int, ...] = (), block_indices: tuple[int, ...] = (),
                         end_chunk: int = 0, **_: Any) -> None:
        fenced = frozenset(fenced_block_ids)  # sliding-window sources: fenced from creation
        job = JobStatus(-1, req, "store", self.s.config.num_workers, keys=keys,
                        gpu_block_ids=block_ids, cpu_chunk_ids=chunk_ids,
                        first_block_index=first_block_index, group_sizes=group_sizes,
                        block_indices=block_indices, fenced_block_ids=fenced,
                        deferred_fence_block_ids=frozenset(block_ids) - fenced)
        self.s._jobs_life.add(job)
        self.s._fire(self.s._jobs_life, job, "create_store")
        req.next_stored_chunk_idx = end_chunk

    def count_allocation_failure(self, req: RequestState, **_: Any) -> None:
        self.s.stats["allocation_failures"] += 1

    def flush_request_jobs(self, req: RequestState, **_: Any) -> None:
        for job_id in sorted(req.transfer_jobs - self.s._batch_load_jobs):
            job = self.s.jobs.get(job_id)
            if job is not None:
                self.s._fire(self.s._jobs_life, job, "flush")

    def register_deferred_fences(self, req: RequestState, **_: Any) -> None:
        for job_id in sorted(req.transfer_jobs):
            job = self.s.jobs.get(job_id)
            if job is not None:
                for block in job.deferred_fence_block_ids:
                    self.s.block_fence.setdefault(block, set()).add(job_id)

    def signal_request_finished(self, req: RequestState, **_: Any) -> None:
        if not req.finished_signaled:
            req.finished_signaled = True
            self.s.manager.on_request_finished(req.ctx)

    def delete_request_status(self, req: RequestState, **_: Any) -> None:
        self.s._req_status.pop(req.req_id, None)
        self.s._retired.append(req)

    def reset_store_cursor(self, req: RequestState, **_: Any) -> None:
        req.next_stored_chunk_idx = 0
        req.lookup_hit_tokens = None
        # beyond vLLM 0.33.0 (F2): the sliding-window positions before the window were freed
        # by the core (and maybe handed out); with the cursor at 0 a store would read them
        for g in self.s.config.window_groups:
            table = req.group_block_ids[g]
            for p in range(min(self.s.config.skipped_blocks(g, req.scheduled_end), len(table))):
                table[p] = NULL_BLOCK

    def drop_request_jobs(self, req: RequestState, **_: Any) -> None:
        for job_id in sorted(req.transfer_jobs):
            job = self.s.jobs.get(job_id)
            if job is not None:
                self.s._fire(self.s._jobs_life, job, "reset")
        req.transfer_jobs.clear()

    def mark_load_invalid(self, req: RequestState, **_: Any) -> None:
        req.loaded_tokens_invalid = True
        if self.s.config.rules.failed_load_lookup is FailedLoadLookup.FOR_LIFE:
            req.load_failed = True

    def poison_request_stores(self, req: RequestState, **_: Any) -> None:
        for job_id in sorted(req.transfer_jobs):
            job = self.s.jobs.get(job_id)
            if job is not None and job.is_store and job.state != J.FAILING:
                self.s._fire(self.s._jobs_life, job, "poison")

    def quarantine_load_blocks(self, req: RequestState, job_id: int = -1,
                               gpu_block_ids: tuple[int, ...] = (), **_: Any) -> None:
        self.s.quarantined_gpu_blocks[job_id] = gpu_block_ids

    def signal_untracked_finished(self, req: RequestState, **_: Any) -> None:
        ctx = self.s.manager.on_new_request(req.req_id)
        self.s.manager.on_request_finished(ctx)

    def promote_after_recving(self, req: RequestState, **_: Any) -> None:
        self.s.stats["orphaned_loads_promoted"] += 1

    # ==================================================================== job effects
    def allocate_job_id(self, job: JobStatus, **_: Any) -> None:
        job.job_id = self.s.jobs.allocate_id()

    def pin_load_chunks(self, job: JobStatus, **_: Any) -> None:
        job.cpu_chunk_ids = self.s.manager.prepare_load(job.keys, job.owner.ctx)

    def protect_store_chunks(self, job: JobStatus, **_: Any) -> None:
        self.s.stats["stores"] += 1

    def enter_job_table(self, job: JobStatus, **_: Any) -> None:
        self.s.jobs.add(job)
        job.owner.transfer_jobs.add(job.job_id)
        if job.is_store:
            self.s._batch_store_jobs.add(job.job_id)
        else:
            self.s._batch_load_jobs.add(job.job_id)
            self.s.stats["loads"] += 1

    def register_store_fences(self, job: JobStatus, **_: Any) -> None:
        blocks = set(job.fenced_block_ids)
        if job.owner.is_finished:
            blocks |= job.deferred_fence_block_ids
        for block in sorted(blocks):
            self.s.block_fence.setdefault(block, set()).add(job.job_id)
        if job.owner.is_finished and blocks & self.s._batch_allocated_blocks:
            self.s._fire(self.s._jobs_life, job, "flush")

    def put_in_metadata(self, job: JobStatus, **_: Any) -> None:
        job.shipped_step = self.s.step_index
        gpu = GPULoadStoreSpec(job.gpu_block_ids, job.first_block_index, job.group_sizes,
                               job.block_indices)
        cpu = CPULoadStoreSpec(job.cpu_chunk_ids)
        if job.is_store:
            self.s._meta_store_jobs[job.job_id] = TransferJob(job.owner.req_id, gpu, cpu)
        else:
            self.s._meta_load_jobs[job.job_id] = TransferJob(job.owner.req_id, cpu, gpu, job.sync)

    def add_to_jobs_to_flush(self, job: JobStatus, **_: Any) -> None:
        job.flush_requested = True
        self.s.jobs_to_flush.add(job.job_id)

    def count_report(self, job: JobStatus, count: int = 1, **_: Any) -> None:
        job.pending_count -= count

    def mark_failed(self, job: JobStatus, **_: Any) -> None:
        job.failed = True

    def complete_in_manager(self, job: JobStatus, **_: Any) -> None:
        if job.is_store:
            self.s.manager.complete_store(job.keys, job.owner.ctx, success=True)
        else:
            self.s.manager.complete_load(job.keys, job.owner.ctx)
            self._unmark_chunks_being_loaded(job)

    def roll_back_in_manager(self, job: JobStatus, **_: Any) -> None:
        self.s.stats["failed_jobs"] += 1
        if job.is_store:
            self.s.manager.complete_store(job.keys, job.owner.ctx, success=False)
        else:
            self.s.manager.complete_load(job.keys, job.owner.ctx)
            self._unmark_chunks_being_loaded(job)

    def leave_job_table(self, job: JobStatus, **_: Any) -> None:
        if job.job_id not in self.s.jobs:
            return  # a timed-out job being reset: it left the table at its timeout
        self.s.jobs.remove(job.job_id)
        job.owner.transfer_jobs.discard(job.job_id)
        for block in job.fenced_block_ids | job.deferred_fence_block_ids:
            waiting = self.s.block_fence.get(block)
            if waiting is not None:
                waiting.discard(job.job_id)
                if not waiting:
                    del self.s.block_fence[block]
        if job.state == J.STALE:
            return  # reset: the owner is being reset in the same event
        self.s._fire(self.s._requests_life, job.owner, J.ENDING_TRIGGER[job.kind, job.state],
                     job_id=job.job_id, gpu_block_ids=job.gpu_block_ids)

    def enter_timeout_quarantine(self, job: JobStatus, **_: Any) -> None:
        self.s.stats["timed_out_jobs"] += 1
        self.s.jobs.quarantine[job.job_id] = job
        if job.is_store:
            job.quarantined_slots = self.s.manager.quarantine_store(job.keys)
        else:
            self._unmark_chunks_being_loaded(job)

    def release_quarantine(self, job: JobStatus, **_: Any) -> None:
        self.s.jobs.quarantine.pop(job.job_id, None)
        if job.is_store:
            self.s.manager.release_slots(job.quarantined_slots)
        else:
            self.s.manager.complete_load(job.keys, None)
        self._release_gpu_quarantine(job.job_id)

    def enter_reset_fence(self, job: JobStatus, **_: Any) -> None:
        self.s.jobs.quarantine.pop(job.job_id, None)
        job.quarantined_slots = ()  # the manager's reset frees every slot
        self.s.fence.entries[job.job_id] = job.pending_count
        self.s._fenced_jobs[job.job_id] = job

    def count_stale_report(self, job: JobStatus, count: int = 1, **_: Any) -> None:
        job.pending_count -= count
        self.s.fence.entries[job.job_id] = job.pending_count
        self.s.stats["stale_reports"] += count

    def invalidate_orphaned_load(self, job: JobStatus, **_: Any) -> None:
        if self.s.config.rules.stale_load_failure is StaleLoadFailure.FENCE_ONLY:
            return  # 0.34.0: only the fence counts it; the core reads failed_recving
        owner = self.s._req_status.get(job.owner.req_id)
        if (not job.is_store and owner is job.owner and owner.state == R.ORPHANED_LOAD
                and not owner.loaded_tokens_invalid):
            owner.loaded_tokens_invalid = True
            self.s.stats["orphaned_loads_failed"] += 1

    def invalidate_owner_kv(self, job: JobStatus, **_: Any) -> None:
        owner = self.s._req_status.get(job.owner.req_id)
        if (not job.is_store and job.sync and owner is job.owner
                and owner.kv_load_id == job.job_id):
            self.s._fire(self.s._requests_life, owner, "kv_invalidated")

    def leave_reset_fence(self, job: JobStatus, **_: Any) -> None:
        del self.s.fence.entries[job.job_id]
        self.s._fenced_jobs.pop(job.job_id, None)
        self._release_gpu_quarantine(job.job_id)

    # ================================================================== fence effects
    def extend_fence(self, fence: ResetFence, **_: Any) -> None:
        fence.since_step = self.s.step_index

    def signal_reset_flushed(self, fence: ResetFence, **_: Any) -> None:
        fence.since_step = None
        self.s.manager.on_reset_flushed()
        self.s.stats["reset_flushed"] += 1

    def count_ignored_report(self, fence: ResetFence, count: int = 1, **_: Any) -> None:
        self.s.stats["ignored_stale_reports"] += count

    # ================================================================== helpers
    def _unmark_chunks_being_loaded(self, job: JobStatus) -> None:
        """Only an async load marked its keys (mark_chunks_being_loaded): a sync load must not
        unmark them, or an async load of the same chunks admitted after it in the same step
        loses its marks (INV-8) and later lookups stop deferring behind it."""
        if not job.sync:
            self.s.chunks_being_loaded.difference_update(job.keys)

    def _release_gpu_quarantine(self, job_id: int) -> None:
        blocks = self.s.quarantined_gpu_blocks.pop(job_id, None)
        if blocks is not None:
            self.s.released_gpu_blocks.extend(blocks)
