"""build_connector_meta (S:2103-2196): stores, cursor, preemption flush, fences, finalize."""

from __future__ import annotations

from spec import job as J
from spec import request as R
from statemachine.messages import CachedRequestData
from tests.driver import Driver


def test_store_jobs_per_full_chunk_and_the_cursor_advances() -> None:
    d = Driver.make(blocks_per_chunk=2)  # 32 tokens a chunk
    d.add("a", 70)
    _, _, meta = d.admit("a")
    (_jid, job), = meta.store_jobs.items()
    assert job.src.block_ids == tuple(d.blocks["a"][:4]) and len(job.dst.chunk_ids) == 2
    assert d.state("a") == R.STORING
    assert d.s.requests["a"].next_stored_chunk_idx == 2
    # decode to 96 tokens: chunk 2 becomes storable
    meta = d.decode(["a"], tokens=26, new_blocks=2)
    (_, job2), = meta.store_jobs.items()
    assert job2.src.block_ids == tuple(d.blocks["a"][4:6])
    assert job2.src.first_block_index == 4


def test_allocation_failure_keeps_the_cursor_and_retries_next_step() -> None:
    d = Driver.make(num_cpu_chunks=2)
    d.add("a", 40)
    _, _, meta = d.admit("a")  # fills both slots, write pending
    d.add("b", 40, family=1)
    _, _, meta_b = d.admit("b")
    assert meta_b.store_jobs == {}
    assert d.s.stats["allocation_failures"] == 1
    assert d.s.requests["b"].next_stored_chunk_idx == 0
    d.ack_all(meta.store_jobs)  # a's chunks ready and evictable now
    meta_b = d.decode(["b"], tokens=1)
    assert len(meta_b.store_jobs) == 1
    assert d.s.get_stats()["manager_evictions"] == 2


def test_already_stored_chunks_advance_the_cursor_without_a_job() -> None:
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")
    d.ack_all(meta.store_jobs)
    d.add("b", 40)
    d.reqs["b"].skip_reading_prefix_cache = True  # recompute, then offer the same chunks
    _, _, meta_b = d.admit("b")
    assert meta_b.store_jobs == {}
    assert d.s.requests["b"].next_stored_chunk_idx == 2 and d.state("b") == R.RUNNING


def test_preemption_flushes_every_job_of_the_request() -> None:
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")
    jid = next(iter(meta.store_jobs))
    meta2 = d.build(preempted=["a"])
    assert meta2.jobs_to_flush == {jid}
    assert d.state("a") == R.PREEMPTED_FLUSHING
    assert d.s.jobs.get(jid).state == J.FLUSH_REQUESTED
    # re-admission while the flush is unacknowledged is deferred (issue #46014)
    assert d.s.get_num_new_matched_tokens(d.reqs["a"], 0) == (None, False)
    d.build()
    d.ack_all([jid])
    assert d.state("a") == R.IDLE
    assert d.s.get_num_new_matched_tokens(d.reqs["a"], 0) == (32, True)


def test_preempting_a_request_without_jobs_makes_it_idle() -> None:
    d = Driver.make()
    d.add("a", 10)
    d.admit("a")
    assert d.state("a") == R.RUNNING
    meta = d.build(preempted=["a"])
    assert d.state("a") == R.IDLE and meta.jobs_to_flush == frozenset()


def test_reallocating_a_fenced_block_flushes_the_store() -> None:
    """test_fence_at_build_store_jobs: a finished request's final store reads a block the
    core gives to another request in the same step."""
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")
    jid = next(iter(meta.store_jobs))
    d.finish("a")  # blocks freed; the in-flight store's sources get fenced
    fence = d.s.abstract_state().block_fence
    assert {b for b, _ in fence} == set(d.blocks["a"][:2])
    d.build(finished=["a"])
    assert d.state("a") == R.FINISHED_DRAINING
    # next step: block 0 of 'a' is re-allocated to 'b'
    d.add("b", 20, family=1)
    d.s.get_num_new_matched_tokens(d.reqs["b"], 0)
    d.s.update_state_after_alloc(d.reqs["b"], [d.blocks["a"][0]], 0)
    from statemachine.messages import NewRequestData
    meta = d.build(new=[NewRequestData("b", (d.blocks["a"][0],))], sched={"b": 20})
    assert jid in meta.jobs_to_flush
    d.ack_all([jid])
    assert d.state("a") == R.ABSENT
    assert d.s.abstract_state().block_fence == ()


def test_final_store_of_a_finished_request_then_finalize() -> None:
    """A store that failed to allocate while running is retried at finish (r16), before
    on_request_finished, and its source blocks are fenced at once."""
    d = Driver.make(num_cpu_chunks=2)
    d.add("x", 40, family=1)
    _, _, meta_x = d.admit("x")  # both slots write-pending
    d.add("a", 40)
    _, _, meta = d.admit("a")
    assert meta.store_jobs == {} and d.state("a") == R.RUNNING
    d.ack_all(meta_x.store_jobs)  # x's chunks ready: evictable
    d.finish("a")
    assert d.state("a") == R.FINISHED_PENDING_FINAL
    meta = d.build(finished=["a"])
    (jid, job), = meta.store_jobs.items()
    assert job.src.block_ids == tuple(d.blocks["a"][:2])
    assert d.state("a") == R.FINISHED_DRAINING
    assert d.s.manager.finished_signals["a"] == 1
    fenced = {b for b, ids in d.s.abstract_state().block_fence if jid in ids}
    assert fenced == set(job.src.block_ids)
    d.ack_all([jid])
    assert d.state("a") == R.ABSENT
    assert d.s.abstract_state().block_fence == ()


def test_finished_request_without_jobs_is_deleted_at_finalize() -> None:
    d = Driver.make()
    d.add("a", 10)
    d.admit("a")
    d.finish("a")
    d.build(finished=["a"])
    assert d.state("a") == R.ABSENT
    assert d.s.manager.finished_signals["a"] == 1


def test_cached_request_blocks_are_appended() -> None:
    d = Driver.make()
    d.add("a", 20)
    d.admit("a")
    d.build(cached=[CachedRequestData("a", (99,))], sched={"a": 1})
    assert d.s.requests["a"].block_ids[-1] == 99
