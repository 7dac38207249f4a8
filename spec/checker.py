"""Exhaustive, breadth-first model checking of `spec.model` within bounds: the readable
reference checker (`statemachine.checker` is its compiled twin, which CI and `kvspec check`
run; the two are kept equal by the differential tests).

Every reachable state (job ids renumbered, `spec.model.canonical`) is visited once; every
safety invariant of `spec.invariants` is checked in it and after every hook that returns
inside a step; an event that breaks the tables (a trigger with no row) is a finding too.
Breadth-first order makes the first safety counterexample a shortest one. Then every progress
property of `spec.progress` is checked as liveness under its fairness: a fair cycle of
states that never leave `waiting` (`spec.liveness`) is a counterexample, a lasso. The older
reachability check (a quiescent state reachable from every state) is kept behind
`stuck=True`: liveness P-3 implies it (a state with no path to quiescence has a terminal
component below it, and a terminal component is fair), so it adds only a count of such
states. Coverage: which table rows fired at least once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from spec import model as M
from spec.invariants import Violation, check
from spec.liveness import fair_cycle
from spec.progress import PROGRESS
from spec.progress import Progress as Property
from spec.schema import Transition
from spec.state import AbstractState


@dataclass(frozen=True)
class Step:
    event: M.Event
    state: M.ModelState
    moves: tuple[tuple[str, object, str, str, str], ...]
    """(machine, subject, source, destination, trigger) of each table row it fired."""


Kind = Literal["invariant", "illegal", "liveness", "stuck", "tier"]


@dataclass
class Counterexample:
    kind: Kind
    summary: str
    steps: list[Step]
    violations: list[Violation] = field(default_factory=list)
    inside: tuple[str, AbstractState] | None = None
    """For a violation inside the last step: the hook it followed and the state it left."""
    cycle_start: int | None = None
    """A liveness counterexample is a lasso: `steps[cycle_start:]` repeat forever."""
    property_id: str | None = None
    """The progress property a lasso violates (P-n)."""
    request: str | None = None
    """The request a per-request property is violated for."""
    fairness: list[str] = field(default_factory=list)
    """Why the cycle is fair: each weakly fair class enabled all along it, and where taken."""

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def verdict(self) -> str:
        """What it shows: `invariant INV-n`, `liveness P-n`, `illegal` (an event with no
        table row), `stuck`, `tier` (a directed program's tier differs from its pin)."""
        if self.kind == "invariant" and self.violations:
            return f"invariant {self.violations[0].invariant}"
        if self.kind == "liveness":
            return f"liveness {self.property_id}"
        return self.kind

    @property
    def prefix(self) -> list[Step]:
        return self.steps if self.cycle_start is None else self.steps[:self.cycle_start]

    @property
    def cycle(self) -> list[Step]:
        return [] if self.cycle_start is None else self.steps[self.cycle_start:]

    def render(self) -> str:
        """A numbered trace: each event, then what it changed (a lasso: the prefix, then the
        cycle that repeats forever, and why the cycle is fair)."""
        size = (f"{len(self.steps)} steps" if self.cycle_start is None else
                f"{self.cycle_start} steps, then a cycle of {len(self.cycle)}")
        what = self.kind if self.property_id is None else f"{self.kind} {self.property_id}"
        lines = [f"counterexample ({what}, {size}): {self.summary}"]
        prev = M.abstract(M.initial(self.steps[0].state.bounds)) if self.steps else None
        for i, step in enumerate(self.steps, 1):
            if self.cycle_start is not None and i == self.cycle_start + 1:
                lines.append(f"     -- the cycle: steps {i}-{len(self.steps)} repeat forever --")
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
                if not changes and self.cycle_start is not None:
                    changes = ["(nothing the connector holds changes)"]
                lines.extend(f"       {d}" for d in changes)
            prev = cur
        if self.fairness:
            lines.append("  fair: every weakly fair class enabled all along the cycle is "
                         "taken in it")
            lines.extend(f"    {f}" for f in self.fairness)
        lines.extend(f"  violated: {v}" for v in self.violations)
        if self.property_id is not None:
            p = next(p for p in PROGRESS if p.id == self.property_id)
            lines.append(f"  violated: {p.id} {p.formula} ({p.statement})")
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
        if x is not None and y is not None and x.store_cursor != y.store_cursor:
            out.append(f"request {rid}: store cursor {x.store_cursor} -> {y.store_cursor}")
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
    liveness: tuple[str, ...] = ()
    """The progress properties checked as liveness (P-n), all of them unless the search
    stopped early (a safety finding, or max_states)."""
    without: frozenset[str] = frozenset()
    """Invariants switched off for this run."""
    engine: str = "python"
    memory: int = 0
    """The bytes of the search's data at its peak (the compiled search's `Run.memory`; 0 from
    the reference checker, which does not count them)."""

    @property
    def ok(self) -> bool:
        return self.counterexample is None

    @property
    def verdict(self) -> str:
        """`pass`, or what the counterexample shows (`Counterexample.verdict`)."""
        return "pass" if self.counterexample is None else self.counterexample.verdict

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds else 0.0

    def uncovered(self) -> list[tuple[str, int, Transition]]:
        return [(m, i, M.MACHINES[m].transitions[i])
                for m, i in sorted(M.coverage_universe() - self.covered)]


Progress = Callable[[int, int, int], None]


# ============================================================================ job ids
def canonical_event(ev: M.Event, s: M.ModelState) -> M.Event:
    """`ev` (sent in `s`) with its job id as `canonical(s)` numbers it."""
    if ev.job is None:
        return ev
    return replace(ev, job=M.renumbering(s).get(ev.job, ev.job))


def real_event(ev: M.Event, s: M.ModelState) -> M.Event:
    """The inverse of `canonical_event`: `ev` of `canonical(s)` as sent in `s`."""
    if ev.job is None:
        return ev
    back = {new: old for old, new in M.renumbering(s).items()}
    return replace(ev, job=back.get(ev.job, ev.job))


def replay(bounds: M.Bounds, events: list[M.Event], faults: M.Faults = M.NO_FAULTS,
           tables: M.Tables = M.SPEC_TABLES, canonical_ids: bool = True,
           start: M.ModelState | None = None) -> list[Step]:
    """Send `events` from the initial state (or `start`); each step's job ids are read as
    canonical ones (the checkers' labels) unless `canonical_ids` is False. A step the model
    refuses raises its ModelError (NotEnabled: the path is not a path of this model)."""
    s = start if start is not None else M.initial(bounds)
    steps: list[Step] = []
    for ev in events:
        real = real_event(ev, s) if canonical_ids else ev
        nxt, _calls, w = M.apply(s, real, faults, tables=tables)
        steps.append(Step(real, nxt, tuple(w.moves)))
        s = nxt
    return steps


def _inside_violation(world: M.World, without: frozenset[str]
                      ) -> Callable[[list[Step]], Counterexample] | None:
    """The first invariant broken after a hook that returned inside the event's step (where
    the implementation checks them too), as a counterexample of the trace it is given."""
    for call, inner in world.inside:
        violations = check(inner, without)
        if violations:
            hook = f"{call.hook}{call.args}"
            return lambda steps: Counterexample(
                "invariant", f"inside the step, after {hook}: {violations[0]}", steps,
                violations, inside=(hook, inner))
    return None


def check_program(bounds: M.Bounds, events: list[M.Event], faults: M.Faults = M.NO_FAULTS,
                  tables: M.Tables = M.SPEC_TABLES, without: frozenset[str] = frozenset(),
                  tier: tuple[str, ...] | None = None) -> Counterexample | None:
    """Check one directed program (`spec.regressions`; real job ids) as the search checks
    every path: each safety invariant in every state and after every hook inside a step, and
    that every event has its row; then, given `tier`, that the CPU tier ends holding that
    (`ModelState.tier`). None: the path holds. A path that leaves the model (an event the
    environment cannot send there) raises its NotEnabled."""
    s = M.initial(bounds)
    inv = check(M.abstract(s), without)
    if inv:
        return Counterexample("invariant", str(inv[0]), [], inv)
    steps: list[Step] = []
    for ev in events:
        try:
            nxt, _calls, world = M.apply(s, ev, faults, inside=True, tables=tables)
        except M.ModelError as exc:
            if isinstance(exc, M.NotEnabled):
                raise
            return Counterexample("illegal", f"{ev}: {exc}", [*steps, Step(ev, s, ())])
        steps.append(Step(ev, nxt, tuple(world.moves)))
        found = _inside_violation(world, without)
        if found is not None:
            return found(steps)
        violations = check(M.abstract(nxt), without)
        if violations:
            return Counterexample("invariant", str(violations[0]), steps, violations)
        s = nxt
    if tier is not None and (held := s.tier()) != tier:
        return Counterexample("tier", tier_difference(held, tier), steps)
    return None


def tier_difference(held: tuple[str, ...], pinned: tuple[str, ...]) -> str:
    """What a program's tier holds beside what it pins, in words."""
    missing = [c for c in pinned if c not in held]
    extra = [c for c in held if c not in pinned]
    return ("the CPU tier ends " + "; ".join(
        part for part in (f"without {', '.join(missing)}" if missing else "",
                          f"with {', '.join(extra)}" if extra else "") if part)
            + f" (it holds: {', '.join(held) or 'nothing'})")


# ============================================================================ liveness
def _waiting_of(p: Property, subject: str | None) -> Callable[[M.ModelState], bool]:
    if p.scope == "system":
        return p.waiting
    return lambda s: bool(p.waiting(s, subject))


def subjects(p: Property, bounds: M.Bounds) -> list[str | None]:
    """The instances of a property: one (None) for the system, one per request template."""
    return [None] if p.scope == "system" else [t.req_id for t in bounds.templates()]


def enabled_classes(s: M.ModelState, faults: M.Faults = M.NO_FAULTS,
                    tables: M.Tables = M.SPEC_TABLES) -> dict[M.FairClass, M.Event]:
    """The weakly fair classes enabled in `s`, each with one of its events."""
    out: dict[M.FairClass, M.Event] = {}
    for ev in M.events(s):
        c = M.fair_class(ev, s)
        if c is None or c in out:
            continue
        try:
            M.apply(s, ev, faults, tables=tables)
        except M.NotEnabled:
            continue
        except M.ModelError:
            pass
        out[c] = ev
    return out


def describe_class(c: M.FairClass) -> str:
    name, subject = c
    return {"step": "an engine step", "admit": f"the admission of {subject}",
            "finish": f"the finishing of {subject}",
            "report": f"a worker's report of job {subject}"}[name]


def certify_lasso(bounds: M.Bounds, steps: list[Step], cycle_start: int, prop: str,
                  request: str | None, faults: M.Faults = M.NO_FAULTS,
                  tables: M.Tables = M.SPEC_TABLES) -> list[str]:
    """Check, on the Python model, that `steps` is a lasso violating `prop`: the cycle
    returns to its first state (up to job numbering), `waiting` holds all along it, and it is
    fair. Returns the fairness lines for the report; raises ValueError when it is not."""
    p = next(q for q in PROGRESS if q.id == prop)
    waiting = _waiting_of(p, request)
    before = steps[cycle_start - 1].state if cycle_start else M.initial(bounds)
    cycle = steps[cycle_start:]
    if not cycle:
        raise ValueError("the lasso has no cycle")
    if M.canonical(before) != M.canonical(cycle[-1].state):
        raise ValueError("the cycle does not return to the state it started in")
    ring = [before, *(st.state for st in cycle[:-1])]
    if not all(waiting(s) for s in ring):
        raise ValueError(f"{prop} is not pending all along the cycle")
    enabled = [enabled_classes(s, faults, tables) for s in ring]
    always = set(enabled[0]).intersection(*enabled[1:])
    taken = {M.fair_class(st.event, s): i for i, (st, s) in
             enumerate(zip(cycle, ring, strict=True), cycle_start + 1)}
    owed = always - taken.keys()
    if owed:
        raise ValueError("the cycle is not fair: "
                         + ", ".join(describe_class(c) for c in sorted(owed, key=repr))
                         + " enabled all along it and never taken")
    if not always:
        return ["(no weakly fair class is enabled in every state of the cycle)"]
    return [f"{describe_class(c)}: taken at step {taken[c]}" for c in sorted(always, key=repr)]


def lasso_summary(p: Property, request: str | None, s: M.ModelState) -> str:
    """What a lasso's cycle shows, in words, from one of its states."""
    a = M.abstract(s)
    if p.scope == "request":
        r = a.request(request) if request is not None else None
        core = dict(s.core).get(request or "")
        where = (f"connector: {r.state} holding {sorted(r.transfer_jobs)}" if r is not None
                 else "connector: not tracked")
        status = core.status if core is not None else "absent"
        return f"request {request} never gets past this ({where}; core: {status})"
    held = sorted(a.live_job_ids | a.fence_ids | {h.id for h in a.quarantine})
    reqs = ", ".join(f"{r.id} in {r.state}" for r in a.requests) or "no request"
    return f"the system never returns to {p.id}'s goal (jobs {held}; {reqs})"


# ============================================================================ the search
def check_model(bounds: M.Bounds, faults: M.Faults = M.NO_FAULTS,
                max_states: int | None = None, progress: Progress | None = None,
                liveness: bool = True, stuck: bool = False,
                without: frozenset[str] = frozenset(),
                tables: M.Tables = M.SPEC_TABLES) -> CheckResult:
    """Explore every state reachable within `bounds`; stop at the first safety finding, then
    check every progress property as liveness (and, with `stuck`, the reachability check)."""
    result = CheckResult(bounds, faults, without=without)
    t0 = time.perf_counter()
    s0 = M.initial(bounds)
    index: dict[M.ModelState, int] = {M.canonical(s0): 0}
    states: list[M.ModelState] = [s0]
    parent: list[tuple[int, M.Event, tuple[tuple[str, object, str, str, str], ...]] | None] = [
        None]
    depth: list[int] = [0]
    out: list[list[tuple[int, M.FairClass | None]]] = [[]]
    labels: list[list[M.Event]] = [[]]
    queue = deque([0])

    def trace(i: int, last: Step | None = None) -> list[Step]:
        steps: list[Step] = [] if last is None else [last]
        while (p := parent[i]) is not None:
            pi, ev, moves = p
            steps.append(Step(ev, states[i], moves))
            i = pi
        return steps[::-1]

    inv = check(M.abstract(s0), without)
    if inv:
        result.counterexample = Counterexample("invariant", str(inv[0]), [], inv)
        return _finish(result, t0, 1, 0)
    while queue:
        i = queue.popleft()
        s = states[i]
        for ev, nxt, _calls, world in M.successors(s, faults, inside=True, tables=tables):
            result.edges += 1
            if isinstance(nxt, M.ModelError):
                bad = Step(ev, s, ())
                result.counterexample = Counterexample(
                    "illegal", f"{ev}: {nxt}", trace(i, bad))
                return _finish(result, t0, len(states), max(depth))
            assert world is not None
            result.covered.update(world.fired)
            found = _inside_violation(world, without)
            if found is not None:
                result.counterexample = found(trace(i, Step(ev, nxt, tuple(world.moves))))
                return _finish(result, t0, len(states), max(depth))
            key = M.canonical(nxt)
            j = index.get(key)
            if j is None:
                j = len(states)
                index[key] = j
                states.append(nxt)
                parent.append((i, ev, tuple(world.moves)))
                depth.append(depth[i] + 1)
                out.append([])
                labels.append([])
                violations = check(M.abstract(nxt), without)
                if violations:
                    result.counterexample = Counterexample(
                        "invariant", str(violations[0]), trace(j), violations)
                    return _finish(result, t0, len(states), max(depth))
                queue.append(j)
                if progress is not None and j % 5000 == 0:
                    progress(len(states), result.edges, depth[j])
            klass = M.fair_class(ev, s)
            if klass is not None and klass[0] == "report":
                klass = ("report", M.renumbering(s).get(int(klass[1] or 0), klass[1]))
            out[i].append((j, klass))
            labels[i].append(canonical_event(ev, s))
        if max_states is not None and len(states) >= max_states:
            result.complete = False
            break
    if liveness and result.complete:
        _check_liveness(result, states, out, labels, depth, trace, faults, tables)
    if stuck and result.complete:
        _check_stuck(result, states, out, trace)
    return _finish(result, t0, len(states), max(depth))


def _check_liveness(result: CheckResult, states: list[M.ModelState],
                    out: list[list[tuple[int, M.FairClass | None]]],
                    labels: list[list[M.Event]], depth: list[int],
                    trace: Callable[[int], list[Step]], faults: M.Faults,
                    tables: M.Tables) -> None:
    checked: list[str] = []
    for p in PROGRESS:
        for subject in subjects(p, result.bounds):
            waiting = _waiting_of(p, subject)
            found = fair_cycle(out, [waiting(s) for s in states], depth)
            if found is None:
                continue
            prefix = trace(found.entry)
            events = [labels[v][k] for v, k in found.edges]
            cycle = replay(result.bounds, events, faults, tables,
                           start=prefix[-1].state if prefix else states[0])
            steps = prefix + cycle
            fairness = certify_lasso(result.bounds, steps, len(prefix), p.id, subject,
                                     faults, tables)
            result.counterexample = Counterexample(
                "liveness", lasso_summary(p, subject, states[found.entry]), steps,
                cycle_start=len(prefix), property_id=p.id, request=subject, fairness=fairness)
            result.liveness = (*checked, p.id)
            return
        checked.append(p.id)
    result.liveness = tuple(checked)


def _finish(result: CheckResult, t0: float, n: int, depth: int) -> CheckResult:
    result.states = n
    result.depth = depth
    result.seconds = time.perf_counter() - t0
    return result


def _check_stuck(result: CheckResult, states: list[M.ModelState],
                 out: list[list[tuple[int, M.FairClass | None]]],
                 trace: Callable[[int], list[Step]]) -> None:
    pred: list[list[int]] = [[] for _ in states]
    for i, outs in enumerate(out):
        for j, _ in outs:
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
    if stuck and result.counterexample is None:
        first = stuck[0]
        a = M.abstract(states[first])
        held = ", ".join(f"{r.id} in {r.state} holding {sorted(r.transfer_jobs)}"
                         for r in a.requests) or "no request"
        result.counterexample = Counterexample(
            "stuck", f"no quiescent state is reachable from here ({held}; job table "
            f"{sorted(a.live_job_ids)}, fence {sorted(a.fence_ids)})", trace(first))


# ============================================================================ row witnesses
Row = tuple[str, int]
"""(machine, transition index): a row of the tables (`MachineSpec.row_id` names it)."""


def row_witnesses(bounds: M.Bounds, rows: set[Row], tables: M.Tables = M.SPEC_TABLES,
                  max_states: int | None = None) -> dict[Row, list[Step]]:
    """For each row of `rows` that some path within `bounds` fires, a shortest such path
    (breadth-first; real job ids), ending in the step that fires the row first. The search
    stops once every row has one, or when the state space (or `max_states`) is spent."""
    s0 = M.initial(bounds)
    index: dict[M.ModelState, int] = {M.canonical(s0): 0}
    states: list[M.ModelState] = [s0]
    parent: list[tuple[int, Step] | None] = [None]
    found: dict[Row, list[Step]] = {}
    todo = set(rows)

    def trace(i: int) -> list[Step]:
        steps: list[Step] = []
        while (p := parent[i]) is not None:
            i, step = p
            steps.append(step)
        return steps[::-1]

    queue = deque([0])
    while queue and todo:
        i = queue.popleft()
        for ev, nxt, _calls, world in M.successors(states[i], tables=tables):
            if isinstance(nxt, M.ModelError):
                continue
            assert world is not None
            step = Step(ev, nxt, tuple(world.moves))
            for row in todo.intersection(world.fired):
                found[row] = [*trace(i), step]
            todo.difference_update(world.fired)
            key = M.canonical(nxt)
            if key not in index:
                index[key] = len(states)
                states.append(nxt)
                parent.append((i, step))
                queue.append(len(states) - 1)
        if max_states is not None and len(states) >= max_states:
            break
    return found
