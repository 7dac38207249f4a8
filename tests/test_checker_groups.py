"""The model checker beyond the compiled twin: the scenarios it does not take (partial
tails) conclude what they record on the Python model, the faults of their paths are found,
and the compiled scenarios fire every table row.

A file of its own so that `make test` (one file per worker) runs these searches beside the
compiled ones of `test_checker.py`."""

from __future__ import annotations

import functools

import pytest

from spec import model as M
from spec.checker import CheckResult
from spec.scenarios import SCENARIOS, Expect, Scenario, by_name, hunt_bounds
from statemachine.checker import check, compiled

pytestmark = pytest.mark.exhaustive

PYTHON = tuple(sc for sc in SCENARIOS if compiled.fits(sc.bounds) is not None)
"""The scenarios of partial tails: the Python model runs them."""


@functools.cache
def _check(name: str) -> CheckResult:
    """A scenario's check, once per worker, in the first test that asks (the workers of
    `make test` take these tests one by one, so each search runs where its test does)."""
    return check(by_name(name).bounds)


@pytest.mark.parametrize("scenario", PYTHON, ids=lambda s: s.name)
def test_each_scenario_of_the_groups_concludes_what_it_records(scenario: Scenario) -> None:
    _concludes(scenario)


def _concludes(scenario: Scenario) -> CheckResult:
    assert scenario.expect is not None
    r = _check(scenario.name)
    assert r.complete and r.engine == f"python ({compiled.fits(scenario.bounds)})"
    assert Expect(r.verdict, r.states, r.depth) == scenario.expect, (
        r.counterexample.render() if r.counterexample else r)
    assert r.liveness == ("P-1", "P-2", "P-3", "P-4", "P-5")
    return r


def test_the_compiled_scenarios_fire_every_transition() -> None:
    """The compiled scenarios under a million states (seconds each; the rows of the larger
    ones are theirs too) fire every row of every table, `WAITING_STORING`'s among them (a
    Mamba group's hand-offs): the Python scenarios fire none of their own, so the mutation
    matrix, which runs the compiled ones, reaches every row."""
    covered: set[tuple[str, int]] = set()
    for sc in SCENARIOS:
        if compiled.fits(sc.bounds) is None and sc.expect is not None \
                and sc.expect.states < 1_000_000:
            covered |= check(sc.bounds).covered
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
    # the same bounds pass without the fault: scenario `partial-tails`
    blind = check(bounds, frozenset({fault}), without=frozenset({"INV-22"}))
    assert blind.counterexample is None and blind.states > r.states
