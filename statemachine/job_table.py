"""The global job table (`_jobs`), the job id counter and the stale threshold.

Only the job machine's effects add or remove entries (`enter_job_table`,
`leave_job_table`), and removing an entry always removes the id from its owner's
`transfer_jobs` too: this is where INV-1 is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum

from statemachine.errors import UnknownJob
from statemachine.models import JobStatus


class JobClass(Enum):
    """Where a reported job id stands."""

    LIVE = "live"
    QUARANTINED = "quarantined"
    FENCED = "fenced"
    STALE_DRAINED = "stale-drained"
    UNKNOWN = "unknown"


class JobTable:
    def __init__(self) -> None:
        self._jobs: dict[int, JobStatus] = {}
        self.quarantine: dict[int, JobStatus] = {}
        """Timed-out jobs awaiting their late reports (beyond vLLM)."""
        self.job_counter = 0
        self.stale_threshold = 0

    def allocate_id(self) -> int:
        job_id = self.job_counter
        self.job_counter += 1
        return job_id

    def add(self, job: JobStatus) -> None:
        if job.job_id in self._jobs:
            raise UnknownJob(job.job_id, "already in the job table")
        self._jobs[job.job_id] = job

    def remove(self, job_id: int) -> JobStatus:
        return self._jobs.pop(job_id)

    def get(self, job_id: int) -> JobStatus | None:
        return self._jobs.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[JobStatus]:
        return iter(list(self._jobs.values()))

    def ids(self) -> frozenset[int]:
        return frozenset(self._jobs)

    def is_stale(self, job_id: int) -> bool:
        return job_id < self.stale_threshold

    def classify(self, job_id: int, fence: dict[int, int]) -> JobClass:
        if job_id in self._jobs:
            return JobClass.LIVE
        if job_id in self.quarantine:
            return JobClass.QUARANTINED
        if job_id in fence:
            return JobClass.FENCED
        if 0 <= job_id < self.stale_threshold:
            return JobClass.STALE_DRAINED
        return JobClass.UNKNOWN
