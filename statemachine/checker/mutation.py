"""Mutation of the spec itself: the tables with one effect removed from one row, or one guard
of one row negated, each checked over the scenarios. The kill matrix says, per mutant, what
caught it: a safety invariant, a progress property, an event left with no row (`illegal`), a
row no scenario fires any more (`coverage`), or nothing (`survived`). A survivor is either a
gap in the checks or a mutant equivalent to the spec; `spec.equivalents` lists the second
kind with the reason, and the tests demand that the survivors are exactly those.

The compiled checker takes the mutated rows at run time (no rebuild); each finding is
replayed and certified on the Python model running the same mutated tables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

from spec import model as M
from spec.equivalents import EQUIVALENT, Survivor
from spec.scenarios import SCENARIOS, Scenario
from spec.schema import SAME, MachineSpec, Transition

Operator = Literal["drop", "negate"]

SLOW_STATES = 2_000_000
"""Scenarios above this many states (three-requests) are left out of the matrix by default:
a survivor would take a minute on each; `full=True` includes them."""


def row_name(t: Transition) -> str:
    """A row as a mutant names it: trigger(sources)->destination [guards]."""
    dest = "=" if t.dest == SAME else t.dest
    guard = f" [{t.guard_text}]" if t.requires or t.unless else ""
    return f"{t.trigger}({','.join(t.sources)})->{dest}{guard}"


@dataclass(frozen=True)
class SpecMutant:
    machine: str
    row: int
    """The row's index in its machine's table."""
    operator: Operator
    target: str
    """The effect dropped, or the guard negated."""

    @property
    def transition(self) -> Transition:
        return M.MACHINES[self.machine].transitions[self.row]

    @property
    def name(self) -> str:
        return f"{self.machine}: {row_name(self.transition)} {self.operator} {self.target}"

    def tables(self) -> M.Tables:
        t = self.transition
        if self.operator == "drop":
            effects = list(t.effects)
            effects.remove(self.target)
            new = replace(t, effects=tuple(effects))
        elif self.target in t.requires:
            new = replace(t, requires=tuple(g for g in t.requires if g != self.target),
                          unless=(*t.unless, self.target))
        else:
            new = replace(t, unless=tuple(g for g in t.unless if g != self.target),
                          requires=(*t.requires, self.target))
        spec = M.MACHINES[self.machine]
        rows = list(spec.transitions)
        rows[self.row] = new
        machines: dict[str, MachineSpec] = dict(M.MACHINES)
        machines[self.machine] = replace(spec, transitions=tuple(rows))
        return M.Tables(machines)


def spec_mutants() -> list[SpecMutant]:
    """One mutant per (row, effect) with the effect removed, one per (row, guard) with the
    guard negated (a `requires` becomes an `unless` and back)."""
    out: list[SpecMutant] = []
    for machine, spec in M.MACHINES.items():
        for i, t in enumerate(spec.transitions):
            out += [SpecMutant(machine, i, "drop", e) for e in t.effects]
            out += [SpecMutant(machine, i, "negate", g) for g in (*t.requires, *t.unless)]
    return out


@dataclass(frozen=True)
class Kill:
    mutant: str
    by: str
    """`invariant INV-n`, `liveness P-n`, `illegal`, `coverage`, `survived`."""
    scenario: str | None
    steps: int
    states: int
    """States explored until the kill (or in all, for a survivor)."""
    equivalent: Survivor | None = None
    """For a survivor `spec.equivalents` lists: its kind and the reason."""
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.by != "survived"


def matrix_scenarios(full: bool = False) -> list[Scenario]:
    """The scenarios each mutant is checked against, cheapest first (a kill comes sooner)."""
    from statemachine.checker import compiled

    # the hybrid scenarios run on the Python model only (the compiled twin has one
    # full-attention group): about a thousand times slower per mutant, so not in the matrix
    chosen = [s for s in SCENARIOS if compiled.fits(s.bounds) is None
              and (full or s.expect is None or s.expect.states <= SLOW_STATES)]
    return sorted(chosen, key=lambda s: s.expect.states if s.expect else 0)


def run_mutant(m: SpecMutant, scenarios: Iterable[Scenario]) -> Kill:
    from statemachine.checker import CheckerDisagreement, check

    tables = m.tables()
    covered: set[tuple[str, int]] = set()
    states = 0
    for sc in scenarios:
        try:
            r = check(sc.bounds, tables=tables)
        except CheckerDisagreement as exc:  # a bug of the compiled twin: surface it
            return Kill(m.name, "disagreement", sc.name, 0, states, detail=str(exc))
        states += r.states
        covered |= r.covered
        if r.counterexample is not None:
            ce = r.counterexample
            return Kill(m.name, r.verdict, sc.name, len(ce), states, detail=ce.summary)
    missing = tables.coverage_universe() - covered
    if missing:
        machine, index = min(missing)
        row = row_name(tables.machines[machine].transitions[index])
        return Kill(m.name, "coverage", None, 0, states, detail=f"{machine}: {row} never fires")
    return Kill(m.name, "survived", None, 0, states, equivalent=EQUIVALENT.get(m.name))


def _run(args: tuple[SpecMutant, bool]) -> Kill:
    m, full = args
    return run_mutant(m, matrix_scenarios(full))


def kill_matrix(mutants: list[SpecMutant] | None = None, full: bool = False,
                jobs: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> Iterator[Kill]:
    """Every mutant's kill, in the order of `mutants` (default: all of `spec_mutants`), run
    over `jobs` processes (default: every core)."""
    todo = spec_mutants() if mutants is None else mutants
    workers = jobs or os.cpu_count() or 1
    if workers == 1:
        for n, m in enumerate(todo, 1):
            yield _run((m, full))
            if progress is not None:
                progress(n, len(todo))
        return
    with ProcessPoolExecutor(workers) as pool:
        for n, kill in enumerate(pool.map(_run, [(m, full) for m in todo]), 1):
            yield kill
            if progress is not None:
                progress(n, len(todo))
