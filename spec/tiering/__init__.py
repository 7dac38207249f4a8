"""Tiering: the CPU tier and the secondary tiers (vLLM's `vllm/v1/kv_offload/tiering/`).

Four tables, like the connector's: a chunk key in the CPU tier (`cpu_chunk`), a chunk key in
a secondary tier (`tier_copy`), a tier job (`tier_job`: cascade or promotion) and a request
in the tiering manager (`tier_request`). `TieringState` is what every layer projects onto.
"""

from spec.schema import MachineSpec
from spec.tiering.cpu_chunk import CPU_CHUNK_MACHINE
from spec.tiering.state import (
    CpuChunk,
    TierCopy,
    TieringState,
    TierJobRecord,
    TierRequestRecord,
)
from spec.tiering.tier_copy import TIER_COPY_MACHINE
from spec.tiering.tier_job import TIER_JOB_MACHINE
from spec.tiering.tier_request import TIER_REQUEST_MACHINE

TIERING_MACHINES: tuple[MachineSpec, ...] = (CPU_CHUNK_MACHINE, TIER_COPY_MACHINE,
                                             TIER_JOB_MACHINE, TIER_REQUEST_MACHINE)

__all__ = [
    "CPU_CHUNK_MACHINE",
    "TIERING_MACHINES",
    "TIER_COPY_MACHINE",
    "TIER_JOB_MACHINE",
    "TIER_REQUEST_MACHINE",
    "CpuChunk",
    "TierCopy",
    "TierJobRecord",
    "TierRequestRecord",
    "TieringState",
]
