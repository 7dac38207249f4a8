"""Progress properties: what must eventually happen, not what holds in one state.

They are checked on the explored state graph (reverse reachability): from every reachable
state, some state satisfying `goal` must be reachable. Fairness assumptions are stated with
each property, because without them "eventually" is meaningless: the engine keeps stepping,
and every worker either reports or the job timeout fires.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spec import request as R
from spec.state import AbstractState


@dataclass(frozen=True)
class Progress:
    id: str
    statement: str
    assumption: str
    invariant: str
    goal: Callable[[AbstractState], bool]


def _drained(s: AbstractState) -> bool:
    return not s.jobs and not s.reset_fence and not s.quarantine


def _no_waiting(s: AbstractState) -> bool:
    return all(r.state not in (R.PREEMPTED_FLUSHING, R.LOOKUP_DEFERRED) for r in s.requests)


PROGRESS: tuple[Progress, ...] = (
    Progress("P-1", "every live job leaves the table and the reset fence drains",
             "the engine keeps stepping; workers report every job they were sent", "INV-13",
             _drained),
    Progress("P-2", "no request waits in PREEMPTED_FLUSHING or LOOKUP_DEFERRED forever",
             "as P-1", "INV-14", _no_waiting),
    Progress("P-3", "a quiescent state (nothing in flight, every request idle or gone) is "
             "reachable from every reachable state", "as P-1",
             "INV-13, INV-14", AbstractState.is_quiescent),
)
