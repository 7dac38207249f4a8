"""The abstract tiering model: an immutable state and the events that move it, each event a
sequence of rows of the four tiering tables (`spec.tiering`), explored exhaustively by
`spec.tiering.checker`.

What it abstracts (and why that is safe):
- The CPU tier's eviction choice is any READY key outside the offer (vLLM's LRU or ARC picks
  one of them), so every policy's choices are explored.
- The tiers' polls (vLLM polls at `lookup`, `prepare_store`, `on_schedule_end` and
  `reset_cache`) are one event that may happen at any time: vLLM's poll points are a subset.
- A secondary tier answers a lookup HIT when it holds a complete copy, else MISS. The
  filesystem tier's asynchronous existence probe (TAL) adds RETRY answers before the first
  verdict; a RETRY is one more deferral of the request and moves no chunk or job, so it is
  left to the model-based tests and the conformance tests, which run the real probe.
- The bytes are tracked as which key's bytes each CPU slot and each tier copy holds (the data
  truth), so "a load reads what a store wrote" is checked exactly.
- The scheduler side (`spec.model`) is reduced to what tiering sees: a request looks its keys
  up in order, loads the hit prefix, computes and stores the rest, and finishes, possibly
  before its last GPU store completed. GPU copies alive at a reset keep writing until they
  land (the reset fence, `spec.fence`); no new GPU store starts before they did (the
  scheduler's ordering, M:451-464), and the manager holds promotions until
  `on_reset_flushed` (TM:1155-1162).

A fault (`spec.tiering.faults`) switches one rule off, to show the checker finds what it
guards against.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.faults import NO_TIER_FAULTS, TierFaults
from spec.tiering.state import (
    CpuChunk,
    TierCopy,
    TieringState,
    TierJobRecord,
    TierRequestRecord,
)

EMPTY = -1
"""A slot's content before anything was written into it (or after a failed write)."""
TORN = -2
"""A slot's content after a copy into it failed half way, or two writers raced."""

# request phases (the scheduler-side view of a request, reduced to what tiering sees)
WAITING = "waiting"          # not yet seen
LOOKUP = "lookup"            # its next engine step looks its keys up (again, if deferred)
LOADING = "loading"          # a GPU load of its hit prefix is in flight
COMPUTE = "compute"          # computes the rest; may store it
STORING = "storing"          # a GPU store is in flight
DONE = "done"                # nothing left but to finish
FINISHED = "finished"        # request_finished was called (a GPU store may still land)


@dataclass(frozen=True)
class TierBounds:
    """One scenario's size. Requests name the chunk keys of their prompt, in prefix order."""

    requests: tuple[tuple[int, ...], ...] = ((0,), (0,))
    cpu_slots: int = 1
    tiers: int = 1
    tier_capacity: int | None = None
    """Copies a tier holds at most (None: unbounded, like vLLM's filesystem tier)."""
    io_failures: int = 0
    """Tier I/O tasks that may fail (an I/O error)."""
    store_failures: int = 0
    """GPU stores that may fail (complete_store(success=False))."""
    hangs: int = 0
    """Times a tier may stop answering."""
    resets: int = 0
    crashes: int = 0
    """Times the process may be killed (kill -9): only the tiers' published copies survive."""
    lookup_order: str = "fcfs"
    """"fcfs": one event per engine step polls, then looks every waiting request up in
    arrival order, as vLLM's scheduler does (S:744-840 under CS's waiting queue); "any":
    each request's lookup is an event of its own, in any order (a peer tier's lookups
    through ParentManager, TB:99-135, or another scheduling policy)."""

    @property
    def num_keys(self) -> int:
        return 1 + max((k for r in self.requests for k in r), default=-1)

    def describe(self) -> str:
        reqs = " ".join(f"r{i}:{','.join(f'k{k}' for k in ks)}"
                        for i, ks in enumerate(self.requests))
        order = "" if self.lookup_order == "fcfs" else "; lookups in any order"
        cap = "unbounded" if self.tier_capacity is None else str(self.tier_capacity)
        return (f"requests {reqs}; {self.cpu_slots} CPU slot(s); {self.tiers} tier(s) of "
                f"capacity {cap}; {self.io_failures} I/O failure(s), {self.store_failures} "
                f"store failure(s), {self.hangs} hang(s), {self.resets} reset(s), "
                f"{self.crashes} crash(es){order}")


@dataclass(frozen=True, order=True)
class Chunk:
    state: str = CC.ABSENT
    slot: int = EMPTY
    readers: int = 0


@dataclass(frozen=True, order=True)
class Copy:
    state: str = TC.ABSENT
    content: int = EMPTY
    """Whose bytes the copy holds (a key, or TORN)."""


@dataclass(frozen=True, order=True)
class Job:
    kind: str                 # "cascade" | "promotion"
    tier: int
    req: int
    keys: tuple[int, ...]
    slots: tuple[int, ...]
    state: str
    job_id: int = -1
    ok: bool = True
    """The I/O's outcome, once REPORTED (or landed late)."""


@dataclass(frozen=True, order=True)
class Req:
    phase: str = WAITING
    tier_state: str = TR.UNKNOWN
    pending_stores: int = 0
    deferred: bool = False
    loads: tuple[int, ...] = ()
    """Keys its GPU load in flight reads (pinned)."""
    stores: tuple[int, ...] = ()
    """Keys its GPU store in flight writes (write-pending)."""
    todo: tuple[int, ...] = ()
    """Keys it must compute (and may store)."""


@dataclass(frozen=True)
class TierModelState:
    bounds: TierBounds
    chunks: tuple[Chunk, ...]
    content: tuple[int, ...]
    """Per CPU slot: whose bytes it holds."""
    copies: tuple[tuple[Copy, ...], ...]
    jobs: tuple[Job, ...] = ()
    reqs: tuple[Req, ...] = ()
    fence: tuple[tuple[int, int], ...] = ()
    """(slot, key) of GPU stores alive at a reset: their copies still land."""
    held: bool = False
    draining: bool = False
    hung: frozenset[int] = frozenset()
    counter: int = 0
    io_failures: int = 0
    store_failures: int = 0
    hangs: int = 0
    resets: int = 0
    crashes: int = 0
    bad_loads: tuple[str, ...] = field(default=(), compare=False)

    # --- small queries ----------------------------------------------------------------
    def used_slots(self) -> frozenset[int]:
        return frozenset(c.slot for c in self.chunks if c.state != CC.ABSENT)

    @property
    def quarantine(self) -> frozenset[int]:
        """Slots a timed-out or stale job may still touch that no key holds any more."""
        return _quarantined(self.jobs, self.chunks)

    def free_slots(self) -> list[int]:
        used = self.used_slots() | self.quarantine
        return [s for s in range(self.bounds.cpu_slots) if s not in used]


def initial(b: TierBounds) -> TierModelState:
    return TierModelState(
        bounds=b, chunks=tuple(Chunk() for _ in range(b.num_keys)),
        content=tuple(EMPTY for _ in range(b.cpu_slots)),
        copies=tuple(tuple(Copy() for _ in range(b.num_keys)) for _ in range(b.tiers)),
        reqs=tuple(Req() for _ in b.requests), io_failures=b.io_failures,
        store_failures=b.store_failures, hangs=b.hangs, resets=b.resets,
        crashes=b.crashes)


# --- events -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TierEvent:
    name: str
    args: tuple[int, ...] = ()
    fair: str | None = None
    """The event's weak-fairness class (None: the environment's free choice)."""

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.args))})" if self.args else self.name


Move = tuple[str, object, str, str, str]
"""(machine, subject, source, destination, trigger) of one table row fired."""


class IllegalMove(Exception):
    """An event needed a row the tables do not have."""

    def __init__(self, machine: str, subject: object, state: str, trigger: str) -> None:
        super().__init__(f"{machine} {subject}: no row for {trigger!r} in {state}")
        self.machine, self.subject, self.state, self.trigger = machine, subject, state, trigger


class _Tx:
    """A mutable copy of a state for one event; records the table rows it fires."""

    def __init__(self, s: TierModelState, faults: TierFaults,
                 choices: tuple[int, ...] = ()) -> None:
        self.s = s
        self.f = faults
        self.choices = choices
        """The branch to take at each choice point, in order (replayed by `step`)."""
        self.points: list[int] = []
        """The number of options at each choice point met so far."""
        self.chunks = list(s.chunks)
        self.content = list(s.content)
        self.copies = [list(t) for t in s.copies]
        self.jobs = list(s.jobs)
        self.reqs = list(s.reqs)
        self.fence = list(s.fence)
        self.held = s.held
        self.draining = s.draining
        self.hung = set(s.hung)
        self.counter = s.counter
        self.io_failures = s.io_failures
        self.store_failures = s.store_failures
        self.hangs = s.hangs
        self.resets = s.resets
        self.crashes = s.crashes
        self.bad: list[str] = []
        self.moves: list[Move] = []

    def done(self) -> TierModelState:
        return TierModelState(
            self.s.bounds, tuple(self.chunks), tuple(self.content),
            tuple(tuple(t) for t in self.copies), tuple(self.jobs), tuple(self.reqs),
            tuple(self.fence), self.held, self.draining,
            frozenset(self.hung), self.counter, self.io_failures,
            self.store_failures, self.hangs, self.resets, self.crashes, tuple(self.bad))

    # --- firing rows ----------------------------------------------------------------
    def _fire(self, machine: str, rows: tuple[object, ...], subject: object, state: str,
              trigger: str, guards: dict[str, bool]) -> str:
        for t in rows:
            if t.trigger != trigger or state not in t.sources:  # type: ignore[attr-defined]
                continue
            if all(guards.get(g, False) for g in t.requires) and not any(  # type: ignore
                    guards.get(g, False) for g in t.unless):  # type: ignore[attr-defined]
                dest = t.dest_from(state)  # type: ignore[attr-defined]
                self.moves.append((machine, subject, state, dest, trigger))
                return str(dest)
        raise IllegalMove(machine, subject, state, trigger)

    def chunk(self, k: int, trigger: str, **guards: bool) -> None:
        c = self.chunks[k]
        dest = self._fire("cpu_chunk", CC.TRANSITIONS, f"k{k}", c.state, trigger, guards)
        self.chunks[k] = replace(c, state=dest)

    def copy(self, t: int, k: int, trigger: str, **guards: bool) -> None:
        c = self.copies[t][k]
        dest = self._fire("tier_copy", TC.TRANSITIONS, f"t{t}/k{k}", c.state, trigger, guards)
        self.copies[t][k] = replace(c, state=dest)

    def job(self, i: int, trigger: str, **guards: bool) -> None:
        j = self.jobs[i]
        dest = self._fire("tier_job", TJ.TRANSITIONS, _job_name(j), j.state, trigger, guards)
        self.jobs[i] = replace(j, state=dest)

    def new_job(self, j: Job, trigger: str) -> int:
        dest = self._fire("tier_job", TJ.TRANSITIONS, _job_name(j), TJ.UNALLOCATED, trigger,
                          {})
        self.jobs.append(replace(j, state=dest))
        return len(self.jobs) - 1

    def req(self, r: int, trigger: str, **guards: bool) -> None:
        q = self.reqs[r]
        dest = self._fire("tier_request", TR.TRANSITIONS, f"r{r}", q.tier_state, trigger,
                          guards)
        self.reqs[r] = replace(q, tier_state=dest)

    # --- the CPU tier -----------------------------------------------------------------
    def free_slot(self, k: int) -> None:
        self.chunks[k] = replace(self.chunks[k], slot=EMPTY, readers=0)

    def choose(self, n: int) -> int:
        """A choice point with `n` options: the branch `step` is exploring."""
        i = len(self.points)
        self.points.append(n)
        return self.choices[i] if i < len(self.choices) else 0

    def allocate(self, k: int, protected: frozenset[int]) -> bool:
        """Give key `k` a slot: a free one, else evict a READY key outside the offer (any
        of them: one branch each, as vLLM's policy picks one). False when neither is
        possible."""
        used = {c.slot for c in self.chunks if c.state != CC.ABSENT} | \
            _quarantined(self.jobs, self.chunks)
        free = [s for s in range(self.s.bounds.cpu_slots) if s not in used]
        ready = [v for v, c in enumerate(self.chunks) if c.state == CC.READY and
                 v not in protected]
        if free:
            slot = free[0]
        elif ready:
            victim = ready[self.choose(len(ready))]
            slot = self.chunks[victim].slot
            self.chunk(victim, "evicted")
            self.free_slot(victim)
        else:
            return False
        self.chunks[k] = replace(self.chunks[k], slot=slot)
        return True

    def pin(self, k: int, trigger: str) -> None:
        self.chunk(k, trigger)
        c = self.chunks[k]
        self.chunks[k] = replace(c, readers=c.readers + 1)

    def unpin(self, k: int) -> None:
        c = self.chunks[k]
        if c.state != CC.PINNED:
            return  # the key was forgotten by a reset; its pin went with it
        self.chunk(k, "reader_released", last_reader=c.readers == 1)
        c = self.chunks[k]
        self.chunks[k] = replace(c, readers=c.readers - 1)

    def suspect(self, t: int) -> bool:
        """The tier holds a timed-out or stale job (tier_job: suspect_tier)."""
        return any(j.tier == t and j.state in TJ.QUARANTINED for j in self.jobs)

    def tier_full(self, t: int) -> bool:
        cap = self.s.bounds.tier_capacity
        return cap is not None and sum(c.state != TC.ABSENT for c in self.copies[t]) >= cap

    def poll(self) -> None:
        """Apply every reported tier job's result (TM:501-549)."""
        for i, j in enumerate(self.jobs):
            if j.state != TJ.REPORTED:
                continue
            self.job(i, "polled", io_ok=j.ok)
            if j.kind == "cascade":
                for k in j.keys:
                    self.unpin(k)
            else:
                self.land_promotion(j)
        self.jobs = [j for j in self.jobs if j.state not in TJ_FINALS]

    def land_promotion(self, j: Job) -> None:
        for k, slot in zip(j.keys, j.slots, strict=True):
            c = self.chunks[k]
            if c.state != CC.PROMOTING or c.slot != slot:
                continue  # forgotten meanwhile: complete_write skips it (M:384-386)
            if j.ok:
                self.chunk(k, "promotion_landed")
            else:
                self.chunk(k, "promotion_failed")
                self.free_slot(k)


def _job_class(j: Job) -> str:
    """A job's name across states (its id is renumbered; its content is not)."""
    keys = ",".join(f"k{k}" for k in j.keys)
    return f"{j.kind} t{j.tier} r{j.req} {keys}"


def _job_name(j: Job) -> str:
    ident = f"#{j.job_id}" if j.job_id >= 0 else "queued"
    return f"{j.kind} {ident} t{j.tier} r{j.req}"


TJ_FINALS = frozenset(TJ.TIER_JOB_MACHINE.finals)


def events(s: TierModelState, faults: TierFaults = NO_TIER_FAULTS) -> Iterator[TierEvent]:
    """Every event enabled in `s` (an event may still turn out to change nothing)."""
    b = s.bounds
    if s.draining:
        for i, j in enumerate(s.jobs):
            yield from _tier_io_events(s, i, j, faults, "stale")
        if not any(j.state == TJ.SUBMITTED for j in s.jobs):
            yield TierEvent("reset_done", fair="reset_done")
        return
    for r, q in enumerate(s.reqs):
        if q.phase == WAITING:
            yield TierEvent("arrive", (r,))
        elif q.phase == LOOKUP and b.lookup_order == "any":
            yield TierEvent("lookup", (r,), fair=f"lookup{r}")
        elif q.phase == LOADING:
            yield TierEvent("load_done", (r,), fair=f"load{r}")
        elif q.phase == COMPUTE:
            if not s.fence:
                yield TierEvent("store", (r,), fair=f"store{r}")
            yield TierEvent("finish", (r,))
        elif q.phase == DONE:
            yield TierEvent("finish", (r,), fair=f"finish{r}")
        if q.stores:
            yield TierEvent("store_done", (r, 1), fair=f"store_done{r}")
            if s.store_failures:
                yield TierEvent("store_done", (r, 0))
        if q.phase == STORING:
            yield TierEvent("finish", (r,))
    for i, j in enumerate(s.jobs):
        yield from _tier_io_events(s, i, j, faults, "time_out")
        if j.state in TJ.QUARANTINED and j.tier not in s.hung:
            yield TierEvent("late_result", (i,), fair=f"late {_job_class(j)}")
    if b.lookup_order == "fcfs" and any(q.phase == LOOKUP for q in s.reqs):
        yield TierEvent("schedule", fair="schedule")
    if any(j.state == TJ.REPORTED for j in s.jobs):
        yield TierEvent("poll", fair="poll")
    if any(j.state == TJ.QUEUED for j in s.jobs):
        yield TierEvent("end_step", fair="end_step")
    for n, (slot, key) in enumerate(s.fence):
        yield TierEvent("late_dma", (n,), fair=f"late_dma s{slot} k{key}")
    if s.held and not s.fence:
        yield TierEvent("reset_flushed", fair="reset_flushed")
    if s.hangs:
        for t in range(b.tiers):
            if t not in s.hung:
                yield TierEvent("hang", (t,))
    for t in sorted(s.hung):
        yield TierEvent("unhang", (t,))
    if s.resets:
        yield TierEvent("reset")
    if s.crashes:
        yield TierEvent("crash")


def _tier_io_events(s: TierModelState, i: int, j: Job, faults: TierFaults,
                    expiry: str) -> Iterator[TierEvent]:
    """A submitted job's I/O finishes (or fails) while its tier answers; on a hung tier
    its timer (`expiry`: the tier job timeout, or the reset's drain deadline) fires."""
    if j.state != TJ.SUBMITTED:
        return
    if j.tier not in s.hung:
        yield TierEvent("io", (i, 1), fair=f"io {_job_class(j)}")
        if s.io_failures:
            yield TierEvent("io", (i, 0))
    elif not faults.no_tier_timeout:
        yield TierEvent(expiry, (i,), fair=f"{expiry} {_job_class(j)}")


def step(s: TierModelState, ev: TierEvent, faults: TierFaults = NO_TIER_FAULTS
         ) -> list[tuple[TierModelState, tuple[Move, ...]]]:
    """Every successor of `s` under `ev` (several where the CPU tier's eviction choice
    branches), with the rows each fired. Raises `IllegalMove` for a row the tables lack."""
    out = []
    todo: list[tuple[int, ...]] = [()]
    while todo:
        choices = todo.pop()
        tx = _Tx(s, faults, choices)
        _apply(tx, ev)
        out.append((tx.done(), tuple(tx.moves)))
        # every other option at each choice point past the ones this run was told
        for i in range(len(choices), len(tx.points)):
            taken = tuple(choices) + (0,) * (i - len(choices))
            todo.extend((*taken, o) for o in range(1, tx.points[i]))
    return out


def _apply(tx: _Tx, ev: TierEvent) -> None:
    name, a = ev.name, ev.args
    if name == "arrive":
        (r,) = a
        tx.req(r, "registered")
        tx.reqs[r] = replace(tx.reqs[r], phase=LOOKUP)
    elif name == "lookup":
        _lookup(tx, a[0])
    elif name == "schedule":
        tx.poll()
        scanned: set[int] = set()  # every key a lookup of this step hit (step-wide)
        for r, q in enumerate(tx.reqs):
            if q.phase == LOOKUP:
                _lookup(tx, r, scanned)
    elif name == "load_done":
        (r,) = a
        q = tx.reqs[r]
        for k in q.loads:
            c = tx.chunks[k]
            if c.state not in CC.LOADABLE or tx.content[c.slot] != k:
                tx.bad.append(f"r{r} loaded k{k} from slot {c.slot} holding "
                              f"{_content_name(tx.content[c.slot]) if c.slot >= 0 else '-'}")
            tx.unpin(k)
        tx.reqs[r] = replace(q, loads=(), phase=COMPUTE if q.todo else DONE)
    elif name == "store":
        _store(tx, a[0])
    elif name == "store_done":
        _store_done(tx, a[0], bool(a[1]))
    elif name == "finish":
        (r,) = a
        q = tx.reqs[r]
        if tx.f.finalize_before_final_store:
            tx.req(r, "finished", stores_pending=False)
        else:
            tx.req(r, "finished", stores_pending=q.pending_stores > 0)
        tx.reqs[r] = replace(tx.reqs[r], phase=FINISHED, todo=())
    elif name == "end_step":
        for i, j in enumerate(tx.jobs):
            if j.state == TJ.QUEUED:
                tx.job(i, "submitted")
                tx.jobs[i] = replace(tx.jobs[i], job_id=tx.counter)
                tx.counter += 1
                for k in j.keys:
                    tx.chunk(k, "promotion_submitted")
                    tx.copy(j.tier, k, "read_started")
    elif name == "io":
        _io(tx, a[0], bool(a[1]))
    elif name == "poll":
        tx.poll()
    elif name == "time_out":
        (i,) = a
        _quarantine(tx, i, "time_out")
    elif name == "stale":
        (i,) = a
        _quarantine(tx, i, "stale", tier_hung=True)
    elif name == "late_result":
        (i,) = a
        j = tx.jobs[i]
        _finish_io(tx, j, ok=True, late=True)
        tx.job(i, "late_result")
        if j.kind == "cascade":
            for k, slot in zip(j.keys, j.slots, strict=True):
                c = tx.chunks[k]
                if c.state == CC.PINNED and c.slot == slot:
                    tx.unpin(k)
        tx.jobs = [x for x in tx.jobs if x.state not in TJ_FINALS]
    elif name == "late_dma":
        (n,) = a
        slot, key = tx.fence.pop(n)
        tx.content[slot] = key
    elif name == "reset_flushed":
        tx.held = False
    elif name == "hang":
        (t,) = a
        tx.hung.add(t)
        tx.hangs -= 1
    elif name == "unhang":
        (t,) = a
        tx.hung.discard(t)
    elif name == "reset":
        tx.resets -= 1
        tx.draining = True
        if tx.f.reset_without_drain:
            _reset_done(tx)
    elif name == "reset_done":
        _reset_done(tx)
    elif name == "crash":
        _crash(tx)
    else:  # pragma: no cover - events() yields only the names above
        raise ValueError(name)


def _content_name(c: int) -> str:
    return {EMPTY: "nothing", TORN: "torn bytes"}.get(c, f"k{c}")


def _lookup(tx: _Tx, r: int, scanned: set[int] | None = None) -> None:
    """The scheduler's prefix lookup of request r's keys (S:773-803 over TM:589-675): HIT
    and HIT_PENDING count as hits and the scan goes on, RETRY goes on too, MISS stops it;
    any HIT_PENDING or RETRY defers the request (S:1014-1019), else the hit prefix loads.
    `scanned` collects the keys every lookup of the step hit so far (a promotion evicts
    none of them); a lone lookup (lookups in any order) protects its own scan only."""
    keys = tx.s.bounds.requests[r]
    hit = set() if scanned is None else scanned

    def lookup(k: int) -> str:
        answer = _lookup_key(tx, r, k, frozenset(hit))
        if answer in ("HIT", "HIT_PENDING"):
            hit.add(k)
        return answer

    answers = CC.prefix_scan(lookup, keys)
    hits = [k for k, a in zip(keys, answers, strict=False) if a in ("HIT", "HIT_PENDING")]
    if any(a in ("HIT_PENDING", "RETRY") for a in answers):
        tx.reqs[r] = replace(tx.reqs[r], deferred=True)
        return
    todo = tuple(keys[len(hits):])
    for k in hits:
        tx.pin(k, "load_pinned")
    phase = LOADING if hits else (COMPUTE if todo else DONE)
    tx.reqs[r] = replace(tx.reqs[r], phase=phase, deferred=False, loads=tuple(hits),
                         todo=todo)


def _lookup_key(tx: _Tx, r: int, k: int, scanned: frozenset[int]) -> str:
    """One key's lookup; a secondary-tier hit reserves a CPU slot for its promotion. The
    slot may come from evicting a READY key, but not one a lookup of this step already hit
    (the spec; vLLM protects the promoted key alone, TM:713, which livelocks a prefix longer
    than the CPU tier, fault `promotion-evicts-own-prefix`, and lets two deferred requests
    evict each other's promoted chunks every step)."""
    answer = CC.LOOKUP_ANSWER[tx.chunks[k].state]
    if answer is not None:
        return answer
    if tx.held and not tx.f.promotions_not_held:
        return "MISS"
    for t in range(tx.s.bounds.tiers):
        if tx.suspect(t):
            continue  # a tier with a quarantined job is skipped (tier_job: suspect_tier)
        if tx.copies[t][k].state not in TC.VISIBLE:
            continue
        # a hit in tier t: reserve a CPU slot and queue the promotion (TM:686-738)
        protected = frozenset({k}) if tx.f.promotion_evicts_own_prefix else scanned | {k}
        if not tx.allocate(k, protected):
            return "MISS"
        tx.chunk(k, "promotion_reserved")
        for i, j in enumerate(tx.jobs):
            if j.state == TJ.QUEUED and j.tier == t and j.req == r:
                tx.jobs[i] = replace(j, keys=(*j.keys, k), slots=(*j.slots, tx.chunks[k].slot))
                break
        else:
            tx.new_job(Job("promotion", t, r, (k,), (tx.chunks[k].slot,), TJ.UNALLOCATED),
                       "promotion_queued")
        return "HIT_PENDING"
    return "MISS"


def _store(tx: _Tx, r: int) -> None:
    """prepare_store of the next chunk the request computed (TM:814-878, M:261-370): the
    engine stores a request chunk by chunk, one GPU store each."""
    q = tx.reqs[r]
    k, todo = q.todo[0], q.todo[1:]
    stored = tx.chunks[k].state == CC.ABSENT and tx.allocate(k, frozenset({k}))
    if stored:
        tx.chunk(k, "store_prepared")
        tx.content[tx.chunks[k].slot] = EMPTY
        tx.req(r, "store_prepared", stores_offered=True)
    q = tx.reqs[r]
    stores = q.stores + ((k,) if stored else ())
    tx.reqs[r] = replace(q, todo=todo, stores=stores,
                         pending_stores=q.pending_stores + stored,
                         phase=COMPUTE if todo else STORING if stores else DONE)


def _store_done(tx: _Tx, r: int, ok: bool) -> None:
    """The request's oldest GPU store lands; complete_store, and the cascades
    (TM:937-1011)."""
    q = tx.reqs[r]
    k, rest = q.stores[0], q.stores[1:]
    if ok:
        tx.content[tx.chunks[k].slot] = k
        tx.chunk(k, "store_completed")
        for t in range(tx.s.bounds.tiers):
            if not tx.f.cascade_without_pin:
                tx.pin(k, "cascade_pinned")
            full = tx.tier_full(t)
            if tx.copies[t][k].state == TC.ABSENT:
                tx.copy(t, k, "write_refused" if full else "write_started", tier_full=full)
            else:
                tx.copy(t, k, "write_started")
            i = tx.new_job(Job("cascade", t, r, (k,), (tx.chunks[k].slot,), TJ.UNALLOCATED),
                           "cascade_created")
            tx.jobs[i] = replace(tx.jobs[i], job_id=tx.counter)
            tx.counter += 1
    else:
        tx.store_failures -= 1
        tx.chunk(k, "store_failed")
        tx.free_slot(k)
    pending = q.pending_stores
    tx.req(r, "store_completed", last_pending_store=pending == 1)
    phase = tx.reqs[r].phase
    if phase == STORING and not rest:
        phase = DONE
    tx.reqs[r] = replace(tx.reqs[r], stores=rest, pending_stores=pending - 1, phase=phase)


def _io(tx: _Tx, i: int, ok: bool) -> None:
    """The tier's I/O of job i finishes (TP:162-194); the result waits for a poll."""
    j = tx.jobs[i]
    if not ok:
        tx.io_failures -= 1
    ok = _finish_io(tx, j, ok, late=False)
    tx.job(i, "io_finished")
    tx.jobs[i] = replace(tx.jobs[i], ok=ok)


def _finish_io(tx: _Tx, j: Job, ok: bool, late: bool) -> bool:
    """The data effect of a job's I/O: a cascade publishes (or not) each copy, a promotion
    fills (or tears) each slot. Returns whether the job succeeded."""
    t = j.tier
    if j.kind == "cascade":
        for k, slot in zip(j.keys, j.slots, strict=True):
            c = tx.copies[t][k]
            if c.state != TC.WRITING:
                continue  # refused (full), or another cascade already wrote it
            if ok:
                tx.copy(t, k, "write_landed")
                tx.copies[t][k] = replace(tx.copies[t][k], content=tx.content[slot])
            else:
                tx.copy(t, k, "write_failed")
                tx.copies[t][k] = replace(tx.copies[t][k], content=EMPTY)
        full = any(tx.copies[t][k].state == TC.ABSENT for k in j.keys)
        return ok and not full
    for k, slot in zip(j.keys, j.slots, strict=True):
        c = tx.copies[t][k]
        if ok and c.state in TC.VISIBLE:
            tx.content[slot] = c.content
        else:
            tx.content[slot] = TORN
            ok = False
        if c.state == TC.READING and not ok and tx.choose(2):
            tx.copy(t, k, "short_read")  # a short file: removed (TIO:155-168)
            tx.copies[t][k] = Copy()
        elif c.state == TC.READING:
            tx.copy(t, k, "read_ended")
    return ok


def _quarantine(tx: _Tx, i: int, trigger: str, **guards: bool) -> None:
    """A job out of the table whose I/O may still run: a promotion's keys leave the index
    (their slots stay quarantined while the job is), a cascade keeps its pins."""
    j = tx.jobs[i]
    tx.job(i, trigger, **guards)
    if j.kind == "promotion":
        for k, slot in zip(j.keys, j.slots, strict=True):
            c = tx.chunks[k]
            if c.state == CC.PROMOTING and c.slot == slot:
                tx.chunk(k, "promotion_timed_out" if trigger == "time_out" else "reset",
                         tier_io_in_flight=True)
                tx.free_slot(k)


def _quarantined(jobs: tuple[Job, ...] | list[Job], chunks: tuple[Chunk, ...] | list[Chunk]
                 ) -> frozenset[int]:
    held = {c.slot for c in chunks if c.state != CC.ABSENT}
    return frozenset(slot for j in jobs if j.state in TJ.QUARANTINED for slot in j.slots
                     if slot not in held)


def _reset_done(tx: _Tx) -> None:
    """reset_cache after the drain (TM:1140-1198): apply the results, drop the queued
    promotions, finalize finished requests, forget the CPU tier, hold promotions."""
    tx.draining = False
    tx.poll()
    for i, j in enumerate(tx.jobs):
        if j.state == TJ.QUEUED:
            tx.job(i, "dropped")
    tx.jobs = [j for j in tx.jobs if j.state not in TJ_FINALS]
    io_slots = {s for j in tx.jobs if j.state in TJ.QUARANTINED or j.state in TJ.IN_TABLE
                for s in j.slots}
    if tx.f.reset_without_drain:
        io_slots = set()
    for k, c in enumerate(tx.chunks):
        if c.state == CC.ABSENT:
            continue
        in_flight = c.slot in io_slots
        if c.state == CC.PROMOTING and tx.f.reset_without_drain:
            tx.chunk(k, "reset", tier_io_in_flight=True)  # the row vLLM lacks: no quarantine
        else:
            tx.chunk(k, "reset", tier_io_in_flight=in_flight)
        tx.free_slot(k)
    for r, q in enumerate(tx.reqs):
        if q.tier_state in TR.OPEN:
            tx.req(r, "reset")
        # GPU copies alive at the reset keep writing: the reset fence
        for k in q.stores:
            tx.fence.append((tx.s.chunks[k].slot, k))
        phase = q.phase
        if phase in (LOADING, STORING):
            phase = COMPUTE if q.todo or q.stores else DONE
        tx.reqs[r] = replace(tx.reqs[r], loads=(), stores=(), pending_stores=0,
                             todo=q.todo + q.stores if phase == COMPUTE else q.todo,
                             phase=phase)
    tx.held = tx.s.bounds.tiers > 0 and not tx.f.promotions_not_held


def _crash(tx: _Tx) -> None:
    """kill -9: a new process starts with nothing but the tiers' published copies (a write
    that was in flight leaves a temporary file no lookup sees, TIO:102-125)."""
    b = tx.s.bounds
    for t, tier in enumerate(tx.copies):
        for k, c in enumerate(tier):
            if c.state == TC.WRITING:
                tx.copy(t, k, "crashed")
            # the new process sees each published copy (no reader survives the crash)
            tx.copies[t][k] = Copy(TC.STORED, c.content) if c.state in TC.VISIBLE else Copy()
    fresh = initial(b)
    tx.chunks, tx.content = list(fresh.chunks), list(fresh.content)
    tx.jobs, tx.reqs, tx.fence = [], list(fresh.reqs), []
    tx.hung = set()
    tx.held = tx.draining = False
    tx.counter = 0
    tx.crashes -= 1


def data_violations(s: TierModelState) -> list[str]:
    """TINV-7 and TINV-8 over the byte truth, and the loads that read wrong bytes."""
    out = [f"TINV-7 loadable-after-write: {bad}" for bad in s.bad_loads]
    for k, c in enumerate(s.chunks):
        if c.state in CC.LOADABLE and s.content[c.slot] != k:
            out.append(f"TINV-7 loadable-after-write (k{k}): {c.state} in slot {c.slot}, "
                       f"which holds {_content_name(s.content[c.slot])}")
    for t, tier in enumerate(s.copies):
        for k, copy in enumerate(tier):
            if copy.state in TC.VISIBLE and copy.content != k:
                out.append(f"TINV-8 copies-complete (t{t}/k{k}): the copy holds "
                           f"{_content_name(copy.content)}")
    return out


# --- projection --------------------------------------------------------------------------
def abstract(s: TierModelState) -> TieringState:
    """The model state as every implementation projects itself (`TieringState`)."""
    cpu = [CpuChunk(f"k{k}", c.state, c.slot, c.readers if c.state == CC.PINNED else 0)
           for k, c in enumerate(s.chunks) if c.state != CC.ABSENT]
    copies = [TierCopy(t, f"k{k}", c.state) for t, tier in enumerate(s.copies)
              for k, c in enumerate(tier) if c.state != TC.ABSENT]
    jobs = [TierJobRecord(j.kind, j.tier, f"r{j.req}", tuple(f"k{k}" for k in j.keys),
                          j.slots, j.state, None if j.job_id < 0 else j.job_id)
            for j in s.jobs]
    reqs = [TierRequestRecord(f"r{r}", q.tier_state, q.pending_stores)
            for r, q in enumerate(s.reqs) if q.tier_state in TR.OPEN]
    used = s.used_slots()
    return TieringState.build(
        cpu=cpu, copies=copies, jobs=jobs, requests=reqs, promotions_held=s.held,
        num_slots=s.bounds.cpu_slots,
        free_slots=s.bounds.cpu_slots - len(used | s.quarantine),
        quarantined_slots=frozenset(s.quarantine))


def canonical(s: TierModelState) -> TierModelState:
    """Job ids renumbered in order of appearance (the explored state space's key)."""
    ids = sorted(j.job_id for j in s.jobs if j.job_id >= 0)
    if not ids and s.counter == 0:
        return s
    ren = {old: new for new, old in enumerate(ids)}
    jobs = tuple(sorted(replace(j, job_id=ren[j.job_id]) if j.job_id >= 0 else j
                        for j in s.jobs))
    return replace(s, jobs=jobs, counter=len(ids), bad_loads=s.bad_loads)
