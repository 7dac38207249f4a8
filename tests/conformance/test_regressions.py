"""The directed programs of `spec.regressions` against vLLM's own scheduler side: refinement,
every invariant after every hook (inside steps too) and the drain, as for the reference; and,
on a release with every feature the spec describes, the program's own path."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from spec import model as M
from spec.regressions import REGRESSIONS, Regression, by_name
from spec.witnesses import Witness

pytestmark = pytest.mark.conformance


def _requests(s: M.ModelState) -> list[tuple[str, str, tuple[int, ...], int | None]]:
    """What a program's path is made of: each request's state, jobs and store cursor."""
    return [(r.id, r.state, tuple(sorted(r.transfer_jobs)), r.store_cursor)
            for r in M.abstract(s).requests]


def _bounds(reg: Regression | Witness) -> M.Bounds:
    """The program's bounds under the rules it replays under on the vLLM under test
    (`adapter.program_rules`)."""
    from conformance.adapter import program_rules

    return replace(reg.bounds, rules=program_rules(reg.bounds))


def _replay_on_vllm(reg: Regression) -> list[M.ModelState]:
    """`statemachine.testing.replay` on vLLM's connector: the path vLLM took, every event of
    the program taken."""
    from conformance.adapter import VLLMMachine
    from statemachine.testing import replay

    path = replay(reg.events(), _bounds(reg), VLLMMachine)
    assert len(path) == len(reg.events()), "an event of the program was not taken"
    return path


def _unfailable(reg: Regression | Witness, spec_path: list[M.ModelState]) -> str | None:
    """The restriction that keeps one of the program's failure reports off vLLM, if any
    (`spec_path`: the spec's state after each event)."""
    from conformance.adapter import unfailable_in_vllm

    before = [M.initial(_bounds(reg)), *spec_path]
    return next((why for ev, s in zip(reg.events(), before, strict=False)
                 if (why := unfailable_in_vllm(s, ev))), None)


@pytest.mark.parametrize("reg", REGRESSIONS, ids=[r.name for r in REGRESSIONS])
def test_regression_replays_clean_on_vllm(vllm_ready: Any, reg: Regression) -> None:
    """Clean on vLLM; on a release with every feature the spec describes, also along the
    program's own path (a program that passes on a path of vLLM's choosing, another
    eviction say, would not test on vLLM what it says)."""
    if vllm_ready.vllm_version() < (0, 26, 0):
        pytest.skip("the programs use preemption and finish, which the 0.22-0.25 machine "
                    "leaves out")
    if reg.bounds.timeout_steps is not None:
        pytest.skip("a job times out: vLLM's connector has no timeout (the path is beyond "
                    "vLLM)")
    from conformance.releases import FEATURES, features
    from spec.checker import replay

    spec_path = [step.state for step in replay(_bounds(reg), reg.events(),
                                               canonical_ids=False)]
    if any(ev.kind == "report" and ev.failed for ev in reg.events()):
        if not vllm_ready.has("failure_reports"):
            pytest.skip("a failed report: this vLLM's connector has none (the machine "
                        "takes no worker failures, CONFORMANCE.md)")
        restriction = _unfailable(reg, spec_path)
        if restriction:
            pytest.skip(f"a failure vLLM 0.34 takes otherwise ({restriction}, "
                        "CONFORMANCE.md)")
    path = _replay_on_vllm(reg)
    if features(vllm_ready.vllm_version()) != set(FEATURES):
        return  # an older release: its own choices (an LRU order, say) may take another path
    for ev, ours, theirs in zip(reg.events(), spec_path, path, strict=True):
        assert _requests(theirs) == _requests(ours), f"vLLM left the program's path at {ev}"
    # refinement held vLLM's chunks to this state's after every hook: vLLM's tier is the pin
    assert path[-1].tier() == reg.tier


def test_an_evicted_loaded_state_is_stored_while_waiting_and_the_reset_rewinds_the_cursor(
        vllm_ready: Any) -> None:
    """The program that kills `reset(WAITING_STORING)->IDLE drop reset_store_cursor` takes
    the same path on vLLM's connector, whose LRU picks the victims the model follows: r1's
    stores evict the Mamba state r2 loaded, the core reaches r2 without scheduling it and
    vLLM stores the state again, so r2 waits with the store in flight and its store cursor
    past the loaded chunk; the reset puts that cursor back to 0, as the row says."""
    reg = by_name("evicted-loaded-state-stored-while-waiting-then-reset")
    seen = {str(ev): {r[0]: (r[1], r[3]) for r in _requests(s)}
            for ev, s in zip(reg.events(), _replay_on_vllm(reg), strict=True)}
    assert seen["promote(r2)"]["r2"] == ("WAITING_STORING", 1)
    assert seen["reset()"]["r2"] == ("IDLE", 0)


def test_a_request_whose_load_failed_never_loads_again(vllm_ready: Any) -> None:
    """`spec.rules.FailedLoadLookup` on vLLM (once the restriction FAILED-LOAD-STICKY): after
    `failed-store-and-async-load`, r1 (whose async load failed, then recomputed and stored)
    is preempted and admitted again. vLLM 0.34 answers 0, since `load_failed` holds for the
    request's life: the spec under 0.34.0's rules (FOR_LIFE) conforms; under the rule before
    it (ONCE) the spec asks the manager and hits two chunks. This test fails once vLLM
    retries a load."""
    from conformance.adapter import RELEASE_RULES, VLLMMachine
    from spec.rules import FailedLoadLookup
    from statemachine.testing import RefinementError, replay

    if not vllm_ready.has("failure_reports"):
        pytest.skip("this vLLM has no failure report")
    assert RELEASE_RULES.failed_load_lookup is FailedLoadLookup.FOR_LIFE
    reg = by_name("failed-store-and-async-load")
    events = reg.events() + M.parse_events(
        "preempt(r1) ; step() ; ack(job 4, count 2) ; step(admit=r1)")
    path = replay(events, _bounds(reg), VLLMMachine)
    assert len(path) == len(events)
    once = replace(_bounds(reg), rules=replace(RELEASE_RULES,
                                               failed_load_lookup=FailedLoadLookup.ONCE))
    with pytest.raises(RefinementError, match=r"answered \(0, False\), the model \(2, True\)"):
        replay(events, once, VLLMMachine)


@pytest.mark.parametrize(("program", "marked_at"), [
    ("orphaned-load-fails-then-hits", "fail(job 1, count 1)"),
    ("failing-load-orphaned-then-hits", "reset()")])
def test_a_stale_load_s_failure_is_left_to_the_core(vllm_ready: Any, program: str,
                                                    marked_at: str) -> None:
    """`spec.rules.StaleLoadFailure` on vLLM (once the restriction STALE-LOAD-FAILURE): a
    reset orphans r1's async load, which one worker fails after the reset or before it.
    vLLM 0.34 only counts the failure against the fence (or forgets it with the job), its
    core recomputes r1 on failed_recving, and r1's next lookup asks the manager and hits:
    the spec under 0.34.0's rules (FENCE_ONLY) conforms; under its own rule
    (INVALIDATES_REQUEST) the spec marks the orphaned r1's loaded tokens invalid, where
    vLLM keeps no mark. This test fails once vLLM marks such a request."""
    from conformance.adapter import RELEASE_RULES, VLLMMachine
    from spec.rules import StaleLoadFailure
    from statemachine.testing import RefinementError, replay

    if not vllm_ready.has("failure_reports"):
        pytest.skip("this vLLM has no failure report")
    assert RELEASE_RULES.stale_load_failure is StaleLoadFailure.FENCE_ONLY
    reg = by_name(program)
    path = replay(reg.events(), _bounds(reg), VLLMMachine)
    assert len(path) == len(reg.events())
    r1 = {r[0]: r for r in _requests(path[7])}["r1"]  # after the load's last report
    assert r1[1] == "IDLE"
    marked = replace(_bounds(reg), rules=replace(
        RELEASE_RULES, stale_load_failure=StaleLoadFailure.INVALIDATES_REQUEST))
    with pytest.raises(RefinementError,
                       match=re.escape(f"{marked_at}: the implementation left the model")):
        replay(reg.events(), marked, VLLMMachine)
