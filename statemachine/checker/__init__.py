"""The model checker `kvspec check` runs: the compiled twin of `spec.model` (`compiled`),
its findings replayed and certified on the Python model.

`check` answers with `spec.checker.CheckResult`, as the reference checker does: the compiled
search finds a counterexample as a path of events over canonical states; `certify` replays it
on `spec.model` (job ids mapped back to the ones each state really uses), checks that the
model agrees (the same invariant broken, the same event illegal; for a lasso: the cycle
returns to its first state, the property is pending all along it, and it is fair) and renders
it like the reference checker's. A disagreement is a bug of the compiled twin, and says so.

Without a C compiler (or beyond the compiled model's bounds) `check` falls back to the
reference checker, and says why in `CheckResult.engine`.
"""

from __future__ import annotations

from collections.abc import Callable

from spec import model as M
from spec.checker import (
    CheckResult,
    Counterexample,
    Step,
    certify_lasso,
    check_model,
    lasso_summary,
    real_event,
    replay,
)
from spec.invariants import check as check_invariants
from spec.progress import PROGRESS
from statemachine.checker import compiled

Progress = Callable[[int, int, int], None]


class CheckerDisagreement(AssertionError):
    """The compiled twin found something the Python model does not confirm: a bug of the
    compiled twin (or of a change to one model not made in the other)."""


def engine_unavailable(bounds: M.Bounds | None = None) -> str | None:
    """Why the compiled checker cannot run (these bounds), or None."""
    why = compiled.available()
    if why is None and bounds is not None:
        why = compiled.fits(bounds)
    return why


def check(bounds: M.Bounds, faults: M.Faults = M.NO_FAULTS, *,
          max_states: int | None = None, progress: Progress | None = None,
          liveness: bool = True, stuck: bool = False, without: frozenset[str] = frozenset(),
          tables: M.Tables = M.SPEC_TABLES, engine: str = "auto",
          threads: int = 1) -> CheckResult:
    """Check `bounds` exhaustively: every safety invariant in every state and inside every
    step, every table row's legality, then every progress property as liveness under its
    fairness. `engine`: "compiled", "python", or "auto" (compiled where it can run).
    `threads`: the compiled search's threads (the same result on any number)."""
    why = engine_unavailable(bounds) if engine != "python" else "asked for"
    if why is not None:
        if engine == "compiled":
            raise compiled.CompiledUnavailable(why)
        result = check_model(bounds, faults, max_states=max_states, progress=progress,
                             liveness=liveness, stuck=stuck, without=without, tables=tables)
        result.engine = "python" if engine == "python" else f"python ({why})"
        return result
    run = compiled.search(bounds, faults, tables, max_states=max_states, liveness=liveness,
                          stuck=stuck, without=without, progress=progress, threads=threads)
    if run.verdict == "limit" and engine == "auto":
        # a mutant (or a fault) drove the model past the compiled twin's fixed sizes (job
        # ids, jobs per state): the reference checker has none
        result = check_model(bounds, faults, max_states=max_states, progress=progress,
                             liveness=liveness, stuck=stuck, without=without, tables=tables)
        result.engine = f"python (compiled limit: {run.message})"
        return result
    result = CheckResult(bounds, faults, states=run.states, edges=run.edges, depth=run.depth,
                         seconds=run.seconds, complete=run.complete,
                         stuck_states=run.stuck_states, covered=run.covered,
                         liveness=tuple(p.id for p in PROGRESS[:run.live_checked]),
                         without=without,
                         engine="compiled" if run.threads == 1 else
                         f"compiled, {run.threads} threads", memory=run.memory)
    if run.verdict in ("limit", "memory"):
        raise MemoryError(f"the compiled search stopped: {run.verdict} ({run.message})")
    if run.verdict != "ok":
        result.counterexample = certify(run, bounds, faults, tables, without)
    return result


def _events(labels: list[int], bounds: M.Bounds) -> list[M.Event]:
    return [compiled.label_event(label, bounds) for label in labels]


def certify(run: compiled.Run, bounds: M.Bounds, faults: M.Faults = M.NO_FAULTS,
            tables: M.Tables = M.SPEC_TABLES,
            without: frozenset[str] = frozenset()) -> Counterexample:
    """The compiled search's finding, replayed on the Python model and rendered."""
    events = _events(run.prefix, bounds)
    try:
        if run.verdict == "illegal":
            steps = replay(bounds, events[:-1], faults, tables)
            s = steps[-1].state if steps else M.initial(bounds)
            ev = real_event(events[-1], s)
            try:
                M.apply(s, ev, faults, tables=tables)
            except M.NotEnabled as exc:
                raise CheckerDisagreement(f"{ev} is not enabled in the Python model") from exc
            except M.ModelError as exc:
                return Counterexample("illegal", f"{ev}: {exc}", [*steps, Step(ev, s, ())])
            raise CheckerDisagreement(f"{ev} is legal in the Python model")
        if run.verdict == "invariant":
            return _invariant(run, bounds, events, faults, tables, without)
        if run.verdict == "liveness":
            prop = PROGRESS[run.invariant]
            subject = f"r{run.request}" if prop.scope == "request" else None
            steps = replay(bounds, events + _events(run.cycle, bounds), faults, tables)
            fairness = certify_lasso(bounds, steps, len(events), prop.id, subject, faults,
                                     tables)
            at = steps[len(events) - 1].state if events else M.initial(bounds)
            return Counterexample("liveness", lasso_summary(prop, subject, at), steps,
                                  cycle_start=len(events), property_id=prop.id,
                                  request=subject, fairness=fairness)
        if run.verdict == "stuck":
            steps = replay(bounds, events, faults, tables)
            at = steps[-1].state if steps else M.initial(bounds)
            a = M.abstract(at)
            held = ", ".join(f"{r.id} in {r.state} holding {sorted(r.transfer_jobs)}"
                             for r in a.requests) or "no request"
            return Counterexample("stuck", f"no quiescent state is reachable from here "
                                  f"({held}; job table {sorted(a.live_job_ids)})", steps)
    except (M.ModelError, ValueError) as exc:
        if isinstance(exc, CheckerDisagreement):
            raise
        raise CheckerDisagreement(f"the compiled checker's {run.verdict} finding does not "
                                  f"replay on the Python model: {exc}") from exc
    raise CheckerDisagreement(f"unknown verdict {run.verdict}")


def _invariant(run: compiled.Run, bounds: M.Bounds, events: list[M.Event], faults: M.Faults,
               tables: M.Tables, without: frozenset[str]) -> Counterexample:
    want = f"INV-{run.invariant}"
    steps = replay(bounds, events[:-1], faults, tables) if events else []
    s = steps[-1].state if steps else M.initial(bounds)
    if not events:
        found = check_invariants(M.abstract(s), without)
        if not any(v.invariant == want for v in found):
            raise CheckerDisagreement(f"{want} holds in the initial state")
        return Counterexample("invariant", str(found[0]), [], found)
    ev = real_event(events[-1], s)
    nxt, _calls, w = M.apply(s, ev, faults, inside=True, tables=tables)
    last = Step(ev, nxt, tuple(w.moves))
    if run.inside_hook >= 0:
        for call, inner in w.inside:
            found = check_invariants(inner, without)
            if found:
                if found[0].invariant != want:
                    raise CheckerDisagreement(f"inside the step the Python model breaks "
                                              f"{found[0].invariant} first, not {want}")
                hook = f"{call.hook}{call.args}"
                return Counterexample("invariant", f"inside the step, after {hook}: {found[0]}",
                                      [*steps, last], found, inside=(hook, inner))
        raise CheckerDisagreement(f"{want} holds inside the step in the Python model")
    found = check_invariants(M.abstract(nxt), without)
    if not found or found[0].invariant != want:
        raise CheckerDisagreement(f"the Python model's state after the trace breaks "
                                  f"{[v.invariant for v in found]}, not {want}")
    return Counterexample("invariant", str(found[0]), [*steps, last], found)
