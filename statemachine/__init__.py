"""kvoffload-spec's reference implementation: machines built from the tables of `spec`,
the scheduler side of the offloading connector with vLLM 0.33.0's API, and its manager."""

from statemachine.config import KVCacheGroup, OffloadingConfig
from statemachine.errors import (
    ConfigError,
    IllegalTransition,
    InvalidArgument,
    InvariantViolation,
    KVSpecError,
    MalformedMessage,
    OutOfStep,
    OverAck,
    SpecMismatch,
    UnknownJob,
    UnknownRequest,
)
from statemachine.job_table import JobTable
from statemachine.manager import CPUOffloadingManager, LookupResult, ManagerError
from statemachine.messages import (
    CachedRequestData,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    KVConnectorOutput,
    NewRequestData,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
    TransferJob,
)
from statemachine.scheduler import OffloadingScheduler

__all__ = [
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CachedRequestData",
    "ConfigError",
    "GPULoadStoreSpec",
    "IllegalTransition",
    "InvalidArgument",
    "InvariantViolation",
    "JobTable",
    "KVCacheGroup",
    "KVConnectorOutput",
    "KVSpecError",
    "LookupResult",
    "MalformedMessage",
    "ManagerError",
    "NewRequestData",
    "OffloadingConfig",
    "OffloadingConnectorMetadata",
    "OffloadingScheduler",
    "OffloadingWorkerMetadata",
    "OutOfStep",
    "OverAck",
    "Request",
    "RequestStatus",
    "SchedulerOutput",
    "SpecMismatch",
    "TransferJob",
    "UnknownJob",
    "UnknownRequest",
]
