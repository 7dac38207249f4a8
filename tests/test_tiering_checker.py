"""The tiering model checker: every tiering scenario concludes what it records (verdict,
states, depth), the passing ones together fire every row of the four tiering tables, each
seeded tiering fault is found with a short trace or a lasso, and the tiering invariants each
reject a state that breaks them."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from spec.tiering import TIERING_MACHINES
from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_job as TJ
from spec.tiering.checker import TierCheckResult, check_tiering_model
from spec.tiering.faults import NO_TIER_FAULTS, TIER_FAULT_NAMES, TierFaults, tier_fault
from spec.tiering.invariants import TIER_INVARIANTS, check_tiering
from spec.tiering.model import TierBounds, abstract, events, initial, step
from spec.tiering.scenarios import TIER_FAULT_HUNTS, TIER_SCENARIOS, TierExpect, tier_scenario
from spec.tiering.state import CpuChunk, TieringState, TierJobRecord, TierRequestRecord

pytestmark = pytest.mark.exhaustive


@functools.cache
def _check(bounds: TierBounds, faults: TierFaults = NO_TIER_FAULTS) -> TierCheckResult:
    """Each search once per run (several tests read the same one)."""
    return check_tiering_model(bounds, faults)


@pytest.mark.parametrize("sc", TIER_SCENARIOS, ids=lambda s: s.name)
def test_each_tiering_scenario_concludes_what_it_records(sc) -> None:  # type: ignore[no-untyped-def]
    r = _check(sc.bounds, sc.faults)
    assert TierExpect(r.verdict, r.states, r.depth) == sc.expect, (
        r.counterexample.render() if r.counterexample else r.summary())


def test_the_passing_scenarios_fire_every_row_of_the_tiering_tables() -> None:
    fired: set[tuple[str, str, str, str]] = set()
    for sc in TIER_SCENARIOS:
        if sc.expect.verdict == "pass":
            fired |= _check(sc.bounds, sc.faults).fired
    rows = {(m.name, src, t.trigger, dst) for m in TIERING_MACHINES for src, dst, t in m.edges()}
    assert rows - fired == set()
    assert fired <= rows  # the model fires no row the tables lack


@pytest.mark.parametrize("sc", TIER_FAULT_HUNTS, ids=lambda s: s.name)
def test_each_tiering_fault_is_found_with_a_short_trace(sc) -> None:  # type: ignore[no-untyped-def]
    r = _check(sc.bounds, sc.faults)
    ce = r.counterexample
    assert ce is not None, f"{sc.name} survived: {r.summary()}"
    assert TierExpect(r.verdict, r.states, r.depth) == sc.expect, ce.render()
    assert len(ce) <= 25
    # the same bounds without the fault pass: the counterexample is the fault's
    assert _check(sc.bounds).ok


def test_every_catalogued_tiering_fault_has_a_hunt() -> None:
    assert sorted(TIER_FAULT_NAMES) == sorted(sc.name for sc in TIER_FAULT_HUNTS)


def test_finish_before_final_store_is_the_keyerror_class() -> None:
    sc = tier_scenario("finalize-before-final-store")
    ce = _check(sc.bounds, sc.faults).counterexample
    assert ce is not None and ce.kind == "illegal"
    assert [str(s.event) for s in ce.steps][-2:] == ["finish(0)", "store_done(0, 1)"]
    assert "tier_request r0: no row for 'store_completed' in FINALIZED" in ce.summary


def test_a_promotion_into_a_late_dma_slot_serves_the_wrong_bytes() -> None:
    sc = tier_scenario("promotions-not-held")
    ce = _check(sc.bounds, sc.faults).counterexample
    assert ce is not None and "TINV-7" in ce.summary
    names = [s.event.name for s in ce.steps]
    assert names.index("reset") < names.index("late_dma")
    assert "reset_flushed" not in names  # the promotion did not wait for the flush


def test_a_hung_tier_without_timeout_is_a_lasso_that_a_timeout_breaks() -> None:
    sc = tier_scenario("no-tier-timeout")
    ce = _check(sc.bounds, sc.faults).counterexample
    assert ce is not None and ce.cycle_start is not None and ce.property_id == "TP-1"
    assert "hang(0)" in [str(s.event) for s in ce.steps[:ce.cycle_start]]
    assert "stutters" in ce.render() or ce.cycle_start < len(ce.steps)


def test_the_thrash_lasso_evicts_each_landed_promotion_before_its_requester_loads_it() -> None:
    sc = tier_scenario("tier-promotion-thrash-any-order")
    ce = _check(sc.bounds).counterexample
    assert ce is not None and ce.cycle_start is not None
    cycle = [m for st in ce.steps[ce.cycle_start:] for m in st.moves]
    assert ("READY", "ABSENT", "evicted") in {(s, d, t) for _, _, s, d, t in cycle}
    assert any(t == "promotion_landed" for *_, t in cycle)
    assert not any(t == "load_pinned" for *_, t in cycle)
    # vLLM's order (one poll, then every waiting request in arrival order) has no such cycle
    assert _check(replace(sc.bounds, lookup_order="fcfs")).ok


def _walk() -> list[TieringState]:
    """A short run of the model through a promotion (every state it passes)."""
    s = initial(TierBounds(requests=((0,), (1,), (0,)), cpu_slots=1, tiers=1))
    out = [abstract(s)]
    plan = ["arrive(0)", "arrive(1)", "schedule", "store(0)", "store_done(0, 1)", "io(0, 1)",
            "poll", "store(1)", "store_done(1, 1)", "io(0, 1)", "poll", "arrive(2)",
            "schedule", "end_step", "io(0, 1)"]
    for name in plan:
        ev = next(e for e in events(s) if str(e) == name)
        s = step(s, ev)[0][0]
        out.append(abstract(s))
    return out


def test_the_invariants_hold_along_a_promotion() -> None:
    states = _walk()
    assert any(j.kind == "promotion" and j.state == TJ.REPORTED
               for j in states[-1].jobs)
    assert all(check_tiering(s) == [] for s in states)


def _broken(inv: str) -> TieringState:
    """A state that breaks invariant `inv` only."""
    ok = TieringState.build(cpu=[CpuChunk("k0", CC.READY, 0)], copies=[], jobs=[],
                            requests=[], promotions_held=False, num_slots=2, free_slots=1)
    if inv == "TINV-1":
        return replace(ok, free_slots=2)
    if inv == "TINV-2":
        return replace(ok, jobs=(TierJobRecord("cascade", 0, "r0", ("k0",), (0,),
                                               TJ.SUBMITTED, 0),))
    if inv == "TINV-3":
        return replace(ok, cpu=(CpuChunk("k0", CC.PROMOTION_QUEUED, 0),),
                       jobs=(TierJobRecord("promotion", 0, "r0", ("k0",), (0,), TJ.QUEUED,
                                           3),))
    if inv == "TINV-4":
        return replace(ok, promotions_held=True, cpu=(CpuChunk("k0", CC.PROMOTION_QUEUED, 0),),
                       jobs=(TierJobRecord("promotion", 0, "r0", ("k0",), (0,), TJ.QUEUED),))
    if inv == "TINV-5":
        return replace(ok, cpu=(CpuChunk("k0", CC.PROMOTING, 0),),
                       jobs=(TierJobRecord("promotion", 0, "r0", ("k0",), (0,), TJ.SUBMITTED,
                                           0),))
    assert inv == "TINV-6"
    return replace(ok, requests=(TierRequestRecord("r0", "FINISH_PENDING", 0),))


@pytest.mark.parametrize("inv", [i.id for i in TIER_INVARIANTS])
def test_each_invariant_rejects_a_state_that_breaks_it(inv: str) -> None:
    found = {v.invariant for v in check_tiering(_broken(inv))}
    assert found == {inv}


def test_a_fault_name_is_checked() -> None:
    with pytest.raises(KeyError, match="no tiering fault"):
        tier_fault("no-such-fault")
