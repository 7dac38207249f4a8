"""Secondary tiers: what vLLM's `SecondaryTierManager` (TB:135-392) asks of a tier, with the
bookkeeping every tier shares; `MemoryTier` and `FilesystemTier` add only their storage.

A tier copies whole CPU slots: a *cascade* job (`submit_store`, TB:226-252) copies slots of
the CPU tier into the tier, a *promotion* job (`submit_load`, TB:254-277) copies the tier's
copies into reserved CPU slots. Both only queue one task on the tier's executor
(`statemachine.tiering.io`); the task does the copies; its `JobResult` waits in the tier's
finished queue until the tiering manager polls `get_finished_jobs` (TB:279-291, TP:130-136).

A job's copies run in order and stop at the first error (TIO:174-226): a cascade publishes
the copies before it, a promotion reports them as its `successful_keys` (TF:297-316).

A key's copy, in the terms of `spec.tiering.tier_copy`: WRITING from `submit_store` until
its task published it or failed; STORED once published; READING while a promotion's task has
not finished reading it. `copy_states` reports them.

Capacity (beyond vLLM): a tier of ``capacity`` copies counts the stored ones and the ones
being written; a cascade's key that does not fit is *refused* at `submit_store` (the table's
``write_refused``: the copy stays ABSENT) and its task fails there with ENOSPC. No tier
deletes a copy to make room, as vLLM's filesystem tier never does.

Faults (beyond vLLM, for tests): `fail_next(n, after)` makes the next ``n`` tasks raise an
EIO ``OSError`` after ``after`` copies; `hang` / `unhang` hold every task not yet started;
`inject_result` queues a result for a job the tier was never given.

Lookups answer HIT or MISS at once by default (the in-memory example tier, TEX:109-121).
With ``async_lookup`` they are existence probes answered a step later, as vLLM's filesystem
tier does (TAL:144-243, TF:215-220): the first lookup of a key answers RETRY and queues a
probe; `on_schedule_end` sends the step's probes as one batch (TAL:167-189), which here is a
task of the tier's executor, so probes and jobs run in the order they were sent (a hung tier
answers no probe either); the next lookup applies the verdicts (TAL:191-218). A failed promotion
turns its failed keys' cached verdicts into misses (TAL:220-230, TF:297-306);
`on_request_finished` drops the request's probes (TAL:232-242).
"""

from __future__ import annotations

import errno
import threading
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from spec.tiering import tier_copy as TC
from statemachine.errors import ConfigError
from statemachine.manager import LookupResult, OffloadingEvent
from statemachine.policies import OffloadKey
from statemachine.tiering.io import Executor, PrimaryBuffer, make_executor


@dataclass(frozen=True)
class TransferJob:
    """A job as a tier receives it (TB:71-80): ``slots`` are CPU slots, one per key."""

    job_id: int
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    is_promotion: bool
    req_id: str


@dataclass(frozen=True)
class JobResult:
    """A finished job (TB:83-95). ``successful_keys``: for a failed promotion, the keys
    copied before the failure (None: all keys share ``success``)."""

    job_id: int
    success: bool
    successful_keys: tuple[OffloadKey, ...] | None = None


_Plan = Literal["write", "skip", "refuse"]


@dataclass
class _Probe:
    """An existence probe of one key (TAL:52-67)."""

    generation: int
    phase: Literal["PENDING", "IN_FLIGHT", "RESOLVED"] = "PENDING"
    found: bool | None = None
    req_ids: set[str] = field(default_factory=set)


class SecondaryTier(ABC):
    """The shared part of every tier; subclasses store, read and list copies."""

    kind = "abstract"
    offload_policy: Literal["chunk", "request"] = "chunk"
    """vLLM's per-request offload policy (TB:315-326); only "chunk" is supported."""

    def __init__(self, buffer: PrimaryBuffer, *, capacity: int | None = None,
                 threads: int = 0, async_lookup: bool = False, marks_present: bool = False,
                 name: str = "") -> None:
        if capacity is not None and (isinstance(capacity, bool)
                                     or not isinstance(capacity, int) or capacity < 0):
            raise ConfigError(f"capacity must be None or an integer >= 0, got {capacity!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ConfigError(f"threads must be an integer >= 0, got {threads!r}")
        self.buffer = buffer
        self.capacity = capacity
        self.name = name or self.kind
        self.async_lookup = async_lookup
        self.marks_present = marks_present
        """A store's success makes its keys' cached verdicts HIT (vLLM 0.34.0's
        `mark_present`, TAL@0.34.0:234-260); off, a verdict outlives the copy it missed
        (0.33.0, finding T2)."""
        self._store_keys: dict[int, tuple[OffloadKey, ...]] = {}
        self._executor: Executor = make_executor(threads, f"tier_{self.name}")
        self._mu = threading.Lock()          # state shared with the executor's threads
        self._writing: Counter[OffloadKey] = Counter()  # key -> store tasks to write it
        self._reading: Counter[OffloadKey] = Counter()  # key -> load tasks not finished
        self._finished: deque[JobResult] = deque()
        self._load_keys: dict[int, tuple[OffloadKey, ...]] = {}
        self._faults: deque[int] = deque()   # per failing task: copies before the error
        self._hung = False
        self._probes: dict[OffloadKey, _Probe] = {}
        self._probe_keys: dict[str, set[OffloadKey]] = {}
        self._probe_batch: list[tuple[OffloadKey, int]] = []
        self._probe_results: list[tuple[OffloadKey, int, bool]] = []
        self._need_to_apply = False
        self._next_generation = 0
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ storage
    @abstractmethod
    def has_copy(self, key: OffloadKey) -> bool:
        """Whether a complete copy of `key` is published (any thread)."""

    @abstractmethod
    def stored_keys(self) -> set[OffloadKey]:
        """Every published copy."""

    @abstractmethod
    def _publish(self, key: OffloadKey, data: bytes) -> None:
        """Store a complete copy atomically, unless one is there; raise OSError on failure.
        Runs in a task."""

    @abstractmethod
    def _fetch(self, key: OffloadKey) -> bytes:
        """A copy's bytes; raise OSError when it is missing or not ``slot_bytes`` long (and
        drop such a corrupt copy). Runs in a task."""

    @abstractmethod
    def _num_stored(self) -> int:
        """How many copies are published (under ``_mu``)."""

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job: TransferJob) -> None:
        """Queue a cascade: copy the CPU slots ``job.slots`` into the tier (TB:226-252)."""
        plan: list[_Plan] = []
        with self._mu:
            for key in job.keys:
                if self.has_copy(key):
                    plan.append("skip")
                elif key in self._writing or not self._full():
                    self._writing[key] += 1
                    plan.append("write")
                else:
                    plan.append("refuse")
                    self.stats["refused"] += 1
        self.stats["store_jobs"] += 1
        if self.marks_present:
            self._store_keys[job.job_id] = job.keys
        self._executor.submit(lambda: self._store_task(job, plan))

    def _full(self) -> bool:
        """(under ``_mu``) The stored copies and the copies being written fill the tier."""
        if self.capacity is None:
            return False
        return self._num_stored() + len(self._writing) >= self.capacity

    def _store_task(self, job: TransferJob, plan: Sequence[_Plan]) -> None:
        fail_at = self._take_fault()
        done = 0
        try:
            for i, (key, slot, how) in enumerate(zip(job.keys, job.slots, plan, strict=True)):
                if i == fail_at:
                    raise OSError(errno.EIO, f"injected I/O error writing key {key}")
                if how == "refuse":
                    raise OSError(errno.ENOSPC, f"tier {self.name} is full "
                                  f"({self.capacity} copies)")
                if how == "write":
                    if not self.has_copy(key):
                        self._publish(key, self.buffer.read(slot))
                        self.stats["copies_written"] += 1
                    self._end_write(key)
                done = i + 1
            result = JobResult(job.job_id, True)
        except Exception:
            for key, how in zip(job.keys[done:], plan[done:], strict=True):
                if how == "write":
                    self._end_write(key)
            self.stats["store_failures"] += 1
            result = JobResult(job.job_id, False)
        with self._mu:
            self._finished.append(result)

    def _end_write(self, key: OffloadKey) -> None:
        with self._mu:
            self._writing[key] -= 1
            if self._writing[key] == 0:
                del self._writing[key]

    def submit_load(self, job: TransferJob) -> None:
        """Queue a promotion: copy the tier's copies into the CPU slots ``job.slots``
        (TB:254-277)."""
        with self._mu:
            self._reading.update(job.keys)
            self._load_keys[job.job_id] = job.keys
        self.stats["load_jobs"] += 1
        self._executor.submit(lambda: self._load_task(job))

    def _load_task(self, job: TransferJob) -> None:
        fail_at = self._take_fault()
        done = 0
        try:
            for i, (key, slot) in enumerate(zip(job.keys, job.slots, strict=True)):
                if i == fail_at:
                    raise OSError(errno.EIO, f"injected I/O error reading key {key}")
                self.buffer.write(slot, self._fetch(key))
                self.stats["copies_read"] += 1
                done = i + 1
            result = JobResult(job.job_id, True)
        except Exception:
            self.stats["load_failures"] += 1
            result = JobResult(job.job_id, False, job.keys[:done] or None)
        with self._mu:
            self._reading.subtract(job.keys)
            self._reading = +self._reading
            self._finished.append(result)

    def get_finished_jobs(self) -> list[JobResult]:
        """The results queued since the last call (TB:279-291). A failed promotion's
        failed keys become cached misses (TF:297-306)."""
        with self._mu:
            out = list(self._finished)
            self._finished.clear()
        for r in out:
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success:
                ok = set(r.successful_keys or ())
                self._mark_miss([k for k in keys if k not in ok])
            stored = self._store_keys.pop(r.job_id, None)
            if stored is not None and r.success:
                self._mark_present(stored)
        return out

    def finished_job_ids(self) -> tuple[int, ...]:
        """The jobs whose results wait in the finished queue (not consumed)."""
        with self._mu:
            return tuple(r.job_id for r in self._finished)

    def has_pending_work(self) -> bool:
        """Tasks queued or running, or results not yet polled (TB:293-299)."""
        with self._mu:
            unpolled = bool(self._finished)
        return unpolled or self._executor.pending() > 0

    def run_io(self) -> int:
        """Let every task that can run finish (inline: run them here; threads: wait for
        them). Returns the tasks run here."""
        return self._executor.run()

    def drain(self, timeout_s: float = 0.0) -> bool:
        """vLLM's drain_jobs (TB:373-388), with a deadline: True once no task is queued or
        running (every result is queued for the next poll); False if the tier is hung
        past the deadline (the inline executor's deadline is now)."""
        return self._executor.wait_idle(timeout_s)

    def take_events(self) -> list[OffloadingEvent]:
        """Events of the tier's own storage (TB:301-303); these tiers emit none."""
        return []

    def touch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Recency hint (TB:305-313); these tiers keep no recency."""

    def on_schedule_end(self) -> None:
        """Send this step's probes, one batch (TAL:167-189, TF:341-343)."""
        self._apply_probe_results()
        self._need_to_apply = True
        batch: list[tuple[OffloadKey, int]] = []
        for key, generation in self._probe_batch:
            probe = self._probes.get(key)
            if probe is not None and probe.generation == generation:
                probe.phase = "IN_FLIGHT"
                batch.append((key, generation))
        self._probe_batch.clear()
        if batch:
            self._executor.submit(lambda: self._probe_task(batch))

    def _probe_task(self, batch: Sequence[tuple[OffloadKey, int]]) -> None:
        """The lookup thread's existence checks (TAL:254-290)."""
        try:
            found = [(key, generation, self.has_copy(key)) for key, generation in batch]
        except Exception:
            found = [(key, generation, False) for key, generation in batch]
        with self._mu:
            self._probe_results.extend(found)

    def on_request_finished(self, req_id: str) -> None:
        """Drop the request's probes, keeping the ones in flight (TAL:232-242)."""
        for key in self._probe_keys.pop(req_id, ()):
            probe = self._probes[key]
            probe.req_ids.discard(req_id)
            if not probe.req_ids and probe.phase != "IN_FLIGHT":
                del self._probes[key]

    def shutdown(self) -> None:
        """Stop the executor; queued tasks are dropped (TF:345-353)."""
        self._executor.shutdown()

    # ------------------------------------------------------------------ lookups
    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        """HIT when a complete copy is published, else MISS; with ``async_lookup``, RETRY
        until the key's probe resolved (TF:215-220, TAL:144-165)."""
        self.stats["lookups"] += 1
        if not self.async_lookup:
            return LookupResult.HIT if self.has_copy(key) else LookupResult.MISS
        if self._need_to_apply:
            self._apply_probe_results()
            self._need_to_apply = False
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = _Probe(self._next_generation)
            self._next_generation += 1
            self._probe_batch.append((key, probe.generation))
        probe.req_ids.add(req_id)
        self._probe_keys.setdefault(req_id, set()).add(key)
        if probe.found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if probe.found else LookupResult.MISS

    def _apply_probe_results(self) -> None:
        """(TAL:191-218)"""
        with self._mu:
            results, self._probe_results = self._probe_results, []
        for key, generation, found in results:
            probe = self._probes.get(key)
            if probe is None or probe.generation != generation:
                continue
            if not probe.req_ids:
                del self._probes[key]
                continue
            probe.found = found
            probe.phase = "RESOLVED"

    def _mark_present(self, keys: Iterable[OffloadKey]) -> None:
        """(TAL@0.34.0:234-260, TF@0.34.0:286-288) A successful store is newer than any
        probe: a key's verdict becomes HIT under a new generation (a probe result or batch
        entry of the old one is dropped); a verdict no request holds any more is dropped."""
        for key in keys:
            probe = self._probes.get(key)
            if probe is None or probe.found is True:
                continue
            if not probe.req_ids:
                del self._probes[key]
                continue
            probe.generation = self._next_generation
            self._next_generation += 1
            probe.found = True
            probe.phase = "RESOLVED"

    def _mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        """(TAL:220-230)"""
        for key in keys:
            probe = self._probes.get(key)
            if probe is not None and probe.phase == "RESOLVED":
                probe.found = False

    # ------------------------------------------------------------------ faults
    def fail_next(self, n: int = 1, after: int = 0) -> None:
        """The next `n` tasks raise an EIO OSError after `after` successful copies."""
        with self._mu:
            self._faults.extend([after] * n)

    def _take_fault(self) -> int | None:
        with self._mu:
            return self._faults.popleft() if self._faults else None

    def hang(self) -> None:
        """No task starts until `unhang` (a started one finishes)."""
        self._hung = True
        self._executor.hang()

    def unhang(self) -> None:
        self._hung = False
        self._executor.unhang()

    @property
    def hung(self) -> bool:
        return self._hung

    def inject_result(self, result: JobResult) -> None:
        """Queue a result as if a task had finished (a tier that reports a job it was never
        given, or reports twice)."""
        with self._mu:
            self._finished.append(result)

    # ------------------------------------------------------------------ introspection
    def copy_states(self) -> dict[OffloadKey, str]:
        """Every key the tier holds or writes, in `spec.tiering.tier_copy` states."""
        stored = self.stored_keys()
        with self._mu:
            out = {k: TC.READING if self._reading[k] > 0 else TC.STORED for k in stored}
            out.update((k, TC.WRITING) for k in self._writing if k not in stored)
        return out

    def check_consistency(self) -> list[str]:
        problems: list[str] = []
        with self._mu:
            if any(n <= 0 for n in self._writing.values()):
                problems.append(f"tier {self.name}: non-positive write counts {self._writing}")
            if any(n < 0 for n in self._reading.values()):
                problems.append(f"tier {self.name}: negative read counts {self._reading}")
            if self.capacity is not None and self._num_stored() > self.capacity:
                problems.append(f"tier {self.name}: {self._num_stored()} copies stored, "
                                f"capacity {self.capacity}")
        return problems


class MemoryTier(SecondaryTier):
    """Copies in a dict (the in-memory example tier, TEX:51-205, with real bytes and
    asynchronous jobs)."""

    kind = "memory"

    def __init__(self, buffer: PrimaryBuffer, *, capacity: int | None = None,
                 threads: int = 0, async_lookup: bool = False, marks_present: bool = False,
                 name: str = "") -> None:
        super().__init__(buffer, capacity=capacity, threads=threads,
                         marks_present=marks_present,
                         async_lookup=async_lookup, name=name)
        self._copies: dict[OffloadKey, bytes] = {}

    def has_copy(self, key: OffloadKey) -> bool:
        return key in self._copies

    def stored_keys(self) -> set[OffloadKey]:
        with self._mu:
            return set(self._copies)

    def _num_stored(self) -> int:
        return len(self._copies)

    def _publish(self, key: OffloadKey, data: bytes) -> None:
        with self._mu:
            self._copies.setdefault(key, bytes(data))

    def _fetch(self, key: OffloadKey) -> bytes:
        with self._mu:
            data = self._copies.get(key)
        if data is None:
            raise OSError(errno.ENOENT, f"no copy of key {key}")
        if len(data) != self.buffer.slot_bytes:
            with self._mu:
                self._copies.pop(key, None)
            raise OSError(errno.EIO, f"copy of key {key} has {len(data)} bytes, expected "
                          f"{self.buffer.slot_bytes}")
        return data

    def corrupt(self, key: OffloadKey, data: bytes) -> None:
        """Replace a copy's bytes (a test's bit rot or truncation)."""
        with self._mu:
            self._copies[key] = data


__all__ = ["JobResult", "MemoryTier", "SecondaryTier", "TransferJob"]
