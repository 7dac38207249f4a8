"""`kvspec simulate`: a seeded workload through engine, connector, workers and kernels.

Requests share prompt prefixes (so lookups hit and chunks are loaded back), arrive over
`steps` steps and are long enough that GPU blocks run out (preemption). Mid-run the prefix
cache is reset (twice: once preempting the running requests, once not), a few requests are
aborted (preferably while their load is in flight), load and store copies are made to fail
on one worker, and one worker hangs on an async load until the job timeout has released
its request. Then the engine drains. Everything is decided by the seed.

The result says what happened, and the three numbers that must be zero: requests stuck (not
finished when the run drained), resources leaked (pinned or write-pending chunks, GPU blocks
not back in the pool, quarantined slots or blocks, jobs or tracked requests left) and
corrupted bytes (the oracle's verdict on every load and every finished request).

With tiers (`SimConfig.tiers`, `kvspec simulate --tiers cpu,fs`), secondary tiers stack below
a CPU tier small enough (`TIER_CPU_CHUNKS` slots) that chunks are evicted from it and come
back later by promotions from a tier: GPU -> CPU -> tiers on every store, tier -> CPU -> GPU
on a lookup that misses the CPU tier (statemachine.tiering.connector). The tiers' I/O runs
once per step (`Engine._run_tier_io`; or on threads, `tier_threads`); the "fs" tiers write
files under a temporary directory, removed at the end unless `keep_tier_dir`. Every copy a
cascade publishes and every copy a promotion reads is checked against its key's blocks
(`statemachine.tiering.copy_oracle`), and so is every block loaded from a promoted chunk (as
every load). Tier faults join the others (`TierFaults`): I/O errors in cascades and in
promotions (the first one after some copies: a partial promotion), the first tier full for a
while (every cascade refused), a tier hung for longer than the tier job timeout (its jobs
time out, their late results come after it resumes), the last time across the first reset
(its jobs in flight become stale). Leaked then also counts tier jobs, cascade pins,
quarantined slots, open tiering requests, pending tier I/O, temporary files and the tiering
manager's inconsistencies.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from spec.rules import VLLM_0_33, Rules
from spec.tiering import tier_job as TJ
from statemachine.config import KV_CACHE_MODELS, TieringConfig
from statemachine.engine import Engine, EngineConfig
from statemachine.errors import KVSpecError
from statemachine.messages import OffloadingConnectorMetadata, RequestStatus
from statemachine.oracle import CorruptedBytes

from kernels import KernelSpecError  # isort: skip


@dataclass(frozen=True)
class SimConfig:
    seed: int = 1
    model: str = "full"
    """A key of `statemachine.config.KV_CACHE_MODELS`."""
    steps: int = 240
    """Steps during which requests arrive and faults are injected; the drain follows."""
    workers: int = 2
    requests: int | None = None
    """Requests in the workload (default: steps / 2)."""
    check_invariants: bool = True
    max_drain_steps: int = 600
    job_timeout_steps: int = 6
    device: str = "cpu"
    """Where the GPU KV lives. The CPU stand-in (copies run when polled or waited for) makes
    a run a function of its seed; on "cuda" copies complete when the GPU is done."""
    tiers: tuple[str, ...] = ()
    """Secondary tiers below the CPU tier, in lookup order ("memory", "fs"); empty: the CPU
    tier alone, of 64 chunks."""
    tier_threads: int = 0
    """I/O threads per tier; 0: the tiers' I/O runs once per step, deterministically."""
    tier_job_timeout_steps: int = 4
    tier_root: str | None = None
    """Where the "fs" tiers write; None: a temporary directory."""
    keep_tier_dir: bool = False
    """Keep the tiers' directory after the run (else it is removed)."""
    monitor_log: str | None = None
    """Write the spec monitor's event log of the connector's hooks here (`kvspec replay`
    checks it); None: none."""
    tier_protect_scanned_keys: bool = True
    """False: vLLM's promotions, which may evict the chunks their own lookup just hit
    (`TieringConfig.protect_scanned_keys`, finding T1)."""
    rules: Rules = VLLM_0_33
    """The connector's rules (`EngineConfig.rules`): 0.33.0's, or a later release's
    (`kvspec simulate --rules 0.34`)."""

    def engine_config(self, tier_root: str | None = None) -> EngineConfig:
        model = KV_CACHE_MODELS[self.model]
        tiering = None
        if self.tiers:
            tiering = TieringConfig(self.tiers, root=tier_root or self.tier_root,
                                    job_timeout_steps=self.tier_job_timeout_steps,
                                    threads=self.tier_threads,
                                    protect_scanned_keys=self.tier_protect_scanned_keys)
        return EngineConfig(
            groups=model.groups, group_bytes_per_token=model.bytes_per_token,
            block_size=16, blocks_per_chunk=2, num_gpu_blocks=64,
            num_cpu_chunks=TIER_CPU_CHUNKS if self.tiers else 64,
            num_workers=self.workers, num_layers=2, bytes_per_token=4,
            max_num_batched_tokens=160, max_num_running=12,
            sync_load_budget_bytes=96 * 4 * 2 * self.workers,
            job_timeout_steps=self.job_timeout_steps,
            check_invariants=self.check_invariants, verify_on_finish=True,
            device=self.device, tiering=tiering, rules=self.rules)

    @property
    def num_requests(self) -> int:
        return self.requests if self.requests is not None else max(4, self.steps // 2)


TIER_CPU_CHUNKS = 16
"""CPU tier slots of a run with tiers: a quarter of the default, so chunks the workload
shares are evicted between their uses and promoted back from a tier."""


@dataclass(frozen=True)
class Arrival:
    step: int
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Workload:
    arrivals: list[Arrival]
    resets: dict[int, bool]
    """step -> reset_running_requests."""
    aborts: list[int]
    fail_loads: list[tuple[int, int]]
    """(step, worker): from that step, fail the next load on that worker."""
    fail_stores: list[tuple[int, int]]
    hangs: list[tuple[int, int, bool]]
    """(step, worker, sync): from that step, that worker hangs on the next load of that kind
    (its report is withheld until well after the job timeout)."""
    fail_and_hang: list[int]
    """From that step, the next async load fails on worker 0 while the last worker hangs on
    it for a few steps: placed just before a reset, it is orphaned by the reset."""
    stalls: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, worker, steps): from that step, no copy of that worker completes for that many
    steps (a busy copy stream): stores stay in flight while the core frees and reuses
    blocks, so only the fences keep their sources intact."""
    tier_fails: list[tuple[int, int, str]] = field(default_factory=list)
    """(step, tier, "cascade" or "promotion"): from that step, the next job of that kind on
    that tier fails with an I/O error (a promotion of several keys after its first copy)."""
    tier_full: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, tier, steps): the tier is full (holds no more copies than now) for that many
    steps: its cascades are refused."""
    tier_hangs: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, tier, steps): the tier runs no I/O for that many steps."""
    tier_resets: list[int] = field(default_factory=list)
    """From that step, reset the cache (not the running requests) as soon as a hung tier
    has a job in flight (dropped if no tier is hung any more)."""


def make_workload(cfg: SimConfig) -> Workload:
    rng = random.Random(cfg.seed)
    steps, n = cfg.steps, cfg.num_requests
    families = [tuple(rng.randrange(1, 30_000) for _ in range(32 * rng.choice((2, 3, 3, 4))))
                for _ in range(5)]
    arrivals: list[Arrival] = []
    window = max(1, int(steps * 0.85))
    for i in range(n):
        step = min(window - 1, i * window // n + rng.randrange(0, 3))
        if arrivals and rng.random() < 0.2:
            prompt = rng.choice(arrivals).prompt  # an exact repeat: a long hit
        else:
            suffix = tuple(rng.randrange(1, 30_000) for _ in range(rng.randrange(4, 72)))
            prompt = rng.choice(families) + suffix
        arrivals.append(Arrival(step, f"req-{i:04d}", prompt, rng.randrange(4, 32)))
    arrivals.sort(key=lambda a: a.step)
    w = workers = cfg.workers
    last = len(cfg.tiers) - 1
    tier_faults: dict[str, Any] = {} if not cfg.tiers else {
        "tier_fails": [(k * steps // 12, (k // 2) % len(cfg.tiers),
                        "cascade" if k % 2 else "promotion") for k in range(2, 11)],
        "tier_full": [(steps // 10, 0, max(4, steps // 8))],
        "tier_hangs": [((5 * steps) // 16, last, cfg.tier_job_timeout_steps + 4),
                       ((7 * steps) // 12, last, max(cfg.tier_job_timeout_steps + 4,
                                                     steps // 8))],
        "tier_resets": [(7 * steps) // 12 + 1],
    }
    return Workload(
        arrivals=arrivals,
        resets={steps // 2: True, (3 * steps) // 4: False},
        aborts=sorted(rng.sample(range(steps // 10, steps), k=max(1, n // 25))),
        fail_loads=[(steps // 5, 1 % w), (steps // 3, 0), ((2 * steps) // 3, (w - 1))],
        fail_stores=[(steps // 4, 0), ((4 * steps) // 5, 1 % workers)],
        hangs=[(steps // 8, 0, False), ((3 * steps) // 5, (w - 1), True)],
        fail_and_hang=[max(0, steps // 2 - 4)] if w > 1 else [],
        stalls=[(steps // 6, 0, 4), ((5 * steps) // 12, w - 1, 4), ((7 * steps) // 8, 0, 4)],
        **tier_faults,
    )


@dataclass
class Faults:
    """The fault hook: arms faults at their steps and fires each on the next fitting job."""

    workload: Workload
    release_after: int
    injected_failures: int = 0
    hung_jobs: list[int] = field(default_factory=list)
    stalls: int = 0
    _armed: list[tuple[str, int]] = field(default_factory=list)

    def __call__(self, engine: Engine, meta: OffloadingConnectorMetadata) -> None:
        step = engine.step_index
        wl = self.workload
        self._armed += [("load", w) for s, w in wl.fail_loads if s == step]
        self._armed += [("store", w) for s, w in wl.fail_stores if s == step]
        self._armed += [("hang-sync" if sync else "hang-async", w)
                        for s, w, sync in wl.hangs if s == step]
        self._armed += [("fail-hang", 0) for s in wl.fail_and_hang if s == step]
        for s, worker, steps in wl.stalls:
            if s == step:
                engine.workers[worker].stall(steps)
                self.stalls += 1
        still: list[tuple[str, int]] = []
        for kind, worker in self._armed:
            if kind == "store":
                jobs = sorted(meta.store_jobs)
            else:
                jobs = sorted(j for j, job in meta.load_jobs.items()
                              if kind == "load" or job.sync == (kind == "hang-sync"))
            if not jobs:
                still.append((kind, worker))
            elif kind == "fail-hang":
                engine.workers[0].fail_job(jobs[0])
                engine.workers[-1].hang_job(jobs[0], release_after=self.release_after)
                self.injected_failures += 1
                self.hung_jobs.append(jobs[0])
            elif kind.startswith("hang"):
                engine.workers[worker].hang_job(jobs[0], release_after=self.release_after)
                self.hung_jobs.append(jobs[0])
            else:
                engine.workers[worker].fail_job(jobs[0])
                self.injected_failures += 1
        self._armed = still


@dataclass
class TierFaults:
    """The tiers' faults: `between_steps` hangs and resumes tiers, fills one and frees it
    again, and arms I/O errors; called right before each step's tier I/O (an engine
    `tier_io_hooks` entry), it makes an armed error fail the next job of its kind: the
    queued tasks then are the step's, in submission order, so the tier's first submitted
    job is the one its next task runs (only while the tier is neither hung nor has a
    timed-out job whose task may still be queued ahead)."""

    workload: Workload
    injected: Counter[str] = field(default_factory=Counter)
    """I/O errors armed, by the kind of job they were armed for."""
    hangs: int = 0
    full_windows: int = 0
    resets: int = 0
    """Resets done while a hung tier had jobs in flight."""
    _reset_armed: int = 0
    _hung_until: dict[int, int] = field(default_factory=dict)
    _full_until: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    _armed: list[tuple[int, str]] = field(default_factory=list)

    def between_steps(self, engine: Engine, step: int) -> None:
        assert engine.tiering is not None
        tiers = engine.tiering.tiers
        for t, until in sorted(self._hung_until.items()):
            if step >= until:
                tiers[t].unhang()
                del self._hung_until[t]
        for t, (until, capacity) in sorted(self._full_until.items()):
            if step >= until:
                tiers[t].capacity = capacity
                del self._full_until[t]
        wl = self.workload
        for s, t, steps in wl.tier_hangs:
            if s == step and t not in self._hung_until:
                tiers[t].hang()
                self._hung_until[t] = step + steps
                self.hangs += 1
        for s, t, steps in wl.tier_full:
            if s == step and t not in self._full_until:
                self._full_until[t] = (step + steps, tiers[t].capacity)
                tiers[t].capacity = len(tiers[t].copy_states())  # stored and being written
                self.full_windows += 1
        self._armed += [(t, kind) for s, t, kind in wl.tier_fails if s == step]
        self._reset_armed += sum(1 for s in wl.tier_resets if s == step)

    def reset_now(self, engine: Engine) -> bool:
        """Whether an armed reset is due: a hung tier has a job in flight (one is dropped
        when no tier is hung)."""
        m = engine.tiering
        assert m is not None
        if not self._reset_armed:
            return False
        if not self._hung_until:
            self._reset_armed -= 1
            return False
        if any(j.state == TJ.SUBMITTED and m.tiers[j.tier].hung for j in m.jobs()):
            self._reset_armed -= 1
            self.resets += 1
            return True
        return False

    def __call__(self, engine: Engine) -> None:
        m = engine.tiering
        assert m is not None
        still: list[tuple[int, str]] = []
        for t, kind in self._armed:
            tier = m.tiers[t]
            first = min((j for j in m.jobs() if j.tier == t and j.state == TJ.SUBMITTED
                         and j.job_id is not None),
                        key=lambda j: j.job_id or 0, default=None)
            if tier.hung or t in m.suspect_tiers or first is None or first.kind != kind:
                still.append((t, kind))
                continue
            tier.fail_next(1, after=1 if first.is_promotion and len(first.keys) > 1 else 0)
            self.injected[kind] += 1
        self._armed = still


@dataclass
class SimResult:
    config: SimConfig
    steps: int = 0
    drain_steps: int = 0
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, int] = field(default_factory=dict)
    stuck: list[str] = field(default_factory=list)
    corrupted: int = 0
    error: str | None = None
    """Set when an error stopped the run: stuck and leaked were then not measured."""

    @property
    def stopped(self) -> bool:
        return self.error is not None

    @property
    def leaked(self) -> int:
        return sum(self.leaks.values())

    @property
    def ok(self) -> bool:
        return not self.stuck and not self.leaked and not self.corrupted and not self.stopped

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.config.seed, "workers": self.config.workers,
            "steps": self.steps, "drain_steps": self.drain_steps,
            "seconds": round(self.seconds, 3), **self.metrics,
            "stuck_requests": None if self.stopped else len(self.stuck), "stuck": self.stuck,
            "leaked": None if self.stopped else self.leaked, "leaks": self.leaks,
            "corrupted_bytes": self.corrupted, "error": self.error, "ok": self.ok,
        }


Progress = Callable[[int, int, Engine], None]
"""Called after every step with (steps done, steps of the run, engine); past the run's steps
the engine is draining."""


class ProgressBar:
    """A carriage-return progress line on `stream`, redrawn at most every `interval` seconds;
    `close()` draws the last state and ends the line."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30,
                 interval: float = 0.1) -> None:
        self.stream, self.width, self.interval = stream, width, interval
        self._last = -interval
        self._line = ""

    def __call__(self, done: int, total: int, engine: Engine) -> None:
        filled = self.width * min(done, total) // max(total, 1)
        where = f"step {done}/{total}" if done <= total else f"draining ({done - total})"
        self._line = (f"\r[{'#' * filled}{'.' * (self.width - filled)}] {where}  finished "
                      f"{engine.stats['finished']}/{engine.stats['requests_added']}  running "
                      f"{len(engine.running)}  waiting {len(engine.waiting)}    ")
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self.stream.write(self._line)
            self.stream.flush()

    def close(self) -> None:
        if self._line:
            self.stream.write(self._line + "\n")
            self.stream.flush()


def progress_bar(stream: TextIO = sys.stderr) -> ProgressBar:
    return ProgressBar(stream)


def run(cfg: SimConfig, progress: Progress | None = None) -> SimResult:
    tier_dir: str | None = None
    if cfg.tiers and cfg.tier_root is None:
        tier_dir = tempfile.mkdtemp(prefix="kvspec_simulate_tiers_")
    try:
        return _run(cfg, progress, tier_dir)
    finally:
        if tier_dir is not None and not cfg.keep_tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)


def _run(cfg: SimConfig, progress: Progress | None, tier_dir: str | None) -> SimResult:
    result = SimResult(cfg)
    workload = make_workload(cfg)
    engine = Engine(cfg.engine_config(tier_dir))
    recorder = None
    if cfg.monitor_log:
        from statemachine.monitor.log import Header, LogWriter
        from statemachine.monitor.recorder import HookRecorder

        recorder = HookRecorder(engine.scheduler, LogWriter(cfg.monitor_log, Header(
            vllm="the reference scheduler", num_workers=cfg.workers, mode="log")))
    faults = Faults(workload, release_after=cfg.job_timeout_steps + 3)
    engine.fault_hooks.append(faults)
    tier_faults = TierFaults(workload) if engine.tiering is not None else None
    if tier_faults is not None:
        engine.tier_io_hooks.append(tier_faults)
    rng = random.Random(cfg.seed * 7919 + 1)
    arrivals = list(workload.arrivals)
    aborts = list(workload.aborts)
    t0 = time.perf_counter()
    try:
        for step in range(cfg.steps):
            if tier_faults is not None:
                tier_faults.between_steps(engine, step)
            while arrivals and arrivals[0].step <= step:
                a = arrivals.pop(0)
                engine.add_request(a.req_id, a.prompt, a.max_tokens)
            if step in workload.resets:
                engine.reset_prefix_cache(reset_running_requests=workload.resets[step],
                                          reset_connector=True)
            if tier_faults is not None and tier_faults.reset_now(engine):
                engine.reset_prefix_cache(reset_running_requests=False, reset_connector=True)
            while aborts and aborts[0] <= step:
                aborts.pop(0)
                _abort_one(engine, rng)
            engine.step()
            result.steps += 1
            if progress is not None:
                progress(result.steps, cfg.steps, engine)
        for a in arrivals:  # a late arrival after the window: still served
            engine.add_request(a.req_id, a.prompt, a.max_tokens)
        while engine.has_pending_work() and result.drain_steps < cfg.max_drain_steps:
            if tier_faults is not None:  # a tier hung near the end resumes
                tier_faults.between_steps(engine, cfg.steps + result.drain_steps)
            engine.step()
            result.drain_steps += 1
            if progress is not None:
                progress(result.steps + result.drain_steps, cfg.steps, engine)
    except CorruptedBytes as exc:
        result.corrupted = max(1, engine.stats["corrupted_blocks"])
        result.error = str(exc)
    except (KVSpecError, KernelSpecError) as exc:  # a transfer spec the kernels refuse too
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - t0
    if not result.stopped:
        result.stuck = sorted(engine.requests)
        result.leaks = dict(engine.leaks())
    result.metrics = _metrics(engine, faults, result.seconds)
    if tier_faults is not None:
        result.metrics["tiering"] = _tier_metrics(engine, tier_faults, tier_dir or cfg.tier_root)
    if recorder is not None:
        recorder.close()
    engine.shutdown()
    return result


def _abort_one(engine: Engine, rng: random.Random) -> None:
    loading = [r for r in engine.requests.values()
               if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    pool = loading or list(engine.requests.values())
    if pool:
        engine.abort(rng.choice(sorted(pool, key=lambda r: r.seq)).id)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _metrics(engine: Engine, faults: Faults, seconds: float) -> dict[str, Any]:
    st, sc = engine.stats, engine.scheduler.stats
    return {
        "requests_added": st["requests_added"],
        "requests_finished": st["finished"] - st["aborted"],
        "requests_aborted": st["aborted"],
        "lookups": sc["lookups"],
        "lookup_hits": sc["lookup_hits"],
        "loads": sc["loads"],
        "stores": sc["stores"],
        "bytes_loaded": st["bytes_loaded"],
        "bytes_stored": st["bytes_stored"],
        "load_gbps": _gbps(st["bytes_loaded"], engine.seconds["load"]),
        "store_gbps": _gbps(st["bytes_stored"], engine.seconds["store"]),
        "preemptions": st["preemptions"] + st["preemptions_by_reset"],
        "recomputes": st["recomputes"],
        "resets": st["resets"],
        "injected_failures": faults.injected_failures,
        "failed_jobs": sc["failed_jobs"],
        # the connector marks them (the spec's rule), or the core recomputes them on the
        # ranks' failed_recving (0.34.0's, Rules.stale_load_failure FENCE_ONLY)
        "orphaned_loads_failed": sc["orphaned_loads_failed"] + st["failed_recving_recomputes"],
        "orphaned_loads_failed_left_to_the_core": st["failed_recving_recomputes"],
        "orphaned_loads_promoted": sc["orphaned_loads_promoted"],
        "stores_with_gaps": st["stores_with_gaps"],
        "states_handed_off": st["states_handed_off"],
        "quarantined_blocks_already_freed": st["quarantined_blocks_already_freed"],
        "hung_jobs": len(faults.hung_jobs),
        "stalls": faults.stalls,
        "timeouts": sc["timed_out_jobs"],
        "loaded_blocks_verified": st["loaded_blocks_verified"],
        "stored_blocks_verified": st["stored_blocks_verified"],
        "computed_blocks_verified": st["computed_blocks_verified"],
        "tokens_computed": st["tokens_computed"],
        "steps_per_second": round((st["steps"]) / seconds, 1) if seconds > 0 else 0.0,
        "groups": [_group_metrics(engine, g) for g in range(engine.config.num_groups)],
    }


def _tier_metrics(engine: Engine, faults: TierFaults, tier_dir: str | None) -> dict[str, Any]:
    m, oracle, st = engine.tiering, engine.copy_oracle, engine.stats
    assert m is not None
    tm = m.stats

    def tiers_sum(name: str) -> int:
        return sum(t.stats[name] for t in m.tiers)

    return {
        "tiers": ",".join(("cpu", *(t.kind for t in m.tiers))),
        "cpu_tier_chunks": m.num_slots,
        "tier_threads": engine.config.tiering.threads if engine.config.tiering else 0,
        "promotions": tm["promotions"],
        "promoted_keys": tm["promoted_keys"],
        "promotion_failures": tm["promotion_failures"],
        "promotion_failed_keys": tm["promotion_failed_keys"],
        "promoted_loads": st["tier_promoted_loads"],
        "promoted_blocks_verified": st["tier_promoted_blocks_verified"],
        "promoted_copies_verified": oracle.stats["promoted_copies_verified"] if oracle else 0,
        "cascades": tm["cascades"],
        "cascaded_keys": tm["cascaded_keys"],
        "cascade_failures": tm["cascade_failures"],
        "copies_written": tiers_sum("copies_written"),
        "copies_written_verified": oracle.stats["copies_written_verified"] if oracle else 0,
        "tier_evictions": tm["tier_evictions"],
        "evictions_without_copy": tm["evictions_without_copy"],
        "tier_lookup_hits": tm["tier_hits"],
        "lookups_deferred": engine.scheduler.stats["lookups_deferred"],
        "tier_resets": tm["resets"],
        "resets_with_a_hung_tier": faults.resets,
        "stale_tier_jobs": tm["stale"],
        "injected_tier_failures": sum(faults.injected.values()),
        "injected_cascade_failures": faults.injected["cascade"],
        "injected_promotion_failures": faults.injected["promotion"],
        "full_tier_windows": faults.full_windows,
        "copies_refused_by_a_full_tier": tiers_sum("refused"),
        "tier_hangs": faults.hangs,
        "tier_timeouts": tm["timeouts"],
        "late_tier_results": tm["late_results"],
        "connector_store_timeouts": tm["connector_quarantined_stores"],
        "tier_dir": tier_dir if any(t.kind == "fs" for t in m.tiers) else None,
    }


GROUP_METRICS = ("loads", "stores", "jobs_failed", "jobs_made_stale_by_reset",
                 "blocks_freed_by_preemption", "blocks_freed_before_window",
                 "loaded_blocks_verified", "stored_blocks_verified", "computed_blocks_verified")
"""What a run did in each KV cache group: jobs with blocks of the group (shipped loads and
stores, failed on a rank, made stale by a reset), blocks freed (by a preemption, by the
sliding window) and blocks the byte oracle checked."""


def _group_metrics(engine: Engine, group: int) -> dict[str, Any]:
    g = engine.config.groups[group]
    stats = engine.group_stats[group]
    return {"group": group, "kind": g.kind, "sliding_window": g.sliding_window,
            "page_bytes": engine.config.block_size * engine.config.bytes_per_token_of(group),
            **{name: stats[name] for name in GROUP_METRICS}}


def exercised_everywhere(result: SimResult) -> list[str]:
    """What the run did not exercise in some group (empty: loads, stores, failures, resets
    and preemptions all touched every group)."""
    missing = []
    for g in result.metrics.get("groups", []):
        for name in ("loads", "stores", "jobs_failed", "jobs_made_stale_by_reset",
                     "blocks_freed_by_preemption", "loaded_blocks_verified",
                     "stored_blocks_verified"):
            if not g[name]:
                missing.append(f"group {g['group']}: no {name.replace('_', ' ')}")
    return missing


def _kind(g: dict[str, Any]) -> str:
    if g["kind"] == "sliding":
        return f"sliding window {g['sliding_window']}, page {g['page_bytes']} B"
    if g["kind"] == "mamba":
        return f"Mamba state, page {g['page_bytes']} B"
    return f"full attention, page {g['page_bytes']} B"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _tier_rows(t: dict[str, Any], cfg: SimConfig) -> list[tuple[str, str]]:
    where = "deterministic, once per step" if not t["tier_threads"] else \
        f"{t['tier_threads']} I/O thread(s) per tier"
    kept = ("" if t["tier_dir"] is None else
            f"; files in {t['tier_dir']}" + (" (kept)" if cfg.keep_tier_dir else " (removed)"))
    return [
        ("tiers", f"{t['tiers']}: a CPU tier of {t['cpu_tier_chunks']} chunks; tier I/O "
                  f"{where}{kept}"),
        ("promotions", f"{t['promotions']} jobs, {t['promoted_keys']} chunks promoted "
                       f"({t['tier_lookup_hits']} tier hits, {t['lookups_deferred']} lookups "
                       f"deferred); {t['promotion_failures']} failed "
                       f"({t['promotion_failed_keys']} chunks)"),
        ("promoted loads", f"{t['promoted_loads']} loads of promoted chunks, "
                           f"{t['promoted_blocks_verified']} blocks checked"),
        ("cascades", f"{t['cascades']} jobs, {t['cascaded_keys']} chunks, "
                     f"{t['copies_written']} copies written; {t['cascade_failures']} failed"),
        ("tier evictions", f"{t['tier_evictions']} CPU evictions of chunks a tier holds "
                           f"({t['evictions_without_copy']} of chunks no tier holds)"),
        ("tier resets", f"{t['tier_resets']}, {t['resets_with_a_hung_tier']} while a tier hung "
                        f"({t['stale_tier_jobs']} tier jobs in flight made stale)"),
        ("tier failures", f"{t['injected_tier_failures']} injected I/O errors "
                          f"({t['injected_cascade_failures']} cascades, "
                          f"{t['injected_promotion_failures']} promotions); "
                          f"{t['copies_refused_by_a_full_tier']} copies refused by a full "
                          f"tier ({t['full_tier_windows']} window(s))"),
        ("tier timeouts", f"{t['tier_timeouts']} tier jobs timed out ({t['tier_hangs']} tier "
                          f"hangs), {t['late_tier_results']} late results drained"),
        ("copies checked", f"{t['copies_written_verified']} written, "
                           f"{t['promoted_copies_verified']} promoted"),
    ]


def render(result: SimResult) -> str:
    m = result.metrics
    cfg = result.config
    rows: list[tuple[str, str]] = [
        ("requests", f"{m['requests_added']} added, {m['requests_finished']} finished, "
                     f"{m['requests_aborted']} aborted"),
        ("lookups", f"{m['lookups']} ({m['lookup_hits']} hits)"),
        ("loads", f"{m['loads']} jobs, {_mb(m['bytes_loaded'])} over all workers, "
                  f"{m['load_gbps']} GB/s"),
        ("stores", f"{m['stores']} jobs, {_mb(m['bytes_stored'])} over all workers, "
                   f"{m['store_gbps']} GB/s"),
        ("preemptions", f"{m['preemptions']} (blocks ran out, or reset)"),
        ("recomputes", f"{m['recomputes']} (a load failed or timed out)"),
        ("resets", str(m["resets"])),
        ("failures", f"{m['injected_failures']} injected, {m['failed_jobs']} jobs failed, "
                     f"{m['orphaned_loads_failed']} reset-orphaned loads failed"
                     + (f" ({m['orphaned_loads_failed_left_to_the_core']} recomputed by the "
                        "core on failed_recving: 0.34.0's rule)"
                        if m["orphaned_loads_failed_left_to_the_core"] else "")),
        ("timeouts", f"{m['timeouts']} jobs timed out ({m['hung_jobs']} hung)"),
        ("stalls", f"{m['stalls']} copy streams stalled for 4 steps"),
        ("bytes checked", f"{m['loaded_blocks_verified']} loaded, "
                          f"{m['stored_blocks_verified']} stored, "
                          f"{m['computed_blocks_verified']} computed blocks"),
        *((f"group {g['group']} ({_kind(g)})",
           f"{g['loads']} loads, {g['stores']} stores, {g['jobs_failed']} failed, "
           f"{g['jobs_made_stale_by_reset']} made stale; blocks freed "
           f"{g['blocks_freed_by_preemption']} by preemption, "
           f"{g['blocks_freed_before_window']} before the window; checked "
           f"{g['loaded_blocks_verified']}/{g['stored_blocks_verified']}/"
           f"{g['computed_blocks_verified']}") for g in m["groups"] if len(m["groups"]) > 1),
        ("stuck requests", str(len(result.stuck))),
        ("leaked", str(result.leaked) + ("" if not result.leaked else " (" + ", ".join(
            f"{k} {v}" for k, v in result.leaks.items() if v) + ")")),
        ("corrupted bytes", str(result.corrupted)),
    ]
    if result.stopped:
        rows[-3:-1] = [(name, f"not measured: the run stopped at step "
                              f"{result.steps + result.drain_steps}")
                       for name in ("stuck requests", "leaked")]
    if "tiering" in m:
        rows[-3:-3] = _tier_rows(m["tiering"], cfg)
    width = max(len(k) for k, _ in rows)
    tiers = f" --tiers {m['tiering']['tiers']}" if "tiering" in m else ""
    head = (f"kvspec simulate --seed {cfg.seed} --model {cfg.model}{tiers}: {cfg.workers} "
            "workers, "
            f"{result.steps} steps "
            f"+ {result.drain_steps} to drain, {result.seconds:.1f} s")
    lines = [head, "", f"{'metric'.ljust(width)}  value", f"{'-' * width}  {'-' * 5}"]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    verdict = "PASS: nothing stuck, leaked or corrupted" if result.ok else "FAIL"
    if result.stuck:
        lines.append(f"\nstuck: {', '.join(result.stuck[:10])}")
    if result.error:
        lines.append(f"\nerror: {result.error}")
    lines.append(f"\n{verdict}")
    return "\n".join(lines)
