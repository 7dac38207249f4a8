"""Eviction policies of the CPU offloading manager (reference §4.3).

A policy orders the chunks the manager holds and picks eviction victims. It never decides
whether a chunk is loadable or pinned: the manager owns the reference counts and hands the
policy a ``ref_cnt`` lookup wherever that matters. ``ref_cnt(key) == 0`` means "stored,
readable and not being loaded": the only chunks a policy may evict.

Two policies, as vLLM 0.33.0 ships them:

* `LRUPolicy`: least recently used first. Keys a request inserts share that request's rank
  and, inside it, later positions (tails) go before earlier ones (heads).
* `ARCPolicy`: adaptive replacement cache: T1 (seen once), T2 (seen again), ghost lists B1
  and B2 of recently evicted keys, and an adaptive target size ``p`` for T1.

Three more reproduce earlier releases, so that their managers can be compared call for call:
`InsertionLRUPolicy` is vLLM 0.31.0-0.32.0's LRU (keys ranked by insertion, request order
at the finish); `ReleaseLRUPolicy` and `TouchARCPolicy` are vLLM 0.30.0's LRU and ARC, which
know no requests: LRU ranks a key when it last became idle, ARC moves keys only on `touch`.

Recency from requests comes in two stages, as in vLLM 0.33.0 (reference §4.3):

* provisional, while the request is active: `on_request_access` reports the keys the
  request reads or stores for the first time. LRU raises each to the request's rank at the
  key's position (so an active request's keys sit together, tails before heads); ARC does
  nothing yet.
* committed, when the request finishes: `on_request_finished` replays the request's keys
  head first. LRU gives them fresh ranks, the head becoming the most recent; ARC promotes the
  keys the request found already stored (T1 to T2) and refreshes those it only inserted.

`touch` is an immediate, unscoped use (vLLM's scheduler never calls it).

A *position* is where a key sits in its request: the end token of its chunk (any increasing
number will do). A key without a known position gets no request rank.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Literal, TypeAlias, get_args

from statemachine.errors import ConfigError

OffloadKey: TypeAlias = int
"""One key names one offloaded chunk (the block hash at the chunk's last block)."""

RefCount: TypeAlias = Callable[[OffloadKey], int]
"""The manager's reference count of an indexed key: -1 write pending, >= 0 ready."""

PolicyName: TypeAlias = Literal["lru", "arc", "lru-insertion", "lru-release", "arc-touch"]
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)
"""Every policy `make_policy` builds: ``lru`` and ``arc`` as vLLM 0.33.0 ships them,
``lru-insertion`` as vLLM 0.31.0-0.32.0 ship LRU, ``lru-release`` and ``arc-touch`` as vLLM
0.30.0 ships LRU and ARC."""

__all__ = [
    "POLICY_NAMES",
    "ARCPolicy",
    "EvictionPolicy",
    "InsertionLRUPolicy",
    "LRUPolicy",
    "OffloadKey",
    "PolicyName",
    "RefCount",
    "ReleaseLRUPolicy",
    "TouchARCPolicy",
    "make_policy",
]


class EvictionPolicy(ABC):
    """What the manager needs from an eviction policy.

    The policy tracks exactly the keys of the manager's index, each with its chunk slot.
    """

    name: str = "abstract"

    @abstractmethod
    def insert(self, key: OffloadKey, chunk_id: int, *, request: Hashable | None = None,
               position: int | None = None) -> None:
        """Start tracking a newly allocated (write-pending) chunk.

        ``request`` and ``position`` say which request stored it and at which position of
        that request's chunk sequence; a policy may use them or ignore them.
        """

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Stop tracking ``key`` (a failed or quarantined store). No ghost entry is left."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ref_cnt: RefCount | None = None) -> None:
        """Mark ``keys`` (head first) as just used. ``ref_cnt`` None means every key is ready."""

    def on_evictable(self, key: OffloadKey, evictable: bool) -> None:
        """The tracked ``key`` stopped being idle and ready (inserted write pending, or pinned
        by a load) or became so again (its store completed, its last load ended). A policy
        may use this to skip such keys cheaply; ``evict`` still checks ``ref_cnt``."""
        del key, evictable

    def pinned(self) -> frozenset[OffloadKey] | None:
        """The keys the policy holds as not idle (from ``on_evictable``); None if it keeps
        no such record (for the manager's consistency check)."""
        return None

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` (head first) were offered for storing but are not held (once per request
        and key)."""
        del keys

    def on_request_access(self, keys: Sequence[OffloadKey], positions: Mapping[OffloadKey, int],
                          request: Hashable) -> None:
        """``request`` reads or stores ``keys`` for the first time (provisional recency).

        ``positions`` gives the request's position of each key it knows; the keys need not be
        tracked yet."""
        del keys, positions, request

    @abstractmethod
    def on_request_finished(self, keys_in_order: Sequence[OffloadKey],
                            reused: Collection[OffloadKey],
                            request: Hashable | None = None,
                            inserted: Collection[OffloadKey] | None = None) -> None:
        """A request ended (committed recency). ``keys_in_order`` are the keys it accessed,
        head first; ``reused`` the ones it found already stored (loads and store reuses);
        ``inserted`` the ones it only stored itself. A key in neither was seen but never
        used (an offer that failed to allocate). ``inserted`` None means every key not in
        ``reused``."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey],
              ref_cnt: RefCount) -> list[tuple[OffloadKey, int]] | None:
        """Choose and drop exactly ``n`` victims among keys with ``ref_cnt == 0`` that are not
        in ``protected``; return ``(key, chunk_id)`` pairs, or None (and change nothing) when
        fewer than ``n`` qualify."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (cache reset)."""

    @abstractmethod
    def chunks(self) -> dict[OffloadKey, int]:
        """Every tracked key and its chunk slot (a copy; for consistency checks)."""

    def check_consistency(self) -> list[str]:
        """Internal problems of the policy's own structures; empty when sound."""
        return []

    def __len__(self) -> int:
        return len(self.chunks())

    def __contains__(self, key: object) -> bool:
        return key in self.chunks()


class LRUPolicy(EvictionPolicy):
    """Least recently used first.

    Every key has a rank ``(major, minor)``; the smallest rank is evicted first. A monotonic
    clock hands out majors: fresh ranks ``(tick, 0)`` and *request ranks*. A request's rank
    is one tick, taken the first time the request accesses or inserts anything, and shared
    by all its keys as ``(request_rank, -position)``: within one active request the tail is
    older than the head. A stored key gets its request's rank at insert (a fresh rank when
    its position is unknown); a reused key is raised to it on access, never lowered.
    `touch` and `on_request_finished` hand out fresh ranks from the tail to the head, so the
    head ends up the most recent.

    Equal ranks (which the manager never produces) go in the order the keys started being
    tracked. Eviction pops a heap of ``(rank, order, key)`` entries, so it costs
    O((victims + skipped keys) log n), not O(n): an entry whose key left or was re-ranked
    since it was pushed is stale and dropped as it comes up; the heap is rebuilt when stale
    entries outnumber live ones.
    """

    name = "lru"

    def __init__(self) -> None:
        self._chunks: dict[OffloadKey, int] = {}
        self._rank: dict[OffloadKey, tuple[int, int]] = {}
        self._request_rank: dict[Hashable, int] = {}
        self._clock = 0
        self._order: dict[OffloadKey, int] = {}
        """When each key started being tracked (its place in `_chunks`): breaks rank ties."""
        self._next_order = 0
        self._pinned: set[OffloadKey] = set()
        """Keys the manager said are not idle (write pending, or being loaded): they leave the
        heap until they are idle again, so an eviction never wades through them."""
        self._heap: list[tuple[tuple[int, int], int, OffloadKey]] = []

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _set_rank(self, key: OffloadKey, rank: tuple[int, int]) -> None:
        self._rank[key] = rank
        if key not in self._pinned:
            self._push(key)

    def _push(self, key: OffloadKey) -> None:
        heapq.heappush(self._heap, (self._rank[key], self._order[key], key))
        if len(self._heap) > 2 * (len(self._rank) - len(self._pinned)) + 64:
            self._heap = [(r, self._order[k], k) for k, r in self._rank.items()
                          if k not in self._pinned]
            heapq.heapify(self._heap)

    def on_evictable(self, key: OffloadKey, evictable: bool) -> None:
        if key not in self._chunks:
            return
        if not evictable:
            self._pinned.add(key)  # its heap entries go stale
        elif key in self._pinned:
            self._pinned.discard(key)
            self._push(key)

    def rank(self, key: OffloadKey) -> tuple[int, int]:
        """The key's current rank (smaller is older)."""
        return self._rank[key]

    def request_rank(self, request: Hashable) -> int:
        """The request's rank, taken from the clock on first use."""
        major = self._request_rank.get(request)
        if major is None:
            major = self._request_rank[request] = self._tick()
        return major

    def insert(self, key: OffloadKey, chunk_id: int, *, request: Hashable | None = None,
               position: int | None = None) -> None:
        if key not in self._chunks:
            self._order[key] = self._next_order
            self._next_order += 1
        self._chunks[key] = chunk_id
        if request is not None and position is not None:
            self._set_rank(key, (self.request_rank(request), -position))
        else:
            self._set_rank(key, (self._tick(), 0))

    def on_request_access(self, keys: Sequence[OffloadKey], positions: Mapping[OffloadKey, int],
                          request: Hashable) -> None:
        major = self.request_rank(request)
        for key in keys:
            position = positions.get(key)
            if position is None or key not in self._chunks:
                continue
            rank = (major, -position)
            if self._rank[key] < rank:
                self._set_rank(key, rank)

    def remove(self, key: OffloadKey) -> None:
        self._chunks.pop(key, None)
        self._rank.pop(key, None)
        self._order.pop(key, None)
        self._pinned.discard(key)

    def _refresh(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self._chunks:
                self._set_rank(key, (self._tick(), 0))

    def touch(self, keys: Sequence[OffloadKey], ref_cnt: RefCount | None = None) -> None:
        del ref_cnt
        self._refresh(keys)

    def on_request_finished(self, keys_in_order: Sequence[OffloadKey],
                            reused: Collection[OffloadKey],
                            request: Hashable | None = None,
                            inserted: Collection[OffloadKey] | None = None) -> None:
        del reused, inserted
        self._refresh(keys_in_order)
        if request is not None:
            self._request_rank.pop(request, None)

    def evict(self, n: int, protected: Collection[OffloadKey],
              ref_cnt: RefCount) -> list[tuple[OffloadKey, int]] | None:
        if n <= 0:
            return []
        heap, rank, order, pinned = self._heap, self._rank, self._order, self._pinned
        victims: list[OffloadKey] = []
        taken: list[tuple[tuple[int, int], int, OffloadKey]] = []
        kept: list[tuple[tuple[int, int], int, OffloadKey]] = []
        while heap and len(victims) < n:
            entry = heapq.heappop(heap)
            r, o, key = entry
            if key in pinned or rank.get(key) != r or order.get(key) != o or key in victims:
                continue  # stale: the key left, was pinned or was re-ranked since the push
            if key in protected or ref_cnt(key) != 0:
                kept.append(entry)
            else:
                victims.append(key)
                taken.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)
        if len(victims) < n:
            for entry in taken:
                heapq.heappush(heap, entry)
            return None
        out = [(k, self._chunks[k]) for k in victims]
        for k in victims:
            self.remove(k)
        return out

    def clear(self) -> None:
        self._chunks.clear()
        self._rank.clear()
        self._request_rank.clear()
        self._order.clear()
        self._pinned.clear()
        self._heap.clear()

    def chunks(self) -> dict[OffloadKey, int]:
        return dict(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks

    def check_consistency(self) -> list[str]:
        if set(self._rank) != set(self._chunks):
            return [f"LRU: ranked keys {sorted(set(self._rank) ^ set(self._chunks))} "
                    "differ from tracked keys"]
        if stray := self._pinned - set(self._chunks):
            return [f"LRU: untracked keys {sorted(stray)} marked pinned"]
        live = {(r, self._order[k], k) for k, r in self._rank.items() if k not in self._pinned}
        if not live <= set(self._heap):
            return ["LRU: an unpinned key's rank is missing from the eviction heap"]
        return []

    def pinned(self) -> frozenset[OffloadKey]:
        return frozenset(self._pinned)


class InsertionLRUPolicy(LRUPolicy):
    """LRU as vLLM 0.31.0-0.32.0 ship it: every insert takes a fresh rank (insertion order,
    vllm/v1/kv_offload/cpu/policies/lru.py:76-83 at v0.31.0), and an active request's reads
    leave ranks alone; a request's order counts only at its finish, when its keys are
    refreshed from the tail to the head as in `LRUPolicy` (lru.py:95-104 at v0.31.0).
    vLLM 0.33.0 replaced it with request ranks (`LRUPolicy`).
    """

    name = "lru-insertion"

    def insert(self, key: OffloadKey, chunk_id: int, *, request: Hashable | None = None,
               position: int | None = None) -> None:
        del request, position
        super().insert(key, chunk_id)

    def on_request_access(self, keys: Sequence[OffloadKey], positions: Mapping[OffloadKey, int],
                          request: Hashable) -> None:
        del keys, positions, request


class ReleaseLRUPolicy(LRUPolicy):
    """LRU as vLLM 0.30.0 ships it: a list of the idle chunks only, a chunk appended when it
    becomes idle (its store completes, its last load ends) and taken out while it is not
    (vllm/v1/kv_offload/cpu/policies/lru.py:32-35 and 81-90 at v0.30.0). `touch` moves the idle
    keys it names to the recent end, the head last (lru.py:43-48); a key not idle is left
    alone, and gets its fresh rank when it becomes idle. Requests play no part: that
    release's manager has no `on_request_finished` of its own and reports no accesses.
    """

    name = "lru-release"

    def insert(self, key: OffloadKey, chunk_id: int, *, request: Hashable | None = None,
               position: int | None = None) -> None:
        del request, position
        super().insert(key, chunk_id)   # write pending: ranked again when it becomes idle

    def on_evictable(self, key: OffloadKey, evictable: bool) -> None:
        if evictable and key in self._chunks:
            self._pinned.discard(key)
            self._set_rank(key, (self._tick(), 0))
        else:
            super().on_evictable(key, evictable)

    def on_request_access(self, keys: Sequence[OffloadKey], positions: Mapping[OffloadKey, int],
                          request: Hashable) -> None:
        del keys, positions, request

    def on_request_finished(self, keys_in_order: Sequence[OffloadKey],
                            reused: Collection[OffloadKey],
                            request: Hashable | None = None,
                            inserted: Collection[OffloadKey] | None = None) -> None:
        del keys_in_order, reused, request, inserted


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache.

    * T1 holds keys seen once, T2 keys used again; each is ordered LRU first.
    * B1/B2 remember keys recently evicted from T1/T2 (keys only, at most ``capacity`` each).
    * A ghost hit in B1 grows the target ``p`` of T1, one in B2 shrinks it, and moves the
      ghost to the MRU end of its list.
    * `evict` takes from T1 while ``|T1| >= int(p)``, else from T2, falling back to the other
      list when the preferred one has no eligible key.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p: float = 0.0
        self.t1: OrderedDict[OffloadKey, int] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, int] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, key: OffloadKey, chunk_id: int, *, request: Hashable | None = None,
               position: int | None = None) -> None:
        del request, position
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        self.t2.pop(key, None)
        self.t1[key] = chunk_id
        self.t1.move_to_end(key)

    def remove(self, key: OffloadKey) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def _ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            self.b2.move_to_end(key)

    def _promote(self, key: OffloadKey) -> None:
        self.t2[key] = self.t1.pop(key)

    def touch(self, keys: Sequence[OffloadKey], ref_cnt: RefCount | None = None) -> None:
        for key in reversed(keys):
            if key in self.t1:
                if ref_cnt is None or ref_cnt(key) >= 0:
                    self._promote(key)
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):       # tail first, as touch: the order moves ghosts and p
            self._ghost_hit(key)

    def on_request_finished(self, keys_in_order: Sequence[OffloadKey],
                            reused: Collection[OffloadKey],
                            request: Hashable | None = None,
                            inserted: Collection[OffloadKey] | None = None) -> None:
        del request
        for key in reversed(keys_in_order):
            if key in reused:            # one frequency hit: T1 -> T2, or T2's MRU end
                if key in self.t1:
                    self._promote(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif inserted is None or key in inserted:   # a store is no hit: refresh in place
                for lst in (self.t1, self.t2):
                    if key in lst:
                        lst.move_to_end(key)

    def evict(self, n: int, protected: Collection[OffloadKey],
              ref_cnt: RefCount) -> list[tuple[OffloadKey, int]] | None:
        if n <= 0:
            return []

        def eligible(lst: OrderedDict[OffloadKey, int]) -> Iterator[OffloadKey]:
            return (k for k in lst if k not in protected and ref_cnt(k) == 0)

        # Simulate the choices first; commit only when all n victims were found.
        from_t1, from_t2 = eligible(self.t1), eligible(self.t2)
        chosen: list[tuple[OffloadKey, bool]] = []   # (key, taken from T1)
        t1_size = len(self.t1)
        for _ in range(n):
            prefer_t1 = t1_size >= int(self.p)
            order = ((from_t1, True), (from_t2, False))
            if not prefer_t1:
                order = order[::-1]
            for source, is_t1 in order:
                key = next(source, None)
                if key is not None:
                    chosen.append((key, is_t1))
                    if is_t1:
                        t1_size -= 1
                    break
            else:
                return None
        out: list[tuple[OffloadKey, int]] = []
        for key, is_t1 in chosen:
            if is_t1:
                out.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                out.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return out

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.p = 0.0

    def chunks(self) -> dict[OffloadKey, int]:
        return {**self.t1, **self.t2}

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def check_consistency(self) -> list[str]:
        problems: list[str] = []
        live = self.t1.keys() | self.t2.keys()
        if both := self.t1.keys() & self.t2.keys():
            problems.append(f"ARC: keys {sorted(both)} in both T1 and T2")
        if ghosts := (self.b1.keys() | self.b2.keys()) & live:
            problems.append(f"ARC: keys {sorted(ghosts)} are both live and ghosts")
        if len(self.b1) > self.capacity or len(self.b2) > self.capacity:
            problems.append(f"ARC: ghost lists |B1|={len(self.b1)} |B2|={len(self.b2)} exceed "
                            f"capacity {self.capacity}")
        if not 0.0 <= self.p <= self.capacity:
            problems.append(f"ARC: target p={self.p} outside [0, {self.capacity}]")
        return problems


class TouchARCPolicy(ARCPolicy):
    """ARC as vLLM 0.30.0 ships it: keys move between and within T1 and T2 only on `touch`
    (vllm/v1/kv_offload/cpu/policies/arc.py:75-99 at v0.30.0); a request's finish and a store of
    keys not held (ghost hits in vLLM 0.33.0) leave the lists and ``p`` alone.
    """

    name = "arc-touch"

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        del keys

    def on_request_finished(self, keys_in_order: Sequence[OffloadKey],
                            reused: Collection[OffloadKey],
                            request: Hashable | None = None,
                            inserted: Collection[OffloadKey] | None = None) -> None:
        del keys_in_order, reused, request, inserted


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (one of `POLICY_NAMES`) for a cache of ``capacity`` chunks.

    Raises `ConfigError` for any other name.
    """
    if name == "lru":
        return LRUPolicy()
    if name == "lru-insertion":
        return InsertionLRUPolicy()
    if name == "lru-release":
        return ReleaseLRUPolicy()
    if name == "arc-touch":
        return TouchARCPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ConfigError(f"unknown eviction policy {name!r}; expected one of "
                      f"{', '.join(map(repr, POLICY_NAMES))}")
