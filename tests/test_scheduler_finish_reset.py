"""request_finished (2.6) and reset_cache (2.7), with the PR #48102 regression."""

from __future__ import annotations

import pytest

from spec import fence as F
from spec import job as J
from spec import request as R
from spec.rules import VLLM_0_34
from statemachine.errors import IllegalTransition, OutOfStep
from statemachine.messages import NewRequestData, Request
from tests.driver import Driver, block_hashes


def loaded_once(d: Driver, rid: str = "seed", tokens: int = 40) -> None:
    d.add(rid, tokens)
    _, _, meta = d.admit(rid)
    d.ack_all(meta.store_jobs)
    d.finish(rid)
    d.build(finished=[rid])


# ---------------------------------------------------------------- request_finished
def test_untracked_request_finished_signals_the_manager() -> None:
    d = Driver.make()
    tokens = list(range(20))
    req = Request("u", tokens, block_hashes=block_hashes(tokens, 16))
    assert d.s.request_finished(req) == (False, None)
    assert d.s.manager.finished_signals["u"] == 1
    assert d.state("u") == R.ABSENT


def test_finishing_twice_is_illegal() -> None:
    d = Driver.make()
    d.add("a", 20)
    d.finish("a")
    with pytest.raises(IllegalTransition, match="FINISHED_PENDING_FINAL: trigger 'finish'"):
        d.finish("a")


def test_abort_while_loading_keeps_the_request_until_the_load_ends() -> None:
    """test_abort_loading_requests."""
    d = Driver.make(num_workers=2)
    loaded_once(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.finish("b", aborted=True)
    d.build(finished=["b"])
    assert d.state("b") == R.FINISHED_DRAINING
    assert d.s.manager.finished_signals["b"] == 1
    d.ack_all([lid])
    assert d.state("b") == R.ABSENT
    assert not d.s.chunks_being_loaded


@pytest.mark.parametrize("where", ["idle", "deferred", "loading", "storing", "flushing",
                                   "running"])
def test_abort_is_legal_everywhere_and_drains(where: str) -> None:
    """Issue #49118: an abort in any state must neither crash nor leak."""
    d = Driver.make(num_workers=2)
    loaded_once(d)
    d.add("x", 40)
    job_ids: set[int] = set()
    if where == "deferred":
        d.add("w", 40, family=2)
        _, _, m = d.admit("w")
        job_ids |= set(m.store_jobs)
        d.add("x2", 40, family=2)
        d.s.get_num_new_matched_tokens(d.reqs["x2"], 0)
        d.build()
        rid = "x2"
    else:
        rid = "x"
        if where != "idle":
            d.reqs["x"].skip_reading_prefix_cache = where in ("storing", "flushing", "running")
            _, _, m = d.admit("x", schedule_tokens=None if where != "running" else 8)
            job_ids |= set(m.load_jobs) | set(m.store_jobs)
        if where == "flushing":
            d.build(preempted=["x"])
    d.finish(rid, aborted=True)
    d.build(finished=[rid])
    d.ack_all(job_ids)
    assert d.state(rid) == R.ABSENT
    assert not d.s.has_pending_work()
    assert all(n >= 0 for n in d.s.manager.chunk_ref_counts().values())


# --------------------------------------------------------------------- reset_cache
def test_pr_48102_reset_with_a_store_in_flight_then_stale_acks_then_readmit() -> None:
    """The named regression: a request holds a store, reset_cache, the stale acks arrive,
    and the request is admitted again and finishes."""
    d = Driver.make(num_workers=2)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    d.build(preempted=["a"])  # preempted with its store in flight
    assert d.state("a") == R.PREEMPTED_FLUSHING
    assert d.s.reset_cache() is True
    assert d.s.transfer_jobs("a") == frozenset()  # the fix: cleared with _jobs
    assert d.state("a") == R.IDLE
    assert d.s.fence.state == F.FENCE_HELD and d.s.fence.entries == {jid: 2}
    meta = d.build()
    assert jid in meta.jobs_to_flush  # pre-reset jobs flushed before new submissions
    d.ack_all([jid])  # the stale acks: counted, never touch the request
    assert d.s.fence.state == F.FENCE_IDLE and d.s.manager.reset_flushed_count == 1
    assert d.s.stats["stale_reports"] == 2
    hit, _, meta = d.admit("a")
    assert hit == 0 and d.state("a") == R.STORING
    d.ack_all(meta.store_jobs)
    d.finish("a")
    d.build(finished=["a"])
    assert d.state("a") == R.ABSENT and not d.s.has_pending_work()


def test_reset_during_a_load_orphans_it_until_finished_recving() -> None:
    d = Driver.make(num_workers=2)
    loaded_once(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.s.reset_cache()
    assert d.state("b") == R.ORPHANED_LOAD
    assert d.s.transfer_jobs("b") == frozenset() and not d.s.chunks_being_loaded
    d.build()
    d.report({lid: 2}, recving=["b"])
    assert d.state("b") == R.IDLE and d.s.fence.state == F.FENCE_IDLE
    d.build(new=[NewRequestData("b", tuple(d.blocks["b"]))], sched={"b": 8})
    assert d.state("b") in R.SCHEDULED and d.state("b") != R.LOADING_SYNC


def test_reset_drops_finished_requests_and_signals_them_once() -> None:
    """test_reset_cache_finalizes_finished_request_with_pending_store."""
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")
    d.finish("a")
    d.s.reset_cache()
    assert d.state("a") == R.ABSENT
    assert d.s.manager.finished_signals["a"] == 1
    (jid,) = meta.store_jobs
    d.ack_all([jid])
    assert d.s.fence.state == F.FENCE_IDLE


def test_reset_of_a_running_request_restarts_its_store_cursor() -> None:
    d = Driver.make()
    d.add("a", 40, family=3)
    _, _, meta = d.admit("a")
    d.s.reset_cache()
    assert d.state("a") == R.RUNNING and d.s.requests["a"].next_stored_chunk_idx == 0
    meta2 = d.decode(["a"])
    assert len(meta2.store_jobs) == 1  # everything offered again after the reset
    assert set(meta.store_jobs) <= meta2.jobs_to_flush


def test_late_acks_after_reset_and_after_draining_are_counted_ignores() -> None:
    d = Driver.make(num_workers=2)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    d.s.reset_cache()
    d.report({jid: 1})
    assert d.s.fence.entries == {jid: 1} and d.s.fence.state == F.FENCE_HELD
    d.report({jid: 1})
    assert d.s.fence.state == F.FENCE_IDLE
    d.report({jid: 3})  # a stale id that already drained: counted, nothing else
    assert d.s.stats["ignored_stale_reports"] == 3


def test_two_resets_with_no_step_between() -> None:
    """vLLM asserts here (S:2404-2407); the spec makes the second reset legal and
    idempotent: no new fence entries, the flush set kept, the threshold unchanged."""
    d = Driver.make(num_workers=2)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    d.s.reset_cache()
    state1 = d.s.abstract_state()
    d.s.reset_cache()
    state2 = d.s.abstract_state()
    assert state2.reset_fence == state1.reset_fence
    assert state2.stale_threshold == state1.stale_threshold
    assert state2.jobs_to_flush == {jid}
    assert d.s.manager.reset_flushed_count == 0  # the first fence still drains
    d.build()
    d.ack_all([jid])
    assert d.s.manager.reset_flushed_count == 1


def test_reset_with_nothing_in_flight_signals_flushed_at_once() -> None:
    d = Driver.make()
    d.s.reset_cache()
    assert d.s.manager.reset_flushed_count == 1 and d.s.fence.state == F.FENCE_IDLE


def test_reset_inside_a_step_is_refused() -> None:
    d = Driver.make()
    d.add("a", 20)
    d.s.get_num_new_matched_tokens(d.reqs["a"], 0)
    before = d.s.abstract_state()
    with pytest.raises(OutOfStep, match="inside a step"):
        d.s.reset_cache()
    assert d.s.abstract_state() == before


def test_preempt_and_readmit_before_the_flush_is_acked() -> None:
    """test_async_preempt_readmit_before_transfer_output_is_deferred."""
    d = Driver.make(num_workers=3)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    d.build(preempted=["a"])
    d.report({jid: 2})
    assert d.s.get_num_new_matched_tokens(d.reqs["a"], 0) == (None, False)
    assert d.s.transfer_jobs("a") == {jid}
    d.build()
    d.report({jid: 1})
    hit, _, _ = d.admit("a")
    assert hit == 32 and d.state("a") == R.LOADING_ASYNC


def test_lookup_for_a_scheduled_request_applies_its_preemption_once() -> None:
    """reset_prefix_cache(reset_running_requests=True): the core preempts a running request
    and may look it up again before build_connector_meta lists it as preempted."""
    d = Driver.make()
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    assert d.s.get_num_new_matched_tokens(d.reqs["a"], 0) == (None, False)
    assert d.state("a") == R.PREEMPTED_FLUSHING
    meta = d.build(preempted=["a"])
    assert meta.jobs_to_flush == {jid}
    assert d.s.jobs.get(jid).state == J.FLUSH_REQUESTED  # type: ignore[union-attr]


def test_a_failed_orphaned_load_is_recomputed_not_promoted() -> None:
    """Beyond vLLM: a reset orphans an async load and a worker then fails it; the stale
    failure marks the request, and finished_recving sends it to recompute."""
    d = Driver.make(num_workers=2)
    loaded_once(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.s.reset_cache()
    d.build()
    d.report({lid: 1}, failed={lid: 1}, recving=["b"])
    assert d.state("b") == R.RECOMPUTE
    assert d.s.fence.state == F.FENCE_IDLE
    lookups = d.s.manager.stats["lookups"]
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (0, False)
    assert d.s.manager.stats["lookups"] == lookups  # answered without the manager


@pytest.mark.parametrize("where", ["failed after the reset", "failing at the reset"])
def test_under_0_34_a_failed_orphaned_load_only_drains_the_fence(where: str) -> None:
    """vLLM 0.34.0's rule (`Rules.stale_load_failure` FENCE_ONLY): the failure of a load a
    reset made stale, reported after the reset or already at it (FAILING), only drains the
    fence. The request leaves ORPHANED_LOAD for IDLE (the core recomputes it on the worker's
    failed_recving) and its next lookup asks the manager."""
    d = Driver.make(num_workers=2, rules=VLLM_0_34)
    loaded_once(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    if where == "failing at the reset":
        d.report(failed={lid: 1})
        assert d.s.jobs.get(lid).state == J.FAILING  # type: ignore[union-attr]
    d.s.reset_cache()
    d.build()
    assert d.state("b") == R.ORPHANED_LOAD
    if where == "failing at the reset":
        d.report({lid: 1}, recving=["b"])
    else:
        d.report({lid: 1}, failed={lid: 1}, recving=["b"])
    assert d.state("b") == R.IDLE
    assert d.s.fence.state == F.FENCE_IDLE
    assert d.s.stats["orphaned_loads_failed"] == 0
    lookups = d.s.manager.stats["lookups"]
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (0, False)
    assert d.s.manager.stats["lookups"] == lookups + 1
