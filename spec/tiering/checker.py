"""Exhaustive checking of the tiering model (`spec.tiering.model`) within bounds: breadth
first over every reachable state (job ids renumbered), the structural invariants
(`spec.tiering.invariants`) and the data invariants in every state, an event that needs a row
the tables lack reported as `illegal`; then each progress property (`spec.tiering.progress`)
as liveness under weak fairness, with stuttering: a reachable cycle of waiting states in
which every fair class enabled all along is taken (or a waiting state where none is enabled)
is a counterexample, printed as a lasso. Breadth first makes a safety counterexample a
shortest one. Coverage: which table rows (source, trigger, destination) fired.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from spec.liveness import Edge, fair_cycle
from spec.tiering import TIERING_MACHINES
from spec.tiering.faults import NO_TIER_FAULTS, TierFaults
from spec.tiering.invariants import check_tiering
from spec.tiering.model import (
    IllegalMove,
    Move,
    TierBounds,
    TierEvent,
    TierModelState,
    abstract,
    canonical,
    data_violations,
    events,
    initial,
    step,
)
from spec.tiering.progress import TIER_PROGRESS, TierProgress

Kind = Literal["invariant", "illegal", "liveness"]


@dataclass(frozen=True)
class TierStep:
    event: TierEvent
    state: TierModelState
    moves: tuple[Move, ...]


@dataclass
class TierCounterexample:
    kind: Kind
    summary: str
    steps: list[TierStep]
    cycle_start: int | None = None
    property_id: str | None = None
    fairness: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def render(self) -> str:
        size = (f"{len(self.steps)} events" if self.cycle_start is None else
                f"{self.cycle_start} events, then a cycle of "
                f"{len(self.steps) - self.cycle_start} that repeats forever")
        what = self.kind if self.property_id is None else f"{self.kind} {self.property_id}"
        lines = [f"counterexample ({what}, {size}): {self.summary}"]
        for n, st in enumerate(self.steps, 1):
            if self.cycle_start is not None and n - 1 == self.cycle_start:
                lines.append("  -- the cycle (repeats forever):")
            lines.append(f"  {n:3d}. {st.event}")
            for machine, subject, src, dst, trig in st.moves:
                arrow = f"{src} -> {dst}" if src != dst else f"{src} (stays)"
                lines.append(f"         {machine} {subject}: {arrow} [{trig}]")
        if self.cycle_start is not None and self.cycle_start == len(self.steps):
            lines.append("  -- then nothing: the system stutters here forever")
        if self.fairness:
            lines.append("  fair because: " + "; ".join(self.fairness))
        return "\n".join(lines)


@dataclass
class TierCheckResult:
    bounds: TierBounds
    faults: TierFaults
    states: int = 0
    edges: int = 0
    depth: int = 0
    seconds: float = 0.0
    counterexample: TierCounterexample | None = None
    fired: set[tuple[str, str, str, str]] = field(default_factory=set)
    """(machine, source, trigger, destination) of every row fired."""

    @property
    def ok(self) -> bool:
        return self.counterexample is None

    @property
    def verdict(self) -> str:
        ce = self.counterexample
        if ce is None:
            return "pass"
        return ce.kind if ce.property_id is None else f"{ce.kind} {ce.property_id}"

    def uncovered(self) -> list[tuple[str, str, str, str]]:
        """Table edges no explored event fired."""
        rows = {(m.name, src, t.trigger, dst) for m in TIERING_MACHINES
                for src, dst, t in m.edges()}
        return sorted(rows - self.fired)

    def summary(self) -> str:
        rate = self.states / self.seconds if self.seconds else 0.0
        return (f"tiering: {self.verdict}: {self.states:,} states, {self.edges:,} edges, "
                f"depth {self.depth}, {self.seconds:.1f} s ({rate:,.0f} states/s)")


def check_tiering_model(bounds: TierBounds, faults: TierFaults = NO_TIER_FAULTS, *,
                        liveness: bool = True, max_states: int = 2_000_000
                        ) -> TierCheckResult:
    t0 = time.perf_counter()
    res = TierCheckResult(bounds, faults)
    s0 = canonical(initial(bounds))
    states: list[TierModelState] = [s0]
    index: dict[TierModelState, int] = {s0: 0}
    parent: list[tuple[int, TierEvent, tuple[Move, ...]] | None] = [None]
    depth = [0]
    out: list[list[Edge]] = []
    labels: list[list[TierEvent]] = []
    queue = deque([0])
    while queue:
        i = queue.popleft()
        s = states[i]
        edges: list[Edge] = []
        evs: list[TierEvent] = []
        for ev in events(s, faults):
            try:
                succs = step(s, ev, faults)
            except IllegalMove as exc:
                res.counterexample = TierCounterexample(
                    "illegal", str(exc), [*_trace(states, parent, i), TierStep(ev, s, ())])
                return _done(res, states, depth, t0)
            for succ, moves in succs:
                for machine, _subject, src, dst, trig in moves:
                    res.fired.add((machine, src, trig, dst))
                c = canonical(succ)
                j = index.get(c)
                if j is None:
                    j = len(states)
                    index[c] = j
                    states.append(c)
                    parent.append((i, ev, moves))
                    depth.append(depth[i] + 1)
                    bad = [str(v) for v in check_tiering(abstract(c))] + data_violations(succ)
                    if bad:
                        res.counterexample = TierCounterexample(
                            "invariant", "; ".join(bad), _trace(states, parent, j))
                        return _done(res, states, depth, t0)
                    if len(states) > max_states:
                        raise RuntimeError(f"more than {max_states:,} states: shrink the "
                                           "bounds")
                    queue.append(j)
                edges.append((j, ev.fair))
                evs.append(ev)
        res.edges += len(edges)
        out.append(edges)
        labels.append(evs)
    if liveness:
        for prop in TIER_PROGRESS:
            subjects: list[object] = (
                list(range(len(bounds.requests))) if prop.scope == "request" else
                [(r, k) for r, keys in enumerate(bounds.requests) for k in sorted(set(keys))]
                if prop.scope == "request-key" else [None])
            for r in subjects:
                ce = _liveness(prop, r, states, out, labels, depth, parent, faults)
                if ce is not None:
                    res.counterexample = ce
                    return _done(res, states, depth, t0)
    return _done(res, states, depth, t0)


def _done(res: TierCheckResult, states: list[TierModelState], depth: list[int],
          t0: float) -> TierCheckResult:
    res.states = len(states)
    res.depth = max(depth)
    res.seconds = time.perf_counter() - t0
    return res


def _trace(states: list[TierModelState],
           parent: list[tuple[int, TierEvent, tuple[Move, ...]] | None],
           j: int) -> list[TierStep]:
    out: list[TierStep] = []
    while (p := parent[j]) is not None:
        i, ev, moves = p
        out.append(TierStep(ev, states[j], moves))
        j = i
    out.reverse()
    return out


def _liveness(prop: TierProgress, r: object, states: list[TierModelState],
              out: list[list[Edge]], labels: list[list[TierEvent]], depth: list[int],
              parent: list[tuple[int, TierEvent, tuple[Move, ...]] | None],
              faults: TierFaults) -> TierCounterexample | None:
    waiting = [prop.waiting(s) if r is None else prop.waiting(s, r) for s in states]
    if not any(waiting):
        return None
    # stuttering: every state may repeat itself forever, unless fairness forbids it
    graph: list[list[Edge]] = [[*es, (i, None)] for i, es in enumerate(out)]
    cyc = fair_cycle(graph, waiting, depth)
    if cyc is None:
        return None
    prefix = _trace(states, parent, cyc.entry)
    cycle: list[TierStep] = []
    for v, k in cyc.edges:
        if k == len(out[v]):
            continue  # a stutter step
        ev = labels[v][k]
        dest = graph[v][k][0]
        moves = next(m for succ, m in step(states[v], ev, faults)
                     if canonical(succ) == states[dest])
        cycle.append(TierStep(ev, states[dest], moves))
    subject = ("" if r is None else f" for r{r}" if isinstance(r, int) else
               f" for r{r[0]}'s k{r[1]}")  # type: ignore[index]
    owed = sorted(str(c) for c in cyc.owed)
    fairness = ([f"{c} is taken in the cycle" for c in owed] or
                ["no weakly fair event is enabled all along the cycle"])
    summary = f"{prop.name}{subject}: {prop.statement}, yet a fair run stays waiting forever"
    steps = prefix + cycle
    return TierCounterexample("liveness", summary, steps, cycle_start=len(prefix),
                              property_id=prop.id, fairness=fairness)
