"""The subjects the tiering lifecycles move: a tier job (`spec.tiering.tier_job`) and a request
as the tiering manager knows it (`spec.tiering.tier_request`).

Their fields mirror vLLM's `TransferJob` / `JobMetadata` (TB:71-80, TM:109-111) with the
pending-promotion accumulator (TM:91-97), and `RequestState` (TM:100-106). Their guard methods
are the guards the tables name; they hold data and answer guards, and never change state
themselves (only `Lifecycle.fire` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transitions import EventData

from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from statemachine.manager import ReqContext
from statemachine.policies import OffloadKey
from statemachine.tiering.tiers import JobResult, TransferJob

JobKind = Literal["cascade", "promotion"]


@dataclass(eq=False)
class TierJob:
    """A cascade (CPU -> tier) or a promotion (tier -> CPU). A promotion is an accumulator of
    one step's keys for one (tier, request) until the step ends and it gets its id."""

    kind: JobKind
    tier: int
    ctx: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    state: str = TJ.UNALLOCATED
    job_id: int | None = None
    submit_step: int = 0
    """The manager's step counter when the job entered the table (for the timeout)."""
    result: JobResult | None = None
    """The tier's report, once polled."""
    tier_is_hung: bool = False
    """Set by a reset whose drain of the job's tier passed its deadline."""
    pins_held: bool = False
    """A cascade: its `prepare_read` pins are still on its keys (until its result is
    applied, or a reset forgets the keys)."""
    held_slots: tuple[int, ...] = ()
    """Slots quarantined on this job's behalf (a timed-out or stale job's)."""

    @property
    def key(self) -> object:
        if self.job_id is None:
            return f"queued promotion (tier {self.tier}, {self.req_id})"
        return self.job_id

    @property
    def req_id(self) -> str:
        return self.ctx.req_id

    @property
    def is_promotion(self) -> bool:
        return self.kind == "promotion"

    def transfer_job(self) -> TransferJob:
        assert self.job_id is not None
        return TransferJob(self.job_id, tuple(self.keys), tuple(self.slots),
                           self.is_promotion, self.req_id)

    # -- guards (spec.tiering.tier_job.GUARDS) -----------------------------------------
    def io_ok(self, event: EventData) -> bool:
        return self.result is not None and self.result.success

    def tier_hung(self, event: EventData) -> bool:
        return self.tier_is_hung


@dataclass(eq=False)
class TierRequest:
    """A request between on_new_request and its finalization in the tiers."""

    ctx: ReqContext
    state: str = TR.UNKNOWN
    pending_stores: int = 0
    """GPU -> CPU stores prepared and not completed (pending_primary_stores, TM:103)."""
    is_finished: bool = False

    @property
    def key(self) -> str:
        return self.ctx.req_id

    # -- guards (spec.tiering.tier_request.GUARDS) -------------------------------------
    def stores_pending(self, event: EventData) -> bool:
        return self.pending_stores > 0

    def last_pending_store(self, event: EventData) -> bool:
        return self.pending_stores == 1

    def stores_offered(self, event: EventData) -> bool:
        return int(event.kwargs.get("offered", 0)) > 0


__all__ = ["JobKind", "TierJob", "TierRequest"]
