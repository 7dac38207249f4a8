"""The tiering progress properties and their fairness: each "never `waiting` forever",
checked as liveness by `spec.tiering.checker` (a fair cycle of waiting states, with
stuttering, is a counterexample: a lasso).

Weak fairness (the event's class in `spec.tiering.model.events`): a tier that is not hung
finishes every I/O it was given; the manager polls; the step ends (on_schedule_end); the
engine retries a deferred lookup, completes its GPU copies and finishes a request that is
done; a timer fires (a tier job's timeout, the reset's drain deadline); the scheduler's
reset fence drains (late GPU copies land) and then calls on_reset_flushed. The environment's
choices carry no fairness: a request's arrival, a hang and its end, I/O and store failures,
a reset, a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.model import LOOKUP, TierModelState


@dataclass(frozen=True)
class TierProgress:
    id: str
    name: str
    statement: str
    scope: Literal["system", "request", "request-key"]
    waiting: Callable[..., bool]
    """`waiting(s)`, `waiting(s, r)` or `waiting(s, (r, k))`: the condition that must not
    hold forever (for each request, or each key of each request's prompt)."""


def _promotion_unfinished(s: TierModelState, rk: tuple[int, int]) -> bool:
    r, k = rk
    return any(j.kind == "promotion" and j.req == r and k in j.keys
               and j.state in (TJ.QUEUED, *TJ.IN_TABLE) for j in s.jobs)


def _deferred(s: TierModelState, r: int) -> bool:
    q = s.reqs[r]
    return q.phase == LOOKUP and q.deferred


def _draining(s: TierModelState) -> bool:
    return s.draining


def _finish_pending(s: TierModelState, r: int) -> bool:
    return s.reqs[r].tier_state == TR.FINISH_PENDING


def _held(s: TierModelState) -> bool:
    return s.held


TIER_PROGRESS: tuple[TierProgress, ...] = (
    TierProgress("TP-1", "deferred-lookups-resolve", "a request whose lookup was deferred "
                 "(HIT_PENDING or RETRY) is eventually answered HIT or MISS", "request",
                 _deferred),
    TierProgress("TP-2", "promotions-end", "a key a request waits on is not promoted "
                 "forever: its promotion ends (lands, fails, is dropped by a reset, times out) "
                 "and is not followed by another one, forever", "request-key",
                 _promotion_unfinished),
    TierProgress("TP-3", "drain-ends", "reset_cache's drain of the tiers ends", "system",
                 _draining),
    TierProgress("TP-4", "finished-requests-finalized", "a finished request is eventually "
                 "finalized in the tiers", "request", _finish_pending),
    TierProgress("TP-5", "promotions-resume", "after a reset, promotions are eventually "
                 "allowed again (on_reset_flushed)", "system", _held),
)
