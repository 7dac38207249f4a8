"""Eviction policies of the CPU offloading manager (statemachine.policies)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine.errors import ConfigError
from statemachine.policies import (
    POLICY_NAMES,
    ARCPolicy,
    EvictionPolicy,
    InsertionLRUPolicy,
    LRUPolicy,
    OffloadKey,
    ReleaseLRUPolicy,
    TouchARCPolicy,
    make_policy,
)


def idle(key: OffloadKey) -> int:
    del key
    return 0


def refs(counts: dict[OffloadKey, int]) -> Callable[[OffloadKey], int]:
    return lambda key: counts.get(key, 0)


def fill(policy: EvictionPolicy, keys: list[OffloadKey], request: str | None = None) -> None:
    for pos, key in enumerate(keys):
        policy.insert(key, chunk_id=100 + key, request=request,
                      position=pos if request is not None else None)


# ---------------------------------------------------------------------------- LRU
def test_lru_evicts_oldest_insert_first_without_request_positions() -> None:
    lru = LRUPolicy()
    fill(lru, [1, 2, 3])
    assert lru.evict(2, set(), idle) == [(1, 101), (2, 102)]
    assert 3 in lru and 1 not in lru and len(lru) == 1


def test_lru_within_a_request_tails_go_before_heads() -> None:
    lru = LRUPolicy()
    fill(lru, [10, 11, 12, 13], request="r1")
    fill(lru, [20], request="r2")          # a later request: more recent than all of r1
    victims = lru.evict(5, set(), idle)
    assert victims is not None
    assert [k for k, _ in victims] == [13, 12, 11, 10, 20]


def test_lru_touch_and_finish_make_the_head_most_recent() -> None:
    lru = LRUPolicy()
    fill(lru, [1, 2, 3, 4])
    lru.touch([2, 1])                       # 2 is the head: most recent of the two
    victims = lru.evict(4, set(), idle)
    assert victims is not None
    assert [k for k, _ in victims] == [3, 4, 1, 2]

    lru = LRUPolicy()
    fill(lru, [5, 6, 7], request="r")
    fill(lru, [9])
    lru.on_request_finished([5, 6, 7], reused=(), request="r")
    victims = lru.evict(4, set(), idle)
    assert victims is not None
    assert [k for k, _ in victims] == [9, 7, 6, 5]
    assert lru.check_consistency() == []


def test_insertion_lru_ranks_an_active_requests_keys_by_insertion() -> None:
    """vLLM 0.31.0-0.32.0: inserts and accesses of an active request keep insertion order
    (the head, inserted first, goes first); the finish refreshes tail to head, as LRU."""
    lru = InsertionLRUPolicy()
    fill(lru, [10, 11, 12], request="r1")
    fill(lru, [20], request="r2")
    lru.on_request_access([20], {20: 0}, "r2")    # no raise: 20 stays the newest anyway
    lru.on_request_access([10], {10: 5}, "r3")    # no raise: 10 stays the oldest
    victims = lru.evict(4, set(), idle)
    assert victims is not None and [k for k, _ in victims] == [10, 11, 12, 20]

    lru = InsertionLRUPolicy()
    fill(lru, [5, 6, 7], request="r")
    fill(lru, [9])
    lru.on_request_finished([5, 6, 7], reused=(), request="r")
    victims = lru.evict(4, set(), idle)
    assert victims is not None and [k for k, _ in victims] == [9, 7, 6, 5]
    assert lru.check_consistency() == []
    assert make_policy("lru-insertion", 4).name == "lru-insertion"


def test_release_lru_ranks_a_key_when_it_last_became_idle() -> None:
    """vLLM 0.30.0: the order is the order in which keys became idle (store completed, last
    load ended); requests count for nothing and a touch moves only idle keys."""
    lru = ReleaseLRUPolicy()
    for key in (1, 2, 3):                      # inserted write pending, in this order
        lru.insert(key, 100 + key, request="r", position=key)
        lru.on_evictable(key, False)
    for key in (3, 1, 2):                      # their stores complete in another
        lru.on_evictable(key, True)
    lru.on_request_access([3], {3: 9}, "r")    # no request ranks ...
    lru.on_request_finished([1, 2, 3], reused={1}, request="r")   # ... and no commit
    assert sorted((1, 2, 3), key=lru.rank) == [3, 1, 2]
    lru.on_evictable(3, False)                 # a load pins 3; the touch leaves it alone,
    lru.touch([1, 3])                          # 1 becomes the newest idle key
    assert sorted((1, 2), key=lru.rank) == [2, 1]
    lru.on_evictable(3, True)                  # the load ends: 3 is the newest
    victims = lru.evict(3, set(), idle)
    assert victims is not None and [k for k, _ in victims] == [2, 1, 3]
    assert lru.check_consistency() == []
    assert make_policy("lru-release", 4).name == "lru-release"


def test_lru_rank_of_request_is_fixed_at_its_first_insert() -> None:
    lru = LRUPolicy()
    fill(lru, [1], request="r")
    fill(lru, [2])
    lru.insert(3, 103, request="r", position=1)   # joins r's (older) rank
    assert lru.rank(3) < lru.rank(2)
    victims = lru.evict(1, set(), idle)
    assert victims == [(3, 103)]


# ---------------------------------------------------------------------------- ARC
def test_arc_touch_of_a_ready_t1_key_promotes_it_to_t2() -> None:
    arc = ARCPolicy(capacity=4)
    fill(arc, [1, 2, 3])
    arc.touch([2], refs({}))
    assert list(arc.t1) == [1, 3] and list(arc.t2) == [2]
    arc.touch([1], refs({1: -1}))            # write pending: stays in T1, moved to its MRU end
    assert list(arc.t1) == [3, 1] and list(arc.t2) == [2]
    arc.touch([2])                           # already in T2: stays there
    assert list(arc.t2) == [2]


def test_arc_request_finish_promotes_reused_and_refreshes_inserted() -> None:
    arc = ARCPolicy(capacity=8)
    fill(arc, [1, 2, 3, 4])
    arc.on_request_finished([1, 2], reused={2})
    assert list(arc.t2) == [2]
    assert list(arc.t1) == [3, 4, 1]


def test_touch_arc_moves_keys_on_touch_only() -> None:
    """vLLM 0.30.0: a request's finish and a store of keys not held change nothing; touch
    works as in `ARCPolicy`."""
    arc = TouchARCPolicy(capacity=2)
    fill(arc, [1, 2, 3])
    assert arc.evict(1, set(), idle) == [(1, 101)]          # 1 becomes a B1 ghost
    arc.on_request_finished([2, 3], reused={2})
    arc.on_store_miss([1])
    assert (list(arc.t1), list(arc.t2), list(arc.b1), arc.p) == ([2, 3], [], [1], 0.0)
    arc.touch([1, 2])                                        # a ghost hit and a promotion
    assert (list(arc.t1), list(arc.t2), arc.p) == ([3], [2], 1.0)
    assert make_policy("arc-touch", 2).name == "arc-touch"


def test_arc_evicts_from_t1_while_it_is_at_least_p_and_remembers_ghosts() -> None:
    arc = ARCPolicy(capacity=4)
    fill(arc, [1, 2, 3, 4])
    arc.touch([3, 4])
    assert list(arc.t1) == [1, 2] and set(arc.t2) == {3, 4}
    victims = arc.evict(1, set(), idle)       # p = 0 <= |T1|: from T1, LRU first
    assert victims == [(1, 101)]
    assert list(arc.b1) == [1] and not arc.b2


def test_arc_ghost_hits_adapt_p_in_both_directions() -> None:
    arc = ARCPolicy(capacity=4)
    fill(arc, [1, 2, 3, 4])
    arc.touch([3, 4])                         # T1 = [1, 2], T2 = [4, 3]
    assert arc.evict(1, set(), idle) == [(1, 101)]       # -> B1
    arc.on_store_miss([1])                    # B1 hit: p grows by max(1, |B2|/|B1|) = 1
    assert arc.p == 1.0
    arc.insert(1, 101)                        # re-inserted: leaves the ghost list
    assert 1 not in arc.b1 and 1 in arc.t1
    # |T1| = 2 >= int(p) = 1: still T1 first. Raise p above |T1| to switch to T2.
    arc.p = 3.0
    victims = arc.evict(1, set(), idle)
    assert victims is not None and victims[0][0] in (3, 4) and victims[0][0] in arc.b2
    ghost = victims[0][0]
    arc.touch([ghost])                        # B2 hit through touch: p shrinks
    assert arc.p == 2.0
    assert arc.check_consistency() == []


def test_arc_falls_back_to_the_other_list_and_trims_ghosts() -> None:
    arc = ARCPolicy(capacity=2)
    fill(arc, [1, 2])
    arc.p = 2.0      # first pick: |T1| = 2 >= 2, T1; second: |T1| = 1 < 2, T2 empty, fallback
    assert arc.evict(2, set(), idle) == [(1, 101), (2, 102)]
    fill(arc, [3, 4])
    assert arc.evict(2, set(), idle) is not None
    assert len(arc.b1) == 2 and list(arc.b1) == [3, 4]


# ---------------------------------------------------------------------------- both
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_evict_never_picks_pinned_pending_or_protected_keys(name: str) -> None:
    policy = make_policy(name, 8)
    fill(policy, [1, 2, 3, 4, 5])
    counts = {1: 2, 2: -1}
    victims = policy.evict(2, {3}, refs(counts))
    assert victims is not None and sorted(k for k, _ in victims) == [4, 5]
    assert set(policy.chunks()) == {1, 2, 3}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_evict_is_atomic_when_too_few_keys_qualify(name: str) -> None:
    policy = make_policy(name, 8)
    fill(policy, [1, 2, 3, 4])
    policy.touch([2])
    before = policy.chunks()
    snapshot = (list(policy.t1), list(policy.t2), list(policy.b1), policy.p) \
        if isinstance(policy, ARCPolicy) else None
    assert policy.evict(3, {1}, refs({2: 1})) is None
    assert policy.chunks() == before
    if isinstance(policy, ARCPolicy):
        assert (list(policy.t1), list(policy.t2), list(policy.b1), policy.p) == snapshot
    assert policy.evict(0, set(), idle) == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_and_clear(name: str) -> None:
    policy = make_policy(name, 4)
    fill(policy, [1, 2])
    policy.remove(1)
    policy.remove(99)                         # unknown: no effect
    assert policy.chunks() == {2: 102}
    policy.clear()
    assert policy.chunks() == {} and len(policy) == 0
    assert policy.evict(1, set(), idle) is None


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="fifo"):
        make_policy("fifo", 4)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES),
       ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(-1, 2)),
                    max_size=40))
def test_random_operations_keep_evict_exact_and_safe(
        name: str, ops: list[tuple[int, int, int]]) -> None:
    policy = make_policy(name, 6)
    counts: dict[OffloadKey, int] = {}
    for op, key, ref in ops:
        if op == 0 and key not in counts:
            policy.insert(key, key)
            counts[key] = ref
        elif op == 1:
            policy.touch([key], refs(counts))
        elif op == 2 and key in counts:
            policy.remove(key)
            del counts[key]
        elif op == 3:
            protected = {key}
            eligible = {k for k, r in counts.items() if r == 0 and k not in protected}
            n = ref + 1
            victims = policy.evict(n, protected, refs(counts))
            if n > len(eligible):
                assert victims is None
            else:
                assert victims is not None and len(victims) == n
                assert {k for k, _ in victims} <= eligible
                for k, cid in victims:
                    assert cid == k
                    del counts[k]
        assert set(policy.chunks()) == set(counts)
        assert policy.check_consistency() == []


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7),
                              st.sampled_from([None, "a", "b"]), st.integers(-1, 3)),
                    max_size=60))
def test_lru_evicts_the_smallest_ranks_first_ties_in_tracking_order(
        ops: list[tuple[int, int, str | None, int]]) -> None:
    """Eviction order is exactly: the eligible keys sorted by rank, equal ranks in the order
    the keys started being tracked (what a full scan sorted by rank gives)."""
    lru = LRUPolicy()
    counts: dict[OffloadKey, int] = {}
    for op, key, request, arg in ops:
        if op == 0:
            lru.insert(key, key, request=request, position=None if arg < 0 else arg % 2)
            counts[key] = 0 if arg >= 0 else -1
        elif op == 1:
            lru.touch([key, (key + 1) % 8])
        elif op == 2:
            lru.on_request_finished([key], (), request)
        elif op == 3 and key in counts:
            lru.remove(key)
            del counts[key]
        elif op == 4 and key in counts:
            counts[key] = arg
        elif op == 5:
            n = arg + 1
            eligible = [k for k in lru.chunks() if counts[k] == 0 and k != key]
            expected = sorted(eligible, key=lru.rank)[:n]
            victims = lru.evict(n, {key}, refs(counts))
            if len(eligible) < n:
                assert victims is None
            else:
                assert victims is not None and [k for k, _ in victims] == expected
                for k in expected:
                    del counts[k]
        assert lru.check_consistency() == []
