"""The core stand-ins' GPU block pool (`statemachine.core.BlockPool`) against the plain FIFO
free list it stands for (vLLM's free block queue: the first block freed is the first
reused): the same ids in the same order after any allocations and frees, and the same
refusals."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statemachine.core import BlockPool, CoreError


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(0, 12), first=st.integers(0, 3),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 30)),
                    max_size=40))
def test_the_pool_hands_out_and_takes_back_as_a_fifo_free_list(
        num_blocks: int, first: int, ops: list[tuple[bool, int, int]]) -> None:
    pool = BlockPool(num_blocks, first)
    free = deque(range(first, first + num_blocks))
    held: list[int] = []
    for allocate, n, pick in ops:
        if allocate:
            if n > len(free):
                with pytest.raises(CoreError, match=f"allocate {n} blocks with {len(free)}"):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                assert got == [free.popleft() for _ in range(n)]
                held.extend(got)
        elif held:
            block = held.pop(pick % len(held))
            pool.free([block])
            free.append(block)
        else:  # nothing held: any id is free already or out of range
            with pytest.raises(CoreError, match="freed twice"):
                pool.free([first + pick % (num_blocks + 2)])
        assert list(pool) == list(free) and len(pool) == len(free)
        assert all(b in pool for b in free)
        assert not any(b in pool for b in held)
    assert "0" not in pool  # ids are ints


class _IntLike:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_a_pool_of_a_million_blocks_answers_at_its_edges() -> None:
    pool = BlockPool(1 << 20)
    assert len(pool) == 1 << 20 and pool.allocate(2) == [0, 1]
    pool.free([0])
    assert 0 in pool and 1 not in pool and (1 << 20) - 1 in pool and 1 << 20 not in pool
    assert len(pool) == (1 << 20) - 1
    assert _IntLike(5) in pool and _IntLike(1) not in pool  # an id as numpy or torch holds it
    with pytest.raises(CoreError, match="freed twice"):
        pool.free([0])
    with pytest.raises(CoreError, match="out of range"):
        pool.free([1 << 20])
