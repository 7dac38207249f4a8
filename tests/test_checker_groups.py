"""The model checker over the groups' paths: every scenario runs on the compiled twin (the
Python model, its reference, checks each again in `make check-groups` and state by state in
`test_checker_compiled.py`), the scenarios fire every table row, and a partial tail loaded
into the wrong block is found by INV-22 alone.

A file of its own so that `make test` (one file per worker) runs these searches beside the
compiled ones of `test_checker.py`."""

from __future__ import annotations

import pytest

from spec import model as M
from spec.scenarios import SCENARIOS, hunt_bounds
from statemachine.checker import check, compiled

pytestmark = pytest.mark.exhaustive


def test_the_compiled_twin_takes_every_scenario() -> None:
    """Full attention, sliding windows, Mamba groups and partial tails: no scenario is left
    to the Python model, so the mutation matrix runs them all."""
    assert {sc.name: compiled.fits(sc.bounds) for sc in SCENARIOS
            if compiled.fits(sc.bounds) is not None} == {}


def test_the_compiled_scenarios_fire_every_transition() -> None:
    """The scenarios under a million states (seconds each; the rows of the larger ones are
    theirs too) fire every row of every table, `WAITING_STORING`'s among them (a Mamba
    group's hand-offs). The safety search alone: a row fires on an edge, and the liveness
    pass walks the edges that search found."""
    covered: set[tuple[str, int]] = set()
    for sc in SCENARIOS:
        if sc.expect is not None and sc.expect.states < 1_000_000:
            covered |= check(sc.bounds, liveness=False).covered
    missing = [(m, M.MACHINES[m].transitions[i].trigger, M.MACHINES[m].transitions[i].sources)
               for m, i in sorted(M.coverage_universe() - covered)]
    assert missing == []


def test_a_partial_tail_loaded_into_the_wrong_block_is_found_by_inv22_alone() -> None:
    """A load that counts its blocks and chunks with floor division puts the boundary's key
    into the last complete block: INV-22 finds it at the load's creation; with INV-22 off,
    no other property does under the same bounds (the tables see nothing wrong)."""
    fault = M.Fault.TAIL_LOAD_ROUNDS_DOWN
    bounds = hunt_bounds(fault)
    r = check(bounds, frozenset({fault}))
    assert r.counterexample is not None and r.verdict == "invariant INV-22", r
    text = r.counterexample.render()
    assert "update_state_after_alloc" in text and len(r.counterexample.steps) <= 10, text
    assert r.engine == "compiled"
    # the same bounds pass without the fault: scenario `partial-tails`
    blind = check(bounds, frozenset({fault}), without=frozenset({"INV-22"}))
    assert blind.counterexample is None and blind.states > r.states
