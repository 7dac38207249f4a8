"""vLLM's real core Scheduler with the offloading connector, driven by
`conformance.core_scheduler` (the engine loop and the workers played by the harness).

On every release: the end-to-end scenario preempts, stores, loads a shared prefix from the
CPU cache, decodes and resets mid-run with a store in flight; a connector named by
`kv_connector_module_path` is the one the Scheduler builds; two workers' acks of one job
may come in different steps. Per release: 0.26+ finish every request and leave nothing in
the connector. With the PR #48102 bug, the request preempted with the store in flight keeps
a job id the connector's job table no longer has: 0.24-0.25 defer its lookups for ever (it
waits, never runs again); 0.22-0.23 do not defer a request with jobs in flight, so the
Scheduler admits it again and its next store raises KeyError on the stale id inside
`build_connector_meta` (feature lookup_defers_in_flight). With one worker (a running holder
at the reset) every buggy release raises that KeyError.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import conformance.vllm_env  # noqa: F401  (before vLLM: offline, quiet, temporary caches)

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from conformance.core_scheduler import (
    SCENARIO_GPU_BLOCKS,
    SHARED_PREFIX_BLOCKS,
    CoreDriver,
    CoreRun,
    RunSummary,
    make_core_scheduler,
    reset_outcome,
    scenario,
    scenario_requests,
)

pytestmark = pytest.mark.conformance

OUTCOME = reset_outcome()
FIXED = OUTCOME == "finishes"
"""0.26.0 clears each request's `transfer_jobs` in `reset_cache` (PR #48102)."""
CPU_CHUNKS = 64  # room for every block of the scenario: nothing is evicted from the CPU


class CountingConnector(OffloadingConnector):  # type: ignore[misc]
    """A trivial subclass, loaded the way an operator loads one
    (`kv_connector_module_path` + class name): counts the Scheduler's hook calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        self._count("get_num_new_matched_tokens")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._count("build_connector_meta")
        return super().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._count("update_connector_output")
        super().update_connector_output(connector_output)


def _scenario_run(num_workers: int) -> tuple[CoreRun, RunSummary]:
    run = make_core_scheduler(num_gpu_blocks=SCENARIO_GPU_BLOCKS, num_cpu_chunks=CPU_CHUNKS,
                              num_workers=num_workers)
    return run, scenario(run, seed=0)


@pytest.fixture(scope="module")
def two_workers() -> tuple[CoreRun, RunSummary]:
    return _scenario_run(2)


def _scheduled_after(summary: RunSummary, req_id: str, step: int) -> list[int]:
    return [r.step for r in summary.records if r.step >= step and req_id in r.scheduled]


# ----------------------------------------------------------------------------- every release
def test_scenario_exercises_the_lifecycle(two_workers: tuple[CoreRun, RunSummary]) -> None:
    run, summary = two_workers
    assert summary.preemptions >= 1
    assert summary.stores
    # decoding: requests sampled several tokens, one a step
    assert max(len(t) for t in summary.output_tokens.values()) >= 5
    # one reset, mid-run, with a store in flight held by a request the Scheduler preempted
    (reset,) = summary.resets
    assert reset.in_flight and set(reset.in_flight) <= set(summary.stores)
    assert 0 < reset.after_step < summary.steps
    assert set(reset.holders.values()) == {"PREEMPTED"}
    if OUTCOME == "crashes":
        return  # the rest of the scenario is cut short (test_buggy_release_crashes_...)
    assert summary.error is None, summary.error
    # a request sharing the prefix loads part of it from the CPU cache
    shared = {r.req_id for r in scenario_requests(run.block_size) if r.shares_prefix}
    spans = {j: span for rec in summary.records for j, span in rec.load_spans.items()}
    prefix_loads = [j for j, req in summary.loads.items()
                    if req in shared and spans[j][0] < SHARED_PREFIX_BLOCKS]
    assert prefix_loads, summary.loads
    # a load is acknowledged with the request's finished_recving once every worker is done
    assert any(rec.finished_recving for rec in summary.records)
    assert [r for r in summary.finished
            if any(r in rec.finished for rec in summary.records[reset.after_step:])]
    # its job was half acknowledged before the reset, the other half after it
    for job in reset.in_flight:
        steps = [rec.step for rec in summary.records if job in rec.acks]
        assert len(steps) == 2 and steps[0] < reset.after_step <= steps[1], (job, steps)


def test_scenario_is_deterministic(two_workers: tuple[CoreRun, RunSummary]) -> None:
    _, summary = two_workers
    _, again = _scenario_run(2)
    assert again.records == summary.records
    assert again.resets == summary.resets
    assert again.output_tokens == summary.output_tokens


def test_module_path_builds_the_subclass() -> None:
    run = make_core_scheduler(num_gpu_blocks=16, num_cpu_chunks=8,
                              kv_connector="CountingConnector",
                              kv_connector_module_path=__name__)
    assert type(run.connector) is CountingConnector
    assert run.scheduler.get_kv_connector() is run.connector
    assert run.vllm_config.kv_transfer_config.kv_connector_module_path == __name__
    driver = CoreDriver(run)
    driver.add_request("a", list(range(3, 3 + 40)), max_tokens=3)
    summary = driver.run_until_idle(50)
    assert summary.idle and summary.finished == ["a"]
    assert summary.stores
    calls = run.connector.calls
    assert calls["get_num_new_matched_tokens"] == 1
    assert calls["build_connector_meta"] == calls["update_connector_output"] == summary.steps


def test_two_workers_acks_split_across_steps() -> None:
    run = make_core_scheduler(num_gpu_blocks=32, num_cpu_chunks=CPU_CHUNKS, num_workers=2)
    driver = CoreDriver(run, seed=3)
    for i in range(4):
        driver.add_request(f"q{i}", list(range(100 * i + 3, 100 * i + 3 + 40 + 9 * i)),
                           max_tokens=20)
    jobs = run.offloading._jobs
    acked: dict[int, int] = {}
    seen_half_done = False
    while not driver.idle():
        assert driver.step_count < 100
        rec = driver.step()
        for job, count in rec.acks.items():
            acked[job] = acked.get(job, 0) + count
            if acked[job] == 1:  # one worker of two so far: the job waits for the other
                assert jobs[job].pending_count == 1
                seen_half_done = True
            else:
                assert job not in jobs
    summary = driver.summary()
    assert seen_half_done
    split, together = set(summary.split_jobs), set(summary.stores) - set(summary.split_jobs)
    assert split and together
    ack_steps: dict[int, list[int]] = {}
    for rec in summary.records:
        for job, count in rec.acks.items():
            ack_steps.setdefault(job, []).extend([rec.step] * count)
    for job in split:
        first, second = ack_steps[job]
        assert second == first + 1
    for job in together:
        first, second = ack_steps[job]
        assert first == second
    assert sorted(summary.finished) == [f"q{i}" for i in range(4)]
    assert not run.offloading._req_status and not jobs


# ----------------------------------------------------------------------------- per release
@pytest.mark.skipif(not FIXED, reason="the PR #48102 bug (0.22-0.25) strands or crashes")
def test_fixed_release_finishes_everything(two_workers: tuple[CoreRun, RunSummary]) -> None:
    run, summary = two_workers
    assert summary.idle and summary.error is None and not summary.stuck
    requests = scenario_requests(run.block_size)
    assert sorted(summary.finished) == sorted(r.req_id for r in requests)
    for r in requests:
        assert len(summary.output_tokens[r.req_id]) == r.max_tokens
    offloading = run.offloading
    assert not offloading._req_status and not offloading._jobs
    assert not getattr(offloading, "_reset_fence", {})
    # the request preempted with the store in flight ran again after the reset
    (reset,) = summary.resets
    for req_id in reset.holders:
        assert _scheduled_after(summary, req_id, reset.after_step)


@pytest.mark.skipif(OUTCOME != "crashes",
                    reason="0.26+ clear transfer_jobs at a reset; 0.24-0.25 defer the holder")
def test_buggy_release_crashes_on_the_stale_id_after_the_reset(
        two_workers: tuple[CoreRun, RunSummary]) -> None:
    """0.22-0.23: the preempted holder is admitted again (its lookup is not deferred), and
    the first store job built for it finds the stale id in its transfer_jobs."""
    run, summary = two_workers
    (reset,) = summary.resets
    (holder,) = reset.holders
    error = summary.error
    assert error is not None and error.hook == "connector.build_connector_meta", error
    assert "kv_connector/v1/offloading/scheduler.py:" in error.where
    assert isinstance(error.error, KeyError)
    assert error.error.args[0] in reset.in_flight
    assert reset.in_flight[error.error.args[0]] == holder
    assert error.step > reset.after_step
    assert not summary.idle and holder not in summary.finished
    # the stale id is still in the holder's transfer_jobs, and not in the job table
    status = run.offloading._req_status[holder]
    assert error.error.args[0] in status.transfer_jobs
    assert error.error.args[0] not in run.offloading._jobs


@pytest.mark.skipif(OUTCOME != "strands",
                    reason="0.26+ clear transfer_jobs at a reset; 0.22-0.23 crash instead")
def test_buggy_release_strands_a_request(two_workers: tuple[CoreRun, RunSummary]) -> None:
    run, summary = two_workers
    (reset,) = summary.resets
    assert summary.error is None and not summary.idle
    # exactly the request that held the store at the reset is left, and never ran again
    (holder,) = reset.holders
    held = sorted(j for j, r in reset.in_flight.items() if r == holder)
    assert summary.unfinished == [holder] and list(summary.stuck) == [holder]
    stuck = summary.stuck[holder]
    assert stuck.status == "PREEMPTED"
    assert stuck.transfer_jobs == stuck.stale_jobs == held
    offloading = run.offloading
    assert not set(held) & set(offloading._jobs)
    assert sorted(offloading._req_status[holder].transfer_jobs) == held
    assert _scheduled_after(summary, holder, reset.after_step) == []
    assert stuck.idle_steps >= summary.steps - reset.after_step
    # every other request finished; the Scheduler keeps the holder waiting
    assert sorted(summary.finished) == sorted(
        r.req_id for r in scenario_requests(run.block_size) if r.req_id != holder)
    assert run.scheduler.has_requests()
    # the connector's answer every step: not yet (None), for ever
    request = run.scheduler.requests[holder]
    assert run.connector.get_num_new_matched_tokens(request, 0) == (None, False)


def test_one_worker_reset_with_a_running_holder() -> None:
    """One worker: the reset falls on a running request's store in flight."""
    run, summary = _scenario_run(1)
    (reset,) = summary.resets
    assert "RUNNING" in reset.holders.values() and not summary.split_jobs
    if FIXED:
        assert summary.idle and summary.error is None
        assert not run.offloading._req_status and not run.offloading._jobs
        return
    # 0.22-0.25: the running request still holds the stale id at its next store
    error = summary.error
    assert error is not None and error.hook == "connector.build_connector_meta"
    assert "kv_connector/v1/offloading/scheduler.py:" in error.where
    assert isinstance(error.error, KeyError)
    assert error.error.args[0] in reset.in_flight
    assert error.step == reset.after_step
