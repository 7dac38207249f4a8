"""Model-based tests of a tiering manager: `TieringStateMachine`, a hypothesis
`RuleBasedStateMachine` that drives a `statemachine.tiering.system.TieringSystem` the way
vLLM's offloading scheduler drives its `TieringOffloadingManager`, and compares it, call for
call, with a reference system driven the same way.

Plug a system in by subclassing with the factories set (a factory takes a `TierSetup`: CPU
slots and secondary tiers):

    class VllmTieringMachine(TieringStateMachine):
        system_factory = staticmethod(lambda s: VllmTieringSystem(s.num_slots, s.num_tiers))
        reference_factory = staticmethod(vllm_like_reference)

    TestVllmTiering = VllmTieringMachine.TestCase

`replay(VllmTieringMachine, trace)` runs a trace an error printed again, with every check.

The rules are the environment of a tiering manager:
- a request arrives (`new_request`): consecutive keys of one of two key families, so requests
  share chunk keys (some runs start with a request that stores a whole family, `warm_up`,
  so the tiers hold copies no probe has cached a verdict for);
- a request's lookup (`lookup`): its keys in order as vLLM's scheduler looks them up
  (`_maximal_prefix_lookup`, S:773-803): HIT and HIT_PENDING count as hits and the scan goes
  on, RETRY goes on too (so the manager starts every probe), MISS stops it; any HIT_PENDING
  or RETRY defers the request (it looks up again in a later rule), else the keys before the
  MISS are the hit prefix, pinned at once (`prepare_load`), as the scheduler allocates a
  request right after its lookup;
- the GPU load of the hit prefix ends (`load_done`): the slots' bytes must be the keys' bytes
  (a key's bytes are a pure function of the key, `key_bytes`), then `complete_load`;
- a GPU store of some of the keys the request computed (`store`: `prepare_store`), which
  later lands (`store_done`: the keys' bytes are written into the slots, then
  `complete_store(success=True)`) or fails (`complete_store(success=False)`), in any later
  rule, also after the request finished;
- the request finishes (`finish`), possibly before its last store completed;
- the step ends (`end_step`: `on_schedule_end`);
- the tiers' I/O runs (`run_tier_io`), the next I/O of a tier is set to fail (`fail_io`), or
  a tier's copy is cut short (`truncate_copy`, where both systems can);
- a cache reset (`reset`): the GPU loads in flight are dropped (their completions never
  come, as the scheduler drops a stale job's report) and the GPU stores in flight become late
  copies (`late_dma` lands each into its slot; no new store starts before they all landed,
  the scheduler's ordering); `reset_flushed` (`on_reset_flushed`) comes a step or more
  later, once they all landed;
- composite rules take the common paths, so that short programs get somewhere: `step`
  (`end_step` then `run_tier_io`) and `advance` (a few requests take their next natural
  move; a deferred request looks up again only after a step).

After every call (so several times in a rule: a lookup scan calls `lookup` once per key) the
machine checks:
- every answer (lookup results, load slots, `prepare_store`'s keys and slots) of the system
  equals the reference's;
- refinement: the system's `project()` equals the reference's (slot numbers up to renaming
  once a system reports ``free_order_unspecified``: translation FREE-ORDER, see
  `conformance.tiering_adapter`);
- the tiering invariants of `spec.tiering.invariants` (when that module is present) on the
  system's state;
- `table_moves`: each subject's move between the projected state before the call and after
  it (a CPU-tier chunk, a tier copy, a tier job, a request) is a path of rows of its table.

Teardown drains: late copies land, loads and stores complete, every request finishes,
promotions are released, then the tiers' I/O runs and steps end until no job is left; it
then asserts nothing is left: no job, no pinned or pending chunk, no open request, no held
promotion.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, cast

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
)

from spec.schema import MachineSpec
from spec.tiering import (
    CPU_CHUNK_MACHINE,
    TIER_COPY_MACHINE,
    TIER_JOB_MACHINE,
    TIER_REQUEST_MACHINE,
)
from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.cpu_chunk import prefix_scan
from spec.tiering.state import TieringState, TierJobRecord
from statemachine.tiering.fs_tier import FilesystemTier
from statemachine.tiering.reference import ReferenceTieringSystem
from statemachine.tiering.system import Answer, TieringSystem
from statemachine.tiering.tiers import MemoryTier


@dataclass(frozen=True)
class TierSetup:
    """The size of one run: CPU-tier slots and secondary tiers."""

    num_slots: int = 3
    num_tiers: int = 1

    def __str__(self) -> str:
        return f"{self.num_slots} CPU slot(s), {self.num_tiers} tier(s)"


SystemFactory = Callable[[TierSetup], TieringSystem]

SETUPS: tuple[TierSetup, ...] = (TierSetup(2, 1), TierSetup(3, 1), TierSetup(3, 2))
"""Small CPU tiers, so that evictions (and so promotions) are frequent."""

FAMILIES: tuple[tuple[str, ...], ...] = (("a0", "a1", "a2"), ("b0", "b1", "b2"))
"""A request's keys are consecutive keys of one family (from its first key, or from a later
one: the chunks before were computed locally, a GPU prefix-cache hit, and the scheduler looks
up only the chunks after them): requests of a family share chunks."""


def key_bytes(key: str, n: int) -> bytes:
    """The `n` bytes a store of `key` writes: a pure function of the key."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (n // len(seed) + 1))[:n]


class RefinementError(AssertionError):
    """The system and the reference answered differently, or their states differ."""


class BadLoad(AssertionError):
    """A GPU load read bytes that are not its key's."""


class DrainError(AssertionError):
    """Something was left after the drain."""


# ----------------------------------------------------------------------------- the reference
class PositionedReference(ReferenceTieringSystem):
    """`ReferenceTieringSystem` that tells its CPU tier each key's position in the request,
    as vLLM's connector does for every key of a request (`set_offload_key_position`,
    S:412-429) and as `conformance.tiering_adapter` does for vLLM's manager: a key's
    position is its order of first appearance in the request's calls, counting from 1 (the
    machine looks keys up in prefix order and stores the rest in order: the chunk's index
    in the prompt). The LRU policy ranks a request's keys by it (tails evicted first)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._positions: dict[str, dict[str, int]] = {}

    def _position(self, req_id: str, keys: Sequence[str]) -> None:
        seen = self._positions.setdefault(req_id, {})
        for k in keys:
            if k not in seen:
                seen[k] = len(seen) + 1
                self.ctx(req_id).set_position(self.key(k), seen[k])

    def lookup(self, req_id: str, key: str) -> Answer:
        self._position(req_id, [key])
        return super().lookup(req_id, key)

    def prepare_load(self, req_id: str, keys: Sequence[str]) -> tuple[int, ...]:
        self._position(req_id, keys)
        return super().prepare_load(req_id, keys)

    def prepare_store(self, req_id: str, keys: Sequence[str]
                      ) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        self._position(req_id, keys)
        return super().prepare_store(req_id, keys)

    def truncate_copy(self, tier: int, key: str) -> bool:
        """Cut tier `tier`'s copy of `key` to half a slot (a corrupt copy, found at its next
        read); False when there is no copy."""
        t = self.tiers[tier]
        k = self.key(key)
        if isinstance(t, FilesystemTier):
            path = t.path(k)
            if not path.exists():
                return False
            os.truncate(path, self.slot_bytes // 2)
            return True
        if isinstance(t, MemoryTier) and t.has_copy(k):
            t.corrupt(k, bytes(self.slot_bytes // 2))
            return True
        return False


def reference_system(setup: TierSetup, tier_kind: str = "fs", *, async_lookup: bool = True,
                     protect_scanned_keys: bool = True,
                     marks_present: bool = False) -> PositionedReference:
    """The reference over `setup`: tiers of `tier_kind` ("fs" or "memory"), with vLLM's
    asynchronous existence probes unless `async_lookup` is False. `protect_scanned_keys`
    False is vLLM's promotion (only the promoted key is kept from eviction, finding T1), for
    the conformance tests; True is the spec's rule. `marks_present`: a store's success
    makes its keys' cached verdicts HIT (vLLM 0.34.0; finding T2 before)."""
    kind: Any = tier_kind
    return PositionedReference(setup.num_slots, (kind,) * setup.num_tiers,
                               async_lookup=async_lookup,
                               protect_scanned_keys=protect_scanned_keys,
                               marks_present=marks_present)


def vllm_like_reference(setup: TierSetup, marks_present: bool = False) -> PositionedReference:
    """The reference as vLLM behaves, for the conformance tests: filesystem tiers,
    asynchronous probes, a promotion protects the promoted key alone (TM:713); a store's
    success updates the probe cache from 0.34.0 (`marks_present`)."""
    return reference_system(setup, "fs", protect_scanned_keys=False,
                            marks_present=marks_present)


# ----------------------------------------------------------------------------- table moves
def _reachable(machine: MachineSpec, src: str, dst: str, max_rows: int = 2) -> bool:
    """Whether `dst` is `src` or follows it by at most `max_rows` rows of `machine`."""
    if src == dst:
        return True
    frontier, seen = {src}, {src}
    for _ in range(max_rows):
        frontier = {d for s in frontier for (a, d, _t) in machine.edges() if a == s} - seen
        if dst in frontier:
            return True
        seen |= frontier
        if not frontier:
            return False
    return False


def _job_subject(j: TierJobRecord) -> tuple[object, ...]:
    return ("queued", j.tier, j.req_id) if j.job_id is None else ("job", j.job_id)


def table_moves(before: TieringState, after: TieringState) -> list[str]:
    """The moves from `before` to `after` that are no path of rows of their table (empty:
    every move is). A subject missing from a state is in its table's initial state (a chunk
    or copy ABSENT, a job UNALLOCATED, a request UNKNOWN) before it appears, and in a final
    state (a job DONE, FAILED, DROPPED or LATE_DRAINED; a request FINALIZED; a chunk or copy
    ABSENT) after it disappears. One call may fire two rows on one subject (a poll lands a
    promotion, then the store that polled evicts the key; a reset's drain reports a job,
    then its poll ends it), so a move is a path of at most two rows; the machine checks after
    every call."""
    out: list[str] = []

    def check(machine: MachineSpec, subject: str, src: str, dst: str | tuple[str, ...]) -> None:
        targets = (dst,) if isinstance(dst, str) else dst
        if not any(_reachable(machine, src, d) for d in targets):
            out.append(f"{machine.name} {subject}: {src} -> {'/'.join(targets)} is no path of "
                       "rows")

    keys = {c.key for c in before.cpu} | {c.key for c in after.cpu}
    for k in sorted(keys):
        check(CPU_CHUNK_MACHINE, k, before.chunk_state(k), after.chunk_state(k))
    copies = {(c.tier, c.key) for c in before.copies} | {(c.tier, c.key) for c in after.copies}
    for t, k in sorted(copies):
        check(TIER_COPY_MACHINE, f"t{t}/{k}", before.copy_state(t, k), after.copy_state(t, k))
    finals = tuple(TIER_JOB_MACHINE.finals)
    old = {_job_subject(j): j for j in before.jobs}
    new = {_job_subject(j): j for j in after.jobs}
    submitted_from: dict[tuple[object, ...], TierJobRecord] = {}
    for subj, j in new.items():
        if subj in old or j.job_id is None or j.kind != "promotion":
            continue
        q = old.get(("queued", j.tier, j.req_id))
        if q is not None and ("queued", j.tier, j.req_id) not in new and q.keys == j.keys:
            submitted_from[subj] = q
    for subj, j in new.items():
        src = old[subj].state if subj in old else (
            TJ.QUEUED if subj in submitted_from else TJ.UNALLOCATED)
        check(TIER_JOB_MACHINE, f"{j.kind} {subj}", src, j.state)
    consumed = {_job_subject(q) for q in submitted_from.values()}
    for subj, j in old.items():
        if subj not in new and subj not in consumed:
            check(TIER_JOB_MACHINE, f"{j.kind} {subj}", j.state, finals)
    reqs = {r.req_id for r in before.requests} | {r.req_id for r in after.requests}
    for r in sorted(reqs):
        a, b = before.request_state(r), after.request_state(r)
        check(TIER_REQUEST_MACHINE, r, a or TR.UNKNOWN, b or (TR.FINALIZED, TR.UNKNOWN))
    return out


def tiering_violations(state: TieringState) -> list[str]:
    """The tiering invariants of `spec.tiering.invariants` broken in `state` (none when that
    module is not there yet)."""
    try:
        from spec.tiering import invariants
    except ImportError:  # pragma: no cover - the module comes with the tiering invariants
        return []
    check: Callable[[TieringState], Sequence[object]] | None = getattr(
        invariants, "check_tiering", None) or getattr(invariants, "check", None)
    return [] if check is None else [str(v) for v in check(state)]


def without_slots(state: TieringState) -> TieringState:
    """`state` with every slot number erased (the chunks' and the jobs'; the quarantine kept
    as a count): equal states up to a renaming of the CPU slots, since within one state each
    key has one slot (TINV-1) and a job's slots are its keys' (TINV-2)."""
    return replace(
        state, cpu=tuple(replace(c, slot=-1) for c in state.cpu),
        jobs=tuple(sorted((replace(j, slots=(-1,) * len(j.slots)) for j in state.jobs),
                          key=lambda j: (j.job_id is None, j.job_id or 0, j.kind, j.tier,
                                         j.req_id, j.keys))),
        quarantined_slots=frozenset(range(-len(state.quarantined_slots), 0)))


def _without_slots(name: str, answer: Any) -> Any:
    """A call's answer with its slot numbers erased (see `without_slots`)."""
    if name == "prepare_load":
        return len(answer)
    if name == "prepare_store" and answer is not None:
        return answer[0]
    return answer


def state_diff(a: TieringState, b: TieringState) -> list[str]:
    """The fields where `a` and `b` differ."""
    out = []
    for name in TieringState.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            out.append(f"{name}:\n    system:    {x}\n    reference: {y}")
    return out


# ----------------------------------------------------------------------------- the machine
def _event(text: str) -> None:
    """A hypothesis event (statistics), ignored outside a hypothesis run (a replay)."""
    with contextlib.suppress(InvalidArgument):
        event(text)


def _coverage(before: TieringState, after: TieringState) -> None:
    """Events for the statistics: which states and moves a run reached."""
    for c in after.cpu:
        if c.state != CC.READY:
            _event(f"CPU chunk {c.state}")
    for j in after.jobs:
        _event(f"{j.kind} {j.state}")
    for copy in after.copies:
        _event(f"copy {copy.state}")
    for r in after.requests:
        if r.state == TR.FINISH_PENDING:
            _event("request FINISH_PENDING")
    if after.promotions_held:
        _event("promotions held")
    gone = {(j.kind, j.job_id) for j in before.jobs if j.job_id is not None} - {
        (j.kind, j.job_id) for j in after.jobs if j.job_id is not None}
    for kind, _ in gone:
        _event(f"{kind} polled")


LOOKUP, LOADING, COMPUTE, DONE = "lookup", "loading", "compute", "done"


@dataclass
class _Req:
    """A request as the machine (the scheduler and the GPU) sees it."""

    req_id: str
    keys: tuple[str, ...]
    phase: str = LOOKUP
    finished: bool = False
    load: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = None
    """The GPU load in flight: keys, and their CPU slots in each system."""
    todo: tuple[str, ...] = ()
    """Keys computed and not yet offered to a store."""
    stores: list[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]] = field(
        default_factory=list)
    """GPU stores in flight: keys, and their slots in each system."""
    defers: int = 0
    """Lookups that deferred it."""
    deferred_at: int = -1
    """The machine's step count at its last deferral."""


class TieringStateMachine(RuleBasedStateMachine):
    """The model-based test of a tiering manager; subclass it with the factories set."""

    system_factory: ClassVar[staticmethod[[TierSetup], TieringSystem] | None] = None
    """Builds the system under test (set it to ``staticmethod(factory)``)."""
    reference_factory: ClassVar[staticmethod[[TierSetup], TieringSystem] | None] = None
    """Builds the system it is compared with (None: no refinement, the invariants, the
    table moves and the drain only)."""
    setups: ClassVar[tuple[TierSetup, ...]] = SETUPS
    MAX_REQUESTS: ClassVar[int] = 8
    MAX_RESETS: ClassVar[int] = 2
    IO_FAULTS: ClassVar[bool] = True
    """Draw `fail_io` (skipped where either system cannot inject a fault)."""
    MAX_FAULTS: ClassVar[int] = 3
    STORE_FAILURES: ClassVar[bool] = True
    """Draw failed GPU stores (`complete_store(success=False)`; the 0.33.0 connector never
    fails one, the manager takes it)."""
    DRAIN_ROUNDS: ClassVar[int] = 8

    def __init__(self) -> None:
        super().__init__()
        self.setup: TierSetup | None = None
        self.system: TieringSystem | None = None
        self.reference: TieringSystem | None = None
        self.reqs: dict[str, _Req] = {}
        self.fence: list[tuple[tuple[int, ...], str]] = []
        """Late GPU copies of a reset: (the slot in each system, key)."""
        self.answers: list[Any] = []
        """Every system's answer to the last call."""
        self.held = False
        self.steps_since_reset = 0
        self.steps = 0
        self.resets = 0
        self.faults = 0
        self.since_end_step = 0
        """Rules since the last `end_step` (a second one in a row only closes an empty
        step, so it is not drawn)."""
        self.since_io = 0
        """Rules since the last `run_tier_io` (likewise)."""
        self.trace: list[str] = []
        self.last: TieringState | None = None
        self.failed = False
        self._calls = 0
        self._checked = -1

    # --- plumbing --------------------------------------------------------------------
    @initialize(which=st.integers(0, 100),
                first=st.lists(st.tuples(st.integers(0, len(FAMILIES) - 1), st.integers(0, 1),
                                         st.integers(1, 3)), min_size=1, max_size=3),
                warm=st.booleans())
    def start(self, which: int, first: list[tuple[int, int, int]] | None = None,
              warm: bool = False) -> None:
        """Build the systems; with `warm`, a first request stores one key family, which
        cascades to the tiers (`warm_up`); then the first requests arrive.
        """
        make = self._factory("system")
        if make is None:
            raise TypeError("set system_factory on the machine's subclass")
        self.setup = self.setups[which % len(self.setups)]
        self.trace.append(f"setup({self.setup})")
        self.system = make(self.setup)
        ref = self._factory("reference")
        if ref is not None:
            self.reference = ref(self.setup)
        self.last = self.system.project()
        self._check()
        if warm:
            self.warm_up()
        for family, offset, length in first or ():
            self._new_request(family, offset, length)

    def warm_up(self, family: int = 0) -> None:
        """A request that stores every key of `family` without looking them up (its KV was
        computed, as after a GPU prefix-cache hit): one key per store, each landing, its
        cascade run and polled; then it finishes. The tiers then hold the family, the CPU
        tier its last keys, and no probe verdict is cached for it."""
        keys = FAMILIES[family]
        q = self._new_request(family, 0, len(keys))
        q.phase, q.todo = COMPUTE, keys
        for _ in keys:
            self._store(q.req_id, 1)
            while q.stores:
                self._land_store(q, 0, True)
            self.step()
            self.step()
        self._finish(q)

    @classmethod
    def _factory(cls, which: str) -> SystemFactory | None:
        """The class's `system_factory` or `reference_factory` (a plain function or a
        staticmethod, set on this class or a base)."""
        for klass in cls.__mro__:
            f = vars(klass).get(f"{which}_factory")
            if isinstance(f, staticmethod):
                f = f.__func__
            if f is not None:
                return f
        return None

    def _slots_renamed(self) -> bool:
        """Whether refinement compares slots up to renaming: once a system says it freed
        slots in an order the calls do not fix (``free_order_unspecified``, vLLM after a
        partly failed promotion); exact before."""
        return any(getattr(s, "free_order_unspecified", False) for s in self._systems())

    def _systems(self) -> list[TieringSystem]:
        assert self.system is not None
        return [self.system] if self.reference is None else [self.system, self.reference]

    def _where(self) -> str:
        return "after " + " ; ".join(self.trace)

    def _call(self, name: str, *args: Any) -> Any:
        """Call `name` on the system and on the reference; their answers must be equal (up
        to slot renaming, see `_slots_renamed`). Returns the system's; `self.answers` keeps
        every system's."""
        answers: list[Any] = []
        self.answers = answers
        for s in self._systems():
            try:
                answers.append(getattr(s, name)(*args))
            except Exception as exc:
                self.failed = True
                exc.add_note(f"{s.name}.{name}{args} raised it; {self._where()}")
                raise
        if len(answers) == 2 and self._slots_renamed():
            same = _without_slots(name, answers[0]) == _without_slots(name, answers[1])
        else:
            same = len(answers) == 1 or answers[0] == answers[1]
        if not same:
            self.failed = True
            raise RefinementError(f"{name}{args}: {self._systems()[0].name} answered "
                                  f"{answers[0]!r}, {self._systems()[1].name} {answers[1]!r}; "
                                  f"{self._where()}")
        self._calls += 1
        self._check()
        return answers[0]

    def _unwritten_loadable(self, state: TieringState) -> list[str]:
        """TINV-7 loadable-after-write over the real bytes: every key the CPU tier would
        answer HIT for holds its own bytes in its slot (a late GPU copy of a reset, or a
        cascade's source reused, shows here at once, before any load reads it)."""
        assert self.system is not None
        out = []
        for c in state.cpu:
            if c.state in CC.LOADABLE:
                got = self.system.read_slot(c.slot)
                if got != key_bytes(c.key, len(got)):
                    out.append(f"TINV-7 loadable-after-write ({c.key}): {c.state} in slot "
                               f"{c.slot}, whose bytes are not the key's")
        return out

    def _check(self) -> None:
        """Refinement, the invariants and the table moves: after every call (and at the end
        of each rule, where it finds nothing new)."""
        assert self.system is not None and self.last is not None
        if self._calls == self._checked:
            return
        self._checked = self._calls
        state = self.system.project()
        try:
            if self.reference is not None:
                ref = self.reference.project()
                if self._slots_renamed():
                    _event("slots compared up to renaming (FREE-ORDER)")
                    state_cmp, ref_cmp = without_slots(state), without_slots(ref)
                else:
                    state_cmp, ref_cmp = state, ref
                if state_cmp != ref_cmp:
                    raise RefinementError(f"{self._where()}: the states differ:\n"
                                          + "\n".join(state_diff(state_cmp, ref_cmp)))
            bad = tiering_violations(state) + self._unwritten_loadable(state)
            if bad:
                raise AssertionError(f"{self._where()}: invariants broken:\n"
                                     + "\n".join(bad) + f"\nstate: {state}")
            moves = table_moves(self.last, state)
            if moves:
                raise AssertionError(f"{self._where()}: moves off the tables:\n"
                                     + "\n".join(moves) + f"\nbefore: {self.last}\n"
                                     f"after: {state}")
        except AssertionError:
            self.failed = True
            raise
        _coverage(self.last, state)
        self.last = state

    def _step(self, text: str) -> None:
        self.trace.append(text)
        self.since_end_step += 1
        self.since_io += 1

    def _live(self, pred: Callable[[_Req], bool]) -> list[str]:
        return sorted(r for r, q in self.reqs.items() if pred(q))

    # --- rules -----------------------------------------------------------------------
    @precondition(lambda self: self.system is not None
                  and len(self.reqs) < self.MAX_REQUESTS)
    @rule(family=st.integers(0, len(FAMILIES) - 1), offset=st.integers(0, 1),
          length=st.integers(1, 3))
    def new_request(self, family: int, offset: int, length: int) -> None:
        self._new_request(family, offset, length)

    def _new_request(self, family: int, offset: int, length: int,
                     keys: tuple[str, ...] | None = None) -> _Req:
        req_id = f"r{len(self.reqs)}"
        keys = keys or FAMILIES[family][offset:offset + length]
        self._step(f"new_request({req_id}: {','.join(keys)})")
        q = self.reqs[req_id] = _Req(req_id, keys)
        self._call("new_request", req_id)
        self._check()
        return q

    def _can_lookup(self, q: _Req) -> bool:
        return not q.finished and q.phase == LOOKUP

    @precondition(lambda self: bool(self._live(self._can_lookup)))
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        """The scheduler's lookup of a request's keys (`_maximal_prefix_lookup`,
        S:773-803), then, unless deferred, the pin of its hit prefix (`prepare_load`, in
        `update_state_after_alloc`)."""
        req_id = data.draw(st.sampled_from(self._live(self._can_lookup)), label="request")
        self._lookup(req_id)

    def _lookup(self, req_id: str) -> None:
        q = self.reqs[req_id]
        self._step(f"lookup({req_id}: {','.join(q.keys)})")

        def lookup(key: str) -> str:
            answer: str = self._call("lookup", req_id, key)
            _event(f"lookup answered {answer}")
            return answer

        answers = prefix_scan(lookup, q.keys)
        self.trace[-1] += f" -> {'/'.join(answers)}"
        if any(a in ("HIT_PENDING", "RETRY") for a in answers):
            q.defers += 1
            q.deferred_at = self.steps
            _event("request deferred")
            self._check()
            return
        hits = q.keys[:len(answers) - (answers[-1] == "MISS")]
        q.todo = q.keys[len(hits):]
        if hits:
            slots = self._call("prepare_load", req_id, hits)
            q.load = (hits, tuple(tuple(a) for a in self.answers))
            q.phase = LOADING
            self.trace[-1] += f", load {','.join(hits)} from slots {tuple(slots)}"
            _event("hit prefix loaded")
        else:
            q.phase = COMPUTE if q.todo else DONE
        self._check()

    @precondition(lambda self: bool(self._live(lambda q: q.load is not None)))
    @rule(data=st.data())
    def load_done(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(self._live(lambda q: q.load is not None)),
                           label="request")
        self._step(f"load_done({req_id})")
        self._finish_load(self.reqs[req_id])
        self._check()

    def _finish_load(self, q: _Req) -> None:
        assert q.load is not None
        keys, per_system = q.load
        for s, slots in zip(self._systems(), per_system, strict=True):
            for k, slot in zip(keys, slots, strict=True):
                got = s.read_slot(slot)
                if got != key_bytes(k, s.slot_bytes):
                    self.failed = True
                    raise BadLoad(f"{s.name}: the load of {k} read slot {slot}, which does not "
                                  f"hold {k}'s bytes; {self._where()}")
        self._call("complete_load", q.req_id, keys)
        q.load = None
        if not q.finished and q.phase == LOADING:
            q.phase = COMPUTE if q.todo else DONE

    def _can_store(self, q: _Req) -> bool:
        return not q.finished and q.phase == COMPUTE and bool(q.todo) and not self.fence

    @precondition(lambda self: bool(self._live(self._can_store)))
    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        """A GPU store of the request's next computed keys (`prepare_store`)."""
        req_id = data.draw(st.sampled_from(self._live(self._can_store)), label="request")
        q = self.reqs[req_id]
        self._store(req_id, data.draw(st.integers(1, len(q.todo)), label="keys"))
        self._check()

    def _store(self, req_id: str, n: int) -> None:
        q = self.reqs[req_id]
        offer = q.todo[:n]
        self._step(f"store({req_id}: {','.join(offer)})")
        out = self._call("prepare_store", req_id, offer)
        self.trace[-1] += f" -> {out}"
        _event("store: no room" if out is None else "store prepared")
        if out is not None:
            keys = out[0]
            q.todo = q.todo[n:]
            if keys:
                q.stores.append((tuple(keys), tuple(tuple(a[1]) for a in self.answers)))
            if not q.todo:
                q.phase = DONE

    @precondition(lambda self: bool(self._live(lambda q: bool(q.stores))))
    @rule(data=st.data(), ok=st.booleans())
    def store_done(self, data: st.DataObject, ok: bool) -> None:
        """A GPU store lands (its bytes, then `complete_store`), or fails."""
        req_id = data.draw(st.sampled_from(self._live(lambda q: bool(q.stores))),
                           label="request")
        q = self.reqs[req_id]
        i = data.draw(st.integers(0, len(q.stores) - 1), label="store")
        ok = ok or not self.STORE_FAILURES
        self._land_store(q, i, ok)
        self._check()

    def _land_store(self, q: _Req, i: int, ok: bool) -> None:
        keys, per_system = q.stores.pop(i)
        self._step(f"store_done({q.req_id}: {','.join(keys)}, {'ok' if ok else 'failed'})")
        _event("GPU store " + ("landed" if ok else "failed")
               + (" after its request finished" if q.finished else ""))
        if ok:
            for s, slots in zip(self._systems(), per_system, strict=True):
                for k, slot in zip(keys, slots, strict=True):
                    s.write_slot(slot, key_bytes(k, s.slot_bytes))
        self._call("complete_store", q.req_id, keys, ok)

    @precondition(lambda self: bool(self._live(lambda q: not q.finished)))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """The request finishes (or is aborted): possibly deferred, loading, or with stores
        in flight."""
        req_id = data.draw(st.sampled_from(self._live(lambda q: not q.finished)),
                           label="request")
        self._finish(self.reqs[req_id])
        self._check()

    def _finish(self, q: _Req) -> None:
        self._step(f"finish({q.req_id})")
        q.finished = True
        self._call("request_finished", q.req_id)

    @precondition(lambda self: self.system is not None and self.since_end_step > 0)
    @rule()
    def end_step(self) -> None:
        self._end_step()
        self._check()

    def _end_step(self) -> None:
        self._step("end_step")
        self._call("end_step")
        self.steps_since_reset += 1
        self.steps += 1
        self.since_end_step = 0

    @precondition(lambda self: self.system is not None and self.since_io > 0)
    @rule()
    def run_tier_io(self) -> None:
        self._run_tier_io()
        self._check()

    def _run_tier_io(self) -> None:
        self._step("run_tier_io")
        self._call("run_tier_io")
        self.since_io = 0

    @precondition(lambda self: self.system is not None and self.IO_FAULTS
                  and self.faults < self.MAX_FAULTS and self.last is not None
                  and any(j.state == TJ.SUBMITTED for j in self.last.jobs))
    @rule(data=st.data())
    def fail_io(self, data: st.DataObject) -> None:
        """The next I/O job of a tier fails (an I/O error inside its copy); drawn while some
        job waits for its I/O."""
        assert self.setup is not None
        tier = data.draw(st.integers(0, self.setup.num_tiers - 1), label="tier")
        armed = [s.fail_next_io(tier) for s in self._systems()]
        self.faults += 1
        self._step(f"fail_io(t{tier})")
        if len(set(armed)) > 1:
            self.failed = True
            raise RuntimeError(f"fail_next_io({tier}) armed in one system only: {armed}")
        self._check()

    def _copies(self) -> list[tuple[int, str]]:
        if self.last is None or not all(hasattr(s, "truncate_copy") for s in self._systems()):
            return []
        return [(c.tier, c.key) for c in self.last.copies if c.state in TC.VISIBLE]

    @precondition(lambda self: self.IO_FAULTS and self.faults < self.MAX_FAULTS
                  and bool(self._copies()))
    @rule(data=st.data())
    def truncate_copy(self, data: st.DataObject) -> None:
        """A tier's copy is cut short (a corrupt file), where both systems can do it: its
        next read is short, the copy is dropped and the read fails (partly, if the job read
        other keys before it)."""
        tier, key = data.draw(st.sampled_from(self._copies()), label="copy")
        self.faults += 1
        self._step(f"truncate_copy(t{tier}/{key})")
        done = [cast(Any, s).truncate_copy(tier, key) for s in self._systems()]
        if len(set(done)) > 1:
            self.failed = True
            raise RefinementError(f"truncate_copy(t{tier}/{key}) found a copy in one system "
                                  f"only: {done}; {self._where()}")
        _event("copy truncated")
        self._check()

    @precondition(lambda self: self.system is not None and self.resets < self.MAX_RESETS)
    @rule()
    def reset(self) -> None:
        """reset_cache; the loads in flight are dropped, the stores in flight land late."""
        assert self.setup is not None and self.last is not None
        self._step("reset")
        if self.last.jobs:
            _event("reset with tier jobs in flight: "
                   + ", ".join(sorted({f"{j.kind} {j.state}" for j in self.last.jobs})))
        self.resets += 1
        self._call("reset")
        for q in self.reqs.values():
            q.load = None
            for keys, per_system in q.stores:
                self.fence.extend(zip(zip(*per_system, strict=True), keys, strict=True))
                if not q.finished:
                    q.todo = tuple(k for k in q.keys if k in keys or k in q.todo)
            q.stores = []
            if not q.finished and q.phase in (LOADING, COMPUTE, DONE):
                q.phase = COMPUTE if q.todo else DONE
        self.held = self.setup.num_tiers > 0
        self.steps_since_reset = 0
        self._check()

    @precondition(lambda self: bool(self.fence))
    @rule(data=st.data())
    def late_dma(self, data: st.DataObject) -> None:
        """A GPU store alive at a reset lands in its (freed) slot."""
        n = data.draw(st.integers(0, len(self.fence) - 1), label="copy")
        self._late_dma(n)
        self._check()

    def _late_dma(self, n: int) -> None:
        slots, key = self.fence.pop(n)
        self._step(f"late_dma({key} -> slot {slots[0]})")
        for s, slot in zip(self._systems(), slots, strict=True):
            s.write_slot(slot, key_bytes(key, s.slot_bytes))

    @precondition(lambda self: self.held and not self.fence and self.steps_since_reset > 0)
    @rule()
    def reset_flushed(self) -> None:
        self._reset_flushed()
        self._check()

    def _reset_flushed(self) -> None:
        self._step("reset_flushed")
        self.held = False
        self._call("reset_flushed")

    # --- composite rules: the common paths, so that short programs get somewhere ---------
    @precondition(lambda self: self.system is not None and self.since_end_step > 0)
    @rule()
    def step(self) -> None:
        """The step ends, then the tiers' I/O runs (the model's execution window)."""
        self._end_step()
        self._check()
        self._run_tier_io()
        self._check()

    def _next_move(self, q: _Req) -> str | None:
        if q.load is not None:
            return "load_done"
        if q.stores:
            return "store_done"
        if q.finished:
            return None
        if q.phase == LOOKUP:
            return "lookup"
        if self._can_store(q):
            return "store"
        return "finish" if q.phase == DONE else None

    @precondition(lambda self: self.system is not None)
    @rule(data=st.data(), moves=st.integers(1, 6))
    def advance(self, data: st.DataObject, moves: int) -> None:
        """A few requests take their next natural moves (lookup, the load, a store of all
        they computed, its landing, finish); a deferred request's lookup comes after the
        step ended and the tiers' I/O ran (`step`), as the scheduler retries it. After a
        reset, the late GPU copies land and the flush is confirmed first."""
        for _ in range(moves):
            if self.fence:
                self._late_dma(0)
                self._check()
                continue
            if self.held and self.steps_since_reset > 0:
                self._reset_flushed()
                self._check()
                continue
            ready = self._live(lambda q: self._next_move(q) is not None
                               and not (q.phase == LOOKUP and q.deferred_at == self.steps))
            if not ready:
                if self.since_end_step == 0:
                    return
                self.step()
                continue
            req_id = data.draw(st.sampled_from(ready), label="request")
            q = self.reqs[req_id]
            move = self._next_move(q)
            if move == "load_done":
                self._step(f"load_done({req_id})")
                self._finish_load(q)
            elif move == "store_done":
                self._land_store(q, 0, True)
            elif move == "lookup":
                self._lookup(req_id)
                continue
            elif move == "store":
                self._store(req_id, len(q.todo))
            else:
                self._finish(q)
            self._check()

    # --- teardown ----------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            if self.system is not None and not self.failed:
                self.drain()
        finally:
            for s in (self.system, self.reference):
                if s is not None:
                    s.close()
            self.system = self.reference = None

    def drain(self) -> None:
        """Everything finishes, all I/O runs, all results are polled; nothing may be left."""
        self._step("-- drain --")
        while self.fence:
            self._late_dma(0)
            self._check()
        for q in self.reqs.values():
            if q.load is not None:
                self._step(f"load_done({q.req_id})")
                self._finish_load(q)
                self._check()
            while q.stores:
                self._land_store(q, 0, True)
                self._check()
            if not q.finished:
                self._finish(q)
                self._check()
        if self.held:
            self._end_step()
            self._check()
            self._reset_flushed()
            self._check()
        state = self.last
        for _ in range(self.DRAIN_ROUNDS):
            self._run_tier_io()
            self._check()
            self._end_step()
            self._check()
            state = self.last
            assert state is not None
            if not state.jobs:
                break
        assert state is not None
        left = []
        if state.jobs:
            left.append(f"jobs: {state.jobs}")
        busy = [c for c in state.cpu if c.state not in (CC.READY,)]
        if busy:
            left.append(f"CPU chunks not READY: {busy}")
        if state.requests:
            left.append(f"open requests: {state.requests}")
        if state.promotions_held:
            left.append("promotions still held")
        moving = [c for c in state.copies if c.state not in (TC.STORED,)]
        if moving:
            left.append(f"copies being written or read: {moving}")
        if left:
            raise DrainError(f"{self._where()}: left after the drain:\n" + "\n".join(left))


_TRACE_STEP = re.compile(r"^(?P<op>[a-z_]+)(?:\((?P<args>[^)]*)\))?")


def replay(machine: type[TieringStateMachine], trace: str | Sequence[str],
           setup: TierSetup | None = None) -> TieringStateMachine:
    """Run a machine's trace again (the text its errors print, ``op(args) ; op ; ...``; the
    answers after ``->`` are ignored, the checks all run), then the drain. ``setup(...)``
    in the trace gives the setup, else `setup`. Returns the machine; raises what the run
    raises."""
    steps = [t.strip() for t in (trace.split(" ; ") if isinstance(trace, str) else trace)]
    if steps and steps[0].startswith("after "):
        steps[0] = steps[0][len("after "):]
    if steps and steps[0].startswith("setup("):
        slots, tiers = (int(x) for x in re.findall(r"\d+", steps.pop(0)))
        setup = TierSetup(slots, tiers)
    m: TieringStateMachine = type("Replay", (machine,), {"setups": (setup or TierSetup(),)})()
    m.start(0, [])
    try:
        for text in steps:
            if text.startswith("--"):
                break
            match = _TRACE_STEP.match(text)
            assert match is not None, text
            op, args = match["op"], (match["args"] or "")
            req, _, rest = args.partition(":")
            if op == "new_request":
                m._new_request(0, 0, 0, tuple(k.strip() for k in rest.split(",")))
            elif op == "lookup":
                m._lookup(req)
            elif op == "load_done":
                m._step(f"load_done({req})")
                m._finish_load(m.reqs[req])
            elif op == "store":
                m._store(req, len([k for k in rest.split(",") if k.strip()]))
            elif op == "store_done":
                keys = tuple(k.strip() for k in rest.rsplit(",", 1)[0].split(","))
                q = m.reqs[req]
                i = next(i for i, (ks, _) in enumerate(q.stores) if ks == keys)
                m._land_store(q, i, rest.strip().endswith("ok"))
            elif op == "finish":
                m._finish(m.reqs[req])
            elif op == "end_step":
                m._end_step()
            elif op == "run_tier_io":
                m._run_tier_io()
            elif op in ("reset", "reset_flushed", "step"):
                getattr(m, op)()
            elif op == "fail_io":
                tier = int(args.strip().lstrip("t"))
                for s in m._systems():
                    s.fail_next_io(tier)
                m.faults += 1
                m._step(f"fail_io(t{tier})")
            elif op == "truncate_copy":
                tier_text, key = args.split("/")
                for s in m._systems():
                    cast(Any, s).truncate_copy(int(tier_text.lstrip("t")), key)
                m._step(f"truncate_copy({args})")
            elif op == "late_dma":
                key = args.split("->")[0].strip()
                m._late_dma(next(i for i, (_, k) in enumerate(m.fence) if k == key))
            else:
                raise ValueError(f"unknown step {text!r}")
            m._check()
    except BaseException:
        m.failed = True
        raise
    finally:
        m.teardown()
    return m


__all__ = ["FAMILIES", "SETUPS", "BadLoad", "DrainError", "PositionedReference",
           "RefinementError", "SystemFactory", "TierSetup", "TieringStateMachine", "key_bytes",
           "reference_system", "replay", "state_diff", "table_moves", "tiering_violations",
           "vllm_like_reference", "without_slots"]
