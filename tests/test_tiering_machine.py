"""The tiering model-based machine (`statemachine.tiering.testing`) on the reference tiering
system against itself: memory tiers against filesystem tiers (the two storages must be
indistinguishable in every answer and every projected state), with vLLM's asynchronous
existence probes and with immediate lookups. Also the machine's own checks (`table_moves`)
on hand-made states. Small and fast: the long run against vLLM is
`tests/conformance/test_tiering_vllm.py`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, settings

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.state import (
    CpuChunk,
    TierCopy,
    TieringState,
    TierJobRecord,
    TierRequestRecord,
)
from statemachine.tiering.testing import (
    RefinementError,
    TieringStateMachine,
    TierSetup,
    key_bytes,
    reference_system,
    table_moves,
)

FAST = settings(max_examples=25, stateful_step_count=40, deadline=None,
                suppress_health_check=list(HealthCheck), database=None)


def memory_async(setup: TierSetup) -> Any:
    return reference_system(setup, "memory")


def fs_async(setup: TierSetup) -> Any:
    return reference_system(setup, "fs")


def memory_sync(setup: TierSetup) -> Any:
    return reference_system(setup, "memory", async_lookup=False)


def fs_sync(setup: TierSetup) -> Any:
    return reference_system(setup, "fs", async_lookup=False)


class MemoryVsFsProbes(TieringStateMachine):
    """Memory tiers against filesystem tiers, both with vLLM's existence probes."""

    system_factory = staticmethod(memory_async)
    reference_factory = staticmethod(fs_async)


class MemoryVsFsImmediate(TieringStateMachine):
    """Memory tiers against filesystem tiers, lookups answered at once (the tiering model's
    tiers)."""

    system_factory = staticmethod(memory_sync)
    reference_factory = staticmethod(fs_sync)


TestMemoryVsFsProbes = MemoryVsFsProbes.TestCase
TestMemoryVsFsProbes.settings = FAST
TestMemoryVsFsImmediate = MemoryVsFsImmediate.TestCase
TestMemoryVsFsImmediate.settings = FAST


def test_the_machine_catches_a_system_that_answers_differently() -> None:
    """A system whose lookups never answer HIT differs from the reference at the first
    hit: the machine reports a refinement error naming the call."""

    class Blind:
        def __init__(self, setup: TierSetup) -> None:
            self.inner = reference_system(setup, "memory", async_lookup=False)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def lookup(self, req_id: str, key: str) -> str:
            answer = self.inner.lookup(req_id, key)
            return "MISS" if answer == "HIT" else str(answer)

    class Machine(TieringStateMachine):
        system_factory = staticmethod(cast(Any, Blind))
        reference_factory = staticmethod(memory_sync)

    m = Machine()
    m.start(0, [])
    try:
        m._new_request(0, 0, 1)                     # r0: a0
        m._lookup("r0")                             # MISS
        m._store("r0", 1)
        m._land_store(m.reqs["r0"], 0, True)        # a0 stored, cascaded
        m._new_request(0, 0, 1)                     # r1: a0
        with pytest.raises(RefinementError, match="lookup"):
            m._lookup("r1")
    finally:
        m.failed = True
        m.teardown()


# ---------------------------------------------------------------------------- table_moves
def _state(**kw: Any) -> TieringState:
    base: dict[str, Any] = dict(cpu=[], copies=[], jobs=[], requests=[],
                                promotions_held=False, num_slots=2, free_slots=2)
    base.update(kw)
    return TieringState.build(**base)


def test_table_moves_accepts_paths_of_rows() -> None:
    before = _state(cpu=[CpuChunk("a", CC.PROMOTING, 0)],
                    jobs=[TierJobRecord("promotion", 0, "r", ("a",), (0,), TJ.REPORTED, 3)],
                    requests=[TierRequestRecord("r", TR.ACTIVE)], free_slots=1)
    # a poll lands the promotion, a store then evicts the key: two rows in one call
    after = _state(requests=[TierRequestRecord("r", TR.ACTIVE)])
    assert table_moves(before, after) == []
    queued = _state(cpu=[CpuChunk("a", CC.PROMOTION_QUEUED, 0)], free_slots=1,
                    copies=[TierCopy(0, "a", TC.STORED)],
                    jobs=[TierJobRecord("promotion", 0, "r", ("a",), (0,), TJ.QUEUED)])
    submitted = _state(cpu=[CpuChunk("a", CC.PROMOTING, 0)], free_slots=1,
                       copies=[TierCopy(0, "a", TC.READING)],
                       jobs=[TierJobRecord("promotion", 0, "r", ("a",), (0,), TJ.SUBMITTED, 0)])
    assert table_moves(queued, submitted) == []


def test_table_moves_rejects_moves_the_tables_lack() -> None:
    ready = _state(cpu=[CpuChunk("a", CC.READY, 0)], free_slots=1)
    promoting = _state(cpu=[CpuChunk("a", CC.PROMOTING, 0)], free_slots=1)
    assert table_moves(ready, promoting) == [
        "cpu_chunk a: READY -> PROMOTING is no path of rows"]
    stored = _state(copies=[TierCopy(0, "a", TC.STORED)])
    writing = _state(copies=[TierCopy(0, "a", TC.WRITING)])
    assert table_moves(stored, writing) == [
        "tier_copy t0/a: STORED -> WRITING is no path of rows"]
    job = TierJobRecord("cascade", 0, "r", ("a",), (0,), TJ.REPORTED, 1)
    back = replace(job, state=TJ.SUBMITTED)
    assert table_moves(_state(jobs=[job]), _state(jobs=[back])) == [
        "tier_job cascade ('job', 1): REPORTED -> SUBMITTED is no path of rows"]
    active = _state(requests=[TierRequestRecord("r", TR.FINISH_PENDING, 1)])
    again = _state(requests=[TierRequestRecord("r", TR.ACTIVE)])
    assert table_moves(active, again) == [
        "tier_request r: FINISH_PENDING -> ACTIVE is no path of rows"]


def test_key_bytes_is_a_function_of_the_key() -> None:
    assert key_bytes("a0", 40) == key_bytes("a0", 40)
    assert key_bytes("a0", 40) != key_bytes("a1", 40)
    assert len(key_bytes("a0", 4096)) == 4096
