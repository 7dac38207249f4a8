"""The copy engine: asynchronous store (GPU -> CPU) and load (CPU -> GPU) jobs of one worker.

A job is submitted with an id and a :class:`~kernels.layout.TransferSpec`; it completes later
and is reported once by :meth:`CopyEngine.poll` as a :class:`CopyResult`. Jobs of one direction
complete in submission order; the two directions are independent (on CUDA they overlap, so a
store and a load touching the same block or chunk must be ordered by the caller, by waiting for
the first to complete).

CUDA backend
    Each job runs on a side stream (round-robin over a small pool) that first waits for the
    current (compute) stream, so the copy sees every kernel issued before the submit, and for
    the end event of the previous job of its direction, so a direction's jobs run in order.
    Start/end events time it; ``poll`` pops each direction's FIFO head while its end event has
    completed; ``wait`` synchronizes end events. Pinned CPU chunks are mapped into the device
    address space when possible, so a scattered job is a couple of index kernels rather than
    one DMA per block (see :mod:`kernels.copy`).

CPU backend (a stand-in with the same API)
    Completion stays asynchronous: ``submit_*`` validates the spec and queues the job; the copy
    is performed only when ``poll`` or ``wait`` is called (FIFO per direction; ``poll`` runs the
    queued jobs in global submission order). The copy reads its source *when it runs*, not at
    submit time, as a GPU copy engine does: it copies the bytes as they are when the transfer
    executes. So the mistakes the real system can make stay observable: reading a destination
    before the job was reported gives stale bytes, and overwriting a GPU block after submitting
    its store but before the store ran (a missing fence) puts the new bytes in the CPU chunk.

Failure injection: :meth:`CopyEngine.inject_failure` marks a job id before submission; that job
then copies nothing and completes (in its FIFO position) with ``success=False`` and
``bytes=0``.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Protocol, cast

import torch

from kernels import native
from kernels.copy import (
    CopyPolicy,
    RowMapping,
    RowTensor,
    Strategy,
    Workspace,
    batch_descriptors,
    batch_unavailable,
    check_kv_tensors,
    choose_strategy,
    copy_rows,
    host_view_on_device,
    native_plan,
    run_batch,
)
from kernels.descriptors import DescriptorPlan, Descriptors
from kernels.layout import KernelSpecError, KVLayout, Segment, TransferSpec, block_row_ids

__all__ = ["CopyEngine", "CopyResult", "Direction", "KernelStateError"]

# torch.cuda.Stream/Event constructors are untyped; call them through typed aliases.
_new_stream = cast(Callable[..., Any], torch.cuda.Stream)
_new_event = cast(Callable[..., Any], torch.cuda.Event)


class KernelStateError(RuntimeError):
    """An engine call is not allowed in the engine's current state (e.g. reused job id)."""


class Direction(enum.StrEnum):
    STORE = "store"  # GPU blocks -> CPU chunks
    LOAD = "load"  # CPU chunks -> GPU blocks


@dataclass(frozen=True, init=False)
class CopyResult:
    """A completed job. ``bytes`` counts bytes copied over all KV tensors (0 if it failed);
    ``seconds`` is the copy's duration (device time on CUDA, wall time on CPU; 0.0 if failed).
    """

    job_id: int
    direction: Direction
    bytes: int
    seconds: float
    success: bool

    def __init__(self, job_id: int, direction: Direction, bytes: int, seconds: float,
                 success: bool) -> None:
        # a frozen value: its fields set once, here (one call, not five: one is made per job)
        vars(self).update(job_id=job_id, direction=direction, bytes=bytes, seconds=seconds,
                          success=success)


@dataclass(eq=False, slots=True)
class _Job:
    seq: int
    job_id: int
    direction: Direction
    mapping: RowMapping
    segments: tuple[Segment, ...]
    """The groups the job copies: each one's blocks at their positions in the mapping."""
    nbytes: int
    fail: bool
    start: Any = None  # torch.cuda.Event on CUDA
    end: Any = None
    batch: Descriptors | None = None
    """A batched job's descriptors, kept until the job completes (the driver reads them)."""


class _Backend(Protocol):
    def launch(self, job: _Job) -> None: ...

    def is_complete(self, job: _Job) -> bool: ...

    def complete(self, job: _Job) -> float: ...


class _Copier:
    """Runs one job's copies (on the current stream): each KV cache group's rows in that
    group's tensors. On host memory with the compiled copy, a group's part of a job is one
    call for all its tensors, planned once per group and direction. Under a batched policy
    a whole job, every group, is one batch of descriptors (one driver call on CUDA), the
    descriptor plans made once per group and direction."""

    def __init__(self, gpu: list[RowTensor], cpu: list[RowTensor], policy: CopyPolicy,
                 groups: tuple[tuple[int, ...], ...], device: torch.device) -> None:
        self.policy, self.device = policy, device
        self.workspace = Workspace()
        self.tensors = [([gpu[t] for t in g], [cpu[t] for t in g]) for g in groups]
        self.plans: dict[Direction, list[native.TensorPairs | None]] = {
            Direction.STORE: [native_plan(c, g, policy) for g, c in self.tensors],
            Direction.LOAD: [native_plan(g, c, policy) for g, c in self.tensors]}
        self.max_row_bytes = max(r.row_bytes for r in gpu)
        self.batch_plans: dict[Direction, list[DescriptorPlan]] = {}
        if policy.batch_dma:
            self.batch_plans = {
                Direction.STORE: [DescriptorPlan([t.data for t in c], [t.data for t in g])
                                  for g, c in self.tensors],
                Direction.LOAD: [DescriptorPlan([t.data for t in g], [t.data for t in c])
                                 for g, c in self.tensors]}

    def strategy(self, job: _Job) -> Strategy | None:
        """``BATCH_DMA`` where the job goes as one batch, else ``None`` (chosen tensor by
        tensor)."""
        if self.batch_plans and choose_strategy(
                job.mapping, self.max_row_bytes, self.policy,
                load=job.direction is Direction.LOAD) is Strategy.BATCH_DMA:
            return Strategy.BATCH_DMA
        return None

    def run(self, job: _Job) -> Descriptors | None:
        """Issue the job's copies; a batched job's descriptors are returned (keep them until
        the job completes)."""
        if self.strategy(job) is Strategy.BATCH_DMA:
            plans = self.batch_plans[job.direction]
            parts = ([job.mapping] if len(job.segments) == 1 else
                     [job.mapping.part(seg.start, seg.size) for seg in job.segments])
            batch = batch_descriptors([plans[seg.group] for seg in job.segments], parts,
                                      self.policy, rows_checked=True)  # by block_rows
            run_batch(batch, self.device, job.direction is Direction.LOAD, self.policy)
            return batch
        if len(job.segments) == 1:
            self._run_group(job.direction, job.segments[0].group, job.mapping)
            return None
        for seg in job.segments:
            self._run_group(job.direction, seg.group, job.mapping.part(seg.start, seg.size))
        return None

    def _run_group(self, direction: Direction, group: int, mapping: RowMapping) -> None:
        plan = self.plans[direction][group]
        if plan is not None:
            plan.copy(mapping.dst_ids, mapping.src_ids)
            return
        store = direction is Direction.STORE
        for gpu, cpu in zip(*self.tensors[group], strict=True):
            if store:
                copy_rows(cpu, gpu, mapping, self.policy, self.workspace)
            else:
                copy_rows(gpu, cpu, mapping, self.policy, self.workspace)


class _CpuBackend:
    def __init__(self, copier: _Copier) -> None:
        self.copier = copier

    def launch(self, job: _Job) -> None:
        """Nothing happens at submit: the copy runs when the job is completed."""

    def is_complete(self, job: _Job) -> bool:
        return False

    def complete(self, job: _Job) -> float:
        if job.fail:
            return 0.0
        t0 = time.perf_counter()
        self.copier.run(job)
        return time.perf_counter() - t0


class _CudaBackend:
    """Side streams round-robin; timing events from a pool (an event is created once and
    reused after its job completed: creating two per job costs more than a small copy)."""

    def __init__(self, copier: _Copier, device: torch.device, num_streams: int) -> None:
        self.copier, self.device = copier, device
        self.streams = [_new_stream(device=device) for _ in range(num_streams)]
        self.next_stream = 0
        self.last_end: dict[Direction, Any] = {d: None for d in Direction}
        self.events: list[Any] = []

    def _event(self) -> Any:
        return self.events.pop() if self.events else _new_event(enable_timing=True)

    def launch(self, job: _Job) -> None:
        stream = self.streams[self.next_stream]
        self.next_stream = (self.next_stream + 1) % len(self.streams)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        previous = self.last_end[job.direction]
        if previous is not None:
            stream.wait_event(previous)
        start, end = self._event(), self._event()
        with torch.cuda.stream(stream):
            start.record(stream)
            if not job.fail:
                job.batch = self.copier.run(job)
            end.record(stream)
        job.start, job.end = start, end
        self.last_end[job.direction] = end

    def is_complete(self, job: _Job) -> bool:
        return bool(job.end.query())

    def complete(self, job: _Job) -> float:
        job.end.synchronize()
        seconds = 0.0 if job.fail else float(job.start.elapsed_time(job.end)) / 1000.0
        if self.last_end[job.direction] is job.end:  # complete: nothing left to wait for
            self.last_end[job.direction] = None
        self.events += (job.start, job.end)
        job.start = job.end = job.batch = None
        return seconds


class CopyEngine:
    """Store/load jobs of one worker's KV tensors; see the module docstring for semantics.

    ``gpu_tensors[t]``: ``int8 (num_gpu_blocks, page_bytes[t])`` on ``device`` (a CUDA device,
    or ``cpu`` for the stand-in backend); ``cpu_tensors[t]``: ``int8 (num_chunks,
    page_bytes[t] * blocks_per_chunk)`` in host memory (pinned for fast CUDA copies).
    ``groups`` (as :attr:`KVLayout.groups`): the tensor indices of each KV cache group; a job's
    blocks of group ``g`` are copied in group ``g``'s tensors only (default: one group).
    ``device`` defaults to the GPU tensors' device. ``host_mapping`` (CUDA only): map pinned CPU
    chunks into the device address space (``None``: when possible; ``False``: never, copies are
    then one DMA per run of consecutive blocks). ``policy`` overrides
    :meth:`CopyPolicy.for_device`. Not thread-safe: one thread drives an engine.
    """

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        device: torch.device | str | None = None,
        *,
        groups: Sequence[Sequence[int]] = (),
        num_streams: int = 2,
        host_mapping: bool | None = None,
        policy: CopyPolicy | None = None,
    ) -> None:
        pages, self.num_gpu_blocks, self.num_chunks = check_kv_tensors(
            gpu_tensors, cpu_tensors, blocks_per_chunk)
        self.layout = KVLayout(tuple(pages), blocks_per_chunk,
                               tuple(tuple(g) for g in groups))
        dev = torch.device(device) if device is not None else gpu_tensors[0].device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if gpu_tensors[0].device != dev:
            raise KernelSpecError(f"GPU tensors are on {gpu_tensors[0].device}, engine on {dev}")
        if num_streams < 1:
            raise KernelSpecError(f"num_streams must be >= 1, got {num_streams}")
        self.device = dev
        mapped: list[torch.Tensor | None] = [None] * len(pages)
        if dev.type == "cpu":
            itemsize = 16
            self.host_mapped = True
        elif dev.type == "cuda":
            itemsize = 8
            if host_mapping is not False:
                mapped = [host_view_on_device(c, dev) for c in cpu_tensors]
            self.host_mapped = all(m is not None for m in mapped)
            if host_mapping and not self.host_mapped:
                raise KernelSpecError("host_mapping=True but the CPU tensors cannot be mapped "
                                      "(are they pinned?)")
            if not self.host_mapped:
                mapped = [None] * len(pages)
        else:
            raise KernelSpecError(f"unsupported device {dev}: need cuda or cpu")
        self.policy = policy if policy is not None else CopyPolicy.for_device(
            dev, self.host_mapped)
        if dev.type == "cuda" and self.policy.native:
            self.policy = replace(self.policy, native=False)  # host-only copy
        if self.policy.index_kernels and not self.host_mapped:
            raise KernelSpecError("policy.index_kernels needs CPU tensors mapped into the device "
                                  "address space; use index_kernels=False")
        why = batch_unavailable(dev) if self.policy.batch_dma else None
        if why is not None:
            raise KernelSpecError(why)
        gpu_rows = [RowTensor.of(g, p, max_itemsize=itemsize)
                    for g, p in zip(gpu_tensors, pages, strict=True)]
        cpu_rows = [RowTensor.of(c, p, mapped=m, max_itemsize=itemsize)
                    for c, m, p in zip(cpu_tensors, mapped, pages, strict=True)]
        copier = _Copier(gpu_rows, cpu_rows, self.policy, self.layout.groups, dev)
        self._backend: _Backend = (
            _CpuBackend(copier) if dev.type == "cpu"
            else _CudaBackend(copier, dev, num_streams))
        self._fifo: dict[Direction, deque[_Job]] = {d: deque() for d in Direction}
        self._done: deque[CopyResult] = deque()
        self._pending: set[int] = set()
        self._fail: set[int] = set()
        self._seq = 0
        self._closed = False

    # -- submission -------------------------------------------------------------------------

    def submit_store(self, job_id: int, spec: TransferSpec) -> None:
        """Queue a copy of ``spec``'s GPU blocks into its CPU chunks."""
        self._submit(job_id, spec, Direction.STORE)

    def submit_load(self, job_id: int, spec: TransferSpec) -> None:
        """Queue a copy of ``spec``'s CPU chunk sub-blocks into its GPU blocks."""
        self._submit(job_id, spec, Direction.LOAD)

    def inject_failure(self, job_id: int) -> None:
        """Make the job ``job_id``, submitted later, copy nothing and report ``success=False``."""
        if job_id in self._pending:
            raise KernelStateError(f"job {job_id} is already submitted; inject before submit")
        self._fail.add(job_id)

    def _submit(self, job_id: int, spec: TransferSpec, direction: Direction) -> None:
        if self._closed:
            raise KernelStateError("engine is shut down")
        if not isinstance(spec, TransferSpec):
            raise KernelSpecError(f"spec must be a TransferSpec, got {type(spec).__name__}")
        if job_id in self._pending:
            raise KernelStateError(f"job id {job_id} is still pending")
        groups = self.layout.num_groups
        if spec.segments[-1].group >= groups:  # segments come in group order
            raise KernelSpecError(f"the job names blocks of KV cache group "
                                  f"{spec.segments[-1].group}; the layout has {groups} groups")
        gpu_rows, cpu_rows = block_row_ids(
            spec, self.layout.blocks_per_chunk, self.num_gpu_blocks, self.num_chunks)
        mapping = (RowMapping.of_block_rows(gpu_rows, cpu_rows) if direction is Direction.STORE
                   else RowMapping.of_block_rows(cpu_rows, gpu_rows))
        fail = job_id in self._fail
        self._fail.discard(job_id)
        job = _Job(self._seq, job_id, direction, mapping,
                   spec.segments,
                   self.layout.job_bytes(spec), fail)
        self._seq += 1
        self._backend.launch(job)
        self._fifo[direction].append(job)
        self._pending.add(job_id)

    # -- completion -------------------------------------------------------------------------

    def _finish_head(self, direction: Direction) -> None:
        job = self._fifo[direction].popleft()
        seconds = self._backend.complete(job)
        self._done.append(CopyResult(job.job_id, direction, 0 if job.fail else job.nbytes,
                                     seconds, not job.fail))

    def _drain_completed(self) -> None:
        for direction in Direction:
            fifo = self._fifo[direction]
            while fifo and self._backend.is_complete(fifo[0]):
                self._finish_head(direction)

    def _complete_in_order(self, limit: int | None) -> None:
        """Complete in-flight jobs in global submission order until ``limit`` results wait."""
        stores, loads = self._fifo[Direction.STORE], self._fifo[Direction.LOAD]
        while limit is None or len(self._done) < limit:
            if stores and (not loads or stores[0].seq < loads[0].seq):
                self._finish_head(Direction.STORE)
            elif loads:
                self._finish_head(Direction.LOAD)
            else:
                return

    def poll(self, limit: int | None = None) -> list[CopyResult]:
        """Report completed jobs (each exactly once), FIFO per direction, at most ``limit``.

        On CPU this is where queued jobs run: in global submission order, until ``limit``
        results are available (all of them if ``limit`` is None).
        """
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if isinstance(self._backend, _CpuBackend):  # nothing completes by itself there
            self._complete_in_order(limit)
        else:
            self._drain_completed()
        count = len(self._done) if limit is None else min(limit, len(self._done))
        results = [self._done.popleft() for _ in range(count)]
        for result in results:
            self._pending.discard(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until these jobs completed (results still come from :meth:`poll`).

        Ids that are unknown, or already completed, are ignored. Completing a job completes
        the jobs submitted before it in the same direction.
        """
        wanted = set(job_ids)
        # per direction, the sequence number of the last wanted job: its prefix completes
        target = {direction: max((job.seq for job in fifo if job.job_id in wanted), default=-1)
                  for direction, fifo in self._fifo.items()}
        while True:  # in global submission order, as the CPU stand-in runs copies
            heads = [(fifo[0].seq, d) for d, fifo in self._fifo.items()
                     if fifo and fifo[0].seq <= target[d]]
            if not heads:
                return
            self._finish_head(min(heads)[1])

    def pending(self) -> set[int]:
        """Ids submitted and not yet reported by :meth:`poll` (in flight, or complete but
        unreported)."""
        return set(self._pending)

    def in_flight(self) -> set[int]:
        """Ids submitted and not yet known to be complete."""
        return {job.job_id for fifo in self._fifo.values() for job in fifo}

    def shutdown(self) -> None:
        """Complete every in-flight job and refuse new submissions; idempotent. Results of
        completed jobs can still be polled."""
        self._complete_in_order(None)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
