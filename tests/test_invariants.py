"""Each safety invariant holds on a healthy state and names the culprit on a broken one."""

from __future__ import annotations

from dataclasses import replace

import pytest

import spec
from spec import job as J
from spec import request as R
from spec.invariants import check
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord

W = 2


def healthy() -> AbstractState:
    """Two requests: r1 storing chunks 10, 11 from blocks 0, 1; r2 loading chunk 20 async."""
    store = JobRecord(5, "store", "r1", J.SHIPPED, W, keys=frozenset({10, 11}),
                      blocks=frozenset({0, 1}))
    load = JobRecord(6, "load", "r2", J.PARTIALLY_ACKED, 1, keys=frozenset({20}),
                     blocks=frozenset({4}))
    return AbstractState(
        num_workers=W,
        requests=(RequestRecord("r1", R.STORING, frozenset({5}), gpu_blocks=(0, 1)),
                  RequestRecord("r2", R.LOADING_ASYNC, frozenset({6}), gpu_blocks=(4,))),
        jobs=(store, load),
        job_counter=7,
        stale_threshold=3,
        reset_fence=(HeldJob(1, "store", 1, flushed=True),),
        chunks_being_loaded=frozenset({20}),
        chunk_ref_cnt=((10, -1), (11, -1), (20, 1), (30, 0)),
    )


def ids(state: AbstractState) -> set[str]:
    return {v.invariant for v in check(state)}


def test_the_healthy_state_satisfies_every_invariant() -> None:
    assert check(healthy()) == []


def test_inv1_the_48102_state() -> None:
    s = healthy()
    r1 = replace(s.requests[0], transfer_jobs=frozenset({5, 2}))
    bad = replace(s, requests=(r1, s.requests[1]))
    v = [x for x in check(bad) if x.invariant == "INV-1"]
    assert len(v) == 1 and v[0].request == "r1" and v[0].jobs == (2,)
    assert "INV-1" in str(v[0]) and "'r1'" in str(v[0]) and "job 2" in str(v[0])


def _break(name: str) -> AbstractState:
    s = healthy()
    store, load = s.jobs
    r1, r2 = s.requests
    cases = {
        "INV-2": replace(s, requests=(replace(r1, transfer_jobs=frozenset()), r2)),
        "INV-3": replace(s, requests=(r1, replace(r2, transfer_jobs=frozenset({5, 6})))),
        "INV-4": replace(s, jobs=(replace(store, id=2), load),
                         requests=(replace(r1, transfer_jobs=frozenset({2})), r2)),
        "INV-5": replace(s, jobs=(replace(store, pending_count=3), load)),
        "INV-6": replace(s, requests=(r1, replace(r2, transfer_jobs=frozenset({6, 5})))),
        "INV-7": replace(s, block_fence=((0, frozenset({6})),)),
        "INV-8": replace(s, chunks_being_loaded=frozenset({20, 21})),
        "INV-9": replace(s, jobs=(replace(store, state=J.CREATED), load)),
        "INV-10": replace(s, requests=(replace(r1, finished_signaled=True), r2)),
        "INV-11": replace(s, finished_signals=(("r1", 2),)),
        "INV-12": replace(s, chunk_ref_cnt=((10, -1), (11, 0), (20, 1), (30, 0))),
        "INV-15": replace(s, requests=(replace(r1, gpu_blocks=(0,)),
                                       replace(r2, gpu_blocks=(4, 1)))),
        "INV-16": replace(s, jobs=(store, replace(load, keys=frozenset({10})))),
        "INV-16b": replace(s, reset_fence=(HeldJob(1, "store", 1),)),
        "INV-17": replace(s, reset_fence=(HeldJob(5, "store", 1, flushed=True),),
                          stale_threshold=7),
        "INV-18": replace(s, requests=(r1, replace(r2, lookup_hit_pending=True))),
        "INV-19": replace(s, requests=(replace(r1, load_invalid=True), r2)),
        "INV-20": replace(s, invalid_chunks=frozenset({20, 30})),
        "INV-21": replace(s, reset_since_last_step=True,
                          requests=(replace(r1, store_cursor=2), r2)),
        "INV-22": replace(s, misplaced_chunks=frozenset({20})),
        "INV-23": replace(s, unwritten_reads=frozenset({20})),
        "INV-24": replace(s, requests=(replace(r1, state=R.RUNNING), r2)),
        "INV-24b": replace(s, requests=(r1, replace(r2, state=R.WAITING_STORING,
                                                    transfer_jobs=frozenset()))),
    }
    return cases[name]


SAFETY_IDS = [i.id for i in spec.SAFETY]


@pytest.mark.parametrize("inv", [i for i in SAFETY_IDS if i != "INV-1"])
def test_each_invariant_detects_its_violation(inv: str) -> None:
    assert inv in ids(_break(inv))


def test_a_state_that_holds_a_job_holding_none_breaks_inv24() -> None:
    """The other half of INV-24: WAITING_STORING says a store is in flight; with no job
    (its store never made), the request would wait for an end no report brings."""
    (v,) = [x for x in check(_break("INV-24b")) if x.invariant == "INV-24"]
    assert v.request == "r2" and "WAITING_STORING holds no job" in str(v)


def test_an_unflushed_pre_reset_job_is_a_cpu_safety_violation() -> None:
    assert "INV-16" in ids(_break("INV-16b"))


def test_a_poisoned_store_of_an_invalidated_request_is_allowed() -> None:
    s = healthy()
    store, load = s.jobs
    r1, r2 = s.requests
    assert store.owner == r1.id
    poisoned = replace(s, requests=(replace(r1, load_invalid=True), r2),
                       jobs=(replace(store, failed=True, state=J.FAILING), load))
    assert "INV-19" not in ids(poisoned)


def test_invalid_kv_is_a_violation_only_once_ready() -> None:
    s = healthy()
    # chunk 20 is being loaded (ref_cnt 1) and 30 is ready (0); 10 is still being stored (-1)
    bad = replace(s, invalid_chunks=frozenset({10, 30}))
    v = [x for x in check(bad) if x.invariant == "INV-20"]
    assert [x.message.split()[1] for x in v] == ["30"]


def test_the_store_cursor_counts_only_between_a_reset_and_the_next_step() -> None:
    s = healthy()
    r1, r2 = s.requests
    moved = replace(s, requests=(replace(r1, store_cursor=2), r2))
    assert "INV-21" not in ids(moved)
    assert "INV-21" not in ids(replace(moved, reset_since_last_step=True, step_open=True))
    assert "INV-21" in ids(replace(moved, reset_since_last_step=True))


def test_every_invariant_is_named() -> None:
    assert [i.id for i in spec.INVARIANTS] == [f"INV-{n}" for n in range(1, 25)]
    progress = {i.id for i in spec.INVARIANTS if i.is_progress}
    assert progress == {"INV-13", "INV-14"}
    covered = {inv for p in spec.PROGRESS for inv in p.invariant.split(", ")}
    assert progress <= covered


def test_progress_waiting_conditions_tell_quiescent_from_busy() -> None:
    from spec import model as M
    from spec.progress import by_id as progress

    bounds = M.Bounds(requests=1, tokens=1)
    quiet = M.initial(bounds)
    busy = quiet
    for ev in M.parse_events("arrive(r0) ; step(admit=r0) ; step()"):
        busy = M.apply(busy, ev)[0]
    assert busy.jobs, "the step after admission ships r0's store"
    assert not progress("P-1").waiting(quiet) and progress("P-1").waiting(busy)
    assert not progress("P-3").waiting(quiet) and progress("P-3").waiting(busy)
    assert progress("P-4").waiting(busy, "r0") and not progress("P-4").waiting(quiet, "r0")


def test_refinement_leaves_out_a_cursor_the_implementation_does_not_expose() -> None:
    from statemachine.testing import unobserved_as_in

    s = healthy()
    r1, r2 = s.requests
    model = replace(s, requests=(replace(r1, store_cursor=2), replace(r2, store_cursor=1)))
    impl = replace(s, requests=(replace(r1, store_cursor=None), replace(r2, store_cursor=3)))
    masked = unobserved_as_in(impl, model)
    assert [r.store_cursor for r in masked.requests] == [None, 1]  # r2's 3 vs 1 still differs
    assert unobserved_as_in(model, model) is model
