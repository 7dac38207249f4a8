"""The shortest program after which a mutant of the tables holds another CPU tier than the spec.

A mutant that breaks no invariant and no progress property may still change what the tier
holds: a chunk stored once less, a slot counted longer. The directed programs pin their tier
(`spec.regressions.Regression.tier`), so a program that reaches such a mutant's row kills it.
This search finds one: the spec and the mutant run side by side, breadth first, on the same
events (an event either side cannot take is left out), until the two tiers differ
(`ModelState.tier`). Its program, with the spec's tier as the pin, is a new directed program
(`kvspec check --mutate --only TEXT --tier-program`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spec import model as M


@dataclass(frozen=True)
class TierProgram:
    events: tuple[M.Event, ...]
    spec_tier: tuple[str, ...]
    """What the spec's tier holds after the program: the pin."""
    mutant_tier: tuple[str, ...]
    pairs: int
    """The pairs of states (the spec's, the mutant's) met before it."""

    @property
    def program(self) -> str:
        """The program as `spec.model.parse_events` reads it."""
        return " ; ".join(str(ev) for ev in self.events)


@dataclass(frozen=True)
class NoTierProgram:
    pairs: int
    complete: bool
    """Every pair reachable under the bounds was met (else the search stopped at its limit)."""


def _after(s: M.ModelState, ev: M.Event, tables: M.Tables) -> M.ModelState | None:
    try:
        return M.apply(s, ev, tables=tables)[0]
    except M.ModelError:  # not enabled, or illegal: no tier to compare along this event
        return None


def tier_program(bounds: M.Bounds, tables: M.Tables, max_pairs: int = 2_000_000
                 ) -> TierProgram | NoTierProgram:
    """The shortest program under `bounds` after which the tier of the model on `tables`
    differs from the spec's, or how far the search went without one."""
    start = M.initial(bounds)
    seen = {(start, start)}
    queue: deque[tuple[M.ModelState, M.ModelState, tuple[M.Event, ...]]] = deque(
        [(start, start, ())])
    while queue:
        spec, mutant, path = queue.popleft()
        for ev in M.events(spec):
            a = _after(spec, ev, M.SPEC_TABLES)
            b = None if a is None else _after(mutant, ev, tables)
            if a is None or b is None:
                continue
            if a.tier() != b.tier():
                return TierProgram((*path, ev), a.tier(), b.tier(), len(seen))
            if (a, b) not in seen:
                if len(seen) >= max_pairs:
                    return NoTierProgram(len(seen), complete=False)
                seen.add((a, b))
                queue.append((a, b, (*path, ev)))
    return NoTierProgram(len(seen), complete=True)
