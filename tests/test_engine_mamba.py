"""The engine with a Mamba group in align mode beside full attention: the core splits a
prefill at block edges, keeps one state block per request, hands off the states it commits;
the connector stores those at a chunk edge into the last block of their chunk, fenced, and a
hit loads the state at the hit's end back into one block. The byte oracle checks each."""

from __future__ import annotations

import pytest

from spec import request as R
from spec.groups import NULL_BLOCK
from statemachine.config import KVCacheGroup
from statemachine.engine import Engine, EngineConfig, StepResult
from statemachine.mutants import by_name
from statemachine.oracle import CorruptedBytes

BS = 4  # tokens per block; 2 blocks per chunk


def mamba_engine(num_gpu_blocks: int = 24, check_invariants: bool = True,
                 budget: int = 64, retention_interval: int | None = None) -> Engine:
    return Engine(EngineConfig(
        block_size=BS, blocks_per_chunk=2, num_gpu_blocks=num_gpu_blocks, num_cpu_chunks=32,
        num_workers=1, num_layers=1, bytes_per_token=2, max_num_batched_tokens=budget,
        groups=(KVCacheGroup(), KVCacheGroup("mamba")), group_bytes_per_token=(2, 6),
        retention_interval=retention_interval, check_invariants=check_invariants,
        device="cpu"))


PROMPT = list(range(200, 219))  # 19 tokens: the last block edge before the last token is 16


def test_a_prefill_stops_at_the_last_block_edge_and_hands_the_state_off() -> None:
    e = mamba_engine()
    assert [t.shape[1] for t in e.workers[0].gpu] == [8, 24]  # the state page is 3x
    e.add_request("a", PROMPT, 2)
    first = e.step()
    # vLLM's aligned split: 16 tokens, not 19, so the state after token 16 is committed
    assert first.scheduled == {"a": 16}
    a = e.requests["a"]
    state, table = first.meta.store_jobs.values()
    # the hand-off's own store: the state after 16 tokens into the last block of chunk 1
    # (a first-chunk skip of one); then the table's store: full attention's 2 chunks
    assert state.src.group_sizes == (0, 1) and state.src.block_indices == (0, 3)
    assert state.src.block_ids == (a.tables[1][3],)
    assert table.src.group_sizes == (4, 0) and table.src.block_ids == tuple(a.tables[0][:4])
    assert e.stats["states_handed_off"] == 1
    # the state block is fenced from the job's creation; the attention blocks are not
    assert set(e.scheduler.block_fence) == {a.tables[1][3]}
    e.step()  # the prompt's last 3 tokens
    assert a.num_computed == 19
    # the core holds only the block of the state after the last computed token
    assert a.tables[1][:4] == [NULL_BLOCK] * 4 and a.tables[1][4] != NULL_BLOCK
    e.run_until_idle()
    assert e.group_stats[1]["stored_blocks_verified"] == 1
    assert e.group_stats[0]["stored_blocks_verified"] == 4
    assert all(v == 0 for v in e.leaks().values())


def test_a_hit_loads_the_state_at_its_end_into_one_block() -> None:
    e = mamba_engine()
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    e.add_request("b", [*PROMPT[:16], 1, 2, 3, 4, 5], 1)
    step = e.step()
    (load,) = step.meta.load_jobs.values()
    # 16 tokens hit: full attention loads 4 blocks, the Mamba group its state's one block
    assert load.dst.group_sizes == (4, 1) and load.dst.block_indices == (0, 3)
    b = e.requests["b"]
    assert b.tables[1][:3] == [NULL_BLOCK] * 3 and load.dst.block_ids[4] == b.tables[1][3]
    e.run_until_idle()
    assert e.group_stats[1]["loaded_blocks_verified"] == 1
    assert e.group_stats[0]["loaded_blocks_verified"] == 4
    assert all(v == 0 for v in e.leaks().values())


@pytest.mark.parametrize("retention", [None, 0])
def test_at_retention_0_the_core_hands_off_only_the_state_of_the_replay_boundary(
        retention: int | None) -> None:
    """A 19-token prompt prefilled 8 tokens a step commits the states after 8 and 16 tokens.
    With dense retention the core hands off both, and a request sharing the first 8 tokens
    loads that state. At vLLM's default retention (0) it keeps, and hands off, only the one
    at the replay boundary (18 tokens, rounded down to a block: 16;
    `spec.groups.state_retained`): the 8-token prefix is no hit, and a request sharing 16
    tokens loads the state after them. The byte oracle checks every stored and loaded
    block."""
    e = mamba_engine(budget=8, retention_interval=retention)
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    kept = 2 if retention is None else 1
    assert e.stats["states_handed_off"] == kept
    assert e.group_stats[1]["stored_blocks_verified"] == kept
    assert e.group_stats[0]["stored_blocks_verified"] == 4  # full attention: every chunk
    e.add_request("b", [*PROMPT[:8], *range(9)], 1)
    step = e.step()
    if retention is None:
        (load,) = step.meta.load_jobs.values()
        assert load.dst.group_sizes == (2, 1) and load.dst.block_indices == (0, 1)
    else:
        assert not step.meta.load_jobs and step.scheduled == {"b": 8}  # computed from 0
        e.run_until_idle()
        e.add_request("c", [*PROMPT[:16], *range(5)], 1)
        (load,) = e.step().meta.load_jobs.values()
        assert load.dst.group_sizes == (4, 1) and load.dst.block_indices == (0, 3)
    e.run_until_idle()
    assert e.group_stats[1]["loaded_blocks_verified"] == 1
    assert all(v == 0 for v in e.leaks().values())


def _resume_after_a_load(reset: bool) -> tuple[Engine, StepResult, int]:
    """a stores its prompt; b (a's first 16 tokens, then its own) loads 16 tokens
    asynchronously; its load is reported and the core promotes it; then, with `reset`, the
    connector's cache is reset. Returns the step that schedules b and the block its load
    filled with the state (the core frees it once that step ran)."""
    e = mamba_engine()
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    e.add_request("b", [*PROMPT[:16], 1, 2, 3, 4, 5], 1)
    b = e.requests["b"]
    while b.num_computed == 0:
        assert not e.step().scheduled.get("b")  # the load is in flight
    assert b.loaded_state_due and b.num_computed == 16
    state = b.tables[1][3]
    assert state != NULL_BLOCK
    if reset:
        assert e.reset_prefix_cache()
    step = e.step()
    assert step.scheduled.get("b") and not b.loaded_state_due
    return e, step, state


@pytest.mark.parametrize("reset", [False, True])
def test_the_core_hands_off_a_loaded_state_as_it_resumes_the_request(reset: bool) -> None:
    """CONFORMANCE.md D4: vLLM's core hands off the state an async load ended on when it
    caches the loaded blocks. The CPU cache holds that state, so no store comes of it;
    after a reset it holds nothing, and the state is stored again (with the prefix's
    full-attention chunks) and checked byte for byte."""
    e, step, state = _resume_after_a_load(reset)
    assert step.meta is not None
    mamba = [j for j in step.meta.store_jobs.values() if j.src.group_sizes == (0, 1)]
    if not reset:
        assert mamba == []
    else:
        (job,) = mamba
        assert job.src.block_ids == (state,) and job.src.block_indices == (0, 3)
        assert state in e.scheduler.block_fence  # fenced from the job's creation
    before = e.group_stats[1]["stored_blocks_verified"]
    e.run_until_idle()
    assert e.group_stats[1]["stored_blocks_verified"] - before == (1 if reset else 0)
    assert all(v == 0 for v in e.leaks().values())


def test_a_loaded_request_the_core_cannot_schedule_waits_with_the_store_of_its_state(
        ) -> None:
    """The waiting loop reaches b after its load, caches the loaded blocks and hands off
    their state, but the 3 tokens y leaves of the budget hold no block-aligned chunk of b:
    b is not scheduled. After a reset the connector stores the state for the waiting b
    (`WAITING_STORING`), the store is checked byte for byte, and b runs later."""
    e = mamba_engine(num_gpu_blocks=48, budget=11)
    e.add_request("a", PROMPT, 1)
    e.run_until_idle()
    e.add_request("b", [*PROMPT[:16], 1, 2, 3, 4, 5], 1)
    e.add_request("y", list(range(700, 760)), 1)
    b = e.requests["b"]
    while not b.loaded_state_due:
        assert "b" not in e.step().scheduled
    state = b.tables[1][3]
    e.reset_prefix_cache()
    step = e.step()
    assert step.scheduled == {"y": 8} and step.meta is not None
    (job,) = [j for j in step.meta.store_jobs.values() if j.req_id == "b"]
    assert job.src.block_ids == (state,) and job.src.group_sizes == (0, 1)
    assert e.scheduler.request_state("b") == R.WAITING_STORING
    before = e.group_stats[1]["stored_blocks_verified"]
    e.run_until_idle()
    assert e.group_stats[1]["stored_blocks_verified"] > before
    assert b.request.is_finished()
    assert all(v == 0 for v in e.leaks().values())


def _reuse_the_state_block_while_its_store_is_in_flight(e: Engine) -> tuple[int, set[int]]:
    """a's store of its 16-token state is submitted, and its worker stalls; a runs on, so
    the core frees that state block at the step's end; b then takes it and its forward pass
    writes there while the store is still in flight. Returns the state store's job id and
    every job flushed."""
    e.add_request("a", PROMPT, 4)
    state_store = min(e.step().meta.store_jobs)  # a: 16 tokens, the state stored (queued)
    e.workers[0].stall(6)
    e.step()  # a: 3 tokens; the store is submitted and stays in flight; block freed
    assert e.requests["a"].tables[1][3] == NULL_BLOCK
    e.add_request("b", list(range(500, 520)), 1)
    flushed: set[int] = set()
    while e.has_pending_work():
        flushed |= e.step().meta.jobs_to_flush
    return state_store, flushed


def test_the_state_store_is_flushed_before_its_block_is_reused() -> None:
    e = mamba_engine(num_gpu_blocks=16)
    state_store, flushed = _reuse_the_state_block_while_its_store_is_in_flight(e)
    assert state_store in flushed  # b re-allocated the fenced state block
    assert e.group_stats[1]["stored_blocks_verified"] >= 1
    assert all(v == 0 for v in e.leaks().values())


def test_without_the_hand_off_fence_the_bytes_are_caught() -> None:
    with by_name("handoff-store-skips-fence").patch():
        e = mamba_engine(num_gpu_blocks=16, check_invariants=False)
        with pytest.raises(CorruptedBytes, match="stored block of request 'a'") as caught:
            _reuse_the_state_block_while_its_store_is_in_flight(e)
        e.shutdown()
    assert caught.value.layer == 1 and caught.value.block_index == 3  # the state's tensor
