"""The subjects the lifecycles move: a request's offload state, a job's status, the fence.

Their fields mirror vLLM 0.33.0's `RequestOffloadState` (S:348-493) and
`TransferJobStatus` (S:77-93), with a block table per KV cache group. Their guard methods are the
guards named in the tables; `transitions` calls them with the event. They hold data and
answer guards; they never change state themselves (only `Lifecycle.fire` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from transitions import EventData

from spec import fence as F
from spec import job as J
from spec import request as R

JobKind = Literal["load", "store"]


@dataclass(eq=False)
class RequestState:
    """One tracked request (vLLM's RequestOffloadState, connector view)."""

    req_id: str
    request: Any = None
    """The engine's request object (prompt, tokens, hashes); the connector reads it."""
    state: str = R.ABSENT
    transfer_jobs: set[int] = field(default_factory=set)
    is_finished: bool = False
    finished_signaled: bool = False
    loaded_tokens_invalid: bool = False
    group_block_ids: list[list[int]] = field(default_factory=lambda: [[]])
    """The block table per KV cache group as the connector saw it (NULL_BLOCK where the
    core gave none, or where a sliding-window block was handed out again)."""
    load_tables: tuple[tuple[int, ...], ...] = ()
    """The tables the core gave update_state_after_alloc for a load: the blocks a loading
    request holds until it is scheduled. The connector keeps only the load's destinations
    from them; its own table stays empty until the schedule records it (S:1502-1552), so a
    request never scheduled since its lookup stores nothing. Read by the projection only."""
    scheduled_end: int = 0
    """Tokens computed once the last scheduled step ran (num_computed + num_scheduled at the
    last build_connector_meta that scheduled it): the core frees a sliding-window group's
    blocks before the window of this many tokens."""
    next_stored_chunk_idx: int = 0
    num_hit_chunks: int = 0
    num_locally_computed_tokens: int = 0
    lookup_hit_tokens: int | None = None
    """Set by a lookup that hit; consumed by update_state_after_alloc or dropped at step end."""
    partial_tail_boundary: int | None = None
    """Set by a lookup whose hit ends at a partial tail (S:1068-1152): the boundary, in
    tokens; consumed by update_state_after_alloc or dropped at step end."""
    sync_load_reserved: bool = False
    deferred_lookup_since_step: int | None = None
    kv_load_id: int | None = None
    """Beyond vLLM: the sync load whose copy the request's KV depends on, until its next
    restart; a failure reported for it (even after a reset) invalidates the request."""
    loaded_from_offload: bool = False
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    load_failed: bool = False
    """`Rules.failed_load_lookup` FOR_LIFE: a load of this request failed or timed out, so
    every later lookup answers 0 without the manager (vLLM 0.34's `load_failed`)."""
    ctx: Any = None
    """The manager's per-request context (from manager.on_new_request)."""

    @property
    def key(self) -> str:
        return self.req_id

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The block table, flat and group by group (as GPULoadStoreSpec orders blocks)."""
        return tuple(b for g in self.group_block_ids for b in g)

    def set_tables(self, tables: tuple[tuple[int, ...], ...]) -> None:
        self.group_block_ids = [list(t) for t in tables]

    # -- guards (spec.request.GUARDS) --------------------------------------------------
    def other_jobs_remain(self, event: EventData) -> bool:
        return bool(self.transfer_jobs)

    def has_transfer_jobs(self, event: EventData) -> bool:
        return bool(self.transfer_jobs)

    def load_invalid(self, event: EventData) -> bool:
        return self.loaded_tokens_invalid


@dataclass(eq=False)
class JobStatus:
    """One transfer job (vLLM's TransferJobStatus plus the state the tables give it)."""

    job_id: int
    owner: RequestState
    kind: JobKind
    num_workers: int
    sync: bool = False
    keys: tuple[int, ...] = ()
    """Chunk keys, in transfer order."""
    gpu_block_ids: tuple[int, ...] = ()
    """GPU blocks the job reads (store) or writes (load), in transfer order."""
    cpu_chunk_ids: tuple[int, ...] = ()
    first_block_index: int = 0
    group_sizes: tuple[int, ...] = ()
    """Blocks per KV cache group in `gpu_block_ids` (empty: one group)."""
    block_indices: tuple[int, ...] = ()
    """Each group's first logical block index (empty: one group, `first_block_index`)."""
    fenced_block_ids: frozenset[int] = frozenset()
    deferred_fence_block_ids: frozenset[int] = frozenset()
    state: str = J.UNALLOCATED
    pending_count: int = 0
    """Reports still due: from the workers while live, late ones once fenced or quarantined."""
    failed: bool = False
    shipped_step: int | None = None
    flush_requested: bool = False
    flush_shipped: bool = False
    """A step's metadata carried its flush (the workers finished it before that step)."""
    quarantined_slots: tuple[int, ...] = ()
    """CPU slots of a timed-out store, held until its late reports arrive."""

    def __post_init__(self) -> None:
        self.pending_count = self.num_workers

    @property
    def key(self) -> int:
        return self.job_id

    @property
    def is_store(self) -> bool:
        return self.kind == "store"

    # -- guards (spec.job.GUARDS) -------------------------------------------------------
    def owner_has_no_jobs(self, event: EventData) -> bool:
        return not self.owner.transfer_jobs

    def reports_complete(self, event: EventData) -> bool:
        count = int(event.kwargs.get("count", 1))
        return count >= self.pending_count


@dataclass(eq=False)
class ResetFence:
    """`_reset_fence`: stale job id -> reports still due; one per scheduler."""

    state: str = F.FENCE_IDLE
    entries: dict[int, int] = field(default_factory=dict)
    since_step: int | None = None

    @property
    def key(self) -> str:
        return "reset_fence"

    # -- guards (spec.fence.GUARDS) ------------------------------------------------------
    def has_live_jobs(self, event: EventData) -> bool:
        return int(event.kwargs.get("live_jobs", 0)) > 0

    def fence_empties(self, event: EventData) -> bool:
        return not self.entries
