"""Messages shaped like vLLM 0.33.0's, and the engine-side request the connector reads.

Scheduler to workers: `OffloadingConnectorMetadata` (load and store jobs keyed by job id, jobs
to flush). Workers to scheduler: `OffloadingWorkerMetadata` (per-job report counts; beyond
vLLM, failed job counts), inside `KVConnectorOutput`. The core scheduler's per-step
`SchedulerOutput` carries what the connector needs of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RequestStatus(Enum):
    WAITING = "WAITING"
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"
    FINISHED_ABORTED = "FINISHED_ABORTED"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """The engine's request, as much of it as the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """One hash per full GPU block of all tokens: a function of the whole prefix."""
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    kv_transfer_params: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool = False
    shared_prefix_boundary: int = 0
    """The shared-prefix junction the core's last lookup found (vLLM's
    `Request.shared_prefix_boundary`; `spec.groups.reachable_boundaries`), 0: none. Only a
    GPU prefix cache finds one, so the engine's requests keep 0."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def is_finished(self) -> bool:
        return self.status.is_finished


BlockTable = tuple[int, ...] | tuple[tuple[int, ...], ...]
"""Block ids per KV cache group (vLLM: `tuple[list[int], ...]`), or a flat tuple of one
group's ids."""


@dataclass(frozen=True)
class GPULoadStoreSpec:
    """GPU block ids of one transfer (one KV group): `block_ids[i]` is the request's logical
    block `first_block_index + i`; the CPU side skips `first_block_index % blocks_per_chunk`
    sub-blocks of its first chunk."""

    block_ids: tuple[int, ...]
    first_block_index: int = 0
    group_sizes: tuple[int, ...] = ()
    """With several KV cache groups: how many of `block_ids` belong to each group, in group
    order (vLLM's `group_sizes`); empty for one group."""
    block_indices: tuple[int, ...] = ()
    """With several groups: each group's first logical block index (vLLM's
    `block_indices`); empty for one group (`first_block_index`)."""

    @property
    def sizes_per_group(self) -> tuple[int, ...]:
        """How many of `block_ids` belong to each group, one group included (vLLM's
        `group_sizes`, which vLLM's spec carries for one group too)."""
        return self.group_sizes or (len(self.block_ids),)

    @property
    def first_index_per_group(self) -> tuple[int, ...]:
        """Each group's first logical block index, one group included (vLLM's
        `block_indices`)."""
        return self.block_indices or (self.first_block_index,)


@dataclass(frozen=True)
class CPULoadStoreSpec:
    chunk_ids: tuple[int, ...]


@dataclass(frozen=True)
class TransferJob:
    req_id: str
    src: GPULoadStoreSpec | CPULoadStoreSpec
    dst: GPULoadStoreSpec | CPULoadStoreSpec
    sync: bool = False

    @property
    def is_store(self) -> bool:
        return isinstance(self.src, GPULoadStoreSpec)


@dataclass(frozen=True)
class OffloadingConnectorMetadata:
    load_jobs: dict[int, TransferJob] = field(default_factory=dict)
    store_jobs: dict[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: frozenset[int] = frozenset()


@dataclass
class OffloadingWorkerMetadata:
    """One worker's reports since its last message, or several workers' aggregated."""

    completed_jobs: dict[int, int] = field(default_factory=dict)
    failed_jobs: dict[int, int] = field(default_factory=dict)
    """Beyond vLLM: jobs whose copy failed on this worker (vLLM asserts, W:299-301)."""

    def mark_completed(self, job_id: int) -> None:
        self.completed_jobs[job_id] = self.completed_jobs.get(job_id, 0) + 1

    def mark_failed(self, job_id: int) -> None:
        self.failed_jobs[job_id] = self.failed_jobs.get(job_id, 0) + 1

    @classmethod
    def aggregate(cls, metas: Iterable[OffloadingWorkerMetadata | None]) -> (
            OffloadingWorkerMetadata | None):
        out = cls()
        seen = False
        for m in metas:
            if m is None:
                continue
            seen = True
            for jid, n in m.completed_jobs.items():
                out.completed_jobs[jid] = out.completed_jobs.get(jid, 0) + n
            for jid, n in m.failed_jobs.items():
                out.failed_jobs[jid] = out.failed_jobs.get(jid, 0) + n
        return out if seen else None


@dataclass
class KVConnectorOutput:
    kv_connector_worker_meta: OffloadingWorkerMetadata | None = None
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose async load every worker finished (the core promotes them)."""


@dataclass(frozen=True)
class NewRequestData:
    req_id: str
    block_ids: BlockTable
    """The whole block table: one tuple per KV cache group (a flat tuple of ids is
    accepted for one group)."""


@dataclass(frozen=True)
class CachedRequestData:
    req_id: str
    new_block_ids: BlockTable
    """Blocks added this step, one tuple per group (or flat for one group)."""
    resumed_from_preemption: bool = False
    """True when `new_block_ids` is the full block table (resumed request)."""


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    scheduled_cached_reqs: tuple[CachedRequestData, ...] = ()
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    boundary_state_offloads: dict[str, tuple[tuple[int, int, int], ...]] = field(
        default_factory=dict)
    """The state blocks the core commits in this step, per request, as `(group, block id,
    boundary tokens)`: a Mamba group's state after `boundary` tokens lies in that block
    (vLLM: `kv_connector_block_state.boundary_state_offloads`,
    `vllm/v1/core/sched/output.py`:214-228)."""
    kv_cache_block_copies: tuple[tuple[int, int], ...] = ()
    """The block copies the core queued in this step, as `(source block, destination
    block)` (vLLM: `kv_cache_block_copies`, a copy on write of a Mamba state): each
    destination is a block given out in this step (S:1530-1531)."""
