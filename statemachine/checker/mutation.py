"""Mutation of the spec itself: the tables with one effect removed from one row, or one guard
of one row negated, each checked over the scenarios. The kill matrix says, per mutant, what
caught it: a safety invariant, a progress property, an event left with no row (`illegal`), a
row no scenario fires any more (`coverage`), a directed program's tier (`tier`), or nothing
(`survived`). A survivor is either a gap in the checks or a mutant equivalent to the spec;
`spec.equivalents` lists the second kind with the reason, and the tests demand that the
survivors are exactly those.

The compiled checker takes the mutated rows at run time (no rebuild); each finding is
replayed and certified on the Python model running the same mutated tables. A mutant the
compiled scenarios leave runs along the directed programs (`spec.regressions`) on the Python
model: each is one path, often past the scenarios' bounds (three requests beside a Mamba
group, say), checked as the search checks every path, and then what the CPU tier holds at
its end against what the program pins (`Regression.check`). A break there is a kill, with
the program as its counterexample (`in`: `program <name>`): its verdict is the check that
broke, and `tier` when the program keeps every invariant and has a row for every event but
ends with another tier than its pin.

A survivor is checked over every scenario to the end, which makes the listed survivors
four fifths of the matrix's time. The search is deterministic, so a survivor proven once
stays proven while nothing it depends on changes: `spec/equivalents.proof.json` records the
survivors of the last complete run with the `fingerprint` of those sources (the modules of
spec/ and of the checker that a kill imports, read as code, and the C checker), and a run at
the same fingerprint takes the listed survivors from it instead of searching again. Every
other mutant is checked every time.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from spec import model as M
from spec.checker import Counterexample
from spec.equivalents import EQUIVALENT, Survivor
from spec.regressions import REGRESSIONS
from spec.regressions import by_name as regression
from spec.scenarios import SCENARIOS, Scenario
from spec.scenarios import by_name as scenario
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


PROGRAM = "program "
"""How a kill names the directed program it came from (`Kill.scenario`)."""


@dataclass(frozen=True)
class Kill:
    mutant: str
    by: str
    """`invariant INV-n`, `liveness P-n`, `illegal`, `coverage`, `survived`."""
    scenario: str | None
    """The scenario whose search killed it, or `program <name>` (a directed program)."""
    steps: int
    states: int
    """States explored until the kill (or in all, for a survivor)."""
    equivalent: Survivor | None = None
    """For a survivor `spec.equivalents` lists: its kind and the reason."""
    detail: str = ""

    @property
    def killed(self) -> bool:
        return self.by != "survived"


@functools.cache
def _fired(names: tuple[str, ...]) -> frozenset[tuple[str, int]]:
    """The rows the spec's own tables fire over the named scenarios."""
    from statemachine.checker import check

    fired: set[tuple[str, int]] = set()
    for sc in SCENARIOS:
        if sc.name in names:
            fired |= check(sc.bounds).covered
    return frozenset(fired)


def matrix_scenarios(full: bool = False) -> list[Scenario]:
    """The scenarios each mutant is checked against, cheapest first (a kill comes sooner)."""
    from statemachine.checker import compiled

    # every scenario fits the compiled twin (test_checker_groups); one that did not would
    # run on the Python model, about a hundred times slower per mutant, so not here
    chosen = [s for s in SCENARIOS if compiled.fits(s.bounds) is None
              and (full or s.expect is None or s.expect.states <= SLOW_STATES)]
    return sorted(chosen, key=lambda s: s.expect.states if s.expect else 0)


ROOT = Path(__file__).resolve().parents[2]
PROOF = ROOT / "spec" / "equivalents.proof.json"
"""The survivors of the last complete kill matrix, at the fingerprint it ran at."""


def fingerprint() -> str:
    """A digest of every source a kill depends on: the modules of spec/ and of the checker
    that this module imports, directly or through one another (`sources`), as code (their
    syntax trees without docstrings, so a reworded docstring or comment, or a line
    reflowed, keeps the proof), and the checker's C sources as bytes. `spec/equivalents.py`
    is left out: its reasons are read only to report. A syntax tree is written as the
    running Python writes it, so under another minor version of Python the proof does not
    count and the survivors are searched again (the proof is written under CI's 3.11)."""
    trees = _closure()
    digest = hashlib.sha256()
    for path in _with_c_sources(trees):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        tree = trees.get(path)
        digest.update((_code(tree) if tree is not None else path.read_bytes()) + b"\0")
    return digest.hexdigest()


_PACKAGES = ("spec", "statemachine.checker")


def sources() -> list[Path]:
    """The files `fingerprint` reads: the closure of this module's imports (top level and
    inside functions; neither spec/ nor the checker imports anything dynamically) within
    spec/ and statemachine/checker, with the packages' `__init__` modules, and every C
    source of the checker."""
    return _with_c_sources(_closure())


def _closure() -> dict[Path, ast.Module]:
    """The Python files of `sources`, each parsed once (its imports are read from the same
    tree that `fingerprint` hashes)."""
    trees: dict[Path, ast.Module] = {}
    todo = [ROOT / "statemachine" / "checker" / "mutation.py"]
    while todo:
        path = todo.pop()
        if path in trees:
            continue
        trees[path] = tree = ast.parse(path.read_text(), str(path))
        todo += _imported(path, tree)
    trees.pop(ROOT / "spec" / "equivalents.py", None)
    return trees


def _with_c_sources(trees: dict[Path, ast.Module]) -> list[Path]:
    c_sources = (ROOT / "statemachine" / "checker").rglob("*")
    return sorted([*trees, *(p for p in c_sources if p.suffix in (".c", ".h"))])


def _module_file(name: str) -> Path | None:
    """The file of a module of spec/ or the checker (`a.b` as a/b.py or a/b/__init__.py)."""
    if not any(name == p or name.startswith(p + ".") for p in _PACKAGES):
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported(path: Path, tree: ast.Module) -> list[Path]:
    """The project files `path` (parsed as `tree`) imports: each module named, the packages
    above it, and for `from a import b` the submodule `a.b` where there is one."""
    package = path.relative_to(ROOT).parts[:-1]  # a/b/c.py and a/b/__init__.py: a.b
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = (list(package[:len(package) - node.level + 1]) if node.level else [])
            base = ".".join([*parts, *(node.module or "").split(".")]).strip(".")
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    out = []
    for name in names:
        parts = name.split(".")
        for n in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            file = _module_file(".".join(parts[:n]))
            if file is not None:
                out.append(file)
    return out


class _Code(ast.NodeTransformer):
    """A syntax tree without its text: each statement that is a string alone (a docstring, a
    module attribute's docstring) is left out."""

    def visit_Expr(self, node: ast.Expr) -> ast.Expr | None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None
        return node


def _code(tree: ast.Module) -> bytes:
    """A module as code: its syntax tree without docstrings, positions or comments (the
    tree is changed in place)."""
    return ast.dump(_Code().visit(tree), include_attributes=False).encode()


def proven_survivors(scenarios: Iterable[Scenario]) -> dict[str, int]:
    """The survivors `PROOF` records (mutant -> states explored) if it was written at this
    fingerprint over these scenarios; else none."""
    try:
        data = json.loads(PROOF.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("fingerprint") != fingerprint() or \
            data.get("scenarios") != [s.name for s in scenarios]:
        return {}
    return {str(name): int(states) for name, states in data.get("survivors", {}).items()}


def write_proof(kills: Iterable[Kill], scenarios: Iterable[Scenario]) -> None:
    """Record the survivors of a complete kill matrix at this fingerprint."""
    data = {"fingerprint": fingerprint(), "scenarios": [s.name for s in scenarios],
            "survivors": {k.mutant: k.states for k in kills if not k.killed},
            "written_by": "kvspec check --mutate (make mutate)"}
    PROOF.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _program_kill(m: SpecMutant, tables: M.Tables, states: int) -> Kill | None:
    """The first directed program that breaks under the mutant's tables, as its kill."""
    for reg in REGRESSIONS:
        try:
            broken = reg.check(tables)
        except M.NotEnabled:
            continue  # the program's path leaves this mutant's model: it shows nothing here
        if broken is not None:
            return Kill(m.name, broken.verdict, f"{PROGRAM}{reg.name}", len(broken), states,
                        detail=broken.summary)
    return None


def run_mutant(m: SpecMutant, scenarios: Iterable[Scenario]) -> Kill:
    """Cheapest first: the (compiled) `scenarios`, then the directed programs (one path
    each, milliseconds); a mutant none of them kills must still fire every row the spec
    fires there, or it is killed by coverage."""
    from statemachine.checker import CheckerDisagreement, check

    tables = m.tables()
    covered: set[tuple[str, int]] = set()
    states = 0
    scenarios = list(scenarios)

    def search(chosen: list[Scenario]) -> Kill | None:
        nonlocal states
        for sc in chosen:
            try:
                r = check(sc.bounds, tables=tables)
            except CheckerDisagreement as exc:  # a bug of the compiled twin: surface it
                return Kill(m.name, "disagreement", sc.name, 0, states, detail=str(exc))
            states += r.states
            covered.update(r.covered)
            if r.counterexample is not None:
                ce = r.counterexample
                return Kill(m.name, r.verdict, sc.name, len(ce), states, detail=ce.summary)
        return None

    kill = search(scenarios) or _program_kill(m, tables, states)
    if kill is not None:
        return kill
    # the rows the spec's own tables fire there: searched only for a mutant nothing killed
    baseline = _fired(tuple(sc.name for sc in scenarios))
    missing = (baseline | {(m.machine, m.row)}) - covered
    if missing:
        machine, index = min(missing)
        row = row_name(tables.machines[machine].transitions[index])
        return Kill(m.name, "coverage", None, 0, states, detail=f"{machine}: {row} never fires")
    return Kill(m.name, "survived", None, 0, states, equivalent=EQUIVALENT.get(m.name))


def counterexample_of(kill: Kill, m: SpecMutant) -> Counterexample | None:
    """The whole counterexample behind `kill` (a Kill keeps only its summary, to cross
    processes): the killing program or scenario checked again on the mutant's tables, the
    search being deterministic. None for a mutant killed by coverage, or not killed."""
    from statemachine.checker import check

    name = kill.scenario
    if not kill.killed or name is None:
        return None
    if name.startswith(PROGRAM):
        reg = regression(name.removeprefix(PROGRAM))
        return reg.check(m.tables())
    return check(scenario(name).bounds, tables=m.tables()).counterexample


def _run(args: tuple[SpecMutant, bool]) -> Kill:
    m, full = args
    return run_mutant(m, matrix_scenarios(full))


def kill_matrix(mutants: list[SpecMutant] | None = None, full: bool = False,
                jobs: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                proven: Mapping[str, int] | None = None) -> Iterator[Kill]:
    """Every mutant's kill, in the order of `mutants` (default: all of `spec_mutants`), run
    over `jobs` processes (default: every core). A listed survivor in `proven` (mutant ->
    states, from `proven_survivors`) is not searched again: its kill is that record."""
    todo = spec_mutants() if mutants is None else mutants
    known = {m.name: proven[m.name] for m in todo
             if proven and m.name in proven and m.name in EQUIVALENT}
    search = [m for m in todo if m.name not in known]
    workers = jobs or os.cpu_count() or 1
    found: Iterator[Kill]
    if workers == 1:
        found = (_run((m, full)) for m in search)
    else:
        pool = ProcessPoolExecutor(workers)
        found = pool.map(_run, [(m, full) for m in search])
    try:
        for n, m in enumerate(todo, 1):
            if m.name in known:
                yield Kill(m.name, "survived", None, 0, known[m.name],
                           equivalent=EQUIVALENT[m.name])
            else:
                yield next(found)
            if progress is not None:
                progress(n, len(todo))
    finally:
        if workers != 1:
            pool.shutdown(cancel_futures=True)
