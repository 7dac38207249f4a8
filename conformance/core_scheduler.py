"""vLLM's real core scheduler with a KV connector, driven on a CPU-only machine.

What is real: vLLM's `Scheduler` (the class `SchedulerConfig.get_scheduler_cls()` names),
built as `EngineCore.__init__` builds it (vllm/v1/engine/core.py:134-158 of v0.25.1,
core.py:164-188 of v0.33.0): a `VllmConfig` whose `kv_transfer_config` names the connector
(`kv_connector`, optionally `kv_connector_module_path`, and `kv_connector_extra_config`), a
`StructuredOutputManager`, the block sizes of `resolve_kv_cache_block_sizes`, the request
block hasher of `prefix_caching_hash_algo`. The Scheduler builds the connector itself
(`KVConnectorFactory.create_connector`, role SCHEDULER; a module path is imported and the
class looked up by name: vllm/distributed/kv_transfer/kv_connector/factory.py:105-113 of
v0.25.1, factory.py:106-114 of v0.33.0), with its CPU offloading spec and manager. The
workers' reports are combined by vLLM's own `KVOutputAggregator`
(kv_connector/utils.py), as the executor does.

What the harness plays (the engine loop and the workers; no model, no GPU, no copies):

* the engine: the synchronous `EngineCore.step` (core.py:479-508 of v0.25.1, core.py:667-697
  of v0.33.0): `schedule()`, a `ModelRunnerOutput`, `update_from_output()`. Async
  scheduling is off (`async_scheduling=False`, as `--no-async-scheduling` sets it; left
  unset, an engine picks the `AsyncScheduler` and a batch queue: vllm/config/vllm.py:
  992-1040 of v0.25.1, :1685-1719 of v0.33.0; this loop does not model them);
* the model: every request whose computed tokens reach its length in a step samples one
  token (a pseudo-random id from the seed, the request and the position; never EOS unless
  `add_request(eos_at=...)` asks for it), so requests decode until `max_tokens`;
* the workers (`num_workers`, the tensor-parallel size): every job that step k's connector
  metadata ships (loads and stores) is acknowledged in the output of step k+1 by every
  worker (`OffloadingWorkerMetadata.completed_jobs`; a load also in `finished_recving`
  unless it is synchronous); with two or more workers and `split_acks`, a seeded half of
  the jobs are acknowledged by one worker in step k+1 and by the others in step k+2. A
  flushed job keeps its schedule: a flush makes the worker wait for the data, and the CPU
  worker reports completions in submission order (vllm/v1/kv_offload/cpu/gpu_worker.py:425
  of v0.25.1, :737 of v0.33.0), so its report may come after the flush;
* the operator: `reset_prefix_cache` between steps, with the connector's cache
  (`Scheduler.reset_prefix_cache(reset_running_requests, reset_connector=True)`, what
  `POST /reset_prefix_cache?reset_external=true` passes; the same signature in both
  releases: vllm/v1/core/sched/scheduler.py:2196-2244 of v0.25.1, :3184-3227 of v0.33.0).
  Without `reset_running_requests` the GPU prefix cache is not reset while requests run
  (the call answers False) but the connector's is, all the same (:2241-2242, :3221-3222).

vLLM keeps the ids of finished and preempted requests in plain sets, which the connector
visits in string-hash order (PYTHONHASHSEED). The driver gives the Scheduler a
`SortedIdSet` for both after every `schedule()` (which replaces them with fresh sets:
scheduler.py:1210-1211 of v0.25.1, :1876-1877 of v0.33.0), so a run does not depend on the
hash seed. `scenario` keeps the CPU cache large enough that nothing is evicted from it
(eviction order among one job's keys follows a set of bytes).

    run = make_core_scheduler(num_gpu_blocks=SCENARIO_GPU_BLOCKS, num_cpu_chunks=64,
                              num_workers=2)
    summary = scenario(run)          # summary.records: one StepRecord per step
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import types
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance import releases
from conformance.vllm_env import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    SortedIdSet,
    _chunk_bytes,
    _kv_cache_config,
    _model_config,
    _v,
    chunk_layers,
    has,
    manager_num_chunks,
    transfer_specs,
    vllm_version,
)


class CoreHarnessError(RuntimeError):
    """The harness cannot do what it was asked (a configuration it does not support, a
    connector whose metadata it cannot play the workers of)."""


class HookError(RuntimeError):
    """An exception raised inside vLLM while the driver was stepping: `hook` names the
    connector method the Scheduler was in (or the Scheduler method, outside the
    connector), `where` the innermost frame (`vllm/...py:LINE`), `step` the step
    (0-based), `phase` the driver's call."""

    def __init__(self, step: int, phase: str, hook: str, where: str,
                 error: BaseException) -> None:
        super().__init__(f"step {step}, {phase}: {type(error).__name__} in {hook} "
                         f"({where}): {error!r}")
        self.step = step
        self.phase = phase
        self.hook = hook
        self.where = where
        self.error = error


# ----------------------------------------------------------------------------- the run
@dataclass
class CoreRun:
    """A Scheduler, the connector it built (scheduler role) and what they were built from."""

    scheduler: Any
    connector: Any
    vllm_config: Any
    kv_cache_config: Any
    block_hasher: Callable[[Any], list[Any]]
    version: tuple[int, int, int]
    num_workers: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_chunks: int
    extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def offloading(self) -> Any:
        """The connector's `OffloadingConnectorScheduler` (its `_req_status`, `_jobs`)."""
        return self.connector.connector_scheduler


def _module(name: str) -> Any:
    return importlib.import_module(name)


HYBRID_GROUPS: tuple[tuple[str, ...], ...] = (("full", "sliding"), ("full", "mamba"),
                                              ("full", "sliding", "mamba"), ("mamba",),
                                              ("sliding",))
"""The models beyond one full-attention group the harness builds: one layer per KV cache
group, in this order (two groups, or the three kinds at once), or one group over every
layer (a pure Mamba model, a sliding window on every layer)."""


def make_core_scheduler(*, num_gpu_blocks: int, block_size: int = 16, num_cpu_chunks: int,
                        num_workers: int = 1, max_num_seqs: int = 8, max_model_len: int = 1024,
                        max_num_batched_tokens: int | None = None,
                        kv_connector: str = "OffloadingConnector",
                        kv_connector_module_path: str | None = None,
                        extra_config: Mapping[str, Any] | None = None,
                        sliding_window: int | None = None,
                        groups: Sequence[str] | None = None,
                        retention_interval: int | None = 0) -> CoreRun:
    """vLLM's Scheduler over `num_gpu_blocks` GPU blocks (one is vLLM's null block) with the
    connector `kv_connector` (a registered name, or a class name in
    `kv_connector_module_path`), offloading to `num_cpu_chunks` CPU chunks of one block.
    `extra_config` entries are merged over the CPU spec's (`kv_connector_extra_config`).
    `num_workers` is the tensor-parallel size: every job waits for that many acks.

    `groups` makes the model hybrid, one layer per KV cache group in that order (vLLM's
    default retention): `("full", "sliding")`, what `sliding_window` (tokens) alone asks
    for, or `("full", "mamba")`, a Mamba group in align mode (`mamba_cache_mode="align"`,
    what prefix caching selects): the core then splits prefills at block edges and hands
    the connector the states it commits (`boundary_state_offloads`); `("mamba",)` is a
    pure Mamba model and `("sliding",)` a window on every layer, one group over every
    layer.
    `retention_interval` is `prefix_cache_retention_interval` (0.30+; vLLM's default 0:
    beside the last block of each window and each Mamba state, the core and the connector
    keep only what a replay of the prompt reads; None: all of them), which the engine
    hands to the core's `KVCacheConfig` as well (vllm/v1/core/kv_cache_planning.py:665-666
    of v0.33.0)."""
    v = _v()
    version = vllm_version()
    cfg = v.config
    groups = tuple(groups or (("full", "sliding") if sliding_window is not None else ("full",)))
    hybrid = groups != ("full",)
    if hybrid and groups not in HYBRID_GROUPS:
        raise CoreHarnessError(f"the harness builds the groups {HYBRID_GROUPS} or one "
                               f"full-attention group; asked for {groups}")
    if ("sliding" in groups) != (sliding_window is not None):
        raise CoreHarnessError("a sliding-window group and `sliding_window` come together; "
                               f"groups {groups}, sliding_window {sliding_window}")
    needs = [f for f, kind in (("retention_interval", hybrid),
                               ("block_state_handoffs", "mamba" in groups)) if kind]
    for feature in needs:
        if not has(feature):
            raise CoreHarnessError(f"a core with the groups {groups} needs vLLM "
                                   f"{releases.FEATURES[feature]}+ ({feature})")
    extra: dict[str, Any] = {
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": num_cpu_chunks * _chunk_bytes(block_size, 1, num_workers,
                                                          chunk_layers(groups)),
        "eviction_policy": "lru",
        "offload_prompt_only": False,
    }
    extra.update(extra_config or {})
    transfer = cfg.KVTransferConfig(kv_connector=kv_connector, kv_role="kv_both",
                                    kv_connector_module_path=kv_connector_module_path,
                                    kv_connector_extra_config=extra)
    parallel = (cfg.ParallelConfig(tensor_parallel_size=num_workers) if num_workers > 1
                else cfg.ParallelConfig())
    vllm_config = cfg.VllmConfig(
        model_config=_model_config(max_model_len),
        cache_config=cfg.CacheConfig(
            block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
            enable_prefix_caching=True,
            **({"mamba_cache_mode": "align"} if "mamba" in groups else {}),
            **({"prefix_cache_retention_interval": retention_interval}
               if has("retention_interval") else {})),
        scheduler_config=cfg.SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(max_model_len, 2048),
            max_model_len=max_model_len, enable_chunked_prefill=True,
            is_encoder_decoder=False, async_scheduling=False),
        parallel_config=parallel,
        device_config=cfg.DeviceConfig(device="cpu"),
        kv_transfer_config=transfer,
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    world = int(vllm_config.parallel_config.world_size)
    if world != num_workers:
        raise CoreHarnessError(f"asked for {num_workers} workers, vLLM's world size is {world}")
    kv_cache_config = _kv_cache_config(num_gpu_blocks, block_size, sliding_window, groups)
    if hasattr(kv_cache_config, "prefix_cache_retention_interval"):  # what the engine plans
        kv_cache_config.prefix_cache_retention_interval = \
            vllm_config.cache_config.prefix_cache_retention_interval

    utils = _module("vllm.v1.core.kv_cache_utils")
    sched_block, hash_block = utils.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if hasattr(utils, "resolve_cache_hit_alignment_tokens"):  # 0.33: the engine sets both
        kv_cache_config.hash_block_size = hash_block
        kv_cache_config.cache_hit_alignment_tokens = utils.resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, sched_block, hash_block)

    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    structured = _module("vllm.v1.structured_output").StructuredOutputManager(vllm_config)
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=structured, include_finished_set=False,
                              log_stats=False, block_size=sched_block,
                              hash_block_size=hash_block)
    connector = scheduler.get_kv_connector()
    if not isinstance(connector, v.OffloadingConnector):
        raise CoreHarnessError(
            f"the harness plays the workers of an OffloadingConnector; the Scheduler built "
            f"{type(connector).__name__}")
    chunks = manager_num_chunks(connector.connector_scheduler.manager)
    if chunks != num_cpu_chunks:
        raise CoreHarnessError(f"asked for {num_cpu_chunks} CPU chunks, vLLM made {chunks}")

    hashing = _module("vllm.utils.hashing")
    hash_fn = hashing.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    if hash_fn is not v.sha256:  # vllm_env seeded vLLM's NONE_HASH for sha256 already
        utils.init_none_hash(hash_fn)
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    block_hasher = (utils.get_request_block_hasher(hash_block, hash_fn, lookahead) if lookahead
                    else utils.get_request_block_hasher(hash_block, hash_fn))
    return CoreRun(scheduler=scheduler, connector=connector, vllm_config=vllm_config,
                   kv_cache_config=kv_cache_config, block_hasher=block_hasher, version=version,
                   num_workers=world, block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                   num_cpu_chunks=chunks, extra_config=extra)


# ----------------------------------------------------------------------------- records
@dataclass
class StepRecord:
    """What one step did. Job ids are the connector's; acks count worker reports."""

    step: int
    scheduled: dict[str, int]
    """Tokens scheduled per request."""
    new: list[str]
    resumed: list[str]
    """Requests scheduled again after a preemption (or a reset that preempted them)."""
    preempted: list[str]
    """`SchedulerOutput.preempted_req_ids`: preempted since the previous schedule."""
    finished_reported: list[str]
    """`SchedulerOutput.finished_req_ids`: finished since the previous schedule."""
    load_jobs: dict[int, str]
    load_spans: dict[int, tuple[int, int]]
    """Load job id -> (index of its first block in the request, blocks it loads)."""
    store_jobs: dict[int, str]
    store_sources: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    """Store job id -> its GPU source: (block ids, blocks per group, the first block's index
    in the request per group); one group (no group sizes): `((ids), (len,), (first,))`."""
    flushed: list[int]
    split_jobs: list[int]
    """Jobs of this step whose worker acks the harness splits over two steps."""
    acks: dict[int, int]
    """Job id -> worker acks delivered in this step's output (summed over workers)."""
    acks_by_worker: list[list[int]]
    finished_recving: list[str]
    """What the aggregated output reported (every worker's load done)."""
    sampled: dict[str, int]
    """Token sampled per request."""
    finished: list[str]
    """Requests that finished in this step's `update_from_output`."""
    computed: dict[str, int] = field(default_factory=dict)
    """Computed tokens of every request the Scheduler holds after `schedule()` (which
    counts the step's scheduled tokens in)."""
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    """Block ids per KV cache group of every request the Scheduler holds, after
    `schedule()`."""
    handoffs: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """The core's Mamba state hand-offs of this step (`take_boundary_state_offloads`:
    request -> `(group, block, boundary tokens)`), what the connector was offered."""
    junctions: dict[str, int] = field(default_factory=dict)
    """The shared-prefix junction of every request the Scheduler holds that has one, after
    `schedule()` (`Request.shared_prefix_boundary`, set at each lookup; absent before vLLM
    releases that find junctions)."""


@dataclass
class ResetRecord:
    """One `reset_prefix_cache` call between steps."""

    after_step: int
    """The number of steps taken before it."""
    result: bool
    in_flight: dict[int, str]
    """Jobs not yet acknowledged by every worker, with their requests."""
    holders: dict[str, str]
    """Requests holding those jobs -> their status at the reset."""


@dataclass
class StuckRequest:
    """An unfinished request that made no progress for the driver's `stall_steps`."""

    req_id: str
    status: str
    idle_steps: int
    transfer_jobs: list[int]
    """Job ids the connector holds for it (`_req_status[...].transfer_jobs`)."""
    stale_jobs: list[int]
    """Those of them the connector's job table (`_jobs`) no longer has."""


@dataclass
class RunSummary:
    steps: int
    idle: bool
    """Every request finished and nothing is in flight."""
    finished: list[str]
    """In finishing order."""
    unfinished: list[str]
    stuck: dict[str, StuckRequest]
    error: HookError | None
    records: list[StepRecord]
    resets: list[ResetRecord]
    output_tokens: dict[str, list[int]]

    @property
    def preemptions(self) -> int:
        return sum(len(r.preempted) for r in self.records)

    @property
    def loads(self) -> dict[int, str]:
        return {j: r for rec in self.records for j, r in rec.load_jobs.items()}

    @property
    def stores(self) -> dict[int, str]:
        return {j: r for rec in self.records for j, r in rec.store_jobs.items()}

    @property
    def split_jobs(self) -> list[int]:
        return [j for rec in self.records for j in rec.split_jobs]


# ----------------------------------------------------------------------------- the driver
def _hook_of(error: BaseException, run: CoreRun) -> str:
    """The connector method the Scheduler was in when `error` was raised (the outermost
    frame whose `self` is the connector or its scheduler half), else the innermost
    Scheduler method."""
    owners: dict[int, str] = {id(run.connector): "connector"}
    inner = getattr(run.connector, "connector_scheduler", None)
    if inner is not None:
        owners[id(inner)] = "connector_scheduler"
    scheduler_frame = ""
    tb: types.TracebackType | None = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        name = tb.tb_frame.f_code.co_name
        if id(owner) in owners:
            return f"{owners[id(owner)]}.{name}"
        if owner is run.scheduler:
            scheduler_frame = f"scheduler.{name}"
        tb = tb.tb_next
    return scheduler_frame or "harness"


def _where(error: BaseException) -> str:
    """`file:line` of the innermost frame, the path from its `vllm/` folder on."""
    tb = error.__traceback__
    if tb is None:
        return "?"
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
    cut = path.rfind("/vllm/")
    return f"{path[cut + 1:] if cut >= 0 else path}:{tb.tb_lineno}"


def _gpu_source(spec: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A GPU spec's (block ids, blocks per group, first block index per group)."""
    ids = tuple(int(b) for b in spec.block_ids)
    sizes = getattr(spec, "group_sizes", None)
    indices = getattr(spec, "block_indices", None)
    return (ids, tuple(int(n) for n in sizes) if sizes is not None else (len(ids),),
            tuple(int(i) for i in indices) if indices is not None else (0,))


class CoreDriver:
    """Plays the engine loop and the workers around `run.scheduler`."""

    def __init__(self, run: CoreRun, *, seed: int = 0, split_acks: bool = True,
                 stall_steps: int = 12) -> None:
        self.run = run
        self.seed = seed
        self.split_acks = split_acks and run.num_workers > 1
        self.stall_steps = stall_steps
        self._rng = random.Random(f"core-driver:{seed}")
        v = _v()
        self._v = v
        self._mro_cls = _module("vllm.v1.outputs").ModelRunnerOutput
        self._mro_has_index = "req_id_to_index" in {
            f.name for f in dataclasses.fields(self._mro_cls)}
        self._meta_cls = _module("vllm.distributed.kv_transfer.kv_connector.v1.offloading."
                                 "common").OffloadingConnectorMetadata
        agg = _module("vllm.distributed.kv_transfer.kv_connector.utils").KVOutputAggregator
        self._aggregator = agg.from_connector(run.connector, run.num_workers)
        self.step_count = 0
        self.records: list[StepRecord] = []
        self._ever_scheduled: set[str] = set()
        self.resets: list[ResetRecord] = []
        self.requests: dict[str, Any] = {}
        self.finished: list[str] = []
        self._eos_at: dict[str, int] = {}
        self._last_progress: dict[str, int] = {}
        # step -> worker -> job ids acknowledged in that step's output
        self._due: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        # job -> (request, an asynchronous load, worker acks still due)
        self._in_flight: dict[int, tuple[str, bool, int]] = {}
        self._handoffs: dict[str, list[tuple[int, int, int]]] = {}
        self._observe_handoffs()
        self._sort_id_sets()

    def _observe_handoffs(self) -> None:
        """Record what the core's `take_boundary_state_offloads` gives each `schedule()`
        (0.29+); the Scheduler drops it from its output once the connector has read it
        (vllm/v1/core/sched/scheduler.py:1681 and :1775 of v0.33.0). The answer is
        passed on unchanged."""
        manager = self.run.scheduler.kv_cache_manager
        take = getattr(manager, "take_boundary_state_offloads", None)
        if take is None:
            return

        def observed() -> Any:
            offloads = take()
            self._handoffs = {str(r): [(int(g), int(b), int(n)) for g, b, n in entries]
                              for r, entries in offloads.items()}
            return offloads

        manager.take_boundary_state_offloads = observed

    # ---------------------------------------------------------------- requests
    def add_request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                    *, eos_at: int | None = None) -> Any:
        """A real `Request` (the engine's block hasher) added to the Scheduler, which calls
        the connector's `on_new_request`. `eos_at`: the model samples EOS as that output
        token (1-based); by default never."""
        if req_id in self.requests:
            raise CoreHarnessError(f"request {req_id} was already added")
        v = self._v
        params = v.SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = v.Request(request_id=req_id, prompt_token_ids=list(prompt_token_ids),
                            sampling_params=params, pooling_params=None,
                            block_hasher=self.run.block_hasher)
        self._call("add_request", self.run.scheduler.add_request, request)
        self.requests[req_id] = request
        if eos_at is not None:
            self._eos_at[req_id] = eos_at
        self._last_progress[req_id] = self.step_count
        return request

    def _token(self, req_id: str, index: int) -> int:
        if self._eos_at.get(req_id) == index + 1:
            return EOS_TOKEN_ID
        token = random.Random(f"{self.seed}:{req_id}:{index}").randrange(3, VOCAB_SIZE)
        return token

    # ---------------------------------------------------------------- stepping
    def _sort_id_sets(self) -> None:
        sched = self.run.scheduler
        sched.finished_req_ids = SortedIdSet(sched.finished_req_ids)
        if hasattr(sched, "reset_preempted_req_ids"):  # 0.24 on: requests a reset preempted
            sched.reset_preempted_req_ids = SortedIdSet(sched.reset_preempted_req_ids)

    def _call(self, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # vLLM's own assertions and lookups included
            raise HookError(self.step_count, phase, _hook_of(error, self.run), _where(error),
                            error) from error

    def step(self) -> StepRecord:
        """One engine step: schedule, the workers' and model's output, update."""
        k = self.step_count
        sched = self.run.scheduler
        self._handoffs = {}
        out = self._call("schedule", sched.schedule)
        self._sort_id_sets()
        computed = {r: int(req.num_computed_tokens) for r, req in sched.requests.items()}
        tables = {r: [list(map(int, g)) for g in sched.kv_cache_manager.get_block_ids(r)]
                  for r in sched.requests}
        junctions = {r: int(j) for r, req in sched.requests.items()
                     if (j := getattr(req, "shared_prefix_boundary", 0))}
        meta = out.kv_connector_metadata
        if not isinstance(meta, self._meta_cls):
            raise CoreHarnessError(f"step {k}: connector metadata is {type(meta).__name__}, "
                                   "not OffloadingConnectorMetadata")

        load_jobs = {int(j): str(job.req_id) for j, job in meta.load_jobs.items()}
        store_jobs = {int(j): str(job.req_id) for j, job in meta.store_jobs.items()}
        load_spans = {int(j): (int(dst.block_indices[0]), len(dst.block_ids))
                      for j, job in meta.load_jobs.items()
                      for dst in (transfer_specs(job)[1],)}
        store_sources = {int(j): _gpu_source(transfer_specs(job)[0])
                         for j, job in meta.store_jobs.items()}
        split: list[int] = []
        for job_id, job in sorted({**meta.load_jobs, **meta.store_jobs}.items()):
            is_async_load = job_id in load_jobs and not getattr(job, "sync", False)
            self._in_flight[job_id] = (str(job.req_id), is_async_load, self.run.num_workers)
            workers = list(range(self.run.num_workers))
            if self.split_acks and self._rng.random() < 0.5:
                first = self._rng.randrange(self.run.num_workers)
                split.append(job_id)
                self._due[k + 1][first].append(job_id)
                for w in workers:
                    if w != first:
                        self._due[k + 2][w].append(job_id)
            else:
                for w in workers:
                    self._due[k + 1][w].append(job_id)

        # the model: one token for every request whose tokens are all computed now
        req_ids = list(out.num_scheduled_tokens)
        sampled: dict[str, int] = {}
        for req_id in req_ids:
            request = sched.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                sampled[req_id] = self._token(req_id, len(request.output_token_ids))

        # the workers: this step's acks, one output per worker, combined by vLLM
        due = self._due.pop(k, {})
        acks: dict[int, int] = {}
        by_worker: list[list[int]] = []
        outputs: list[Any] = []
        for w in range(self.run.num_workers):
            jobs = sorted(due.get(w, []))
            by_worker.append(jobs)
            recving: set[str] = set()
            for job_id in jobs:
                acks[job_id] = acks.get(job_id, 0) + 1
                req_id, is_async_load, left = self._in_flight[job_id]
                if is_async_load:
                    recving.add(req_id)
                if left == 1:
                    del self._in_flight[job_id]
                else:
                    self._in_flight[job_id] = (req_id, is_async_load, left - 1)
            worker_meta = (self._v.OffloadingWorkerMetadata(
                completed_jobs={j: 1 for j in jobs}) if jobs else None)
            kv_out = self._v.KVConnectorOutput(finished_recving=recving or None,
                                               kv_connector_worker_meta=worker_meta)
            # 0.34.0 dropped `req_id_to_index` (the index is the position in req_ids)
            index = ({"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
                     if self._mro_has_index else {})
            outputs.append(self._mro_cls(
                req_ids=list(req_ids), **index,
                sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
                kv_connector_output=kv_out))
        model_output = self._call("aggregate", self._aggregator.aggregate, outputs)
        recved = sorted(model_output.kv_connector_output.finished_recving or ())

        engine_outputs = self._call("update_from_output", sched.update_from_output, out,
                                    model_output)
        finished: list[str] = []
        for client in engine_outputs.values():
            for o in client.outputs:
                if o.finish_reason is not None:
                    finished.append(str(o.request_id))
        finished.sort()
        self.finished.extend(finished)
        for req_id in out.num_scheduled_tokens:
            self._last_progress[req_id] = k

        # 0.34.0 sends a resumed request in full among the new ones (no resumed_req_ids)
        cached = out.scheduled_cached_reqs
        resumed = sorted(cached.resumed_req_ids or () if hasattr(cached, "resumed_req_ids")
                         else (r.req_id for r in out.scheduled_new_reqs
                               if r.req_id in self._ever_scheduled))
        self._ever_scheduled.update(out.num_scheduled_tokens)
        record = StepRecord(
            step=k, scheduled={r: int(n) for r, n in out.num_scheduled_tokens.items()},
            new=[r.req_id for r in out.scheduled_new_reqs],
            resumed=resumed,
            preempted=sorted(out.preempted_req_ids or ()),
            finished_reported=sorted(out.finished_req_ids or ()),
            load_jobs=load_jobs, load_spans=load_spans, store_jobs=store_jobs,
            store_sources=store_sources,
            flushed=sorted(int(j) for j in (meta.jobs_to_flush or ())), split_jobs=split,
            acks=dict(sorted(acks.items())), acks_by_worker=by_worker,
            finished_recving=recved, sampled=sampled, finished=finished, computed=computed,
            tables=tables, handoffs=self._handoffs, junctions=junctions)
        self.records.append(record)
        self.step_count += 1
        return record

    # ---------------------------------------------------------------- the operator
    def in_flight(self) -> dict[int, str]:
        """Jobs shipped and not yet acknowledged by every worker -> their requests."""
        return {j: r for j, (r, _, _) in sorted(self._in_flight.items())}

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """The operator's reset between two steps, the connector's cache with it
        (`Scheduler.reset_prefix_cache(reset_running_requests, reset_connector=True)`).
        Returns the Scheduler's answer (False while running requests hold GPU blocks and
        are not reset: the GPU prefix cache stays, the connector's is reset all the
        same)."""
        in_flight = self.in_flight()
        holders = {r: self.status(r) for r in sorted(set(in_flight.values()))}
        result = bool(self._call("reset_prefix_cache", self.run.scheduler.reset_prefix_cache,
                                 reset_running_requests=reset_running_requests,
                                 reset_connector=True))
        self.resets.append(ResetRecord(after_step=self.step_count, result=result,
                                       in_flight=in_flight, holders=holders))
        return result

    # ---------------------------------------------------------------- state
    def status(self, req_id: str) -> str:
        return str(self.requests[req_id].status.name)

    def unfinished(self) -> list[str]:
        return [r for r, req in self.requests.items() if not req.is_finished()]

    def idle(self) -> bool:
        """No request left in the Scheduler (finished ones released too) and no ack due."""
        return not self.unfinished() and not self.run.scheduler.has_requests() \
            and not self._in_flight

    def stalled(self) -> bool:
        """Every unfinished request has made no progress for `stall_steps`, nothing was
        scheduled in that time and no ack is due: the run cannot move on."""
        k = self.step_count
        recent = self.records[-self.stall_steps:]
        return (bool(self.unfinished()) and len(recent) == self.stall_steps
                and not self._in_flight and all(not r.scheduled for r in recent)
                and all(k - self._last_progress[r] >= self.stall_steps
                        for r in self.unfinished()))

    def stuck(self) -> dict[str, StuckRequest]:
        """The waiting requests that were not scheduled for `stall_steps` steps or more."""
        offloading = getattr(self.run.connector, "connector_scheduler", None)
        table = getattr(offloading, "_req_status", {})
        jobs = getattr(offloading, "_jobs", {})
        out: dict[str, StuckRequest] = {}
        for req_id in self.unfinished():
            idle = self.step_count - self._last_progress[req_id]
            if idle < self.stall_steps or self.status(req_id) == "RUNNING":
                continue
            held = sorted(int(j) for j in getattr(table.get(req_id), "transfer_jobs", ()))
            out[req_id] = StuckRequest(req_id=req_id, status=self.status(req_id),
                                       idle_steps=idle, transfer_jobs=held,
                                       stale_jobs=[j for j in held if j not in jobs])
        return out

    def summary(self, error: HookError | None = None) -> RunSummary:
        return RunSummary(
            steps=self.step_count, idle=self.idle(), finished=list(self.finished),
            unfinished=self.unfinished(), stuck=self.stuck(), error=error,
            records=list(self.records), resets=list(self.resets),
            output_tokens={r: list(req.output_token_ids) for r, req in self.requests.items()})

    def run_until_idle(self, max_steps: int) -> RunSummary:
        """Steps until idle, until the run stalls (see `stall_steps`), until a hook raises
        (recorded, not raised) or until `max_steps` more steps were taken."""
        error: HookError | None = None
        for _ in range(max_steps):
            if self.idle() or self.stalled():
                break
            try:
                self.step()
            except HookError as e:
                error = e
                break
        return self.summary(error)


# ----------------------------------------------------------------------------- scenario
SHARED_PREFIX_BLOCKS = 3
# (arrival step, shares the prefix, prompt tokens beyond the prefix or in all, max tokens)
_SCENARIO: tuple[tuple[int, bool, int, int], ...] = (
    (0, True, 32, 12), (2, False, 42, 10), (5, True, 27, 5), (7, False, 88, 10),
    (10, True, 21, 10), (11, False, 62, 9), (11, True, 29, 11), (11, False, 44, 6),
)
SCENARIO_GPU_BLOCKS = 10
"""GPU blocks (one of them vLLM's null block) the scenario is sized for: few enough that
the Scheduler preempts."""
SCENARIO_WINDOW = 49
"""The sliding window, in tokens, of the scenario on a model with a window: three 16-token
blocks and a token, so that a running request's window frees blocks while it prefills and
decodes."""


@dataclass(frozen=True)
class ScenarioRequest:
    req_id: str
    arrives: int
    """The step before which it is added."""
    prompt: tuple[int, ...]
    max_tokens: int
    shares_prefix: bool


def scenario_requests(block_size: int = 16, *, seed: int = 0) -> list[ScenarioRequest]:
    """Eight requests arriving over steps 0 to 11; the even-numbered (r0, r2, r4, r6) share
    a `SHARED_PREFIX_BLOCKS`-block prefix. Prompts of 2 to 5 blocks and a part, 5 to 12
    output tokens. The seed draws the token ids."""
    rng = random.Random(f"core-scenario:{seed}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    shared = tokens(SHARED_PREFIX_BLOCKS * block_size)
    scale = block_size / 16
    out: list[ScenarioRequest] = []
    for i, (arrives, shares, length, max_tokens) in enumerate(_SCENARIO):
        n = max(1, round(length * scale))
        prompt = shared + tokens(n) if shares else tokens(n)
        out.append(ScenarioRequest(req_id=f"r{i}", arrives=arrives, prompt=tuple(prompt),
                                   max_tokens=max_tokens, shares_prefix=shares))
    return out


def _reset_moment(driver: CoreDriver, earliest: int, latest: int) -> bool:
    """Reset now? From step `earliest`: when a waiting request (preempted or new, not
    loading) holds a job in flight and no running or loading request holds one (a request
    left with a stale id on a buggy release then simply waits); from step `latest` as soon
    as anything is in flight."""
    k = driver.step_count
    in_flight = driver.in_flight()
    if k < earliest or not in_flight:
        return False
    if k >= latest:
        return True
    statuses = {driver.status(r) for r in in_flight.values()}
    waiting = {"WAITING", "PREEMPTED"}
    return bool(statuses & waiting) and all(s in waiting or s.startswith("FINISHED")
                                            for s in statuses)


RESET_OUTCOMES = ("finishes", "strands", "crashes")


def reset_outcome() -> str:
    """Where `scenario`'s reset leads on the vLLM under test (two workers): "finishes" with
    the fix of PR #48102 (0.26+: every request finishes); "strands" with the bug where a
    lookup of a request holding jobs answers "not yet" (0.24-0.25: the preempted holder of
    the stale id waits for ever); "crashes" with the bug and no such deferral (0.22-0.23:
    the holder is admitted again and its next store raises KeyError on the stale id)."""
    from conformance import vllm_env

    if vllm_env.has("fix_48102"):
        return "finishes"
    return "strands" if vllm_env.has("lookup_defers_in_flight") else "crashes"


def scenario(run: CoreRun, *, seed: int = 0, max_steps: int = 300,
             reset_earliest: int = 4, reset_latest: int = 40,
             requests: Sequence[ScenarioRequest] | None = None) -> RunSummary:
    """The end-to-end run: `scenario_requests` arrive over the first steps; one
    `reset_prefix_cache` (the connector's with it) while jobs are in flight (see
    `_reset_moment`); then steps until idle (or stalled, or a hook raised). Over
    `SCENARIO_GPU_BLOCKS` GPU blocks the Scheduler preempts running requests; requests
    sharing the prefix, and preempted ones, load what the CPU cache has.

    The reset waits for a moment when only waiting requests hold jobs in flight: a
    request preempted while its store is half acknowledged (two workers, split acks). On a
    release with the PR #48102 bug that request keeps the stale id, the connector answers
    None for it every step (offloading/scheduler.py:674-679 of v0.25.1) and it never runs
    again.
    With one worker no such moment comes (a preempted request's jobs are all acknowledged
    in the step that reports the preemption); the reset then comes at `reset_latest` with
    whatever is in flight, and a running request left holding a stale id makes 0.22-0.25's
    `build_connector_meta` raise KeyError at its next store (the check that a request's
    jobs are stores looks the stale id up in `_jobs`: vllm/distributed/kv_transfer/
    kv_connector/v1/offloading/scheduler.py:994 of v0.25.1); the summary records it."""
    driver = CoreDriver(run, seed=seed)
    if requests is None:
        requests = scenario_requests(run.block_size, seed=seed)
    pending = sorted(requests, key=lambda r: r.arrives)
    reset_done = False
    error: HookError | None = None
    for _ in range(max_steps):
        while pending and pending[0].arrives <= driver.step_count:
            r = pending.pop(0)
            driver.add_request(r.req_id, list(r.prompt), r.max_tokens)
        if not reset_done and _reset_moment(driver, reset_earliest, reset_latest):
            driver.reset_prefix_cache()
            reset_done = True
        if not pending and (driver.idle() or driver.stalled()):
            break
        try:
            driver.step()
        except HookError as e:
            error = e
            break
    return driver.summary(error)


__all__ = ["SCENARIO_GPU_BLOCKS", "SHARED_PREFIX_BLOCKS", "CoreDriver", "CoreHarnessError",
           "CoreRun", "HookError", "ResetRecord", "RunSummary", "ScenarioRequest",
           "StepRecord", "StuckRequest", "make_core_scheduler", "scenario",
           "scenario_requests"]
