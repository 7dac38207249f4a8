"""The interpreter of the tables: every move of the model goes through `fire`.

`fire` finds the rows for the subject's state and trigger, evaluates each row's guards (the
functions of `GUARDS`, by the names the row gives under `requires` and `unless`), sets the
destination and runs the row's effects (the functions registered in `EFFECTS`, by name). So
the model's action set is the set of table rows, and a table edit changes the model. The
tables it runs on are a `Tables` value: the spec's (`SPEC_TABLES`), or a mutated copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spec import fence as F
from spec import job as J
from spec import request as R
from spec.model.state import ModelError, World
from spec.schema import MachineSpec, Transition

Guard = Callable[[World, Any, dict[str, Any]], bool]
Effect = Callable[..., None]


class Tables:
    """The machines the model runs on, with their rows indexed by (machine, state, trigger)."""

    def __init__(self, machines: Mapping[str, MachineSpec]) -> None:
        self.machines: dict[str, MachineSpec] = dict(machines)
        self._rows: dict[tuple[str, str, str], list[tuple[int, Transition]]] = {}

    def rows(self, machine: str, state: str, trigger: str) -> list[tuple[int, Transition]]:
        """(row index, row) of every row of `machine` leaving `state` on `trigger`."""
        found = self._rows.get((machine, state, trigger))
        if found is None:
            found = [(i, t) for i, t in enumerate(self.machines[machine].transitions)
                     if t.trigger == trigger and state in t.sources]
            self._rows[(machine, state, trigger)] = found
        return found

    def coverage_universe(self) -> set[tuple[str, int]]:
        return {(m, i) for m, spec in self.machines.items() for i in range(len(spec.transitions))}


SPEC_TABLES = Tables({"request": R.REQUEST_MACHINE, "job": J.JOB_MACHINE,
                      "fence": F.FENCE_MACHINE})
MACHINES = SPEC_TABLES.machines


def _state_of(subject: Any) -> str:
    return subject if isinstance(subject, str) else str(subject.state)


def fire(w: World, machine: str, k: Any, trigger: str, **kw: Any) -> str:
    """Move subject `k` of `machine` by `trigger`, through the table; returns the new state."""
    subject = w.get(machine, k)
    state = _state_of(subject)
    guards = GUARDS[machine]
    for index, t in w.tables.rows(machine, state, trigger):
        if all(guards[g](w, subject, kw) for g in t.requires) and \
                not any(guards[g](w, subject, kw) for g in t.unless):
            dest: str = t.dest_from(state)
            w.fired.append((machine, index))
            w.moves.append((machine, k, state, dest, trigger))
            if machine == "fence":
                w.fence_state = dest
            else:
                w.put(machine, subject._replace(state=dest))
            for e in t.effects:
                try:
                    EFFECTS[e](w, k, **kw)
                except ModelError:
                    raise
                except (KeyError, ValueError, IndexError, AssertionError) as exc:
                    # an effect whose precondition the rows broke (a mutated table)
                    raise ModelError(f"{machine} {k!r}: effect {e} of {trigger!r} from {state} "
                                     f"failed: {exc!r}") from exc
            return dest
    raise ModelError(f"{machine} {k!r} in {state}: no {trigger!r} transition")


GUARDS: dict[str, dict[str, Guard]] = {
    "request": {
        "other_jobs_remain": lambda w, r, kw: bool(r.jobs),
        "has_transfer_jobs": lambda w, r, kw: bool(r.jobs),
        "load_invalid": lambda w, r, kw: bool(r.load_invalid),
    },
    "job": {
        "owner_has_no_jobs": lambda w, j, kw: not w.get("request", j.owner).jobs,
        "reports_complete": lambda w, j, kw: int(kw.get("count", 1)) >= j.pending,
    },
    "fence": {
        "has_live_jobs": lambda w, f, kw: int(kw.get("live_jobs", 0)) > 0,
        "fence_empties": lambda w, f, kw: not any(j.state == J.STALE for j in w.held.values()),
    },
}

EFFECTS: dict[str, Effect] = {}
"""Every effect the tables name, by name (filled by `spec.model.effects`)."""


def effect(fn: Effect) -> Effect:
    """Register `fn` as the model's implementation of the effect of its name."""
    EFFECTS[fn.__name__] = fn
    return fn


def stateless(*names: str) -> None:
    """Effects with nothing to do in the model (statistics, bookkeeping it keeps implicit)."""
    for name in names:
        EFFECTS[name] = _noop


def _noop(w: World, k: Any, **kw: Any) -> None:
    return None


def unresolved() -> list[str]:
    """Effect and guard names of the spec's tables the model does not implement."""
    out = [f"effect {e.name!r} ({m.name})" for m in MACHINES.values() for e in m.effects
           if e.name not in EFFECTS]
    out += [f"guard {g.name!r} ({m.name})" for m in MACHINES.values() for g in m.guards
            if g.name not in GUARDS.get(m.name, {})]
    return out
