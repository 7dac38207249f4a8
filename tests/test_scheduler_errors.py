"""Typed errors: API calls the table forbids, bad configuration, and an invariant violation
caught at the hook that causes it (the PR #48102 fault, injected)."""

from __future__ import annotations

from typing import Any

import pytest

from spec import request as R
from statemachine.config import OffloadingConfig
from statemachine.effects import SchedulerEffects
from statemachine.errors import ConfigError, IllegalTransition, InvariantViolation
from statemachine.messages import NewRequestData
from statemachine.models import RequestState
from statemachine.scheduler import OffloadingScheduler
from tests.driver import Driver


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"blocks_per_chunk": 1.5}, "blocks_per_chunk"),
    ({"num_workers": 0}, "num_workers"),
    ({"eviction_policy": "fifo"}, "eviction_policy"),
    ({"sync_load_budget_bytes": 10}, "needs kv_bytes_per_token"),
    ({"job_timeout_steps": 0}, "job_timeout_steps"),
    ({"kv_bytes_per_token": -1}, "kv_bytes_per_token"),
])
def test_bad_config_is_a_typed_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadingConfig(**kwargs)


def test_scheduling_a_deferred_request_is_illegal_and_changes_nothing() -> None:
    d = Driver.make()
    d.add("a", 40)
    d.admit("a")  # a's stores are pending
    d.add("b", 40)
    d.s.get_num_new_matched_tokens(d.reqs["b"], 0)
    assert d.state("b") == R.LOOKUP_DEFERRED
    d.build()
    with pytest.raises(IllegalTransition, match="'b' in state LOOKUP_DEFERRED: trigger "
                                                "'schedule'"):
        d.build(new=[NewRequestData("b", (50, 51))], sched={"b": 40})


def test_alloc_for_a_loading_request_is_illegal() -> None:
    d = Driver.make()
    d.add("seed", 40)
    _, _, meta = d.admit("seed")
    d.ack_all(meta.store_jobs)
    d.add("b", 40)
    d.admit("b")
    assert d.state("b") == R.LOADING_ASYNC
    before = d.s.abstract_state()
    with pytest.raises(IllegalTransition, match="LOADING_ASYNC: trigger 'lookup_resolved'"):
        d.s.get_num_new_matched_tokens(d.reqs["b"], 0)
    with pytest.raises(IllegalTransition, match="LOADING_ASYNC: trigger 'load_async'"):
        d.s.update_state_after_alloc(d.reqs["b"], [1, 2, 3], 32)
    assert d.s.abstract_state() == before


class KeepsTransferJobs(SchedulerEffects):
    def drop_request_jobs(self, req: RequestState, **_: Any) -> None:
        for job_id in sorted(req.transfer_jobs):
            job = self.s.jobs.get(job_id)
            if job is not None:
                saved = set(req.transfer_jobs)
                self.s._fire(self.s._jobs_life, job, "reset")
                req.transfer_jobs |= saved  # the bug: the ids stay


class ResetKeepsTransferJobs(OffloadingScheduler):
    """vLLM before PR #48102: reset_cache leaves the ids in transfer_jobs."""

    effects_cls = KeepsTransferJobs


def test_the_48102_fault_is_caught_at_reset_cache_naming_request_and_job() -> None:
    d = Driver(OffloadingConfig(num_workers=2))
    d.s = ResetKeepsTransferJobs(d.config)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    with pytest.raises(InvariantViolation) as err:
        d.s.reset_cache()
    e = err.value
    assert e.invariant == "INV-1" and e.request == "a" and e.jobs == (jid,)
    assert "reset_cache()" in e.event and "STORING --reset--> RUNNING" in e.event


def test_checking_can_be_switched_off() -> None:
    d = Driver(OffloadingConfig(check_invariants=False))
    d.s = ResetKeepsTransferJobs(d.config)
    d.add("a", 40)
    d.admit("a")
    d.s.reset_cache()  # no check: the fault goes unnoticed until asked
    with pytest.raises(InvariantViolation, match="INV-1"):
        d.s.check_invariants()
