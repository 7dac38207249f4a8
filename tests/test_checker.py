"""The exhaustive model checker: every scenario passes, the tables are fully covered, and
each abstract mutant yields a short, readable counterexample."""

from __future__ import annotations

import json

import pytest

from spec import model as M
from spec.checker import check_model
from spec.scenarios import SCENARIOS, hunt_bounds, parse_bounds
from statemachine import cli, diagrams
from statemachine.mutants import MUTANTS, Mutant


@pytest.fixture(scope="module")
def suite() -> dict[str, object]:
    return {sc.name: check_model(sc.bounds) for sc in SCENARIOS}


def test_every_scenario_passes_and_is_complete(suite: dict[str, object]) -> None:
    for name, r in suite.items():
        assert r.ok, f"{name}: {r.counterexample.render()}"  # type: ignore[attr-defined]
        assert r.complete and r.stuck_states == 0, name  # type: ignore[attr-defined]


def test_the_scenarios_fire_every_table_transition(suite: dict[str, object]) -> None:
    covered: set[tuple[str, int]] = set()
    for r in suite.values():
        covered |= r.covered  # type: ignore[attr-defined]
    missing = [(m, M.MACHINES[m].transitions[i].trigger, M.MACHINES[m].transitions[i].sources)
               for m, i in sorted(M.coverage_universe() - covered)]
    assert missing == []


def test_the_48102_counterexample_is_short_and_fast() -> None:
    r = check_model(hunt_bounds(M.Fault.RESET_KEEPS_TRANSFER_JOBS),
                    frozenset([M.Fault.RESET_KEEPS_TRANSFER_JOBS]))
    ce = r.counterexample
    assert ce is not None and ce.kind == "invariant" and len(ce) <= 10
    assert ce.violations[0].invariant == "INV-1"
    text = ce.render()
    assert "reset()" in text and "transfer_jobs [0] (kept)" in text


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.abstract], ids=lambda m: m.name)
def test_the_checker_finds_each_abstract_mutant(mutant: Mutant) -> None:
    assert mutant.model_fault is not None and mutant.model_fault.value == mutant.name
    r = check_model(hunt_bounds(mutant.model_fault), frozenset([mutant.model_fault]))
    assert r.counterexample is not None, mutant.name


def test_stuck_detection_finds_a_job_that_never_completes() -> None:
    r = check_model(hunt_bounds(M.Fault.AGGREGATE_COUNTS_ONCE),
                    frozenset([M.Fault.AGGREGATE_COUNTS_ONCE]))
    assert r.counterexample is not None and r.counterexample.kind == "stuck"
    assert "no quiescent state" in r.counterexample.summary


def test_cli_check_exit_codes_and_json(capsys: pytest.CaptureFixture[str],
                                       tmp_path: object) -> None:
    assert cli.main(["check", "--scenario", "eviction", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scenarios"][0]["result"] == "pass"
    svg = f"{tmp_path}/ce.svg"
    assert cli.main(["check", "--mutant", "reset-keeps-transfer-jobs", "--svg", svg]) == 1
    out = capsys.readouterr().out
    assert "INV-1" in out and "1. arrive(r0)" in out
    if diagrams.have_dot():
        with open(svg) as fh:
            assert fh.read().startswith("<?xml")
    else:
        with open(f"{tmp_path}/ce.dot") as fh:
            assert fh.read().startswith("digraph counterexample")
    assert cli.main(["check", "--mutant", "no-such"]) == 2
    assert cli.main(["check", "--bounds", "requests=x"]) == 2
    assert cli.main(["check", "--mutant", "pending-count-one"]) == 2


def test_bounds_parsing() -> None:
    b = parse_bounds("requests=1,timeout_steps=none,sync_loads=true", M.Bounds())
    assert (b.requests, b.timeout_steps, b.sync_loads) == (1, None, True)
    with pytest.raises(ValueError, match="bad bound"):
        parse_bounds("nope=1", M.Bounds())


def test_check_svg_without_dot_writes_the_dot_source(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: object) -> None:
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    assert cli.main(["check", "--mutant", "reset-keeps-transfer-jobs",
                     "--svg", f"{tmp_path}/ce.svg"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install -y graphviz" in err and "ce.dot" in err
    with open(f"{tmp_path}/ce.dot") as fh:
        assert "color=red" in fh.read()
