"""Row witnesses: for every row of the tables, a shortest program that fires it.

The exhaustive scenarios fire every row of the request, job and fence tables, but a random
run of an implementation may never take some of them (a reset while a sync load is in
flight, a late failure of a load already timed out). A witness is a program of model events,
under the bounds of the first scenario (smallest first) in which the breadth-first search
reaches the row, that ends in the step firing it: a path a reviewer can read and an
implementation can be driven down. The reference replays every witness through the
model-based machine (`tests/test_witnesses.py`), vLLM's scheduler side every one it can take
(`tests/conformance/test_witnesses.py`); `kvspec witness r48` prints one.

The programs are data (`spec/witnesses.json`), written by `kvspec witness --write`; the
tests check that each still fires its row on the current tables and that every row has one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spec import model as M
from spec.scenarios import SCENARIOS, Scenario
from spec.scenarios import by_name as scenario

PATH = Path(__file__).with_name("witnesses.json")


@dataclass(frozen=True)
class Witness:
    row: str
    """The row's id (`MachineSpec.row_id`: r48, j20, f5)."""
    scenario: str
    """The scenario whose bounds the program runs under."""
    program: str
    """Model events with real job ids (`spec.model.parse_events`)."""

    @property
    def bounds(self) -> M.Bounds:
        return scenario(self.scenario).bounds

    def events(self) -> list[M.Event]:
        return M.parse_events(self.program)


def all_rows() -> dict[str, tuple[str, int]]:
    """Every row of the tables the model may fire, by id, in table order."""
    return {M.MACHINES[m].row_id(i): (m, i) for m, i in sorted(
        M.coverage_universe(), key=lambda r: (list(M.MACHINES).index(r[0]), r[1]))}


def load(path: Path = PATH) -> tuple[Witness, ...]:
    return tuple(Witness(**w) for w in json.loads(path.read_text()))


WITNESSES: tuple[Witness, ...] = load()


def by_row(row: str) -> Witness:
    for w in WITNESSES:
        if w.row == row:
            return w
    raise KeyError(f"no witness for row {row!r}; rows are named as in spec/SPEC.md "
                   f"(r1-r{len(M.MACHINES['request'].transitions)}, j1-.., f1-..)")


def describe_row(row: str) -> str:
    """`r48: request load_recving [ORPHANED_LOAD] -> IDLE [!load_invalid]`."""
    machine, index = all_rows()[row]
    t = M.MACHINES[machine].transitions[index]
    guard = f" [{t.guard_text}]" if t.guard_text else ""
    return f"{row}: {machine} {t.trigger} {list(t.sources)} -> {t.dest}{guard}"


def render(w: Witness) -> str:
    """The program step by step, each event with what it changed in the abstract state,
    the row it witnesses named at the step that fires it."""
    from spec.checker import diff

    events = w.events()
    lines = [f"witness of {describe_row(w.row)}", f"  scenario {w.scenario}: {len(events)} "
             "steps from the initial state"]
    s = M.initial(w.bounds)
    prev = M.abstract(s)
    for i, ev in enumerate(events, 1):
        s, _calls, world = M.apply(s, ev)
        lines.append(f"{i:3}. {ev}")
        cur = M.abstract(s)
        lines.extend(f"       {d}" for d in diff(prev, cur))
        prev = cur
    m, sub, src, dst, trig = world.moves[world.fired.index(all_rows()[w.row])]
    lines.append(f"  step {len(events)} fires {w.row}: {m} {sub!r} {src} -> {dst} by {trig}")
    return "\n".join(lines)


def search_order() -> list[Scenario]:
    """The scenarios a witness is searched in: the simplest model that has the row first.
    One full-attention group with one block per chunk under the spec's own rules before
    groups, windows and chunks of several blocks, and those before another release's rules
    (the programs a reader follows most easily, and the ones every implementation under test
    can take); within each, the smallest state space first."""
    default = M.Bounds().rules
    return sorted((s for s in SCENARIOS if s.expect is not None and s.expect.verdict == "pass"),
                  key=lambda s: (s.bounds.rules != default, s.bounds.hybrid,
                                 s.expect.states if s.expect else 0, s.name))


def first_firing(covers: Callable[[M.Bounds], set[tuple[str, int]]]) -> dict[str, str]:
    """For each row that some scenario fires, the first scenario in `search_order` that fires
    it, by `covers(bounds)`: the rows a scenario's search fires. The scenario `generate`
    writes a row's witness under, where `covers` is the whole search's coverage."""
    ids = {v: k for k, v in all_rows().items()}
    first: dict[str, str] = {}
    for sc in search_order():
        if len(first) == len(ids):
            break
        for row in covers(sc.bounds):
            first.setdefault(ids[row], sc.name)
    return first


def generate(progress: Callable[[str, int], None] | None = None,
             covers: Callable[[M.Bounds], set[tuple[str, int]]] | None = None
             ) -> tuple[Witness, ...]:
    """A witness for every row: each scenario in `search_order` searched, breadth-first, for
    the rows no smaller scenario fired. `covers(bounds)`, if given, names the rows a
    scenario fires (a faster checker's coverage), so that a scenario without any row still
    wanted is not searched. It is only a filter: a scenario is searched for every row still
    wanted, and a row it does not fire goes on to the next, so `covers` may name too many
    rows (every row, where the compiled checker cannot run) and the witnesses stay the same.
    `first_firing` would name each row's scenario only where `covers` is exact.
    `progress(scenario, rows found)` after each search."""
    from spec.checker import row_witnesses

    ids = {v: k for k, v in all_rows().items()}
    todo = set(ids)
    out: dict[str, Witness] = {}
    for sc in search_order():
        if not todo:
            break
        if covers is not None and not todo & covers(sc.bounds):
            continue
        found = row_witnesses(sc.bounds, todo)
        for row, steps in found.items():
            out[ids[row]] = Witness(ids[row], sc.name, " ; ".join(str(s.event) for s in steps))
        todo -= set(found)
        if progress is not None:
            progress(sc.name, len(found))
    order = list(ids.values())
    return tuple(sorted(out.values(), key=lambda w: order.index(w.row)))


def write(witnesses: tuple[Witness, ...], path: Path = PATH) -> None:
    path.write_text(json.dumps([w.__dict__ for w in witnesses], indent=1) + "\n")
