"""`VLLMAdapter`: the model-based test machine of `statemachine.testing`, driving vLLM.

The machine's model speaks in small units: a GPU block holds `tokens_per_block` model
tokens (1 by default), chunk keys are `spec.model.key(family, position)`, GPU blocks are
0..gpu_blocks-1. The adapter
translates each model hook call into the same hook of vLLM's real scheduler-side
`OffloadingConnector` (built by `conformance.vllm_env`):

- vLLM's blocks hold `BLOCK_SIZE` tokens, so a model token is `BLOCK_SIZE //
  tokens_per_block` of them: token ids that are a pure function of (family, position), so
  prompts that share a model prefix share vLLM block hashes, hence offload keys; the adapter
  keeps the map from each offload key back to the model key;
- token counts (lookup hits, scheduled and computed tokens) are multiplied by the vLLM
  tokens per model token on the way in and divided on the way out (a vLLM answer that is not
  a whole number of model tokens is a divergence);
- model GPU block `b` is vLLM block `b + 1` (vLLM's block 0 is the null block);
- the adapter plays vLLM's core scheduler around the hooks: request status
  (`RUNNING`, `PREEMPTED` with `num_computed_tokens = 0`, `WAITING_FOR_REMOTE_KVS`,
  `FINISHED_*`), the block table it hands over (`NewRequestData` for a first scheduling, a
  resumed `CachedRequestData` after a preemption, a plain cached entry while running),
  `preempted_req_ids` and `finished_req_ids` in the next `SchedulerOutput`, worker acks as
  `OffloadingWorkerMetadata.completed_jobs` summed over the workers, and
  `finished_recving` for async loads;
- evictions (the model lets the implementation choose victims) are read as the manager's
  keys that disappeared during `build_connector_meta`.

`VLLMMachine` is `OffloadingStateMachine` restricted to what the installed vLLM has (see
CONFORMANCE.md for each restriction and its reason).
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize

from conformance import releases
from conformance import vllm_env as E
from conformance.projection import (
    JobMemo,
    Observations,
    count_manager_calls,
    model_block,
    project,
    vllm_block,
)
from spec import model as M
from spec import request as RS
from spec.groups import NULL_BLOCK, split_groups, window_tokens
from spec.rules import LastTokenCut, Rules
from spec.state import AbstractState, RequestRecord
from statemachine.core import StepLedger
from statemachine.testing import (
    DECODE_BOUNDS,
    HYBRID_BOUNDS,
    SETTINGS_BOUNDS,
    OffloadingStateMachine,
    model_hit,
    normalize,
    transfer_params,
)

BLOCK_SIZE = 16
"""vLLM tokens per GPU block (one block hash each); a model token is `BLOCK_SIZE //
tokens_per_block` of them."""


def block_tokens(family: int, position: int, n: int = BLOCK_SIZE) -> list[int]:
    """The `n` vLLM token ids of the model token at `position` of a prompt of `family`."""
    base = 3 + (family * 101 + position) * BLOCK_SIZE
    span = E.VOCAB_SIZE - 3
    return [3 + (base + i - 3) % span for i in range(n)]


def tokens_per_model_token(bounds: M.Bounds) -> int:
    """vLLM tokens per model token: a vLLM block holds `tokens_per_block` model tokens."""
    if BLOCK_SIZE % bounds.tokens_per_block:
        raise ValueError(f"{bounds.tokens_per_block} model tokens per block do not divide "
                         f"vLLM's block of {BLOCK_SIZE} tokens")
    return BLOCK_SIZE // bounds.tokens_per_block


def _accepts_max_num_new_tokens(scheduler: Any) -> bool:
    return "max_num_new_tokens" in inspect.signature(
        scheduler.get_num_new_matched_tokens).parameters


class VLLMAdapter:
    """Drives vLLM's scheduler-side connector through the machine's model calls."""

    sync_load_budget_bytes: ClassVar[int] = 1 << 40
    last_token_bound: ClassVar[bool] = True
    """Apply the LAST-TOKEN-BOUND translation where vLLM has the bound (0.33: yes)."""

    def __init__(self, bounds: M.Bounds) -> None:
        self.bounds = bounds
        extra: dict[str, Any] = {}
        if bounds.sync_loads:
            extra["sync_load_budget_bytes"] = self.sync_load_budget_bytes
        if bounds.store_threshold > 1:
            extra["store_threshold"] = bounds.store_threshold
        if bounds.offload_prompt_only:  # vLLM's default; vllm_env.make_setup turns it off
            extra["offload_prompt_only"] = True
        self.groups = len(bounds.groups)
        self.tok = tokens_per_model_token(bounds)
        """vLLM tokens per model token."""
        self.setup = E.make_setup(num_gpu_blocks=bounds.gpu_blocks + 1, block_size=BLOCK_SIZE,
                                  blocks_per_chunk=bounds.blocks_per_chunk,
                                  num_cpu_chunks=bounds.cpu_chunks, num_workers=bounds.workers,
                                  eviction_policy="lru", extra_config=extra,
                                  **hybrid_setup(bounds))
        self.connector = self.setup.connector
        self.scheduler = self.setup.scheduler
        self.status = E.request_status()
        self.obs = Observations(num_workers=bounds.workers, groups=bounds.groups,
                                sliding_window=bounds.sliding_window,
                                tokens_per_block=bounds.tokens_per_block)
        if not hasattr(self.scheduler, "_reset_fence"):
            self.obs.emulated_fence = {}
        self.requests: dict[str, Any] = {}
        self.family: dict[str, int] = {}
        self.ledger = StepLedger()
        """The core's record of the step (shared with every core stand-in)."""
        self.last_async: dict[str, bool] = {}
        self.admitted: set[str] = set()
        """Requests looked up in the current step."""
        self.looked_up: set[str] = set()
        """Requests looked up at least once (0.22.x tracks a request from then on)."""
        self.step_open = False
        """Inside a step: from its first lookup or allocation to the end of
        build_connector_meta (what 0.33's `_step_region` holds; read where vLLM has none)."""
        self.hit_tokens: dict[str, int] = {}
        """vLLM's last lookup answer per request, in tokens."""
        self.bound_last_token = self.last_token_bound and _accepts_max_num_new_tokens(
            self.scheduler)
        self.cap_keeps_the_last_token = (
            E.has("hybrid_hit_at_the_cap") and bool(self.scheduler._sliding_window_groups)
            and bounds.rules.last_token_cut is LastTokenCut.AFTER_CAPS
            and not getattr(self.scheduler.config, "supports_partial_tail", False))
        """CAP-BEFORE-THE-LAST-TOKEN: bounds under 0.33's cut (`LastTokenCut.AFTER_CAPS`,
        the directed programs written under it) on 0.34.0 with a window or Mamba group,
        whose lookup takes the recomputed token off before the caps. Not with partial tails:
        their search reads the cap itself (S@0.34.0:1202-1203), up to the boundary the
        spec's hit reaches, where a lower cap would stop it short (`program_rules`)."""
        self._evicted: list[int] = []
        self._failed_loads: set[int] = set()
        """Load jobs a worker failed, live or stale: the worker names their request in
        `failed_recving` (W@0.34.0:306-316) whatever the scheduler's table says."""
        self.deferred: set[str] = set()
        """Requests whose last lookup answered None while they held no job (the
        LOOKUP_DEFERRED mark, where vLLM keeps none: `_as_of_release`)."""
        self.marks_deferred = _marks_deferred_lookups(type(self.scheduler))
        self._wrap_manager()

    # -- identity -----------------------------------------------------------------
    @property
    def vllm_file(self) -> str:
        """`vllm.__file__` of the tree under test (installed wheel or VLLM_SRC checkout)."""
        return self.setup.vllm_file

    @property
    def vllm_version(self) -> tuple[int, int, int]:
        return self.setup.version

    # -- observation wrappers (count only; they call through unchanged) --------------
    def _wrap_manager(self) -> None:
        obs = self.obs

        def recording_victims(store: Callable[[], Any]) -> Any:
            # the victims of each store in turn: a step may evict a chunk for one store and
            # store it again for the next (a hand-off, then the positional store)
            before = self._policy_keys()
            out = store()
            self._evicted.extend(sorted(obs.key_of[k] for k in before - self._policy_keys()))
            return out

        # 0.22.x has no manager finish signal (feature manager_finish_signal): none counted
        count_manager_calls(self.setup.manager, obs,
                            lambda rid: rid in self.scheduler._req_status, recording_victims)

    # -- requests -----------------------------------------------------------------
    def _request(self, req_id: str) -> Any:
        req = self.requests.get(req_id)
        if req is not None:
            return req
        t = self.bounds.template(req_id)
        prompt = [tok for p in range(t.tokens) for tok in block_tokens(t.family, p, self.tok)]
        req = E.make_request(
            self.setup, req_id, prompt,
            kv_transfer_params=transfer_params(t.settings, self.tok) or None,
            skip_reading_prefix_cache=t.settings.skip_reading_prefix_cache)
        self._map_keys(t, req, 0, t.tokens)
        self.requests[req_id] = req
        self.family[req_id] = t.family
        return req

    def _map_keys(self, t: M.Template, req: Any, first: int, tokens: int) -> None:
        """Map the offload keys of `req`'s block hashes from hash `first` on (of its first
        `tokens` model tokens) back to the model's keys."""
        hashes = list(req.block_hashes)
        unit = self.bounds.tokens_per_hash  # a block, or a model token with partial tails
        if len(hashes) != tokens // unit:
            raise AssertionError(f"{t.req_id}: {len(hashes)} block hashes for "
                                 f"{tokens // unit} full hash blocks")
        for c in range(first, len(hashes)):
            for g in range(self.groups):
                self.obs.key_of[bytes(E.offload_key(hashes[c], g))] = t.block_key(
                    c, unit, g, self.groups)

    def _sampled(self, outputs: dict[str, int]) -> None:
        """Each request's output grown to the model's count after a step, as vLLM's core
        appends the sampled tokens (`Request.append_output_token_ids`, which extends its
        block hashes): a model token's `tok` vLLM tokens at once."""
        for r, n in outputs.items():
            req = self.requests[r]
            t = self.bounds.template(r)
            have = len(req.output_token_ids) // self.tok
            if have >= n:
                continue
            first = len(req.block_hashes)
            req.append_output_token_ids([tok for p in range(t.tokens + have, t.tokens + n)
                                         for tok in block_tokens(t.output_family, p,
                                                                 self.tok)])
            self._map_keys(t, req, first, t.tokens + n)

    def _policy_keys(self) -> set[bytes]:
        policy = self.setup.manager._policy
        table = getattr(policy, "chunks", None)
        if table is None:
            table = policy.blocks
        return {bytes(k) for k in table}

    def _memo_jobs(self, meta: Any = None) -> None:
        """Remember each live job's kind, keys and GPU blocks (vLLM forgets them at reset)."""
        obs = self.obs
        for jid, js in self.scheduler._jobs.items():
            if jid not in obs.jobs:
                keys = frozenset(obs.key_of[bytes(k)] for k in js.keys)
                obs.jobs[jid] = JobMemo("store" if js.is_store else "load", keys,
                                        sync=bool(getattr(js, "is_sync_load", False)))
        if meta is None:
            return
        for table, gpu_side in ((meta.load_jobs, 1), (meta.store_jobs, 0)):
            for jid, job in table.items():
                gpu = E.transfer_specs(job)[gpu_side]
                blocks = frozenset(model_block(b) for b in gpu.block_ids.tolist() if b != 0)
                memo = obs.jobs.get(jid)
                if memo is not None:
                    memo.blocks = blocks
        flushed = set(meta.jobs_to_flush or ())
        obs.flush_requested |= flushed
        obs.flush_shipped |= flushed

    # -- the hooks ----------------------------------------------------------------
    def call(self, call: M.Call) -> Any:
        a = call.args
        hook = call.hook
        if hook == "on_new_request":
            req = self._request(a[0])
            self.obs.core_status[a[0]] = "waiting"
            return self.connector.on_new_request(req)
        if hook == "get_num_new_matched_tokens":
            return self._lookup(a[0], int(a[1]))
        if hook == "update_state_after_alloc":
            return self._alloc(a[0], tuple(a[1]), int(a[2]))
        if hook == "build_connector_meta":
            return self._build(*a)
        if hook == "update_connector_output":
            return self._report(int(a[0]), int(a[1]), int(a[2]), frozenset(a[3]))
        if hook == "request_finished":
            return self._finished(a[0], bool(a[1]))
        if hook == "reset_cache":
            return self._reset()
        raise ValueError(f"unknown hook {hook!r}")

    def _lookup(self, req_id: str, local: int) -> tuple[int | None, bool]:
        req = self._request(req_id)
        if self.obs.core_status.get(req_id) == "running":
            req.status = self.status.PREEMPTED  # re-admitted before the step reported it
        self.obs.core_status[req_id] = "waiting"
        self.obs.core_blocks[req_id] = ()
        self.obs.window_end[req_id] = 0
        req.num_computed_tokens = 0
        self.admitted.add(req_id)
        self.looked_up.add(req_id)
        self.step_open = True
        if self.bound_last_token:
            # LAST-TOKEN-BOUND (CONFORMANCE.md): the hit may not cover the last prompt
            # token, through vLLM's own bound for it (what OffloadingConnector passes for
            # hybrid models: the longest hit of num_tokens - 1 tokens in hash blocks).
            unit = self.bounds.tokens_per_hash * self.tok
            cap = max(0, (req.num_tokens - 1) // unit * unit - local * self.tok)
            if self.cap_keeps_the_last_token:
                # CAP-BEFORE-THE-LAST-TOKEN (CONFORMANCE.md): the cap one token lower gives
                # 0.33's cut on 0.34.0, which takes that token off before the cap
                cap = max(0, cap - 1)
            hits, is_async = self.scheduler.get_num_new_matched_tokens(
                req, local * self.tok, max_num_new_tokens=cap)
        else:
            hits, is_async = self.connector.get_num_new_matched_tokens(req,
                                                                       local * self.tok)
        self.last_async[req_id] = bool(is_async)
        if hits is None:
            # deferred on a chunk (marked in 0.26+), not on the request's own jobs (unmarked)
            status = self.scheduler._req_status.get(req_id)
            if status is not None and not status.transfer_jobs:
                self.deferred.add(req_id)
            else:
                self.deferred.discard(req_id)
            return None, bool(is_async)
        self.deferred.discard(req_id)
        self.obs.invalid_loads.discard(req_id)
        self.hit_tokens[req_id] = int(hits)
        try:
            return model_hit(int(hits), "sliding" in self.bounds.groups, self.tok), \
                bool(is_async)
        except AssertionError as exc:
            raise AssertionError(f"lookup of {req_id}: {exc}") from None

    def _vllm_table(self, blocks: tuple[int, ...]) -> Any:
        """The model's flat table as vLLM's: block `b` is `b + 1`, a null position vLLM's
        null block 0; with several groups, one list per group."""
        ids = [0 if b == NULL_BLOCK else vllm_block(b) for b in blocks]
        if self.groups == 1:
            return ids
        return tuple(list(t) for t in split_groups(ids, self.groups))

    def _alloc(self, req_id: str, blocks: tuple[int, ...], hit: int) -> Any:
        req = self._request(req_id)
        self.step_open = True
        vblocks = self._vllm_table(blocks)
        self.obs.core_blocks[req_id] = _flat(vblocks)
        out = self.connector.update_state_after_alloc(
            req, E.kv_blocks(vblocks), self.hit_tokens.get(req_id, 0) if hit else 0)
        if hit and self.last_async.get(req_id, False):
            self.obs.core_status[req_id] = "remote"
            req.status = self.status.WAITING_FOR_REMOTE_KVS
        else:  # the core schedules it in this very step (CS:1482-1486 then running)
            self.obs.core_status[req_id] = "running"
        self._memo_jobs()
        return out

    def _build(self, new: dict[str, tuple[int, ...]], cached: dict[str, tuple[int, ...]],
               sched: dict[str, int], finished: frozenset[str], preempted: frozenset[str],
               computed: dict[str, tuple[int, bool]],
               handoffs: dict[str, tuple[tuple[int, int, int], ...]],
               copies: tuple[tuple[int, int], ...],
               outputs: dict[str, int] | None = None) -> Any:
        obs = self.obs
        for r in sorted(preempted):
            if r in new or r in self.admitted or r not in self.requests:
                continue  # preempted, then admitted again in this very step
            req = self.requests[r]
            if not req.is_finished():
                req.status = self.status.PREEMPTED
                req.num_computed_tokens = 0
                obs.core_status[r] = "waiting"
                obs.core_blocks[r] = ()
        for r, (n, _aborted) in computed.items():
            if r in self.requests:
                self.requests[r].num_computed_tokens = n * self.tok
        ledger = self.ledger
        for r in sched:  # in the model's order: the order of vLLM's stores
            obs.recompute.discard(r)  # scheduled: out of RECOMPUTE
            obs.window_end[r] = computed[r][0] + sched[r]
            if r in new:
                req = self._request(r)
                vblocks = self._vllm_table(new[r])
                ledger.admit(r, vblocks, sched[r] * self.tok)
                req.status = self.status.RUNNING
                obs.core_status[r] = "running"
                obs.core_blocks[r] = _flat(vblocks)
            else:
                vblocks = self._vllm_table(cached[r]) if cached[r] or self.groups == 1 \
                    else tuple([] for _ in range(self.groups))
                ledger.run(r, vblocks, sched[r] * self.tok)
                if self.groups == 1:
                    obs.core_blocks[r] = (*obs.core_blocks.get(r, ()), *vblocks)
                elif any(vblocks):  # a decoding request's new blocks, group by group
                    old = split_groups(obs.core_blocks.get(r, ()), self.groups)
                    obs.core_blocks[r] = tuple(b for mine, more in zip(old, vblocks, strict=True)
                                               for b in (*mine, *more))
        for r in finished:
            ledger.finish(r)
        for r in preempted:
            ledger.preempt(r)
        out = E.scheduler_output_of(  # the core hands off a Mamba group's states
            self.setup, ledger.close(), self.requests,
            {r: [(g, vllm_block(b), end * self.tok) for g, b, end in entries]
             for r, entries in handoffs.items()},
            [(vllm_block(src), vllm_block(dst)) for src, dst in copies])
        self.step_open = True
        meta = self.connector.build_connector_meta(out)  # victims: counted_prepare_store
        self.step_open = False
        self._memo_jobs(meta)
        self._sampled(outputs or {})
        obs.reset_since_last_step = False
        self.admitted.clear()
        return meta

    def _report(self, job: int, done: int, failed: int, recving: frozenset[str]) -> Any:
        """Worker reports for `job`: `done` acks and `failed` failures (from 0.34.0, feature
        failure_reports: a failing worker's report counts like an ack and names the job in
        `failed_jobs`; the requests of a load that failed come in `failed_recving` with
        their `finished_recving`, and the core recomputes them from token 0)."""
        fence = self.obs.emulated_fence
        if fence is not None and job in fence:
            fence[job] -= done
            if fence[job] <= 0:
                del fence[job]
        # a load a worker failed, in this report or an earlier one, live or made stale by a
        # reset since: the worker's failed_recving (the aggregator hands it to the core
        # with the load's last finished_recving, KU@0.34.0:181-184)
        live = self.scheduler._jobs.get(job)
        memo = self.obs.jobs.get(job)
        if failed and memo is not None and memo.kind == "load":
            self._failed_loads.add(job)
        failed_load = job in self._failed_loads
        failed_recving = set(recving) if failed_load else set()
        count = done + failed
        out = self.connector.update_connector_output(
            E.connector_output({job: count} if count else {},
                               finished_recving=set(recving),
                               failed_jobs={job} if failed else frozenset(),
                               failed_recving=failed_recving))
        if failed_load and live is not None and job not in self.scheduler._jobs:
            self.obs.invalid_loads.add(live.req_id)  # its request's `load_failed` is set
        for r in recving:  # the core's side of finished_recving
            if self.obs.core_status.get(r) == "remote":
                self.obs.core_status[r] = "waiting"
                self.requests[r].status = self.status.WAITING
                if r in failed_recving:  # CS@0.34.0:3625-3646: its blocks freed, recomputed
                    self.obs.core_blocks[r] = ()
                    self.requests[r].num_computed_tokens = 0
                    self.obs.recompute.add(r)
            elif self.obs.core_status.get(r) == "finished":
                self.obs.core_blocks[r] = ()
        return out

    def _finished(self, req_id: str, aborted: bool) -> Any:
        req = self._request(req_id)
        req.status = (self.status.FINISHED_ABORTED if aborted
                      else self.status.FINISHED_STOPPED)
        self.obs.final_blocks[req_id] = self.obs.core_blocks.get(req_id, ())
        blocks = [b for b in self.obs.core_blocks.get(req_id, ()) if b != 0]
        if self.obs.core_status.get(req_id) != "remote":  # an abort while loading keeps them
            self.obs.core_blocks[req_id] = ()
        self.obs.core_status[req_id] = "finished"
        return self.connector.request_finished(req, blocks)

    def _reset(self) -> Any:
        self._memo_jobs()
        fence = self.obs.emulated_fence
        if fence is not None:  # no fence in this vLLM: count the reports still due here
            for jid, js in self.scheduler._jobs.items():
                fence[jid] = int(js.pending_count)
        out = self.connector.reset_cache()
        self.obs.flush_requested |= set(self.scheduler._current_batch_jobs_to_flush)
        self.obs.reset_since_last_step = True
        return out

    # -- the Adapter protocol -----------------------------------------------------
    def evicted(self) -> tuple[int, ...]:
        out, self._evicted = tuple(self._evicted), []
        return out

    def abstract_state(self) -> AbstractState:
        return self._as_of_release(project(self.setup, self.obs))

    def _as_of_release(self, state: AbstractState) -> AbstractState:
        """What the projection cannot read in an older release, from the adapter's own
        observations (each a named feature of conformance/releases.py):

        - step_region (0.33.0): before it vLLM keeps no mark of an open step; the step is
          open from its first lookup or allocation to the end of build_connector_meta, as
          0.33's `_acquire_step`/`_release_step` hold it (S:1239, S:1367, S:2108-2113);
        - on_new_request (0.23.0): 0.22.x tracks a request only from its first lookup;
        - lookup_resets_cursor (0.33.0): CURSOR-KEPT (CONFORMANCE.md). 0.33 puts a request's
          store cursor back to 0 at each lookup (S:1241-1245: a restart offers every chunk
          again); 0.26-0.32 keep it, so after a preemption vLLM's cursor stays ahead of the
          spec's. The cursor is then not compared (None, as for 0.22-0.25, which have no
          chunk cursor); what it decides still is: a chunk the restarted request does not
          offer again would be a missing store job in the comparison of the jobs.
        """
        if not E.has("step_region"):
            state = replace(state, step_open=self.step_open)
        if not E.has("lookup_resets_cursor"):
            state = replace(state, requests=tuple(replace(r, store_cursor=None)
                                                  for r in state.requests))
        if not E.has("on_new_request"):
            state = self._with_requests_not_looked_up(state)
        if not self.marks_deferred:
            state = replace(state, requests=tuple(
                replace(r, state=RS.LOOKUP_DEFERRED)
                if r.state == RS.IDLE and r.id in self.deferred else r
                for r in state.requests))
        return state

    def _with_requests_not_looked_up(self, state: AbstractState) -> AbstractState:
        """0.22.x (feature on_new_request): the connector has no `on_new_request` and tracks
        a request from its first lookup (offloading/scheduler.py:525-528 in 0.22.0), where
        the spec tracks it from its arrival. A request that arrived and was never looked up
        is IDLE, holding nothing: the record vLLM would have (no store cursor, as vLLM has
        none before 0.26)."""
        known = {r.id for r in state.requests}
        extra = [RequestRecord(id=r, state=RS.IDLE, transfer_jobs=frozenset(), finished=False,
                               finished_signaled=False, load_invalid=False,
                               lookup_hit_pending=False, gpu_blocks=(), store_cursor=None)
                 for r in sorted(self.requests)
                 if r not in known and r not in self.looked_up
                 and self.obs.core_status.get(r) != "finished"]
        return replace(state, requests=tuple(sorted((*state.requests, *extra))))


def _marks_deferred_lookups(scheduler_type: type) -> bool:
    """Whether vLLM marks a deferred lookup (`RequestOffloadState.deferred_lookup_start_time`,
    S@0.26.0:260, set where the lookup of the chunks answers None, S@0.26.0:766-768, not where
    the request's own jobs defer it; the projection reads it for LOOKUP_DEFERRED). 0.22-0.25
    defer the same lookups (the manager's answer or a hit chunk being loaded,
    S@0.25.1:593-625) with no mark: the adapter keeps it (`VLLMAdapter.deferred`)."""
    module = inspect.getmodule(scheduler_type)
    state_type = getattr(module, "RequestOffloadState", None)
    fields = getattr(state_type, "__dataclass_fields__", None)
    return fields is None or "deferred_lookup_start_time" in fields


def _flat(table: Any) -> tuple[int, ...]:
    """A vLLM table (one list, or one list per group) as one flat tuple, group by group."""
    if table and not isinstance(table[0], int):
        return tuple(b for g in table for b in g)
    return tuple(table)


def hybrid_setup(bounds: M.Bounds) -> dict[str, Any]:
    """`make_setup`'s arguments for the bounds' KV cache groups (none for one full-attention
    group; a group of another kind alone is a model whose every layer is of that kind: a
    pure Mamba model, a sliding window on every layer), and the retention interval in vLLM's
    tokens. With a sliding window the model's window of W tokens is vLLM's `16 (W - 1) + 1`,
    where vLLM's reachable-block mask counts one block less than the spec's (finding F4):
    the two agree where neither mask leaves a block out, so under dense retention the window
    must span a chunk and the one before it (vLLM's `W - 1` blocks cover a chunk)."""
    if bounds.groups == ("full",):
        return {}
    if set(bounds.groups) == {"full"}:
        raise ValueError(f"the conformance setup takes one full-attention group, or groups "
                         f"with a sliding window or a Mamba group; got {bounds.groups}")
    retention = bounds.retention_interval
    kept = {} if retention is None else {
        "retention_interval": retention * tokens_per_model_token(bounds)}
    if "sliding" not in bounds.groups:
        tails = {"prefix_match_unit": tokens_per_model_token(bounds)} \
            if bounds.partial_tails else {}
        return {"groups": bounds.groups, **tails, **kept}
    if retention is None and bounds.sliding_window - 1 < bounds.tokens_per_chunk:
        raise ValueError(f"a sliding window of {bounds.sliding_window} tokens does not span "
                         f"a chunk of {bounds.tokens_per_chunk} tokens and the one before it")
    return {"sliding_window": window_tokens(bounds.sliding_window,
                                            tokens_per_model_token(bounds)),
            "groups": bounds.groups, **kept}


# ============================================================================ the machine
def _vllm_bounds(sync_loads: bool) -> tuple[M.Bounds, ...]:
    """The machine's bounds, without worker failures or job timeouts (vLLM has neither)."""
    out = [
        M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=2,
                 failures=0, preemptions=2),
        M.Bounds(requests=3, tokens=2, shared_prefix=False, workers=1, cpu_chunks=2,
                 gpu_blocks=4, resets=1, failures=0, preemptions=1),
        M.Bounds(requests=3, tokens=3, families=2, workers=1, cpu_chunks=4, gpu_blocks=6,
                 resets=2, failures=0, preemptions=2),
        # requests that decode: output stored as it runs and at the finish, a preempted
        # request's lookup over it
        M.Bounds(requests=3, tokens=2, workers=2, cpu_chunks=4, gpu_blocks=8, resets=1,
                 failures=0, preemptions=2, decode_tokens=3),
        M.Bounds(requests=2, tokens=3, shared_prefix=False, workers=1, cpu_chunks=3,
                 gpu_blocks=6, resets=1, failures=0, preemptions=2, decode_tokens=2),
        # vLLM's default offload_prompt_only: the output is never stored
        M.Bounds(requests=3, tokens=2, workers=2, cpu_chunks=4, gpu_blocks=8, resets=1,
                 failures=0, preemptions=2, decode_tokens=3, offload_prompt_only=True),
    ]
    if sync_loads:
        out.append(M.Bounds(requests=2, tokens=3, workers=2, cpu_chunks=4, gpu_blocks=6,
                            resets=2, failures=0, preemptions=1, sync_loads=True))
        # requests with their own settings (kv_transfer_params, skip_reading_prefix_cache)
        out += [replace(b, failures=0) for b in SETTINGS_BOUNDS if not b.hybrid]
    return tuple(out)


def offload_caps_past_the_tail(b: M.Bounds) -> M.Bounds:
    """F3 (CONFORMANCE.md): vLLM asserts when a request's `max_offload_tokens` falls below
    its partial tail's boundary; the machine raises such a cap to the boundary."""
    boundary = b.tail_boundary(b.tokens)
    if boundary is None:
        return b
    return replace(b, request_settings=tuple(
        s._replace(max_offload_tokens=max(s.max_offload_tokens, boundary))
        if s.max_offload_tokens is not None else s for s in b.request_settings))


def features_needed(b: M.Bounds) -> frozenset[str]:
    """The vLLM features (`conformance.releases.FEATURES`) a run under bounds `b` needs."""
    need: set[str] = set()
    if b.sync_loads:
        need.add("sync_loads")
    for s in b.request_settings:
        if s.max_load_tokens is not None:
            need.add("max_load_tokens")
        if s.max_offload_tokens is not None:
            need.add("offload_caps")
    if "mamba" in b.groups:
        need.add("block_state_handoffs")
        if b.requests > 1 and b.shared_prefix:
            # PENDING-PAST-THE-HIT (CONFORMANCE.md): without the lookup's bound (0.29.0)
            # the full-attention scan runs past the Mamba-aligned hit and defers on a chunk
            # still being stored there, where the spec hits the aligned prefix
            need.add("max_num_new_tokens")
    if b.partial_tails:
        need |= {"partial_tails", "prefix_match_unit"}
    if b.retention_interval is not None or "sliding" in b.groups:
        # which window chunks a store keeps: the retention rule from 0.30.0; before, the
        # chunks of full-attention alignment segments (S:975-996 in 0.26.0), not the spec's
        need.add("retention_interval")
    if b.blocks_per_chunk > 1:
        need.add("blocks_per_chunk")
    if b.store_threshold > 1:
        need.add("store_admission_at_store")
    if b.decode_tokens:
        need.add("finished_commit_point")
    if b.offload_prompt_only:
        need.add("offload_caps")
    return frozenset(need)


RELEASE_FAILURES = 2 if E.has("failure_reports") else 0
"""Worker failures a run may draw: from 0.34.0 (feature failure_reports) a worker reports a
failed copy; before, a failure asserts in the worker (W:299-301) and none is drawn."""


RELEASE_RULES = Rules.of(dict(rule for feature, rules in releases.RULE_FEATURES.items()
                              if E.has(feature) for rule in rules))
"""The spec's rules for the vLLM under test (`spec.rules`): 0.33.0's, or, where a release
changed a rule the spec states both ways (D5, D6, D7, a failed load not retried, a stale
load's failure left to the core), that release's."""


def program_rules(b: M.Bounds) -> Rules:
    """The rules a directed program written under bounds `b` (0.33.0's rules) replays under
    on the vLLM under test: the release's (RELEASE_RULES), except the last-token cut, which
    the adapter holds at the program's on 0.34.0 where it can (CAP-BEFORE-THE-LAST-TOKEN:
    not with partial tails), so that a program keeps the path it was written for."""
    if b.partial_tails:
        return RELEASE_RULES
    return replace(RELEASE_RULES, last_token_cut=b.rules.last_token_cut)


def release_bounds(b: M.Bounds) -> M.Bounds:
    """`b` under the rules of the vLLM under test (RELEASE_RULES), with the worker failures
    it reports (RELEASE_FAILURES)."""
    return replace(b, failures=RELEASE_FAILURES, rules=RELEASE_RULES)


def for_release(bounds: tuple[M.Bounds, ...]) -> tuple[M.Bounds, ...]:
    """The bounds the vLLM under test has every feature for (decided without importing it:
    `vllm_env.release_version`), under its rules and with its failures (`release_bounds`),
    each once."""
    return tuple(dict.fromkeys(
        release_bounds(b) for b in bounds if not E.missing(*sorted(features_needed(b)))))


def dropped_for_release(bounds: tuple[M.Bounds, ...]) -> list[tuple[M.Bounds, list[str]]]:
    """The bounds `for_release` leaves out, each with the features the release lacks."""
    out = []
    for b in bounds:
        lacks = E.missing(*sorted(features_needed(b)))
        if lacks:
            out.append((b, list(lacks)))
    return out


HYBRID_VLLM_BOUNDS: tuple[M.Bounds, ...] = (
    *(offload_caps_past_the_tail(replace(
        b, failures=0, sliding_window=max(b.sliding_window, b.tokens_per_chunk + 1)
        if "sliding" in b.groups else b.sliding_window))
      for b in (*HYBRID_BOUNDS, *(s for s in (*SETTINGS_BOUNDS, *DECODE_BOUNDS) if s.hybrid))
      if b.retention_interval is None),  # a bound of its own below (MASK-SPAN)
    M.Bounds(requests=2, tokens=6, workers=1, cpu_chunks=4, gpu_blocks=16, resets=1,
             failures=0, preemptions=1, groups=("full", "sliding"), sliding_window=5,
             blocks_per_chunk=4),
    # vLLM's default retention: only the window tail a replay of the prompt reads; with a
    # 4-token window and 2-block chunks vLLM's tail (3 blocks) and the spec's (5 under
    # 0.33.0's cut, 4 under 0.34.0's) take the same chunks of a 5-token prompt
    M.Bounds(requests=3, tokens=5, families=2, workers=1, cpu_chunks=5, gpu_blocks=14,
             resets=1, failures=0, preemptions=1, groups=("full", "sliding"),
             sliding_window=4, blocks_per_chunk=2, retention_interval=0),
    # the same with a Mamba group beside them: the three kinds in one model (one layer
    # each), the states retained at the same replay boundaries as the window tails
    M.Bounds(requests=3, tokens=5, families=2, workers=2, cpu_chunks=6, gpu_blocks=18,
             resets=1, failures=0, preemptions=1, groups=("full", "sliding", "mamba"),
             sliding_window=4, blocks_per_chunk=2, retention_interval=0),
    # and a window on every layer at retention 0, decoding: no tail ends in an output
    # chunk, and no full-attention group stores it, so the step that completes it stores
    # nothing and moves the store cursor past it
    M.Bounds(requests=3, tokens=5, families=2, workers=1, cpu_chunks=5, gpu_blocks=12,
             resets=1, failures=0, preemptions=1, groups=("sliding",), sliding_window=4,
             blocks_per_chunk=2, retention_interval=0, decode_tokens=2),
)
"""The hybrid machine's bounds: the model-based tests' `HYBRID_BOUNDS` (one group over
both layers, such as a pure Mamba model, or one layer per group: two groups, or the three
kinds) and their hybrid settings and decoding bounds (requests that decode beside a
sliding window over 2-block chunks, and in blocks of 2 model tokens), without worker
failures and with a window that spans a chunk (`hybrid_setup`), plus 4-block chunks: a
full-attention and a sliding-window group (either order) with 1, 2 and 4 blocks per chunk,
a full-attention and a Mamba group, a Mamba group alone, a sliding window alone (under dense
retention and at retention 0), the three kinds at retention 0, one full-attention group of
2-block chunks, and blocks of 2 model tokens (vLLM block size 16: a model token is 16 vLLM
tokens, or 8 where a block holds 2 model tokens)."""


def unfailable_in_vllm(model: M.ModelState, ev: M.Event) -> str | None:
    """The restriction that keeps the failure report `ev` off vLLM 0.34, or None (it takes
    it as the spec does). CONFORMANCE.md: SYNC-LOAD-FAILURE, a sync load's failure raises in
    the worker (W@0.34.0:309-312: its request already ran on the KV), live or made stale by
    a reset, where the spec recomputes the request and poisons its stores. (The failure of
    an async load a reset made stale, the restriction STALE-LOAD-FAILURE before, is 0.34.0's
    rule `spec.rules.StaleLoadFailure.FENCE_ONLY`, which RELEASE_RULES gives the spec.)"""
    if ev.kind != "report" or not ev.failed or ev.job is None:
        return None
    job = next((j for j in (*model.jobs, *model.held) if j.id == ev.job), None)
    return "SYNC-LOAD-FAILURE" if job is not None and job.kind == "load" and job.sync else None


VLLM_SWARM = ("abort", "finish", "preempt", "reset", "partial", "complete", "late",
              *(("failure",) if RELEASE_FAILURES else ()))
"""The machine's swarm; "failure" only where vLLM reports a failed transfer (0.34.0+)."""


VLLM025_SWARM = ("preempt", "reset", "partial", "complete", "late")
"""0.22-0.25: no abort or finish events (EARLY-FINISH-SIGNAL, see VLLM025Machine)."""

FINISHES_AS_THE_SPEC = E.has("finished_signal")
"""EARLY-FINISH-SIGNAL (CONFORMANCE.md): before 0.27.0 (feature finished_signal)
`request_finished` signals the manager at once (`manager.on_request_finished`,
offloading/scheduler.py:1292 in 0.26.0), before the request's final store, which the next
step still makes; the spec signals after the final store. Without the feature the machine
takes no finish or abort events and its drain does not finish requests."""

RELEASE_SWARM = tuple(e for e in VLLM_SWARM
                      if FINISHES_AS_THE_SPEC or e not in ("abort", "finish"))
"""The machine's swarm on the vLLM under test."""


class VLLMMachine(OffloadingStateMachine):
    """`OffloadingStateMachine` against vLLM's real scheduler-side connector.

    Restrictions (each with its reason in CONFORMANCE.md): no worker failures, no job
    timeouts, no duplicate-report rule (vLLM raises a bare KeyError, the spec a typed
    error), sync loads only where vLLM has them. Invariants are checked on vLLM's state
    before the refinement comparison, so a broken invariant is reported as such.
    """

    adapter_factory: ClassVar[type] = VLLMAdapter
    bounds_choices: ClassVar[tuple[M.Bounds, ...]] = for_release(_vllm_bounds(sync_loads=True))
    """The bounds of every release, less those needing features this one lacks."""
    SWARM: ClassVar[tuple[str, ...]] = RELEASE_SWARM
    CHECK_INVARIANTS_FIRST: ClassVar[bool] = True

    steps_taken: ClassVar[int] = 0
    """Model steps taken (events the model and vLLM both stepped), over every run."""
    runs: ClassVar[int] = 0
    last_trace: ClassVar[list[str]] = []
    """The trace of the last run that failed (hypothesis replays the shrunk one last)."""
    last_error: ClassVar[str] = ""
    seconds: ClassVar[float] = 0.0

    @initialize(which=st.integers(0, 100), swarm=st.sets(st.sampled_from(RELEASE_SWARM),
                                                         min_size=2))
    def start(self, which: int, swarm: set[str]) -> None:
        type(self).runs += 1
        super().start(which, swarm)

    def _step(self, ev: M.Event) -> None:
        before = len(self.trace)
        t0 = time.perf_counter()
        try:
            super()._step(ev)
        finally:
            type(self).seconds += time.perf_counter() - t0
            if len(self.trace) > before:
                type(self).steps_taken += 1

    def _record_failure(self, exc: BaseException) -> None:
        """Keep the run's first failure where the tests read it (class-wide: hypothesis
        replays the shrunk run last)."""
        if self.failure is None:
            type(self).last_trace = list(self.trace)
            type(self).last_error = f"{type(exc).__name__}: {exc}"
        super()._record_failure(exc)

    def allows(self, rule: str, ev: M.Event) -> bool:
        """vLLM's restrictions: no reset where vLLM is known to crash (RESET-TWICE) or
        stores a block it no longer holds (RESET-WINDOW), no finish or abort before 0.27.0
        (EARLY-FINISH-SIGNAL), and the admissions and preemptions older releases take
        differently."""
        if rule == "reset":
            return not self.reset_would_trip() and not self.reset_keeps_stale_window()
        if rule in ("finish", "abort"):
            return FINISHES_AS_THE_SPEC
        if rule == "step":
            return (not self.whole_prompt_hit(ev) and not self.readmits_preempted(ev)
                    and not self.restarts_past_a_kept_cursor(ev))
        if rule == "preempt":
            return not self.preempts_a_load(ev)
        if rule == "worker_failure":
            return not self.fails_what_vllm_cannot(ev)
        return True

    def fails_what_vllm_cannot(self, ev: M.Event) -> bool:
        """A failure `unfailable_in_vllm` names."""
        return self.model is not None and unfailable_in_vllm(self.model, ev) is not None

    def readmits_preempted(self, ev: M.Event) -> bool:
        """PREEMPTED-LOAD (CONFORMANCE.md, releases before 0.33.0, feature
        preempted_load_flush): admitting again in this step a request whose preemption the
        step reports gives it a load job, and build_connector_meta then asserts that a
        preempted request holds only stores (offloading/scheduler.py:1138 in 0.26.0, :1862
        in 0.32.0); 0.33 flushes the load."""
        m = self.model
        return (m is not None and not E.has("preempted_load_flush")
                and not self.allow_known_crashes and ev.kind == "step"
                and ev.req is not None and ev.req in m.pending_preempted)

    def restarts_past_a_kept_cursor(self, ev: M.Event) -> bool:
        """CURSOR-KEPT (CONFORMANCE.md, releases before 0.33.0, feature
        lookup_resets_cursor): a request admitted again after it stored keeps vLLM's store
        cursor (`next_stored_chunk_idx`), where the spec offers its chunks again from 0; a
        chunk evicted from the CPU tier meanwhile is stored again by the spec, not by vLLM
        (found on 0.26.0 and 0.27.0: `arrive(r0) ; arrive(r1) ; arrive(r2) ; reset() ;
        step(admit=r0) ; ack(job 0, count 1) ; preempt(r0) ; step(admit=r1) ; ack(job 1,
        count 1) ; step() ; step(admit=r0)`, one worker, two CPU chunks). The machine does
        not admit again a request whose cursor has moved. A difference of states, not of
        liveness: a machine that does not check refinement keeps the path."""
        m = self.model
        if (m is None or not self.CHECK_REFINEMENT or E.has("lookup_resets_cursor")
                or not self.admits_with_a_lookup(ev)):
            return False
        req = next((r for r in m.reqs if r.id == ev.req), None)
        return req is not None and req.cursor > 0

    def admits_with_a_lookup(self, ev: M.Event) -> bool:
        """`ev` admits a waiting request through a lookup (it restarts from token 0). Not
        a request whose async load ended: it runs on the blocks it holds, with no lookup,
        in vLLM and in the spec alike. The restrictions on admissions (CURSOR-KEPT,
        WHOLE-PROMPT-HIT) are about the lookup; taking them at the end of a load too left
        a loaded request that could neither run nor finish (D3) in the drain (found on
        0.27.0: `step() ; arrive(r0) ; arrive(r1) ; arrive(r2) ; step(admit=r0) ; ack(job
        0, count 2) ; step() ; ack(job 1, count 2) ; step(admit=r1) ; ack(job 2, count 2)
        ; ack(job 3, count 2) ; abort(r0) ; abort(r2)`, then the drain)."""
        m = self.model
        if m is None or ev.kind != "step" or ev.req is None:
            return False
        core = dict(m.core).get(ev.req)
        return core is None or not core.blocks

    def preempts_a_load(self, ev: M.Event) -> bool:
        """PREEMPTED-LOAD, the other way in: preempting a request that holds a load job
        (before 0.33.0)."""
        m = self.model
        if (m is None or E.has("preempted_load_flush") or self.allow_known_crashes
                or ev.req is None):
            return False
        req = next((r for r in m.reqs if r.id == ev.req), None)
        loads = {j.id for j in m.jobs if j.kind == "load"}
        return req is not None and bool(req.jobs & loads)

    def whole_prompt_hit(self, ev: M.Event) -> bool:
        """WHOLE-PROMPT-HIT (CONFORMANCE.md, releases before 0.30.0: no
        `max_num_new_tokens`, feature max_num_new_tokens): admitting `ev.req` now could give
        a lookup that vLLM answers with the whole block-aligned prompt (divergence D1: the
        spec, with the LAST-TOKEN-BOUND, leaves the last block to compute). A hybrid model
        with a sliding window is bounded by vLLM itself (`max_hit_size_tokens -= 1`). Taken
        where the request's last chunk is in the model's CPU tier (a whole-prompt hit needs
        it; a shorter hit is then not taken either)."""
        m = self.model
        if (m is None or not self.admits_with_a_lookup(ev) or self.allow_known_divergences
                or getattr(self.impl, "bound_last_token", True)):
            return False
        b = m.bounds
        if b.window_groups():
            return False
        assert ev.req is not None  # admits_with_a_lookup
        t = b.template(ev.req)
        tpc = b.tokens_per_chunk
        if t.settings.skip_reading_prefix_cache or t.tokens % tpc or t.tokens < tpc:
            return False
        held = {k for k, _ref in m.chunks}
        last = t.tokens // tpc - 1
        return any(M.block_key(t.family, (last + 1) * b.blocks_per_chunk - 1,
                               b.tokens_per_block, g, len(b.groups)) in held
                   for g in range(len(b.groups)))

    def reset_keeps_stale_window(self) -> bool:
        """A reset now would leave a request's table with sliding-window ids the core freed
        below the store cursor it puts back to 0: vLLM's next store of that request reads
        them (finding F2, RESET-WINDOW in CONFORMANCE.md); the spec zeroes them."""
        m = self.model
        if m is None or self.allow_known_divergences or not m.bounds.window_groups():
            return False
        return any(r.blocks and m.bounds.skipped_blocks(g, r.window_end) > 0
                   for r in m.reqs for g in m.bounds.window_groups())

    def reset_would_trip(self) -> bool:
        """A second reset before any step, while the first one's flush is still pending:
        vLLM asserts `not _current_batch_jobs_to_flush` (finding F1 in CONFORMANCE.md;
        fixed in 0.34.0, feature second_reset_merges)."""
        return (self.model is not None and self.model.reset_since_step
                and bool(self.model.to_flush) and not self.allow_known_crashes
                and not E.has("second_reset_merges"))

    allow_known_divergences: ClassVar[bool] = False
    """Lift the restrictions that avoid vLLM's documented divergences (to show them)."""

    allow_known_crashes: ClassVar[bool] = False
    """Lift the restrictions that avoid vLLM's known crashes (to show they still happen)."""

    def duplicate_report_is_rejected(self) -> None:
        """Not a rule here: vLLM answers a report for an ended job with a bare KeyError (and
        an over-ack with an assert); the spec's typed refusal is beyond vLLM."""

    DRAIN_FINISHES: ClassVar[bool] = FINISHES_AS_THE_SPEC
    """The drain aborts every request (the base machine's drain). False: it only delivers
    every report and steps, then asks that every request is left idle, holding no job (so
    before 0.27.0: EARLY-FINISH-SIGNAL)."""

    def teardown(self) -> None:
        if self.failure is not None:
            return  # the first failure stands; vLLM stopped mid-hook
        try:
            if self.DRAIN_FINISHES:
                super().teardown()  # the base machine's drain: nothing restricts it now
            else:
                self._drain_without_finishing()
        except BaseException as exc:
            self._record_failure(exc)
            raise

    def _drain_without_finishing(self) -> None:
        if self.model is None:
            return
        self._deliver_and_step()
        self._nothing_left()

    def _deliver_and_step(self) -> None:
        """Deliver every report and step until nothing changes."""
        for _ in range(200):
            evs = [e for e in self._possible()
                   if (e.kind == "report" and not e.failed
                       and e.count == max(1, self._unreported(e.job)))
                   or (e.kind == "step" and e.req is None)]
            evs.sort(key=lambda e: ("report", "step").index(e.kind))
            if not evs:
                break
            before = self.model
            self._step(evs[0])
            if self.model == before and evs[0].kind == "step":
                break

    def _nothing_left(self) -> None:
        """No request holds a job, no job is live, no chunk is pinned."""
        assert self.model is not None
        state = normalize(self.impl.abstract_state(), self.model.bounds)
        stuck = [r for r in state.requests if r.transfer_jobs]
        assert not stuck, ("requests stuck after the drain (every report delivered): "
                           + "; ".join(f"{r.id} in {r.state} holds jobs "
                                       f"{sorted(r.transfer_jobs)}, live jobs "
                                       f"{sorted(state.live_job_ids)}" for r in stuck))
        assert not state.jobs and not state.reset_fence and not state.quarantine, state
        assert all(n == 0 for _, n in state.chunk_ref_cnt), state.chunk_ref_cnt


class VLLMHybridMachine(VLLMMachine):
    """The machine on vLLM's connector built with a hybrid KV cache configuration."""

    bounds_choices: ClassVar[tuple[M.Bounds, ...]] = for_release(HYBRID_VLLM_BOUNDS)


class VLLM025Machine(VLLMMachine):
    """The machine against vLLM 0.22-0.25 (before PR #48102 and the reset fence).

    The 0.26-0.32 machine's restrictions, nothing more (reasons in CONFORMANCE.md):
    EARLY-FINISH-SIGNAL (these releases signal the manager and drop a finished request at
    `request_finished`, before its final store: no finish or abort events, a drain that does
    not finish requests), WHOLE-PROMPT-HIT (no admission of a request whose last chunk is in
    the CPU tier: the lookup may offer the whole block-aligned prompt) and PREEMPTED-LOAD (no
    preemption of a request holding a load, no admission in the step that reports its
    preemption); no sync loads. Requests share prefixes (loads, deferred lookups) and are
    preempted; resets, partial, complete and late acks: the paths of the #48102 bug.
    """

    bounds_choices: ClassVar[tuple[M.Bounds, ...]] = (
        M.Bounds(requests=2, tokens=2, shared_prefix=False, workers=2, cpu_chunks=3,
                 gpu_blocks=4, resets=2, failures=0, preemptions=0),
        M.Bounds(requests=2, tokens=2, workers=2, cpu_chunks=3, gpu_blocks=4, resets=2,
                 failures=0, preemptions=2),
        M.Bounds(requests=3, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=6, resets=2,
                 failures=0, preemptions=2),
    )
    """Own prefixes and no preemption (the #48102 path alone), then shared prefixes with
    preemptions (loads, deferred lookups, preempted flushes)."""
    DRAIN_FINISHES: ClassVar[bool] = False

    @initialize(which=st.integers(0, 100), swarm=st.sets(st.sampled_from(VLLM025_SWARM),
                                                         min_size=2))
    def start(self, which: int, swarm: set[str]) -> None:
        type(self).runs += 1
        OffloadingStateMachine.start(self, which, swarm)


class Deferred(Exception):
    """vLLM deferred a lookup the model answers (the liveness machine's adapter)."""

    def __init__(self, req_id: str, held: tuple[int, ...]) -> None:
        super().__init__(req_id, held)
        self.req_id, self.held = req_id, held


class VLLM025LivenessAdapter(VLLMAdapter):
    """The adapter of `VLLM025LivenessMachine`: a lookup that vLLM defers where the model
    answers raises `Deferred` (nothing else of the step is called), so that the machine can
    let the request wait instead of failing the comparison of the answers."""

    def call(self, call: M.Call) -> Any:
        got = super().call(call)
        if (call.hook == "get_num_new_matched_tokens" and got[0] is None
                and call.answer is not None and call.answer[0] is not None):
            req_id = call.args[0]
            self.admitted.discard(req_id)
            self.step_open = False
            st_ = self.scheduler._req_status.get(req_id)
            raise Deferred(req_id, tuple(sorted(st_.transfer_jobs)) if st_ else ())
        return got


class VLLM025LivenessMachine(VLLM025Machine):
    """`VLLM025Machine` checking liveness alone: no refinement, no invariants, only vLLM's
    own asserts and the drain (every report delivered, steps, then every waiting request
    admitted), asking that no request is left holding a job and that every waiting request
    runs again. It shows that the #48102 state is a hang or a crash, found as such, not only
    an invariant. A lookup that vLLM defers where the model answers is not a failure in the
    run (the request waits, the model does not take the step); in the drain, with every
    report delivered, it is: the request never runs again."""

    adapter_factory: ClassVar[type] = VLLM025LivenessAdapter
    CHECK_REFINEMENT: ClassVar[bool] = False
    CHECK_INVARIANTS_FIRST: ClassVar[bool] = False
    CHECK_EVERY_HOOK: ClassVar[bool] = False

    found: ClassVar[dict[str, tuple[list[str], str]]] = {}
    """Each distinct failure (by where it was raised) with its trace: hypothesis replays
    each shrunk failure last."""

    def invariants_hold(self) -> None:
        """Not an invariant here (liveness alone)."""

    def _step(self, ev: M.Event) -> None:
        trace, events = list(self.trace), list(self.events)
        try:
            super()._step(ev)
        except Deferred:
            self.trace, self.events = trace, events  # the model does not take the step

    def _record_failure(self, exc: BaseException) -> None:
        if isinstance(exc, Deferred):
            return
        if self.failure is None:
            frames = traceback.extract_tb(exc.__traceback__)
            where = type(exc).__name__
            if frames:
                path = "/".join(frames[-1].filename.split("/")[-2:])
                where += f" at {path}:{frames[-1].lineno} ({frames[-1].name})"
            type(self).found[where] = (list(self.trace), f"{type(exc).__name__}: {exc}")
        super()._record_failure(exc)

    def _drain_without_finishing(self) -> None:
        """Deliver every report and step; admit every waiting request in turn (each then
        runs, its reports delivered); then nothing may be left."""
        if self.model is None:
            return
        self._deliver_and_step()
        for _ in range(20):
            admit = [e for e in self._possible() if e.kind == "step" and e.req is not None
                     and self.allows("step", e)]
            if not admit:
                break
            try:
                VLLMMachine._step(self, admit[0])
            except Deferred as d:
                raise AssertionError(
                    f"request {d.req_id!r} never runs again: with every report delivered, "
                    f"vLLM defers its lookup (it holds job ids {list(d.held)}, live jobs "
                    f"{sorted(self.impl.scheduler._jobs)})") from None
            self._deliver_and_step()
        self._nothing_left()


def machine_for(version: tuple[int, int, int]) -> type[VLLMMachine]:
    """The machine for a vLLM version: releases with the fix of PR #48102 (0.26+) have the
    lifecycle the spec describes; earlier ones (0.22-0.25) the narrower `VLLM025Machine`."""
    return VLLMMachine if releases.has("fix_48102", version) else VLLM025Machine


__all__ = [
    "BLOCK_SIZE",
    "FINISHES_AS_THE_SPEC",
    "RELEASE_FAILURES",
    "RELEASE_RULES",
    "RELEASE_SWARM",
    "VLLM025_SWARM",
    "VLLM_SWARM",
    "Deferred",
    "VLLM025LivenessAdapter",
    "VLLM025LivenessMachine",
    "VLLM025Machine",
    "VLLMAdapter",
    "VLLMMachine",
    "block_tokens",
    "dropped_for_release",
    "features_needed",
    "for_release",
    "machine_for",
    "program_rules",
    "release_bounds",
    "unfailable_in_vllm",
]
