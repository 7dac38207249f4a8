"""Scheduler-side connector cost per engine step: ours against vLLM 0.33.0's, side by side.

One seeded trace is replayed through `statemachine.OffloadingScheduler` (ours) and through
vLLM 0.33.0's real `OffloadingConnector` in the scheduler role (its
`OffloadingConnectorScheduler` with the real CPU offloading spec and `CPUOffloadingManager`,
built by `conformance.vllm_env`), at 64, 256 and 1,024 active requests.

The trace: N active requests in steady state, one full-attention group, 16-token blocks, one
block per CPU chunk, one worker. Prompts of 64 to 640 tokens; half of them start with one of
N/16 shared prefixes of 128 to 384 tokens, so lookups hit and async loads happen (and a
lookup of chunks another request is loading defers). Prefill in chunks of 128 tokens, then
one token per step for 8 to 96 tokens (the first cohort, admitted at step 0, from 1, so
finishes spread at once); finished requests are replaced the next step. Every job is acked
one step after the metadata that carried it; a loaded request is scheduled the step after
its ack. New full blocks give store jobs every step. Freed GPU blocks are reused in FIFO
order. The CPU cache holds 8 chunks per active request, fewer than a request offers, so the
LRU evicts throughout the run; our manager chooses the same victims as vLLM 0.33.0's (the
differential test tests/conformance/test_manager_vs_vllm.py checks that call for call). The
trace is planned once against our scheduler; every replay checks each
lookup answer against the plan and each step's counts (lookups, hits, deferrals, load and
store jobs, chunks loaded and stored, flushes) against the plan's, so both sides provably
do the same work; any difference aborts (exit 1).

What is timed (process CPU time, `time.process_time_ns`; wall time for a check) per engine
step, on each side: the connector's scheduler-side hooks, called as vLLM's core calls them,
  schedule():           on_new_request (arrivals), get_num_new_matched_tokens (waiting
                        requests) and update_state_after_alloc, in the core's order, then
                        build_connector_meta;
  update_from_output(): request_finished (requests that stopped), update_connector_output
                        (the previous step's job acks).
Not timed: trace generation, request, block-table, SchedulerOutput and KVConnectorOutput
construction, and the core's bookkeeping between hooks (computed and sampled tokens,
statuses). The first 12 steps of each replay warm up and are not counted. Replays alternate
sides (vLLM, ours, ours, vLLM, ...), each on a fresh connector, after `gc.collect()` and
`gc.freeze()` (as vLLM's engine freezes its start-up heap); the figure per side is the median
over replays of the mean CPU ms per counted step.

Ours runs as in production: `OffloadingConfig(check_invariants=False)`, every state change
still made by the `transitions` lifecycles: the headline. Ours is also measured with the
testing default (every invariant of `spec` re-checked after every hook), over the first few
counted steps only, since one check costs O(state) (`--no-checks` skips it).

    .venv-vllm/bin/python bench/scheduler.py               # 64, 256, 1024; 1 to 1.5 minutes
    .venv-vllm/bin/python bench/scheduler.py --quick       # 64 and 256, fewer steps
    .venv/bin/python bench/scheduler.py --ours-only        # without vLLM
    .venv/bin/python bench/scheduler.py --ours-only --profile --sizes 1024  # cProfile, ours
    .venv-vllm/bin/python bench/scheduler.py --profile vllm --sizes 1024

Exit status: 0 when the run completed, 1 when the two sides did different work, 2 when vLLM
(or conformance.vllm_env) cannot be imported and --ours-only was not given. Timings never go
in tests.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# this folder holds kernels.py: keep it from shadowing the `kernels` package; the repository
# root gives `conformance` when the project is installed without it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from statemachine.config import OffloadingConfig  # noqa: E402
from statemachine.core import (  # noqa: E402
    BlockPool,
    CoreStep,
    StepLedger,
    block_hashes,
    blocks_needed,
)
from statemachine.messages import (  # noqa: E402
    KVConnectorOutput,
    OffloadingWorkerMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from statemachine.scheduler import OffloadingScheduler  # noqa: E402

BLOCK = 16                 # tokens per GPU block = per hash = per CPU chunk
PREFILL_CHUNK = 128        # prefill tokens per request per step (chunked prefill)
MAX_MODEL_LEN = 1024
VOCAB = (3, 1000)          # token ids drawn from here (0-2 left to special tokens)
ACTIVE_PER_FAMILY = 16     # one shared prefix per this many active requests
SHARE = 0.5                # fraction of requests that start with a shared prefix
CPU_CHUNKS_PER_REQUEST = 8   # fewer than a request offers: the LRU evicts (see the docstring)
DECODE = (8, 96)           # decode lengths (the first cohort's start at 1)


# ================================================================================ the trace
@dataclass(frozen=True)
class ReqSpec:
    rid: str
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]
    """The tokens it will sample, one per step once its prefill is done; then it stops."""


@dataclass
class Counts:
    lookups: int = 0
    hits: int = 0
    deferred: int = 0
    loads: int = 0
    load_chunks: int = 0
    stores: int = 0
    store_chunks: int = 0
    flushes: int = 0

    def add(self, other: Counts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def row(self) -> str:
        return " ".join(f"{n}={getattr(self, n)}" for n in self.__dataclass_fields__)


@dataclass
class Step:
    resumed: list[tuple[str, int]] = field(default_factory=list)
    """Async loads acked last step: the core sets num_computed_tokens to the hit (untimed)."""
    arrivals: list[str] = field(default_factory=list)
    lookups: list[tuple[str, tuple[int | None, bool]]] = field(default_factory=list)
    """(request, the planned answer); every lookup is at num_computed_tokens == 0."""
    calls: list[tuple[str, str, tuple[int, ...], int]] = field(default_factory=list)
    """schedule()'s hook calls before build_connector_meta, in the core's order:
    ("new", req), ("lookup", req), ("alloc", req, block ids, external tokens); a lookup and
    its request's allocation are adjacent, as in vLLM (an async load admitted just before
    makes a later lookup of the same chunks defer)."""
    core: CoreStep = field(default_factory=CoreStep)
    """What the core scheduled (the shared record every core stand-in builds)."""
    loading: list[str] = field(default_factory=list)
    sampled: list[tuple[str, int]] = field(default_factory=list)
    finishing: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """(request, its block table) that stop after this step: request_finished."""
    planned: Counts = field(default_factory=Counts)


@dataclass
class Trace:
    active: int
    warmup: int
    specs: dict[str, ReqSpec]
    steps: list[Step]
    num_gpu_blocks: int
    num_cpu_chunks: int


class RequestSource:
    """Seeded request generator: shared prefixes, unique suffixes."""

    def __init__(self, seed: int, active: int) -> None:
        self.rng = random.Random(seed)
        families = max(4, active // ACTIVE_PER_FAMILY)
        self.prefixes = [self._tokens(self.rng.randint(8, 24) * BLOCK) for _ in range(families)]
        self.n = 0

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(*VOCAB) for _ in range(n))

    def make(self, first_cohort: bool) -> ReqSpec:
        rng = self.rng
        self.n += 1
        if rng.random() < SHARE:
            prefix = rng.choice(self.prefixes)
            prompt = prefix + self._tokens(rng.randint(16, 256))
        else:
            prompt = self._tokens(rng.randint(64, 640))
        decode = rng.randint(1 if first_cohort else DECODE[0], DECODE[1])
        decode = min(decode, MAX_MODEL_LEN - len(prompt) - 1)
        return ReqSpec(f"r{self.n:06d}", prompt, self._tokens(decode))


# ============================================================================ the sides
class Side:
    """One implementation under test, driven through the connector's scheduler hooks."""

    name = "?"
    connector: Any
    requests: dict[str, Any]

    def fresh(self, trace: Trace) -> None:
        raise NotImplementedError

    def new_request(self, spec: ReqSpec) -> Any:
        raise NotImplementedError

    def blocks(self, block_ids: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def finished_args(self, req: Any, block_ids: tuple[int, ...]) -> tuple[Any, ...]:
        raise NotImplementedError

    def scheduler_output(self, step: Step) -> Any:
        raise NotImplementedError

    def acks(self, meta: Any) -> Any:
        raise NotImplementedError

    def meta_counts(self, meta: Any, counts: Counts) -> None:
        raise NotImplementedError

    def meta_job_ids(self, meta: Any) -> list[int]:
        return [*meta.load_jobs, *meta.store_jobs]

    def start_counting(self) -> None:
        """Called before the first counted step."""

    # -- the core's bookkeeping on a request (untimed) -------------------------------------
    def set_status(self, req: Any, status: str) -> None:
        raise NotImplementedError

    def append_token(self, req: Any, token: int) -> None:
        raise NotImplementedError


class Ours(Side):
    name = "ours"

    def __init__(self, check_invariants: bool = False) -> None:
        self.check_invariants = check_invariants
        if check_invariants:
            self.name = "ours+checks"

    def fresh(self, trace: Trace) -> None:
        self.connector = OffloadingScheduler(OffloadingConfig(
            block_size=BLOCK, blocks_per_chunk=1, num_workers=1,
            num_cpu_chunks=trace.num_cpu_chunks, eviction_policy="lru",
            check_invariants=False))
        self.requests = {}

    def start_counting(self) -> None:
        # with checks: on from the first counted step (a warm-up with them takes too long)
        if self.check_invariants:
            self.connector.config = replace(self.connector.config, check_invariants=True)

    def new_request(self, spec: ReqSpec) -> Request:
        prompt = list(spec.prompt)
        return Request(spec.rid, prompt, block_hashes=block_hashes(prompt, BLOCK))

    def blocks(self, block_ids: tuple[int, ...]) -> list[int]:
        return list(block_ids)

    def finished_args(self, req: Request, block_ids: tuple[int, ...]) -> tuple[Any, ...]:
        return (req,)

    def scheduler_output(self, step: Step) -> SchedulerOutput:
        return step.core.scheduler_output()

    def acks(self, meta: Any) -> KVConnectorOutput:
        done = dict.fromkeys(self.meta_job_ids(meta), 1) if meta is not None else {}
        recving = {j.req_id for j in meta.load_jobs.values()} if meta is not None else set()
        return KVConnectorOutput(OffloadingWorkerMetadata(done), recving)

    def meta_counts(self, meta: Any, counts: Counts) -> None:
        counts.loads += len(meta.load_jobs)
        counts.load_chunks += sum(len(j.src.chunk_ids) for j in meta.load_jobs.values())
        counts.stores += len(meta.store_jobs)
        counts.store_chunks += sum(len(j.dst.chunk_ids) for j in meta.store_jobs.values())
        counts.flushes += len(meta.jobs_to_flush)

    def set_status(self, req: Request, status: str) -> None:
        req.status = RequestStatus[status]

    def append_token(self, req: Request, token: int) -> None:
        req.output_token_ids.append(token)
        if (len(req.prompt_token_ids) + len(req.output_token_ids)) % BLOCK == 0:
            req.block_hashes = block_hashes(req.all_token_ids, BLOCK, req.block_hashes)


class VLLM(Side):
    name = "vLLM"

    def __init__(self, env: Any) -> None:
        self.env = env
        self.status = env.request_status()

    def fresh(self, trace: Trace) -> None:
        self.setup = self.env.make_setup(
            num_gpu_blocks=trace.num_gpu_blocks, block_size=BLOCK, blocks_per_chunk=1,
            num_cpu_chunks=trace.num_cpu_chunks, eviction_policy="lru",
            max_num_seqs=max(16, trace.active), max_model_len=MAX_MODEL_LEN)
        self.connector = self.setup.connector
        self.requests = {}

    def new_request(self, spec: ReqSpec) -> Any:
        return self.env.make_request(self.setup, spec.rid, list(spec.prompt),
                                     max_tokens=len(spec.outputs))

    def blocks(self, block_ids: tuple[int, ...]) -> Any:
        return self.env.kv_blocks(block_ids)

    def finished_args(self, req: Any, block_ids: tuple[int, ...]) -> tuple[Any, ...]:
        return (req, list(block_ids))

    def scheduler_output(self, step: Step) -> Any:
        return self.env.scheduler_output_of(self.setup, step.core, self.requests)

    def acks(self, meta: Any) -> Any:
        if meta is None:
            return self.env.connector_output({})
        return self.env.connector_output(
            dict.fromkeys(self.meta_job_ids(meta), 1),
            finished_recving={j.req_id for j in meta.load_jobs.values()})

    def meta_counts(self, meta: Any, counts: Counts) -> None:
        counts.loads += len(meta.load_jobs)
        counts.load_chunks += sum(len(j.src_spec.block_ids) for j in meta.load_jobs.values())
        counts.stores += len(meta.store_jobs)
        counts.store_chunks += sum(len(j.dst_spec.block_ids) for j in meta.store_jobs.values())
        counts.flushes += len(meta.jobs_to_flush or ())

    def set_status(self, req: Any, status: str) -> None:
        req.status = self.status[status]

    def append_token(self, req: Any, token: int) -> None:
        req.append_output_token_ids(token)


class MonitoredVLLM(VLLM):
    """vLLM's connector as `MonitoredOffloadingConnector` (statemachine.monitor.connector)
    in one of the monitor's modes, its event log written to a temporary file."""

    def __init__(self, env: Any, mode: str, log_dir: Path) -> None:
        super().__init__(env)
        self.mode = mode
        self.name = f"vLLM+{mode}"
        self.log_dir = log_dir
        self.closed_findings = 0
        """Findings of the connectors replaced since (a checker process reports at close)."""
        self.open_monitor: Any = None

    def fresh(self, trace: Trace) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

        from statemachine.monitor.connector import MonitoredOffloadingConnector

        self.close()
        log = self.log_dir / f"{self.mode.replace('/', '-')}-{trace.active}.jsonl"
        extra = {"kvspec_mode": self.mode.split("/")[0], "kvspec_log": str(log)}
        if self.mode.endswith("/process"):  # warn/process: kvspec_checker process
            extra["kvspec_checker"] = "process"
        self.setup = self.env.make_setup(
            num_gpu_blocks=trace.num_gpu_blocks, block_size=BLOCK, blocks_per_chunk=1,
            num_cpu_chunks=trace.num_cpu_chunks, eviction_policy="lru",
            max_num_seqs=max(16, trace.active), max_model_len=MAX_MODEL_LEN,
            extra_config=extra)
        self.connector = MonitoredOffloadingConnector(
            self.setup.vllm_config, KVConnectorRole.SCHEDULER, self.setup.kv_cache_config)
        self.setup.connector = self.connector
        self.setup.scheduler = self.connector.connector_scheduler
        self.setup.manager = self.setup.scheduler.manager
        self.requests = {}
        self.open_monitor = self.connector.kvspec

    def close(self) -> None:
        """Ends the current connector's monitor (its checker process, if any)."""
        if self.open_monitor is not None:
            self.open_monitor.close()
            self.closed_findings += len(self.open_monitor.findings)
            self.open_monitor = None

    def findings(self) -> int:
        self.close()
        return self.closed_findings


# =========================================================================== planning
def plan(active: int, steps: int, warmup: int, seed: int) -> Trace:
    """Run the core's side of the trace once against our scheduler (checks off) and record
    every step's hook calls and answers: the replays then call exactly these."""
    source = RequestSource(seed, active)
    trace = Trace(active, warmup, {}, [], num_gpu_blocks=active * (MAX_MODEL_LEN // BLOCK) + 1,
                  num_cpu_chunks=active * CPU_CHUNKS_PER_REQUEST)
    side = Ours()
    side.fresh(trace)
    s: OffloadingScheduler = side.connector
    reqs = side.requests
    pool = BlockPool(trace.num_gpu_blocks - 1, first=1)   # block 0 is vLLM's null block
    ledger = StepLedger()
    table: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    waiting: list[str] = []
    ready: list[tuple[str, int]] = []
    running: list[str] = []
    n_active = 0
    load_hit: dict[str, int] = {}
    prev_meta = None

    def alloc(rid: str, total_tokens: int) -> tuple[int, ...]:
        new = tuple(pool.allocate(blocks_needed(total_tokens, BLOCK, len(table[rid]))))
        table[rid].extend(new)
        return new

    for t in range(steps):
        step = Step()
        trace.steps.append(step)
        # a load acked last step: the core promotes the request with the loaded tokens
        step.resumed = ready
        for rid, hit in ready:
            reqs[rid].num_computed_tokens = computed[rid] = hit
            side.set_status(reqs[rid], "WAITING")
        # --- schedule(): running first, then waiting (loaded ones, then new ones) ----------
        n_sched: dict[str, int] = {}
        for rid in running:
            spec = trace.specs[rid]
            c = computed[rid]
            n = min(PREFILL_CHUNK, len(spec.prompt) - c) if c < len(spec.prompt) else 1
            ledger.run(rid, alloc(rid, c + n), n)
            n_sched[rid] = n
        while n_active < active:
            spec = source.make(first_cohort=t == 0)
            trace.specs[spec.rid] = spec
            reqs[spec.rid] = side.new_request(spec)
            s.on_new_request(reqs[spec.rid])
            step.arrivals.append(spec.rid)
            step.calls.append(("new", spec.rid, (), 0))
            waiting.append(spec.rid)
            table[spec.rid] = []
            computed[spec.rid] = 0
            n_active += 1
        admitted: list[str] = []
        for rid, hit in ready:
            n = min(PREFILL_CHUNK, len(trace.specs[rid].prompt) - hit)
            new = alloc(rid, hit + n)
            s.update_state_after_alloc(reqs[rid], list(new), 0)
            step.calls.append(("alloc", rid, new, 0))
            admitted.append(rid)
            n_sched[rid] = n
        still: list[str] = []
        for rid in waiting:
            answer = s.get_num_new_matched_tokens(reqs[rid], 0)
            step.lookups.append((rid, answer))
            step.calls.append(("lookup", rid, (), 0))
            hit, is_async = answer
            if hit is None:
                still.append(rid)
                continue
            if hit:
                assert is_async, "the bench trace has no sync-load budget"
                new = alloc(rid, hit)
                s.update_state_after_alloc(reqs[rid], list(new), hit)
                step.calls.append(("alloc", rid, new, hit))
                step.loading.append(rid)
                load_hit[rid] = hit
                side.set_status(reqs[rid], "WAITING_FOR_REMOTE_KVS")
                continue
            n = min(PREFILL_CHUNK, len(trace.specs[rid].prompt))
            new = alloc(rid, n)
            s.update_state_after_alloc(reqs[rid], list(new), 0)
            step.calls.append(("alloc", rid, new, 0))
            admitted.append(rid)
            n_sched[rid] = n
        waiting = still
        for rid in admitted:
            ledger.admit(rid, table[rid], n_sched[rid])
        step.core = ledger.close()
        meta = s.build_connector_meta(side.scheduler_output(step))
        record_counts(side, step.planned, step.lookups, meta)
        # --- the step runs; update_from_output() ------------------------------------------
        for rid in admitted:
            side.set_status(reqs[rid], "RUNNING")
        for rid, n in n_sched.items():
            computed[rid] += n
            reqs[rid].num_computed_tokens = computed[rid]
            spec, req = trace.specs[rid], reqs[rid]
            if computed[rid] == len(req.prompt_token_ids) + len(req.output_token_ids):
                token = spec.outputs[len(req.output_token_ids)]
                step.sampled.append((rid, token))
                side.append_token(req, token)
                if len(req.output_token_ids) == len(spec.outputs):
                    step.finishing.append((rid, tuple(table[rid])))
        running = [*running, *admitted]
        for rid, blocks in step.finishing:
            side.set_status(reqs[rid], "FINISHED_LENGTH_CAPPED")
            s.request_finished(reqs[rid])
            pool.free(blocks)
            running.remove(rid)
            ledger.finish(rid)
            n_active -= 1
        acks = side.acks(prev_meta)
        s.update_connector_output(acks)
        prev_meta = meta
        ready = [(rid, load_hit.pop(rid)) for rid in sorted(acks.finished_recving)]
    return trace


def record_counts(side: Side, counts: Counts, lookups: list[tuple[str, Any]], meta: Any) -> None:
    counts.lookups += len(lookups)
    counts.hits += sum(1 for _, (hit, _a) in lookups if hit)
    counts.deferred += sum(1 for _, (hit, _a) in lookups if hit is None)
    side.meta_counts(meta, counts)


# ============================================================================ replaying
class Divergence(Exception):
    pass


@dataclass
class Run:
    side: str
    step_ns: list[int]
    """CPU ns of the timed hooks, per counted step."""
    wall_ns: list[int]
    counts: Counts


def replay(side: Side, trace: Trace, profiler: cProfile.Profile | None = None,
           counted: int | None = None) -> Run:
    """Replay the planned trace on a fresh `side` (only its first `counted` counted steps if
    given); time only the hook calls."""
    side.fresh(trace)
    # as vLLM's engine does after start-up: what exists now (the trace, the imported modules)
    # moves to the permanent generation, so the collector scans only what the replay creates
    gc.collect()
    gc.freeze()
    try:
        return _replay(side, trace, profiler, counted)
    finally:
        gc.unfreeze()


def _replay(side: Side, trace: Trace, profiler: cProfile.Profile | None,
            counted: int | None) -> Run:
    conn = side.connector
    reqs = side.requests
    on_new, lookup = conn.on_new_request, conn.get_num_new_matched_tokens
    alloc, build = conn.update_state_after_alloc, conn.build_connector_meta
    finished, update = conn.request_finished, conn.update_connector_output
    clock, wall = time.process_time_ns, time.perf_counter_ns
    step_ns: list[int] = []
    wall_ns: list[int] = []
    total = Counts()
    prev_meta = None
    steps = trace.steps if counted is None else trace.steps[:trace.warmup + counted]
    for t, step in enumerate(steps):
        if t == trace.warmup:
            side.start_counting()
        # --- untimed: the core's bookkeeping and this step's call arguments --------------
        for rid, hit in step.resumed:
            reqs[rid].num_computed_tokens = hit
            side.set_status(reqs[rid], "WAITING")
        for rid in step.arrivals:
            reqs[rid] = side.new_request(trace.specs[rid])
        calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
            (on_new, (reqs[rid],)) if kind == "new"
            else (lookup, (reqs[rid], 0)) if kind == "lookup"
            else (alloc, (reqs[rid], side.blocks(blocks), ext))
            for kind, rid, blocks, ext in step.calls]
        out = side.scheduler_output(step)
        # --- timed: schedule()'s connector hooks ------------------------------------------
        prof = profiler if t >= trace.warmup else None
        if prof is not None:
            prof.enable()
        w0, c0 = wall(), clock()
        try:
            results = [fn(*a) for fn, a in calls]
            meta = build(out)
        except Exception as exc:  # a side left the plan (a lookup answered otherwise)
            raise Divergence(f"{side.name}, step {t}: {type(exc).__name__}: {exc}") from exc
        c1, w1 = clock(), wall()
        if prof is not None:
            prof.disable()
        # --- untimed: check the answers, advance the requests -----------------------------
        planned = [a for _, a in step.lookups]
        got = [(r[0], bool(r[1])) for (fn, _), r in zip(calls, results, strict=True)
               if fn is lookup]
        if got != planned:
            bad = next(i for i, (g, p) in enumerate(zip(got, planned, strict=True)) if g != p)
            raise Divergence(f"{side.name}, step {t}: lookup of {step.lookups[bad][0]} answered "
                             f"{got[bad]}, the plan {planned[bad]}")
        counts = Counts()
        record_counts(side, counts, step.lookups, meta)
        if counts != step.planned:
            raise Divergence(f"{side.name}, step {t}: did {counts.row()}; "
                             f"the plan {step.planned.row()}")
        if t >= trace.warmup:
            total.add(counts)
        for rid in step.loading:
            side.set_status(reqs[rid], "WAITING_FOR_REMOTE_KVS")
        for rid in step.core.new:
            side.set_status(reqs[rid], "RUNNING")
        for rid, n in step.core.num_scheduled.items():
            reqs[rid].num_computed_tokens += n
        for rid, token in step.sampled:
            side.append_token(reqs[rid], token)
        fins = [side.finished_args(reqs[rid], blocks) for rid, blocks in step.finishing]
        for rid, _ in step.finishing:
            side.set_status(reqs[rid], "FINISHED_LENGTH_CAPPED")
        acks = side.acks(prev_meta)
        # --- timed: update_from_output()'s connector hooks --------------------------------
        if prof is not None:
            prof.enable()
        w2, c2 = wall(), clock()
        try:
            for args in fins:
                finished(*args)
            update(acks)
        except Exception as exc:
            raise Divergence(f"{side.name}, step {t}: {type(exc).__name__}: {exc}") from exc
        c3, w3 = clock(), wall()
        if prof is not None:
            prof.disable()
        prev_meta = meta
        if t >= trace.warmup:
            step_ns.append(c1 - c0 + c3 - c2)
            wall_ns.append(w1 - w0 + w3 - w2)
    return Run(side.name, step_ns, wall_ns, total)


# ============================================================================== driving
@dataclass
class Row:
    active: int
    label: str
    ours: list[Run]
    vllm: list[Run]
    steps: int
    """Counted steps the figures cover (the first ones of the window)."""
    monitored: dict[str, list[Run]] = field(default_factory=dict)
    """vLLM with the spec monitor, per mode."""

    @staticmethod
    def _ms(runs: list[Run], steps: int, wall: bool = False) -> float:
        return statistics.median(statistics.fmean((r.wall_ns if wall else r.step_ns)[:steps])
                                 for r in runs) / 1e6

    def ms(self, side: str, wall: bool = False) -> float:
        runs = (self.ours if side == "ours" else self.vllm if side == "vLLM"
                else self.monitored[side])
        return self._ms(runs, self.steps, wall)

    def floor(self, side: str) -> float:
        """Each counted step's least CPU ms over the repetitions (the same trace, so the same
        step), averaged: the steadier figure on a loaded machine (others only add time)."""
        runs = (self.ours if side == "ours" else self.vllm if side == "vLLM"
                else self.monitored[side])
        return statistics.fmean(min(r.step_ns[k] for r in runs)
                                for k in range(self.steps)) / 1e6


def measure(trace: Trace, sides: list[Side], reps: int,
            counted: int | None = None) -> dict[str, list[Run]]:
    """`reps` replays per side, alternating which side goes first."""
    runs: dict[str, list[Run]] = {s.name: [] for s in sides}
    for rep in range(reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            runs[side.name].append(replay(side, trace, counted=counted))
    return runs


def load_vllm_env() -> Any:
    try:
        from conformance import vllm_env

        vllm_env.vllm_version()  # imports vLLM
    except ImportError as exc:
        print(f"bench/scheduler.py: cannot import vLLM ({exc}).\n"
              "Run it with the vLLM environment (make conformance builds it):\n"
              "    .venv-vllm/bin/python bench/scheduler.py\n"
              "or measure our side only:  python bench/scheduler.py --ours-only",
              file=sys.stderr)
        sys.exit(2)
    return vllm_env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None,
                   help="active requests, comma-separated (default 64,256,1024)")
    p.add_argument("--steps", type=int, default=None,
                   help="counted steps per replay (default 40 at 64, 30 at 256, 24 at 1024)")
    p.add_argument("--warmup", type=int, default=12, help="steps run but not counted")
    p.add_argument("--reps", type=int, default=3, help="repetitions per side (interleaved)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="64 and 256, fewer steps and reps")
    p.add_argument("--no-checks", action="store_true",
                   help="skip measuring ours with invariant checks after every hook (the "
                        "testing default; measured over the first --checks-steps counted "
                        "steps only)")
    p.add_argument("--checks-steps", type=int, default=None,
                   help="counted steps with checks (default 6, 2 above 256 requests)")
    p.add_argument("--ours-only", action="store_true", help="without vLLM")
    p.add_argument("--monitor", default="log,warn",
                   help="the spec monitor's modes to measure on vLLM's connector, "
                        "comma-separated (default log,warn; warn/process: warn with "
                        "kvspec_checker process; '' for none)")
    p.add_argument("--profile", nargs="?", const="ours", choices=("ours", "vllm"),
                   help="cProfile one replay's hook calls (ours by default) instead of timing")
    p.add_argument("--top", type=int, default=30, help="profile rows to print")
    p.add_argument("--sort", choices=("cumulative", "tottime"), default="cumulative",
                   help="profile order")
    args = p.parse_args(argv)

    sizes = [int(x) for x in (args.sizes or ("64,256" if args.quick else "64,256,1024"))
             .split(",")]
    reps = 2 if args.quick and args.reps == 3 else args.reps

    def counted(n: int) -> int:
        if args.steps is not None:
            return args.steps
        base = {64: 40, 256: 30}.get(n, 24)
        return base // 2 if args.quick else base

    env = None
    if not args.ours_only or args.profile == "vllm":
        t0 = time.perf_counter()
        env = load_vllm_env()
        version = ".".join(map(str, env.vllm_version()))
        print(f"vLLM {version} imported in {time.perf_counter() - t0:.1f} s")

    if args.profile:
        for n in sizes:
            trace = plan(n, args.warmup + counted(n), args.warmup, args.seed)
            side: Side = Ours() if args.profile == "ours" else VLLM(env)
            replay(side, trace)  # warm
            prof = cProfile.Profile()
            run = replay(side, trace, prof)
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats(args.sort).print_stats(args.top)
            print(f"\n== profile of {side.name}'s hooks, {n} active requests, the "
                  f"{len(run.step_ns)} counted steps (timed regions only), by {args.sort} time")
            print(buf.getvalue())
        return 0

    rows: list[Row] = []
    t_start = time.perf_counter()
    modes = [m for m in args.monitor.split(",") if m]
    log_dir = Path(tempfile.mkdtemp(prefix="kvspec-bench-monitor-"))
    for n in sizes:
        t0 = time.perf_counter()
        trace = plan(n, args.warmup + counted(n), args.warmup, args.seed)
        t_plan = time.perf_counter() - t0
        total = Counts()
        for st in trace.steps[trace.warmup:]:
            total.add(st.planned)
        print(f"\n{n} active requests: {len(trace.steps)} steps ({trace.warmup} warm-up), "
              f"{len(trace.specs)} requests, {trace.num_cpu_chunks} CPU chunks; planned in "
              f"{t_plan:.1f} s")
        sides: list[Side] = [Ours()]
        monitored = [MonitoredVLLM(env, m, log_dir) for m in modes] if env is not None else []
        if env is not None:
            sides[:0] = [VLLM(env), *monitored]
        try:
            runs = measure(trace, sides, reps)
            n_checked = min(counted(n), args.checks_steps or (6 if n <= 256 else 2))
            checked = ([] if args.no_checks else
                       measure(trace, [Ours(True)], 1, n_checked)["ours+checks"])
        except Divergence as exc:
            print(f"ABORT: the two sides did different work: {exc}", file=sys.stderr)
            return 1
        # replay() checked every side's every step against the plan; the totals, once more
        for name, rs in runs.items():
            for r in rs:
                if r.counts != total:
                    print(f"ABORT: {name} did {r.counts.row()}, the plan {total.row()}",
                          file=sys.stderr)
                    return 1
            print(f"  {name:5} counted steps: {rs[0].counts.row()}")
        vllm_runs = runs.get("vLLM", [])
        for m in monitored:
            if m.findings():
                print(f"ABORT: the monitor ({m.mode}) reported {m.findings()} violation(s) "
                      "on vLLM's connector: see its log", file=sys.stderr)
                return 1
        rows.append(Row(n, "production", runs["ours"], vllm_runs, counted(n),
                        {m.name: runs[m.name] for m in monitored}))
        if checked:
            rows.append(Row(n, "checks on", checked, vllm_runs, n_checked))
        same = "both sides did the same work" if env is not None else "as planned"
        print(f"  {same}; {time.perf_counter() - t0:.1f} s")

    print(f"\nCPU ms per engine step (connector hooks only; median of the per-repetition means; "
          f"{time.perf_counter() - t_start:.0f} s)")
    head = f"{'active':>7} {'ours setting':13} {'steps':>5} {'ours ms':>9}"
    if env is not None:
        head += f" {'vLLM ms':>9} {'ours/vLLM':>10} {'(wall)':>7}"
        for m in modes:
            head += f" {'+' + m + ' ms':>10} {'+' + m + '/vLLM':>11}"
    print(head)
    for row in rows:
        line = f"{row.active:7} {row.label:13} {row.steps:5} {row.ms('ours'):9.3f}"
        if env is not None:
            line += (f" {row.ms('vLLM'):9.3f} {row.ms('ours') / row.ms('vLLM'):10.2f}"
                     f" {row.ms('ours', True) / row.ms('vLLM', True):7.2f}")
            for m in modes:
                if f"vLLM+{m}" in row.monitored:
                    ms = row.ms(f"vLLM+{m}")
                    line += f" {ms:10.3f} {ms / row.ms('vLLM'):11.2f}"
        print(line)
    if env is not None and modes:
        print("vLLM+MODE: vLLM's connector as MonitoredOffloadingConnector, the spec monitor in "
              "that mode, its event log written (statemachine/monitor/connector.py)")
        print("\nthe floor (each counted step's least CPU ms over the repetitions, averaged)")
        print(f"{'active':>7} {'vLLM ms':>9}" + "".join(
            f" {'+' + m + ' ms':>10} {'+' + m + '/vLLM':>11}" for m in modes))
        for row in rows:
            if not row.monitored or not row.vllm:
                continue
            base = row.floor("vLLM")
            line = f"{row.active:7} {base:9.3f}"
            for m in modes:
                if f"vLLM+{m}" in row.monitored:
                    f = row.floor(f"vLLM+{m}")
                    line += f" {f:10.3f} {f / base:11.2f}"
            print(line)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
