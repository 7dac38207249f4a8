"""A small core engine: vLLM's core scheduler, the workers and a forward-pass stand-in.

`Engine` plays the part of vLLM's core scheduler (CS) around the connector
(`OffloadingScheduler`) and the worker ranks (`statemachine.worker.Worker`): a GPU block pool
(a FIFO free list; no GPU prefix cache), waiting and running queues, a token budget per step
(chunked prefill), preemption when blocks run out (the newest running request is preempted:
its blocks freed, `num_computed_tokens = 0`, re-queued at the front), finish (max_tokens)
and abort, and `reset_prefix_cache`. One `step()` runs, in vLLM's order (the core's
schedule and update_from_output, CS:1138-1789 and CS:3566-3578; the worker, MX:67-107):

1. schedule: running requests first (allocating, preempting the newest when blocks run
   out), then, unless this step preempted, waiting ones: `get_num_new_matched_tokens` for a
   request with no computed token (`None`: skipped this step), allocation,
   `update_state_after_alloc` (an async hit makes the request WAITING_FOR_REMOTE_KVS, with
   blocks for all its tokens, so that it can run as soon as its load lands);
   then `build_connector_meta`;
2. every worker: `handle_preemptions`, `start_kv_transfers`; the forward pass (the byte
   stand-in); `prepare_store_kv`; `get_finished`;
3. update from output: tokens advanced and sampled, stopped requests freed
   (`request_finished`), then `update_connector_output` with the summed worker metadata
   and the finished_recving of loads every rank finished, then those requests promoted.

The engine follows the connector's answers: a request the connector moved to RECOMPUTE,
TIMED_OUT or PREEMPTED_FLUSHING because its load failed or timed out is preempted (running)
or has its load abandoned (waiting for it) and is recomputed; the destination blocks of a
timed-out load stay out of the pool until `take_released_gpu_blocks` hands them back; a
finished (e.g. aborted) request keeps the destination blocks of a load still in flight until
that load ends. Beyond the connector: a load a reset made stale (ORPHANED_LOAD) whose copy
failed on some rank is never promoted. Under the spec's own rule the connector sends its
request to RECOMPUTE (`invalidate_orphaned_load`), and the engine checks that it did (the
ranks' failed_jobs name the load); under 0.34.0's (`Rules.stale_load_failure` FENCE_ONLY)
the connector only drains the fence, and the engine, as vLLM 0.34.0's core reads
failed_recving, recomputes the request itself when its finished_recving arrives.

With tiers (`EngineConfig.tiering`), the connector's manager is a tiering manager over the
workers' CPU tensors (`statemachine.tiering.connector`); after update from output, the
tiers' I/O runs (4.: cascades and promotions, see `Engine._run_tier_io`) and a byte oracle
checks every copy they publish or promote (`statemachine.tiering.copy_oracle`).

The forward stand-in writes into every GPU block it computes tokens of, in every layer of
every rank, the bytes `oracle.kv_pattern` gives for the block's prefix hash. Every load (and,
with `check_stores`, every store) is checked against them as soon as its copy is known
complete (after a flush or sync wait, before the forward pass; else when polled), and with
`verify_on_finish` every computed block of a finishing request is checked before its blocks
are freed: any difference raises `CorruptedBytes`.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK, handoff_positions, mamba_chunk_end, offload_key
from spec.rules import VLLM_0_33, Rules, StaleLoadFailure
from statemachine.config import KVCacheGroup, OffloadingConfig, TieringConfig
from statemachine.core import BlockPool, StepLedger, block_hashes, cdiv, prefix_hash
from statemachine.errors import ConfigError, KVSpecError
from statemachine.messages import (
    GPULoadStoreSpec,
    KVConnectorOutput,
    OffloadingConnectorMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
    TransferJob,
)
from statemachine.models import JobStatus
from statemachine.oracle import CorruptedBytes, first_mismatch, first_mismatch_rows, pattern_for
from statemachine.scheduler import OffloadingScheduler
from statemachine.worker import Worker, WorkerJob, WorkerReport, aggregate, make_workers

from kernels import KVLayout  # isort: skip

if TYPE_CHECKING:
    from statemachine.tiering.connector import ConnectorTieringManager
    from statemachine.tiering.copy_oracle import CopyOracle



class EngineError(KVSpecError):
    """The engine's own bookkeeping broke (a block freed twice, a block the connector
    quarantined that the engine does not hold, a connector state the engine cannot follow)."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    blocks_per_chunk: int = 2
    num_gpu_blocks: int = 64
    num_cpu_chunks: int = 64
    num_workers: int = 2
    num_layers: int = 2
    bytes_per_token: int = 4
    """KV bytes of one token in one layer on one rank (the page is block_size times that)."""
    max_num_batched_tokens: int = 256
    max_num_running: int = 32
    sync_load_budget_bytes: int = 0
    job_timeout_steps: int | None = None
    eviction_policy: str = "lru"
    check_invariants: bool = True
    verify_on_finish: bool = True
    """Check every computed block of a finishing request (before its blocks are freed)."""
    check_stores: bool = True
    """Check the CPU rows every store wrote (loads are always checked)."""
    device: str | None = None
    """Where the GPU KV lives: None picks CUDA when available, else the CPU stand-in."""
    groups: tuple[KVCacheGroup, ...] = (KVCacheGroup(),)
    """The model's KV cache groups (full attention, sliding window), in vLLM's group order.
    Each group has `num_layers` KV tensors of its own; all share the GPU block pool."""
    retention_interval: int | None = None
    """vLLM's `prefix_cache_retention_interval` (`OffloadingConfig.retention_interval`): the
    window blocks the connector stores, and the Mamba states the core hands off."""
    group_bytes_per_token: tuple[int, ...] = ()
    """Per group, `bytes_per_token` of that group's layers (so each group has pages of its
    own size); empty: `bytes_per_token` for every group."""
    tiering: TieringConfig | None = None
    """Secondary tiers below the CPU tier (`OffloadingConfig.tiering`): the connector's
    manager is then a tiering manager over the workers' CPU tensors, and the tiers' I/O
    runs at the end of every step (see `Engine.step`)."""
    rules: Rules = VLLM_0_33
    """The connector's rules (`OffloadingConfig.rules`): 0.33.0's, or a later release's
    (`spec.rules.VLLM_0_34`); under 0.34.0's the engine, as that release's core, recomputes
    a request whose stale load a rank failed (`Rules.stale_load_failure`)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "blocks_per_chunk", "num_gpu_blocks", "num_cpu_chunks",
                     "num_workers", "num_layers", "bytes_per_token", "max_num_batched_tokens",
                     "max_num_running"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"EngineConfig: {name} must be an int >= 1, got {value!r}")
        per_group = self.group_bytes_per_token
        if type(per_group) is not tuple or (per_group and len(per_group) != len(self.groups)) \
                or not all(type(v) is int and v >= 1 for v in per_group):
            raise ConfigError(f"EngineConfig: group_bytes_per_token must be empty or one int "
                              f">= 1 per group ({len(self.groups)}), got {per_group!r}")
        self.offloading_config()  # the groups are the connector's: validated there

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def bytes_per_token_of(self, group: int) -> int:
        return self.group_bytes_per_token[group] if self.group_bytes_per_token \
            else self.bytes_per_token

    @property
    def page_bytes(self) -> int:
        """The page size of group 0's layers."""
        return self.block_size * self.bytes_per_token_of(0)

    def tensors_of(self, group: int) -> range:
        """The KV tensor indices of `group` on every worker (group-major, then layer)."""
        return range(group * self.num_layers, (group + 1) * self.num_layers)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            tuple(self.block_size * self.bytes_per_token_of(g)
                  for g in range(self.num_groups) for _ in range(self.num_layers)),
            self.blocks_per_chunk,
            tuple(tuple(self.tensors_of(g)) for g in range(self.num_groups)))

    def offloading_config(self) -> OffloadingConfig:
        per_token = sum(self.bytes_per_token_of(g) for g in range(self.num_groups))
        return OffloadingConfig(
            block_size=self.block_size, blocks_per_chunk=self.blocks_per_chunk,
            num_workers=self.num_workers, num_cpu_chunks=self.num_cpu_chunks,
            eviction_policy=self.eviction_policy,
            sync_load_budget_bytes=self.sync_load_budget_bytes,
            kv_bytes_per_token=per_token * self.num_layers * self.num_workers,
            job_timeout_steps=self.job_timeout_steps, check_invariants=self.check_invariants,
            groups=self.groups, retention_interval=self.retention_interval,
            tiering=self.tiering, rules=self.rules)


@dataclass(eq=False)
class EngineRequest:
    """The core's view of one request."""

    request: Request
    max_tokens: int
    seq: int
    tables: list[list[int]] = field(default_factory=list)
    """The block table of each KV cache group (NULL_BLOCK where a sliding-window group holds
    no block: before its window); all of one length."""
    handed_over: set[int] = field(default_factory=set)
    """Blocks of this request the connector quarantined (a timed-out load's destination)."""
    load_job: int | None = None
    """The load job of the current admission (async or sync)."""
    load_blocks: tuple[int, ...] = ()
    load_end: int = 0
    """num_computed_tokens once the load has landed."""
    loaded_blocks: int = 0
    """Blocks [0, loaded_blocks) of the current admission came from a load."""
    load_failed: bool = False
    """Some rank reported the current load failed (its bytes are not to be trusted)."""
    loaded_state_due: bool = False
    """An async load ended and the core has not yet cached the loaded blocks: it does when
    its waiting loop next reaches the request, and then hands off the state the load ended
    on."""
    preemptions: int = 0
    recomputes: int = 0

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def blocks(self) -> list[int]:
        """Every GPU block the request holds, group by group."""
        return [b for t in self.tables for b in t if b != NULL_BLOCK]

    @property
    def table_length(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    def block_table(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t) for t in self.tables)

    @property
    def status(self) -> RequestStatus:
        return self.request.status

    @property
    def num_computed(self) -> int:
        return self.request.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens


@dataclass
class StepResult:
    step: int
    scheduled: dict[str, int]
    meta: OffloadingConnectorMetadata
    finished: list[str]
    preempted: frozenset[str]


FaultHook = Callable[["Engine", OffloadingConnectorMetadata], None]


class Engine:
    def __init__(self, config: EngineConfig | None = None,
                 scheduler: OffloadingScheduler | None = None,
                 workers: Sequence[Worker] | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.workers = list(workers) if workers is not None else make_workers(
            cfg.num_workers, cfg.layout, cfg.num_gpu_blocks, cfg.num_cpu_chunks, cfg.device)
        self.tiering: ConnectorTieringManager | None = None
        """The connector's tiering manager, when tiers are configured."""
        self.copy_oracle: CopyOracle | None = None
        """Checks every tier copy's bytes (when the engine built the tiering manager)."""
        if scheduler is None and cfg.tiering is not None:
            scheduler = OffloadingScheduler(cfg.offloading_config(),
                                            self._build_tiering(cfg.offloading_config()))
        self.scheduler = scheduler or OffloadingScheduler(cfg.offloading_config())
        if self.tiering is None and self.scheduler.config.tiering is not None:
            from statemachine.tiering.connector import ConnectorTieringManager

            if isinstance(self.scheduler.manager, ConnectorTieringManager):
                self.tiering = self.scheduler.manager
        if len(self.workers) != self.scheduler.config.num_workers:
            raise ConfigError(f"{len(self.workers)} workers, but the connector expects "
                              f"{self.scheduler.config.num_workers} reports per job")
        self.free_blocks = BlockPool(cfg.num_gpu_blocks)
        self._offloading = cfg.offloading_config()
        self.group_stats: list[Counter[str]] = [Counter() for _ in cfg.groups]
        """Per KV cache group: jobs with blocks of the group (shipped, failed on a rank, made
        stale by a reset), blocks the oracle checked (loaded, stored, computed), blocks freed
        by a preemption and before a sliding window."""
        self._job_groups: dict[int, tuple[int, ...]] = {}
        """Shipped job -> the groups it has blocks of (kept while the connector knows it)."""
        self.ledger = StepLedger()
        """Scheduled-before, finished and preempted requests between two steps."""
        self.requests: dict[str, EngineRequest] = {}
        """Unfinished requests."""
        self.done: dict[str, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.held_loads: dict[int, tuple[str, tuple[int, ...]]] = {}
        """Finished requests' loads still in flight: job id -> (request, destination blocks)."""
        self.connector_held: set[int] = set()
        """GPU blocks in the connector's quarantine (timed-out loads' destinations)."""
        self._quarantine_seen: set[int] = set()
        self._freed_before_quarantine: Counter[int] = Counter()
        """Blocks a timed-out sync load names that the core had already freed (a sliding
        window left them behind in the load's step): the connector releases them later, and
        the engine must not free them again."""
        self._unpublished: list[tuple[JobStatus, CorruptedBytes]] = []
        """Stores that copied wrong bytes, held until the connector decides their fate: a
        store it completes publishes them (CorruptedBytes); one it fails, resets or times out
        never does (its request's load failed and poisoned it, say, before every report
        came in)."""
        self._recv_counts: Counter[int] = Counter()
        self._store_positions: dict[int, tuple[int, ...]] = {}
        """Store job -> the request's logical block index of each block it copies, from the
        chunk keys the connector put it under: a group's chunks of one store need not be
        consecutive (chunks already in the CPU tier are not stored again)."""
        self._promoted_slots: dict[int, frozenset[int]] = {}
        """Load job -> its CPU slots whose chunks a promotion brought back for its request
        (`TieringManager.get_load_source`, TM:677-684)."""
        self._seq = 0
        self.step_index = 0
        self.stats: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"load": 0.0, "store": 0.0}
        self.fault_hooks: list[FaultHook] = []
        """Called with each step's metadata before the workers run it (fault injection)."""
        self.tier_io_hooks: list[Callable[[Engine], None]] = []
        """With tiers: called every step right before the tiers' I/O runs (fault
        injection: the tasks queued now are the step's, in submission order)."""

    def _build_tiering(self, config: OffloadingConfig) -> ConnectorTieringManager:
        """The tiering manager over the workers' CPU tensors (one slot: every rank's rows of
        one chunk, `statemachine.tiering.torch_buffer`), its copies checked by a
        `CopyOracle`."""
        from statemachine.tiering.connector import build
        from statemachine.tiering.copy_oracle import CopyOracle
        from statemachine.tiering.torch_buffer import WorkerCPUBuffer

        cfg = self.config
        buffer = WorkerCPUBuffer.of_workers(self.workers)
        self.copy_oracle = CopyOracle(buffer, cfg.tensors_of, cfg.layout.page_bytes,
                                      cfg.blocks_per_chunk)
        self.tiering = build(config, buffer, observer=self.copy_oracle)
        return self.tiering

    # ================================================================ requests
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                    kv_transfer_params: dict[str, object] | None = None) -> EngineRequest:
        if req_id in self.requests or req_id in self.done:
            raise EngineError(f"request {req_id!r} added twice")
        if max_tokens < 1 or not prompt_token_ids:
            raise EngineError(f"request {req_id!r}: needs a prompt and max_tokens >= 1")
        longest = cdiv(len(prompt_token_ids) + max_tokens, self.config.block_size) \
            * self.config.num_groups
        if longest > self.config.num_gpu_blocks:
            raise EngineError(f"request {req_id!r} needs up to {longest} GPU blocks over its "
                              f"{self.config.num_groups} KV cache groups; the pool has "
                              f"{self.config.num_gpu_blocks}")
        tokens = list(prompt_token_ids)
        request = Request(req_id, tokens, block_hashes=block_hashes(tokens, self.config.block_size),
                          kv_transfer_params=kv_transfer_params)
        r = EngineRequest(request, max_tokens, self._seq)
        self._seq += 1
        self.scheduler.on_new_request(request)
        self.requests[req_id] = r
        self.waiting.append(r)
        self.stats["requests_added"] += 1
        return r

    def abort(self, req_id: str) -> None:
        """Abort a request between steps (finish_requests, CS:3017-3027)."""
        r = self.requests.get(req_id)
        if r is None:
            raise EngineError(f"abort: request {req_id!r} is not unfinished")
        self._finish(r, RequestStatus.FINISHED_ABORTED)
        self.stats["aborted"] += 1
        self._after_connector()

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = True) -> bool:
        """Between steps (CS:3184-3249): optionally preempt every running request, reset the
        (absent) GPU prefix cache, then the connector's cache."""
        if reset_running_requests:
            for r in reversed(list(self.running)):
                self._preempt(r)
                self.stats["preemptions_by_reset"] += 1
        ok = True
        if reset_connector:
            self.stats["async_loads_orphaned_by_reset"] += sum(
                1 for r in self.requests.values()
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and r.load_job in self.scheduler.jobs)
            for job in self.scheduler.jobs:
                for g in self._job_groups.get(job.job_id, ()):
                    self.group_stats[g]["jobs_made_stale_by_reset"] += 1
            ok = self.scheduler.reset_cache()
            self.stats["resets"] += 1
        self._after_connector()
        return ok

    # ================================================================ blocks
    def _allocate(self, n: int) -> list[int]:
        return self.free_blocks.allocate(n)

    def _free(self, blocks: Iterable[int]) -> None:
        self.free_blocks.free(blocks)

    def _release_request_blocks(self, r: EngineRequest, keep: Iterable[int] = ()) -> None:
        """Free a request's blocks group by group, each tail first, as vLLM's KVCacheManager
        free does: its last blocks (the ones its latest stores read) are the first reused."""
        kept = set(keep) | r.handed_over
        for table in r.tables:
            self._free(b for b in reversed(table) if b != NULL_BLOCK and b not in kept)
        r.tables = []
        r.handed_over = set()

    def _blocks_to_grow(self, r: EngineRequest, tokens: int, computed: int) -> int:
        """GPU blocks that extending `r`'s tables to `tokens` tokens takes: every group's new
        positions, but none of a sliding-window group's wholly before the window of token
        `computed`, the first token to compute (vLLM gives it the null block there)."""
        length = cdiv(tokens, self.config.block_size)
        return sum(max(0, length - max(r.table_length,
                                       self._offloading.skipped_blocks(g, computed)))
                   for g in range(self.config.num_groups))

    def _grow(self, r: EngineRequest, tokens: int, computed: int) -> tuple[tuple[int, ...], ...]:
        """Extend `r`'s tables to hold `tokens` tokens (see `_blocks_to_grow`); returns each
        group's new positions."""
        length = cdiv(tokens, self.config.block_size)
        if not r.tables:
            r.tables = [[] for _ in self.config.groups]
        ids = iter(self._allocate(self._blocks_to_grow(r, tokens, computed)))
        added: list[tuple[int, ...]] = []
        for g, table in enumerate(r.tables):
            skip = self._offloading.skipped_blocks(g, computed)
            new = tuple(NULL_BLOCK if p < skip else next(ids) for p in range(len(table), length))
            table.extend(new)
            added.append(new)
        return tuple(added)

    def _free_before_window(self) -> None:
        """The core frees each running request's sliding-window blocks that left the window
        and puts the null block in their place (vLLM 0.33.0:
        vllm/v1/core/single_type_kv_cache_manager.py:682-720, called from
        vllm/v1/core/kv_cache_manager.py:555-568 as the request's next step is allocated; no
        connector hook but a finish or a reset comes in between, and the abstract model
        frees at this same point, the end of the step)."""
        for r in self.running:
            for g in self._offloading.window_groups:
                table = r.tables[g]
                for p in range(min(self._offloading.skipped_blocks(g, r.num_computed),
                                   len(table))):
                    b = table[p]
                    if b == NULL_BLOCK:
                        continue
                    table[p] = NULL_BLOCK
                    if b not in r.handed_over:
                        self._free((b,))
                    self.group_stats[g]["blocks_freed_before_window"] += 1

    # ================================================================ the step
    def step(self) -> StepResult:
        out = self._schedule()
        meta = self.scheduler.build_connector_meta(out)
        self._note_jobs(meta)
        self._sync_quarantine()
        for hook in self.fault_hooks:
            hook(self, meta)
        for w in self.workers:
            w.handle_preemptions(meta)
            self._check_copies(w)
        for w in self.workers:
            w.start_kv_transfers(meta)
            self._check_copies(w)
        self._forward(out.num_scheduled_tokens)
        for w in self.workers:
            w.prepare_store_kv(meta)
        reports = [w.get_finished() for w in self.workers]
        for w in self.workers:
            self._check_copies(w)
        finished = self._update_from_output(out.num_scheduled_tokens, reports)
        self._free_before_window()
        self._run_tier_io()
        self.step_index += 1
        self.stats["steps"] += 1
        return StepResult(self.step_index - 1, dict(out.num_scheduled_tokens), meta, finished,
                          out.preempted_req_ids)

    def _run_tier_io(self) -> None:
        """The tiers' I/O, once per step, after the step's last connector call: the cascades
        this step's completed stores started and the promotions its lookups queued (submitted
        by `on_schedule_end`) run now, as vLLM's tier pool threads (TP:60-194) finish the
        tasks they were given between two steps; their results wait for the next poll (the
        next step's first lookup, prepare_store or on_schedule_end, TM:448-458). With tier
        threads the tasks started when they were submitted; this waits for them. A hung
        tier runs nothing. Then the tiers' copies are judged (`CopyOracle`) and, with
        `check_invariants`, the tiering manager's consistency."""
        if self.tiering is None:
            return
        for hook in self.tier_io_hooks:
            hook(self)
        self.tiering.run_tier_io()
        if self.copy_oracle is not None:
            problems = self.copy_oracle.take_problems()
            if problems:
                from statemachine.tiering.copy_oracle import CorruptedCopy

                self.stats["corrupted_blocks"] += len(problems)
                self.stats["corrupted_copies"] += len(problems)
                raise CorruptedCopy(problems)
        if self.config.check_invariants:
            problems = self.tiering.check_consistency()
            if problems:
                from statemachine.tiering.connector import TieringInconsistency

                raise TieringInconsistency(problems, f"step {self.step_index}'s tier I/O")

    def _schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        preempted_now = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            r = self.running[idx]
            n = self._aligned_split(r, r.num_computed,
                                    min(r.num_tokens - r.num_computed, budget))
            if n == 0:
                idx += 1  # no block-aligned chunk fits the budget left
                continue
            need = self._blocks_to_grow(r, r.num_computed + n, r.num_computed)
            while need > len(self.free_blocks):
                victim = self.running[-1]
                self._preempt(victim)
                self.stats["preemptions"] += 1
                preempted_now = True
                if victim is r:
                    break
            if r.status != RequestStatus.RUNNING:
                break
            new = self._grow(r, r.num_computed + n, r.num_computed)
            self.ledger.run(r.id, new, n)
            budget -= n
            idx += 1
        resumed: set[str] = set()
        if not preempted_now:
            budget = self._schedule_waiting(budget, resumed)
        step = self.ledger.close()
        step.handoffs = self._commit_states(step.num_scheduled, resumed)
        return step.scheduler_output()

    def _aligned_split(self, r: EngineRequest, start: int, n: int) -> int:
        """With a Mamba group, clip a prefill chunk of `n` tokens from `start` so that it
        ends where a state is to be committed (`spec.groups.mamba_chunk_end`). 0: no
        aligned chunk fits."""
        if not self._offloading.handoff_groups:
            return n
        end = mamba_chunk_end(start, start + n, self.config.block_size,
                              r.request.num_prompt_tokens, r.num_tokens,
                              self.config.max_num_batched_tokens,
                              r.request.shared_prefix_boundary)
        return max(end - start, 0)

    def _commit_states(self, num_sched: dict[str, int], resumed: set[str]
                       ) -> dict[str, tuple[tuple[int, int, int], ...]]:
        """The Mamba states the core commits in this step and hands to the connector: for
        every scheduled request whose step ends on a block edge, each Mamba group's block
        of the state after the step's last token, as `(group, block, boundary)`
        (`boundary_state_offloads`; vLLM 0.33.0 `vllm/v1/core/sched/output.py`:214-228);
        before it, for each request in `resumed` (the waiting loop reached it after its async
        load ended, whether or not it scheduled it), the state the load ended on, which the
        core hands off as it caches the loaded blocks (as `spec.model.hooks.handoffs`
        says). Both under the retention (`spec.groups.handoff_positions`)."""
        groups = self._offloading.handoff_groups
        out: dict[str, tuple[tuple[int, int, int], ...]] = {}
        if not groups:
            return out
        for rid in sorted({*num_sched, *resumed}):
            r = self.requests[rid]
            entries = tuple(
                (g, r.tables[g][position], boundary)
                for boundary, position in handoff_positions(
                    r.num_computed, num_sched.get(rid, 0), rid in resumed,
                    self.config.block_size, self.config.retention_interval,
                    r.request.num_prompt_tokens, r.request.shared_prefix_boundary)
                for g in groups if r.tables[g][position] != NULL_BLOCK)
            if entries:
                out[rid] = entries
                self.stats["states_handed_off"] += len(entries)
        return out

    def _schedule_waiting(self, budget: int, resumed: set[str]) -> int:
        """Admit waiting requests while the budget and the running slots last. A request
        whose async load ended joins `resumed` when the loop reaches it: the core caches
        its loaded blocks then, scheduled or not (vLLM's `_handle_blocked_waiting_request`,
        CS:3519-3535)."""
        bs = self.config.block_size
        # the requests that hold KV blocks first, each kind in its order: vLLM keeps them in
        # a queue of their own and drains it before the others (`kv_holding_waiting`,
        # CS:1063-1067, CS:2697-2715), so a request that holds blocks never waits behind one
        # that cannot get any (a preempted request whose recompute does not fit)
        self.waiting.sort(key=lambda w: not self._holds_kv_blocks(w))
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_running:
            r = self.waiting.pop(0)
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(r)
                continue
            if r.loaded_state_due:
                r.loaded_state_due = False
                resumed.add(r.id)
            hit = 0
            is_async = False
            if r.num_computed == 0:
                answer, is_async = self.scheduler.get_num_new_matched_tokens(r.request, 0)
                self.stats["lookups"] += 1
                if answer is None:
                    skipped.append(r)
                    continue
                hit = answer
            if is_async:
                # blocks for every token now, not only the loaded ones: a loaded request then
                # never waits for blocks that other loaded (not running) requests hold
                need = self._blocks_to_grow(r, r.num_tokens, hit)
                if need > len(self.free_blocks):
                    self.waiting.insert(0, r)
                    break
                self._grow(r, r.num_tokens, hit)
                self.scheduler.update_state_after_alloc(r.request, r.block_table(), hit)
                self._note_load(r, hit)
                self.stats["async_loads_scheduled"] += 1
                r.request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(r)
                continue
            start = r.num_computed + hit
            n = self._aligned_split(r, start, min(r.num_tokens - start, budget))
            if n == 0:
                skipped.append(r)  # no block-aligned chunk fits the budget left
                continue
            need = self._blocks_to_grow(r, start + n, start)
            if need > len(self.free_blocks):
                self.waiting.insert(0, r)
                break
            self._grow(r, start + n, start)
            self.scheduler.update_state_after_alloc(r.request, r.block_table(), hit)
            if hit:
                self._note_load(r, hit)
                r.request.num_computed_tokens = hit
                r.loaded_blocks = hit // bs
            r.request.status = RequestStatus.RUNNING
            self.running.append(r)
            self.ledger.admit(r.id, r.block_table(), n)
            budget -= n
        self.waiting[:0] = skipped
        return budget

    @staticmethod
    def _holds_kv_blocks(r: EngineRequest) -> bool:
        """vLLM's test of a waiting request that holds KV blocks: tokens computed (an async
        load's, once promoted) or an async load in flight (CS:2697-2707)."""
        return r.num_computed > 0 or r.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _note_load(self, r: EngineRequest, hit: int) -> None:
        jobs = self.scheduler.transfer_jobs(r.id)
        loads = [j for j in jobs if (job := self.scheduler.jobs.get(j)) is not None
                 and not job.is_store]
        if len(loads) != 1:
            raise EngineError(f"request {r.id!r}: the connector answered a hit of {hit} tokens "
                              f"but holds loads {loads}")
        bs = self.config.block_size
        r.load_job = loads[0]
        r.load_failed = False
        first, end = r.num_computed // bs, cdiv(r.num_computed + hit, bs)
        r.load_blocks = tuple(b for t in r.tables for b in t[first:end] if b != NULL_BLOCK)
        r.load_end = r.num_computed + hit
        self.stats["loads_scheduled"] += 1

    def _preempt(self, r: EngineRequest) -> None:
        """The core's preemption (CS:1799-1843): blocks freed, recomputed from token 0."""
        self.running.remove(r)
        for g, table in enumerate(r.tables):
            self.group_stats[g]["blocks_freed_by_preemption"] += sum(
                1 for b in table if b != NULL_BLOCK)
        self._release_request_blocks(r)
        r.request.num_computed_tokens = 0
        r.request.status = RequestStatus.PREEMPTED
        r.load_job = None
        r.load_failed = False
        r.loaded_blocks = 0
        r.loaded_state_due = False
        r.preemptions += 1
        self.waiting.insert(0, r)
        self.ledger.preempt(r.id)

    # ================================================================ forward pass
    def _forward(self, num_sched: dict[str, int]) -> None:
        """Write, in every group's layers, the bytes of every block a scheduled request
        computes tokens of (a partial block: the hash of its tokens so far)."""
        bs = self.config.block_size
        rows: list[list[int]] = [[] for _ in self.config.groups]
        hashes: list[int] = []
        for rid, n in num_sched.items():
            r = self.requests[rid]
            tokens = r.request.all_token_ids
            start, end = r.num_computed, r.num_computed + n
            for i in range(start // bs, cdiv(end, bs)):
                for g, table in enumerate(r.tables):
                    if table[i] == NULL_BLOCK:
                        raise EngineError(f"request {rid!r}: block {i} of group {g} computes "
                                          f"tokens [{start}, {end}) but holds no GPU block")
                    rows[g].append(table[i])
                if (i + 1) * bs <= end:
                    hashes.append(r.request.block_hashes[i])
                else:  # a partial block: the hash of its tokens so far
                    parent = r.request.block_hashes[i - 1] if i else 0
                    hashes.append(prefix_hash(parent, tokens[i * bs:end]))
        self.stats["tokens_computed"] += sum(num_sched.values())
        if not hashes:
            return
        for w in self.workers:
            for g, group_rows in enumerate(rows):
                index = torch.tensor(group_rows, dtype=torch.int64, device=w.gpu[0].device)
                for t in self.config.tensors_of(g):
                    gpu = w.gpu[t]
                    pages = pattern_for(hashes, t, w.rank, gpu.shape[1]).to(gpu.device)
                    gpu.index_copy_(0, index, pages)

    # ================================================================ the oracle
    def _check_copies(self, w: Worker) -> None:
        """Check every copy of `w` known complete since the last check: loads always,
        stores unless `check_stores` is off."""
        for job in w.take_copied_jobs():
            r = self.requests.get(job.req_id) or self.done.get(job.req_id)
            if r is None:
                raise EngineError(f"job {job.job_id} for unknown request {job.req_id!r}")
            if not job.is_store:
                self._check_load(w, job, r)
            elif self.config.check_stores:
                self._check_store(w, job, r)

    def _judge_unpublished(self) -> None:
        """Raise for a wrong store the connector completed; forget one it voided."""
        still = []
        for status, wrong in self._unpublished:
            if status.state == J.COMPLETED:
                self.stats["corrupted_blocks"] += wrong.bad_blocks
                raise wrong
            if status.state in J.LIVE or status.state == J.CREATED:
                still.append((status, wrong))
            else:
                self.stats["void_stores_discarded"] += 1
        self._unpublished = still

    def _chunk_key(self, r: EngineRequest, index: int, group: int) -> int | None:
        """The offload key of the chunk holding block `index` of `group` (vLLM's
        make_offload_key of the hash at the chunk's last block)."""
        bpc = self.config.blocks_per_chunk
        pos = (index // bpc + 1) * bpc - 1
        hashes = r.request.block_hashes
        return (offload_key(hashes[pos], group, self.config.num_groups)
                if pos < len(hashes) else None)

    def _note_jobs(self, meta: OffloadingConnectorMetadata) -> None:
        """The groups each new job has blocks of; and where each new store's blocks sit in
        their request, by its chunk keys: key
        (hash, group) names the chunk that ends at the block of that hash, in that group.
        A key whose group is not the group its blocks come from is an error."""
        bpc, groups = self.config.blocks_per_chunk, self.config.num_groups
        for job_id, job in (*meta.load_jobs.items(), *meta.store_jobs.items()):
            gpu = job.src if job.is_store else job.dst
            assert isinstance(gpu, GPULoadStoreSpec)
            self._job_groups[job_id] = tuple(
                g for g, n in enumerate(gpu.sizes_per_group) if n)
            for g in self._job_groups[job_id]:
                self.group_stats[g]["stores" if job.is_store else "loads"] += 1
            firsts = gpu.first_index_per_group
            if not job.is_store and any(firsts[g] % bpc for g in self._job_groups[job_id]):
                # a group's first loaded block is not its chunk's first: the kernels skip
                # into the chunk (GW:629-663), as a window group's tail load does
                self.stats["loads_inside_a_chunk"] += 1
        if self.tiering is not None:
            self._note_promoted_loads(meta)
        for job_id, job in sorted(meta.store_jobs.items()):
            status = self.scheduler.job_status(job_id)
            r = self.requests.get(job.req_id) or self.done.get(job.req_id)
            if status is None or r is None:
                raise EngineError(f"store job {job_id} of {job.req_id!r} shipped, but the "
                                  "connector or the engine does not know it")
            where = {h: i for i, h in enumerate(r.request.block_hashes)}
            spec = job.src
            assert isinstance(spec, GPULoadStoreSpec)
            sizes, firsts = spec.sizes_per_group, spec.first_index_per_group
            block_groups = [g for g, n in enumerate(sizes) for _ in range(n)]
            positions: list[int] = []
            begun: set[int] = set()
            for key in status.keys:
                last = where.get(key // groups)
                group = key % groups
                if last is None or (last + 1) % bpc or len(positions) >= len(block_groups):
                    raise EngineError(f"store job {job_id}: key {key:#x} names no chunk of "
                                      f"request {r.id!r}")
                if block_groups[len(positions)] != group:
                    raise EngineError(f"store job {job_id}: blocks of group "
                                      f"{block_groups[len(positions)]} are stored under key "
                                      f"{key:#x} of group {group}")
                # a group's first chunk skips the sub-blocks before its first block (a Mamba
                # state fills only the last block of its chunk)
                skip = 0 if group in begun else firsts[group] % bpc
                begun.add(group)
                positions += range(last + 1 - bpc + skip, last + 1)
            if len(positions) != len(block_groups):
                raise EngineError(f"store job {job_id}: its keys cover {len(positions)} "
                                  f"blocks, its source {len(block_groups)}")
            self._store_positions[job_id] = tuple(positions)
            if self.copy_oracle is not None:
                self._note_slot_truths(job_id, job, status.keys, r)
            if any(block_groups[i] == block_groups[i - 1] and positions[i] != positions[i - 1] + 1
                   for i in range(1, len(positions))):
                self.stats["stores_with_gaps"] += 1  # a group's chunks not consecutive
        for job_id in [j for j in self._job_groups if self.scheduler.job_status(j) is None
                       and not any(j in w.jobs for w in self.workers)]:
            del self._job_groups[job_id]
            self._store_positions.pop(job_id, None)
            self._promoted_slots.pop(job_id, None)

    def _note_promoted_loads(self, meta: OffloadingConnectorMetadata) -> None:
        """The CPU slots of each new load whose chunks were promoted for its request."""
        assert self.tiering is not None
        for job_id in sorted(meta.load_jobs):
            status = self.scheduler.job_status(job_id)
            if status is None:
                continue
            promoted = frozenset(
                slot for key, slot in zip(status.keys, status.cpu_chunk_ids, strict=True)
                if self.tiering.get_load_source(key, status.owner.ctx) is not None)
            if promoted:
                self._promoted_slots[job_id] = promoted
                self.stats["tier_promoted_loads"] += 1

    def _note_slot_truths(self, job_id: int, job: TransferJob, keys: Sequence[int],
                          r: EngineRequest) -> None:
        """Tell the copy oracle which blocks (prefix hashes) the store writes into which
        rows of which CPU slot, under which key."""
        from statemachine.tiering.copy_oracle import SlotTruth
        from statemachine.worker import transfer_spec

        assert self.copy_oracle is not None
        spec = transfer_spec(job)
        bpc = self.config.blocks_per_chunk
        positions = self._store_positions[job_id]
        slot_keys = dict(zip(spec.cpu_chunks, keys, strict=True))
        rows: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        for seg in spec.segments:
            skip = seg.skip(bpc)
            for i in range(seg.size):
                slot = spec.cpu_chunks[spec.chunk_position(seg.start + i, bpc)]
                block_hash = r.request.block_hashes[positions[seg.start + i]]
                rows.setdefault(slot, (seg.group, []))[1].append(((skip + i) % bpc,
                                                                   block_hash))
        for slot, (group, written) in rows.items():
            self.copy_oracle.note_store(slot, SlotTruth(
                slot_keys[slot], group, tuple(written),
                f"store job {job_id} of request {r.id!r}"))

    def _check_load(self, w: Worker, job: WorkerJob, r: EngineRequest) -> None:
        spec = job.transfer
        bpc = self.config.blocks_per_chunk
        for seg in spec.segments:
            blocks = spec.gpu_blocks[seg.start:seg.start + seg.size]
            first = seg.first_block_index
            hashes = r.request.block_hashes[first:first + seg.size]
            for t in self.config.tensors_of(seg.group):
                m = first_mismatch(w.gpu[t], blocks, hashes, t, w.rank)
                if m is None:
                    continue
                index = seg.first_block_index + m.position
                chunk = spec.cpu_chunks[spec.chunk_position(seg.start + m.position, bpc)]
                self.stats["corrupted_blocks"] += m.bad_blocks
                raise CorruptedBytes(
                    req_id=r.id, what="loaded block", rank=w.rank, layer=t,
                    block_index=index, gpu_block=blocks[m.position], offset=m.offset,
                    expected=m.expected, actual=m.actual, job_id=job.job_id, chunk=chunk,
                    chunk_key=self._chunk_key(r, index, seg.group),
                    writer=w.chunk_writer.get(chunk), bad_blocks=m.bad_blocks)
            self.group_stats[seg.group]["loaded_blocks_verified"] += seg.size
        self.stats["loaded_blocks_verified"] += spec.num_blocks
        promoted = self._promoted_slots.get(job.job_id)
        if promoted:
            self.stats["tier_promoted_blocks_verified"] += sum(
                1 for seg in spec.segments for i in range(seg.start, seg.start + seg.size)
                if spec.cpu_chunks[spec.chunk_position(i, bpc)] in promoted)

    def _check_store(self, w: Worker, job: WorkerJob, r: EngineRequest) -> None:
        spec = job.transfer
        bpc = self.config.blocks_per_chunk
        where = self._store_positions[job.job_id]
        for seg in spec.segments:
            positions = where[seg.start:seg.start + seg.size]
            hashes = [r.request.block_hashes[p] for p in positions]
            for t in self.config.tensors_of(seg.group):
                m = first_mismatch_rows(w.cpu_rows(t, job, seg), hashes, t, w.rank)
                if m is None:
                    continue
                index = positions[m.position]
                status = self.scheduler.job_status(job.job_id)
                if status is None:
                    raise EngineError(f"store job {job.job_id} copied, but the connector does "
                                      "not know it")
                self._unpublished.append((status, CorruptedBytes(
                    req_id=r.id, what="stored block", rank=w.rank, layer=t, block_index=index,
                    gpu_block=spec.gpu_blocks[seg.start + m.position], offset=m.offset,
                    expected=m.expected, actual=m.actual, job_id=job.job_id,
                    chunk=spec.cpu_chunks[spec.chunk_position(seg.start + m.position, bpc)],
                    chunk_key=self._chunk_key(r, index, seg.group), bad_blocks=m.bad_blocks)))
                self._judge_unpublished()  # already completed: raise now
                return
        for seg in spec.segments:
            self.group_stats[seg.group]["stored_blocks_verified"] += seg.size
        self.stats["stored_blocks_verified"] += spec.num_blocks

    def verify_request(self, req_id: str, include_loaded: bool = True) -> int:
        """Check every fully computed block of an unfinished request that the core still
        holds, in every group, on every rank; returns the number of blocks checked. Raises
        CorruptedBytes on the first wrong one."""
        r = self.requests.get(req_id)
        if r is None:
            raise EngineError(f"verify_request: {req_id!r} is not an unfinished request")
        return self._verify(r, 0 if include_loaded else r.loaded_blocks)

    def _verify(self, r: EngineRequest, start: int) -> int:
        full = min(r.num_computed // self.config.block_size, r.table_length)
        checked = 0
        for g, table in enumerate(r.tables):
            positions = [p for p in range(start, full) if table[p] != NULL_BLOCK]
            blocks = [table[p] for p in positions]
            hashes = [r.request.block_hashes[p] for p in positions]
            for w in self.workers:
                for t in self.config.tensors_of(g):
                    m = first_mismatch(w.gpu[t], blocks, hashes, t, w.rank)
                    if m is not None:
                        self.stats["corrupted_blocks"] += m.bad_blocks
                        raise CorruptedBytes(
                            req_id=r.id, what="computed block", rank=w.rank, layer=t,
                            block_index=positions[m.position], gpu_block=blocks[m.position],
                            offset=m.offset, expected=m.expected, actual=m.actual,
                            bad_blocks=m.bad_blocks)
            self.group_stats[g]["computed_blocks_verified"] += len(blocks)
            checked += len(blocks)
        self.stats["computed_blocks_verified"] += checked
        return checked

    # ================================================================ update from output
    def _update_from_output(self, num_sched: dict[str, int],
                            reports: list[WorkerReport]) -> list[str]:
        for rep in reports:
            self.stats["bytes_loaded"] += rep.bytes_loaded
            self.stats["bytes_stored"] += rep.bytes_stored
            self.seconds["load"] += rep.seconds_loading
            self.seconds["store"] += rep.seconds_storing
        finished: list[str] = []
        for rid, n in num_sched.items():
            r = self.requests[rid]
            r.request.num_computed_tokens += n
            if r.num_computed < r.num_tokens:
                continue  # chunked prefill: nothing sampled yet
            r.request.output_token_ids.append(self._sample(r))
            r.request.block_hashes = block_hashes(r.request.all_token_ids,
                                                  self.config.block_size,
                                                  r.request.block_hashes)
            if len(r.request.output_token_ids) >= r.max_tokens:
                self._finish(r, RequestStatus.FINISHED_LENGTH_CAPPED)
                finished.append(rid)
        failed = {job_id for rep in reports if rep.meta is not None
                  for job_id in rep.meta.failed_jobs}
        for job_id in failed:
            for g in self._job_groups.get(job_id, ()):
                self.group_stats[g]["jobs_failed"] += 1
        for r in self.requests.values():
            if r.load_job is not None and r.load_job in failed:
                r.load_failed = True
                if r.load_job not in self.scheduler.jobs:
                    self.stats["stale_loads_failed"] += 1
        named = self._finished_recving(reports)
        output = KVConnectorOutput(aggregate(reports), set(named))
        self.scheduler.update_connector_output(output)
        # the connector takes out a stale id (a timed-out load's late completion, while the
        # request waits on a newer load: spec.request.recving_is_stale); the core promotes
        # the others
        self.stats["stale_recvings"] += len(named - output.finished_recving)
        for rid in sorted(output.finished_recving):
            self._promote(self.requests[rid])
        self._after_connector()
        return finished

    def _sample(self, r: EngineRequest) -> int:
        seed = zlib.crc32(r.id.encode())
        return (seed * 1_000_003 + r.num_tokens * 7919) % 32_000

    def _finished_recving(self, reports: list[WorkerReport]) -> set[str]:
        """Requests waiting for remote KVs one of whose async loads every rank finished: the
        worker names the request of any async load that completes (W:286-321), the
        aggregator once every rank did (KU:90-101). Past a timeout that may be an older
        load than the one the request waits on; the connector then takes the id out."""
        out: set[str] = set()
        for rep in reports:
            for job_id, rid in rep.recving_jobs.items():
                self._recv_counts[job_id] += 1
                if self._recv_counts[job_id] < len(self.workers):
                    continue
                del self._recv_counts[job_id]
                r = self.requests.get(rid)
                if r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    out.add(rid)
        return out

    def _promote(self, r: EngineRequest) -> None:
        """finished_recving: the loaded tokens count as computed (CS:3569-3575)."""
        state = self.scheduler.request_state(r.id)
        if state in R.MUST_RECOMPUTE:
            return  # the load failed: _reconcile abandons it
        if state != R.IDLE:
            raise EngineError(f"request {r.id!r}: its load ended but the connector has it in "
                              f"{state}")
        if r.load_failed:
            if (self.scheduler.config.rules.stale_load_failure
                    is StaleLoadFailure.FENCE_ONLY):
                # 0.34.0's rule: the connector only counted the stale load's failure against
                # the fence; the core hears of it in failed_recving and recomputes
                # (CS@0.34.0:3839-3852)
                self.stats["failed_recving_recomputes"] += 1
                self._abandon_load(r)
                return
            # the ranks' failed_jobs name this load: the connector must have sent the request
            # to recompute (a stale load's failure too, invalidate_orphaned_load)
            raise EngineError(f"request {r.id!r}: a rank failed its load but the connector "
                              "promotes it as loaded")
        r.request.num_computed_tokens = r.load_end
        r.loaded_blocks = r.load_end // self.config.block_size
        r.loaded_state_due = True
        r.request.status = RequestStatus.WAITING
        self.stats["loads_promoted"] += 1

    def _abandon_load(self, r: EngineRequest) -> None:
        """A load whose tokens cannot be trusted: drop its blocks, recompute from token 0."""
        self._release_request_blocks(r)
        r.request.num_computed_tokens = 0
        r.request.status = RequestStatus.WAITING
        r.load_job = None
        r.load_failed = False
        r.loaded_blocks = 0
        r.loaded_state_due = False
        r.recomputes += 1
        self.stats["recomputes"] += 1

    def _finish(self, r: EngineRequest, status: RequestStatus) -> None:
        if self.config.verify_on_finish and status != RequestStatus.FINISHED_ABORTED:
            self._verify(r, r.loaded_blocks)
        r.request.status = status
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        keep: tuple[int, ...] = ()
        if r.load_job is not None and r.load_job in self.scheduler.jobs:
            holds = set(r.blocks)  # a sliding window may have freed some destinations
            keep = tuple(b for b in r.load_blocks if b in holds and b not in r.handed_over)
            self.held_loads[r.load_job] = (r.id, keep)
        self._release_request_blocks(r, keep)
        self.scheduler.request_finished(r.request)
        self.ledger.finish(r.id)
        del self.requests[r.id]
        self.done[r.id] = r
        self.stats["finished"] += 1

    # ================================================================ following the connector
    def _after_connector(self) -> None:
        self._judge_unpublished()
        self._sync_quarantine()
        self._free(self._take_released())
        self._reconcile()

    def _take_released(self) -> list[int]:
        released: list[int] = []
        for b in self.scheduler.take_released_gpu_blocks():
            if self._freed_before_quarantine[b] > 0:
                self._freed_before_quarantine[b] -= 1
                continue  # the core freed it before the quarantine named it
            if b not in self.connector_held:
                raise EngineError(f"the connector released GPU block {b}, which it never "
                                  "quarantined")
            self.connector_held.remove(b)
            released.append(b)
        self._freed_before_quarantine += Counter()  # drop the zero counts
        self._quarantine_seen &= set(self.scheduler.quarantined_gpu_blocks)
        return released

    def _sync_quarantine(self) -> None:
        """Blocks the connector quarantined (timed-out loads) leave their owner's hands: the
        engine never frees them; the connector hands them back when the late reports come."""
        for job_id, blocks in sorted(self.scheduler.quarantined_gpu_blocks.items()):
            if job_id in self._quarantine_seen:
                continue
            self._quarantine_seen.add(job_id)
            held = self.held_loads.pop(job_id, None)
            owner = next((r for r in self.requests.values() if r.load_job == job_id), None)
            ours = set(held[1]) if held is not None else (
                set(owner.blocks) if owner is not None else None)
            if ours is None:
                # no request holds the load: only a sync load's may have left (its copy ended
                # with its step, and a reset that preempted its request before the connector
                # heard of it, then an abort, ended the request before the job timed out)
                job = self.scheduler.jobs.quarantine.get(job_id)
                if job is None or not job.sync:
                    raise EngineError(f"the connector quarantined blocks {blocks} of load job "
                                      f"{job_id}, which no request of the engine holds")
                ours = set()
            gone = set(blocks) - ours
            if gone:
                # only a sync load's: its copy ended with its step, before the core freed
                # the blocks its window left behind (an async load's request does not run)
                job = self.scheduler.jobs.quarantine.get(job_id)
                if job is None or not job.sync:
                    raise EngineError(f"load job {job_id}: quarantined blocks {sorted(gone)} "
                                      "are no longer held by its request, and the load is "
                                      "not a sync load whose copy is over")
                self._freed_before_quarantine.update(gone)
                self.stats["quarantined_blocks_already_freed"] += len(gone)
            taken = set(blocks) & ours
            if held is None and owner is not None:
                owner.handed_over.update(taken)
            self.connector_held.update(taken)
            self.stats["quarantined_loads"] += 1

    def _reconcile(self) -> None:
        """Follow the connector: failed or timed-out loads are recomputed; finished
        requests' loads that ended give their blocks back."""
        for r in list(self.requests.values()):
            state = self.scheduler.request_state(r.id)
            if r.status == RequestStatus.RUNNING and state in R.PREEMPTED_IF_RUNNING:
                self._preempt(r)
                r.recomputes += 1
                self.stats["recomputes"] += 1
            elif (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                  and state in R.MUST_RECOMPUTE):
                self._abandon_load(r)
        for job_id in sorted(self.held_loads):
            if job_id not in self.scheduler.jobs:
                _, blocks = self.held_loads.pop(job_id)
                self._free(blocks)

    # ================================================================ queries
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        return (bool(self.requests) or self.ledger.has_finished()
                or self.scheduler.has_pending_work()
                or any(w.has_jobs() for w in self.workers) or bool(self.held_loads)
                or bool(self.connector_held))

    def run_until_idle(self, max_steps: int = 1000) -> int:
        """Step while anything is unfinished or in flight; returns the steps taken."""
        steps = 0
        while self.has_pending_work() and steps < max_steps:
            self.step()
            steps += 1
        return steps

    def leaks(self) -> dict[str, int]:
        """What is still held when nothing should be: all zero after a full drain."""
        mgr = self.scheduler.manager
        refs = mgr.chunk_ref_counts()
        return {
            "pinned_chunks": sum(1 for v in refs.values() if v > 0),
            "write_pending_chunks": sum(1 for v in refs.values() if v < 0),
            "quarantined_slots": len(mgr.quarantined_slots),
            "gpu_blocks_not_free": self.config.num_gpu_blocks - len(self.free_blocks),
            "quarantined_gpu_blocks": len(self.connector_held),
            "live_jobs": len(self.scheduler.jobs) + len(self.scheduler.jobs.quarantine),
            "reset_fence_entries": len(self.scheduler.fence.entries),
            "tracked_requests": len(self.scheduler.requests),
            "worker_jobs": sum(len(w.jobs) for w in self.workers),
            **(self.tiering.tier_leaks() if self.tiering is not None else {}),
        }

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()
        if self.tiering is not None:
            self.tiering.shutdown()
