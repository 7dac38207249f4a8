"""Scheduler bugs the engine and the simulation found, each reproduced with the bare driver.

1. A sync load's completion removed its keys from `_chunks_being_loaded`, which only async
   loads put there: an async load of the same chunks admitted after the sync one (in the
   same step) lost its marks (INV-8), so later lookups stopped deferring behind it.
2. The job timeout fired at the start of `build_connector_meta`, before the step's scheduled
   requests were recorded: a request whose sync load timed out in a step that scheduled it
   raised IllegalTransition (TIMED_OUT has no `schedule`), though the core had done nothing
   wrong and could not know.
3. INV-15 demanded that a live load's destination blocks stay with its request, but the
   request table lets the core preempt a request whose sync load has not reported yet (it
   is flushed, as stores are): the invariant now accepts a flushed load, as it does a
   flushed store.
"""

from __future__ import annotations

from spec import job as J
from spec import request as R
from statemachine.messages import NewRequestData
from tests.driver import Driver


def seeded(d: Driver, tokens: int = 40) -> None:
    d.add("seed", tokens)
    _, _, meta = d.admit("seed")
    d.ack_all(meta.store_jobs)
    d.finish("seed")
    d.build(finished=["seed"])


def test_a_sync_load_ending_keeps_the_marks_of_an_async_load_of_the_same_chunks() -> None:
    d = Driver.make(num_workers=1, sync_load_budget_bytes=32, kv_bytes_per_token=1)
    seeded(d)
    a, b = d.add("a", 60), d.add("b", 60)
    assert d.s.get_num_new_matched_tokens(a, 0) == (32, False)  # fits the sync budget
    d.alloc("a", 4)
    d.s.update_state_after_alloc(a, d.blocks["a"], 32)
    assert d.s.get_num_new_matched_tokens(b, 0) == (32, True)  # budget spent: async
    d.alloc("b", 2)
    d.s.update_state_after_alloc(b, d.blocks["b"], 32)
    meta = d.build(new=[NewRequestData("a", tuple(d.blocks["a"]))], sched={"a": 28})
    sync_id, async_id = sorted(meta.load_jobs)
    keys = set(d.s.jobs.get(async_id).keys)  # type: ignore[union-attr]
    d.ack_all([sync_id])  # raised InvariantViolation (INV-8) before the fix
    assert d.state("a") == R.RUNNING and d.state("b") == R.LOADING_ASYNC
    assert d.s.chunks_being_loaded == keys
    c = d.add("c", 60)
    assert d.s.get_num_new_matched_tokens(c, 0) == (None, False)  # still deferred behind b
    d.ack_all([async_id])
    assert not d.s.chunks_being_loaded


def test_a_sync_load_may_time_out_in_a_step_that_schedules_its_request() -> None:
    d = Driver.make(num_workers=2, sync_load_budget_bytes=10**6, kv_bytes_per_token=1,
                    job_timeout_steps=2)
    seeded(d)
    d.add("b", 60)
    hit, is_async, meta = d.admit("b")
    assert (hit, is_async) == (32, False)
    (lid,) = meta.load_jobs
    d.ack_all(meta.store_jobs)  # the store beside it ends; the load's report:
    d.report({lid: 1})  # one rank reported; the other one's report is lost
    d.ack_all(d.decode(["b"]).store_jobs)
    assert d.state("b") == R.LOADING_SYNC
    d.decode(["b"])  # the core scheduled b; the timeout fires in the same step
    assert d.state("b") == R.TIMED_OUT and lid in d.s.jobs.quarantine
    assert d.s.quarantined_gpu_blocks[lid] == tuple(d.blocks["b"][:2])
    d.report({lid: 1})  # the late report
    assert d.s.take_released_gpu_blocks() == list(d.blocks["b"][:2])


def test_a_request_may_be_preempted_while_its_sync_load_has_not_reported() -> None:
    d = Driver.make(num_workers=2, sync_load_budget_bytes=10**6, kv_bytes_per_token=1)
    seeded(d)
    d.add("b", 60)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.ack_all(meta.store_jobs)
    d.report({lid: 1})
    meta = d.build(preempted=["b"])  # raised InvariantViolation (INV-15) before the fix
    assert d.state("b") == R.PREEMPTED_FLUSHING and lid in meta.jobs_to_flush
    assert d.s.jobs.get(lid).state == J.FLUSH_REQUESTED  # type: ignore[union-attr]
    d.report({lid: 1})
    assert d.state("b") == R.IDLE and not d.s.jobs.ids()
