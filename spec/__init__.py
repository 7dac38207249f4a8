"""kvoffload-spec: the formal specification of vLLM's KV-offloading lifecycles.

The tables (`REQUEST_MACHINE`, `JOB_MACHINE`, `FENCE_MACHINE`, `WORKER_MACHINE`) are the
single source of truth; the invariants and progress properties are predicates over
`AbstractState`.
This package knows nothing of torch or of the implementation.
"""

from spec.fence import FENCE_MACHINE
from spec.invariants import INVARIANTS, SAFETY, Invariant, Violation, check
from spec.job import JOB_MACHINE
from spec.progress import PROGRESS, Progress
from spec.request import REQUEST_MACHINE
from spec.schema import BEYOND_VLLM, SAME, MachineSpec, Path, State, Transition
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord
from spec.worker import WORKER_MACHINE

MACHINES: tuple[MachineSpec, ...] = (REQUEST_MACHINE, JOB_MACHINE, FENCE_MACHINE,
                                     WORKER_MACHINE)

__all__ = [
    "BEYOND_VLLM",
    "FENCE_MACHINE",
    "INVARIANTS",
    "JOB_MACHINE",
    "MACHINES",
    "PROGRESS",
    "REQUEST_MACHINE",
    "SAFETY",
    "SAME",
    "WORKER_MACHINE",
    "AbstractState",
    "HeldJob",
    "Invariant",
    "JobRecord",
    "MachineSpec",
    "Path",
    "Progress",
    "RequestRecord",
    "State",
    "Transition",
    "Violation",
    "check",
]
