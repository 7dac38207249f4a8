"""Mutation of the spec itself (`kvspec check --mutate`): the mutants are generated from the
tables, each is checked over the scenarios and the directed programs, and the survivors must
be exactly the ones `spec.equivalents` lists with a reason. The whole matrix (about 6 minutes
on 2 cores) runs in `make mutate` and CI; here, the mechanism on a few mutants over the
cheapest scenarios of the matrix (`small_matrix`), and the proof that lets a run at an
unchanged fingerprint skip searching the listed survivors again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from spec import model as M
from spec.checker import CheckResult
from spec.equivalents import EQUIVALENT, Survivor
from spec.regressions import by_name
from spec.scenarios import Scenario
from statemachine.checker import mutation
from statemachine.checker.mutation import SpecMutant, matrix_scenarios, run_mutant, spec_mutants
from statemachine.cli import main

SMALL = 8
"""The cheapest scenarios of the matrix the mechanism runs on: a survivor searched over the
whole matrix takes about 30 s (`make mutate` searches it there); over these, under a second."""


@pytest.fixture(autouse=True)
def small_matrix(monkeypatch: pytest.MonkeyPatch) -> list[Scenario]:
    whole = matrix_scenarios

    def small(full: bool = False) -> list[Scenario]:
        return whole(full)[:SMALL]

    monkeypatch.setattr(mutation, "matrix_scenarios", small)
    monkeypatch.setattr("statemachine.cli.mutate.matrix_scenarios", small)
    return small()


def _named(name: str) -> SpecMutant:
    return next(m for m in spec_mutants() if m.name == name)


def test_the_small_matrix_is_the_cheapest_of_the_whole() -> None:
    whole = matrix_scenarios()
    assert len(whole) > SMALL
    assert mutation.matrix_scenarios() == whole[:SMALL]
    cost = [sc.expect.states if sc.expect else 0 for sc in whole]
    assert cost == sorted(cost)


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


def test_a_fence_that_never_drains_is_killed_as_liveness(small_matrix: list[Scenario]) -> None:
    mutant = _named("job: ack(STALE)->STALE_DRAINED [reports_complete] drop leave_reset_fence")
    kill = run_mutant(mutant, small_matrix)
    assert kill.killed and kill.by == "liveness P-1" and kill.steps > 0
    ce = mutation.counterexample_of(kill, mutant)  # the kill's whole lasso, found again
    assert ce is not None and ce.verdict == kill.by and len(ce) == kill.steps
    assert ce.cycle and ce.summary == kill.detail


def test_a_listed_survivor_survives_with_its_reason(small_matrix: list[Scenario]) -> None:
    name = "request: add(ABSENT)->IDLE drop create_request_status"
    kill = run_mutant(_named(name), small_matrix)
    assert not kill.killed and kill.equivalent == EQUIVALENT[name]
    assert isinstance(kill.equivalent, Survivor) and kill.equivalent.reason


def _search_finds_nothing(monkeypatch: pytest.MonkeyPatch, mutant: SpecMutant) -> None:
    """Stub the scenarios' search: it finds nothing and fires the mutant's row, which is all
    the spec's own tables fire there (the coverage baseline, stubbed too, so that no cached
    baseline of the real scenarios is left behind)."""
    import statemachine.checker as checker

    searched = CheckResult(M.Bounds(), M.NO_FAULTS)
    searched.covered.add((mutant.machine, mutant.row))
    monkeypatch.setattr(checker, "check", lambda *a, **k: searched)
    monkeypatch.setattr(mutation, "_fired", lambda names: frozenset(searched.covered))


def test_a_survivor_of_the_search_is_killed_by_a_directed_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutant the scenarios leave (here: a search that finds nothing and fires the row)
    runs through the directed programs; one that breaks is the kill, named, with its
    length and verdict; one no program breaks survives."""
    cursor = _named("request: reset(WAITING_STORING)->IDLE drop reset_store_cursor")
    _search_finds_nothing(monkeypatch, cursor)
    kill = run_mutant(cursor, [])
    program = "evicted-loaded-state-stored-while-waiting-then-reset"
    assert (kill.by, kill.scenario) == ("invariant INV-21", f"program {program}")
    assert kill.steps == len(by_name(program).events()) - 1  # broken at the reset
    bookkeeping = _named("request: add(ABSENT)->IDLE drop create_request_status")
    _search_finds_nothing(monkeypatch, bookkeeping)
    assert run_mutant(bookkeeping, matrix_scenarios()[:1]).by == "survived"
    assert run_mutant(bookkeeping, []).by == "coverage"  # no scenario fired its row


def test_cli_only_prints_one_mutants_whole_counterexample(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--only` picks mutants by a part of their name; for one, the kill's counterexample
    is printed whole (here a program's: the search stubbed to find nothing)."""
    name = "request: reset(WAITING_STORING)->IDLE drop reset_store_cursor"
    _search_finds_nothing(monkeypatch, _named(name))
    assert main(["check", "--mutate", "--only", "reset(WAITING_STORING)->IDLE drop reset_store",
                 "--jobs", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [k["mutant"] for k in out["matrix"]] == [name]
    ce = out["counterexample"]
    program = by_name("evicted-loaded-state-stored-while-waiting-then-reset")
    assert ce["steps"] == [str(e) for e in program.events()][:-1]
    assert [v["invariant"] for v in ce["violations"]] == ["INV-21"]
    assert main(["check", "--mutate", "--only", "reset(WAITING_STORING)->IDLE drop reset_store",
                 "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert "reset()" in text and "request r1: store cursor 3 -> 0" in text
    assert "request r2: store cursor" not in text.split(". reset()")[1]


def test_cli_only_refuses_what_it_cannot_pick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--mutate", "--only", "no such row"]) == 2
    assert "no mutant of the tables" in capsys.readouterr().err
    assert main(["check", "--only", "drop"]) == 2
    assert "goes with --mutate" in capsys.readouterr().err


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
        assert main(["check", "--mutate", "--jobs", "1"]) == 1
        text = capsys.readouterr().out
        assert f"survived, not listed as equivalent in spec/equivalents.py: {survivor}" in text
        assert "--tier-program --scenario NAME" in text  # the way to a program that kills it


def _tree(root: Path) -> Path:
    """A copy of the sources the fingerprint reads."""
    for top in ("spec", "statemachine/checker"):
        shutil.copytree(mutation.ROOT / top, root / top,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_fingerprint_follows_the_code_of_the_spec_and_the_checkers_not_their_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mutation, "ROOT", _tree(tmp_path))
    first = mutation.fingerprint()
    assert mutation.fingerprint() == first

    def edited(name: str, edit: Callable[[str], str]) -> str:
        path = tmp_path / name
        original = path.read_text()
        changed = edit(original)
        assert changed != original, f"the edit of {name} found nothing to change"
        path.write_text(changed)
        try:
            return mutation.fingerprint()
        finally:
            path.write_text(original)

    request = "spec/request.py"
    docstring = (tmp_path / request).read_text().split('"""')[1]
    # the reasons are only reported; a module no kill imports is not read
    assert edited("spec/equivalents.py", lambda s: s + "\nX = 1\n") == first
    assert edited("spec/render.py", lambda s: s + "\nX = 1\n") == first
    # text is not code: a docstring reworded, a comment, a blank line
    assert edited(request, lambda s: s.replace(docstring, "reworded", 1)) == first
    assert edited(request, lambda s: s + "\n# a comment\n\n") == first
    assert edited("statemachine/checker/mutation.py",
                  lambda s: s.replace('SLOW_STATES = 2_000_000\n"""Scenarios above',
                                      'SLOW_STATES = 2_000_000\n"""Those above', 1)) == first
    # code is: a statement of the spec, a byte of the C checker
    assert edited(request, lambda s: s + "\nX = 1\n") != first
    assert edited("statemachine/checker/c/model.c", lambda s: s + "\n") != first
    assert mutation.fingerprint() == first


def test_the_fingerprint_reads_every_module_a_kill_loads() -> None:
    """`sources` reads the imports statically; a kill in a fresh interpreter (the compiled
    scenarios, a certificate on the Python model, a liveness lasso, the directed programs and
    their pins, a survivor searched to the end) loads no module of spec/ or the checker
    outside it, the listing of reasons aside."""
    names = ["job: ack(STALE)->STALE_DRAINED [reports_complete] drop leave_reset_fence",
             "request: reset(WAITING_STORING)->IDLE drop reset_store_cursor",
             "request: lookup_resolved(RECOMPUTE,TIMED_OUT)->= drop restart_from_token_zero",
             "request: add(ABSENT)->IDLE drop create_request_status"]
    script = f"""
import json, sys
from statemachine.checker import mutation as m
named = {{x.name: x for x in m.spec_mutants()}}
for name in {names!r}:
    kill = m.run_mutant(named[name], m.matrix_scenarios()[:{SMALL}])
    if kill.killed:
        m.counterexample_of(kill, named[name])
print(json.dumps([getattr(mod, "__file__", None) for name, mod in sys.modules.items()
                  if name.split(".")[0] == "spec" or name.startswith("statemachine.checker")]))
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=mutation.ROOT, check=True,
                         capture_output=True, text=True)
    loaded = {Path(f) for f in json.loads(run.stdout.splitlines()[-1]) if f}
    assert loaded - set(mutation.sources()) == {mutation.ROOT / "spec" / "equivalents.py"}


def test_a_proof_counts_only_at_its_fingerprint_and_scenarios(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proof = tmp_path / "proof.json"
    monkeypatch.setattr(mutation, "PROOF", proof)
    scenarios = mutation.matrix_scenarios()
    assert mutation.proven_survivors(scenarios) == {}  # no file
    survivor = "request: add(ABSENT)->IDLE drop create_request_status"
    kill = mutation.Kill(survivor, "survived", None, 0, 123, equivalent=EQUIVALENT[survivor])
    mutation.write_proof([kill], scenarios)
    assert mutation.proven_survivors(scenarios) == {survivor: 123}
    assert mutation.proven_survivors(scenarios[:-1]) == {}
    data = json.loads(proof.read_text())
    proof.write_text(json.dumps({**data, "fingerprint": "0" * 64}))
    assert mutation.proven_survivors(scenarios) == {}
    proof.write_text("{not json")
    assert mutation.proven_survivors(scenarios) == {}


def test_a_proven_listed_survivor_is_not_searched_again(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    survivor = "request: add(ABSENT)->IDLE drop create_request_status"
    killed = "job: ack(STALE)->STALE_DRAINED [reports_complete] drop leave_reset_fence"
    searched: list[str] = []
    real = mutation._run

    def spy(args: tuple[SpecMutant, bool]) -> mutation.Kill:
        searched.append(args[0].name)
        return real(args)

    monkeypatch.setattr(mutation, "_run", spy)
    proven = {survivor: 7, killed: 9}  # a killed mutant is never taken from a proof
    kills = list(mutation.kill_matrix([_named(survivor), _named(killed)], jobs=1,
                                      proven=proven))
    assert searched == [killed]
    assert (kills[0].mutant, kills[0].by, kills[0].states) == (survivor, "survived", 7)
    assert kills[0].equivalent == EQUIVALENT[survivor] and kills[1].by == "liveness P-1"


def test_only_a_complete_clean_matrix_writes_the_proof(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    proof = tmp_path / "proof.json"
    monkeypatch.setattr(mutation, "PROOF", proof)
    monkeypatch.setattr("statemachine.cli.mutate.PROOF", proof)
    survivor = "request: add(ABSENT)->IDLE drop create_request_status"
    monkeypatch.setattr("statemachine.cli.mutate.spec_mutants", lambda: [_named(survivor)])
    listing = {survivor: EQUIVALENT[survivor]}
    monkeypatch.setattr("statemachine.cli.mutate.EQUIVALENT", listing)
    monkeypatch.setattr(mutation, "EQUIVALENT", listing)
    assert main(["check", "--mutate", "--jobs", "1", "--json"]) == 0  # clean, but partial
    capsys.readouterr()
    assert not proof.exists()
    monkeypatch.setattr(mutation, "spec_mutants", lambda: [_named(survivor)])
    assert main(["check", "--mutate", "--jobs", "1", "--json"]) == 0  # the whole (patched) set
    assert json.loads(capsys.readouterr().out)["proven_before"] == []
    assert set(json.loads(proof.read_text())["survivors"]) == {survivor}
    assert main(["check", "--mutate", "--jobs", "1", "--json"]) == 0  # taken from the proof
    assert json.loads(capsys.readouterr().out)["proven_before"] == [survivor]
