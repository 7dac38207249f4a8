"""Typed errors. Each says what went wrong, where (request, job, state), and what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spec.invariants import Violation


class KVSpecError(Exception):
    """Base class of every error this package raises on purpose."""


class SpecMismatch(KVSpecError):
    """A table names a guard or effect that the implementation does not provide."""


class IllegalTransition(KVSpecError):
    """A trigger the table does not allow in the subject's current state."""

    def __init__(self, machine: str, key: object, state: str, trigger: str,
                 allowed: Sequence[str], reason: str = "") -> None:
        self.machine = machine
        self.key = key
        self.state = state
        self.trigger = trigger
        self.allowed = tuple(allowed)
        why = reason or f"the {machine} table has no {trigger!r} transition from {state}"
        super().__init__(
            f"{machine} {key!r} in state {state}: trigger {trigger!r} rejected: {why}. "
            f"Triggers allowed in {state}: {', '.join(self.allowed) or 'none'}."
        )


class InvariantViolation(KVSpecError):
    """The state reached after an event breaks an invariant of `spec.invariants`."""

    def __init__(self, violations: Sequence[Violation], event: str) -> None:
        self.violations = tuple(violations)
        self.event = event
        first = self.violations[0]
        self.invariant = first.invariant
        self.request = first.request
        self.jobs = first.jobs
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"after {event}: {len(self.violations)} invariant violation(s):\n"
                         f"{lines}")


class UnknownRequest(KVSpecError):
    def __init__(self, req_id: str, hook: str) -> None:
        self.req_id = req_id
        super().__init__(f"{hook}: request {req_id!r} is not tracked (never added with "
                         "on_new_request, or already cleaned up)")


class UnknownJob(KVSpecError):
    def __init__(self, job_id: int, detail: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id}: {detail}")


class OverAck(KVSpecError):
    def __init__(self, job_id: int, count: int, due: int, state: str) -> None:
        self.job_id = job_id
        self.count = count
        self.due = due
        super().__init__(f"job {job_id} in state {state}: report count {count} exceeds the "
                         f"{due} report(s) still due; nothing was changed")


class MalformedMessage(KVSpecError):
    """A message from the workers (or to them) that does not have the documented shape."""


class InvalidArgument(KVSpecError):
    """A hook argument that contradicts the connector's state (a hit it never answered, a
    block table too short, a token count out of range)."""


class OutOfStep(KVSpecError):
    """A hook called where the step protocol forbids it (reset_cache inside a step)."""


class ConfigError(KVSpecError):
    """A configuration value outside its documented range."""


class UnknownTierJob(KVSpecError):
    """A secondary tier reported a result for a job id that is neither in the tiering
    manager's job table nor quarantined (vLLM asserts, TM:527-535)."""

    def __init__(self, tier: int, job_id: int, detail: str, more: int = 0) -> None:
        self.tier = tier
        self.job_id = job_id
        others = f" (and {more} more unknown result(s) in this poll)" if more else ""
        super().__init__(f"tier {tier} reported job {job_id}, which is not one of its jobs in "
                         f"flight: {detail}{others}; the poll applied every other result")
