"""`VllmTieringSystem`: vLLM 0.33.0's own `TieringOffloadingManager`, with its real
filesystem tier, as a `statemachine.tiering.system.TieringSystem`.

What is real: the manager comes out of vLLM's own construction path,
`OffloadingSpecFactory.create_spec(OffloadingConfig(...)).get_manager()` with
``spec_name = "TieringOffloadingSpec"`` (TS:366-467): a scheduler-side `SharedOffloadRegion`
in ``/dev/shm`` (one page per chunk), a `CPUPrimaryTierOffloadingManager` (LRU) over it, and
one `FileSystemTierManager` per secondary tier (``"type": "fs"``, built by vLLM's
`SecondaryTierFactory`), each on a temporary directory of its own with one read-priority and
one write-priority I/O thread. The `OffloadingConfig` is written out field by field (one KV
cache group, one block per chunk, one worker, 4096 KV bytes per block): no `VllmConfig` and
no model are needed for the scheduler-side manager. The tier-poll thread is off
(``tier_poll_interval_s = 0``; the filesystem tier does not ask for it anyway, TB:167-175).
Every manager call is made under the manager's lock, as the connector makes it.

Keys: the machine's keys are strings; key ``k`` is vLLM's ``make_offload_key(sha256(k), 0)``
(B:30-32), so its file name (`FileMapper.get_file_name`) is a function of the string. Request
ids are the machine's. Each request has one `ReqContext` (as the connector keeps one per
request); a key's position in it (`set_offload_key_position`, which the LRU policy orders a
request's keys by) is its order of first appearance in the request's calls, counting from 1:
the machine looks a request's keys up in prefix order and stores the rest in order, so that
is the key's chunk index in the prompt, as the connector's end tokens are.

Determinism. vLLM's filesystem tier works on two kinds of threads:
- its I/O thread pool (`DualQueueThreadPool`, TP): ``submit_store``/``submit_load`` (TF:222-276)
  enqueue one task per job, a pool thread runs it and appends ``(job_id, success)`` to the
  pool's finished queue, which the manager's next poll reads (TM:501-549);
- its existence probe (`AsyncLookupManager`, TAL): a lookup of an unknown key answers RETRY
  and adds the key to a batch (TAL:144-165); ``on_schedule_end`` flushes the batch onto the
  probe thread's queue (TAL:167-189, TF:341-343); the thread posts the verdicts on a result
  queue (TAL:254-290), which the tier drains at the first lookup after a flush, or at the next
  flush (TAL:153-155, TAL:191-218).

Left alone, both race the machine's rules. So the adapter *holds* the work they are handed,
and releases it only in `run_tier_io`:
- each tier's pool gets instance attributes ``enqueue_load``/``enqueue_store`` that hold the
  job (id, task count, tasks) in the adapter, in submission order; the pool's own methods,
  queues and threads are untouched;
- each tier's probe manager gets, in place of its ``_lookup_queue``, a queue that holds every
  batch ``flush`` posts, in order (the shutdown sentinel goes straight through; the probe
  thread's ``get`` still reads the real queue), and in place of its ``_pending_results``, a
  queue that counts what the probe thread posts.

`run_tier_io` releases the held work one item at a time, tier by tier in tier order, each tier's
jobs and probe batches in the order they were handed over (one queue per tier, as the
reference's tiers run their jobs and probes as tasks of one executor, in order). A job goes to
the pool's real enqueue method, then the adapter waits, under the pool's own condition variable,
for the pool to be idle (the predicate of `wait_idle`, TP:138-147: the job's task ran and its
result is in the finished queue); a probe batch goes onto the real probe queue, then the adapter
waits for the probe thread to have posted a verdict for every key of the batch (the thread
answers each key once: 0.33.0 posts a batch's verdicts as one result item, TAL:271-290; 0.34.0
posts one item per request of the batch, as each request's probe ends, TAL@0.34.0:301-321, so
the adapter counts verdicts, not items). Each wait has a timeout (`io_timeout_s`, default 30 s)
and raises `TierIOTimeout` when it expires: nothing is waited for blindly, and nothing sleeps.
After `run_tier_io` the results wait where vLLM leaves them (the pool's finished queue, the
probe's result queue) for vLLM's own next poll or drain. So between two rules no vLLM thread has
anything to do, and the projected state after each rule is a function of the rules so far.

`reset` first releases all the held work in the same way, then calls `reset_cache`: vLLM's
reset drains the pool itself (``drain_jobs`` = ``wait_idle``, TM:1164-1169, TF:333-336), which
would otherwise find the held jobs not yet enqueued and trip ``assert not self._jobs``
(TM:1169). The probe thread takes no part in vLLM's drain; releasing its held batches too is
one of vLLM's interleavings (the thread was quicker than the reset), the one the reference's
drain takes (its probes are tasks of the same executor).

Fault injection (`fail_next_io`): real I/O errors inside vLLM's own I/O code. The fs I/O
module's ``os`` (TIO, which calls ``os.write`` in a store and ``os.readv`` in a load,
TIO:90-171) is replaced, once per process, by a proxy of the real module whose ``write`` and
``readv`` raise ``OSError(EIO)`` on a thread that is running a task marked to fail, and
delegate otherwise. `fail_next_io(tier)` marks the next job of that tier that `run_tier_io` (or
`reset`) releases (several calls mark as many jobs): its task runs under the mark, so its first
write (a store: the temporary file is removed, nothing is published, TIO:133-138) or its first
read (a load: nothing is loaded, TF:249-274) fails, and vLLM's pool reports the job failed
(TP:178-194). The C extension `vllm.fs_io_C` would bypass the proxy: it does not load on this
CPU-only machine (`_HAS_FSIO_C` is False: the pure-Python path runs), and `fail_next_io`
refuses to arm where it does.

A second fault, `truncate_copy(tier, key)`, cuts a copy's file to half a slot (disk
corruption): vLLM's next read of it is short, removes the file and fails the read, keeping the
keys the job read before it (TIO:141-168, TF:297-316).

One observation, no change: each tier's ``get_finished_jobs`` is wrapped (called through, its
results returned unchanged) to notice a promotion that failed part way with two failed keys or
more. vLLM frees their slots in the iteration order of a Python set (TM:469-476), which
depends on PYTHONHASHSEED; `free_order_unspecified` then turns True and the machine compares
slots up to renaming (translation FREE-ORDER, finding T3).

`project()` reads vLLM's fields onto `spec.tiering.TieringState`, each state by the
``vllm_predicate`` of its table (``spec/tiering/*.py``):
- cpu_chunk: the keys of ``primary_tier._policy.chunks``; ``ref_cnt == -1`` is
  PROMOTION_QUEUED if the key is in ``_pending_load_submissions[tier][req_id].keys``,
  PROMOTING if it is in the keys of an ``is_promotion`` job of ``_jobs``, else
  WRITE_PENDING; ``ref_cnt == 0`` is READY; ``ref_cnt > 0`` is PINNED with ``readers =
  ref_cnt``; ``slot = chunk_id``;
- tier_copy: a ``.bin`` file at ``file_mapper.get_file_name(key)`` is a copy; it is READING
  while a promotion job of that tier reads the key and has not reported (its I/O has not run),
  else STORED; a key of a cascade job of that tier that has not reported and whose file does
  not exist yet is WRITING;
- tier_job: every job of ``_jobs`` (SUBMITTED, or REPORTED once its id is in the tier pool's
  finished queue) and every entry of ``_pending_load_submissions`` (QUEUED, no id);
- tier_request: the entries of ``_req_state`` (ACTIVE unless ``is_finished``, then
  FINISH_PENDING; ``pending_stores = pending_primary_stores``);
- ``promotions_held = _promotions_held``; ``num_slots = primary_tier._num_chunks``;
  ``free_slots = primary_tier._get_num_free_chunks()`` (the free list plus the chunks never
  allocated, M:100-101); vLLM quarantines nothing.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import itertools
import logging
import mmap
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import conformance.vllm_env  # noqa: F401  (before vLLM: offline, quiet, temporary caches)
from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.state import (
    CpuChunk,
    TierCopy,
    TieringState,
    TierJobRecord,
    TierRequestRecord,
)
from statemachine.tiering.system import Answer

SLOT_BYTES = mmap.PAGESIZE
"""KV bytes of one CPU chunk: one page (`SharedOffloadRegion` needs whole pages, SR:121)."""


class TierIOTimeout(AssertionError):
    """A vLLM thread did not finish the work the adapter released within the timeout."""


# ----------------------------------------------------------------------------- vLLM, lazily
@functools.cache
def _v() -> Any:
    """vLLM's tiering classes (imported on first use)."""
    import importlib
    from types import SimpleNamespace

    def mod(name: str) -> Any:
        return importlib.import_module(name)

    base = mod("vllm.v1.kv_offload.base")
    config = mod("vllm.v1.kv_offload.config")
    return SimpleNamespace(
        make_offload_key=base.make_offload_key,
        ReqContext=base.ReqContext,
        ScheduleEndContext=base.ScheduleEndContext,
        LookupResult=base.LookupResult,
        OffloadingConfig=config.OffloadingConfig,
        OffloadingGroupConfig=config.OffloadingGroupConfig,
        OffloadingModelConfig=config.OffloadingModelConfig,
        OffloadingCacheConfig=config.OffloadingCacheConfig,
        OffloadingParallelConfig=config.OffloadingParallelConfig,
        OffloadingSpecFactory=mod("vllm.v1.kv_offload.factory").OffloadingSpecFactory,
        TieringOffloadingManager=mod("vllm.v1.kv_offload.tiering.manager")
        .TieringOffloadingManager,
        FileSystemTierManager=mod("vllm.v1.kv_offload.tiering.fs.manager")
        .FileSystemTierManager,
        fs_io=mod("vllm.v1.kv_offload.tiering.fs.io"),
        fs_manager=mod("vllm.v1.kv_offload.tiering.fs.manager"),
    )


# ----------------------------------------------------------------------------- faults
_FAULT = threading.local()
"""``_FAULT.active`` is True on a pool thread while it runs a task marked to fail."""


class _FaultyOs:
    """The real `os` module, except that ``write`` and ``readv`` raise EIO on a thread that
    runs a task marked to fail."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def write(self, fd: int, data: Any) -> int:
        if getattr(_FAULT, "active", False):
            raise OSError(errno.EIO, "injected I/O error (kvspec fail_next_io)")
        return int(self._real.write(fd, data))

    def readv(self, fd: int, buffers: Any) -> int:
        if getattr(_FAULT, "active", False):
            raise OSError(errno.EIO, "injected I/O error (kvspec fail_next_io)")
        return int(self._real.readv(fd, buffers))


_PATCH_LOCK = threading.Lock()


def _install_fault_proxy() -> bool:
    """Put `_FaultyOs` in place of the fs I/O module's ``os`` (once per process). False where
    vLLM's C I/O extension is loaded (its reads and writes would not pass through it)."""
    io = _v().fs_io
    if getattr(io, "_HAS_FSIO_C", False):
        return False
    with _PATCH_LOCK:
        if not isinstance(io.os, _FaultyOs):
            io.os = _FaultyOs(io.os)
    return True


def _failing(task: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        _FAULT.active = True
        try:
            return task()
        finally:
            _FAULT.active = False

    return run


# ----------------------------------------------------------------------------- held work
@dataclass
class _HeldJob:
    tier: int
    kind: str
    """"load" or "store" (the pool queue vLLM chose)."""
    job_id: int
    n_tasks: int
    tasks: list[Callable[[], Any]]
    enqueue: Callable[..., None]
    """The pool's own enqueue method."""


@dataclass
class _HeldProbe:
    tier: int
    batch: Any
    """The batch ``flush`` posted (a list of (key, req_context, generation))."""


class _HeldLookupQueue:
    """Stands for a probe manager's ``_lookup_queue``: ``put`` holds each batch in the
    adapter (the shutdown sentinel goes through), ``get`` reads the real queue."""

    def __init__(self, real: Any, hold: Callable[[Any], None]) -> None:
        self.real = real
        self._hold = hold

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is None:
            self.real.put(None)
        else:
            self._hold(item)

    put_nowait = put

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self.real.get(block, timeout)

    def empty(self) -> bool:
        return bool(self.real.empty())


class _CountingResults:
    """Stands for a probe manager's ``_pending_results``: counts the verdicts the probe
    thread posts (an item is a list of (key, generation, found)), so the adapter can wait for
    every key of a batch it released."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.verdicts = 0
        self.cond = threading.Condition()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.real.put(item)
        with self.cond:
            self.verdicts += len(item)
            self.cond.notify_all()

    def get_nowait(self) -> Any:
        return self.real.get_nowait()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self.real.get(block, timeout)

    def empty(self) -> bool:
        return bool(self.real.empty())


@dataclass
class _Tier:
    index: int
    manager: Any
    """vLLM's `FileSystemTierManager`."""
    root: str
    results: _CountingResults
    released_keys: int = 0
    """The keys of the probe batches released so far: each gets one verdict."""
    failures_armed: int = 0


def key_hash(key: str) -> bytes:
    """The block hash of the machine's key `key` (32 bytes)."""
    return hashlib.sha256(key.encode()).digest()


_ENGINE_IDS = itertools.count()
_LIVE: weakref.WeakSet[VllmTieringSystem] = weakref.WeakSet()
"""Systems not closed yet: closed at exit, so that no shared-memory region outlives the
process (a test that fails before its teardown)."""


@atexit.register
def _close_all() -> None:
    for system in list(_LIVE):
        system.close()


@dataclass(eq=False)
class VllmTieringSystem:
    """vLLM 0.33.0's `TieringOffloadingManager` over a CPU tier of `num_slots` chunks and
    `num_tiers` filesystem tiers, as a `TieringSystem` (see the module docstring)."""

    num_slots: int = 4
    num_tiers: int = 1
    io_timeout_s: float = 30.0
    eviction_policy: str = "lru"
    name: str = "vllm"
    slot_bytes: int = field(default=SLOT_BYTES, init=False)
    root: str = field(default="", init=False)
    manager: Any = field(default=None, init=False, repr=False)
    tiers: list[_Tier] = field(default_factory=list, init=False, repr=False)
    held: list[_HeldJob | _HeldProbe] = field(default_factory=list, init=False, repr=False)
    contexts: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    positions: dict[str, dict[str, int]] = field(default_factory=dict, init=False,
                                                 repr=False)
    keys: dict[bytes, str] = field(default_factory=dict, init=False, repr=False)
    """vLLM's key -> the machine's key, for every key the adapter made."""
    faults_supported: bool = field(default=False, init=False)
    _load_keys: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """Promotion job id -> its key count."""
    free_order_unspecified: bool = field(default=False, init=False)
    """True once vLLM freed the slots of a partly failed promotion: it frees them in the
    iteration order of a Python set of keys (TM:469-476, M:393-400), which depends on
    PYTHONHASHSEED, so from then on the slot a later allocation takes is not a function of
    the calls (translation FREE-ORDER: the machine compares slots up to renaming)."""

    def __post_init__(self) -> None:
        v = _v()
        self.faults_supported = _install_fault_proxy()
        # the pool logs every failed task at error level; the failures show in the state
        logging.getLogger("vllm.v1.kv_offload.tiering.fs.thread_pool").setLevel(
            logging.CRITICAL)
        self.root = tempfile.mkdtemp(prefix="kvspec-tiering-")
        tier_configs = []
        for t in range(self.num_tiers):
            path = os.path.join(self.root, f"tier{t}")
            os.makedirs(path)
            tier_configs.append({"type": "fs", "root_dir": path, "n_read_threads": 1,
                                 "n_write_threads": 1})
        engine_id = f"kvspec-tiering-{os.getpid()}-{next(_ENGINE_IDS)}"
        config = v.OffloadingConfig(
            groups=(v.OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",),
                                            group_id=0),),
            worker_kv_bytes_per_block=SLOT_BYTES,
            enable_kv_cache_events=False,
            extra_config={"spec_name": "TieringOffloadingSpec",
                          "cpu_bytes_to_use": self.num_slots * SLOT_BYTES,
                          "eviction_policy": self.eviction_policy,
                          "tier_poll_interval_s": 0,
                          "secondary_tiers": tier_configs},
            engine_id=engine_id,
            model=v.OffloadingModelConfig(name="kvspec-tiering", dtype="float32"),
            cache=v.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=v.OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False),
        )
        try:
            manager = v.OffloadingSpecFactory.create_spec(config).get_manager()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.manager = manager
        _LIVE.add(self)
        try:
            self._wire(manager)
        except BaseException:
            self.close()
            raise

    def _wire(self, manager: Any) -> None:
        v = _v()
        if not isinstance(manager, v.TieringOffloadingManager):
            raise RuntimeError(f"expected a TieringOffloadingManager, got {type(manager)}")
        if manager._tier_poll_thread is not None:
            raise RuntimeError("the tier-poll thread is running (tier_poll_interval_s 0?)")
        primary = manager.primary_tier
        if primary._num_chunks != self.num_slots:
            raise RuntimeError(f"asked for {self.num_slots} CPU chunks, vLLM made "
                               f"{primary._num_chunks}")
        view = primary.get_kv_memoryview()
        if view.strides[0] != SLOT_BYTES:
            raise RuntimeError(f"chunk stride {view.strides[0]}, expected {SLOT_BYTES}")
        for t, tier in enumerate(manager.secondary_tiers):
            if not isinstance(tier, v.FileSystemTierManager):
                raise RuntimeError(f"tier {t} is a {type(tier).__name__}")
            pool = tier._pool
            pool.enqueue_load = functools.partial(self._hold_job, t, "load",
                                                  pool.enqueue_load)
            pool.enqueue_store = functools.partial(self._hold_job, t, "store",
                                                   pool.enqueue_store)
            lookups = tier._lookup_manager
            results = _CountingResults(lookups._pending_results)
            lookups._pending_results = results
            lookups._lookup_queue = _HeldLookupQueue(
                lookups._lookup_queue, functools.partial(self._hold_probe, t))
            root = os.path.join(self.root, f"tier{t}")
            self.tiers.append(_Tier(t, tier, root, results))
            tier.get_finished_jobs = functools.partial(self._observe_results,
                                                       tier.get_finished_jobs)

    # --- holding and releasing the tiers' work ----------------------------------------
    def _hold_job(self, tier: int, kind: str, enqueue: Callable[..., None], job_id: int,
                  n_tasks: int, tasks: Any) -> None:
        if kind == "load":
            self._load_keys[int(job_id)] = len(self.manager._jobs[int(job_id)]
                                               .transfer_job.keys)
        self.held.append(_HeldJob(tier, kind, int(job_id), int(n_tasks), list(tasks), enqueue))

    def _observe_results(self, get_finished_jobs: Callable[[], Any]) -> Any:
        """The tier's own `get_finished_jobs`, called through; notes a partly failed
        promotion that frees two slots or more (their order is a set's)."""
        results = list(get_finished_jobs())
        for r in results:
            n = self._load_keys.pop(int(r.job_id), None)
            if n is not None and not r.success and r.successful_keys \
                    and n - len(r.successful_keys) >= 2:
                self.free_order_unspecified = True
        return results

    def _hold_probe(self, tier: int, batch: Any) -> None:
        self.held.append(_HeldProbe(tier, batch))

    def _release(self, item: _HeldJob | _HeldProbe) -> None:
        tier = self.tiers[item.tier]
        if isinstance(item, _HeldJob):
            tasks = item.tasks
            if tier.failures_armed:
                tier.failures_armed -= 1
                tasks = [_failing(task) for task in tasks]
            item.enqueue(item.job_id, item.n_tasks, tasks)
            pool = tier.manager._pool
            with pool._condition:
                idle = pool._condition.wait_for(lambda: pool._inflight_jobs == 0,
                                                timeout=self.io_timeout_s)
            if not idle:
                raise TierIOTimeout(f"tier {item.tier}: job {item.job_id} ({item.kind}) did "
                                    f"not finish within {self.io_timeout_s} s")
            return
        results = tier.results
        tier.released_keys += len(item.batch)
        want = tier.released_keys
        lookup_queue: Any = tier.manager._lookup_manager._lookup_queue
        lookup_queue.real.put(item.batch)
        with results.cond:
            done = results.cond.wait_for(lambda: results.verdicts >= want,
                                         timeout=self.io_timeout_s)
        if not done:
            raise TierIOTimeout(f"tier {item.tier}: the existence probe posted "
                                f"{results.verdicts - (want - len(item.batch))} of the "
                                f"{len(item.batch)} verdicts of its batch within "
                                f"{self.io_timeout_s} s")

    def _run_held(self) -> None:
        """Release the held work tier by tier (in tier order), each tier's jobs and probe
        batches in the order they were handed over."""
        for t in range(len(self.tiers)):
            mine = [h for h in self.held if h.tier == t]
            for item in mine:
                self.held.remove(item)
                self._release(item)

    # --- keys and requests --------------------------------------------------------------
    def vkey(self, key: str) -> bytes:
        k: bytes = _v().make_offload_key(key_hash(key), 0)
        self.keys.setdefault(k, key)
        return k

    def mkey(self, vkey: bytes) -> str:
        try:
            return self.keys[bytes(vkey)]
        except KeyError:
            raise AssertionError(f"vLLM returned a key the adapter never made: {vkey!r}"
                                 ) from None

    def _ctx(self, req_id: str, keys: Sequence[str] = ()) -> Any:
        ctx = self.contexts[req_id]
        pos = self.positions[req_id]
        for k in keys:
            if k not in pos:
                pos[k] = len(pos) + 1
                ctx.set_offload_key_position(self.vkey(k), pos[k])
        return ctx

    # --- vLLM's manager calls -------------------------------------------------------------
    def new_request(self, req_id: str) -> None:
        ctx = _v().ReqContext(req_id=req_id)
        self.contexts[req_id] = ctx
        self.positions[req_id] = {}
        with self.manager.lock:
            self.manager.on_new_request(ctx)

    def lookup(self, req_id: str, key: str) -> Answer:
        ctx = self._ctx(req_id, [key])
        with self.manager.lock:
            result = self.manager.lookup(self.vkey(key), ctx)
        name = str(result.name)
        assert name in ("HIT", "HIT_PENDING", "RETRY", "MISS"), name
        return name  # type: ignore[return-value]

    def prepare_load(self, req_id: str, keys: Sequence[str]) -> tuple[int, ...]:
        ctx = self._ctx(req_id, keys)
        with self.manager.lock:
            spec = self.manager.prepare_load([self.vkey(k) for k in keys], ctx)
        return tuple(int(c) for c in spec.chunk_ids)

    def complete_load(self, req_id: str, keys: Sequence[str]) -> None:
        ctx = self._ctx(req_id, keys)
        with self.manager.lock:
            self.manager.complete_load([self.vkey(k) for k in keys], ctx)

    def prepare_store(self, req_id: str, keys: Sequence[str]
                      ) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        ctx = self._ctx(req_id, keys)
        with self.manager.lock:
            out = self.manager.prepare_store([self.vkey(k) for k in keys], ctx)
        if out is None:
            return None
        return (tuple(self.mkey(k) for k in out.keys_to_store),
                tuple(int(c) for c in out.store_spec.chunk_ids))

    def complete_store(self, req_id: str, keys: Sequence[str], success: bool) -> None:
        ctx = self._ctx(req_id, keys)
        with self.manager.lock:
            self.manager.complete_store([self.vkey(k) for k in keys], ctx, success)

    def request_finished(self, req_id: str) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(self.contexts[req_id])

    def end_step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(_v().ScheduleEndContext(new_req_ids=(),
                                                                 preempted_req_ids=()))

    def reset(self) -> None:
        self._run_held()  # vLLM's drain_jobs waits for the jobs (TM:1164-1165)
        with self.manager.lock:
            self.manager.reset_cache()

    def reset_flushed(self) -> None:
        with self.manager.lock:
            self.manager.on_reset_flushed()

    # --- the test's controls ------------------------------------------------------------
    def run_tier_io(self) -> None:
        self._run_held()

    def fail_next_io(self, tier: int) -> bool:
        if not self.faults_supported:
            return False
        self.tiers[tier].failures_armed += 1
        return True

    def _flat(self) -> memoryview:
        return memoryview(self.manager.primary_tier.get_kv_memoryview()).cast("B")

    def write_slot(self, slot: int, data: bytes) -> None:
        if len(data) != SLOT_BYTES:
            raise ValueError(f"a slot holds {SLOT_BYTES} bytes, got {len(data)}")
        with self._flat() as flat:
            flat[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES] = data

    def read_slot(self, slot: int) -> bytes:
        with self._flat() as flat:
            return bytes(flat[slot * SLOT_BYTES:(slot + 1) * SLOT_BYTES])

    def truncate_copy(self, tier: int, key: str) -> bool:
        """Cut tier `tier`'s copy of `key` to half a slot (a corrupt file); False when there
        is no copy. vLLM finds it at the next read: a short read, the file is removed and
        the read fails (TIO:141-168)."""
        path = self.copy_path(tier, key)
        if not os.path.exists(path):
            return False
        os.truncate(path, SLOT_BYTES // 2)
        return True

    def copy_path(self, tier: int, key: str) -> str:
        """Where vLLM's tier `tier` keeps its copy of `key`."""
        return str(self.tiers[tier].manager.file_mapper.get_file_name(self.vkey(key)))

    def held_items(self) -> list[str]:
        """The work held for `run_tier_io`, in order (for traces)."""
        return [f"t{h.tier} {h.kind} job {h.job_id}" if isinstance(h, _HeldJob)
                else f"t{h.tier} probe of {len(h.batch)} key(s)" for h in self.held]

    # --- projection -----------------------------------------------------------------------
    def _files(self, tier: _Tier) -> tuple[set[str], list[str]]:
        """The machine keys whose copy file exists, and stray files (temporaries, unknown
        names)."""
        names = {self.copy_path(tier.index, k): k for k in set(self.keys.values())}
        found: set[str] = set()
        stray: list[str] = []
        for dirpath, _dirs, files in os.walk(tier.root):
            for f in files:
                path = os.path.join(dirpath, f)
                if path in names:
                    found.add(names[path])
                elif f != "config.json":
                    stray.append(path)
        return found, stray

    def stray_files(self) -> list[str]:
        """Files in the tiers' directories that are neither a copy nor the config: a
        temporary left behind would be one."""
        return [p for t in self.tiers for p in self._files(t)[1]]

    def project(self) -> TieringState:
        m = self.manager
        primary = m.primary_tier
        queued: dict[str, tuple[int, str]] = {}
        jobs: list[TierJobRecord] = []
        for tier_idx, by_req in sorted(m._pending_load_submissions.items()):
            for req_id, entry in sorted(by_req.items()):
                keys = tuple(self.mkey(k) for k in entry.keys)
                for k in keys:
                    queued[k] = (tier_idx, req_id)
                jobs.append(TierJobRecord("promotion", tier_idx, req_id, keys,
                                          tuple(int(c) for c in entry.chunk_ids), TJ.QUEUED))
        reported = {t.index: {int(j) for j, _ok, _time in list(t.manager._pool._finished_q)}
                    for t in self.tiers}
        promoting: set[str] = set()
        reading: set[tuple[int, str]] = set()
        writing: set[tuple[int, str]] = set()
        for job_id, meta in sorted(m._jobs.items()):
            job = meta.transfer_job
            keys = tuple(self.mkey(k) for k in job.keys)
            done = int(job_id) in reported[meta.tier_idx]
            kind = "promotion" if job.is_promotion else "cascade"
            jobs.append(TierJobRecord(kind, int(meta.tier_idx), str(job.req_context.req_id),
                                      keys, tuple(int(c) for c in job.chunk_ids),
                                      TJ.REPORTED if done else TJ.SUBMITTED, int(job_id)))
            if job.is_promotion:
                promoting.update(keys)
            if not done:
                for k in keys:
                    (reading if job.is_promotion else writing).add((int(meta.tier_idx), k))
        cpu: list[CpuChunk] = []
        for vk, chunk in primary._policy.chunks.items():
            key = self.mkey(vk)
            ref = int(chunk.ref_cnt)
            if ref < 0:
                state = (CC.PROMOTION_QUEUED if key in queued
                         else CC.PROMOTING if key in promoting else CC.WRITE_PENDING)
            elif ref == 0:
                state = CC.READY
            else:
                state = CC.PINNED
            cpu.append(CpuChunk(key, state, int(chunk.chunk_id), ref if ref > 0 else 0))
        copies: list[TierCopy] = []
        for t in self.tiers:
            found, _stray = self._files(t)
            for k in sorted(found):
                copies.append(TierCopy(t.index, k, TC.READING if (t.index, k) in reading
                                       else TC.STORED))
            for tier_idx, k in sorted(writing):
                if tier_idx == t.index and k not in found:
                    copies.append(TierCopy(t.index, k, TC.WRITING))
        requests = [TierRequestRecord(req_id, TR.FINISH_PENDING if st.is_finished
                                      else TR.ACTIVE, int(st.pending_primary_stores))
                    for req_id, st in m._req_state.items()]
        return TieringState.build(
            cpu=cpu, copies=copies, jobs=jobs, requests=requests,
            promotions_held=bool(m._promotions_held), num_slots=int(primary._num_chunks),
            free_slots=int(primary._get_num_free_chunks()), quarantined_slots=frozenset())

    # --- vLLM's own state, for scenario tests -------------------------------------------
    def probe_verdict(self, tier: int, key: str) -> bool | str | None:
        """The fs tier's cached existence verdict for `key`: True, False, None (in flight or
        pending), or "absent" when the probe keeps no state for it (TAL:60-67)."""
        st = self.tiers[tier].manager._lookup_manager._lookup_state.get(self.vkey(key))
        if st is None:
            return "absent"
        return None if st.result is None else bool(st.result)

    def close(self) -> None:
        m, self.manager = self.manager, None
        _LIVE.discard(self)
        try:
            if m is not None:
                m.shutdown()
        finally:
            self.held.clear()
            shutil.rmtree(self.root, ignore_errors=True)


def make_vllm_tiering_system(num_slots: int, num_tiers: int) -> VllmTieringSystem:
    return VllmTieringSystem(num_slots=num_slots, num_tiers=num_tiers)


__all__ = ["SLOT_BYTES", "TierIOTimeout", "VllmTieringSystem", "key_hash",
           "make_vllm_tiering_system"]
