"""The transitions machines built from the tables (statemachine.lifecycle)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec import job as J
from spec import request as R
from statemachine.errors import IllegalTransition, SpecMismatch
from statemachine.lifecycle import Fired, Lifecycle, Nesting
from statemachine.models import JobStatus, RequestState, ResetFence


class RecordingHost:
    """Every effect of every table, recorded with its subject key and arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def effect(subject: Any, **kwargs: Any) -> None:
            self.calls.append((name, subject.key, kwargs))

        return effect


def _requests(host: object | None = None) -> Lifecycle:
    return Lifecycle(spec.REQUEST_MACHINE, RequestState, host or RecordingHost())


def test_fire_moves_along_the_table_and_runs_effects_in_order() -> None:
    host = RecordingHost()
    life = _requests(host)
    req = RequestState("r1")
    life.add(req)
    assert req.state == R.ABSENT
    assert life.fire(req, "add") == R.IDLE
    life.fire(req, "lookup_resolved", hit_tokens=32)
    assert req.state == R.IDLE
    assert [c[0] for c in host.calls] == ["create_request_status", "restart_from_token_zero",
                                         "record_lookup_hit"]
    assert host.calls[-1] == ("record_lookup_hit", "r1", {"hit_tokens": 32})


def test_a_trigger_not_in_the_table_raises_and_changes_nothing() -> None:
    life = _requests()
    req = RequestState("r7")
    life.add(req, R.IDLE)
    with pytest.raises(IllegalTransition) as err:
        life.fire(req, "finalize")
    assert req.state == R.IDLE
    e = err.value
    assert (e.machine, e.key, e.state, e.trigger) == ("request", "r7", R.IDLE, "finalize")
    assert "r7" in str(e) and "IDLE" in str(e) and "finalize" in str(e)
    assert "finish" in e.allowed


def test_guards_choose_the_destination() -> None:
    life = _requests()
    req = RequestState("r1")
    life.add(req, R.STORING)
    req.transfer_jobs = {4}
    life.fire(req, "store_ended")
    assert req.state == R.STORING
    req.transfer_jobs = set()
    life.fire(req, "store_ended")
    assert req.state == R.RUNNING


def test_all_guards_failing_raises_instead_of_silently_staying() -> None:
    life = _requests()
    req = RequestState("r2")
    life.add(req, R.IDLE)
    req.transfer_jobs = {9}  # the #48102 shape: a load must not be created now
    with pytest.raises(IllegalTransition, match="has_transfer_jobs=True"):
        life.fire(req, "load_async")
    assert req.state == R.IDLE


def test_job_guard_reads_the_report_count() -> None:
    owner = RequestState("r1")
    life = Lifecycle(spec.JOB_MACHINE, JobStatus, RecordingHost())
    job = JobStatus(0, owner, "store", num_workers=3)
    life.add(job, J.SHIPPED)
    life.fire(job, "ack", count=1)
    assert job.state == J.PARTIALLY_ACKED
    job.pending_count = 2
    life.fire(job, "ack", count=2)
    assert job.state == J.COMPLETED


def test_no_auto_transitions_exist() -> None:
    life = _requests()
    req = RequestState("r1")
    life.add(req)
    assert not hasattr(req, "to_RUNNING")
    assert set(life.machine.events) == set(spec.REQUEST_MACHINE.triggers)


def test_one_machine_serves_many_subjects() -> None:
    """Subjects are moved through the machine's events without being registered as its
    models: nothing is bound onto them, and their number costs the machine nothing."""
    life = _requests()
    reqs = [RequestState(f"r{i}") for i in range(50)]
    before = set(vars(reqs[0]))
    for r in reqs:
        life.add(r)
    for r in reqs[::2]:
        life.fire(r, "add")
    assert [r.state for r in reqs[:4]] == [R.IDLE, R.ABSENT, R.IDLE, R.ABSENT]
    assert len(life.machine.models) == 0
    assert set(vars(reqs[0])) == before
    assert not hasattr(reqs[0], "add") and not hasattr(reqs[0], "is_IDLE")


def test_missing_guard_or_effect_fails_at_build_time() -> None:
    class NoGuards:
        state: str

    with pytest.raises(SpecMismatch, match="other_jobs_remain"):
        Lifecycle(spec.REQUEST_MACHINE, NoGuards, RecordingHost())

    class NoEffects:
        pass

    with pytest.raises(SpecMismatch, match="create_request_status"):
        Lifecycle(spec.REQUEST_MACHINE, RequestState, NoEffects())


def test_a_subject_method_named_like_a_trigger_is_harmless() -> None:
    """Nothing is bound onto a subject, so its own methods never clash with triggers."""

    class Finishing(RequestState):
        def finish(self) -> str:
            return "mine"

    life = Lifecycle(spec.REQUEST_MACHINE, Finishing, RecordingHost())
    req = Finishing("r")
    life.add(req)
    life.fire(req, "add")
    life.fire(req, "finish")
    assert req.state == R.FINISHED_PENDING_FINAL and req.finish() == "mine"


def test_observers_see_every_transition_with_its_depth() -> None:
    nesting = Nesting()
    seen: list[Fired] = []
    nesting.observers.append(seen.append)
    fence_life = Lifecycle(spec.FENCE_MACHINE, ResetFence, RecordingHost(), nesting)
    fence = ResetFence()
    fence_life.add(fence)
    fence_life.fire(fence, "reset", live_jobs=2)
    assert seen == [Fired("fence", "reset_fence", "reset", "FENCE_IDLE", "FENCE_HELD", 0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.booleans()), max_size=40))
def test_random_walk_never_leaves_the_table(steps: list[tuple[int, bool, bool]]) -> None:
    """Whatever is fired, every observed move is an edge of the table."""
    life = _requests()
    req = RequestState("r")
    life.add(req)
    edges = {(s, d, t.trigger) for s, d, t in spec.REQUEST_MACHINE.edges()}
    triggers = spec.REQUEST_MACHINE.triggers
    for pick, holds_jobs, invalid in steps:
        req.transfer_jobs = {1} if holds_jobs else set()
        req.loaded_tokens_invalid = invalid
        trig = triggers[pick % len(triggers)]
        before = req.state
        try:
            after = life.fire(req, trig)
        except IllegalTransition:
            assert req.state == before
            continue
        assert (before, after, trig) in edges
