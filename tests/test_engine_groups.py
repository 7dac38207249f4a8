"""The engine with several KV cache groups: per-group block tables from one pool, the core
freeing sliding-window blocks as the window moves, the fence that protects a store reading
them, a load that starts inside a chunk, and the bytes of every group checked."""

from __future__ import annotations

import pytest

from spec.groups import NULL_BLOCK, skipped_blocks
from statemachine.config import KVCacheGroup
from statemachine.engine import Engine, EngineConfig, EngineError
from statemachine.errors import ConfigError
from statemachine.mutants import by_name
from statemachine.oracle import CorruptedBytes

WINDOW = 10  # tokens: 2.5 blocks of 4


def hybrid_engine(num_gpu_blocks: int = 14, check_invariants: bool = True) -> Engine:
    return Engine(EngineConfig(
        block_size=4, blocks_per_chunk=2, num_gpu_blocks=num_gpu_blocks, num_cpu_chunks=32,
        num_workers=1, num_layers=1, bytes_per_token=2, max_num_batched_tokens=64,
        groups=(KVCacheGroup(), KVCacheGroup("sliding", sliding_window=WINDOW)),
        group_bytes_per_token=(2, 3), check_invariants=check_invariants, device="cpu"))


PROMPT = list(range(100, 124))  # 24 tokens: 6 blocks, 3 chunks


def test_a_window_leaves_blocks_behind_and_the_store_reading_them_is_flushed() -> None:
    e = hybrid_engine()
    assert [len(t) for t in (e.workers[0].gpu)] == [14, 14]
    assert [t.shape[1] for t in e.workers[0].gpu] == [8, 12]  # a page size per group
    e.add_request("a", PROMPT, 2)
    first = e.step()
    a = e.requests["a"]
    (store,) = first.meta.store_jobs.values()
    assert store.src.group_sizes == (6, 6) and store.src.block_indices == (0, 0)
    # only the window's sources are fenced at the store's creation (S:2068-2069)
    assert set(e.scheduler.block_fence) == set(store.src.block_ids[6:])
    # the core freed the window group's blocks before the window of token 24
    gone = skipped_blocks(WINDOW, 4, 24)
    assert gone == 3 and a.tables[1][:3] == [NULL_BLOCK] * 3
    assert NULL_BLOCK not in a.tables[0] and len(e.free_blocks) == 14 - 12 + 3
    assert e.group_stats[1]["blocks_freed_before_window"] == 3
    assert e.group_stats[0]["blocks_freed_before_window"] == 0
    freed = list(store.src.block_ids[6:9])
    # a's next block takes 12 and 13; b gets two of the freed ones: the connector flushes
    # a's store before the forward pass writes b's bytes there
    assert list(e.free_blocks) == [12, 13, *freed]
    e.add_request("b", [7, 8, 9, 10], 1)
    second = e.step()
    assert 0 in second.meta.jobs_to_flush
    e.run_until_idle()
    assert e.group_stats[1]["stored_blocks_verified"] == 6  # a's store, every window block
    assert all(v == 0 for v in e.leaks().values())


def test_without_the_window_fence_the_bytes_are_caught() -> None:
    with by_name("sliding-window-skips-fence").patch():
        e = hybrid_engine(check_invariants=False)
        e.add_request("a", PROMPT, 2)
        e.step()
        e.add_request("b", [7, 8, 9, 10], 1)
        with pytest.raises(CorruptedBytes, match="stored block of request 'a'") as caught:
            e.run_until_idle()
        e.shutdown()
    assert caught.value.layer == 1  # the window group's tensor


def test_a_hit_loads_the_window_from_inside_a_chunk() -> None:
    e = hybrid_engine(num_gpu_blocks=40)
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    e.add_request("c", [*PROMPT, 1, 2, 3, 4], 1)
    step = e.step()
    (load,) = step.meta.load_jobs.values()
    # full attention loads every block of the 24-token hit; the window group only those
    # from its window on: block 3, the second of chunk 1 (a first-chunk skip of one)
    assert load.dst.group_sizes == (6, 3) and load.dst.block_indices == (0, 3)
    assert len(load.src.chunk_ids) == 3 + 2
    c = e.requests["c"]
    assert c.tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in c.tables[1][3:]
    e.run_until_idle()
    assert e.group_stats[1]["loaded_blocks_verified"] == 3
    assert e.group_stats[0]["loaded_blocks_verified"] == 6
    assert all(v == 0 for v in e.leaks().values())


def test_a_load_into_the_wrong_sub_block_is_caught_in_the_window_group() -> None:
    e = hybrid_engine(num_gpu_blocks=40)
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    with by_name("kernel-ignores-first-chunk-skip").patch():
        e.add_request("c", [*PROMPT, 1, 2, 3, 4], 1)
        with pytest.raises(CorruptedBytes, match="loaded block of request 'c'") as caught:
            e.run_until_idle()
    e.shutdown()
    assert caught.value.layer == 1 and caught.value.block_index == 3


def test_engine_config_errors() -> None:
    with pytest.raises(ConfigError, match="group_bytes_per_token must be empty or one int"):
        EngineConfig(groups=(KVCacheGroup(), KVCacheGroup("sliding", 8)),
                     group_bytes_per_token=(2,))
    with pytest.raises(ConfigError, match="a sliding-window group needs sliding_window"):
        EngineConfig(groups=(KVCacheGroup("sliding"),))
    e = hybrid_engine()
    with pytest.raises(EngineError, match="needs up to 16 GPU blocks over its 2 KV cache groups"):
        e.add_request("long", list(range(30)), 2)
    e.shutdown()


# The soak's hybrid program 299 of data-plane seed 9, shrunk: a request whose sync load hangs
# (worker 1) is aborted after the window has moved past some of the load's destinations; the
# core freed those at the step's end and re-allocates one to a new request whose store reads
# it. The projection used to count every destination of the finished request's load as still
# held, so INV-15 called that store's source a re-allocated block.
SOAK_HYBRID_299 = (
    ("new_request", {"family": 1, "tokens": 11, "max_tokens": 1}),
    ("new_request", {"family": 1, "tokens": 7, "max_tokens": 5}),
    ("new_request", {"family": 1, "tokens": 16, "max_tokens": 4}),
    ("new_request", {"family": 2, "tokens": 5, "max_tokens": 4}),
    ("new_request", {"family": 1, "tokens": 12, "max_tokens": 5}),
    ("new_request", {"family": 1, "tokens": 15, "max_tokens": 1}),
    ("step", {}),
    ("new_request", {"family": 1, "tokens": 19, "max_tokens": 5}),
    ("step", {}), ("step", {}),
    ("reset", {"running": True}),
    ("new_request", {"family": 0, "tokens": 12, "max_tokens": 4}),
    ("step", {}), ("step", {}),
    ("abort_request", {"req_id": "q8"}),
    ("worker_hang", {"worker": 1}),
    ("new_request", {"family": 0, "tokens": 15, "max_tokens": 6}),
    ("new_request", {"family": 0, "tokens": 19, "max_tokens": 6}),
)


def test_a_finished_request_does_not_hold_load_destinations_its_window_left() -> None:
    """Soak finding (hybrid data plane): the program runs to its end with every invariant
    checked after every transition and the engine drained clean."""
    from statemachine.soak import _run_actions
    from statemachine.testing import HybridDataPlaneStateMachine

    taken, exc = _run_actions(list(SOAK_HYBRID_299), machine=HybridDataPlaneStateMachine)
    assert exc is None, f"{type(exc).__name__}: {exc}"
    assert len(taken) == len(SOAK_HYBRID_299)


def _short_hit_after_a_partial_chunk(check_invariants: bool = True) -> Engine:
    """a (20 tokens, window 5 = one block and a token) computes 16 tokens; a reset puts its
    store cursor back, and its next store finds chunk 1 without block 2 (the window left
    it behind). b, the same prompt, hits 15 tokens (one short of a block edge): its window
    reads blocks 2 and 3, both from chunk 1."""
    e = Engine(EngineConfig(
        block_size=4, blocks_per_chunk=2, num_gpu_blocks=40, num_cpu_chunks=32,
        num_workers=1, num_layers=1, bytes_per_token=2, max_num_batched_tokens=16,
        groups=(KVCacheGroup(), KVCacheGroup("sliding", sliding_window=5)),
        group_bytes_per_token=(2, 3), check_invariants=check_invariants, device="cpu"))
    prompt = list(range(100, 120))
    e.add_request("a", prompt, 8)
    assert e.step().scheduled == {"a": 16}
    e.reset_prefix_cache()
    after = e.step()
    ((_, store),) = after.meta.store_jobs.items()
    e.stats["window_blocks_stored_after_reset"] = store.src.group_sizes[1]
    for _ in range(3):
        e.step()
    e.add_request("b", prompt, 2)
    return e


def test_a_chunk_without_the_block_a_short_hit_reads_is_not_stored() -> None:
    """The spec's mask counts the block a hit one token short of a block edge reads (need
    2 blocks of 4 for a 5-token window): chunk 1 lacks block 2, so it is not stored, and b
    recomputes its window instead of loading bytes nobody wrote."""
    e = _short_hit_after_a_partial_chunk()
    assert e.stats["window_blocks_stored_after_reset"] == 0
    e.run_until_idle()
    assert e.group_stats[1]["loaded_blocks_verified"] == 0
    assert all(v == 0 for v in e.leaks().values())
    e.shutdown()


def test_vllms_mask_lets_a_short_hit_load_unwritten_bytes() -> None:
    """vLLM's mask (finding F4) needs 1 block for that window: chunk 1 is stored with
    block 3 alone, b's lookup hits it, and its load of block 2 reads a sub-block no store
    wrote. The byte oracle catches it."""
    with by_name("store-mask-ignores-short-hits").patch():
        e = _short_hit_after_a_partial_chunk(check_invariants=False)
        assert e.stats["window_blocks_stored_after_reset"] == 1
        with pytest.raises(CorruptedBytes, match="loaded block of request 'b'") as caught:
            e.run_until_idle()
        e.shutdown()
    assert caught.value.layer == 1 and caught.value.block_index == 2


def test_a_window_on_every_layer_at_retention_0_loads_its_tail_alone() -> None:
    """A sliding window on every layer at vLLM's default retention (0), a 40-token prompt
    (5 chunks of 2 blocks): a's store writes only the chunks the tail of its replay
    boundary reads (chunks 2 and 3: blocks 4-7), never chunks 0 and 1, which no prefix scan
    needs here. c (the same prompt) hits on those two alone and loads them from inside
    chunk 2 (positions 5-7; 0-4 null), and the byte oracle checks every block it loads."""
    e = Engine(EngineConfig(
        block_size=4, blocks_per_chunk=2, num_gpu_blocks=40, num_cpu_chunks=32,
        num_workers=1, num_layers=1, bytes_per_token=2, max_num_batched_tokens=64,
        groups=(KVCacheGroup("sliding", sliding_window=WINDOW),), retention_interval=0,
        device="cpu"))
    prompt = list(range(100, 140))
    e.add_request("a", prompt, 1)
    (store,) = e.step().meta.store_jobs.values()
    assert store.src.first_block_index == 4 and len(store.src.block_ids) == 4
    e.run_until_idle()
    e.add_request("c", prompt, 1)
    (load,) = e.step().meta.load_jobs.values()
    assert load.src.chunk_ids == store.dst.chunk_ids
    assert load.dst.first_block_index == 5 and len(load.dst.block_ids) == 3
    assert e.requests["c"].tables[0][:5] == [NULL_BLOCK] * 5
    e.run_until_idle()
    assert e.group_stats[0]["loaded_blocks_verified"] == 3
    assert e.stats["loads_inside_a_chunk"] == 1  # position 5: chunk 2's second block
    assert all(v == 0 for v in e.leaks().values())
