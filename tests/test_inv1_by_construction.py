"""INV-1 from the tables alone: no transition can leave a request holding an id that is not in
the job table (the PR #48102 shape). Behaviour is checked again by the invariant checker."""

from __future__ import annotations

import dataclasses

import spec
from spec import job as J
from spec import request as R


def _leaves_table(m: spec.MachineSpec) -> list[tuple[str, str, str]]:
    """Job edges from a live state to a non-live state without `leave_job_table`."""
    return [(src, dst, t.trigger) for src, dst, t in m.edges()
            if src in J.IN_TABLE and dst not in J.IN_TABLE
            and "leave_job_table" not in t.effects]

def test_every_job_exit_from_the_table_removes_it_from_its_owner() -> None:
    assert _leaves_table(spec.JOB_MACHINE) == []

def test_the_effect_that_leaves_the_table_names_both_sides() -> None:
    meaning = {e.name: e.meaning for e in spec.JOB_MACHINE.effects}["leave_job_table"]
    assert "_jobs" in meaning and "transfer_jobs" in meaning

def test_job_reset_leaves_the_table() -> None:
    rows = [t for t in spec.JOB_MACHINE.transitions if t.trigger == "reset"]
    assert rows and all("leave_job_table" in t.effects and t.dest == J.STALE for t in rows)
    assert set(J.LIVE) <= {s for t in rows for s in t.sources}

def resets_keeping_jobs(m: spec.MachineSpec) -> list[spec.Transition]:
    """Request resets from a state that may hold jobs, without dropping them."""
    return [t for t in m.transitions if t.trigger == "reset"
            and set(R.MAY_HOLD_JOBS) & set(t.sources) and "drop_request_jobs" not in t.effects]

def test_every_request_reset_from_a_state_that_may_hold_jobs_drops_them() -> None:
    assert resets_keeping_jobs(spec.REQUEST_MACHINE) == []

def test_a_48102_table_is_caught() -> None:
    """The bug, written as a table: reset keeps the requests' transfer_jobs."""
    buggy = dataclasses.replace(spec.REQUEST_MACHINE, transitions=tuple(
        dataclasses.replace(t, effects=tuple(e for e in t.effects if e != "drop_request_jobs"))
        for t in spec.REQUEST_MACHINE.transitions))
    caught = resets_keeping_jobs(buggy)
    assert {s for t in caught for s in t.sources} >= {R.STORING, R.FINISHED_DRAINING}
