"""Exhaustive, breadth-first model checking of `spec.model` within bounds.

Every reachable state (job ids renumbered, `spec.model.canonical`) is visited once; every
safety invariant of `spec.invariants` is checked in it; an event that breaks the tables (a
trigger with no row) is a finding too. Breadth-first order makes the first counterexample a
shortest one. Stuck-freedom (P-3): from every reachable state some quiescent state must be
reachable; it is decided by reverse reachability over the explored graph. Coverage: which
table rows fired at least once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from spec import model as M
from spec.invariants import Violation, check
from spec.schema import Transition
from spec.state import AbstractState


@dataclass(frozen=True)
class Step:
    event: M.Event
    state: M.ModelState
    moves: tuple[tuple[str, object, str, str, str], ...]
    """(machine, subject, source, destination, trigger) of each table row it fired."""


@dataclass
class Counterexample:
    kind: Literal["invariant", "illegal", "stuck"]
    summary: str
    steps: list[Step]
    violations: list[Violation] = field(default_factory=list)
    inside: tuple[str, AbstractState] | None = None
    """For a violation inside the last step: the hook it followed and the state it left."""

    def __len__(self) -> int:
        return len(self.steps)

    def render(self) -> str:
        """A numbered trace: each event, then what it changed."""
        lines = [f"counterexample ({self.kind}, {len(self.steps)} steps): {self.summary}"]
        prev = M.abstract(M.initial(self.steps[0].state.bounds)) if self.steps else None
        for i, step in enumerate(self.steps, 1):
            last = i == len(self.steps) and self.inside is not None
            if last and self.inside is not None:
                hook, cur = self.inside
                lines.append(f"{i:3}. {step.event}, inside the step, after {hook}")
            else:
                lines.append(f"{i:3}. {step.event}")
                cur = M.abstract(step.state)
            if prev is not None:
                changes = diff(prev, cur)
                if not changes and step.event.kind == "preempt":
                    changes = [f"the core preempts {step.event.req} and frees its GPU blocks; "
                               "the connector hears of it in the next build_connector_meta"]
                lines.extend(f"       {d}" for d in changes)
            prev = cur
        lines.extend(f"  violated: {v}" for v in self.violations)
        return "\n".join(lines)


def diff(a: AbstractState, b: AbstractState) -> list[str]:
    """What changed between two abstract states, in words."""
    out: list[str] = []
    ra, rb = {r.id: r for r in a.requests}, {r.id: r for r in b.requests}
    for rid in sorted(ra.keys() | rb.keys()):
        x, y = ra.get(rid), rb.get(rid)
        sx = x.state if x else "ABSENT"
        sy = y.state if y else "ABSENT"
        jx = sorted(x.transfer_jobs) if x else []
        jy = sorted(y.transfer_jobs) if y else []
        if sx != sy or jx != jy:
            out.append(f"request {rid}: {sx} -> {sy}, transfer_jobs "
                       + (f"{jx} -> {jy}" if jx != jy else f"{jy} (kept)"))
        bx = x.gpu_blocks if x else ()
        by = y.gpu_blocks if y else ()
        if bx != by:
            out.append(f"request {rid} holds GPU blocks {list(by)}" if by
                       else f"request {rid} holds no GPU block")
    ja, jb = {j.id: j for j in a.jobs}, {j.id: j for j in b.jobs}
    for jid in sorted(ja.keys() | jb.keys()):
        x2, y2 = ja.get(jid), jb.get(jid)
        if x2 is None and y2 is not None:
            out.append(f"job {jid} ({y2.kind} of {y2.owner}) enters the table: {y2.state}, "
                       f"pending {y2.pending_count}")
        elif y2 is None and x2 is not None:
            out.append(f"job {jid} leaves the table")
        elif x2 is not None and y2 is not None and (x2.state, x2.pending_count) != (
                y2.state, y2.pending_count):
            out.append(f"job {jid}: {x2.state} -> {y2.state}, pending {x2.pending_count} -> "
                       f"{y2.pending_count}")
    fa = {h.id: h.reports_due for h in a.reset_fence}
    fb = {h.id: h.reports_due for h in b.reset_fence}
    if fa != fb:
        out.append(f"reset fence {fa} -> {fb}")
    qa = {h.id: h.reports_due for h in a.quarantine}
    qb = {h.id: h.reports_due for h in b.quarantine}
    if qa != qb:
        out.append(f"timeout quarantine {qa} -> {qb}")
    if a.stale_threshold != b.stale_threshold:
        out.append(f"stale threshold {a.stale_threshold} -> {b.stale_threshold}")
    if a.chunk_ref_cnt != b.chunk_ref_cnt:
        out.append(f"chunks {dict(a.chunk_ref_cnt)} -> {dict(b.chunk_ref_cnt)}")
    if a.jobs_to_flush != b.jobs_to_flush and b.jobs_to_flush:
        out.append(f"jobs_to_flush {sorted(b.jobs_to_flush)}")
    return out


@dataclass
class CheckResult:
    bounds: M.Bounds
    faults: M.Faults
    states: int = 0
    edges: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = True
    """False when max_states stopped the search before the whole space was seen."""
    counterexample: Counterexample | None = None
    stuck_states: int = 0
    covered: set[tuple[str, int]] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.counterexample is None

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0

    def uncovered(self) -> list[tuple[str, int, Transition]]:
        return [(m, i, M.MACHINES[m].transitions[i])
                for m, i in sorted(M.coverage_universe() - self.covered)]


Progress = Callable[[int, int, int], None]


def check_model(bounds: M.Bounds, faults: M.Faults = M.NO_FAULTS,
                max_states: int | None = None, progress: Progress | None = None,
                stuck: bool = True) -> CheckResult:
    """Explore every state reachable within `bounds`; stop at the first finding."""
    result = CheckResult(bounds, faults)
    t0 = time.perf_counter()
    s0 = M.initial(bounds)
    index: dict[M.ModelState, int] = {M.canonical(s0): 0}
    states: list[M.ModelState] = [s0]
    parent: list[tuple[int, M.Event, tuple[tuple[str, object, str, str, str], ...]] | None] = [
        None]
    depth: list[int] = [0]
    succ: list[list[int]] = [[]]
    queue = deque([0])

    def trace(i: int, last: Step | None = None) -> list[Step]:
        steps: list[Step] = [] if last is None else [last]
        while (p := parent[i]) is not None:
            pi, ev, moves = p
            steps.append(Step(ev, states[i], moves))
            i = pi
        return steps[::-1]

    while queue:
        i = queue.popleft()
        s = states[i]
        for ev, nxt, _calls, world in M.successors(s, faults, inside=True):
            result.edges += 1
            if isinstance(nxt, M.ModelError):
                bad = Step(ev, s, ())
                result.counterexample = Counterexample(
                    "illegal", f"{ev}: {nxt}", trace(i, bad))
                return _finish(result, t0, len(states), max(depth))
            assert world is not None
            result.covered.update(world.fired)
            for call, inner in world.inside:  # where the implementation checks them too
                violations = check(inner)
                if violations:
                    hook = f"{call.hook}{call.args}"
                    result.counterexample = Counterexample(
                        "invariant", f"inside the step, after {hook}: {violations[0]}",
                        trace(i, Step(ev, nxt, tuple(world.moves))), violations,
                        inside=(hook, inner))
                    return _finish(result, t0, len(states), max(depth))
            key = M.canonical(nxt)
            j = index.get(key)
            if j is None:
                j = len(states)
                index[key] = j
                states.append(nxt)
                parent.append((i, ev, tuple(world.moves)))
                depth.append(depth[i] + 1)
                succ.append([])
                violations = check(M.abstract(nxt))
                if violations:
                    result.counterexample = Counterexample(
                        "invariant", str(violations[0]), trace(j), violations)
                    return _finish(result, t0, len(states), max(depth))
                queue.append(j)
                if progress is not None and j % 5000 == 0:
                    progress(len(states), result.edges, depth[j])
            succ[i].append(j)
        if max_states is not None and len(states) >= max_states:
            result.complete = False
            break
    if stuck and result.complete:
        _check_stuck(result, states, succ, trace)
    return _finish(result, t0, len(states), max(depth))


def _finish(result: CheckResult, t0: float, n: int, depth: int) -> CheckResult:
    result.states = n
    result.depth = depth
    result.seconds = time.perf_counter() - t0
    return result


def _check_stuck(result: CheckResult, states: list[M.ModelState], succ: list[list[int]],
                 trace: Callable[[int], list[Step]]) -> None:
    pred: list[list[int]] = [[] for _ in states]
    for i, outs in enumerate(succ):
        for j in outs:
            pred[j].append(i)
    good = [M.abstract(s).is_quiescent() for s in states]
    todo = deque(i for i, g in enumerate(good) if g)
    while todo:
        j = todo.popleft()
        for i in pred[j]:
            if not good[i]:
                good[i] = True
                todo.append(i)
    stuck = [i for i, g in enumerate(good) if not g]
    result.stuck_states = len(stuck)
    if stuck:
        first = stuck[0]
        a = M.abstract(states[first])
        held = ", ".join(f"{r.id} in {r.state} holding {sorted(r.transfer_jobs)}"
                         for r in a.requests) or "no request"
        result.counterexample = Counterexample(
            "stuck", f"no quiescent state is reachable from here ({held}; job table "
            f"{sorted(a.live_job_ids)}, fence {sorted(a.fence_ids)})", trace(first))
