"""The reference tiering manager (statemachine.tiering): stores cascade into the tiers, lookups
promote from them, failures, finishes before the final store, resets, hung tiers (timeouts,
stale jobs at a reset, late results), and its internal consistency after every call."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from statemachine.errors import ConfigError, IllegalTransition, InvalidArgument, UnknownTierJob
from statemachine.tiering.io import BytearrayBuffer
from statemachine.tiering.manager import TieringManager
from statemachine.tiering.reference import ReferenceTieringSystem, TierKind
from statemachine.tiering.tiers import JobResult, MemoryTier

SLOT = 32


def data(key: str) -> bytes:
    """A key's bytes: a pure function of the key."""
    return hashlib.sha256(key.encode()).digest()[:SLOT]


class Checked:
    """The reference system, its consistency checked after every call."""

    def __init__(self, sys: ReferenceTieringSystem) -> None:
        self.sys = sys

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.sys, name)
        if not callable(attr) or name in ("project", "check_consistency", "key"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                assert self.sys.check_consistency() == [], name

        return call

    # -- shorthands ---------------------------------------------------------------------
    def store(self, req: str, keys: Sequence[str]) -> tuple[str, ...]:
        """prepare_store, the GPU copy of the keys' bytes, complete_store."""
        out = self.prepare_store(req, keys)
        assert out is not None
        stored, slots = out
        for key, slot in zip(stored, slots, strict=True):
            self.write_slot(slot, data(key))
        self.complete_store(req, list(stored), True)
        return tuple(stored)

    def load(self, req: str, keys: Sequence[str]) -> list[bytes]:
        """prepare_load, the CPU -> GPU copy, complete_load."""
        slots = self.prepare_load(req, keys)
        got = [self.read_slot(s) for s in slots]
        self.complete_load(req, keys)
        return got

    def chunk(self, key: str) -> str:
        return self.sys.project().chunk_state(key)

    def copy(self, tier: int, key: str) -> str:
        return self.sys.project().copy_state(tier, key)

    def job_states(self, kind: str | None = None) -> list[str]:
        return [j.state for j in self.sys.project().jobs if kind in (None, j.kind)]

    @property
    def m(self) -> TieringManager:
        return self.sys.manager


@pytest.fixture
def make() -> Iterator[Callable[..., Checked]]:
    made: list[ReferenceTieringSystem] = []

    def build(num_slots: int = 2, tiers: Sequence[TierKind] = ("memory",),
              **kwargs: Any) -> Checked:
        s = ReferenceTieringSystem(num_slots, tiers, slot_bytes=SLOT, **kwargs)
        made.append(s)
        return Checked(s)

    yield build
    for s in made:
        s.close()


def _evict_into_tier(s: Checked, keys: Sequence[str], filler: Sequence[str]) -> None:
    """Store `keys` (cascaded to every tier), let the cascades finish, then store `filler`
    so the CPU tier evicts `keys`."""
    s.new_request("writer")
    s.store("writer", keys)
    s.request_finished("writer")
    s.run_tier_io()
    s.end_step()
    s.new_request("filler")
    s.store("filler", filler)
    s.request_finished("filler")
    s.run_tier_io()
    s.end_step()
    for k in keys:
        assert s.chunk(k) == CC.ABSENT
        for t in range(s.num_tiers):
            assert s.copy(t, k) == TC.STORED


# ------------------------------------------------------------------ the happy path
@pytest.mark.parametrize("tier", ["memory", "fs"])
def test_store_cascade_evict_promote_load(make: Callable[..., Checked], tier: TierKind) -> None:
    s = make(2, (tier,))
    s.new_request("r1")
    s.store("r1", ["a", "b"])
    # the cascade pinned both keys, once per tier, and the tier writes them
    assert [c.readers for c in s.project().cpu] == [1, 1]
    assert s.copy(0, "a") == TC.WRITING and s.job_states() == [TJ.SUBMITTED]
    s.run_tier_io()
    assert s.copy(0, "a") == TC.STORED and s.job_states() == [TJ.REPORTED]
    s.end_step()

    # a second request's stores evict a and b (prepare_store polls first: pins released)
    s.new_request("r2")
    s.store("r2", ["c", "d"])
    assert s.chunk("a") == CC.ABSENT and s.copy(0, "a") == TC.STORED
    s.run_tier_io()
    s.end_step()

    # a lookup hits the tier: a CPU slot is reserved and the promotion queued
    s.new_request("r3")
    assert s.lookup("r3", "a") == "HIT_PENDING"
    assert s.chunk("a") == CC.PROMOTION_QUEUED and s.job_states("promotion") == [TJ.QUEUED]
    assert s.lookup("r3", "a") == "HIT_PENDING"         # no second promotion
    assert s.m.stats["promotions_queued"] == 1
    s.end_step()                                          # submits it
    assert s.chunk("a") == CC.PROMOTING and s.copy(0, "a") == TC.READING
    assert s.lookup("r3", "a") == "HIT_PENDING"
    s.run_tier_io()
    assert s.copy(0, "a") == TC.STORED and s.job_states("promotion") == [TJ.REPORTED]
    s.end_step()
    assert s.lookup("r3", "a") == "HIT"                   # the next step's poll applied it
    assert s.m.get_load_source(s.key("a"), s.ctx("r3")) == 0
    assert s.load("r3", ["a"]) == [data("a")]
    assert s.m.stats["promoted_keys"] == 1 and s.m.stats["promotions"] == 1


def test_lookup_answers_from_the_cpu_tier_first(make: Callable[..., Checked]) -> None:
    s = make(2)
    s.new_request("r")
    out = s.prepare_store("r", ["a"])
    assert out is not None
    assert s.lookup("r", "a") == "HIT_PENDING"            # write pending
    s.write_slot(out[1][0], data("a"))
    s.complete_store("r", ["a"], True)
    assert s.lookup("r", "a") == "HIT"
    assert s.lookup("r", "zz") == "MISS"
    assert s.m.stats["tier_hits"] == 0


def test_promotion_into_a_full_cpu_tier_misses(make: Callable[..., Checked]) -> None:
    s = make(2)
    _evict_into_tier(s, ["a"], ["c", "d"])
    s.new_request("reader")
    s.prepare_load("reader", ["c", "d"])                  # every slot pinned
    assert s.lookup("reader", "a") == "MISS"
    assert s.chunk("a") == CC.ABSENT and s.job_states() == []
    assert s.m.stats["promotion_allocation_failures"] == 1
    s.complete_load("reader", ["c", "d"])
    assert s.lookup("reader", "a") == "HIT_PENDING"       # a slot can be had again


def test_promotions_are_one_job_per_tier_and_request(make: Callable[..., Checked]) -> None:
    s = make(4)
    _evict_into_tier(s, ["a", "b"], ["c", "d", "e", "f"])
    s.new_request("x")
    s.new_request("y")
    assert [s.lookup("x", "a"), s.lookup("x", "b"), s.lookup("y", "b")] == \
        ["HIT_PENDING"] * 3
    queued = [j for j in s.project().jobs if j.state == TJ.QUEUED]
    assert [(j.req_id, j.keys) for j in queued] == [("x", ("a", "b"))]
    s.end_step()
    assert [(j.job_id, j.state) for j in s.project().jobs] == [(2, TJ.SUBMITTED)]  # 0, 1: cascades


# ------------------------------------------------------------------ I/O failures
def test_failed_cascade_releases_its_pins_and_publishes_nothing(
        make: Callable[..., Checked]) -> None:
    s = make(2, ("memory", "memory"))
    s.tiers[0].fail_next(1)
    s.new_request("r")
    s.store("r", ["a", "b"])
    assert [c.readers for c in s.project().cpu] == [2, 2]
    s.run_tier_io()
    assert s.copy(0, "a") == TC.ABSENT and s.copy(0, "b") == TC.ABSENT
    assert s.copy(1, "a") == TC.STORED                    # the other tier's cascade is fine
    s.end_step()
    s.lookup("r", "a")                                     # the next step's poll
    assert s.job_states() == [] and [c.state for c in s.project().cpu] == [CC.READY] * 2
    assert s.m.stats["cascade_failures"] == 1


def test_a_cascade_stops_at_its_first_error(make: Callable[..., Checked]) -> None:
    s = make(3)
    s.tiers[0].fail_next(1, after=1)
    s.new_request("r")
    s.store("r", ["a", "b", "c"])
    s.run_tier_io()
    assert [s.copy(0, k) for k in "abc"] == [TC.STORED, TC.ABSENT, TC.ABSENT]


def test_failed_promotion_keeps_the_keys_copied_before_the_error(
        make: Callable[..., Checked]) -> None:
    s = make(3)
    _evict_into_tier(s, ["a", "b", "c"], ["x", "y", "z"])
    s.new_request("r")
    assert [s.lookup("r", k) for k in "abc"] == ["HIT_PENDING"] * 3
    s.tiers[0].fail_next(1, after=1)
    s.end_step()
    s.run_tier_io()
    s.end_step()
    assert s.lookup("r", "a") == "HIT"
    assert [s.chunk(k) for k in "abc"] == [CC.READY, CC.ABSENT, CC.ABSENT]
    assert s.m.stats["promotion_failures"] == 1
    assert s.m.stats["promotion_failed_keys"] == 2
    assert s.load("r", ["a"]) == [data("a")]
    assert s.m.get_load_source(s.key("b"), s.ctx("r")) is None
    assert s.project().free_slots == 2                   # the failed keys' slots came back


def test_a_wholly_failed_promotion_frees_its_slots(make: Callable[..., Checked]) -> None:
    s = make(2)
    _evict_into_tier(s, ["a"], ["x", "y"])
    s.new_request("r")
    assert s.lookup("r", "a") == "HIT_PENDING"
    s.tiers[0].fail_next(1)
    s.end_step()
    s.run_tier_io()
    s.end_step()
    assert s.lookup("r", "a") == "HIT_PENDING"     # the poll freed it; a new promotion starts
    assert s.m.stats["promotion_failures"] == 1 and s.m.stats["promotions_queued"] == 2


# ------------------------------------------------------------------ finishing
class RecordingTier(MemoryTier):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[str] = []

    def on_request_finished(self, req_id: str) -> None:
        self.finished.append(req_id)
        super().on_request_finished(req_id)


def _manager_with_recording_tier() -> tuple[TieringManager, RecordingTier, BytearrayBuffer]:
    buf = BytearrayBuffer(2, SLOT)
    tier = RecordingTier(buf)
    return TieringManager(2, [tier]), tier, buf


def test_the_tiers_are_told_only_after_the_last_gpu_store() -> None:
    m, tier, buf = _manager_with_recording_tier()
    ctx = m.on_new_request("r")
    out = m.prepare_store([1, 2], ctx)
    assert out is not None
    m.on_request_finished(ctx)
    assert m.open_requests()[0].state == TR.FINISH_PENDING and tier.finished == []
    for slot in out.chunk_ids:
        buf.write(slot, bytes(SLOT))
    m.complete_store([1, 2], ctx)                 # still cascades, then finalizes
    assert tier.finished == ["r"] and m.open_requests() == []
    assert [j.kind for j in m.jobs()] == ["cascade"]
    with pytest.raises(IllegalTransition) as e:
        m.complete_store([1, 2], ctx)
    assert e.value.machine == "tier_request" and e.value.state == TR.FINALIZED
    assert m.check_consistency() == []


def test_a_request_without_pending_stores_is_finalized_at_once() -> None:
    m, tier, _ = _manager_with_recording_tier()
    ctx = m.on_new_request("r")
    m.on_request_finished(ctx)
    assert tier.finished == ["r"]
    with pytest.raises(IllegalTransition):
        m.on_request_finished(ctx)


def test_contract_violations_are_typed_and_change_nothing() -> None:
    m, _, _ = _manager_with_recording_tier()
    ctx = m.on_new_request("r")
    with pytest.raises(IllegalTransition):
        m.on_new_request("r")
    with pytest.raises(InvalidArgument):
        m.complete_store([1], ctx)                 # nothing pending
    assert m.check_consistency() == [] and m.open_requests()[0].pending_stores == 0


# ------------------------------------------------------------------ resets
def test_reset_drains_the_tiers_and_applies_every_result(make: Callable[..., Checked]) -> None:
    s = make(4)
    _evict_into_tier(s, ["a", "b"], ["c", "d", "e", "f"])
    s.new_request("r")
    assert s.lookup("r", "a") == "HIT_PENDING"
    s.end_step()                                   # a's promotion is SUBMITTED
    assert s.lookup("r", "b") == "HIT_PENDING"     # b's is QUEUED
    s.new_request("w")
    s.store("w", ["g"])                            # g's cascade is SUBMITTED
    assert sorted(s.job_states()) == [TJ.QUEUED, TJ.SUBMITTED, TJ.SUBMITTED]
    s.request_finished("w")
    s.reset()
    p = s.project()
    assert p.cpu == () and p.jobs == () and p.quarantined_slots == frozenset()
    assert p.free_slots == 4 and p.promotions_held
    assert s.copy(0, "g") == TC.STORED             # the drain finished the cascade
    assert [r.req_id for r in p.requests] == ["r"]  # w was finalized
    assert s.m.stats["dropped_promotions"] == 1
    assert s.m.stats["promoted_keys"] == 1         # applied, then forgotten by the reset


def test_promotions_are_held_until_the_reset_is_flushed(make: Callable[..., Checked]) -> None:
    s = make(2)
    _evict_into_tier(s, ["a"], ["x", "y"])
    s.new_request("r")
    s.reset()
    assert s.lookup("r", "a") == "MISS"            # held: recompute, do not promote
    s.end_step()
    assert s.lookup("r", "a") == "MISS"
    s.reset_flushed()
    assert s.lookup("r", "a") == "HIT_PENDING"


def test_a_reset_with_no_tier_holds_nothing() -> None:
    m = TieringManager(2)
    m.reset_cache()
    assert not m.promotions_held


# ------------------------------------------------------------------ hung tiers
def test_a_hung_promotion_times_out_and_its_late_result_is_discarded(
        make: Callable[..., Checked]) -> None:
    s = make(2, tier_job_timeout_steps=2)
    _evict_into_tier(s, ["a"], ["x", "y"])
    s.new_request("r")
    assert s.lookup("r", "a") == "HIT_PENDING"
    slot = s.project().chunk("a").slot
    s.hang(0)
    s.end_step()                                   # submitted
    s.run_tier_io()
    s.end_step()                                   # one step old: still waiting
    assert s.job_states() == [TJ.SUBMITTED]
    s.end_step()                                   # two steps: timed out
    p = s.project()
    assert [j.state for j in p.jobs] == [TJ.TIMED_OUT]
    assert p.chunk_state("a") == CC.ABSENT and p.quarantined_slots == {slot}
    assert p.copy_state(0, "a") == TC.READING      # the hung I/O may still read it
    assert s.m.suspect_tiers == {0}
    assert s.lookup("r", "a") == "MISS"            # the suspect tier is skipped
    # the quarantined slot is never handed out: the CPU tier has one slot left
    s.new_request("w")
    assert s.prepare_store("w", ["p", "q"]) is None
    out = s.prepare_store("w", ["p"])
    assert out is not None and slot not in out[1]
    s.write_slot(out[1][0], data("p"))
    s.complete_store("w", ["p"], True)
    # the late result lands in the quarantined slot, is discarded, the slot released
    s.unhang(0)
    s.run_tier_io()
    s.end_step()
    s.lookup("w", "zz")                            # the poll
    p = s.project()
    assert [j.state for j in p.jobs if j.kind == "promotion"] == []
    assert p.quarantined_slots == frozenset() and p.chunk_state("a") == CC.ABSENT
    assert s.m.stats["late_results"] == 1 and s.m.stats["timeouts"] == 1
    assert s.m.suspect_tiers == frozenset()
    assert s.lookup("w", "a") == "HIT_PENDING"


def test_a_hung_cascade_times_out_keeping_its_pins(make: Callable[..., Checked]) -> None:
    s = make(2, tier_job_timeout_steps=1)
    s.hang(0)
    s.new_request("r")
    s.store("r", ["a"])
    s.end_step()                                   # created this step: not yet
    s.end_step()
    p = s.project()
    assert [j.state for j in p.jobs] == [TJ.TIMED_OUT]
    assert p.chunk("a") is not None and p.chunk("a").state == CC.PINNED
    assert p.copy_state(0, "a") == TC.WRITING
    assert s.load("r", ["a"]) == [data("a")]       # still loadable
    s.unhang(0)
    s.run_tier_io()
    s.end_step()
    s.lookup("r", "zz")
    p = s.project()
    assert p.jobs == () and p.chunk_state("a") == CC.READY
    assert p.copy_state(0, "a") == TC.STORED       # the late copy was published all the same
    assert s.m.stats["late_results"] == 1


def test_a_hung_tier_at_a_reset_makes_its_jobs_stale(make: Callable[..., Checked]) -> None:
    s = make(3)
    _evict_into_tier(s, ["a"], ["x", "y", "z"])
    s.new_request("r")
    assert s.lookup("r", "a") == "HIT_PENDING"
    s.end_step()                                   # promotion submitted
    s.hang(0)
    s.new_request("w")
    s.store("w", ["b"])                            # cascade submitted to the hung tier
    p = s.project()
    held = {p.chunk("a").slot, p.chunk("b").slot}
    s.reset()
    p = s.project()
    assert sorted(j.state for j in p.jobs) == [TJ.STALE, TJ.STALE]
    assert p.cpu == () and p.quarantined_slots == held and p.free_slots == 1
    assert s.m.suspect_tiers == {0} and s.m.stats["stale"] == 2
    s.unhang(0)
    s.run_tier_io()
    s.lookup("r", "zz")                            # the poll drains both late results
    p = s.project()
    assert p.jobs == () and p.quarantined_slots == frozenset() and p.free_slots == 3
    assert s.m.stats["late_results"] == 2
    assert p.copy_state(0, "b") == TC.STORED


def test_a_slot_two_hung_cascades_read_is_freed_after_both(
        make: Callable[..., Checked]) -> None:
    s = make(2, ("memory", "memory"))
    s.hang(0)
    s.hang(1)
    s.new_request("w")
    s.store("w", ["a"])
    slot = s.project().chunk("a").slot
    s.reset()
    assert s.project().quarantined_slots == {slot}
    s.unhang(0)
    s.run_tier_io()
    s.lookup("w", "zz")
    assert s.project().quarantined_slots == {slot}   # tier 1 may still read it
    s.unhang(1)
    s.run_tier_io()
    s.end_step()
    s.lookup("w", "zz")
    assert s.project().quarantined_slots == frozenset()


# ------------------------------------------------------------------ typed errors, config
def test_a_result_for_an_unknown_job_is_a_typed_error(make: Callable[..., Checked]) -> None:
    s = make(2)
    s.new_request("r")
    s.store("r", ["a"])
    s.run_tier_io()
    s.tiers[0].inject_result(JobResult(99, True))
    s.end_step()                                   # prepare_store polled this step
    with pytest.raises(UnknownTierJob) as e:
        s.lookup("r", "a")
    assert (e.value.tier, e.value.job_id) == (0, 99)
    assert "tier 0" in str(e.value) and "job 99" in str(e.value)
    assert s.job_states() == []                    # the real result was applied


def test_a_result_reported_twice_is_a_typed_error(make: Callable[..., Checked]) -> None:
    s = make(2)
    s.new_request("r")
    s.store("r", ["a"])
    s.run_tier_io()
    s.lookup("r", "a")
    s.tiers[0].inject_result(JobResult(0, True))
    s.end_step()
    with pytest.raises(UnknownTierJob, match="already applied"):
        s.lookup("r", "a")


def test_out_of_scope_configurations_are_refused() -> None:
    buf = BytearrayBuffer(2, SLOT)
    tier = MemoryTier(buf)
    tier.offload_policy = "request"
    with pytest.raises(ConfigError, match="request-level"):
        TieringManager(2, [tier])
    with pytest.raises(ConfigError, match="back-pressure"):
        TieringManager(2, [], backpressure=True)
    with pytest.raises(ConfigError):
        TieringManager(2, [], tier_job_timeout_steps=0)


def test_every_move_is_a_table_row(make: Callable[..., Checked]) -> None:
    s = make(2)
    s.new_request("r")
    s.store("r", ["a"])
    s.run_tier_io()
    s.end_step()
    s.lookup("r", "a")
    moves = [(f.machine, f.trigger, f.source, f.dest) for f in s.m.fired]
    assert moves == [
        ("tier_request", "registered", TR.UNKNOWN, TR.ACTIVE),
        ("tier_request", "store_prepared", TR.ACTIVE, TR.ACTIVE),
        ("tier_job", "cascade_created", TJ.UNALLOCATED, TJ.SUBMITTED),
        ("tier_request", "store_completed", TR.ACTIVE, TR.ACTIVE),
        ("tier_job", "io_finished", TJ.SUBMITTED, TJ.REPORTED),
        ("tier_job", "polled", TJ.REPORTED, TJ.DONE),
    ]


def test_threaded_tier_io_gives_the_same_result(make: Callable[..., Checked]) -> None:
    s = make(2, ("fs", "memory"), threads=2)
    _evict_into_tier(s, ["a", "b"], ["c", "d"])
    s.new_request("r")
    assert [s.lookup("r", "a"), s.lookup("r", "b")] == ["HIT_PENDING"] * 2
    s.end_step()
    s.run_tier_io()
    s.end_step()
    assert [s.lookup("r", "a"), s.lookup("r", "b")] == ["HIT", "HIT"]
    assert s.load("r", ["a", "b"]) == [data("a"), data("b")]


@pytest.mark.parametrize("marks_present", [False, True], ids=["0.33", "marks-present"])
def test_a_stored_copy_turns_a_cached_miss_into_a_hit_only_with_marks_present(
        make: Callable[..., Checked], marks_present: bool) -> None:
    """A probe's miss verdict is cached while the request that asked is alive. As vLLM
    0.33.0 does (finding T2), a copy another request's cascade stores later stays a MISS
    for it; with `marks_present` (vLLM 0.34.0's `mark_present`) the cascade's success
    turns the verdict into a hit, and the copy is promoted."""
    s = make(2, ("fs",), async_lookup=True, marks_present=marks_present)
    s.new_request("r")
    assert s.lookup("r", "a") == "RETRY"
    s.end_step()
    s.run_tier_io()
    s.end_step()
    assert s.lookup("r", "a") == "MISS"            # nowhere yet: a cached miss
    _evict_into_tier(s, ["a"], ["x", "y"])          # stored, cascaded, evicted from the CPU
    assert s.lookup("r", "a") == ("HIT_PENDING" if marks_present else "MISS")


def test_async_lookups_answer_retry_until_the_probe_resolved(
        make: Callable[..., Checked]) -> None:
    s = make(2, ("fs",), async_lookup=True)
    _evict_into_tier(s, ["a"], ["x", "y"])
    s.new_request("r")
    assert s.lookup("r", "a") == "RETRY"           # probe queued
    assert s.lookup("r", "nope") == "RETRY"
    s.end_step()                                   # probes sent
    s.run_tier_io()                                # the lookup thread answers
    s.end_step()
    assert s.lookup("r", "a") == "HIT_PENDING"
    assert s.lookup("r", "nope") == "MISS"
