"""The CPU offloading manager (statemachine.manager)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from statemachine.errors import ConfigError, KVSpecError
from statemachine.manager import (
    CPUOffloadingManager,
    LookupResult,
    ManagerError,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from statemachine.policies import POLICY_NAMES, ARCPolicy

_CALLS = ("on_new_request", "lookup", "prepare_load", "complete_load", "prepare_store",
          "complete_store", "on_request_finished", "reset_cache", "on_reset_flushed",
          "take_events", "on_schedule_end", "quarantine_store", "release_slots")


class CheckedManager(CPUOffloadingManager):
    """Runs `check_consistency` after every public call, whether it returned or raised."""


def _checked(name: str) -> Callable[..., Any]:
    original = getattr(CPUOffloadingManager, name)

    def call(self: CPUOffloadingManager, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            assert self.check_consistency() == [], f"after {name}{args}"

    return call


for _name in _CALLS:
    setattr(CheckedManager, _name, _checked(_name))


Snapshot = tuple[dict[OffloadKey, int], int, int, frozenset[int], dict[OffloadKey, int | None]]


def snapshot(m: CPUOffloadingManager) -> Snapshot:
    refs = m.chunk_ref_counts()
    return refs, m.num_free_slots(), m.num_evictable(), m.quarantined_slots, \
        {k: m.chunk_id(k) for k in refs}


def stored(m: CPUOffloadingManager, ctx: ReqContext, keys: list[OffloadKey]) -> tuple[int, ...]:
    """Store ``keys`` and complete the store; return their slots."""
    out = m.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    m.complete_store(keys, ctx)
    return out.chunk_ids


# ------------------------------------------------------------------------------ walk-through
def test_lru_walk_through() -> None:
    m = CheckedManager(4)
    ctx = m.on_new_request("r1")
    assert ctx == ReqContext("r1", 0)
    assert m.lookup(1, ctx) is LookupResult.MISS

    out = m.prepare_store([1, 2, 3], ctx)
    assert out == PrepareStoreOutput((1, 2, 3), (0, 1, 2), ())
    assert m.lookup(1, ctx) is LookupResult.HIT_PENDING
    assert m.chunk_ref_counts() == {1: -1, 2: -1, 3: -1}
    assert m.num_free_slots() == 1 and m.num_evictable() == 0

    m.complete_store([1, 2], ctx)
    assert m.lookup(1, ctx) is LookupResult.HIT and m.lookup(3, ctx) is LookupResult.HIT_PENDING
    assert m.take_events() == [OffloadingEvent("stored", (1, 2))]
    assert m.take_events() == []
    assert m.num_evictable() == 2

    assert m.prepare_load([2, 1], ctx) == (1, 0)           # pinned: nothing is evictable
    assert m.num_evictable() == 0
    ctx2 = m.on_new_request("r2")
    assert m.prepare_store([4, 5, 6], ctx2) is None         # needs 2 more slots, none evictable
    assert m.stats["allocation_failures"] == 1
    assert m.chunk_ref_counts() == {1: 1, 2: 1, 3: -1}

    m.complete_load([1], ctx)                               # 1 becomes evictable again
    out = m.prepare_store([4, 5], ctx2)
    assert out == PrepareStoreOutput((4, 5), (3, 0), (1,))   # fresh slot first, then 1's slot
    assert m.lookup(1, ctx2) is LookupResult.MISS
    assert m.take_events() == [OffloadingEvent("removed", (1,))]

    m.complete_store([3], ctx, success=False)               # rollback frees slot 2
    assert m.lookup(3, ctx) is LookupResult.MISS
    assert m.num_free_slots() == 1
    assert m.take_events() == [OffloadingEvent("removed", (3,), metadata_only=True)]
    assert m.prepare_store([7], ctx2) == PrepareStoreOutput((7,), (2,), ())

    m.complete_store([4, 5, 7], ctx2)
    m.complete_load([2], None)
    assert m.chunk_ref_counts() == {2: 0, 4: 0, 5: 0, 7: 0}
    assert m.stats["evictions"] == 1 and m.stats["stores"] == 6 and m.stats["loads"] == 2
    assert not m.has_pending_work()


def test_empty_output_when_every_offered_key_is_held() -> None:
    m = CheckedManager(2)
    ctx = m.on_new_request("r")
    m.prepare_store([1], ctx)
    stored(m, ctx, [2])
    assert m.prepare_store([1, 2, 2], ctx) == PrepareStoreOutput((), (), ())


def test_offered_keys_are_protected_from_their_own_eviction() -> None:
    m = CheckedManager(2)
    ctx = m.on_new_request("r")
    stored(m, ctx, [1, 2])
    before = snapshot(m)
    assert m.prepare_store([1, 2, 3], ctx) is None          # 1, 2 evictable but offered
    assert snapshot(m) == before
    out = m.prepare_store([2, 3], ctx)
    assert out == PrepareStoreOutput((3,), (0,), (1,))


def test_prepare_load_keeps_key_order_and_counts_duplicates() -> None:
    m = CheckedManager(3)
    ctx = m.on_new_request("r")
    assert stored(m, ctx, [5, 6, 7]) == (0, 1, 2)
    assert m.prepare_load([7, 5, 6, 7], ctx) == (2, 0, 1, 2)
    assert m.chunk_ref_counts() == {5: 1, 6: 1, 7: 2}
    m.complete_load([7, 7], ctx)
    assert m.chunk_ref_counts()[7] == 0


def test_failed_store_event_is_dropped_when_the_key_is_stored_again() -> None:
    m = CheckedManager(2)
    ctx = m.on_new_request("r")
    m.prepare_store([1, 2], ctx)
    m.complete_store([1, 2], ctx, success=False)
    m.prepare_store([1], ctx)
    assert m.take_events() == [OffloadingEvent("removed", (2,), metadata_only=True)]


# ------------------------------------------------------------------------------ requests, reset
def test_finish_is_counted_and_refreshes_recency_once() -> None:
    m = CheckedManager(4)
    r1, r2 = m.on_new_request("r1"), m.on_new_request("r2")
    stored(m, r1, [1, 2, 3])
    stored(m, r2, [4])
    m.on_request_finished(r1)                               # r1's keys become most recent
    m.on_request_finished(r1)                               # counted, otherwise ignored
    assert m.finished_signals == {"r1": 2}
    out = m.prepare_store([5], r2)
    assert out is not None and out.evicted_keys == (4,)


def positioned(m: CPUOffloadingManager, req_id: str, keys: list[OffloadKey]) -> ReqContext:
    """A new request whose chunks are ``keys``, head first (positions 16, 32, ...)."""
    ctx = m.on_new_request(req_id)
    for i, key in enumerate(keys):
        ctx.set_position(key, 16 * (i + 1))
    return ctx


def test_without_finish_lru_evicts_the_request_tail_first() -> None:
    m = CheckedManager(3)
    r1 = positioned(m, "r1", [1, 2, 3])
    stored(m, r1, [1, 2, 3])
    out = m.prepare_store([9], m.on_new_request("r2"))
    assert out is not None and out.evicted_keys == (3,)


def test_without_positions_lru_evicts_in_insert_order() -> None:
    m = CheckedManager(3)
    stored(m, m.on_new_request("r1"), [1, 2, 3])       # no position: fresh ranks
    out = m.prepare_store([9], m.on_new_request("r2"))
    assert out is not None and out.evicted_keys == (1,)


def test_lru_reuse_is_provisional_until_the_request_finishes() -> None:
    """An active request raises the keys it reuses to its own rank (tails before heads);
    finishing it makes its head the most recent."""
    m = CheckedManager(4)
    stored(m, positioned(m, "a", [1, 2]), [1, 2])
    b = positioned(m, "b", [1, 3])
    assert m.prepare_load([1], b) == (0,)
    m.complete_load([1], b)
    stored(m, b, [3])                    # b's rank: 1 at its head, 3 at its tail
    stored(m, positioned(m, "c", [4]), [4])
    out = m.prepare_store([5], m.on_new_request("d"))
    assert out is not None and out.evicted_keys == (2,)   # a's tail; then b's tail 3, head 1
    m.on_request_finished(b)             # committed: 3 then 1 (the head) most recent
    out = m.prepare_store([6, 7], m.on_new_request("e"))
    assert out is not None and out.evicted_keys == (4, 3)


def test_a_write_pending_offer_is_not_an_access() -> None:
    """Offering a key another request is still writing records nothing: finishing the
    request does not refresh that chunk."""
    m = CheckedManager(3)
    a = positioned(m, "a", [1])
    m.prepare_store([1], a)
    b = positioned(m, "b", [1])
    assert m.prepare_store([1], b) == PrepareStoreOutput((), (), ())  # 1 is write pending
    m.complete_store([1], a)
    stored(m, positioned(m, "c", [2]), [2])
    m.on_request_finished(b)             # b saw nothing: 1 stays the oldest
    out = m.prepare_store([3, 4], m.on_new_request("d"))
    assert out is not None and out.evicted_keys == (1,)


def test_an_access_after_a_reset_is_committed_at_finish() -> None:
    m = CheckedManager(2)
    a = positioned(m, "a", [1, 2])
    m.reset_cache()
    stored(m, a, [1])                    # the pre-reset context records afresh
    stored(m, positioned(m, "b", [2]), [2])
    m.on_request_finished(a)             # 1 becomes the most recent
    out = m.prepare_store([3], m.on_new_request("c"))
    assert out is not None and out.evicted_keys == (2,)


def test_store_after_finish_is_refused_and_recorded() -> None:
    m = CheckedManager(2)
    ctx = m.on_new_request("r")
    m.on_request_finished(ctx)
    before = snapshot(m)
    with pytest.raises(ManagerError, match=r"request 'r'.*key 7 is absent") as err:
        m.prepare_store([7], ctx)
    assert err.value.req_id == "r" and err.value.keys == (7,)
    assert m.stores_after_finish == ["r"] and snapshot(m) == before
    # a new incarnation of the same request id may store again
    assert m.prepare_store([7], m.on_new_request("r")) is not None


def test_reset_makes_every_slot_reusable_and_bumps_the_generation() -> None:
    m = CheckedManager(3)
    old = m.on_new_request("old")
    stored(m, old, [1, 2])
    m.prepare_load([1], old)
    m.prepare_store([3], old)
    m.quarantine_store([3])
    m.reset_cache()
    assert m.generation == 1 and m.stats["resets"] == 1
    assert m.chunk_ref_counts() == {} and m.num_free_slots() == 3
    assert m.quarantined_slots == frozenset() and m.num_evictable() == 0
    assert m.lookup(1, old) is LookupResult.MISS

    # late reports of pre-reset jobs: stores are skipped, loads are a contract violation
    m.complete_store([1, 2], old)
    with pytest.raises(ManagerError, match="key 1 is absent"):
        m.complete_load([1], old)
    with pytest.raises(ManagerError, match="release_slots"):
        m.release_slots([2])

    new = m.on_new_request("new")
    assert new.generation == 1
    assert m.prepare_store([4, 5, 6], new) == PrepareStoreOutput((4, 5, 6), (0, 1, 2), ())
    m.on_request_finished(old)                              # older generation: ignored
    assert m.finished_signals == {"old": 1}
    m.on_reset_flushed()
    assert m.reset_flushed_count == 1
    m.on_schedule_end()


def test_a_context_older_than_the_reset_can_still_store() -> None:
    m = CheckedManager(2)
    ctx = m.on_new_request("r")
    m.reset_cache()
    assert m.prepare_store([1], ctx) == PrepareStoreOutput((1,), (0,), ())


# ------------------------------------------------------------------------------ quarantine
def test_quarantine_holds_the_slot_until_released() -> None:
    m = CheckedManager(3)
    ctx = m.on_new_request("r")
    stored(m, ctx, [1])
    m.prepare_store([2, 3], ctx)
    m.take_events()
    assert m.quarantine_store([1, 2, 9]) == (1,)           # only the write-pending key
    assert m.lookup(2, ctx) is LookupResult.MISS and m.chunk_id(2) is None
    assert m.quarantined_slots == frozenset({1})
    assert m.num_free_slots() == 0
    assert m.take_events() == [OffloadingEvent("removed", (2,), metadata_only=True)]
    # the held slot is never handed out, even under eviction pressure
    out = m.prepare_store([4], ctx)
    assert out == PrepareStoreOutput((4,), (0,), (1,))
    before = snapshot(m)
    with pytest.raises(ManagerError, match=r"slot\(s\) \[0\]"):
        m.release_slots([0, 1])
    with pytest.raises(ManagerError):
        m.release_slots([1, 1])
    assert snapshot(m) == before
    m.release_slots([1])
    assert m.quarantined_slots == frozenset() and m.num_free_slots() == 1
    assert m.prepare_store([5], ctx) == PrepareStoreOutput((5,), (1,), ())


# ------------------------------------------------------------------------------ errors
def test_contract_violations_raise_and_change_nothing() -> None:
    m = CheckedManager(4)
    ctx = m.on_new_request("req-9")
    stored(m, ctx, [1, 2])
    m.prepare_store([3], ctx)
    m.prepare_load([2], ctx)
    before = snapshot(m)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: m.prepare_load([1, 8], ctx), r"prepare_load for request 'req-9'.*key 8 is absent"),
        (lambda: m.prepare_load([1, 3], ctx), r"key 3 is write pending in slot 2"),
        (lambda: m.complete_load([1], ctx), r"key 1 is ready in slot 0 with ref_cnt=0"),
        (lambda: m.complete_load([2, 2], ctx), r"key 2 is ready in slot 1 with ref_cnt=1"),
        (lambda: m.complete_load([3], None), r"complete_load: .*key 3 is write pending"),
        (lambda: m.release_slots([0]), r"release_slots"),
    ]
    for call, pattern in cases:
        with pytest.raises(ManagerError, match=pattern) as err:
            call()
        assert isinstance(err.value, KVSpecError)
        assert "nothing was changed" in str(err.value)
        assert snapshot(m) == before


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError):
        CPUOffloadingManager(0)
    with pytest.raises(ConfigError, match="fifo"):
        CPUOffloadingManager(4, "fifo")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ ARC
def test_arc_manager_keeps_reused_chunks_and_adapts_on_ghost_misses() -> None:
    m = CheckedManager(3, "arc")
    arc = m.policy
    assert isinstance(arc, ARCPolicy)
    writer = m.on_new_request("writer")
    stored(m, writer, [1, 2, 3])
    ctx = m.on_new_request("r")
    m.prepare_load([1], ctx)                                # a reuse, committed at finish
    m.complete_load([1], ctx)
    assert list(arc.t2) == []
    m.on_request_finished(ctx)                              # 1 moves to T2
    assert list(arc.t2) == [1]
    out = m.prepare_store([4], writer)
    assert out is not None and out.evicted_keys == (2,)    # LRU end of T1
    assert list(arc.b1) == [2]
    other = m.on_new_request("other")
    assert m.prepare_store([2], other) is not None          # ghost hit in B1: p grows
    assert arc.p == 1.0
    m.prepare_store([2], other)                             # already pending: no new miss
    assert arc.p == 1.0


def test_lru_and_arc_differ_on_a_reused_head() -> None:
    victims = {}
    for policy in ("lru", "arc"):
        m = CheckedManager(2, policy)  # type: ignore[arg-type]
        stored(m, m.on_new_request("writer"), [1, 2])
        ctx = m.on_new_request("r")
        m.prepare_load([1], ctx)
        m.complete_load([1], ctx)
        m.on_request_finished(ctx)           # LRU: 1 most recent; ARC: 1 moves to T2
        stored(m, m.on_new_request("s"), [3])                 # both evict 2
        out = m.prepare_store([4], m.on_new_request("t"))
        assert out is not None
        victims[policy] = out.evicted_keys
    assert victims == {"lru": (1,), "arc": (3,)}            # ARC keeps the reused key
    # ARC only: a key the request loads after inserting it is not a reuse (no T2 promotion)
    m = CheckedManager(3, "arc")
    ctx = m.on_new_request("r")
    stored(m, ctx, [1, 2, 3])
    m.prepare_load([1], ctx)
    m.complete_load([1], ctx)
    m.on_request_finished(ctx)
    assert isinstance(m.policy, ARCPolicy) and list(m.policy.t2) == []


# ------------------------------------------------------------------------------ stateful
KEYS = list(range(8))


class ManagerMachine(RuleBasedStateMachine):
    """Random operations against a dict model of which keys are pending, ready and pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.m = CheckedManager(1)
        self.pending: set[OffloadKey] = set()
        self.pins: dict[OffloadKey, int] = {}    # ready key -> loads in flight
        self.quarantined: set[int] = set()
        self.ctxs: dict[str, ReqContext] = {}
        self.finished: set[str] = set()

    @initialize(num_chunks=st.integers(1, 5), policy=st.sampled_from(POLICY_NAMES))
    def setup(self, num_chunks: int, policy: str) -> None:
        self.m = CheckedManager(num_chunks, policy)  # type: ignore[arg-type]

    def _free(self) -> int:
        return self.m.num_chunks - len(self.pending) - len(self.pins) - len(self.quarantined)

    def _ctx(self, data: st.DataObject) -> ReqContext:
        live = sorted(set(self.ctxs) - self.finished)
        if not live:
            return self.new_request_ctx(data.draw(st.integers(0, 3)))
        return self.ctxs[data.draw(st.sampled_from(live))]

    def new_request_ctx(self, i: int) -> ReqContext:
        req_id = f"r{i}"
        self.ctxs[req_id] = self.m.on_new_request(req_id)
        self.finished.discard(req_id)
        return self.ctxs[req_id]

    @rule(i=st.integers(0, 3))
    def new_request(self, i: int) -> None:
        self.new_request_ctx(i)

    @rule(data=st.data(), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def prepare_store(self, data: st.DataObject, keys: list[OffloadKey]) -> None:
        ctx = self._ctx(data)
        offered = list(dict.fromkeys(keys))
        candidates = [k for k in offered if k not in self.pending and k not in self.pins]
        idle = {k for k, n in self.pins.items() if n == 0 and k not in offered}
        need = len(candidates) - self._free()
        out = self.m.prepare_store(keys, ctx)
        if candidates and need > len(idle):
            assert out is None
            return
        assert out is not None
        assert list(out.keys_to_store) == candidates
        assert len(out.evicted_keys) == max(need, 0) and set(out.evicted_keys) <= idle
        assert len(set(out.chunk_ids)) == len(out.chunk_ids)
        assert not set(out.chunk_ids) & self.quarantined
        assert [self.m.chunk_id(k) for k in candidates] == list(out.chunk_ids)
        for key in out.evicted_keys:
            del self.pins[key]
        self.pending.update(candidates)

    @rule(data=st.data(), success=st.booleans(),
          extra=st.lists(st.sampled_from(KEYS), max_size=2))
    def complete_store(self, data: st.DataObject, success: bool,
                       extra: list[OffloadKey]) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.pending)), unique=True)) \
            if self.pending else []
        self.m.complete_store(chosen + extra, None, success=success)
        done = {k for k in chosen + extra if k in self.pending}
        self.pending -= done
        if success:
            self.pins.update(dict.fromkeys(done, 0))

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        if not self.pins:
            return
        keys = data.draw(st.lists(st.sampled_from(sorted(self.pins)), min_size=1, max_size=3))
        slots = self.m.prepare_load(keys, self._ctx(data))
        assert list(slots) == [self.m.chunk_id(k) for k in keys]
        for key in keys:
            self.pins[key] += 1

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, n in self.pins.items() if n > 0)
        if pinned:
            keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, unique=True))
            self.m.complete_load(keys, None)
            for key in keys:
                self.pins[key] -= 1

    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def bad_call_changes_nothing(self, data: st.DataObject, key: OffloadKey) -> None:
        before = snapshot(self.m)
        if key not in self.pins:
            with pytest.raises(ManagerError):
                self.m.prepare_load([*sorted(self.pins)[:1], key], self._ctx(data))
        if self.pins.get(key, 0) == 0:
            with pytest.raises(ManagerError):
                self.m.complete_load([key], None)
        with pytest.raises(ManagerError):
            self.m.release_slots([self.m.num_chunks + key])
        assert snapshot(self.m) == before

    @rule(data=st.data())
    def quarantine(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=3))
        expected = [k for k in dict.fromkeys(keys) if k in self.pending]
        slots_before = {k: self.m.chunk_id(k) for k in expected}
        slots = self.m.quarantine_store(keys)
        assert list(slots) == [slots_before[k] for k in expected]
        self.pending -= set(expected)
        self.quarantined.update(slots)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.quarantined:
            slots = data.draw(st.lists(st.sampled_from(sorted(self.quarantined)), min_size=1,
                                       unique=True))
            self.m.release_slots(slots)
            self.quarantined -= set(slots)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        if self.ctxs:
            req_id = data.draw(st.sampled_from(sorted(self.ctxs)))
            self.m.on_request_finished(self.ctxs[req_id])
            self.finished.add(req_id)

    @rule(data=st.data())
    def store_after_finish(self, data: st.DataObject) -> None:
        if self.finished:
            req_id = data.draw(st.sampled_from(sorted(self.finished)))
            before = snapshot(self.m)
            with pytest.raises(ManagerError):
                self.m.prepare_store([0], self.ctxs[req_id])
            assert self.m.stores_after_finish[-1] == req_id
            assert snapshot(self.m) == before

    @rule()
    def reset(self) -> None:
        self.m.reset_cache()
        self.pending.clear()
        self.pins.clear()
        self.quarantined.clear()

    @invariant()
    def matches_the_model(self) -> None:
        m = self.m
        assert m.check_consistency() == []
        expected = {**dict.fromkeys(self.pending, -1), **self.pins}
        assert m.chunk_ref_counts() == expected
        assert m.num_free_slots() == self._free()
        assert m.num_evictable() == sum(1 for n in self.pins.values() if n == 0)
        assert m.quarantined_slots == frozenset(self.quarantined)
        probe = ReqContext("probe", m.generation)
        for key in KEYS:
            want = (LookupResult.HIT_PENDING if key in self.pending
                    else LookupResult.HIT if key in self.pins else LookupResult.MISS)
            assert m.lookup(key, probe) is want


ManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                            deadline=None)
TestManagerMachine = ManagerMachine.TestCase
