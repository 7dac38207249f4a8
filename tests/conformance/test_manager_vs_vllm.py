"""Differential test: our `CPUOffloadingManager` against vLLM 0.33.0's, call for call.

Both managers get the same random sequences of calls (requests with chunk positions,
lookups, loads, stores that succeed or fail, touches, request finishes, cache resets) on a
small cache, so that evictions are frequent. After every call the test compares:

* the return values: lookup results, load slots, `prepare_store`'s keys to store, slots and
  evicted keys (in order), or None;
* the resident keys with their reference counts and slots;
* the events;
* the policy's recency state: LRU's eviction order of every resident key; ARC's T1, T2, B1,
  B2 (in order) and target ``p``. A divergence shows here before it changes an eviction.

vLLM's manager is built directly, as its CPU offloading spec builds it (store threshold off,
events on). Our keys are ints; vLLM's are bytes (hash + group index), mapped one to one.

Cases where the two differ on purpose are never generated; `SKIPPED` names each with its
reason (they are listed in CONFORMANCE.md). Releases before 0.33.0 (conformance/releases.py):
without `lru_request_ranks` vLLM's LRU is compared with our `InsertionLRUPolicy` (keys ranked
by insertion, as those releases rank them); without `manager_request_recency` (0.30.0) with
our `ReleaseLRUPolicy` (idle keys in the order they became idle, which is all vLLM orders)
and vLLM's ARC with our `TouchARCPolicy`, the contexts without key positions; without
`failed_store_cleanup_event` the metadata-only removal events are left out of the event
comparison. Before `manager_chunks` (0.30.0) the manager counts blocks, not chunks: skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

import conformance.vllm_env  # (before vLLM: offline, quiet, temporary caches)

if conformance.vllm_env.vllm_version() < (0, 26, 0):
    pytest.skip("the manager's request-access API is 0.26+ (0.25 has no ReqContext positions)",
                allow_module_level=True)

# isort: split
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.cpu.manager import (
    CPUOffloadingManager as VllmManager,
)

from conformance.adapter import RELEASE_RULES
from statemachine.manager import CPUOffloadingManager, LookupResult, ReqContext
from statemachine.policies import ARCPolicy, LRUPolicy, ReleaseLRUPolicy

pytestmark = [pytest.mark.conformance]

# Deliberate differences: these cases are never generated (reasons also in CONFORMANCE.md).
SKIPPED = {
    "duplicate-absent-key-in-offer": (
        "vLLM's prepare_store does not deduplicate the offer: an absent key listed twice "
        "gets two slots and two policy inserts (one slot leaks). Ours deduplicates. The "
        "connector never offers a key twice."),
    "prepare-after-finish": (
        "a prepare_store/prepare_load after on_request_finished breaks the manager contract "
        "(B:430-448). Ours refuses every such prepare_store with ManagerError and records "
        "nothing for such loads; vLLM asserts only when a key is new to the request."),
    "contract-violation-asserts": (
        "prepare_load of an absent or write-pending key, complete_load of an unpinned key: "
        "vLLM asserts part-way (earlier keys already changed); ours raises ManagerError and "
        "changes nothing (tests/test_manager.py)."),
    "lru-equal-rank-ties": (
        "two keys of one request at one position (several KV cache groups) share an LRU "
        "rank: vLLM evicts them in key byte order, ours in tracking order. Our model has one "
        "group; the generator gives each key of a request its own position."),
    "ours-only-calls": (
        "quarantine_store/release_slots (timed-out stores) exist on one side only."),
}

KEYS = list(range(10))
TOKENS_PER_CHUNK = 16


def vkey(key: int) -> bytes:
    return bytes(make_offload_key(key.to_bytes(4, "big"), 0))


def ikey(key: bytes) -> int:
    return int.from_bytes(key[:-4], "big")


def vkeys(keys: list[int]) -> list[Any]:
    return [vkey(k) for k in keys]


def slots(spec: Any) -> list[int]:
    """The chunk slots of vLLM's `CPULoadStoreSpec`."""
    return [int(c) for c in spec.block_ids]


@dataclass
class Request:
    """One request, as both managers see it."""

    ours: ReqContext
    theirs: VReqContext
    chunks: list[int]                     # its keys, head first
    finished: bool = False


@dataclass
class Job:
    req: Request
    keys: list[int]


@dataclass
class Counts:
    """What a run exercised, summed over all examples (for sizing the test)."""

    calls: int = 0
    evictions: int = 0
    failed_allocations: int = 0
    by_rule: dict[str, int] = field(default_factory=dict)


COUNTS = Counts()


def our_policy(policy: str) -> str:
    """Our policy for vLLM's `policy` on this release: before `manager_request_recency`
    (0.31.0) vLLM's policies know no requests (`ReleaseLRUPolicy`, `TouchARCPolicy`); before
    `lru_request_ranks` (0.33.0) its LRU ranks an active request's keys by insertion
    (`InsertionLRUPolicy`)."""
    if not conformance.vllm_env.has("manager_request_recency"):
        return {"lru": "lru-release", "arc": "arc-touch"}[policy]
    if policy == "lru" and not conformance.vllm_env.has("lru_request_ranks"):
        return "lru-insertion"
    return policy


def vllm_name(name: str) -> str:
    """vLLM's name for one of its manager's fields: before `manager_chunks` (0.30.0) the
    manager counted blocks (`num_blocks`, `BlockStatus.block_id`, `evictable_blocks`, ...)."""
    return name if conformance.vllm_env.has("manager_chunks") else \
        name.replace("chunk", "block")


def their_manager(num_chunks: int, policy: str, store_threshold: int = 1) -> Any:
    extra = {"store_threshold": store_threshold} if store_threshold > 1 else {}
    return VllmManager(**{vllm_name("num_chunks"): num_chunks}, cache_policy=policy,
                       enable_events=True, **extra)


def our_manager(num_chunks: int, policy: str, store_threshold: int = 1) -> CPUOffloadingManager:
    """Ours, under the store-admission rule of the vLLM under test (`spec.rules`)."""
    return CPUOffloadingManager(num_chunks, our_policy(policy),  # type: ignore[arg-type]
                                store_threshold=store_threshold,
                                store_admission=RELEASE_RULES.store_admission)


TOUCH = not conformance.vllm_env.has("manager_touch_removed")
"""Whether vLLM's manager has `touch` (0.34.0 removed it; its scheduler never called it)."""

KEY_POSITIONS = conformance.vllm_env.has("manager_key_positions")
"""Whether vLLM's request context takes key positions (0.31.0+); before, ours get none
either (the policies of those releases ignore them)."""


class ManagerVsVllm(RuleBasedStateMachine):
    policy = "lru"
    store_threshold = 1

    def __init__(self) -> None:
        super().__init__()
        self.ours = our_manager(1, self.policy, self.store_threshold)
        self.theirs = their_manager(1, self.policy, self.store_threshold)
        self.requests: dict[int, Request] = {}
        self.stores: list[Job] = []
        self.loads: list[Job] = []

    def _count(self, name: str) -> None:
        COUNTS.calls += 1
        COUNTS.by_rule[name] = COUNTS.by_rule.get(name, 0) + 1

    @initialize(num_chunks=st.integers(1, 5),
                first=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
                second=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True))
    def setup(self, num_chunks: int, first: list[int], second: list[int]) -> None:
        self.ours = our_manager(num_chunks, self.policy, self.store_threshold)
        self.theirs = their_manager(num_chunks, self.policy, self.store_threshold)
        self._start(0, first, None)
        self._start(1, second, None)

    # ------------------------------------------------------------------ helpers
    def _live(self) -> list[int]:
        """Requests that may still prepare (SKIPPED["prepare-after-finish"])."""
        return sorted(i for i, r in self.requests.items() if not r.finished)

    def _pick(self, data: st.DataObject, live_only: bool) -> Request:
        slots = self._live() if live_only else sorted(self.requests)
        return self.requests[data.draw(st.sampled_from(slots), label="request")]

    def _keys_for(self, data: st.DataObject, req: Request, max_size: int = 4) -> list[int]:
        """Mostly the request's own chunks (any subset, any order), sometimes other keys."""
        pool = st.sampled_from(req.chunks) | st.sampled_from(KEYS)
        return data.draw(st.lists(pool, min_size=1, max_size=max_size,
                                  unique=True),   # SKIPPED["duplicate-absent-key-in-offer"]
                         label="keys")

    def _ready(self) -> list[int]:
        """Loadable keys (SKIPPED["contract-violation-asserts"])."""
        return sorted(k for k, n in self.ours.chunk_ref_counts().items() if n >= 0)

    # ------------------------------------------------------------------ requests
    @rule(slot=st.integers(0, 3),
          chunks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
          unpositioned=st.one_of(st.none(), st.integers(0, 5)))
    def new_request(self, slot: int, chunks: list[int], unpositioned: int | None) -> None:
        """A request (replacing any in the slot) whose chunks get end-token positions, except
        possibly one (no position: vLLM's fallback paths)."""
        self._start(slot, chunks, unpositioned)

    def _start(self, slot: int, chunks: list[int], unpositioned: int | None) -> None:
        self._count("new_request")
        req_id = f"r{slot}"
        ours = self.ours.on_new_request(req_id)
        theirs = VReqContext(req_id=req_id)
        self.theirs.on_new_request(theirs)
        for i, key in enumerate(chunks):
            if i != unpositioned and KEY_POSITIONS:
                # one position per key: SKIPPED["lru-equal-rank-ties"]
                ours.set_position(key, (i + 1) * TOKENS_PER_CHUNK)
                theirs.set_offload_key_position(vkey(key), (i + 1) * TOKENS_PER_CHUNK)
        self.requests[slot] = Request(ours, theirs, chunks)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), go=st.sampled_from([False, False, True]))
    def finish(self, data: st.DataObject, go: bool) -> None:
        """One draw in three, so that requests live long enough to fill the cache."""
        if not go:
            return
        self._count("finish")
        req = self._pick(data, live_only=False)      # a second finish is ignored by both
        self.ours.on_request_finished(req.ours)
        self.theirs.on_request_finished(req.theirs)
        req.finished = True

    # ------------------------------------------------------------------ lookups, loads
    @precondition(lambda self: self.requests)
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def lookup(self, data: st.DataObject, key: int) -> None:
        self._count("lookup")
        req = self._pick(data, live_only=False)
        ours = self.ours.lookup(key, req.ours)
        theirs = self.theirs.lookup(vkey(key), req.theirs)
        assert ours.name == theirs.name and ours is not LookupResult.RETRY

    @precondition(lambda self: any(not r.finished for r in self.requests.values()))
    @rule(data=st.data(), complete_now=st.booleans())
    def prepare_load(self, data: st.DataObject, complete_now: bool) -> None:
        """Load ready keys (the request's own when it has any ready); complete the load at
        once or leave it in flight (pinned)."""
        req = self._pick(data, live_only=True)
        ready = self._ready()
        own = [k for k in req.chunks if k in ready]
        if not ready:
            return
        self._count("prepare_load")
        keys = data.draw(st.lists(st.sampled_from(own or ready), min_size=1, max_size=3),
                         label="load keys")            # duplicates allowed: pinned twice
        ours = self.ours.prepare_load(keys, req.ours)
        theirs = self.theirs.prepare_load(vkeys(keys), req.theirs)
        assert list(ours) == slots(theirs)
        self.loads.append(Job(req, keys))
        if complete_now:
            self._complete_load(len(self.loads) - 1)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        self._complete_load(data.draw(st.integers(0, len(self.loads) - 1), label="load job"))

    def _complete_load(self, index: int) -> None:
        self._count("complete_load")
        job = self.loads.pop(index)
        self.ours.complete_load(job.keys, job.req.ours)
        self.theirs.complete_load(vkeys(job.keys), job.req.theirs)

    # ------------------------------------------------------------------ stores
    @precondition(lambda self: any(not r.finished for r in self.requests.values()))
    @rule(data=st.data(), then=st.sampled_from(["complete", "complete", "fail", "in flight"]))
    def prepare_store(self, data: st.DataObject, then: str) -> None:
        """Offer keys; complete the store at once (mostly), fail it, or leave it in flight."""
        self._count("prepare_store")
        req = self._pick(data, live_only=True)
        keys = self._keys_for(data, req)
        ours = self.ours.prepare_store(keys, req.ours)
        theirs = self.theirs.prepare_store(vkeys(keys), req.theirs)
        if theirs is None:
            COUNTS.failed_allocations += 1
            assert ours is None
            return
        assert ours is not None
        assert list(ours.keys_to_store) == [ikey(k) for k in theirs.keys_to_store]
        assert list(ours.evicted_keys) == [ikey(k) for k in theirs.evicted_keys]
        assert list(ours.chunk_ids) == slots(theirs.store_spec)
        COUNTS.evictions += len(ours.evicted_keys)
        if ours.keys_to_store:
            self.stores.append(Job(req, list(ours.keys_to_store)))
            if then != "in flight":
                self._complete_store(len(self.stores) - 1, then == "complete", [])

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.booleans(),
          extra=st.lists(st.sampled_from(KEYS), max_size=2, unique=True))
    def complete_store(self, data: st.DataObject, success: bool, extra: list[int]) -> None:
        """Complete a store job, sometimes with keys it does not hold (both skip them)."""
        self._complete_store(data.draw(st.integers(0, len(self.stores) - 1), label="store job"),
                             success, extra)

    def _complete_store(self, index: int, success: bool, extra: list[int]) -> None:
        self._count("complete_store")
        job = self.stores.pop(index)
        keys = job.keys + [k for k in extra if k not in job.keys]
        self.ours.complete_store(keys, job.req.ours, success=success)
        self.theirs.complete_store(vkeys(keys), job.req.theirs, success=success)

    # ------------------------------------------------------------------ touch, reset
    @precondition(lambda self: self.requests and TOUCH)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        self._count("touch")
        req = self._pick(data, live_only=False)
        keys = self._keys_for(data, req, max_size=3)
        self.ours.touch(keys, req.ours)
        self.theirs.touch(vkeys(keys), req.theirs)

    @rule(go=st.sampled_from([False] * 7 + [True]))
    def reset(self, go: bool) -> None:
        """Now and then (one draw in eight). Requests live on across it. In-flight loads are
        dropped: vLLM's scheduler never completes a pre-reset load (its stale-job threshold);
        late store completions are still sent, and both managers skip or apply them alike."""
        if not go:
            return
        self._count("reset")
        self.ours.reset_cache()
        self.theirs.reset_cache()
        self.loads.clear()

    # ------------------------------------------------------------------ comparisons
    def _their_chunks(self) -> dict[int, Any]:
        policy: Any = self.theirs._policy
        table = {**policy.t1, **policy.t2} if self.policy == "arc" else \
            getattr(policy, vllm_name("chunks"))
        return {ikey(k): c for k, c in table.items()}

    @invariant()
    def same_resident_chunks(self) -> None:
        theirs = self._their_chunks()
        assert self.ours.chunk_ref_counts() == {k: c.ref_cnt for k, c in theirs.items()}
        assert {k: self.ours.chunk_id(k) for k in theirs} == \
            {k: getattr(c, vllm_name("chunk_id")) for k, c in theirs.items()}
        theirs_now = {name: getattr(self.theirs, vllm_name(name)) for name in (
            "_get_num_free_chunks", "_num_evictable_cache_chunks", "_num_write_pending_chunks")}
        assert self.ours.num_free_slots() == theirs_now["_get_num_free_chunks"]()
        assert self.ours.num_evictable() == theirs_now["_num_evictable_cache_chunks"]
        assert self.ours.num_write_pending() == theirs_now["_num_write_pending_chunks"]
        assert self.ours.check_consistency() == []

    @invariant()
    def same_recency(self) -> None:
        theirs: Any = self.theirs._policy
        ours = self.ours.policy
        if isinstance(ours, ReleaseLRUPolicy):  # vLLM orders its idle chunks only
            idle = [k for k, c in self._their_chunks().items() if c.ref_cnt == 0]
            assert sorted(idle, key=ours.rank) == [ikey(k) for k in getattr(
                theirs, vllm_name("evictable_chunks"))]
        elif isinstance(ours, LRUPolicy):
            resident = list(self._their_chunks())
            assert sorted(resident, key=ours.rank) == \
                sorted(resident, key=lambda k: theirs._ranks[vkey(k)])
        else:
            assert isinstance(ours, ARCPolicy)
            for mine, their in ((ours.t1, theirs.t1), (ours.t2, theirs.t2),
                                (ours.b1, theirs.b1), (ours.b2, theirs.b2)):
                assert list(mine) == [ikey(k) for k in their]
            assert ours.p == theirs.target_t1_size

    @invariant()
    def same_admission_counts(self) -> None:
        """Store admission: the same keys counted the same number of times, in the same
        tracker order (least recently offered first)."""
        if self.store_threshold > 1:
            assert self.ours.offers is not None
            assert list(self.ours.offers.items()) == \
                [(ikey(k), n) for k, n in self.theirs.counts.items()]

    @invariant()
    def same_events(self) -> None:
        # Before 0.33.0 a failed store frees its keys without an event, and vLLM's events
        # have no `metadata_only` (releases.py: failed_store_cleanup_event).
        cleanup = conformance.vllm_env.has("failed_store_cleanup_event")
        ours = [(e.kind, list(e.keys), e.metadata_only) for e in self.ours.take_events()
                if cleanup or not e.metadata_only]
        theirs = [("removed" if e.removed else "stored", [ikey(k) for k in e.keys],
                   e.metadata_only if cleanup else False) for e in self.theirs.take_events()]
        assert ours == theirs


class LRUVsVllm(ManagerVsVllm):
    policy = "lru"


class ARCVsVllm(ManagerVsVllm):
    policy = "arc"


class ThresholdVsVllm(ManagerVsVllm):
    """Store admission at a threshold of 2, under the vLLM's own rule for what counts
    (`spec.rules.StoreAdmission`: every offer before 0.34.0, a key once per request and
    cache generation from it)."""

    policy = "lru"
    store_threshold = 2


_SETTINGS = settings(max_examples=200, stateful_step_count=80, deadline=None)
LRUVsVllm.TestCase.settings = _SETTINGS
ARCVsVllm.TestCase.settings = _SETTINGS
ThresholdVsVllm.TestCase.settings = _SETTINGS
TestLRUVsVllm = LRUVsVllm.TestCase
TestARCVsVllm = ARCVsVllm.TestCase
TestThresholdVsVllm = pytest.mark.skipif(
    not conformance.vllm_env.has("store_admission_at_store"),
    reason="this vLLM's manager admits stores elsewhere (feature store_admission_at_store)")(
        ThresholdVsVllm.TestCase)



def test_arc_evicts_from_t1_when_t2_has_no_eligible_chunk() -> None:
    """A cache of 2 chunks whose ARC target `p` exceeds |T1|: the eviction prefers T2, whose
    one chunk the offer itself protects, and must fall back to T1's idle chunk. Both managers
    run the same calls, compared after each as in the machine. vLLM 0.29.0 and earlier
    refuse the store instead (finding ARC-NO-FALLBACK: a strict xfail there). The scenario
    is built with `touch` (its ghost hits), which 0.34.0 removed: it skips there, and the
    call-for-call machine (`TestARCVsVllm`) compares ARC's evictions alone."""
    if not TOUCH:
        pytest.skip("built with the manager's touch, which this vLLM removed")
    m = ARCVsVllm()
    m.setup(num_chunks=2, first=[1], second=[2])
    req = m.requests[0]

    def both(call: str, keys: list[int]) -> tuple[Any, Any]:
        out = (getattr(m.ours, call)(keys, req.ours),
               getattr(m.theirs, call)(vkeys(keys), req.theirs))
        m.same_resident_chunks()
        m.same_recency()
        m.same_events()
        return out

    def store(keys: list[int]) -> list[int] | None:
        ours, theirs = both("prepare_store", keys)
        assert (ours is None) == (theirs is None), (keys, ours, theirs)
        if ours is None:
            return None
        assert list(ours.keys_to_store) == [ikey(k) for k in theirs.keys_to_store]
        assert list(ours.evicted_keys) == [ikey(k) for k in theirs.evicted_keys]
        both("complete_store", list(ours.keys_to_store))
        return list(ours.evicted_keys)

    assert store([1, 2]) == []
    assert store([3]) == [1] and store([4]) == [2]     # T1 = [3, 4], B1 = [1, 2]
    both("touch", [1])
    both("touch", [2])                                 # two ghost hits: p = 2
    both("touch", [3])                                 # T1 = [4], T2 = [3]
    assert m.ours.policy.p == 2.0                      # type: ignore[attr-defined]
    assert store([3, 5]) == [4]                        # 3 protected: T1's 4 goes
