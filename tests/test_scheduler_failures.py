"""Beyond vLLM: failed jobs and job timeouts, both table transitions."""

from __future__ import annotations

from spec import fence as F
from spec import job as J
from spec import request as R
from statemachine.manager import LookupResult
from tests.driver import Driver


def seeded(d: Driver, tokens: int = 40) -> None:
    d.add("seed", tokens)
    _, _, meta = d.admit("seed")
    d.ack_all(meta.store_jobs)
    d.finish("seed")
    d.build(finished=["seed"])


def test_store_failure_waits_for_every_worker_then_rolls_back() -> None:
    d = Driver.make(num_workers=3)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    keys = tuple(d.reqs["a"].block_hashes[:2])
    d.report(failed={jid: 1})
    assert d.s.jobs.get(jid).state == J.FAILING  # type: ignore[union-attr]
    assert all(d.s.manager.chunk_ref_counts()[k] == -1 for k in keys)  # nothing released yet
    d.report({jid: 2})
    assert jid not in d.s.jobs and d.state("a") == R.RUNNING
    ctx = d.s.requests["a"].ctx
    assert [d.s.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
    assert d.s.stats["failed_jobs"] == 1


def test_async_load_failure_sends_the_request_to_recompute() -> None:
    d = Driver.make(num_workers=2)
    seeded(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.report({lid: 1}, failed={lid: 1})
    assert d.state("b") == R.RECOMPUTE
    assert set(d.s.manager.chunk_ref_counts().values()) == {0}  # unpinned
    assert not d.s.chunks_being_loaded
    # the next lookup bypasses the offload tier: recompute from the local prefix; the
    # request stays RECOMPUTE until it is scheduled (an allocation that fails keeps the duty)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (0, False)
    assert d.state("b") == R.RECOMPUTE and d.s.stats["lookups_bypassed"] == 1
    hit, _, _ = d.admit("b")
    assert hit == 0 and d.state("b") == R.RUNNING and d.s.stats["lookups_bypassed"] == 2


def test_sync_load_failure_poisons_the_stores_beside_it() -> None:
    d = Driver.make(num_workers=2, sync_load_budget_bytes=10**6, kv_bytes_per_token=1)
    seeded(d, 40)
    d.add("b", 60)  # 32 loaded sync, then 28 computed: chunk 2 stored in the same step
    _, is_async, meta = d.admit("b")
    assert not is_async
    (lid,) = meta.load_jobs
    (sid,) = meta.store_jobs
    assert d.state("b") == R.LOADING_SYNC
    d.report(failed={lid: 2})
    assert d.state("b") == R.PREEMPTED_FLUSHING
    assert d.s.jobs.get(sid).state == J.FAILING  # type: ignore[union-attr]
    d.build()
    d.ack_all([sid])  # the workers copied it, but it read KV computed from the bad load
    assert d.state("b") == R.RECOMPUTE
    key = d.reqs["b"].block_hashes[2]
    assert d.s.manager.lookup(key, d.s.requests["b"].ctx) == LookupResult.MISS


def test_without_a_timeout_a_lost_ack_keeps_the_request_forever() -> None:
    """Hazard H1 of vLLM 0.33.0, reproduced: nothing ever releases the load."""
    d = Driver.make(num_workers=2)
    seeded(d)
    d.add("b", 40)
    d.admit("b")
    for _ in range(20):
        d.build()
    assert d.state("b") == R.LOADING_ASYNC and d.s.has_pending_work()
    d.add("c", 40)
    assert d.s.get_num_new_matched_tokens(d.reqs["c"], 0) == (None, False)


def test_load_timeout_releases_the_request_and_quarantines_its_blocks() -> None:
    d = Driver.make(num_workers=2, job_timeout_steps=3)
    seeded(d)
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    d.report({lid: 1})  # one worker answers, the other hangs
    for _ in range(3):
        d.build()
    assert d.state("b") == R.TIMED_OUT and lid not in d.s.jobs
    assert d.s.quarantined_gpu_blocks[lid] == tuple(d.blocks["b"][:2])
    assert not d.s.chunks_being_loaded  # other requests are no longer deferred behind it
    d.add("c", 40)
    assert d.s.get_num_new_matched_tokens(d.reqs["c"], 0) == (32, True)
    assert d.s.get_num_new_matched_tokens(d.reqs["b"], 0) == (0, False)  # recompute
    d.build()
    assert d.s.stats["timed_out_jobs"] == 1
    pins = d.s.manager.chunk_ref_counts()
    d.report({lid: 1})  # the late report drains the quarantine
    assert lid not in d.s.jobs.quarantine
    assert d.s.take_released_gpu_blocks() == list(d.blocks["b"][:2])
    assert sum(d.s.manager.chunk_ref_counts().values()) == sum(pins.values()) - 2


def test_store_timeout_drops_the_keys_and_holds_the_slots_until_late_acks() -> None:
    d = Driver.make(num_workers=2, job_timeout_steps=2, num_cpu_chunks=4)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (sid,) = meta.store_jobs
    d.build()
    d.build()
    assert sid in d.s.jobs.quarantine and d.state("a") == R.RUNNING
    assert d.s.manager.chunk_ref_counts() == {}
    assert len(d.s.manager.quarantined_slots) == 2
    d.ack_all([sid])
    assert d.s.manager.quarantined_slots == frozenset()
    assert d.s.manager.num_free_slots() == 4


def test_reset_moves_a_quarantined_job_to_the_fence() -> None:
    d = Driver.make(num_workers=2, job_timeout_steps=1)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (sid,) = meta.store_jobs
    d.build()
    assert sid in d.s.jobs.quarantine
    d.s.reset_cache()
    assert sid not in d.s.jobs.quarantine and d.s.fence.entries == {sid: 2}
    d.build()
    d.ack_all([sid])
    assert d.s.fence.state == F.FENCE_IDLE


def test_finished_request_with_a_timed_out_store_is_cleaned_up() -> None:
    d = Driver.make(num_workers=2, job_timeout_steps=2)
    d.add("a", 40)
    _, _, _meta = d.admit("a")
    d.finish("a")
    d.build(finished=["a"])
    assert d.state("a") == R.FINISHED_DRAINING
    d.build()
    assert d.state("a") == R.ABSENT
