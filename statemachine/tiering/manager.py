"""The reference tiering manager: vLLM's `TieringOffloadingManager` (TM:207-1305) over our CPU
manager (`statemachine.manager.CPUOffloadingManager`, vLLM's CPU manager call for call) as the
primary tier, and the secondary tiers of `statemachine.tiering.tiers`.

Data flows through the CPU tier only: a GPU store completes into the CPU tier and *cascades*
to every secondary tier, one job per tier, each pinning the keys it copies (TM:937-1011); a
lookup that misses the CPU tier and hits a secondary tier reserves a CPU slot and queues a
*promotion*, submitted as one job per (tier, request) when the step ends (TM:686-763); the
promoted key is HIT once a poll applied the job (TM:460-549).

Tier jobs and tiering requests are subjects of `transitions` machines built from
`spec.tiering.tier_job` and `spec.tiering.tier_request` (`statemachine.lifecycle`): every
move of one is a row of its table, and a trigger with no row raises `IllegalTransition`. The
CPU tier's chunks and the tiers' copies are not subjects: their states are read off the CPU
manager's reference counts and the tiers (`statemachine.tiering.projection`).

Polls. A poll applies every result the tiers queued. `lookup` polls at most once per step
(the gate, TM:448-458), `prepare_store` always (TM:836-851), `on_schedule_end` through the
gate and then reopens it (TM:1090-1100), `reset_cache` always (TM:1168).

Beyond vLLM:
- a tier job timeout, in steps (``tier_job_timeout_steps``): at `on_schedule_end`, a job
  still SUBMITTED that many steps after the step it entered the table is TIMED_OUT: out of
  the table, a promotion's slots quarantined (neither indexed nor reused), a cascade's pins
  kept, until its late result arrives; that result is discarded and counted (LATE_DRAINED)
  and the quarantine released. The tier is *suspect* meanwhile: lookups skip it, so a hung
  tier cannot start promotion after promotion.
- a reset drains each tier for at most ``reset_drain_timeout_s``; the jobs of a tier still
  busy after that are STALE (quarantined likewise) instead of blocking forever
  (TM:1164-1165).
- quarantined slots are counted per job, so a slot two hung cascades read is freed after
  both late results.
- a result for a job id that is neither in the table nor quarantined raises
  `UnknownTierJob` (vLLM asserts, TM:527-535), after the poll applied the others.
- contract violations raise typed errors before any change: an unknown or finished request,
  `complete_store` after the request was finalized (IllegalTransition of the
  tier_request table: vLLM's KeyError), a `complete_store` with no store pending, or one that
  names a key a promotion writes.

Out of scope (a `ConfigError` if asked for): request-level tiers (TM:866-935) and
back-pressure (TM:551-587); also vLLM's tier-poll thread and external requests (TM:312-428),
which serve remote peers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from spec.tiering import TIER_JOB_MACHINE, TIER_REQUEST_MACHINE
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from statemachine.errors import (
    ConfigError,
    IllegalTransition,
    InvalidArgument,
    UnknownRequest,
    UnknownTierJob,
)
from statemachine.lifecycle import Fired, Lifecycle, Nesting
from statemachine.manager import (
    CPUOffloadingManager,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from statemachine.policies import OffloadKey, PolicyName
from statemachine.tiering.effects import TieringEffects
from statemachine.tiering.models import TierJob, TierRequest
from statemachine.tiering.tiers import JobResult, SecondaryTier

_STAT_NAMES = ("lookups", "primary_hits", "tier_hits", "polls", "promotions_queued",
               "promotions", "promoted_keys", "promotion_failures", "promotion_failed_keys",
               "promotion_allocation_failures", "cascades", "cascaded_keys",
               "cascade_failures", "io_reports", "timeouts", "stale", "late_results",
               "dropped_promotions", "evictions", "resets", "tiers_suspected")


class TieringManager:
    """A CPU primary tier of `num_slots` slots and the secondary `tiers`, in order (a lookup
    promotes from the first tier that hits)."""

    def __init__(self, num_slots: int, tiers: Sequence[SecondaryTier] = (), *,
                 eviction_policy: PolicyName = "lru",
                 tier_job_timeout_steps: int | None = None,
                 protect_scanned_keys: bool = True,
                 reset_drain_timeout_s: float = 0.0,
                 backpressure: bool = False) -> None:
        if tier_job_timeout_steps is not None and (
                isinstance(tier_job_timeout_steps, bool)
                or not isinstance(tier_job_timeout_steps, int) or tier_job_timeout_steps < 1):
            raise ConfigError("tier_job_timeout_steps must be None or an integer >= 1, got "
                              f"{tier_job_timeout_steps!r}")
        if reset_drain_timeout_s < 0:
            raise ConfigError(f"reset_drain_timeout_s must be >= 0, got "
                              f"{reset_drain_timeout_s!r}")
        if backpressure:
            raise ConfigError("back-pressure (TM:551-587) is out of scope of the reference "
                              "tiering manager")
        for i, tier in enumerate(tiers):
            if tier.offload_policy != "chunk":
                raise ConfigError(f"tier {i} ({tier.name}) asks for the request-level policy "
                                  "(TM:866-935), out of scope of the reference tiering "
                                  "manager")
        self.primary = CPUOffloadingManager(num_slots, eviction_policy)
        """The CPU tier (vLLM's CPUPrimaryTierOffloadingManager, TM:114-173)."""
        self.tiers: list[SecondaryTier] = list(tiers)
        self.tier_job_timeout_steps = tier_job_timeout_steps
        self.protect_scanned_keys = protect_scanned_keys
        self._scanned: dict[str, set[OffloadKey]] = {}
        """Per request, the keys its lookups answered HIT or HIT_PENDING this step (a
        promotion evicts none of them: `_promotion_protects`)."""
        self.reset_drain_timeout_s = reset_drain_timeout_s
        self.step = 0
        """Steps ended (on_schedule_end calls)."""
        self._job_id_counter = 0
        self._jobs: dict[int, TierJob] = {}
        """The job table (_jobs, TM:247-252): SUBMITTED and REPORTED jobs."""
        self._pending: dict[int, dict[str, TierJob]] = {}
        """Queued promotions per tier and request (_pending_load_submissions, TM:263-267)."""
        self._quarantined: dict[int, TierJob] = {}
        """TIMED_OUT and STALE jobs, until their late results."""
        self._slot_holds: dict[int, set[int]] = {}
        """Quarantined CPU slot -> the quarantined jobs whose I/O may still touch it."""
        self._promotions_held = False
        self._processed_jobs_this_step = False
        self._requests: dict[str, TierRequest] = {}
        """Open requests (_req_state, TM:273-276)."""
        self._finalized: set[str] = set()
        self._load_sources: dict[str, dict[OffloadKey, int]] = {}
        """Per request, the tier each promoted key came from (TM:278-281)."""
        self._load_pins: Counter[OffloadKey] = Counter()
        """GPU loads in flight per key (for `check_consistency`)."""
        self.stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self.fired: list[Fired] = []
        """Every table row fired, in order (observers may clear it)."""
        nesting = Nesting(observers=[self.fired.append])
        self.effects = TieringEffects(self)
        self._jobs_life = Lifecycle(TIER_JOB_MACHINE, TierJob, self.effects, nesting)
        self._requests_life = Lifecycle(TIER_REQUEST_MACHINE, TierRequest, self.effects,
                                        nesting)

    # ================================================================ introspection
    @property
    def num_slots(self) -> int:
        return self.primary.num_chunks

    @property
    def promotions_held(self) -> bool:
        return self._promotions_held

    @property
    def suspect_tiers(self) -> frozenset[int]:
        """The tiers that hold a timed-out or stale job: lookups skip them until its late
        result arrives (the tier_job table's `suspect_tier`)."""
        return frozenset(j.tier for j in self._quarantined.values())

    def jobs(self) -> list[TierJob]:
        """Queued promotions, the job table, and the quarantined jobs."""
        return self._live_jobs() + list(self._quarantined.values())

    def _live_jobs(self) -> list[TierJob]:
        """Queued promotions and the job table: the jobs whose I/O the CPU tier's index
        still accounts for (write-pending or pinned keys)."""
        queued = [j for by_req in self._pending.values() for j in by_req.values()]
        return queued + list(self._jobs.values())

    def open_requests(self) -> list[TierRequest]:
        return list(self._requests.values())

    def get_load_source(self, key: OffloadKey, ctx: ReqContext) -> int | None:
        """The tier a key the request loads was promoted from; None: the CPU tier
        (TM:677-684)."""
        return self._load_sources.get(ctx.req_id, {}).get(key)

    # ================================================================ requests
    def on_new_request(self, req_id: str) -> ReqContext:
        """(TM:1013-1042) Every tier answers the chunk-level policy here."""
        if req_id in self._requests:
            req = self._requests[req_id]
            raise IllegalTransition(TIER_REQUEST_MACHINE.name, req_id, req.state, "registered",
                                    self._requests_life.allowed(req.state))
        ctx = self.primary.on_new_request(req_id)
        self._requests_life.fire(TierRequest(ctx), "registered")
        return ctx

    def on_request_finished(self, ctx: ReqContext) -> None:
        """The CPU tier commits the request's recency; the tiers are told once no GPU store
        of it is pending (TM:1044-1080)."""
        req = self._request(ctx, "on_request_finished")
        self._require(self._requests_life, req, "finished")
        self.primary.on_request_finished(ctx)
        self._requests_life.fire(req, "finished")

    def _request(self, ctx: ReqContext, hook: str) -> TierRequest:
        """The open request, or IllegalTransition (finalized) / UnknownRequest."""
        req = self._requests.get(ctx.req_id)
        if req is not None:
            return req
        if ctx.req_id in self._finalized:
            return TierRequest(ctx, state=TR.FINALIZED)
        raise UnknownRequest(ctx.req_id, hook)

    @staticmethod
    def _require(life: Lifecycle, subject: Any, trigger: str) -> None:
        """IllegalTransition now, before any change, if `trigger` has no row."""
        if not life.outgoing(subject.state, trigger):
            raise IllegalTransition(life.spec.name, subject.key, subject.state, trigger,
                                    life.allowed(subject.state))

    # ================================================================ lookups and loads
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT, HIT_PENDING, RETRY or MISS (TM:589-675): poll (once per step); the CPU tier
        answers if it holds the key; else, unless promotions are held, the first tier that
        hits starts a promotion (HIT_PENDING; MISS when no CPU slot can be had)."""
        self.stats["lookups"] += 1
        self._maybe_process_finished_jobs()
        answer = self._lookup(key, ctx)
        if answer in (LookupResult.HIT, LookupResult.HIT_PENDING):
            self._scanned.setdefault(ctx.req_id, set()).add(key)
        return answer

    def _lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        answer = self.primary.lookup(key, ctx)
        if answer is not LookupResult.MISS:
            self.stats["primary_hits"] += 1
            return answer
        if self._promotions_held:
            return LookupResult.MISS
        any_retry = False
        for i, tier in enumerate(self.tiers):
            if i in self.suspect_tiers:
                continue
            found = tier.lookup(key, ctx.req_id)
            if found is LookupResult.HIT:
                self.stats["tier_hits"] += 1
                promoted = self._initiate_promotion(i, key, ctx)
                return LookupResult.HIT_PENDING if promoted else LookupResult.MISS
            any_retry |= found is LookupResult.RETRY
        return LookupResult.RETRY if any_retry else LookupResult.MISS

    def _promotion_protects(self, ctx: ReqContext) -> set[OffloadKey]:
        """The keys a promotion's slot must not be taken from: those any request's lookup
        hit this step (the tiering model's rule). vLLM protects the promoted key alone
        (TM:713): a prefix longer than the CPU tier evicts itself round after round and its
        request is deferred forever (finding T1); with the request's own hits protected
        only, two deferred requests still evict each other's promoted chunks every step (the
        data plane found it: a promoted chunk keeps its request's old LRU rank). So the
        protection is step-wide. `protect_scanned_keys=False` is vLLM's behaviour, for the
        conformance tests."""
        if not self.protect_scanned_keys:
            return set()
        return set().union(*self._scanned.values())

    def _initiate_promotion(self, tier: int, key: OffloadKey, ctx: ReqContext) -> bool:
        """Reserve a CPU slot now (the key is HIT_PENDING from here on) and add it to the
        (tier, request) promotion submitted at the end of the step (TM:686-738)."""
        out = self.primary.prepare_store([key], ctx, protect=self._promotion_protects(ctx))
        if out is None or not out.keys_to_store:
            self.stats["promotion_allocation_failures"] += 1
            return False
        self.stats["evictions"] += len(out.evicted_keys)
        job = self._pending.get(tier, {}).get(ctx.req_id)
        if job is None:
            job = TierJob("promotion", tier, ctx)
            self._jobs_life.fire(job, "promotion_queued")
        job.keys.extend(out.keys_to_store)
        job.slots.extend(out.chunk_ids)
        self._load_sources.setdefault(ctx.req_id, {}).update(
            dict.fromkeys(out.keys_to_store, tier))
        self.stats["promotions_queued"] += len(out.keys_to_store)
        return True

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[int, ...]:
        """Pin keys a lookup answered HIT; their CPU slots (TM:765-785)."""
        slots = self.primary.prepare_load(keys, ctx)
        self._load_pins.update(keys)
        return slots

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """(TM:800-812)"""
        self.primary.complete_load(keys, ctx)
        self._load_pins.subtract(keys)
        self._load_pins = +self._load_pins

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Recency in every tier (TM:787-798)."""
        self.primary.touch(keys, ctx)
        for tier in self.tiers:
            tier.touch(keys)

    # ================================================================ stores
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext
                      ) -> PrepareStoreOutput | None:
        """Poll first, so finished cascades and promotions are evictable, then allocate in
        the CPU tier (TM:814-864)."""
        req = self._request(ctx, "prepare_store")
        self._require(self._requests_life, req, "store_prepared")
        self._processed_jobs_this_step = True
        self._process_finished_jobs()
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        self.stats["evictions"] += len(out.evicted_keys)
        if out.keys_to_store:
            self._requests_life.fire(req, "store_prepared", offered=len(out.keys_to_store))
        return out

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext,
                       success: bool = True) -> None:
        """The GPU store landed (or failed): the CPU tier publishes (or frees) the keys, the
        published ones cascade to every tier, one pinning job per tier (TM:937-1011), and
        the request may be finalized (TM:977-983)."""
        req = self._request(ctx, "complete_store")
        self._require(self._requests_life, req, "store_completed")
        if req.pending_stores == 0:
            raise InvalidArgument(f"complete_store for request {ctx.req_id!r}: no GPU store "
                                  "of it is pending (never prepared, already completed, or "
                                  "dropped by a reset)")
        promoting = self._promotion_keys() & set(keys)
        if promoting:
            raise InvalidArgument(f"complete_store for request {ctx.req_id!r}: keys "
                                  f"{sorted(promoting)} are written by a promotion, not by a "
                                  "GPU store")
        ref = self.primary.chunk_ref_counts()
        published = [k for k in dict.fromkeys(keys) if ref.get(k) == -1]
        self.primary.complete_store(keys, ctx, success)
        if success and published:
            for i in range(len(self.tiers)):
                self._create_store_job(published, ctx, i)
        self._requests_life.fire(req, "store_completed")

    def _create_store_job(self, keys: Sequence[OffloadKey], ctx: ReqContext, tier: int
                          ) -> TierJob:
        """Pin the keys (prepare_read) and submit the cascade (TM:985-1011)."""
        slots = self.primary.prepare_read(keys, ctx)
        job = TierJob("cascade", tier, ctx, list(keys), list(slots), pins_held=True)
        self._jobs_life.fire(job, "cascade_created")
        self.stats["cascaded_keys"] += len(keys)
        return job

    def _promotion_keys(self) -> set[OffloadKey]:
        """Keys a queued or running promotion writes."""
        return {k for j in self._live_jobs() if j.is_promotion for k in j.keys}

    # ================================================================ polls
    def _maybe_process_finished_jobs(self) -> None:
        """At most once per step (TM:448-458)."""
        if self._processed_jobs_this_step:
            return
        self._processed_jobs_this_step = True
        self._process_finished_jobs()

    def sync_io_reports(self) -> None:
        """Move the jobs whose I/O finished (their results queued in their tier) from
        SUBMITTED to REPORTED (the table's `io_finished`)."""
        for i, tier in enumerate(self.tiers):
            for job_id in tier.finished_job_ids():
                job = self._jobs.get(job_id)
                if job is not None and job.tier == i and job.state == TJ.SUBMITTED:
                    self._jobs_life.fire(job, "io_finished")

    def run_tier_io(self) -> None:
        """Let every tier's runnable I/O finish (`SecondaryTier.run_io`), then note the
        reports; the results wait for the next poll."""
        for tier in self.tiers:
            tier.run_io()
        self.sync_io_reports()

    def _process_finished_jobs(self) -> None:
        """Apply every queued result (TM:501-549); a late one of a quarantined job is
        discarded. Raises UnknownTierJob after the others were applied."""
        self.stats["polls"] += 1
        unknown: list[tuple[int, int, str]] = []
        for i, tier in enumerate(self.tiers):
            for result in tier.get_finished_jobs():
                why = self._apply(i, result)
                if why:
                    unknown.append((i, result.job_id, why))
        if unknown:
            where, job_id, why = unknown[0]
            raise UnknownTierJob(where, job_id, why, more=len(unknown) - 1)

    def _apply(self, tier: int, result: JobResult) -> str:
        """Apply one result; a reason when its job is not one of `tier`'s."""
        job = self._jobs.get(result.job_id)
        late = job is None
        if job is None:
            job = self._quarantined.get(result.job_id)
        if job is None:
            issued = result.job_id < self._job_id_counter
            return ("its result was already applied" if issued else
                    f"no job with that id was ever created (next id {self._job_id_counter})")
        if job.tier != tier:
            return f"it is a job of tier {job.tier}"
        job.result = result
        if late:
            self._jobs_life.fire(job, "late_result")
            return ""
        if job.state == TJ.SUBMITTED:
            self._jobs_life.fire(job, "io_finished")
        self._jobs_life.fire(job, "polled")
        return ""

    def _complete_promotion(self, job: TierJob, result: JobResult) -> None:
        """Publish the promoted keys and free the failed ones (TM:460-499)."""
        if result.success:
            ok: list[OffloadKey] = list(job.keys)
        else:
            good = set(result.successful_keys or ())
            if not good <= set(job.keys):
                raise InvalidArgument(f"promotion job {job.job_id} of tier {job.tier} "
                                      f"reported keys {sorted(good - set(job.keys))} it was "
                                      "not given")
            ok = [k for k in job.keys if k in good]
        failed = [k for k in job.keys if k not in set(ok)]
        if ok:
            self.primary.complete_store(ok, job.ctx, True)
        if failed:
            self.primary.complete_store(failed, job.ctx, False)
            self._drop_load_sources(job.req_id, failed, job.tier)
        self.stats["promoted_keys"] += len(ok)
        self.stats["promotion_failed_keys"] += len(failed)

    def _drop_load_sources(self, req_id: str, keys: Sequence[OffloadKey], tier: int) -> None:
        sources = self._load_sources.get(req_id)
        if sources is not None:
            for k in keys:
                if sources.get(k) == tier:
                    del sources[k]

    # ================================================================ quarantine
    def _hold_slots(self, job: TierJob, slots: Sequence[int]) -> None:
        """Quarantine `slots` on `job`'s behalf (they are quarantined in the CPU tier)."""
        assert job.job_id is not None
        job.held_slots = tuple(job.held_slots) + tuple(slots)
        for s in slots:
            self._slot_holds.setdefault(s, set()).add(job.job_id)

    def _release_slots(self, job: TierJob) -> None:
        """Give back the job's holds; a slot no other job holds returns to the CPU tier."""
        assert job.job_id is not None
        free: list[int] = []
        for s in job.held_slots:
            holders = self._slot_holds[s]
            holders.discard(job.job_id)
            if not holders:
                del self._slot_holds[s]
                free.append(s)
        job.held_slots = ()
        if free:
            self.primary.release_slots(free)

    def _check_timeouts(self) -> None:
        """SUBMITTED jobs `tier_job_timeout_steps` steps old time out (beyond vLLM)."""
        limit = self.tier_job_timeout_steps
        if limit is None:
            return
        for job in list(self._jobs.values()):
            if job.state == TJ.SUBMITTED and self.step - job.submit_step >= limit:
                self._jobs_life.fire(job, "time_out")
                self.stats["timeouts"] += 1

    # ================================================================ the step
    def on_schedule_end(self) -> None:
        """The last call of a step (TM:1082-1115): poll (through the gate), reopen the gate,
        time jobs out, submit the step's promotions (one job per tier and request), and let
        the tiers send their lookup probes."""
        self._maybe_process_finished_jobs()
        self._processed_jobs_this_step = False
        self._scanned.clear()
        self.sync_io_reports()
        self._check_timeouts()
        self._flush_pending_promotions()
        for tier in self.tiers:
            tier.on_schedule_end()
        self.step += 1

    def _flush_pending_promotions(self) -> None:
        """(TM:740-763)"""
        pending, self._pending = self._pending, {}
        for by_req in pending.values():
            for job in by_req.values():
                self._jobs_life.fire(job, "submitted")

    def has_pending_work(self) -> bool:
        """Jobs in the table or tier work outstanding (TM:1117-1126)."""
        return bool(self._jobs) or any(t.has_pending_work() for t in self.tiers)

    def take_events(self) -> list[OffloadingEvent]:
        """The CPU tier's events, then each tier's (TM:1128-1138)."""
        out = list(self.primary.take_events())
        for tier in self.tiers:
            out.extend(tier.take_events())
        return out

    # ================================================================ resets
    def reset_cache(self) -> None:
        """Drain every tier (at most ``reset_drain_timeout_s`` each), apply the results, make
        the jobs of tiers still busy STALE, drop the queued promotions, finalize finished
        requests, forget the CPU tier (quarantined slots stay quarantined) and hold
        promotions until `on_reset_flushed` (TM:1140-1198)."""
        drained = [tier.drain(self.reset_drain_timeout_s) for tier in self.tiers]
        self.sync_io_reports()
        self._process_finished_jobs()
        for job in list(self._jobs.values()):
            job.tier_is_hung = not drained[job.tier]
            self._jobs_life.fire(job, "stale")
            self.stats["stale"] += 1
        for by_req in list(self._pending.values()):
            for job in list(by_req.values()):
                self._jobs_life.fire(job, "dropped")
        self._load_sources.clear()
        for req in list(self._requests.values()):
            self._requests_life.fire(req, "reset")
        for job in self._quarantined.values():
            if job.pins_held:        # the keys go; their slots stay held for the late I/O
                self._hold_slots(job, job.slots)
                job.pins_held = False
        self.primary.reset_cache(quarantine=set(self._slot_holds))
        self._load_pins.clear()
        self._scanned.clear()
        self._processed_jobs_this_step = False
        self._promotions_held = bool(self.tiers)
        self.stats["resets"] += 1

    def on_reset_flushed(self) -> None:
        """Promotions may fill CPU slots again (TM:1200-1202)."""
        self._promotions_held = False
        self.primary.on_reset_flushed()

    def shutdown(self) -> None:
        """Stop every tier's I/O (TM:1250-1305)."""
        for tier in self.tiers:
            tier.shutdown()

    # ================================================================ invariants
    def check_consistency(self) -> list[str]:
        """Every broken internal invariant, in words; empty when the state is sound."""
        problems = list(self.primary.check_consistency())
        problems += self._check_jobs()
        problems += self._check_pins()
        problems += self._check_requests()
        for tier in self.tiers:
            problems += tier.check_consistency()
        return problems

    def _check_jobs(self) -> list[str]:
        problems: list[str] = []
        for tier, by_req in self._pending.items():
            for req_id, job in by_req.items():
                if job.state != TJ.QUEUED or job.tier != tier or job.req_id != req_id:
                    problems.append(f"queued promotion ({tier}, {req_id}) is {job.state} of "
                                    f"tier {job.tier}, request {job.req_id}")
        for job_id, job in self._jobs.items():
            if job.job_id != job_id or job.state not in TJ.IN_TABLE:
                problems.append(f"job table entry {job_id} is job {job.job_id} in {job.state}")
        for job_id, job in self._quarantined.items():
            if job.job_id != job_id or job.state not in TJ.QUARANTINED:
                problems.append(f"quarantined entry {job_id} is job {job.job_id} in "
                                f"{job.state}")
        if both := self._jobs.keys() & self._quarantined.keys():
            problems.append(f"jobs {sorted(both)} are both in the table and quarantined")
        ids = [j.job_id for j in self.jobs() if j.job_id is not None]
        if any(i >= self._job_id_counter for i in ids):
            problems.append(f"job ids {ids} reach the counter {self._job_id_counter}")
        ref = self.primary.chunk_ref_counts()
        for job in self.jobs():
            if len(job.keys) != len(job.slots) or not job.keys:
                problems.append(f"job {job.key}: keys {job.keys} vs slots {job.slots}")
        for job in self._live_jobs():
            if job.is_promotion:
                for k, s in zip(job.keys, job.slots, strict=False):
                    if ref.get(k) != -1 or self.primary.chunk_id(k) != s:
                        problems.append(f"promotion {job.key} writes key {k} into slot {s}, "
                                        f"but the key is {self.primary.describe(k)}")
        held = {s for j in self._quarantined.values() for s in j.held_slots}
        if set(self._slot_holds) != held:
            problems.append(f"slot holds {sorted(self._slot_holds)} != the quarantined jobs' "
                            f"slots {sorted(held)}")
        if set(self._slot_holds) != self.primary.quarantined_slots:
            problems.append(f"slot holds {sorted(self._slot_holds)} != the CPU tier's "
                            f"quarantined slots {sorted(self.primary.quarantined_slots)}")
        if self._promotions_held and any(j.is_promotion for j in self._live_jobs()):
            problems.append("a promotion is queued or running while promotions are held")
        return problems

    def _check_pins(self) -> list[str]:
        """A pinned key's readers are its GPU loads plus the cascades that hold pins."""
        problems: list[str] = []
        readers: Counter[OffloadKey] = Counter(self._load_pins)
        for job in self.jobs():
            if not job.is_promotion and job.pins_held:
                readers.update(job.keys)
        for key, n in self.primary.chunk_ref_counts().items():
            if n >= 0 and n != readers[key]:
                problems.append(f"key {key} has ref_cnt {n}, but {readers[key]} reader(s) "
                                "hold it")
        for key in readers:
            if key not in self.primary.chunk_ref_counts():
                problems.append(f"key {key} is read but not indexed")
        return problems

    def _check_requests(self) -> list[str]:
        problems: list[str] = []
        for req_id, req in self._requests.items():
            if req.key != req_id or req.state not in TR.OPEN:
                problems.append(f"open request {req_id} is {req.key} in {req.state}")
            if req.pending_stores < 0:
                problems.append(f"request {req_id}: {req.pending_stores} stores pending")
            if req.state == TR.FINISH_PENDING and req.pending_stores == 0:
                problems.append(f"request {req_id} finished, no store pending, not finalized")
        if both := self._requests.keys() & self._finalized:
            problems.append(f"requests {sorted(both)} are both open and finalized")
        return problems


__all__ = ["TieringManager"]
