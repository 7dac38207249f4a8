"""Row witnesses (`spec.witnesses`): every row of the tables has a program that fires it, the
program is a path of the current model that breaks nothing, and the reference implementation
takes it with every check of the random runs (refinement, invariants after every hook, the
drain). A random soak may never reach a row; its witness does, every run."""

from __future__ import annotations

import pytest

from spec import model as M
from spec import witnesses as W
from spec.checker import check_program, replay, row_witnesses
from spec.scenarios import by_name
from statemachine.cli import main
from statemachine.testing import OffloadingStateMachine
from statemachine.testing import replay as replay_on_reference


def test_every_row_has_one_witness_in_table_order() -> None:
    assert [w.row for w in W.WITNESSES] == list(W.all_rows())
    assert len(W.all_rows()) == len(M.coverage_universe())
    assert {w.scenario for w in W.WITNESSES} <= {s.name for s in W.search_order()}


def test_first_firing_names_the_first_scenario_in_search_order_that_fires_a_row() -> None:
    """Scenario i (in search order) fires the first row and row i: the first row is first
    fired by the first scenario, and every other row by its own; a row no scenario fires has
    no entry, and the walk stops once every row has one."""
    order, rows = W.search_order(), list(W.all_rows().items())
    universe = [row for _, row in rows]
    calls: list[M.Bounds] = []

    def covers(bounds: M.Bounds) -> set[tuple[str, int]]:
        calls.append(bounds)
        return {universe[0], universe[len(calls) - 1]}

    first = W.first_firing(covers)
    assert calls == [s.bounds for s in order]
    assert first == {name: order[i].name for i, (name, _) in enumerate(rows[:len(order)])}
    calls.clear()
    assert W.first_firing(lambda b: calls.append(b) or set(universe)) == \
        {name: order[0].name for name, _ in rows}
    assert calls == [order[0].bounds]


@pytest.mark.parametrize("w", W.WITNESSES, ids=[w.row for w in W.WITNESSES])
def test_the_witness_fires_its_row_at_its_last_step_only(w: W.Witness) -> None:
    """On the current tables: the path breaks no invariant and no table, and its row fires
    at its last step and not before (the path is the one that first reaches it)."""
    events = w.events()
    assert check_program(w.bounds, events) is None
    row = W.all_rows()[w.row]
    s = M.initial(w.bounds)
    for i, ev in enumerate(events):
        s, _calls, world = M.apply(s, ev)
        assert (row in world.fired) == (i == len(events) - 1), f"{w.row} at {ev}"


@pytest.mark.parametrize("w", W.WITNESSES, ids=[w.row for w in W.WITNESSES])
def test_the_reference_takes_the_witness(w: W.Witness) -> None:
    path = replay_on_reference(w.events(), w.bounds)
    assert len(path) == len(w.events()), "an event of the witness was not taken"


def test_the_machine_counts_the_rows_a_program_fires() -> None:
    """`OffloadingStateMachine.rows_fired`, which the soaks add up, counts the witness's row
    once: at its last step."""
    w = W.by_row("r48")
    m = OffloadingStateMachine()
    m.begin(w.bounds)
    for ev in w.events()[:-1]:
        m._step(ev)
    assert W.all_rows()["r48"] not in m.rows_fired
    m._step(w.events()[-1])
    assert m.rows_fired[W.all_rows()["r48"]] == 1
    assert m.rows_fired[W.all_rows()["r1"]] == sum(e.kind == "arrive" for e in w.events())


def test_a_witness_is_a_shortest_path_to_its_row_in_its_scenario() -> None:
    """The search is breadth-first: no shorter program of the scenario fires the row (checked
    for the witnesses of the first scenario, whose search is quick)."""
    first = W.WITNESSES[0].scenario
    mine = [w for w in W.WITNESSES if w.scenario == first]
    rows = {W.all_rows()[w.row]: w for w in mine}
    found = row_witnesses(by_name(first).bounds, set(rows))
    assert set(found) == set(rows)
    for row, steps in found.items():
        assert len(steps) == len(rows[row].events())
    # and the search stops at what it was asked for
    one = next(iter(rows))
    assert set(row_witnesses(by_name(first).bounds, {one})) == {one}


def test_kvspec_witness_prints_the_path_and_names_the_row(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    w = W.by_row("r48")
    assert main(["witness", "r48"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("witness of r48: request load_recving ['ORPHANED_LOAD'] -> IDLE")
    steps = replay(w.bounds, w.events(), canonical_ids=False)
    assert f"{len(steps):3}. {steps[-1].event}" in out
    assert out.rstrip().splitlines()[-1].startswith(f"  step {len(steps)} fires r48: request")
    assert "ORPHANED_LOAD -> IDLE by load_recving" in out
    assert main(["witness"]) == 0
    listing = capsys.readouterr().out
    assert f"{len(W.WITNESSES)} witnesses for {len(W.all_rows())} rows" in listing
    assert main(["witness", "r999"]) == 2
    assert "no row r999" in capsys.readouterr().err


@pytest.mark.deep
def test_each_witness_runs_under_the_first_scenario_that_fires_its_row() -> None:
    """Each program of `spec/witnesses.json` runs under the scenario `kvspec witness
    --write` would pick now: the first in `search_order` whose search fires the row (the
    compiled checker's coverage; `make check-groups`, since the search passes through
    `three-requests`). A change to the model or the scenarios that lets a simpler scenario
    reach a row leaves the file stale, and this says which rows to write again."""
    from statemachine.checker import check

    first = W.first_firing(lambda bounds: check(bounds, liveness=False,
                                                engine="compiled").covered)
    stale = {w.row: (w.scenario, first.get(w.row)) for w in W.WITNESSES
             if first.get(w.row) != w.scenario}
    assert not stale, f"written under, first fired in: {stale}; run `kvspec witness --write`"
