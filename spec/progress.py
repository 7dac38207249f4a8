"""Progress properties: what must eventually happen, as temporal properties under explicit
fairness, the way TLA+ states them.

Every property has the shape "the system does not stay forever in `waiting`": globally
`□◇¬waiting`, or per request `∀r: □(waiting(r) ⇒ ◇¬waiting(r))`. A counterexample is a
lasso: a path to a cycle all of whose states are `waiting` (for the same request) and which is
*fair*: every weakly fair class of events that is enabled in every state of the cycle is taken
somewhere in it. The checkers (`spec.checker`, `statemachine.checker`) search the explored
state graph for such cycles: strongly connected components of the `waiting` states that hold a
fair cycle.

Fairness is data (`FAIRNESS`): weak fairness for what the engine and the workers do (an engine
step, the admission of a waiting request, the finishing of a request that computed every
token, a worker's report of a job it was sent), none for what the environment chooses
(arrivals, aborts, preemptions, resets, the choice between an ack and a failure, a stray
report of a drained stale id). Without the former, "eventually" is meaningless; with the
latter, a property would hold only because the environment is kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from spec import request as R

if TYPE_CHECKING:
    from spec.model.state import ModelState

Scope = Literal["system", "request"]


@dataclass(frozen=True)
class Fairness:
    """Weak fairness (WF) of one class of events: if some event of the class is enabled in
    every state from some point on, one is eventually taken."""

    name: str
    per: Literal["system", "request", "job"]
    events: str
    reason: str


FAIRNESS: tuple[Fairness, ...] = (
    Fairness("step", "system", "step(): an engine step (schedule, build_connector_meta, "
             "the workers' batch)", "the engine keeps stepping"),
    Fairness("admit", "request", "step(admit=r): the core tries to admit waiting request r",
             "the core's waiting queue is served: a request it could admit is tried"),
    Fairness("finish", "request", "finish(r): r has computed every token and stops",
             "a request that has computed every token is finished by the engine"),
    Fairness("report", "job", "ack(job j, ...) or fail(job j, ...): a worker reports job j",
             "a worker that is alive eventually reports a job it was sent (an ack or a "
             "failure: which one is the environment's choice)"),
)
"""The weakly fair classes. Every other event (arrive, abort, preempt, reset, a promotion
without a schedule, a stray report of a drained stale id) is the environment's choice and
carries no fairness."""

UNFAIR = ("arrive", "abort", "preempt", "reset", "promote", "stray report")
"""The environment's events, named in SPEC.md's fairness table (no fairness)."""


@dataclass(frozen=True)
class Progress:
    id: str
    statement: str
    formula: str
    """The temporal property (TLA+ notation), under the fairness of `FAIRNESS`."""
    scope: Scope
    """`system`: one property; `request`: one per request template."""
    invariant: str
    """The progress invariants of `spec.invariants` it stands behind."""
    waiting: Callable[..., bool]
    """`waiting(s)` (system) or `waiting(s, req_id)` (request) over a `spec.model.ModelState`:
    the condition the system must not stay in forever."""


def _busy(s: ModelState) -> bool:
    return bool(s.jobs or s.held)


def _on_connector(s: ModelState, req: str) -> bool:
    return any(q.id == req and q.state in R.WAITING_ON_CONNECTOR for q in s.reqs)


def _unquiet(s: ModelState) -> bool:
    from spec.model.projection import abstract

    return not abstract(s).is_quiescent()


def _unserved(s: ModelState, req: str) -> bool:
    return any(r == req and c.status != "finished" for r, c in s.core)


def _unsignaled(s: ModelState, req: str) -> bool:
    return any(r == req and c.status == "finished" for r, c in s.core) and \
        dict(s.signals).get(req, 0) == 0


PROGRESS: tuple[Progress, ...] = (
    Progress("P-1", "every live job leaves the table, and the reset fence and the timeout "
             "quarantine drain", "□◇(jobs = {} ∧ fence = {} ∧ quarantine = {})", "system",
             "INV-13", _busy),
    Progress("P-2", "no request waits in PREEMPTED_FLUSHING or LOOKUP_DEFERRED forever",
             "∀r: □(r ∈ waiting_on_connector ⇒ ◇(r ∉ waiting_on_connector))", "request",
             "INV-14", _on_connector),
    Progress("P-3", "the system keeps coming back to quiescence (nothing in flight, every "
             "request idle or gone)", "□◇quiescent", "system", "INV-13, INV-14", _unquiet),
    Progress("P-4", "every request that arrived is eventually finished or aborted: none "
             "waits or runs forever (PR #48102: a request that never runs again)",
             "∀r: □(arrived(r) ⇒ ◇finished(r))", "request", "INV-1, INV-14", _unserved),
    Progress("P-5", "every finished request is eventually signaled to the offloading manager "
             "(on_request_finished), which releases what the manager keeps for it",
             "∀r: □(finished(r) ⇒ ◇signaled(r))", "request", "INV-11", _unsignaled),
)
"""Checked in this order; a counterexample names the first one violated."""


def by_id(pid: str) -> Progress:
    for p in PROGRESS:
        if p.id == pid:
            return p
    raise KeyError(f"no progress property {pid!r}; known: "
                   + ", ".join(p.id for p in PROGRESS))
