"""Findings of the tiering conformance work on vLLM 0.33.0's `TieringOffloadingManager` with
its filesystem tier (`conformance.tiering_adapter`), each a minimal reproducer that asserts
the behaviour is there. When vLLM changes it, the test fails and says so: move the finding to
the fixed ones in CONFORMANCE.md.

T1 and T2 are vLLM behaviours the tiering spec decides on, not divergences the machine sees:
the reference mirrors vLLM on both when built as `vllm_like_reference` (the conformance
machine's, call for call); by default it keeps a request's scanned keys out of a promotion's
eviction (the spec's fix of T1). T3 is a divergence the machine translates (FREE-ORDER).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
if pytest.importorskip("conformance.vllm_env").vllm_version() < (0, 33, 0):
    pytest.skip("the tiering adapter drives vLLM 0.33.0's TieringOffloadingManager",
                allow_module_level=True)

# isort: split
from conformance.tiering_adapter import VllmTieringSystem
from conformance.vllm_env import has
from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering.cpu_chunk import prefix_scan
from tests.conformance import early
from tests.conformance.test_tiering_vllm import Checked

pytestmark = pytest.mark.conformance


@pytest.fixture
def make() -> Iterator[Any]:
    systems: list[VllmTieringSystem] = []

    def build(num_slots: int) -> Checked:
        systems.append(VllmTieringSystem(num_slots=num_slots, num_tiers=1))
        return Checked(systems[-1])

    yield build
    for s in systems:
        s.close()

FIXED = "vLLM no longer behaves so: move the finding to the fixed ones in CONFORMANCE.md"


def _scan(v: Checked, req_id: str, keys: list[str]) -> list[str]:
    return prefix_scan(lambda k: v.lookup(req_id, k), keys)


def _store_to_tier(v: Checked, req_id: str, keys: list[str]) -> None:
    """A GPU store of `keys` that lands, cascades, and is polled (the cascade's pins gone)."""
    v.store(req_id, keys)
    v.end_step()
    v.run_tier_io()
    v.end_step()


def test_tiering_finding_t1_a_prefix_longer_than_the_cpu_tier_is_deferred_forever(
        make: Any) -> None:
    """T1 (vLLM 0.33.0): a request whose hit prefix lives in a secondary tier and has more
    chunks than the CPU tier can hold is deferred forever, and thrashes the CPU tier.

    The scheduler looks up the whole prefix each step (S:773-803): a chunk the CPU tier
    misses and the tier holds is promoted, and the promotion's slot is taken by evicting the
    least recent evictable chunk, which here is a chunk of the same prefix that an earlier
    round promoted (TM:686-738, M:320-345: only the promoted key is protected). Each round
    therefore answers HIT_PENDING for some chunk, so the lookup defers (S:1014-1019) and the
    request is never scheduled; nothing bounds the rounds. Here: 3 chunks on disk, 2 CPU
    slots; after the first promotions the CPU tier's contents repeat with period 2 (a
    livelock, not slow progress), and every round reads two chunks from disk again.
    """
    v = make(num_slots=2)
    v.new_request("w")
    _store_to_tier(v, "w", ["a0", "a1"])
    _store_to_tier(v, "w", ["a2"])
    _store_to_tier(v, "w", ["x0", "x1"])            # evicts the prefix from the CPU tier
    v.request_finished("w")
    assert {c.key for c in v.state.copies} >= {"a0", "a1", "a2"}
    v.new_request("r")
    rounds = []
    for _ in range(8):
        answers = _scan(v, "r", ["a0", "a1", "a2"])
        rounds.append((tuple(answers), v.state.cpu))
        v.end_step()
        v.run_tier_io()
    deferred = [any(a in ("HIT_PENDING", "RETRY") for a in ans) for ans, _ in rounds]
    assert all(deferred), (FIXED, rounds)
    promoted = [tuple(sorted(c.key for c in cpu if c.state == CC.PROMOTION_QUEUED))
                for _, cpu in rounds]
    assert promoted[3:] == promoted[3:5] * 2 + promoted[3:4], (FIXED, promoted)
    # with a CPU slot per chunk the same prefix is served
    w = make(num_slots=3)
    w.new_request("w")
    _store_to_tier(w, "w", ["a0", "a1", "a2"])
    _store_to_tier(w, "w", ["x0", "x1", "x2"])
    w.request_finished("w")
    w.new_request("r")
    for _ in range(3):
        _scan(w, "r", ["a0", "a1", "a2"])
        w.end_step()
        w.run_tier_io()
        w.end_step()
    assert _scan(w, "r", ["a0", "a1", "a2"]) == ["HIT", "HIT", "HIT"]


def test_tiering_finding_t2_a_miss_verdict_outlives_the_copy_it_missed(make: Any) -> None:
    """T2 (vLLM 0.33.0): the filesystem tier keeps a key's negative existence verdict while
    any request that looked the key up is alive, and every new request that looks it up
    joins that verdict; a chunk cascaded to the tier after the probe is a MISS for all of
    them, so each recomputes it although it is on disk.

    `AsyncLookupManager` caches one verdict per key, shared by the requests that asked
    (TAL:144-165), dropped only when the last of them finishes (TAL:232-242); a cascade
    that writes the key does not touch it (TF:222-236, TF:278-325; only a failed promotion
    rewrites a verdict, to False, TAL:220-230). With overlapping requests sharing a prefix
    (a common system prompt) the verdict can stay stale indefinitely. Here A looks k up
    (MISS: nowhere yet), stores it (cascaded to disk), the CPU tier evicts it; B, then C
    (after A finished) get MISS though k's copy is on disk; only D, after every one of them
    finished, probes again and promotes it.
    """
    v = make(num_slots=2)
    v.new_request("A")
    assert v.lookup("A", "k") == "RETRY"
    v.end_step()
    v.run_tier_io()
    assert v.lookup("A", "k") == "MISS"
    _store_to_tier(v, "A", ["k"])
    _store_to_tier(v, "A", ["x0", "x1"])            # evicts k from the CPU tier
    assert v.chunk("k") is None and v.state.copy_state(0, "k") == TC.STORED
    v.new_request("B")
    if has("tier_store_marks_present"):
        # fixed in 0.34.0: the cascade's success turned A's verdict into a hit, so B finds
        # k on disk without a new probe (its promotion pending)
        assert v.lookup("B", "k") == "HIT_PENDING"
        return
    assert v.lookup("B", "k") == "MISS", FIXED
    v.request_finished("A")
    v.end_step()
    assert v.lookup("B", "k") == "MISS", FIXED
    v.new_request("C")
    assert v.lookup("C", "k") == "MISS", FIXED     # C joins B's stale verdict
    v.request_finished("B")
    v.end_step()
    assert v.lookup("C", "k") == "MISS", FIXED
    assert v.probe_verdict(0, "k") is False
    v.request_finished("C")
    v.new_request("D")
    assert v.lookup("D", "k") == "RETRY"            # a fresh probe
    v.end_step()
    v.run_tier_io()
    assert v.lookup("D", "k") == "HIT_PENDING"


_FREE_ORDER = """
import sys
sys.path.insert(0, ".")
from conformance.tiering_adapter import VllmTieringSystem
from statemachine.tiering.testing import key_bytes

v = VllmTieringSystem(num_slots=4, num_tiers=1)
try:
    def store(r, keys):
        out = v.prepare_store(r, keys)
        for k, s in zip(*out):
            v.write_slot(s, key_bytes(k, v.slot_bytes))
        v.complete_store(r, keys, True)
        v.end_step(); v.run_tier_io(); v.end_step()
    v.new_request("w")
    store("w", ["a0", "a1", "a2", "a3"])
    store("w", ["x0", "x1", "x2", "x3"])
    v.request_finished("w")
    v.new_request("r")
    for k in ["a0", "a1", "a2", "a3"]:
        v.lookup("r", k)
    v.end_step(); v.run_tier_io()
    for k in ["a0", "a1", "a2", "a3"]:
        v.lookup("r", k)
    v.end_step()
    v.truncate_copy(0, "a1")
    v.run_tier_io(); v.end_step()
    assert v.free_order_unspecified
    v.new_request("s")
    print(v.prepare_store("s", ["y"])[1][0])
finally:
    v.close()
"""


_FREE_ORDER_SEEDS = ("0", "1")


def _own_seed() -> str | None:
    """This process's hash seed, where it is one of `_FREE_ORDER_SEEDS` (make conformance
    fixes it): that seed's slot is taken here, with vLLM already imported, not in a process
    of its own (a vLLM import saved)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return seed if seed in _FREE_ORDER_SEEDS else None


def _free_order_here() -> int:
    """`_FREE_ORDER` run in this process: the slot it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_FREE_ORDER, "<T3 free order>", "exec"), {})
    return int(out.getvalue().strip().splitlines()[-1])


def _free_order_jobs() -> dict[str, early.Job]:
    return {f"t3-free-order-{seed}": ([sys.executable, "-c", _FREE_ORDER],
                                      {**os.environ, "PYTHONHASHSEED": seed})
            for seed in _FREE_ORDER_SEEDS if seed != _own_seed()}


T3 = "test_tiering_finding_t3_a_partly_failed_promotion_frees_its_slots_in_hash_order"
EARLY_JOBS: early.Jobs = {T3: _free_order_jobs}
"""T3's two processes, one per hash seed (tests/conformance/early.py)."""


def test_tiering_finding_t3_a_partly_failed_promotion_frees_its_slots_in_hash_order() -> None:
    """T3 (vLLM 0.33.0, harmless): a promotion that fails part way (a short read of its
    second key) frees the slots of its failed keys in the iteration order of a Python set of
    keys (TM:469-476, M:393-400); the free list is a stack, so the slot the next allocation
    takes depends on PYTHONHASHSEED, from one process to the next. Slots are
    interchangeable, so nothing breaks, but the manager is not a function of its calls; the
    reference frees in job order. Translation FREE-ORDER: once a system reports such frees
    (`free_order_unspecified`), the machine compares slots up to renaming.

    Four keys promoted in one job, the second one's copy cut short: the slot of the next
    store under PYTHONHASHSEED 0 and 1 (each in a fresh process, or this one for its own
    seed)."""
    slots = {_free_order_here()} if _own_seed() is not None else set()
    for key in _free_order_jobs():
        out = early.result_of(EARLY_JOBS, T3, key)
        assert out.returncode == 0, out.stderr[-3000:]
        slots.add(int(out.stdout.strip().splitlines()[-1]))
    assert len(slots) == 2, (FIXED, slots)
