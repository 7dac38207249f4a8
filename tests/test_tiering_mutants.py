"""Each tiering mutant (`statemachine.tiering.mutants`) is found twice: by the tiering model
checker (its model fault, `tests/test_tiering_checker.py` pins the counterexample) and by the
model-based tests on the patched reference; without a mutant the same search passes. The
mutant the model-based tests cannot reach (a hang is not one of their rules) is caught by a
direct test of the reference here."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from spec.tiering.checker import check_tiering_model
from spec.tiering.cpu_chunk import prefix_scan
from spec.tiering.faults import TIER_FAULT_NAMES
from spec.tiering.scenarios import tier_scenario
from statemachine.tiering.mutants import TIER_MUTANTS, tier_mutant
from statemachine.tiering.reference import ReferenceTieringSystem
from statemachine.tiering.testing import TieringStateMachine, TierSetup, replay

HUNT = settings(max_examples=400, stateful_step_count=40, derandomize=True, deadline=None,
                database=None, phases=(Phase.generate,),
                suppress_health_check=list(HealthCheck))


def _reference(setup: TierSetup) -> ReferenceTieringSystem:
    return ReferenceTieringSystem(setup.num_slots, ("memory",) * setup.num_tiers)


class ReferenceMachine(TieringStateMachine):
    system_factory = staticmethod(_reference)


def test_the_catalogue_matches_the_model_faults() -> None:
    assert [m.name for m in TIER_MUTANTS] == list(TIER_FAULT_NAMES)
    with pytest.raises(KeyError, match="no tiering mutant"):
        tier_mutant("nope")


@pytest.mark.parametrize("m", TIER_MUTANTS, ids=lambda m: m.name)
def test_the_checker_finds_each_mutant_s_model_fault(m) -> None:  # type: ignore[no-untyped-def]
    sc = tier_scenario(m.name)
    assert not check_tiering_model(sc.bounds, sc.faults).ok


def test_the_reference_passes_the_hunt_without_a_mutant() -> None:
    run_state_machine_as_test(ReferenceMachine, settings=HUNT)


REPLAYED = {
    # the checker's counterexample (kvspec check --mutant promotions-not-held) as a program
    # of the machine: a reset with a GPU store in flight, a promotion into its slot, the late
    # copy landing over it. Random programs reach that order too rarely to pin.
    "promotions-not-held": (
        "setup(1 CPU slot(s), 1 tier(s)) ; new_request(r0: a0) ; lookup(r0) ; store(r0: a0) ; "
        "store_done(r0: a0, ok) ; end_step ; run_tier_io ; end_step ; new_request(r1: b0) ; "
        "lookup(r1) ; store(r1: b0) ; reset ; new_request(r2: a0) ; lookup(r2) ; end_step ; "
        "run_tier_io ; late_dma(b0 -> slot 0) ; lookup(r2)"),
}


@pytest.mark.parametrize("m", [m for m in TIER_MUTANTS if m.caught_by_tests],
                         ids=lambda m: m.name)
def test_the_model_based_tests_find_each_mutant(m) -> None:  # type: ignore[no-untyped-def]
    trace = REPLAYED.get(m.name)
    if trace is not None:
        replay(ReferenceMachine, trace)  # the spec passes the program
        with m.patch(), pytest.raises(AssertionError, match="TINV-7"):
            replay(ReferenceMachine, trace)
        return
    with m.patch(), pytest.raises(Exception) as caught:
        run_state_machine_as_test(ReferenceMachine, settings=HUNT)
    assert not isinstance(caught.value, (KeyboardInterrupt, SystemExit))


def test_without_a_timeout_a_hung_tier_keeps_its_promotion_forever() -> None:
    """no-tier-timeout: the reference with a tier job timeout ends the hung promotion; the
    mutant keeps it (and its requester deferred) however many steps pass."""
    for patched in (False, True):
        sys_ = ReferenceTieringSystem(1, ("memory",), tier_job_timeout_steps=3)
        sys_.new_request("r0")
        (_keys, slots) = sys_.prepare_store("r0", ["k0"]) or ((), ())
        sys_.write_slot(slots[0], b"k0" * 8)
        sys_.complete_store("r0", ["k0"], True)
        sys_.run_tier_io()
        sys_.end_step()
        sys_.new_request("r1")
        assert sys_.prepare_store("r1", ["k1"]) is not None  # evicts k0 (in the tier now)
        sys_.write_slot(0, b"k1" * 8)
        sys_.complete_store("r1", ["k1"], True)
        sys_.run_tier_io()
        sys_.end_step()
        sys_.new_request("r2")
        assert sys_.lookup("r2", "k0") == "HIT_PENDING"
        sys_.hang(0)
        ctx = tier_mutant("no-tier-timeout").patch() if patched else contextlib.nullcontext()
        with ctx:
            for _ in range(10):
                sys_.end_step()
                answer = sys_.lookup("r2", "k0")
        promotions = [j for j in sys_.project().jobs if j.kind == "promotion"]
        if patched:
            assert answer == "HIT_PENDING" and promotions[0].state == "SUBMITTED"
        else:
            assert answer == "MISS" and promotions[0].state == "TIMED_OUT"
        sys_.unhang(0)
        sys_.close()


def _stored_then_evicted(prefix: list[str], others: list[str]) -> ReferenceTieringSystem:
    """Two CPU slots; `prefix` stored and cascaded to the tier, then evicted by `others`."""
    sys_ = ReferenceTieringSystem(2, ("memory",))
    sys_.new_request("w")
    for k in prefix + others:
        out = sys_.prepare_store("w", [k])
        assert out is not None
        for key, slot in zip(*out, strict=True):
            sys_.write_slot(slot, key.encode() * 8)
        sys_.complete_store("w", list(out[0]), True)
        sys_.end_step()
        sys_.run_tier_io()
        sys_.end_step()
    sys_.request_finished("w")
    return sys_


@pytest.mark.parametrize("patched", [False, True], ids=["spec", "vllm"])
def test_a_prefix_longer_than_the_cpu_tier_loads_what_fits(patched: bool) -> None:
    """promotion-evicts-own-prefix (T1): the spec's lookup keeps the chunks its scan hit, so
    a 3-chunk prefix over 2 CPU slots ends HIT, HIT, MISS (two load, one is computed); with
    vLLM's rule every round evicts an earlier chunk of the prefix, and it defers forever."""
    sys_ = _stored_then_evicted(["a0", "a1", "a2"], ["x0", "x1"])
    sys_.new_request("r")
    mutant = tier_mutant("promotion-evicts-own-prefix")
    ctx = mutant.patch() if patched else contextlib.nullcontext()
    rounds = []
    with ctx:
        for _ in range(8):
            rounds.append(prefix_scan(lambda k: sys_.lookup("r", k), ["a0", "a1", "a2"]))
            sys_.end_step()
            sys_.run_tier_io()
    if patched:
        assert all("HIT_PENDING" in r for r in rounds), rounds
    else:
        assert rounds[-1] == ["HIT", "HIT", "MISS"], rounds
    sys_.close()
