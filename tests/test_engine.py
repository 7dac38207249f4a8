"""The engine: vLLM's step order around the connector and the workers, the block pool,
preemption, finish and abort, reset, and following the connector's answers (deferred
lookups, async loads, failed and timed-out loads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from spec import job as J
from spec import request as R
from spec.rules import VLLM_0_34
from statemachine.engine import Engine, EngineConfig, EngineError
from statemachine.errors import ConfigError
from statemachine.messages import OffloadingConnectorMetadata, RequestStatus
from statemachine.mutants import by_name as mutant

PREFIX = list(range(1000, 1064))  # 64 tokens: 4 blocks, 2 chunks


def make(**kw: Any) -> Engine:
    # the CPU stand-in: copies run when polled or waited for, in a deterministic order
    cfg: dict[str, Any] = {"num_gpu_blocks": 32, "num_cpu_chunks": 32, "num_workers": 2,
                           "device": "cpu"}
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def seeded(e: Engine) -> None:
    """Request 'a' computes PREFIX (+3 tokens); its two chunks end up stored."""
    e.add_request("a", [*PREFIX, 1, 2, 3], max_tokens=3)
    e.run_until_idle(50)
    assert e.scheduler.stats["stores"] >= 1 and not e.has_pending_work()


def on_load(e: Engine, action: Callable[[Engine, int, bool], None]) -> list[int]:
    """Run `action(engine, job_id, sync)` on the first load job of the run."""
    seen: list[int] = []

    def hook(eng: Engine, meta: OffloadingConnectorMetadata) -> None:
        if not seen and meta.load_jobs:
            job_id = min(meta.load_jobs)
            seen.append(job_id)
            action(eng, job_id, meta.load_jobs[job_id].sync)

    e.fault_hooks.append(hook)
    return seen


def assert_drained(e: Engine) -> None:
    assert e.run_until_idle(200) < 200
    assert all(v == 0 for v in e.leaks().values()), e.leaks()
    assert not e.requests


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        EngineConfig(num_gpu_blocks=0)
    e = make()
    with pytest.raises(EngineError, match="GPU blocks"):
        e.add_request("huge", list(range(600)), max_tokens=1)
    e.add_request("x", [1, 2, 3], max_tokens=1)
    with pytest.raises(EngineError, match="twice"):
        e.add_request("x", [1, 2, 3], max_tokens=1)


def test_step_order_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    e = make()
    log: list[str] = []

    def spy(obj: Any, name: str, label: str) -> None:
        original = getattr(obj, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            log.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(obj, name, call)

    for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                 "build_connector_meta", "request_finished", "update_connector_output"):
        spy(e.scheduler, name, name)
    for w in e.workers:
        for name in ("handle_preemptions", "start_kv_transfers", "prepare_store_kv",
                     "get_finished"):
            spy(w, name, f"{name}[{w.rank}]")
    spy(e, "_forward", "forward")
    e.add_request("a", [*PREFIX, 1], max_tokens=1)
    e.step()
    assert log == [
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "handle_preemptions[0]", "handle_preemptions[1]",
        "start_kv_transfers[0]", "start_kv_transfers[1]", "forward",
        "prepare_store_kv[0]", "prepare_store_kv[1]", "get_finished[0]", "get_finished[1]",
        "request_finished", "update_connector_output"]


def test_prefix_hits_are_loaded_and_every_loaded_block_checked() -> None:
    e = make()
    seeded(e)
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=4)
    statuses: list[RequestStatus] = []
    e.fault_hooks.append(lambda eng, meta: statuses.append(eng.requests["b"].status))
    e.step()
    e.fault_hooks.clear()
    assert statuses == [RequestStatus.WAITING_FOR_REMOTE_KVS]  # while the workers ran
    b = e.requests["b"]
    assert e.scheduler.request_state("b") == R.IDLE  # acked in the same step...
    assert b.status == RequestStatus.WAITING and b.num_computed == 64  # ...and promoted
    assert b.load_end == 64 and b.loaded_blocks == 4
    assert e.stats["loaded_blocks_verified"] == 4 * 2  # 4 blocks on each of 2 workers
    assert e.stats["loads_inside_a_chunk"] == 0  # full attention loads from block 0
    assert_drained(e)
    assert e.stats["computed_blocks_verified"] > 0


def test_a_deferred_lookup_skips_the_request_for_the_step() -> None:
    e = make()
    seeded(e)
    on_load(e, lambda eng, job, sync: eng.workers[1].hang_job(job, release_after=2))
    e.add_request("b", [*PREFIX, 4], max_tokens=2)
    e.add_request("c", [*PREFIX, 5], max_tokens=2)
    e.step()
    # b loads the prefix; c hits the same chunks while they are being loaded: None
    assert e.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert e.scheduler.request_state("c") == R.LOOKUP_DEFERRED
    assert e.requests["c"].status == RequestStatus.WAITING and not e.requests["c"].blocks
    e.step()
    assert e.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS  # rank 1 hangs
    assert_drained(e)


def test_preemption_takes_the_newest_running_request_and_requeues_it() -> None:
    e = make(num_gpu_blocks=7, blocks_per_chunk=1)
    e.add_request("old", list(range(48)), max_tokens=3)  # 3 blocks
    e.add_request("new", list(range(100, 164)), max_tokens=3)  # 4 blocks: pool full
    e.step()
    assert [r.id for r in e.running] == ["old", "new"]
    result = e.step()  # old needs a 4th block: new is preempted, its blocks go to old
    assert result.preempted == {"new"}
    new = e.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed == 0
    assert not new.blocks and e.waiting[0] is new and new.preemptions == 1
    assert [r.id for r in e.running] == ["old"] and e.stats["preemptions"] == 1
    assert_drained(e)
    assert e.done["new"].request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_waiting_request_that_holds_blocks_goes_before_a_preempted_one() -> None:
    """vLLM drains the waiting requests that hold KV blocks first (`kv_holding_waiting`).
    Over 10 GPU blocks, q4 is preempted for room (it goes to the head of the queue, holding
    nothing) while q5, whose async load ended, waits holding its blocks: q5 runs, and q4
    after it. With one queue q4 came first, did not fit beside q5's blocks, and the engine
    stopped for good (the soak's TightDataPlaneStateMachine found it in a 5-request
    program)."""
    e = make(block_size=4, blocks_per_chunk=2, num_gpu_blocks=10, num_cpu_chunks=6,
             max_num_batched_tokens=32, max_num_running=4, sync_load_budget_bytes=0,
             job_timeout_steps=3)
    for n, (family, tokens, max_tokens) in enumerate(
            [(2, 10, 6), (0, 16, 4), (0, 17, 2), (2, 20, 4), (2, 19, 2)], start=1):
        e.add_request(f"q{n}", [family * 1000 + i for i in range(tokens)], max_tokens)
    seen = False
    for _ in range(40):
        order = [r.id for r in e.waiting]
        holding = [r.id for r in e.waiting if r.num_computed > 0]
        bare = [r.id for r in e.waiting if r.preemptions and not r.blocks]
        result = e.step()
        if holding and bare and order.index(bare[0]) < order.index(holding[0]):
            seen = True
            assert holding[0] in result.scheduled and bare[0] not in result.scheduled
        if not e.has_pending_work():
            break
    assert seen and e.stats["preemptions"] >= 1 and e.stats["loads_promoted"] >= 1
    assert_drained(e)


@pytest.mark.parametrize("sync", [False, True])
def test_a_failed_load_is_recomputed_and_the_bytes_are_right_afterwards(sync: bool) -> None:
    e = make(sync_load_budget_bytes=10**6 if sync else 0)
    seeded(e)
    on_load(e, lambda eng, job, is_sync: eng.workers[1].fail_job(job))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=6)
    e.step()
    assert e.scheduler.stats["failed_jobs"] == 1
    assert e.scheduler.request_state("b") == R.RECOMPUTE
    b = e.requests["b"]
    assert b.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert b.num_computed == 0 and b.recomputes == 1 and not b.blocks
    e.step()  # the lookup is bypassed: b recomputes its whole prompt
    assert e.scheduler.request_state("b") == R.RUNNING
    assert b.num_computed == b.num_tokens - 1  # every token but the one just sampled
    assert e.verify_request("b") == 4  # on both workers, including the re-computed prefix
    assert_drained(e)
    assert e.done["b"].request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_failed_sync_load_poisons_the_stores_beside_it_and_recomputes() -> None:
    e = make(sync_load_budget_bytes=10**6)
    seeded(e)
    on_load(e, lambda eng, job, sync: eng.workers[0].fail_job(job))
    e.add_request("b", [*PREFIX, *range(40)], max_tokens=3)  # chunk 2 stored beside the load
    e.step()
    assert e.scheduler.request_state("b") == R.PREEMPTED_FLUSHING
    assert e.requests["b"].status == RequestStatus.PREEMPTED
    assert_drained(e)
    assert e.scheduler.stats["failed_jobs"] == 2  # the load and its poisoned store


def test_a_timed_out_load_keeps_its_blocks_out_of_the_pool_until_the_late_report() -> None:
    e = make(job_timeout_steps=3)
    seeded(e)
    hung = on_load(e, lambda eng, job, sync: eng.workers[1].hang_job(job, release_after=6))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=8)
    e.step()
    dest = e.requests["b"].load_blocks
    assert len(dest) == 4
    for _ in range(3):
        e.step()
    assert e.scheduler.stats["timed_out_jobs"] == 1
    assert set(dest) <= e.connector_held
    assert not set(dest) & set(e.free_blocks)
    b = e.requests["b"]
    assert not set(dest) & set(b.blocks)  # b recomputes in other blocks
    while hung[0] in e.scheduler.jobs.quarantine:
        assert set(dest) <= e.connector_held and not set(dest) & set(e.free_blocks)
        e.step()
    assert not e.connector_held and set(dest) <= set(e.free_blocks)
    assert_drained(e)
    assert e.stats["recomputes"] == 1 and e.done["b"].recomputes == 1


def test_a_hung_sync_load_times_out_while_its_request_runs() -> None:
    e = make(job_timeout_steps=3, sync_load_budget_bytes=10**6)
    seeded(e)
    on_load(e, lambda eng, job, sync: eng.workers[0].hang_job(job, release_after=8))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=12)
    states = []
    for _ in range(5):
        e.step()
        states.append(e.scheduler.request_state("b"))
    assert states[:3] == [R.LOADING_SYNC] * 3  # it runs while the report is lost
    assert R.TIMED_OUT in states  # timed out in a step that had scheduled it
    assert_drained(e)


def reload_while_a_timed_out_load_hangs(e: Engine) -> tuple[int, int]:
    """'b' loads PREFIX asynchronously; rank 1 withholds that load (L1) for 6 polls, past
    the 3-step timeout, so b recomputes and runs. A reset of the GPU prefix cache alone
    (vLLM's default: the connector keeps its cache) preempts b, which loads PREFIX again
    (L2) while rank 0 stalls; L1's late report comes while b waits on L2. Returns (L1, L2)."""
    seeded(e)
    hung = on_load(e, lambda eng, job, sync: eng.workers[1].hang_job(job, release_after=6))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=12)
    for _ in range(4):
        e.step()
    assert e.scheduler.request_state("b") == R.TIMED_OUT
    e.step()
    b = e.requests["b"]
    assert b.status == RequestStatus.RUNNING and hung[0] in e.scheduler.jobs.quarantine
    e.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
    e.workers[0].stall(2)
    e.step()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and b.load_job is not None
    assert b.load_job != hung[0] and hung[0] in e.scheduler.jobs.quarantine
    return hung[0], b.load_job


def test_a_timed_out_loads_late_completion_leaves_the_newer_load_to_finish() -> None:
    """`spec.request.recving_is_stale` on the data plane: the worker names b in
    finished_recving when L1 completes; the connector takes the id out, b waits for L2,
    and is promoted with the bytes L2 brought."""
    e = make(job_timeout_steps=3, sync_load_budget_bytes=0)
    old, new = reload_while_a_timed_out_load_hangs(e)
    verified = e.stats["loaded_blocks_verified"]
    e.step()  # L1's late report
    assert old not in e.scheduler.jobs.quarantine
    assert e.stats["stale_recvings"] == 1
    assert e.scheduler.get_stats()["stale_recving_ignored"] == 1
    assert e.scheduler.request_state("b") == R.LOADING_ASYNC and e.stats["loads_promoted"] == 0
    e.step()  # L2 completes on both ranks
    assert e.stats["loads_promoted"] == 1 and e.requests["b"].load_job == new
    assert e.stats["loaded_blocks_verified"] > verified
    assert_drained(e)
    assert e.done["b"].request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_timed_out_loads_late_completion_taken_for_the_newer_load_is_caught() -> None:
    """Under mutant stale-recving-promotes the connector passes L1's completion on as b's,
    and the engine, promoting b while L2 still copies, stops on it."""
    e = make(job_timeout_steps=3, sync_load_budget_bytes=0)
    reload_while_a_timed_out_load_hangs(e)
    with mutant("stale-recving-promotes").patch(), \
            pytest.raises(EngineError, match="its load ended but the connector has it in "
                                             "LOADING_ASYNC"):
        e.step()
    e.shutdown()


def test_a_hung_sync_load_of_a_request_gone_before_its_timeout_quarantines_freed_blocks(
        ) -> None:
    """A reset of the GPU prefix cache alone preempts b while its sync load's report is
    withheld, before the connector hears of it; an abort ends b; then the load times out and
    the connector quarantines its destination blocks. The copy ended with its step, so the
    core was right to free them: the engine counts them as freed before the quarantine and
    ignores their release (it used to stop: no request held the load). Found by the
    data-plane soak once it drew resets without the connector."""
    e = make(job_timeout_steps=3, sync_load_budget_bytes=10**6)
    seeded(e)
    hung = on_load(e, lambda eng, job, sync: eng.workers[0].hang_job(job, release_after=8))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=6)
    e.step()
    dest = e.requests["b"].load_blocks
    assert e.scheduler.request_state("b") == R.LOADING_SYNC and len(dest) == 4
    e.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
    e.abort("b")
    assert set(dest) <= set(e.free_blocks)  # the core freed them: the copy is over
    while hung[0] not in e.scheduler.jobs.quarantine:
        e.step()
    assert e.stats["quarantined_blocks_already_freed"] == len(dest)
    assert not e.connector_held
    assert_drained(e)


def test_an_aborted_loading_request_keeps_its_blocks_until_its_load_ends() -> None:
    e = make()
    seeded(e)
    on_load(e, lambda eng, job, sync: eng.workers[1].hang_job(job, release_after=3))
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=8)
    e.step()
    dest = e.requests["b"].load_blocks
    e.abort("b")
    assert e.scheduler.request_state("b") == R.FINISHED_PENDING_FINAL
    assert not set(dest) & set(e.free_blocks) and e.held_loads
    e.step()
    assert e.scheduler.request_state("b") == R.FINISHED_DRAINING
    assert not set(dest) & set(e.free_blocks)
    assert_drained(e)
    assert e.done["b"].request.status == RequestStatus.FINISHED_ABORTED


def test_reset_mid_run_orphans_a_load_that_still_lands() -> None:
    e = make()
    seeded(e)
    on_load(e, lambda eng, job, sync: eng.workers[1].hang_job(job, release_after=3))
    e.add_request("run", list(range(5000, 5100)), max_tokens=6)
    e.add_request("b", [*PREFIX, 4, 5, 6], max_tokens=6)
    e.step()
    assert e.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert e.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert e.scheduler.request_state("b") == R.ORPHANED_LOAD
    assert e.requests["run"].status == RequestStatus.PREEMPTED
    assert e.scheduler.fence.entries  # the in-flight load is fenced
    assert_drained(e)
    assert e.stats["loads_promoted"] >= 1 and e.scheduler.stats["reset_flushed"] >= 1


def orphan_a_load_a_rank_fails(e: Engine) -> None:
    """'b' loads PREFIX asynchronously; rank 0 fails the load, rank 1 holds it for two
    steps, and a reset orphans it; then both ranks' reports come (the load is over)."""
    seeded(e)

    def fail_and_hang(eng: Engine, job: int, sync: bool) -> None:
        eng.workers[0].fail_job(job)
        eng.workers[1].hang_job(job, release_after=2)

    on_load(e, fail_and_hang)
    e.add_request("b", [*PREFIX, *range(40)], max_tokens=4)
    e.step()
    e.reset_prefix_cache(reset_running_requests=True)
    assert e.scheduler.request_state("b") == R.ORPHANED_LOAD
    e.step()
    e.step()  # rank 1's late report: finished_recving from every rank, the load is over


def test_an_orphaned_load_that_failed_on_a_rank_is_recomputed_not_trusted() -> None:
    e = make()
    orphan_a_load_a_rank_fails(e)
    # rank 0's failure reached the connector as a stale report: it knows, not only the core
    assert e.scheduler.request_state("b") == R.RECOMPUTE
    assert e.scheduler.stats["orphaned_loads_failed"] == 1
    assert e.stats["loads_promoted"] == 0 and e.stats["recomputes"] == 1
    assert_drained(e)
    # b recomputed its prefix and stored it again: a later load gets the right bytes
    e.add_request("c", [*PREFIX, *range(40), 9], max_tokens=2)
    assert_drained(e)
    assert e.stats["loaded_blocks_verified"] >= 8


def test_a_job_completes_only_when_every_worker_reported() -> None:
    e = make(num_workers=3)
    stores: list[int] = []

    def hang_store(eng: Engine, meta: OffloadingConnectorMetadata) -> None:
        if meta.store_jobs and not stores:
            stores.append(min(meta.store_jobs))
            eng.workers[2].hang_job(stores[0], release_after=3)

    e.fault_hooks.append(hang_store)
    e.add_request("a", [*PREFIX, 1], max_tokens=8)
    e.step()
    e.step()  # the store is submitted and copied on every rank; rank 2 withholds it
    job = e.scheduler.jobs.get(stores[0])
    assert job is not None and job.state == J.PARTIALLY_ACKED and job.pending_count == 1
    assert_drained(e)
    assert e.scheduler.stats["failed_jobs"] == 0


def test_workers_and_connector_must_agree_on_the_world_size() -> None:
    e = make(num_workers=2)
    with pytest.raises(ConfigError, match="workers"):
        Engine(EngineConfig(num_workers=3, device="cpu"), workers=e.workers)


def test_under_0_34_an_orphaned_load_a_rank_failed_is_recomputed_by_the_core() -> None:
    """vLLM 0.34.0's rule (`Rules.stale_load_failure` FENCE_ONLY): the stale failure only
    drains the reset fence, the connector lets the request go IDLE as after a good load, and
    the core, hearing of it from the ranks (failed_recving), recomputes it instead of
    promoting it. Its next lookup asks the manager again."""
    e = make(rules=VLLM_0_34)
    orphan_a_load_a_rank_fails(e)
    # the connector kept no mark: the request is IDLE, and the core did not promote it
    assert e.scheduler.request_state("b") == R.IDLE
    assert e.scheduler.stats["orphaned_loads_failed"] == 0
    assert e.stats["failed_recving_recomputes"] == 1
    assert e.stats["loads_promoted"] == 0 and e.stats["recomputes"] == 1
    assert e.requests["b"].request.num_computed_tokens == 0
    lookups = e.scheduler.manager.stats["lookups"]
    e.step()  # b is admitted again: its lookup asks the manager (the spec's rule bypasses it)
    assert e.scheduler.manager.stats["lookups"] > lookups
    assert_drained(e)
    # b recomputed its prefix (the byte oracle checked every block it computed and stored)
    e.add_request("c", [*PREFIX, *range(40), 9], max_tokens=2)
    assert_drained(e)
    assert e.stats["loaded_blocks_verified"] >= 8
