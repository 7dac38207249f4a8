"""Mutation of the spec itself (`kvspec check --mutate`): the mutants are generated from the
tables, each is checked over the scenarios, and the survivors must be exactly the ones
`spec.equivalents` lists with a reason. The whole matrix (about 5 minutes on 2 cores) runs in
`make mutate` and CI; here, the mechanism on a few mutants."""

from __future__ import annotations

import json

import pytest

from spec import model as M
from spec.equivalents import EQUIVALENT, Survivor
from statemachine.checker import mutation
from statemachine.checker.mutation import SpecMutant, matrix_scenarios, run_mutant, spec_mutants
from statemachine.cli import main


def _named(name: str) -> SpecMutant:
    return next(m for m in spec_mutants() if m.name == name)


def test_one_mutant_per_effect_and_per_guard_of_every_row() -> None:
    mutants = spec_mutants()
    rows = [t for spec in M.MACHINES.values() for t in spec.transitions]
    assert len(mutants) == sum(len(t.effects) + len(t.requires) + len(t.unless) for t in rows)
    assert len({m.name for m in mutants}) == len(mutants)
    negated = next(m for m in mutants if m.operator == "negate")
    before, after = negated.transition, negated.tables().machines[negated.machine].transitions[
        negated.row]
    assert set(before.requires) ^ set(after.requires) == {negated.target}
    assert set(before.unless) ^ set(after.unless) == {negated.target}


def test_a_fence_that_never_drains_is_killed_as_liveness() -> None:
    kill = run_mutant(_named("job: ack(STALE)->STALE_DRAINED [reports_complete] drop "
                             "leave_reset_fence"), matrix_scenarios())
    assert kill.killed and kill.by == "liveness P-1" and kill.steps > 0


def test_a_listed_survivor_survives_with_its_reason() -> None:
    name = "request: add(ABSENT)->IDLE drop create_request_status"
    kill = run_mutant(_named(name), matrix_scenarios())
    assert not kill.killed and kill.equivalent == EQUIVALENT[name]
    assert isinstance(kill.equivalent, Survivor) and kill.equivalent.reason


def test_every_listed_survivor_names_a_mutant_of_the_tables() -> None:
    assert set(EQUIVALENT) <= {m.name for m in spec_mutants()}


@pytest.mark.parametrize("listed", [True, False])
def test_cli_fails_on_an_unlisted_survivor_and_on_a_stale_reason(
        listed: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    survivor = "request: add(ABSENT)->IDLE drop create_request_status"
    killed = "job: ack(STALE)->STALE_DRAINED [reports_complete] drop leave_reset_fence"
    monkeypatch.setattr("statemachine.cli.mutate.spec_mutants",
                        lambda: [_named(survivor), _named(killed)])
    listing = {survivor: EQUIVALENT[survivor]} if listed else {}
    if listed:
        listing[killed] = EQUIVALENT[survivor]  # a listed mutant that is killed: stale
    monkeypatch.setattr("statemachine.cli.mutate.EQUIVALENT", listing)
    monkeypatch.setattr(mutation, "EQUIVALENT", listing)
    assert main(["check", "--mutate", "--jobs", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    by = {k["mutant"]: k["by"] for k in out["matrix"]}
    assert by == {survivor: "survived", killed: "liveness P-1"}
    if listed:
        assert out["stale_equivalents"] == [killed] and out["non_equivalent_survivors"] == []
    else:
        assert out["non_equivalent_survivors"] == [survivor] and out["stale_equivalents"] == []
