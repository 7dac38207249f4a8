"""The scheduler side of the offloading connector, with vLLM 0.33.0's API and semantics.

Several KV cache groups (full attention, sliding window; `OffloadingConfig.groups`), any
`blocks_per_chunk >= 1`, as `spec` models them. Every state change of a request or
a job is a trigger of its table's machine (`statemachine.lifecycle`); the effects the tables
name are the methods of `statemachine.effects`. The hooks here only read, validate, decide
which trigger fires, and fire it. A bad input is rejected with a typed error before anything
changes.

With `config.check_invariants` (the default), every invariant of `spec` is checked after
every hook, on the projection `abstract_state()`; a violation raises `InvariantViolation`
naming the invariant, the request, the job ids and the event (the hook and the transitions
it fired). A hook is the unit of atomicity, as in vLLM, where each runs under the manager
lock: inside one, a request and its job move one after the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import spec
from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK, cdiv, offload_key, storable_chunks
from spec.rules import LastTokenCut, PartialTailSearch
from spec.state import AbstractState
from statemachine.config import OffloadingConfig
from statemachine.effects import SchedulerEffects
from statemachine.errors import (
    IllegalTransition,
    InvalidArgument,
    InvariantViolation,
    MalformedMessage,
    OutOfStep,
    OverAck,
    UnknownJob,
    UnknownRequest,
)
from statemachine.job_table import JobClass, JobTable
from statemachine.lifecycle import Fired, Lifecycle, Nesting
from statemachine.manager import CPUOffloadingManager, LookupResult
from statemachine.messages import (
    KVConnectorOutput,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
    TransferJob,
)
from statemachine.models import JobStatus, RequestState, ResetFence

if TYPE_CHECKING:
    from statemachine.tiering.connector import ConnectorTieringManager


class OffloadingScheduler:
    effects_cls: type[SchedulerEffects] = SchedulerEffects
    """The host of the tables' effects (a subclass may substitute a faulty one in tests)."""

    def __init__(self, config: OffloadingConfig,
                 manager: CPUOffloadingManager | ConnectorTieringManager | None = None
                 ) -> None:
        self.config = config
        self.manager: CPUOffloadingManager | ConnectorTieringManager
        if manager is not None:
            self.manager = manager
        elif config.tiering is not None:
            # secondary tiers below the CPU tier (TM:207-1305): the engine builds this one
            # over its workers' CPU tensors; alone, the connector moves no bytes
            from statemachine.tiering.connector import build

            self.manager = build(config)
        else:
            self.manager = CPUOffloadingManager(
                config.num_cpu_chunks, config.eviction_policy,  # type: ignore[arg-type]
                store_threshold=config.store_threshold,
                store_admission=config.rules.store_admission)
        self.jobs = JobTable()
        self.fence = ResetFence()
        self._req_status: dict[str, RequestState] = {}
        self.chunks_being_loaded: set[int] = set()
        self.block_fence: dict[int, set[int]] = {}
        """`_block_id_to_pending_jobs`: GPU block -> store jobs that still read it."""
        self.jobs_to_flush: set[int] = set()
        self._batch_load_jobs: set[int] = set()
        self._batch_store_jobs: set[int] = set()
        self._batch_allocated_blocks: set[int] = set()
        self._batch_sync_load_bytes = 0
        self._meta_load_jobs: dict[int, TransferJob] = {}
        self._meta_store_jobs: dict[int, TransferJob] = {}
        self._fenced_jobs: dict[int, JobStatus] = {}
        self._preempted_early: set[str] = set()
        self._retired: list[RequestState] = []
        self.quarantined_gpu_blocks: dict[int, tuple[int, ...]] = {}
        """Beyond vLLM: destination blocks of timed-out loads, held until their late reports."""
        self.released_gpu_blocks: list[int] = []
        """Quarantined GPU blocks whose late reports arrived; the engine may free them."""
        self.step_index = 0
        self.step_open = False
        self.reset_since_last_step = False
        self.stats: Counter[str] = Counter()
        self._fired: list[Fired] = []
        nesting = Nesting(observers=[self._fired.append])
        self.effects = self.effects_cls(self)
        """The host of the effects the tables name (the lifecycles run them)."""
        self._requests_life = Lifecycle(spec.REQUEST_MACHINE, RequestState, self.effects,
                                        nesting)
        self._jobs_life = Lifecycle(spec.JOB_MACHINE, JobStatus, self.effects, nesting)
        self._fence_life = Lifecycle(spec.FENCE_MACHINE, ResetFence, self.effects, nesting)
        self._fence_life.add(self.fence)

    # ================================================================ the machinery
    def _fire(self, life: Lifecycle, subject: Any, trigger: str, **kwargs: Any) -> str:
        return life.fire(subject, trigger, **kwargs)

    def _require(self, life: Lifecycle, subject: Any, trigger: str) -> None:
        """Raise IllegalTransition now, before any change, if `trigger` has no row."""
        if not life.outgoing(subject.state, trigger):
            raise IllegalTransition(life.spec.name, subject.key, subject.state, trigger,
                                    life.allowed(subject.state))

    @contextmanager
    def _hook(self, name: str) -> Iterator[None]:
        self._fired.clear()
        yield
        self._retired.clear()
        if self.config.check_invariants:
            self.check_invariants(name)

    def _tracked(self, req_id: str, hook: str) -> RequestState:
        req = self._req_status.get(req_id)
        if req is None:
            raise UnknownRequest(req_id, hook)
        return req

    def _open_step(self) -> None:
        self.step_open = True

    def check_invariants(self, event: str = "check_invariants()") -> None:
        """Raise InvariantViolation if any safety invariant of `spec` fails now."""
        violations = spec.check(self.abstract_state())
        if violations:
            fired = "; ".join(f"{f.machine} {f.key!r}: {f.source} --{f.trigger}--> {f.dest}"
                              for f in self._fired)
            raise InvariantViolation(violations, f"{event}" + (f" [{fired}]" if fired else ""))

    def abstract_state(self) -> AbstractState:
        from statemachine.projection import project

        return project(self)

    # ============================================================ request lookups
    def request_state(self, req_id: str) -> str:
        req = self._req_status.get(req_id)
        return R.ABSENT if req is None else req.state

    def transfer_jobs(self, req_id: str) -> frozenset[int]:
        req = self._req_status.get(req_id)
        return frozenset() if req is None else frozenset(req.transfer_jobs)

    def offload_keys(self, request: Request, group: int = 0) -> list[int]:
        """The chunk keys of `group` the request's hashes give so far: one per full chunk,
        from the hash at the chunk's last block and the group (S:412-429, B:27-42)."""
        per_chunk, n = self.config.hashes_per_chunk, self.config.num_groups
        hashes = request.block_hashes
        return [offload_key(hashes[(c + 1) * per_chunk - 1], group, n)
                for c in range(len(hashes) // per_chunk)]

    def _boundary_key(self, req: RequestState, request: Request, group: int,
                      boundary: int) -> int:
        """The key of group `group` at a hash boundary (`_make_boundary_key`,
        S:1056-1066): the hash of the boundary's last hash block and the group; the manager
        learns its position, the boundary."""
        key = offload_key(request.block_hashes[boundary // self.config.hash_unit - 1], group,
                          self.config.num_groups)
        req.ctx.positions[key] = boundary
        return key

    def _request_keys(self, req: RequestState, request: Request, group: int = 0) -> list[int]:
        """`offload_keys`, telling the manager (through the request context) each key's
        position: the end token of its chunk, as vLLM's scheduler does (S:412-429)."""
        keys = self.offload_keys(request, group)
        positions, tpc = req.ctx.positions, self.config.tokens_per_chunk
        # a group's keys only grow, and are positioned in order: only its new tail is not
        first = len(keys)
        while first and keys[first - 1] not in positions:
            first -= 1
        for c in range(first, len(keys)):
            positions[keys[c]] = (c + 1) * tpc
        return keys

    def _tables(self, block_ids: Any, hook: str) -> tuple[tuple[int, ...], ...]:
        """A hook's block ids as one table per KV cache group: a sequence of sequences (one
        per group), or a flat sequence of ids for a one-group configuration."""
        n = self.config.num_groups
        if not block_ids:
            return ((),) * n
        if all(type(b) is int for b in block_ids):
            if n != 1:
                raise InvalidArgument(f"{hook}: {n} KV cache groups need one block table per "
                                      "group, got one flat table")
            return (tuple(block_ids),)
        tables = tuple(tuple(t) for t in block_ids)
        if len(tables) != n or not all(type(b) is int for t in tables for b in t):
            raise InvalidArgument(f"{hook}: expected {n} block tables of ints (one per KV "
                                  f"cache group), got {block_ids!r}")
        return tables

    # =================================================================== the hooks
    def on_new_request(self, request: Request) -> None:
        with self._hook(f"on_new_request({request.request_id!r})"):
            req = self._req_status.get(request.request_id)
            if req is not None:
                self._require(self._requests_life, req, "add")
            req = RequestState(request.request_id, request,
                               group_block_ids=[[] for _ in self.config.groups])
            self._parse_transfer_params(req, request)
            self._requests_life.add(req)
            self._fire(self._requests_life, req, "add")

    def _parse_transfer_params(self, req: RequestState, request: Request) -> None:
        params = request.kv_transfer_params or {}
        for name in ("max_load_tokens", "max_offload_tokens"):
            if name not in params:
                continue
            value = params[name]
            if type(value) is int and value >= 0:
                setattr(req, name, value)
            else:  # documented, counted ignore (vLLM warns and ignores, S:378-410)
                self.stats["ignored_transfer_params"] += 1

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        hook = f"get_num_new_matched_tokens({request.request_id!r}, {num_computed_tokens})"
        with self._hook(hook):
            req = self._tracked(request.request_id, "get_num_new_matched_tokens")
            n = num_computed_tokens
            if type(n) is not int or not 0 <= n <= request.num_tokens \
                    or n % self.config.block_size:
                raise InvalidArgument(f"{hook}: num_computed_tokens must be a block-aligned "
                                      f"int in [0, {request.num_tokens}]")
            if req.state in R.SCHEDULED:
                # a lookup for a scheduled request means the core preempted it (e.g. by
                # reset_prefix_cache(reset_running_requests=True)); apply the preemption now,
                # once: build_connector_meta will not apply it again.
                self._fire(self._requests_life, req, "preempt")
                self._preempted_early.add(req.req_id)
            if self._lookup_blocked(req):
                self._open_step()
                self._fire(self._requests_life, req, "lookup_blocked")
                return None, False
            self._require(self._requests_life, req, "lookup_resolved")
            self._open_step()
            if req.state in R.MUST_RECOMPUTE:
                self._fire(self._requests_life, req, "lookup_resolved")
                return 0, False
            req.num_locally_computed_tokens = n
            hit = self._lookup(req, request, n)
            if hit is None:
                self._fire(self._requests_life, req, "lookup_deferred")
                return None, False
            sync = self._sync_load_fits(request, n, hit)
            self._fire(self._requests_life, req, "lookup_resolved", hit_tokens=hit, sync=sync)
            return hit, bool(hit) and not sync

    def _lookup(self, req: RequestState, request: Request, n: int) -> int | None:
        """The tokens loadable after the local hit `n`; None means defer (S:1068-1152): the
        complete chunks' hit, then, with partial tails, its refinement up to a boundary."""
        req.partial_tail_boundary = None
        if request.skip_reading_prefix_cache or req.load_failed:
            return 0  # S:1258-1259; a faulting load is not retried (S@0.34.0:1411)
        complete, full_attention_hit = self._lookup_complete_chunks(req, request, n)
        if complete is None or not self.config.supports_partial_tail:
            return complete
        return self._lookup_partial_tail(req, request, n, complete, full_attention_hit)

    def _lookup_partial_tail(self, req: RequestState, request: Request, n: int,
                             complete: int, full_attention_hit: int | None) -> int | None:
        """From the furthest hash boundary the hit may reach inside the next block (before
        the last prompt token, under `max_load_tokens`) down to the complete hit's end, the
        first boundary whose keys every group holds ready extends the hit to it (its
        boundary is recorded for the load). A key not ready, met before a miss, defers the
        lookup if the complete hit is empty (S:1068-1195). The block is the one after the
        complete hit, or, as 0.34 searches (`spec.rules.PartialTailSearch`), the one after
        the full-attention groups' hit (S@0.34.0:1159-1263)."""
        cfg = self.config
        unit, edge = cfg.hash_unit, n + complete
        anchor, pending = edge, False
        prefix = cfg.rules.partial_tail_search is PartialTailSearch.FROM_FULL_ATTENTION_PREFIX
        fa = full_attention_hit or 0
        if prefix and fa > edge:
            between = (k for g in range(cfg.num_groups) if g not in cfg.window_groups
                       for k in self._request_keys(req, request, g)[
                           edge // cfg.block_size:fa // cfg.block_size])
            pending = any(k in self.chunks_being_loaded for k in between)
            if not pending:  # (being loaded: an empty hit defers, S@0.34.0:1176-1189)
                anchor = fa
        furthest = min(request.num_prompt_tokens - 1, anchor + cfg.block_size - 1)
        if req.max_load_tokens is not None:
            furthest = min(furthest, n + req.max_load_tokens)
        furthest = furthest // unit * unit
        if furthest <= edge:
            return complete  # no boundary to search (S@0.34.0:1210-1211)
        for boundary in range(furthest, edge, -unit):
            if boundary <= anchor and boundary % cfg.block_size == 0:
                continue  # a complete chunk, which the complete-chunk lookup missed
            ready = True
            for g in range(cfg.num_groups):
                key = self._boundary_key(req, request, g, boundary)
                if prefix and key in self.chunks_being_loaded:
                    ready, pending = False, True  # S@0.34.0:1303-1309
                result = self.manager.lookup(key, req.ctx)
                if result == LookupResult.MISS:
                    ready = False
                    break
                if result != LookupResult.HIT:
                    ready, pending = False, True
            if ready:
                req.partial_tail_boundary = boundary
                return boundary - n
        return None if pending and complete == 0 else complete

    def _lookup_complete_chunks(self, req: RequestState, request: Request,
                                n: int) -> tuple[int | None, int | None]:
        """The tokens loadable in whole chunks after the local hit `n`; None means defer
        (`_lookup_complete_chunks`, S:849-1054). Every group scans its keys (a prefix scan
        for full attention, a suffix-window scan for a sliding window or a Mamba state); a
        group's answer can shorten the hit, which sends the groups round again until it
        converges. The hit never covers the last prompt token's hash block
        (LAST-TOKEN-BOUND). Also the hit's boundary as the full-attention groups left it,
        before the first window group narrowed it (0 without such a group or when one
        deferred; None if the lookup ended before a window group; S@0.34.0:992-1001)."""
        cfg = self.config
        tpc = cfg.tokens_per_chunk
        keys = [self._request_keys(req, request, g) for g in range(cfg.num_groups)]
        max_hit = (request.num_tokens - 1) // cfg.hash_unit * cfg.hash_unit
        if req.max_load_tokens is not None:
            max_hit = min(max_hit, n + req.max_load_tokens)
        if cfg.window_groups:
            # the last prompt token is recomputed for its logprobs: 0.33 takes it off after
            # the caps, so a hit may end one token short of a block (S:872-876); 0.34 off the
            # request's length before them (S@0.34.0:921-941), which this bound leaves out
            if cfg.rules.last_token_cut is LastTokenCut.AFTER_CAPS:
                max_hit -= 1
            if cfg.handoff_groups:  # a Mamba state exists only at chunk edges (S:877-881)
                max_hit = max_hit // tpc * tpc
        order = tuple(g for g in range(cfg.num_groups) if g not in cfg.window_groups) \
            + cfg.window_groups
        num_hit, defer, todo = 0, False, order
        full_attention_hit: int | None = None
        while todo:
            looked_sliding, groups, todo = False, todo, ()
            for g in groups:
                windowed = g in cfg.window_groups
                max_hit = min(max_hit, len(keys[g]) * tpc)
                if req.max_load_tokens is not None:
                    max_hit = max_hit // tpc * tpc
                if max_hit - n < tpc:
                    return 0, full_attention_hit
                if windowed and full_attention_hit is None:
                    full_attention_hit = max_hit if len(order) > len(cfg.window_groups) \
                        and not defer else 0
                n_chunks = min(cdiv(max_hit, tpc), len(keys[g]))
                start = n // tpc
                if not windowed:
                    found = self._prefix_scan(keys[g][start:n_chunks], req)
                else:
                    first = cfg.load_window_chunks(g, min(max_hit, n_chunks * tpc))
                    found = self._window_scan(keys[g][start:n_chunks], req, first,
                                              cfg.window_chunks(g))
                if found == 0:
                    return 0, full_attention_hit
                if found is None:
                    defer = True
                else:
                    max_hit = min(max_hit, tpc * (start + found))
                new = max_hit - n
                if new < tpc:
                    return 0, full_attention_hit
                if new < num_hit:
                    if defer:
                        defer, todo = False, order
                    elif looked_sliding and not todo:
                        todo = cfg.window_groups
                looked_sliding |= windowed
                num_hit = new
        if defer:
            return None, full_attention_hit
        end = n + num_hit
        for g in range(cfg.num_groups):  # a hit chunk an async load still brings
            hit = keys[g][n // tpc:cdiv(end, tpc)]
            if g in cfg.window_groups:
                hit = hit[-cfg.load_window_chunks(g, end):]
            if any(k in self.chunks_being_loaded for k in hit):
                return None, full_attention_hit
        return num_hit, full_attention_hit

    def _prefix_scan(self, keys: list[int], req: RequestState) -> int | None:
        """Chunks hit from the start (S:773-803); None: defer (a chunk still being written,
        or one the manager cannot place yet)."""
        hits, defer = 0, False
        for k in keys:
            result = self.manager.lookup(k, req.ctx)
            if result == LookupResult.MISS:
                break
            if result == LookupResult.RETRY:
                defer = True  # keep scanning, as vLLM does, for the answer's sake only
                continue
            hits += 1
            defer |= result == LookupResult.HIT_PENDING
        return None if defer else hits

    def _window_scan(self, keys: list[int], req: RequestState, first: int,
                     window: int) -> int | None:
        """The end (in `keys`) of the last run of `window` hits, scanning from the right; the
        first run may need `first` (S:805-847). 0: no run; None: defer."""
        run, need, pending, retry = 0, first, False, False
        for idx in range(len(keys) - 1, -1, -1):
            result = self.manager.lookup(keys[idx], req.ctx)
            if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                run += 1
                pending |= result == LookupResult.HIT_PENDING
            else:
                retry |= result == LookupResult.RETRY
                run, pending, need = 0, False, window
            if run == need:
                return None if retry or pending else idx + need
        return None if retry or pending else run

    def _sync_load_fits(self, request: Request, n: int, hit: int) -> bool:
        budget = self.config.sync_load_budget_bytes
        return (budget > 0 and hit > 0 and n + hit < request.num_tokens
                and self._batch_sync_load_bytes + hit * self.config.kv_bytes_per_token
                <= budget)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[Any],
                                 num_external_tokens: int) -> None:
        hook = (f"update_state_after_alloc({request.request_id!r}, {len(block_ids)} blocks, "
                f"{num_external_tokens})")
        with self._hook(hook):
            req = self._tracked(request.request_id, "update_state_after_alloc")
            ext = num_external_tokens
            if ext == 0:
                self._batch_allocated_blocks.update(
                    b for t in self._tables(block_ids, hook) for b in t if b != NULL_BLOCK)
                req.lookup_hit_tokens = None
                return
            trigger = "load_sync" if req.sync_load_reserved else "load_async"
            self._require(self._requests_life, req, trigger)
            if req.lookup_hit_tokens != ext:
                raise InvalidArgument(f"{hook}: the last lookup of this request answered "
                                      f"{req.lookup_hit_tokens} tokens in this step, not {ext}")
            cfg = self.config
            bs, bpc = cfg.block_size, cfg.blocks_per_chunk
            tables = self._tables(block_ids, hook)
            n = req.num_locally_computed_tokens
            cached = n + ext
            tail = req.partial_tail_boundary
            if tail is not None and tail != cached:
                raise InvalidArgument(f"{hook}: the lookup's partial tail ends at {tail} "
                                      f"tokens, not at {cached}")
            num_gpu, end_chunk = self._load_extent(cached)
            keys: list[int] = []
            dst: list[int] = []
            sizes: list[int] = []
            starts: list[int] = []
            for g, table in enumerate(tables):  # per group, S:1385-1466
                if len(table) < num_gpu:
                    raise InvalidArgument(f"{hook}: group {g}: {len(table)} blocks cannot "
                                          f"hold {num_gpu} blocks of computed and loaded "
                                          "tokens")
                start = next((i for i in range(cdiv(n, bs), num_gpu)
                              if table[i] != NULL_BLOCK), num_gpu)
                if start < num_gpu:
                    keys += self._request_keys(req, request, g)[
                        start // bpc:end_chunk - (tail is not None)]
                    if tail is not None:  # the boundary's key, last (S:1428-1442)
                        keys.append(self._boundary_key(req, request, g, tail))
                dst += table[start:num_gpu]
                sizes.append(num_gpu - start)
                starts.append(start)
            self._open_step()
            self._batch_allocated_blocks.update(b for t in tables for b in t if b != NULL_BLOCK)
            self._fire(self._requests_life, req, trigger, keys=tuple(keys),
                       block_ids=tuple(dst), first_block_index=starts[0],
                       **self._group_layout(sizes, starts), end_chunk=end_chunk,
                       sync=req.sync_load_reserved, block_table=tables)
            req.partial_tail_boundary = None

    def _load_extent(self, cached: int) -> tuple[int, int]:
        """The GPU blocks and the chunks that `cached` computed and loaded tokens reach
        (S:1393, S:1423): a partial block or chunk counts."""
        return cdiv(cached, self.config.block_size), cdiv(cached, self.config.tokens_per_chunk)

    def _group_layout(self, sizes: list[int], starts: list[int]) -> dict[str, tuple[int, ...]]:
        """A job's per-group layout (vLLM's `group_sizes`, `block_indices`), for several
        groups; one group needs none (`first_block_index` says it)."""
        if self.config.num_groups == 1:
            return {}
        return {"group_sizes": tuple(sizes), "block_indices": tuple(starts)}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> (
            OffloadingConnectorMetadata):
        with self._hook(f"build_connector_meta(step {self.step_index})"):
            out = scheduler_output
            unknown = [r for r in (*(d.req_id for d in out.scheduled_new_reqs),
                                   *(d.req_id for d in out.scheduled_cached_reqs))
                       if r not in self._req_status]
            if unknown:
                raise UnknownRequest(unknown[0], "build_connector_meta (scheduled)")
            self._open_step()
            self._update_req_states(out)
            for req_id in sorted(out.preempted_req_ids - self._preempted_early):
                req = self._req_status.get(req_id)
                if req is not None and req.state in R.PREEMPT_FLUSHED:
                    self._fire(self._requests_life, req, "preempt")
            self._flush_reallocated_blocks()
            # Timeouts last: the core already scheduled (or preempted) this step's requests,
            # so a request whose sync load times out now is first updated as scheduled, and a
            # preempted one is first flushed (its blocks were freed behind the flush, not
            # quarantined).
            self._time_out_jobs()
            self._build_boundary_store_jobs(out)
            self._build_partial_tail_store_jobs(out)
            for req_id in [*out.num_scheduled_tokens, *sorted(out.finished_req_ids)]:
                req = self._req_status.get(req_id)
                if req is not None and req.state in R.STORE_CANDIDATES:
                    self._build_store_job(req, out.num_scheduled_tokens.get(req_id, 0))
            for job_id in sorted(self._batch_load_jobs | self._batch_store_jobs):
                job = self.jobs.get(job_id)
                if job is not None and job.state in J.TO_SHIP:
                    self._fire(self._jobs_life, job, "ship")
            meta = OffloadingConnectorMetadata(dict(self._meta_load_jobs),
                                               dict(self._meta_store_jobs),
                                               frozenset(self.jobs_to_flush))
            for req_id in sorted(out.finished_req_ids):
                req = self._req_status.get(req_id)
                if req is not None and req.state == R.FINISHED_PENDING_FINAL:
                    self._fire(self._requests_life, req, "finalize")
            self._end_step()
            return meta

    def _lookup_blocked(self, req: RequestState) -> bool:
        """S:1247-1252: a request that still holds jobs is not looked up (issue #46014)."""
        return req.state == R.PREEMPTED_FLUSHING

    def _flush_reallocated_blocks(self) -> None:
        """The re-allocation fence (S:2153-2165): a store still reading a block given out
        in this step is flushed before the step's loads and forward pass."""
        for block in sorted(self._batch_allocated_blocks):
            for job_id in sorted(self.block_fence.get(block, ())):
                job = self.jobs.get(job_id)
                if job is not None:
                    self._fire(self._jobs_life, job, "flush")

    def _advance_stale_threshold(self) -> None:
        """Every id handed out so far is stale from now on (S:2436)."""
        self.jobs.stale_threshold = self.jobs.job_counter

    def _time_out_jobs(self) -> None:
        limit = self.config.job_timeout_steps
        if limit is None:
            return
        for job in self.jobs:
            if job.shipped_step is not None and self.step_index - job.shipped_step >= limit:
                self._fire(self._jobs_life, job, "time_out")

    def _update_req_states(self, out: SchedulerOutput) -> None:
        """The scheduled requests' tables (S:1502-1552): a full table replaces, new blocks
        extend; then a sliding-window block the core handed out again in this step is zeroed
        in any table that still lists it, from the store cursor to where the table ended
        before this step (earlier positions were stored already)."""
        ends: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self._scheduled(self._req_status[new.req_id], new.block_ids, full=True)
            ends[new.req_id] = 0
        for cached in out.scheduled_cached_reqs:
            req = self._req_status[cached.req_id]
            full = cached.resumed_from_preemption
            ends[cached.req_id] = 0 if full else self._table_length(req)
            self._scheduled(req, cached.new_block_ids, full=full)
        self._batch_allocated_blocks.update(dst for _, dst in out.kv_cache_block_copies)
        for req_id, num in out.num_scheduled_tokens.items():
            scheduled = self._req_status.get(req_id)
            if scheduled is not None:
                scheduled.scheduled_end = scheduled.request.num_computed_tokens + num
        if not self.config.window_groups or not self._batch_allocated_blocks:
            return
        bpc = self.config.blocks_per_chunk
        for req_id, req in self._req_status.items():
            for g in self.config.window_groups:
                table = req.group_block_ids[g]
                for p in range(req.next_stored_chunk_idx * bpc, ends.get(req_id, len(table))):
                    if table[p] in self._batch_allocated_blocks:
                        table[p] = NULL_BLOCK

    @staticmethod
    def _table_length(req: RequestState) -> int:
        return len(req.group_block_ids[0]) if req.group_block_ids else 0

    def _scheduled(self, req: RequestState, block_ids: Any, full: bool) -> None:
        tables = self._tables(block_ids, "build_connector_meta (a scheduled request)")
        self._batch_allocated_blocks.update(b for t in tables for b in t if b != NULL_BLOCK)
        if req.state in R.SCHEDULED:
            if full:
                req.set_tables(tables)
            else:  # a running request: only the step's new blocks (no copy of its table)
                for own, new in zip(req.group_block_ids, tables, strict=True):
                    own.extend(new)
            return
        if not full:
            tables = tuple((*o, *t) for o, t in zip(req.group_block_ids, tables, strict=True))
        # the table says from where a request may be scheduled
        self._fire(self._requests_life, req, "schedule", block_ids=tables)

    def _build_store_job(self, req: RequestState, num_scheduled: int) -> None:
        if req.loaded_tokens_invalid:
            self.stats["stores_withheld_invalid_kv"] += 1
            return  # no store reads KV that a failed load invalidated
        request: Request = req.request
        cfg = self.config
        if req.is_finished:
            tokens = (request.num_computed_tokens
                      if request.status == RequestStatus.FINISHED_ABORTED
                      else max(request.num_prompt_tokens, request.num_tokens - 1))
        else:
            tokens = request.num_computed_tokens + num_scheduled
        tokens = self._offloadable_tokens(req, tokens)
        bpc = cfg.blocks_per_chunk
        tables = req.group_block_ids
        n_chunks = min(tokens // cfg.tokens_per_chunk, len(request.block_hashes) // bpc,
                       *(len(t) // bpc for t in tables))
        start = req.next_stored_chunk_idx
        if start >= n_chunks:  # most steps of a decoding request: no new full chunk
            return
        offered: list[int] = []
        # key -> (group, the blocks the store copies, the table position of the first)
        source: dict[int, tuple[int, tuple[int, ...], int]] = {}
        for g, table in enumerate(tables):  # per group, S:1859-1982
            if g in cfg.handoff_groups:
                continue  # not positional: stored from the core's hand-offs (S:1904-1905)
            keys = self._request_keys(req, request, g)
            reach = cfg.reachable_blocks(
                g, request.num_prompt_tokens, start * bpc, n_chunks * bpc,
                shared_prefix_boundary=request.shared_prefix_boundary)
            # skipped: a chunk with a needed block the core freed or handed out again, or
            # none needed (the reachable-block mask, S:1770-1796)
            for c, _, copied in storable_chunks(table, start, n_chunks, bpc, reach):
                offered.append(keys[c])
                # a window's null blocks lead: the copied ones end the chunk
                source[keys[c]] = (g, copied, (c + 1) * bpc - len(copied))
        if not offered:
            req.next_stored_chunk_idx = n_chunks
            return
        result = self.manager.prepare_store(offered, req.ctx)
        if result is None:
            self._fire(self._requests_life, req, "store_alloc_failed")
            return
        if not result.keys_to_store:
            req.next_stored_chunk_idx = n_chunks
            return
        blocks: list[int] = []
        fenced: list[int] = []
        sizes = [0] * cfg.num_groups
        starts: list[int | None] = [None] * cfg.num_groups
        for k in result.keys_to_store:  # in the manager's order: group by group (S:2002-2051)
            g, chunk, position = source[k]
            blocks += chunk
            sizes[g] += len(chunk)
            if starts[g] is None:
                starts[g] = position
            if g in cfg.window_groups:
                fenced += chunk
        first = source[result.keys_to_store[0]][2]
        self._fire(self._requests_life, req, "store", keys=tuple(result.keys_to_store),
                   chunk_ids=tuple(result.chunk_ids), block_ids=tuple(blocks),
                   first_block_index=first, fenced_block_ids=tuple(fenced),
                   **self._group_layout(sizes, [s or 0 for s in starts]), end_chunk=n_chunks)

    def _build_boundary_store_jobs(self, out: SchedulerOutput) -> None:
        """`_build_aligned_boundary_store_jobs` (S:1554-1624): each state block the core
        handed off at a chunk boundary within the request's offloadable tokens is stored,
        alone, into the chunk that ends there, and fenced from the job's creation (the core
        frees a Mamba state block one step later); the store cursor stays. A hand-off vLLM
        skips (the null block, a boundary inside a chunk or past the offloadable tokens) is
        counted in `handoffs_skipped`; one for a request the connector does not track, or
        in a state with no `store` row, in `handoffs_ignored`."""
        cfg = self.config
        bs, tpc = cfg.block_size, cfg.tokens_per_chunk
        for req_id, entries in sorted(out.boundary_state_offloads.items()):
            req = self._req_status.get(req_id)
            for group, block, boundary in entries:
                if not (type(group) is int and 0 <= group < cfg.num_groups):
                    raise InvalidArgument(f"build_connector_meta: request {req_id!r}: a "
                                          f"hand-off names group {group!r} of "
                                          f"{cfg.num_groups}")
                if req is None or not self._requests_life.outgoing(req.state, "store") \
                        or req.loaded_tokens_invalid:
                    self.stats["handoffs_ignored"] += 1
                    continue
                if cfg.supports_partial_tail and boundary % bs:
                    continue  # a partial tail: the next builder's
                request: Request = req.request
                keys = self._request_keys(req, request, group)
                if block == NULL_BLOCK or boundary % tpc or boundary // tpc > len(keys) \
                        or boundary > self._offloadable_tokens(req, request.num_tokens):
                    self.stats["handoffs_skipped"] += 1
                    continue
                key = keys[boundary // tpc - 1]
                result = self.manager.prepare_store([key], req.ctx)
                if result is None:
                    self._fire(self._requests_life, req, "store_alloc_failed")
                    continue
                if not result.keys_to_store:
                    continue
                sizes = [0] * cfg.num_groups
                sizes[group] = 1
                starts = [0] * cfg.num_groups
                starts[group] = boundary // bs - 1
                self._fire(self._requests_life, req, "store", keys=(key,),
                           chunk_ids=tuple(result.chunk_ids), block_ids=(block,),
                           first_block_index=boundary // bs - 1, fenced_block_ids=(block,),
                           **self._group_layout(sizes, starts),
                           end_chunk=req.next_stored_chunk_idx)

    def _build_partial_tail_store_jobs(self, out: SchedulerOutput) -> None:
        """`_build_partial_tail_store_jobs` (S:1626-1760), with partial tails on: a request's
        hand-offs inside a block (one boundary) become one store of every group's block the
        boundary falls in (a Mamba group's handed-off copy, the others' table block) under
        the boundary's keys, every source fenced from the job's creation; the store cursor
        stays. vLLM asserts what it cannot store (a boundary past the offloadable tokens, a
        null source); here such a hand-off is counted in `handoffs_skipped`, and one for a
        request without a `store` row (or whose loaded KV is invalid) in
        `handoffs_ignored`."""
        cfg = self.config
        if not cfg.supports_partial_tail:
            return
        bs = cfg.block_size
        for req_id, entries in sorted(out.boundary_state_offloads.items()):
            tails = [(g, block, boundary) for g, block, boundary in entries if boundary % bs]
            if not tails:
                continue
            req = self._req_status.get(req_id)
            if req is None or not self._requests_life.outgoing(req.state, "store") \
                    or req.loaded_tokens_invalid:
                self.stats["handoffs_ignored"] += 1
                continue
            request: Request = req.request
            boundaries = {boundary for _, _, boundary in tails}
            if len(boundaries) != 1:
                raise InvalidArgument(f"build_connector_meta: request {req_id!r}: partial "
                                      f"tails at several boundaries {sorted(boundaries)}")
            boundary = boundaries.pop()
            position = boundary // bs
            copies = {g: block for g, block, _ in tails}
            sources: list[int] = []
            for g in range(cfg.num_groups):
                table = req.group_block_ids[g]
                if g in cfg.handoff_groups:
                    sources.append(copies.get(g, NULL_BLOCK))
                else:
                    sources.append(table[position] if position < len(table) else NULL_BLOCK)
            if NULL_BLOCK in sources or boundary % cfg.hash_unit \
                    or boundary > self._offloadable_tokens(req, request.num_prompt_tokens):
                self.stats["handoffs_skipped"] += 1
                continue
            keys = [self._boundary_key(req, request, g, boundary)
                    for g in range(cfg.num_groups)]
            result = self.manager.prepare_store(keys, req.ctx)
            if result is None:
                self._fire(self._requests_life, req, "store_alloc_failed")
                continue
            if not result.keys_to_store:
                continue
            stored = [keys.index(k) for k in result.keys_to_store]
            blocks = tuple(sources[g] for g in stored)
            sizes = [1 if g in stored else 0 for g in range(cfg.num_groups)]
            starts = [position if g in stored else 0 for g in range(cfg.num_groups)]
            self._fire(self._requests_life, req, "store", keys=tuple(result.keys_to_store),
                       chunk_ids=tuple(result.chunk_ids), block_ids=blocks,
                       first_block_index=position, fenced_block_ids=blocks,
                       **self._group_layout(sizes, starts),
                       end_chunk=req.next_stored_chunk_idx)

    def _offloadable_tokens(self, req: RequestState, tokens: int) -> int:
        """`tokens` under the request's `max_offload_tokens` and the prompt-only setting
        (`_calc_num_offloadable_tokens`, S:762-771)."""
        if req.max_offload_tokens is not None:
            tokens = min(tokens, req.max_offload_tokens)
        if self.config.offload_prompt_only:
            tokens = min(tokens, req.request.num_prompt_tokens)
        return tokens

    def _end_step(self) -> None:
        self._batch_load_jobs.clear()
        self._batch_store_jobs.clear()
        self._batch_allocated_blocks.clear()
        self._batch_sync_load_bytes = 0
        self._meta_load_jobs.clear()
        self._meta_store_jobs.clear()
        self._preempted_early.clear()
        for job_id in self.jobs_to_flush:
            job = (self.jobs.get(job_id) or self._fenced_jobs.get(job_id)
                   or self.jobs.quarantine.get(job_id))
            if job is not None:
                job.flush_shipped = True
        self.jobs_to_flush.clear()
        for req in self._req_status.values():
            req.lookup_hit_tokens = None
            req.partial_tail_boundary = None
            req.sync_load_reserved = False
        self.manager.on_schedule_end()
        self.reset_since_last_step = False
        self.step_open = False
        self.step_index += 1

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        with self._hook("update_connector_output"):
            reports = self._validate_reports(output)
            reported = {job_id: self.job_status(job_id) for job_id in reports}
            for job_id, (done, failed, cls) in sorted(reports.items()):
                self._apply_reports(job_id, done, failed, cls)
            completed = self._async_loads_completed(reported)
            for req_id in sorted(output.finished_recving):
                if self._recving_is_stale(req_id, completed.get(req_id, -1)):
                    # the late completion of a timed-out load (spec.request.recving_is_stale):
                    # out of the set, so that the core does not promote the request early
                    output.finished_recving.discard(req_id)
                    self.stats["stale_recving_ignored"] += 1
                    continue
                req = self._req_status.get(req_id)
                if req is not None and req.state == R.ORPHANED_LOAD:
                    self._fire(self._requests_life, req, "load_recving")

    def _async_loads_completed(self, reported: dict[int, JobStatus | None]) -> dict[str, int]:
        """Per request, the newest of its async loads whose last report this output carried
        (a reported job the scheduler no longer knows once the reports are applied)."""
        out: dict[str, int] = {}
        for job_id, job in reported.items():
            if job is not None and job.kind == "load" and not job.sync and \
                    self.job_status(job_id) is None:
                owner = job.owner.req_id
                out[owner] = max(out.get(owner, -1), job_id)
        return out

    def _recving_is_stale(self, req_id: str, completed: int) -> bool:
        due = (*self.jobs, *self.jobs.quarantine.values(), *self._fenced_jobs.values())
        return R.recving_is_stale(req_id, completed, (
            (j.owner.req_id, j.kind, j.sync, j.job_id) for j in due))

    def _validate_reports(self, output: KVConnectorOutput) -> (
            dict[int, tuple[int, int, JobClass]]):
        if not isinstance(output, KVConnectorOutput):
            raise MalformedMessage(f"update_connector_output expects a KVConnectorOutput, got "
                                   f"{type(output).__name__}")
        recving = output.finished_recving
        if not isinstance(recving, set) or not all(isinstance(r, str) for r in recving):
            raise MalformedMessage("finished_recving must be a set of request ids")
        meta = output.kv_connector_worker_meta
        if meta is None:
            return {}
        if not isinstance(meta, OffloadingWorkerMetadata):
            raise MalformedMessage(f"kv_connector_worker_meta must be OffloadingWorkerMetadata "
                                   f"or None, got {type(meta).__name__}")
        counts: dict[int, list[int]] = {}
        for field_name, slot in (("completed_jobs", 0), ("failed_jobs", 1)):
            table = getattr(meta, field_name)
            if not isinstance(table, dict):
                raise MalformedMessage(f"{field_name} must be a dict of job id -> count")
            for job_id, count in table.items():
                if type(job_id) is not int or type(count) is not int or count <= 0:
                    raise MalformedMessage(f"{field_name}[{job_id!r}] = {count!r}: job ids and "
                                           "counts must be ints, counts > 0")
                counts.setdefault(job_id, [0, 0])[slot] += count
        reports: dict[int, tuple[int, int, JobClass]] = {}
        for job_id, (done, failed) in counts.items():
            cls = self.jobs.classify(job_id, self.fence.entries)
            if cls == JobClass.UNKNOWN:
                raise UnknownJob(job_id, self._unknown_reason(job_id))
            due = self._reports_due(job_id, cls)
            if due is not None and done + failed > due:
                state = self._reported_job(job_id, cls).state
                raise OverAck(job_id, done + failed, due, state)
            reports[job_id] = (done, failed, cls)
        return reports

    def _reported_job(self, job_id: int, cls: JobClass) -> JobStatus:
        """The job model a report for `job_id` of class `cls` moves."""
        table: dict[int, JobStatus] | JobTable = (
            self.jobs if cls == JobClass.LIVE
            else self.jobs.quarantine if cls == JobClass.QUARANTINED else self._fenced_jobs)
        job = table.get(job_id)
        assert job is not None, (job_id, cls)
        return job

    def _reports_due(self, job_id: int, cls: JobClass) -> int | None:
        if cls == JobClass.FENCED:
            return self.fence.entries[job_id]
        if cls in (JobClass.LIVE, JobClass.QUARANTINED):
            return self._reported_job(job_id, cls).pending_count
        return None

    def _unknown_reason(self, job_id: int) -> str:
        if job_id >= self.jobs.job_counter or job_id < 0:
            return (f"never allocated (the job counter is {self.jobs.job_counter}); "
                    "nothing was changed")
        return (f"reported after it ended (completed, failed, or a timed-out job that drained; "
                f"ids below the stale threshold {self.jobs.stale_threshold} are filtered as "
                "stale); a duplicate report? nothing was changed")

    def _apply_reports(self, job_id: int, done: int, failed: int, cls: JobClass) -> None:
        if cls == JobClass.STALE_DRAINED:
            self._fire(self._fence_life, self.fence, "drained_report", count=done + failed)
            return
        job = self._reported_job(job_id, cls)
        if done:
            self._fire(self._jobs_life, job, "ack", count=done)
        if failed:
            self._fire(self._jobs_life, job, "fail", count=failed)
        if cls == JobClass.FENCED:
            self._fire(self._fence_life, self.fence, "stale_report")

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        with self._hook(f"request_finished({request.request_id!r})"):
            req = self._req_status.get(request.request_id)
            if req is None:
                temp = RequestState(request.request_id, request)
                self._requests_life.add(temp)
                self._fire(self._requests_life, temp, "finish_untracked")  # removes temp
                return False, None
            self._require(self._requests_life, req, "finish")
            req.is_finished = True
            self._fire(self._requests_life, req, "finish")
            return False, None

    def reset_cache(self) -> bool:
        with self._hook("reset_cache()"):
            if self.step_open:
                raise OutOfStep("reset_cache() called inside a step (after a lookup or "
                                "allocation, before build_connector_meta); vLLM asserts "
                                "the same (S:2403-2407)")
            live = len(self.jobs) + len(self.jobs.quarantine)
            for req_id in sorted(self._req_status):
                self._fire(self._requests_life, self._req_status[req_id], "reset")
            for job in list(self.jobs.quarantine.values()):
                self._fire(self._jobs_life, job, "reset")
            self.manager.reset_cache()
            self._advance_stale_threshold()
            self._fire(self._fence_life, self.fence, "reset", live_jobs=live)
            self.chunks_being_loaded.clear()
            self.block_fence.clear()
            self.reset_since_last_step = True
            self.stats["resets"] += 1
            return True

    # ============================================================== queries (2.8)
    def has_pending_work(self) -> bool:
        return (bool(len(self.jobs)) or bool(self.fence.entries) or bool(self.jobs.quarantine)
                or self.manager.has_pending_work())

    has_pending_push_work = has_pending_work

    def take_events(self) -> list[Any]:
        return list(self.manager.take_events())

    def get_stats(self) -> dict[str, int]:
        return {**self.stats, **{f"manager_{k}": v for k, v in self.manager.stats.items()}}

    def job_status(self, job_id: int) -> JobStatus | None:
        """The job's status while the scheduler still knows it: live, in the timeout
        quarantine, or in the reset fence (its `state` stays final once it ends)."""
        return (self.jobs.get(job_id) or self.jobs.quarantine.get(job_id)
                or self._fenced_jobs.get(job_id))

    def take_released_gpu_blocks(self) -> list[int]:
        out, self.released_gpu_blocks = self.released_gpu_blocks, []
        return out

    def shutdown(self) -> None:
        self.stats["shutdown"] += 1
        stop = getattr(self.manager, "shutdown", None)  # a tiering manager's I/O threads
        if stop is not None:
            stop()

    @property
    def requests(self) -> dict[str, RequestState]:
        return dict(self._req_status)
