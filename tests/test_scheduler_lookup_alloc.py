"""on_new_request, get_num_new_matched_tokens, update_state_after_alloc (S:1197-1500)."""

from __future__ import annotations

import pytest

from spec import request as R
from statemachine.errors import IllegalTransition, InvalidArgument, UnknownRequest
from statemachine.messages import Request
from tests.driver import Driver, block_hashes


def stored(d: Driver, rid: str, tokens: int, family: int = 0) -> None:
    """Run `rid` once and ack its stores, so its chunks are in the CPU cache."""
    d.add(rid, tokens, family)
    _, _, meta = d.admit(rid)
    d.ack_all(meta.store_jobs)
    d.finish(rid)
    d.build(finished=[rid])


def test_new_request_is_idle_and_a_second_add_is_illegal() -> None:
    d = Driver.make()
    d.add("a", 40)
    assert d.state("a") == R.IDLE
    with pytest.raises(IllegalTransition, match="'a' in state IDLE: trigger 'add'"):
        d.s.on_new_request(d.reqs["a"])


def test_invalid_transfer_params_are_ignored_and_counted() -> None:
    d = Driver.make()
    tokens = list(range(40))
    req = Request("p", tokens, block_hashes=block_hashes(tokens, 16),
                  kv_transfer_params={"max_load_tokens": -1, "max_offload_tokens": 16})
    d.s.on_new_request(req)
    assert d.s.requests["p"].max_offload_tokens == 16
    assert d.s.requests["p"].max_load_tokens is None
    assert d.s.stats["ignored_transfer_params"] == 1


def test_miss_returns_zero_and_hit_returns_whole_blocks_leaving_a_token() -> None:
    d = Driver.make(blocks_per_chunk=2)  # 32 tokens per chunk
    stored(d, "a", 100)  # chunks 0..2 stored (96 tokens)
    d.add("b", 100)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (96, True)
    # a hit must leave the last token's block to compute: it ends inside chunk 2, which is
    # loaded in part (vLLM 0.33.0 answers 80 too, with the LAST-TOKEN-BOUND)
    d.add("c", 96)
    assert d.s.get_num_new_matched_tokens(d.reqs["c"], 0) == (80, True)
    d.add("x", 100, family=1)
    assert d.s.get_num_new_matched_tokens(d.reqs["x"], 0) == (0, False)


def test_local_prefix_hit_counts_from_its_chunk() -> None:
    d = Driver.make(blocks_per_chunk=2)
    stored(d, "a", 100)
    d.add("b", 100)
    # 16 local tokens (1 block) in chunk 0: the hit ends at 96, 80 tokens beyond local
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 16) == (80, True)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 64) == (32, True)


def test_pending_store_defers_the_lookup() -> None:
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")  # stores chunks 0, 1 (write pending)
    d.add("b", 40)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (None, False)
    assert d.state("b") == R.LOOKUP_DEFERRED
    d.build()
    d.ack_all(meta.store_jobs)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (32, True)
    assert d.state("b") == R.IDLE


def test_chunk_being_loaded_defers_a_second_lookup() -> None:
    """As vLLM's test_concurrent_lookups_of_the_same_prefix: a lookup of chunks another
    request is loading defers."""
    d = Driver.make()
    stored(d, "a", 40)
    d.add("b", 40)
    hit, is_async, _ = d.admit("b")
    assert (hit, is_async) == (32, True) and d.state("b") == R.LOADING_ASYNC
    d.add("c", 40)
    assert d.s.get_num_new_matched_tokens(d.reqs["c"], 0) == (None, False)
    assert d.state("c") == R.LOOKUP_DEFERRED


def test_skip_reading_prefix_cache_and_max_load_tokens() -> None:
    d = Driver.make()
    stored(d, "a", 80)
    d.add("b", 80)
    d.reqs["b"].skip_reading_prefix_cache = True
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (0, False)
    tokens = list(range(80))
    req = Request("c", tokens, block_hashes=block_hashes(tokens, 16),
                  kv_transfer_params={"max_load_tokens": 40})
    d.s.on_new_request(req)
    assert d.s.get_num_new_matched_tokens(req, 0) == (32, True)


def test_sync_load_when_the_budget_fits() -> None:
    d = Driver.make(sync_load_budget_bytes=64 * 100, kv_bytes_per_token=100)
    stored(d, "a", 80)
    d.add("b", 80)
    hit, is_async, meta = d.admit("b")
    assert (hit, is_async) == (64, False)
    (job_id, job), = meta.load_jobs.items()
    assert job.sync and d.state("b") == R.LOADING_SYNC
    d.ack_all([job_id])
    assert d.state("b") in R.SCHEDULED and d.state("b") != R.LOADING_SYNC


def test_update_state_after_alloc_creates_one_load_with_the_right_blocks() -> None:
    d = Driver.make(blocks_per_chunk=2)
    stored(d, "a", 100)
    d.add("b", 100)
    hit, _, meta = d.admit("b", local_tokens=16)
    assert hit == 80
    (job_id, job), = meta.load_jobs.items()
    blocks = d.blocks["b"]
    assert job.dst.block_ids == tuple(blocks[1:6])  # logical blocks 1..5
    assert job.dst.first_block_index == 1  # the first chunk skips one sub-block
    assert len(job.src.chunk_ids) == 3
    assert d.s.transfer_jobs("b") == {job_id}
    assert d.s.abstract_state().chunks_being_loaded  # async: its keys are being loaded


def test_zero_external_tokens_only_records_the_allocation() -> None:
    d = Driver.make()
    d.add("a", 40)
    d.s.get_num_new_matched_tokens(d.reqs["a"], 0)
    d.s.update_state_after_alloc(d.reqs["a"], [3, 4, 5], 0)
    assert d.s._batch_allocated_blocks == {3, 4, 5}
    assert d.s.transfer_jobs("a") == frozenset()


def test_alloc_for_a_hit_that_was_not_answered_is_rejected_unchanged() -> None:
    d = Driver.make()
    stored(d, "a", 40)
    d.add("b", 40)
    d.s.get_num_new_matched_tokens(d.reqs["b"], 0)
    before = d.s.abstract_state()
    with pytest.raises(InvalidArgument, match="answered 32 tokens in this step, not 16"):
        d.s.update_state_after_alloc(d.reqs["b"], [0, 1, 2], 16)
    with pytest.raises(InvalidArgument, match="1 blocks cannot hold 2 blocks"):
        d.s.update_state_after_alloc(d.reqs["b"], [0], 32)
    assert d.s.abstract_state() == before


def test_hooks_for_an_unknown_request_raise_typed_errors() -> None:
    d = Driver.make()
    tokens = list(range(32))
    ghost = Request("ghost", tokens, block_hashes=block_hashes(tokens, 16))
    with pytest.raises(UnknownRequest, match="'ghost' is not tracked"):
        d.s.get_num_new_matched_tokens(ghost, 0)
    with pytest.raises(UnknownRequest):
        d.s.update_state_after_alloc(ghost, [1], 16)


def test_misaligned_computed_tokens_are_rejected() -> None:
    d = Driver.make()
    d.add("a", 40)
    with pytest.raises(InvalidArgument, match="block-aligned"):
        d.s.get_num_new_matched_tokens(d.reqs["a"], 5)
    with pytest.raises(InvalidArgument):
        d.s.get_num_new_matched_tokens(d.reqs["a"], 48)


def test_lookup_hit_not_consumed_is_dropped_at_step_end() -> None:
    """INV-18: allocate_slots failed after a hit; nothing is pinned and nothing outlives the
    step (r6)."""
    d = Driver.make()
    stored(d, "a", 40)
    d.add("b", 40)
    hit, _, _ = d.admit("b", alloc_ok=False)
    assert hit == 32 and d.state("b") == R.IDLE
    assert d.s.requests["b"].lookup_hit_tokens is None
    assert all(n == 0 for n in d.s.manager.chunk_ref_counts().values())
