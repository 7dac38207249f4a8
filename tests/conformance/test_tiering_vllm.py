"""vLLM 0.33.0's own `TieringOffloadingManager`, with its real filesystem tier on a temporary
directory, under the tiering model-based machine (`statemachine.tiering.testing`) and in
pinned scenarios.

The machine compares vLLM with the reference tiering system (`statemachine.tiering.reference`,
filesystem tiers, asynchronous existence probes, vLLM's promotion eviction rule:
`vllm_like_reference`) call for call and state for state, and checks the tiering invariants,
the table moves and the drain. The scenarios check vLLM's
projected state at each step against what the tables say, and the bytes every load reads.
How vLLM's threads are made deterministic: `conformance.tiering_adapter`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
if pytest.importorskip("conformance.vllm_env").vllm_version() < (0, 33, 0):
    pytest.skip("the tiering adapter drives vLLM 0.33.0's TieringOffloadingManager",
                allow_module_level=True)

# isort: split
from hypothesis import HealthCheck, settings

from conformance.tiering_adapter import VllmTieringSystem
from conformance.vllm_env import has
from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.state import TieringState, TierRequestRecord
from statemachine.tiering.testing import (
    TieringStateMachine,
    TierSetup,
    key_bytes,
    table_moves,
    tiering_violations,
    vllm_like_reference,
)

pytestmark = pytest.mark.conformance

EXAMPLES = int(os.environ.get("KVSPEC_TIERING_EXAMPLES", "60"))


def vllm_system(setup: TierSetup) -> VllmTieringSystem:
    return VllmTieringSystem(num_slots=setup.num_slots, num_tiers=setup.num_tiers)


def release_reference(setup: TierSetup) -> Any:
    """The reference as this release behaves: from 0.34.0 (feature
    tier_store_marks_present) a store's success updates the probe cache (T2 fixed)."""
    return vllm_like_reference(setup, marks_present=has("tier_store_marks_present"))


class VllmTieringMachine(TieringStateMachine):
    system_factory = staticmethod(vllm_system)
    reference_factory = staticmethod(release_reference)


TestVllmTieringMachine = VllmTieringMachine.TestCase
TestVllmTieringMachine.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=100, deadline=None,
    suppress_health_check=list(HealthCheck), database=None)


# ============================================================================ scenarios
class Checked:
    """A `VllmTieringSystem` whose every call is followed by the checks of the machine: the
    tiering invariants and the table moves from the state before the call."""

    def __init__(self, system: VllmTieringSystem) -> None:
        self.s = system
        self.last: TieringState = system.project()
        self.trace: list[str] = []

    @property
    def state(self) -> TieringState:
        return self.last

    def __getattr__(self, name: str) -> Any:
        f = getattr(self.s, name)
        if name in ("project", "close", "read_slot", "copy_path", "probe_verdict",
                    "held_items") or not callable(f):
            return f

        def call(*args: Any) -> Any:
            out = f(*args)
            self.trace.append(f"{name}{args} -> {out!r}")
            state = self.s.project()
            bad = tiering_violations(state) + table_moves(self.last, state)
            assert not bad, f"after {' ; '.join(self.trace)}:\n" + "\n".join(bad)
            self.last = state
            return out

        return call

    def store(self, req_id: str, keys: list[str]) -> tuple[int, ...]:
        """A GPU store that lands: prepare, write the keys' bytes, complete."""
        out = self.prepare_store(req_id, keys)
        assert out is not None and list(out[0]) == keys, out
        for k, slot in zip(*out, strict=True):
            self.write_slot(slot, key_bytes(k, self.s.slot_bytes))
        self.complete_store(req_id, keys, True)
        return tuple(out[1])

    def load(self, req_id: str, keys: list[str]) -> None:
        """A GPU load of `keys`: pin, check every slot holds its key's bytes, release."""
        slots = self.prepare_load(req_id, keys)
        for k, slot in zip(keys, slots, strict=True):
            assert self.s.read_slot(slot) == key_bytes(k, self.s.slot_bytes), (k, slot)
        self.complete_load(req_id, keys)

    def chunk(self, key: str) -> tuple[str, int] | None:
        c = self.s.project().chunk(key)
        return None if c is None else (c.state, c.slot)


@pytest.fixture
def make() -> Iterator[Any]:
    systems: list[VllmTieringSystem] = []

    def build(num_slots: int, num_tiers: int = 1) -> Checked:
        s = VllmTieringSystem(num_slots=num_slots, num_tiers=num_tiers)
        systems.append(s)
        return Checked(s)

    yield build
    for s in systems:
        s.close()


def _offload_and_evict(v: Checked, keys: list[str], fillers: list[str]) -> None:
    """Store `keys` (they cascade to the tier: files), then store `fillers`, which evict
    them from the CPU tier."""
    v.new_request("w0")
    v.store("w0", keys)
    v.end_step()                # prepare_store polled this step: the step's poll is spent
    v.run_tier_io()
    v.end_step()                # polls the cascade: READY
    assert all(v.chunk(k) == (CC.READY, i) for i, k in enumerate(keys))
    v.new_request("w1")
    v.store("w1", fillers)
    assert all(v.chunk(k) is None for k in keys)
    assert all(v.state.copy_state(0, k) == TC.STORED for k in keys)
    v.end_step()
    v.run_tier_io()
    v.end_step()


def test_promotion_after_the_cpu_tier_evicted_the_chunk(make: Any) -> None:
    """A chunk the CPU tier evicted is promoted back from the filesystem tier: RETRY while
    the existence probe runs, HIT_PENDING while the promotion is queued and runs, then HIT,
    and the load reads exactly the bytes the store wrote."""
    v = make(num_slots=1)
    _offload_and_evict(v, ["a"], ["b"])
    v.new_request("r")
    assert v.lookup("r", "a") == "RETRY"            # a probe of a's file starts (TAL:144-165)
    v.end_step()                                    # the probe batch is flushed (TAL:167-189)
    v.run_tier_io()                                 # the probe thread finds the file
    assert v.lookup("r", "a") == "HIT_PENDING"      # promotion queued, b evicted (TM:686-738)
    assert v.chunk("a") == (CC.PROMOTION_QUEUED, 0)
    (job,) = v.state.jobs
    assert (job.kind, job.state, job.keys, job.job_id) == ("promotion", TJ.QUEUED, ("a",), None)
    v.end_step()                                    # submitted (TM:740-763)
    assert v.chunk("a") == (CC.PROMOTING, 0)
    assert v.state.copy_state(0, "a") == TC.READING
    v.write_slot(0, b"\0" * v.s.slot_bytes)         # whatever the slot held is overwritten
    assert v.lookup("r", "a") == "HIT_PENDING"
    v.run_tier_io()                                 # the load runs
    assert v.state.jobs[0].state == TJ.REPORTED
    assert v.state.copy_state(0, "a") == TC.STORED
    # this step's lookup already polled (the gate, TM:448-458): still pending until the next
    assert v.lookup("r", "a") == "HIT_PENDING"
    v.end_step()
    assert v.lookup("r", "a") == "HIT"              # the poll landed it (TM:460-499)
    assert v.chunk("a") == (CC.READY, 0)
    v.load("r", ["a"])
    v.request_finished("r")
    assert not v.state.jobs


def test_reset_with_cascades_and_promotions_in_flight(make: Any) -> None:
    """A reset while a promotion runs, another is queued and a cascade runs: vLLM drains the
    tier (its I/O finishes), applies the results, drops the queued promotion, forgets the CPU
    tier and holds promotions; the copies stay; active requests stay open."""
    v = make(num_slots=4)
    _offload_and_evict(v, ["a", "b", "c", "d"], ["e", "f", "g", "h"])
    for r, keys in (("r2", ["a", "b"]), ("r3", ["c"])):
        v.new_request(r)
        assert [v.lookup(r, k) for k in keys] == ["RETRY"] * len(keys)
    v.end_step()
    v.run_tier_io()
    assert [v.lookup("r2", k) for k in "ab"] == ["HIT_PENDING"] * 2
    v.end_step()                                    # r2's promotion: SUBMITTED
    assert v.lookup("r3", "c") == "HIT_PENDING"     # r3's: QUEUED
    v.new_request("r4")
    v.store("r4", ["i"])                            # a cascade: SUBMITTED
    kinds = sorted((j.kind, j.state) for j in v.state.jobs)
    assert kinds == [("cascade", TJ.SUBMITTED), ("promotion", TJ.QUEUED),
                     ("promotion", TJ.SUBMITTED)], v.state.jobs
    v.reset()
    s = v.state
    assert s.cpu == () and s.jobs == () and s.promotions_held
    assert s.free_slots == 4
    assert {c.key for c in s.copies if c.state == TC.STORED} == set("abcdefghi")
    assert {r.req_id: (r.state, r.pending_stores) for r in s.requests} == {
        r: (TR.ACTIVE, 0) for r in ("w0", "w1", "r2", "r3", "r4")}
    assert v.lookup("r3", "c") == "MISS"            # held (TM:640-641)
    v.end_step()
    v.reset_flushed()
    assert v.lookup("r3", "c") == "HIT_PENDING"     # c's cached verdict survived the reset


def test_promotions_held_after_reset_until_on_reset_flushed(make: Any) -> None:
    """After a reset, a chunk only a secondary tier holds is a MISS (the request recomputes
    it) until `on_reset_flushed`, then it is promoted again (TM:1155-1162, TM:1198-1202)."""
    v = make(num_slots=1)
    _offload_and_evict(v, ["a"], ["b"])
    v.new_request("r")
    assert v.lookup("r", "a") == "RETRY"
    v.end_step()
    v.run_tier_io()
    v.reset()
    assert v.state.promotions_held
    for _ in range(3):
        assert v.lookup("r", "a") == "MISS"
        v.end_step()
    v.reset_flushed()
    assert not v.state.promotions_held
    assert v.lookup("r", "a") == "HIT_PENDING"
    assert v.chunk("a") == (CC.PROMOTION_QUEUED, 0)


def test_request_finished_before_its_final_store(make: Any) -> None:
    """A request finishes while its last GPU store is pending: the tiering manager keeps it
    (FINISH_PENDING) until the store completes, the completion still cascades under the
    request, and only then are the tiers told (TM:1044-1080). Telling them first made the
    late `complete_store` look the request up after it was gone (a KeyError)."""
    v = make(num_slots=2)
    v.new_request("r")
    assert v.lookup("r", "a") == "RETRY"
    v.end_step()
    v.run_tier_io()
    assert v.lookup("r", "a") == "MISS"             # no copy anywhere
    assert v.probe_verdict(0, "a") is False
    out = v.prepare_store("r", ["a"])
    assert out == (("a",), (0,))
    v.request_finished("r")
    assert v.state.requests == (TierRequestRecord("r", TR.FINISH_PENDING, 1),)
    assert v.probe_verdict(0, "a") is False         # the tier was not told yet
    v.write_slot(0, key_bytes("a", v.s.slot_bytes))
    v.complete_store("r", ["a"], True)
    assert v.state.requests == ()
    assert v.probe_verdict(0, "a") == "absent"      # now it was (TAL:232-242)
    (job,) = v.state.jobs
    assert (job.kind, job.req_id, job.keys) == ("cascade", "r", ("a",))
    v.end_step()                                    # this step's lookup polled already
    v.run_tier_io()
    v.end_step()
    assert v.state.jobs == () and v.state.copy_state(0, "a") == TC.STORED
    assert v.chunk("a") == (CC.READY, 0)


def test_promotion_into_a_full_cpu_tier_is_a_miss(make: Any) -> None:
    """A chunk a secondary tier holds is a MISS while no CPU slot can take it (every slot
    write-pending or pinned): no promotion is queued (TM:713-719, TM:661-662); once a slot
    is evictable it is promoted."""
    v = make(num_slots=1)
    _offload_and_evict(v, ["a"], ["b"])
    v.new_request("r")
    assert v.lookup("r", "a") == "RETRY"
    v.end_step()
    v.run_tier_io()
    v.new_request("s")
    out = v.prepare_store("s", ["c"])               # evicts b; c write-pending
    assert out == (("c",), (0,))
    assert v.lookup("r", "a") == "MISS"
    assert v.state.jobs == () and v.chunk("c") == (CC.WRITE_PENDING, 0)
    v.write_slot(0, key_bytes("c", v.s.slot_bytes))
    v.complete_store("s", ["c"], True)              # c READY, pinned by its cascade
    assert v.lookup("r", "a") == "MISS"
    v.run_tier_io()
    v.end_step()                                    # the cascade's pin is released
    assert v.lookup("r", "a") == "HIT_PENDING"
    assert v.chunk("a") == (CC.PROMOTION_QUEUED, 0)


def test_a_failed_promotion_frees_its_slot_and_caches_a_miss(make: Any) -> None:
    """An I/O error in a promotion (injected into vLLM's own read, `fail_next_io`): the
    promoted key leaves the CPU tier, its slot is free, and the filesystem tier answers MISS
    for it from then on while the probe is cached, though the file is still there (the
    livelock guard of TF:297-306, TAL:220-230)."""
    v = make(num_slots=1)
    if not v.s.faults_supported:
        pytest.skip("vLLM's C I/O extension is loaded: the fault proxy cannot reach it")
    _offload_and_evict(v, ["a"], ["b"])
    v.new_request("r")
    assert v.lookup("r", "a") == "RETRY"
    v.end_step()
    v.run_tier_io()
    assert v.lookup("r", "a") == "HIT_PENDING"
    v.end_step()
    assert v.fail_next_io(0)
    v.run_tier_io()
    v.end_step()
    assert v.chunk("a") is None and v.state.free_slots == 1
    assert v.state.copy_state(0, "a") == TC.STORED
    assert v.probe_verdict(0, "a") is False
    assert v.lookup("r", "a") == "MISS"


def test_a_failed_cascade_publishes_nothing(make: Any) -> None:
    """An I/O error in a cascade's write: the temporary file is removed, no copy appears,
    the CPU chunk is released (READY) and a later lookup's probe finds nothing."""
    v = make(num_slots=2)
    if not v.s.faults_supported:
        pytest.skip("vLLM's C I/O extension is loaded: the fault proxy cannot reach it")
    v.new_request("r")
    v.store("r", ["a"])
    assert v.state.copy_state(0, "a") == TC.WRITING
    assert v.fail_next_io(0)
    v.end_step()
    v.run_tier_io()
    assert v.state.copy_state(0, "a") == TC.ABSENT
    assert v.s.stray_files() == []
    v.end_step()
    assert v.chunk("a") == (CC.READY, 0) and v.state.jobs == ()


def test_a_truncated_copy_fails_its_promotion_from_that_key_on(make: Any) -> None:
    """A copy cut short on disk: the promotion that reads it keeps the keys it read before
    (`successful_keys`, TF:297-316, TM:460-499), frees the slots of the rest, and the short
    file is removed (TIO:141-168); the tier answers MISS for the failed key from then on."""
    v = make(num_slots=2)
    _offload_and_evict(v, ["a", "b"], ["c", "d"])
    v.new_request("r")
    assert [v.lookup("r", k) for k in "ab"] == ["RETRY", "RETRY"]
    v.end_step()
    v.run_tier_io()
    assert [v.lookup("r", k) for k in "ab"] == ["HIT_PENDING", "HIT_PENDING"]
    v.end_step()
    (job,) = v.state.jobs
    assert job.keys == ("a", "b") and job.state == TJ.SUBMITTED
    assert v.truncate_copy(0, "b")
    v.run_tier_io()
    assert v.state.copy_state(0, "b") == TC.ABSENT     # the short file was removed
    v.end_step()
    assert v.chunk("a") == (CC.READY, 1)
    assert v.chunk("b") is None and v.state.free_slots == 1
    assert not v.s.free_order_unspecified           # one failed key: no order to choose
    assert v.probe_verdict(0, "b") is False
    assert [v.lookup("r", k) for k in "ab"] == ["HIT", "MISS"]
    v.load("r", ["a"])


def test_a_probe_batch_of_two_requests_is_waited_for_to_its_last_verdict(make: Any) -> None:
    """One step's probe batch holds two requests' keys. From 0.34.0 the probe thread posts a
    result item per request, as each request's probe ends (TAL@0.34.0:301-321; 0.33.0 posts
    one item per batch, TAL:271-290): `run_tier_io` waits for a verdict for every key of the
    batch, not for the first item, so the second request's lookup is answered even when its
    probe ends late (here: its `batch_lookup` is held back a little, as a loaded machine
    does)."""
    v = make(num_slots=2)
    _offload_and_evict(v, ["a", "b"], ["c", "d"])
    probe = v.s.tiers[0].manager._lookup_manager
    real_batch_lookup = probe.batch_lookup
    late: list[str] = []

    def batch_lookup(keys: Any, req_context: Any) -> Any:
        if req_context.req_id == "r3":
            late.append(req_context.req_id)
            threading.Event().wait(0.3)             # the second request's probe ends late
        return real_batch_lookup(keys, req_context)

    probe.batch_lookup = batch_lookup
    for r, k in (("r2", "a"), ("r3", "b")):
        v.new_request(r)
        assert v.lookup(r, k) == "RETRY"
    v.end_step()                                    # one batch of both requests' keys
    v.run_tier_io()
    assert late == ["r3"]
    assert [v.lookup(r, k) for r, k in (("r2", "a"), ("r3", "b"))] == ["HIT_PENDING"] * 2
    assert v.probe_verdict(0, "a") is True and v.probe_verdict(0, "b") is True
