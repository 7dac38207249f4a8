"""Worker ranks: each owns a KV shard and runs its copies of the step's transfer jobs.

A `Worker` is one tensor-parallel rank: its own GPU KV tensors (`kernels.allocate_gpu_kv`),
its own CPU chunks (`kernels.allocate_cpu_kv`) and its own `kernels.CopyEngine`. Its jobs are
models of one `Lifecycle` built from `spec.worker` (`add` on receipt, `remove` once
reported). The table's effects are this class's methods, and they are the only code that
touches the copy engine: entering SUBMITTED launches the copy (`launch_copy_kernel`), a
flush or a sync load waits for it (`wait_for_copy`), and COPIED / FAILED are entered only
when `get_finished` polls the copy's completion.

The per-step calls mirror vLLM's worker (W:219-329): `handle_preemptions`,
`start_kv_transfers`, (the forward pass), `prepare_store_kv`, `get_finished`.

Fault injection (beyond vLLM): `fail_job` makes a job's copy report failure (the kernels'
failure hook: it copies nothing); `hang_job` makes the rank withhold a job's completion, as
a hung worker or a lost report would, until `release_job` (or a countdown of steps);
`stall` keeps every copy of the rank in flight for a few steps (a busy copy stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transitions import EventData

import spec
from spec import worker as W
from statemachine.errors import KVSpecError
from statemachine.lifecycle import Fired, Lifecycle, Nesting
from statemachine.messages import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)

from kernels import (  # isort: skip
    CopyEngine,
    CopyResult,
    KVLayout,
    Segment,
    TransferSpec,
    allocate_cpu_kv,
    allocate_gpu_kv,
)

JobKind = Literal["load", "store"]


class WorkerError(KVSpecError):
    """A worker call that breaks the step protocol (a job received twice, a failure injected
    after the copy was launched, a completion for a job never submitted)."""


@dataclass(eq=False)
class WorkerJob:
    """One rank's copy of one transfer job: a model of the worker lifecycle."""

    job_id: int
    req_id: str
    kind: JobKind
    sync: bool
    transfer: TransferSpec
    rank: int
    state: str = W.QUEUED
    result: CopyResult | None = None
    copied: bool = False
    """Its copy is known complete (waited for, or polled) and was handed to the oracle."""

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The job's blocks per KV cache group (one segment for a one-group job)."""
        return self.transfer.segments

    @property
    def key(self) -> int:
        return self.job_id

    @property
    def is_store(self) -> bool:
        return self.kind == "store"

    # -- guards (spec.worker.GUARDS) -------------------------------------------------
    def copy_succeeded(self, event: EventData) -> bool:
        result = event.kwargs.get("result")
        return isinstance(result, CopyResult) and result.success

    def sync_load(self, event: EventData) -> bool:
        return self.kind == "load" and self.sync

    def async_load(self, event: EventData) -> bool:
        return self.kind == "load" and not self.sync


@dataclass
class WorkerReport:
    """What one rank hands back at the end of a step (`get_finished`)."""

    rank: int
    meta: OffloadingWorkerMetadata | None
    """completed_jobs {id: 1}; beyond vLLM failed_jobs {id: 1}. None if nothing ended."""
    finished_recving: set[str] = field(default_factory=set)
    recving_jobs: dict[int, str] = field(default_factory=dict)
    """The async loads behind finished_recving, by job id (the engine matches them)."""
    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds_loading: float = 0.0
    seconds_storing: float = 0.0


def transfer_spec(job: TransferJob) -> TransferSpec:
    gpu, cpu = (job.src, job.dst) if job.is_store else (job.dst, job.src)
    if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, CPULoadStoreSpec):
        raise WorkerError(f"job of request {job.req_id!r}: a transfer goes between GPU blocks "
                          "and CPU chunks")
    if gpu.group_sizes:
        return TransferSpec(gpu.block_ids, cpu.chunk_ids, group_sizes=gpu.group_sizes,
                            block_indices=gpu.block_indices)
    return TransferSpec(gpu.block_ids, cpu.chunk_ids, gpu.first_block_index)


class Worker:
    def __init__(self, rank: int, layout: KVLayout, num_gpu_blocks: int, num_cpu_chunks: int,
                 device: torch.device | str | None = None) -> None:
        self.rank = rank
        self.layout = layout
        self.gpu = allocate_gpu_kv(layout, num_gpu_blocks, device)
        self.cpu = allocate_cpu_kv(layout, num_cpu_chunks)
        self.engine = CopyEngine(self.gpu, self.cpu, layout.blocks_per_chunk,
                                 groups=layout.groups)
        self.jobs: dict[int, WorkerJob] = {}
        self.chunk_writer: dict[int, tuple[int, str]] = {}
        """CPU chunk slot -> (store job id, request id) of the last store submitted into it."""
        self._queued_stores: list[int] = []
        self._popped: set[int] = set()
        self._hung: dict[int, int | None] = {}
        self._failing: set[int] = set()
        self._stalled_polls = 0
        """get_finished calls left during which no copy completes (`stall`)."""
        self._copied: list[WorkerJob] = []
        self._withheld: dict[int, CopyResult] = {}
        self._behind: dict[int, list[int]] = {}
        """A hung sync load -> the later jobs of its request whose completions wait for its
        report (a rank reports a request's sync load before its later jobs)."""
        self._meta = OffloadingWorkerMetadata()
        self._reported_any = False
        self._recving: dict[int, str] = {}
        self._bytes = {"load": 0, "store": 0}
        self._seconds = {"load": 0.0, "store": 0.0}
        self.fired: list[Fired] = []
        self.record_fired = False
        """Keep every fired transition in `fired` (for tests)."""
        nesting = Nesting(observers=[self._observe_fired])
        self.life = Lifecycle(spec.WORKER_MACHINE, WorkerJob, self, nesting)

    def _observe_fired(self, fired: Fired) -> None:
        if self.record_fired:
            self.fired.append(fired)

    # ================================================================ the machinery
    def _fire(self, job: WorkerJob, trigger: str, **kwargs: Any) -> str:
        state = self.life.fire(job, trigger, **kwargs)
        if state in spec.WORKER_MACHINE.finals:
            del self.jobs[job.job_id]
            self._failing.discard(job.job_id)
        return state

    def _receive(self, job_id: int, job: TransferJob) -> WorkerJob:
        if job_id in self.jobs:
            raise WorkerError(f"worker {self.rank}: job {job_id} received twice (it is "
                              f"{self.jobs[job_id].state})")
        wjob = WorkerJob(job_id, job.req_id, "store" if job.is_store else "load", job.sync,
                         transfer_spec(job), self.rank)
        self.life.add(wjob)
        self.jobs[job_id] = wjob
        return wjob

    def _submit_queued_stores(self) -> None:
        queued, self._queued_stores = self._queued_stores, []
        for job_id in queued:
            self._fire(self.jobs[job_id], "submit")

    # ================================================================ the step
    def handle_preemptions(self, meta: OffloadingConnectorMetadata) -> None:
        """Before the forward pass: if the step flushes jobs, take this step's flushed stores,
        submit every queued store, then wait for every flushed job (W:219-244)."""
        if not meta.jobs_to_flush:
            return
        for job_id in sorted(meta.jobs_to_flush & meta.store_jobs.keys()):
            self._receive(job_id, meta.store_jobs[job_id])
            self._queued_stores.append(job_id)
            self._popped.add(job_id)
        self._submit_queued_stores()
        for job_id in sorted(meta.jobs_to_flush):
            job = self.jobs.get(job_id)
            if job is not None:  # unknown or already reported: ignored (GW:759-763)
                self._fire(job, "flush")

    def start_kv_transfers(self, meta: OffloadingConnectorMetadata) -> None:
        """Submit the stores queued by the previous step, then this step's loads; wait for the
        sync loads before the forward pass (W:246-270)."""
        self._submit_queued_stores()
        received = [self._receive(job_id, job) for job_id, job in sorted(meta.load_jobs.items())]
        for job in received:
            self._fire(job, "submit")
        for job in received:
            if job.sync:
                self._fire(job, "await_sync")

    def prepare_store_kv(self, meta: OffloadingConnectorMetadata) -> None:
        """Queue this step's stores; they are submitted at the start of the next step
        (W:272-284)."""
        for job_id, job in sorted(meta.store_jobs.items()):
            if job_id in self._popped:
                continue  # flushed in this step: already submitted by handle_preemptions
            self._receive(job_id, job)
            self._queued_stores.append(job_id)
        self._popped.clear()

    def get_finished(self) -> WorkerReport:
        """Poll the copies' completions; report every job whose completion was observed
        (W:286-329)."""
        fresh: set[int] = set()
        limit = None
        if self._stalled_polls:
            self._stalled_polls -= 1
            limit = 0  # the copies stay in flight (a wait still completes them)
        for result in self.engine.poll(limit):
            job = self.jobs.get(result.job_id)
            if job is None or job.state not in W.COPYING:
                raise WorkerError(f"worker {self.rank}: the copy engine completed job "
                                  f"{result.job_id}, which this worker never submitted")
            if result.success:
                self._copy_known_complete(job)
            if result.job_id in self._hung:
                self._withheld[result.job_id] = result
                fresh.add(result.job_id)
                continue
            blocker = self._hung_sync_load_before(job)
            if blocker is not None:
                self._withheld[result.job_id] = result
                self._behind.setdefault(blocker, []).append(result.job_id)
                continue
            self._fire(job, "copy_done", result=result)
        for job_id in sorted((self._withheld.keys() & self._hung.keys()) - fresh):
            countdown = self._hung[job_id]
            if countdown is None:
                continue
            self._hung[job_id] = countdown - 1
            if countdown - 1 <= 0:
                self._release(job_id)
        for job in [j for j in self.jobs.values() if j.state in W.OBSERVED]:
            self._fire(job, "report")
        report = WorkerReport(
            self.rank, self._meta if self._reported_any else None,
            set(self._recving.values()), dict(self._recving), self._bytes["load"],
            self._bytes["store"], self._seconds["load"], self._seconds["store"])
        self._meta = OffloadingWorkerMetadata()
        self._reported_any = False
        self._recving = {}
        self._bytes = {"load": 0, "store": 0}
        self._seconds = {"load": 0.0, "store": 0.0}
        return report

    # ================================================================ the effects
    def launch_copy_kernel(self, job: WorkerJob, **_: Any) -> None:
        if job.is_store:
            self.engine.submit_store(job.job_id, job.transfer)
            for chunk in job.transfer.cpu_chunks:
                self.chunk_writer[chunk] = (job.job_id, job.req_id)
        else:
            self.engine.submit_load(job.job_id, job.transfer)

    def wait_for_copy(self, job: WorkerJob, **_: Any) -> None:
        self.engine.wait([job.job_id])
        if job.job_id not in self._failing:
            self._copy_known_complete(job)

    def record_copy_result(self, job: WorkerJob, result: CopyResult | None = None,
                           **_: Any) -> None:
        assert result is not None
        job.result = result
        self._bytes[job.kind] += result.bytes
        self._seconds[job.kind] += result.seconds

    def report_completed(self, job: WorkerJob, **_: Any) -> None:
        self._meta.mark_completed(job.job_id)
        self._reported_any = True

    def report_failed(self, job: WorkerJob, **_: Any) -> None:
        self._meta.mark_failed(job.job_id)
        self._reported_any = True

    def report_finished_recving(self, job: WorkerJob, **_: Any) -> None:
        self._recving[job.job_id] = job.req_id

    # ================================================================ fault injection
    def fail_job(self, job_id: int) -> None:
        """Make job `job_id`'s copy on this rank fail (it copies nothing). The job may not be
        received yet; it must not be submitted yet."""
        job = self.jobs.get(job_id)
        if job is not None and job.state != W.QUEUED:
            raise WorkerError(f"worker {self.rank}: job {job_id} is already {job.state}; a "
                              "failure must be injected before its copy is launched")
        self.engine.inject_failure(job_id)
        self._failing.add(job_id)

    def hang_job(self, job_id: int, release_after: int | None = None) -> None:
        """Withhold job `job_id`'s completion on this rank, as a hung worker would: it is
        never reported, or reported `release_after` steps (get_finished calls) after its copy
        completed."""
        job = self.jobs.get(job_id)
        if job is not None and job.state not in W.NOT_YET_COPIED:
            raise WorkerError(f"worker {self.rank}: job {job_id} is already {job.state}")
        if release_after is not None and release_after < 1:
            raise WorkerError(f"release_after must be >= 1 or None, got {release_after}")
        self._hung[job_id] = release_after

    def stall(self, polls: int) -> None:
        """Let no copy of this rank complete for the next `polls` get_finished calls, as a
        busy copy stream would: the forward passes go on while stores and async loads stay
        in flight. A flush or a sync load still waits for its copy. (On CUDA a copy that
        stays in flight is the normal case; the CPU stand-in runs copies when polled, so
        without a stall a store always ends before the core can reuse its sources.)"""
        if type(polls) is not int or polls < 1:
            raise WorkerError(f"stall: polls must be an int >= 1, got {polls!r}")
        self._stalled_polls = max(self._stalled_polls, polls)

    def release_job(self, job_id: int) -> None:
        """Stop withholding job `job_id`: its completion is reported at the next
        get_finished."""
        if job_id not in self._hung:
            raise WorkerError(f"worker {self.rank}: job {job_id} is not hung")
        if job_id in self._withheld:
            self._hung[job_id] = 1
        else:
            del self._hung[job_id]

    def _release(self, job_id: int) -> None:
        result = self._withheld.pop(job_id)
        del self._hung[job_id]
        self._fire(self.jobs[job_id], "copy_done", result=result)
        for later in self._behind.pop(job_id, []):
            self._fire(self.jobs[later], "copy_done", result=self._withheld.pop(later))

    def _hung_sync_load_before(self, job: WorkerJob) -> int | None:
        """An earlier sync load of the same request whose report this rank withholds: the
        rank reports a sync load in the step that waited for it, so before any later job of
        its request (W:256-270, W:286-329); a hung one holds those back too."""
        for job_id in sorted(self._hung):
            held = self.jobs.get(job_id)
            if (held is not None and job_id < job.job_id and held.req_id == job.req_id
                    and held.kind == "load" and held.sync):
                return job_id
        return None

    # ================================================================ the oracle's view
    def _copy_known_complete(self, job: WorkerJob) -> None:
        if not job.copied:
            job.copied = True
            self._copied.append(job)

    def take_copied_jobs(self) -> list[WorkerJob]:
        """Jobs whose copy completed successfully since the last call: after a flush or a
        sync wait (before the forward pass), or when polled. Each is handed out once, so the
        oracle checks the bytes a copy moved at the time it moved them."""
        out, self._copied = self._copied, []
        return out

    def cpu_rows(self, tensor: int, job: WorkerJob, segment: Segment) -> torch.Tensor:
        """The CPU sub-rows (one page per block) of KV tensor `tensor` that one group's part
        of a job reads or writes, in transfer order."""
        t = job.transfer
        bpc = self.layout.blocks_per_chunk
        skip = segment.skip(bpc)
        first = t.chunk_position(segment.start, bpc)
        rows = [t.cpu_chunks[first + (skip + i) // bpc] * bpc + (skip + i) % bpc
                for i in range(segment.size)]
        page = self.layout.page_bytes[tensor]
        return self.cpu[tensor].view(-1, page).index_select(
            0, torch.tensor(rows, dtype=torch.int64))

    # ================================================================ queries
    def hung_jobs(self) -> frozenset[int]:
        return frozenset(self._hung)

    def states(self) -> dict[int, str]:
        return {job_id: job.state for job_id, job in sorted(self.jobs.items())}

    def has_jobs(self) -> bool:
        return bool(self.jobs)

    def shutdown(self) -> None:
        self.engine.shutdown()


def make_workers(num_workers: int, layout: KVLayout, num_gpu_blocks: int,
                 num_cpu_chunks: int, device: torch.device | str | None = None) -> list[Worker]:
    return [Worker(rank, layout, num_gpu_blocks, num_cpu_chunks, device)
            for rank in range(num_workers)]


def aggregate(reports: Iterable[WorkerReport]) -> OffloadingWorkerMetadata | None:
    """Sum the ranks' metadata, as vLLM's KVOutputAggregator does (KU:82-175)."""
    return OffloadingWorkerMetadata.aggregate(r.meta for r in reports)
