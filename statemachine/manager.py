"""The CPU offloading manager: which chunks the CPU cache holds, in which slot, and in which
state (reference §4.1, §4.2, §4.4).

One key names one chunk. An indexed chunk has a reference count:

* ``-1``: write pending. `prepare_store` allocated its slot; the copy has not been confirmed.
  Lookups answer HIT_PENDING; it can be neither loaded nor evicted.
* ``0``: ready and idle. Lookups answer HIT; the eviction policy may pick it.
* ``n > 0``: ready and pinned by ``n`` loads in flight; never evicted.

Every one of the ``num_chunks`` slots is, at any time, exactly one of: on the free list,
not yet handed out by the bump allocator, held by one indexed key, or quarantined (the
slot of a store that timed out: its late copy may still land, so the slot is neither
indexed nor reused until `release_slots`). `check_consistency` verifies this.

Deviations from vLLM's CPU manager, all deliberate:

* the store-admission tracker counts an offer of a key once, however often the offer lists
  it (offers are deduplicated, below);
* `complete_store(success=False)` and the timeout quarantine (`quarantine_store`,
  `release_slots`) exist, although the 0.33.0 connector never fails a store;
* contract violations raise `ManagerError` (leaving the manager unchanged) where vLLM
  asserts; a `prepare_store` after `on_request_finished` is always refused (vLLM asserts
  only on a key new to the request) and a later load records no access;
* an offer is deduplicated (vLLM gives an absent key listed twice two slots).

Store admission, as vLLM's (M:129-148, M:266-291): with ``store_threshold >= 2`` every
`prepare_store` counts each offered key (absent, pending or ready) in a tracker of at most
``max_tracker_size`` keys (least recently offered dropped first, never one of the current
offer); an absent key becomes a store candidate only once offered ``store_threshold`` times.
A key held back is neither a store miss nor an access. A reset keeps the counts. What counts
is ``store_admission`` (`spec.rules.StoreAdmission`): every offer, as 0.33.0, or, as
0.34.0 (M@0.34.0:133-159, M@0.34.0:290-298), a key once per request in its access record
(a request's re-offer after a preemption or a failed allocation only refreshes the key's
recency; `stores_skipped` counts a key held back at the request's first offer of it).

Eviction choices, slot choices and recency are vLLM's, call for call
(tests/conformance/test_manager_vs_vllm.py checks it against vLLM 0.33.0).

`reset_cache` frees every slot, quarantined ones included, as vLLM's reset frees every
slot: keeping a late copy from landing in a reused slot is the scheduler's reset fence's job.

Recency, as in vLLM 0.33.0 (reference §4.2, §4.3). Each request has an *access record* for
the current cache generation: the keys it has seen (first-seen order), the ones it inserted
and the ones it reused (found already stored and ready, unless it had inserted them itself).
A key enters the record the first time the request loads it, stores it, or offers it for
storing while it is absent or ready; an offered key that is still write pending is not an
access. New keys are reported to the policy at once (`on_request_access`: *provisional*
recency, LRU's request rank); the whole record is replayed head first when the request
finishes (`on_request_finished`: *committed* recency). Head-first order is the order of the
*positions* the caller set on the request context (`ReqContext.set_position`, vLLM's end
token of the chunk) when every seen key has one, else first-seen order.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from spec.rules import StoreAdmission
from statemachine.errors import ConfigError, KVSpecError
from statemachine.policies import EvictionPolicy, OffloadKey, PolicyName, make_policy

__all__ = [
    "CPUOffloadingManager",
    "LookupResult",
    "ManagerError",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
]


class ManagerError(KVSpecError):
    """A call that breaks the manager's contract. The manager was left unchanged.

    ``states`` maps each offending key to its chunk state ("absent", "write pending in slot
    3", ...); ``slots`` lists offending slot ids for slot operations.
    """

    def __init__(self, op: str, detail: str, *, req_id: str | None = None,
                 states: Mapping[OffloadKey, str] | None = None,
                 slots: Sequence[int] = ()) -> None:
        self.op = op
        self.req_id = req_id
        self.states = dict(states or {})
        self.keys = tuple(self.states)
        self.slots = tuple(slots)
        who = f" for request {req_id!r}" if req_id is not None else ""
        parts = [f"key {k} is {s}" for k, s in self.states.items()]
        if self.slots:
            parts.append(f"slot(s) {list(self.slots)}")
        what = f" ({'; '.join(parts)})" if parts else ""
        super().__init__(f"{op}{who}: {detail}{what}; nothing was changed")


class LookupResult(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"   # part of the vLLM contract; this manager never answers it


@dataclass(frozen=True)
class ReqContext:
    """A request as the manager knows it; ``generation`` is the cache generation at creation.

    ``positions`` maps the request's keys to their position in it (vLLM's end token of the
    chunk); the caller sets them, before offering or loading the keys, with `set_position`.
    """

    req_id: str
    generation: int
    positions: dict[OffloadKey, int] = field(default_factory=dict, compare=False, repr=False)

    def set_position(self, key: OffloadKey, position: int) -> None:
        self.positions[key] = position


@dataclass(frozen=True)
class PrepareStoreOutput:
    keys_to_store: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    evicted_keys: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class OffloadingEvent:
    kind: Literal["stored", "removed"]
    keys: tuple[OffloadKey, ...]
    metadata_only: bool = False


@dataclass(slots=True)
class _Chunk:
    chunk_id: int
    ref_cnt: int


@dataclass(slots=True)
class _Access:
    """One request's access record in the current cache generation (see the module doc)."""

    token: int                       # names the request to the policy (its request rank)
    seen: dict[OffloadKey, None] = field(default_factory=dict)   # first-seen order
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_missed: set[OffloadKey] = field(default_factory=set)
    counted: set[OffloadKey] = field(default_factory=set)   # store admission per request


_STAT_NAMES = ("lookups", "hits", "hits_pending", "misses", "store_calls", "stores",
               "store_reuses", "stores_completed", "stores_failed", "loads", "loads_completed",
               "evictions", "allocation_failures", "quarantined", "released", "resets",
               "stores_skipped", "reads", "reads_completed")


class CPUOffloadingManager:
    """Reference model of vLLM's ``CPUOffloadingManager`` (single-threaded, no lock)."""

    def __init__(self, num_chunks: int, eviction_policy: PolicyName = "lru",
                 store_threshold: int = 1, max_tracker_size: int = 64_000,
                 store_admission: StoreAdmission = StoreAdmission.PER_OFFER) -> None:
        for name, value in (("num_chunks", num_chunks), ("store_threshold", store_threshold),
                            ("max_tracker_size", max_tracker_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_chunks = num_chunks
        if not isinstance(store_admission, StoreAdmission):
            raise ConfigError(f"store_admission must be a spec.rules.StoreAdmission, got "
                              f"{store_admission!r}")
        self.store_threshold = store_threshold
        self.store_admission = store_admission
        """What the threshold counts (`spec.rules.StoreAdmission`): every offer (0.33.0),
        or a key once per request and cache generation (0.34.0)."""
        self.max_tracker_size = max_tracker_size
        self.offers: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None)
        """Store admission: how often each key was offered, least recently offered first
        (only with `store_threshold >= 2`)."""
        self.eviction_policy = eviction_policy
        self._policy: EvictionPolicy = make_policy(eviction_policy, num_chunks)
        self._index: dict[OffloadKey, _Chunk] = {}
        self._free: deque[int] = deque()
        self._num_allocated = 0           # bump allocator: slots below it were handed out
        self._quarantined: set[int] = set()
        self._num_evictable = 0           # ready keys with ref_cnt == 0
        self._num_write_pending = 0       # keys with ref_cnt == -1
        self._generation = 0
        self._access: dict[str, _Access] = {}    # req_id -> record; cleared by a reset
        self._next_token = 0
        self._finished: set[str] = set()
        self._events: list[OffloadingEvent] = []
        self.finished_signals: dict[str, int] = {}
        self.stores_after_finish: list[str] = []
        self.reset_flushed_count = 0
        self.stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)

    # ------------------------------------------------------------------ introspection
    @property
    def generation(self) -> int:
        return self._generation

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def quarantined_slots(self) -> frozenset[int]:
        return frozenset(self._quarantined)

    def num_free_slots(self) -> int:
        """Slots a store can take without evicting: the free list plus unallocated slots."""
        return len(self._free) + self.num_chunks - self._num_allocated

    def num_evictable(self) -> int:
        return self._num_evictable

    def num_write_pending(self) -> int:
        return self._num_write_pending

    def chunk_ref_counts(self) -> dict[OffloadKey, int]:
        return {k: c.ref_cnt for k, c in self._index.items()}

    def chunk_id(self, key: OffloadKey) -> int | None:
        chunk = self._index.get(key)
        return None if chunk is None else chunk.chunk_id

    def describe(self, key: OffloadKey) -> str:
        """The chunk state of ``key`` in words (used in error messages)."""
        chunk = self._index.get(key)
        if chunk is None:
            return "absent"
        if chunk.ref_cnt < 0:
            return f"write pending in slot {chunk.chunk_id}"
        return f"ready in slot {chunk.chunk_id} with ref_cnt={chunk.ref_cnt}"

    def _ref_cnt(self, key: OffloadKey) -> int:
        return self._index[key].ref_cnt

    # ------------------------------------------------------------------ requests
    def on_new_request(self, req_id: str) -> ReqContext:
        self._finished.discard(req_id)
        self._access[req_id] = self._new_access()
        return ReqContext(req_id, self._generation)

    def _new_access(self) -> _Access:
        self._next_token += 1
        return _Access(self._next_token)

    def _access_of(self, ctx: ReqContext) -> _Access | None:
        """The request's access record (a fresh one after a reset); None once it finished."""
        if ctx.req_id in self._finished:
            return None
        rec = self._access.get(ctx.req_id)
        if rec is None:
            rec = self._access[ctx.req_id] = self._new_access()
        return rec

    def _record_access(self, rec: _Access, ctx: ReqContext, keys: Iterable[OffloadKey],
                       reused: Iterable[OffloadKey] = ()) -> None:
        """Add ``keys`` to the record, reporting the new ones to the policy (provisional
        recency); ``reused`` ones count as reuses unless this request inserted them."""
        new = [k for k in dict.fromkeys(keys) if k not in rec.seen]
        if new:
            rec.seen.update(dict.fromkeys(new))
            self._policy.on_request_access(new, ctx.positions, request=rec.token)
        rec.reused.update(k for k in reused if k not in rec.inserted)

    def on_request_finished(self, ctx: ReqContext) -> None:
        """The request will issue no further prepare_store/prepare_load.

        Every call is counted in `finished_signals`. The first one commits the request's
        recency: its access record, head first (ordered by position when every seen key has
        one), goes to the policy. A request with no access since the last reset commits
        nothing. The request is marked finished in every case, so a later `prepare_store` is
        refused and later loads record nothing.
        """
        req_id = ctx.req_id
        self.finished_signals[req_id] = self.finished_signals.get(req_id, 0) + 1
        if req_id in self._finished:
            return
        self._finished.add(req_id)
        rec = self._access.pop(req_id, None)
        if rec is None:
            return
        order = list(rec.seen)
        if all(k in ctx.positions for k in order):
            order.sort(key=ctx.positions.__getitem__)
        held = [k for k in order if k in self._index]
        self._policy.on_request_finished(held, rec.reused, request=rec.token,
                                         inserted=rec.inserted - rec.reused)

    # ------------------------------------------------------------------ lookup and loads
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        del ctx
        self.stats["lookups"] += 1
        chunk = self._index.get(key)
        if chunk is None:
            self.stats["misses"] += 1
            return LookupResult.MISS
        if chunk.ref_cnt < 0:
            self.stats["hits_pending"] += 1
            return LookupResult.HIT_PENDING
        self.stats["hits"] += 1
        return LookupResult.HIT

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[int, ...]:
        """Pin every key (ref_cnt += 1) and return their slots in key order."""
        out = self._pin("prepare_load", keys, ctx)
        if (rec := self._access_of(ctx)) is not None:
            self._record_access(rec, ctx, keys, reused=keys)
        self.stats["loads"] += len(keys)
        return out

    def prepare_read(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[int, ...]:
        """Pin every key for a copy from the CPU tier to a secondary tier (a tiering
        cascade): `prepare_load` without the access record, as vLLM's tiering primary tier
        pins with ``_prepare_load(record_access=False)`` (TM:150-158, M:221-241)."""
        out = self._pin("prepare_read", keys, ctx)
        self.stats["reads"] += len(keys)
        return out

    def _pin(self, op: str, keys: Sequence[OffloadKey], ctx: ReqContext) -> tuple[int, ...]:
        bad = {k: self.describe(k) for k in keys
               if k not in self._index or self._index[k].ref_cnt < 0}
        if bad:
            raise ManagerError(op, "every key must be stored and ready", req_id=ctx.req_id,
                               states=bad)
        out: list[int] = []
        for key in keys:
            chunk = self._index[key]
            if chunk.ref_cnt == 0:
                self._num_evictable -= 1
                self._policy.on_evictable(key, False)
            chunk.ref_cnt += 1
            out.append(chunk.chunk_id)
        return tuple(out)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        """Mark ``keys`` (head first) as just used, outside any request's access record.
        Part of vLLM's manager API; its scheduler never calls it."""
        del ctx
        self._policy.touch(list(keys), self._ref_cnt)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Unpin every key (ref_cnt -= 1); a key listed twice is unpinned twice."""
        self._unpin("complete_load", keys, ctx)
        self.stats["loads_completed"] += len(keys)

    def complete_read(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """Unpin the keys of a finished `prepare_read` (vLLM's alias of complete_load,
        TM:144)."""
        self._unpin("complete_read", keys, ctx)
        self.stats["reads_completed"] += len(keys)

    def _unpin(self, op: str, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        counts = Counter(keys)
        bad = {k: self.describe(k) for k, n in counts.items()
               if k not in self._index or self._index[k].ref_cnt < n}
        if bad:
            raise ManagerError(op, "every key must be pinned by a load",
                               req_id=None if ctx is None else ctx.req_id, states=bad)
        for key in keys:
            chunk = self._index[key]
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                self._policy.on_evictable(key, True)

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext,
                      protect: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        """Reserve slots for the offered keys that are not held yet.

        Returns None (allocating and evicting nothing) when the free slots plus the evictable
        chunks outside the offer (and outside `protect`, keys the caller needs kept: the
        tiering manager's promotions pass the keys their request's lookup just hit) cannot
        cover them. The store-miss report and the access
        record (absent and ready offered keys; write-pending ones are not accesses) happen
        before that check, as in vLLM.
        """
        rec = self._access_of(ctx)
        if rec is None:
            self.stores_after_finish.append(ctx.req_id)
            raise ManagerError("prepare_store", "new cache keys offered after the request "
                               "finished", req_id=ctx.req_id,
                               states={k: self.describe(k) for k in keys})
        self.stats["store_calls"] += 1
        offered = list(dict.fromkeys(keys))
        counted: set[OffloadKey] = set()
        if self.offers is not None:
            if self.store_admission is StoreAdmission.PER_REQUEST:
                counted = {k for k in offered if k in rec.counted}
                rec.counted.update(offered)
            self._count_offers(offered, counted)
        candidates: list[OffloadKey] = []
        reuses: list[OffloadKey] = []
        for key in offered:
            chunk = self._index.get(key)
            if chunk is None:
                candidates.append(key)
            elif chunk.ref_cnt >= 0:
                reuses.append(key)
        if self.offers is not None:
            admitted = [k for k in candidates if self.offers.get(k, 0) >= self.store_threshold]
            self.stats["stores_skipped"] += sum(1 for k in candidates
                                                if k not in admitted and k not in counted)
            candidates = admitted
        if misses := [k for k in candidates if k not in rec.store_missed]:
            rec.store_missed.update(misses)
            self._policy.on_store_miss(misses)
        accessed = set(candidates) | set(reuses)
        self._record_access(rec, ctx, [k for k in offered if k in accessed], reused=reuses)
        self.stats["store_reuses"] += len(reuses)
        if not candidates:
            return PrepareStoreOutput((), (), ())

        need = len(candidates) - self.num_free_slots()
        evicted: list[OffloadKey] = []
        if need > 0:
            victims = None
            kept = set(offered) | set(protect)
            if need <= self._num_evictable:
                victims = self._policy.evict(need, kept, self._ref_cnt)
            if victims is None:
                self.stats["allocation_failures"] += 1
                return None
            self._check_victims(victims, need, kept)
            for key, chunk_id in victims:
                del self._index[key]
                self._free.append(chunk_id)
                self._num_evictable -= 1
                evicted.append(key)
            self._events.append(OffloadingEvent("removed", tuple(evicted)))
            self.stats["evictions"] += len(evicted)

        chunk_ids: list[int] = []
        for key in candidates:
            chunk_id = self._allocate()
            self._index[key] = _Chunk(chunk_id, -1)
            self._policy.insert(key, chunk_id, request=rec.token, position=ctx.positions.get(key))
            self._policy.on_evictable(key, False)  # write pending
            chunk_ids.append(chunk_id)
        rec.inserted.update(candidates)
        self._num_write_pending += len(candidates)
        self.stats["stores"] += len(candidates)
        return PrepareStoreOutput(tuple(candidates), tuple(chunk_ids), tuple(evicted))

    def _count_offers(self, offered: Sequence[OffloadKey],
                      counted: Collection[OffloadKey]) -> None:
        """Count one offer of each key, except those in `counted` (keys the request's
        earlier offers counted: they only move to the tracker's recent end); a new key takes
        the place of the least recently offered key not in this offer when the tracker is
        full (and waits when all are)."""
        assert self.offers is not None
        counts = self.offers
        protected = 0
        for key in offered:
            if key in counts:
                counts.move_to_end(key)
                if key not in counted:
                    counts[key] += 1
                protected += 1
        unprotected = len(counts) - protected
        for key in offered:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    def _check_victims(self, victims: Sequence[tuple[OffloadKey, int]], need: int,
                       protected: set[OffloadKey]) -> None:
        """Guard against a policy bug: the victims must be exactly ``need`` idle keys."""
        wrong = {k: self.describe(k) for k, cid in victims
                 if k in protected or self.chunk_id(k) != cid or self._index[k].ref_cnt != 0}
        if wrong or len({k for k, _ in victims}) != need:
            raise ManagerError("prepare_store", f"policy {self._policy.name} returned invalid "
                               f"victims {list(victims)} for {need} slot(s); the policy's "
                               "state is now inconsistent", states=wrong)

    def _allocate(self) -> int:
        """A fresh slot from the bump allocator while any is left, else the most recently
        freed one (vLLM pops its free list from the end)."""
        if self._num_allocated < self.num_chunks:
            self._num_allocated += 1
            return self._num_allocated - 1
        return self._free.pop()

    def _pending(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The distinct keys among ``keys`` that are indexed and write pending, in order."""
        return [k for k in dict.fromkeys(keys) if k in self._index and self._index[k].ref_cnt < 0]

    def _drop_pending(self, keys: Sequence[OffloadKey]) -> list[int]:
        slots: list[int] = []
        for key in keys:
            slots.append(self._index.pop(key).chunk_id)
            self._policy.remove(key)
        self._num_write_pending -= len(keys)
        if keys:
            self._events.append(OffloadingEvent("removed", tuple(keys), metadata_only=True))
        return slots

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext | None,
                       success: bool = True) -> None:
        """Finish a store job. Keys that are absent or already ready are skipped."""
        del ctx
        pending = self._pending(keys)
        if success:
            for key in pending:
                self._index[key].ref_cnt = 0
                self._policy.on_evictable(key, True)
            self._num_write_pending -= len(pending)
            self._num_evictable += len(pending)
            if pending:
                self._events.append(OffloadingEvent("stored", tuple(pending)))
            self.stats["stores_completed"] += len(pending)
        else:
            self._free.extend(self._drop_pending(pending))
            self.stats["stores_failed"] += len(pending)

    def quarantine_store(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Take the write-pending keys of a timed-out store out of the index, keeping their
        slots out of circulation until `release_slots`. Returns the held slot ids."""
        slots = self._drop_pending(self._pending(keys))
        self._quarantined.update(slots)
        self.stats["quarantined"] += len(slots)
        return tuple(slots)

    def release_slots(self, chunk_ids: Sequence[int]) -> None:
        """Return quarantined slots to circulation."""
        bad = [s for s, n in Counter(chunk_ids).items() if s not in self._quarantined or n > 1]
        if bad:
            raise ManagerError("release_slots", "only quarantined slots can be released, once "
                               f"each (quarantined now: {sorted(self._quarantined)})", slots=bad)
        for slot in chunk_ids:
            self._quarantined.remove(slot)
            self._free.append(slot)
        self.stats["released"] += len(chunk_ids)

    # ------------------------------------------------------------------ resets, events
    def reset_cache(self, quarantine: Iterable[int] = ()) -> None:
        """Forget every chunk; every slot, quarantined ones included, is reusable at once,
        except the slots in `quarantine`, which stay quarantined until `release_slots` (a
        secondary tier that may still copy into them: beyond vLLM, whose tiering reset waits
        for every tier, TM:1164-1169). Without `quarantine` the bump allocator restarts at
        slot 0, as vLLM's (M:462-463); with it, every other slot goes on the free list, lowest
        handed out first."""
        held = set(quarantine)
        bad = [s for s in held if not 0 <= s < self.num_chunks]
        if bad:
            raise ManagerError("reset_cache", f"cannot quarantine slots outside [0, "
                               f"{self.num_chunks})", slots=sorted(bad))
        self._index.clear()
        self._policy.clear()
        self._free.clear()
        self._quarantined = held
        self._num_allocated = 0
        if held:
            self._num_allocated = self.num_chunks
            self._free.extend(s for s in reversed(range(self.num_chunks)) if s not in held)
        self._num_evictable = 0
        self._num_write_pending = 0
        self._access.clear()
        self._generation += 1
        self.stats["resets"] += 1

    def on_reset_flushed(self) -> None:
        self.reset_flushed_count += 1

    def take_events(self) -> list[OffloadingEvent]:
        """Detach the events. Bookkeeping-only removals of keys held again are dropped."""
        out: list[OffloadingEvent] = []
        for event in self._events:
            if event.metadata_only:
                keys = tuple(k for k in event.keys if k not in self._index)
                if not keys:
                    continue
                event = OffloadingEvent(event.kind, keys, metadata_only=True)
            out.append(event)
        self._events = []
        return out

    def on_schedule_end(self) -> None:
        """Last call of every scheduler step; nothing to do for this manager."""

    def has_pending_work(self) -> bool:
        return False

    # ------------------------------------------------------------------ invariants
    def check_consistency(self) -> list[str]:
        """Every broken internal invariant, in words; empty when the state is sound."""
        problems: list[str] = []
        n = self.num_chunks
        if not 0 <= self._num_allocated <= n:
            problems.append(f"bump allocator at {self._num_allocated}, outside [0, {n}]")
        owner: dict[int, str] = {}

        def claim(slot: int, what: str) -> None:
            if not 0 <= slot < n:
                problems.append(f"{what} uses slot {slot}, outside [0, {n})")
            elif slot in owner:
                problems.append(f"slot {slot} is both {owner[slot]} and {what}")
            else:
                owner[slot] = what

        for key, chunk in self._index.items():
            if chunk.ref_cnt < -1:
                problems.append(f"key {key} has ref_cnt {chunk.ref_cnt} < -1")
            claim(chunk.chunk_id, f"held by key {key}")
        for slot in self._free:
            claim(slot, "free")
            if slot >= self._num_allocated:
                problems.append(f"free slot {slot} was never handed out by the bump allocator")
        for slot in self._quarantined:
            claim(slot, "quarantined")
            if slot >= self._num_allocated:
                problems.append(f"quarantined slot {slot} was never handed out")
        for slot in range(self._num_allocated, n):
            claim(slot, "unallocated")
        if missing := sorted(set(range(n)) - owner.keys()):
            problems.append(f"slots {missing} are lost (neither free, unallocated, held nor "
                            "quarantined)")
        evictable = sum(1 for c in self._index.values() if c.ref_cnt == 0)
        if evictable != self._num_evictable:
            problems.append(f"evictable count {self._num_evictable} != {evictable} idle ready "
                            "keys")
        pending = sum(1 for c in self._index.values() if c.ref_cnt == -1)
        if pending != self._num_write_pending:
            problems.append(f"write-pending count {self._num_write_pending} != {pending}")
        tracked = self._policy.chunks()
        if tracked != {k: c.chunk_id for k, c in self._index.items()}:
            problems.append(f"policy tracks {sorted(tracked.items())}, index holds "
                            f"{sorted((k, c.chunk_id) for k, c in self._index.items())}")
        problems.extend(self._policy.check_consistency())
        told = self._policy.pinned()
        if told is not None and (busy := {k for k, c in self._index.items()
                                          if c.ref_cnt != 0}) != told:
            problems.append(f"policy takes {sorted(told)} as pinned, the keys not idle are "
                            f"{sorted(busy)}")
        expected_free = len(self._free) + sum(1 for s in owner.values() if s == "unallocated")
        if self.num_free_slots() != expected_free:
            problems.append(f"num_free_slots() {self.num_free_slots()} != {expected_free}")
        return problems
