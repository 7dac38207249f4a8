"""The model-based machine of `statemachine.testing` against vLLM's scheduler-side connector.

- vLLM 0.26+ (0.33.0 pinned): refinement after every step, every invariant, the drain; at
  least 2,000 model steps in one run; the same with a hybrid KV cache (a full-attention and
  a sliding-window group, 1, 2 and 4 blocks per chunk). The documented divergences
  (CONFORMANCE.md) are each replayed with the machine's restriction lifted, to show they
  still diverge as written.
- vLLM 0.22-0.25 (0.25.1): the same machine (shared prefixes, preemptions, resets; no
  finish, EARLY-FINISH-SIGNAL) must find the PR #48102 stuck request by itself (hypothesis
  search and shrinking, deterministic), shrunk to at most 12 steps; with liveness alone it
  must reach what users of those releases saw: the crash on a stale job id in a later hook
  and a request that never runs again. On 0.26+ the same machine and its programs conform.

KVSPEC_CONFORMANCE_EXAMPLES sets the number of hypothesis runs of the long test.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from spec import model as M

pytestmark = pytest.mark.conformance

MIN_STEPS = 2000
MAX_TRACE = 12


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    derandomize=True, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def _needs(vllm_env: Any, at_least: bool) -> None:
    new = vllm_env.vllm_version() >= (0, 26, 0)
    if new != at_least:
        pytest.skip(f"for vLLM {'>=' if at_least else '<'} 0.26 "
                    f"(this is {'.'.join(map(str, vllm_env.vllm_version()))})")


def _fresh(machine: Any, name: str) -> Any:
    """A subclass with its own counters and settings (hypothesis keeps per-class state)."""
    return type(name, (machine,), {"steps_taken": 0, "runs": 0, "last_trace": [],
                                   "last_error": "", "seconds": 0.0, "found": {}})


# ============================================================================ 0.26 and later
def _long_run(vllm_env: Any, machine: Any, name: str, record_property: Any) -> str:
    """Run `machine` for KVSPEC_CONFORMANCE_EXAMPLES hypothesis runs (at least MIN_STEPS
    model steps in all); the figures, as printed."""
    _needs(vllm_env, at_least=True)
    machine = _fresh(machine, name)
    examples = int(os.environ.get("KVSPEC_CONFORMANCE_EXAMPLES", "150"))
    t0 = time.perf_counter()
    machine.TestCase.settings = _settings(examples, 50)
    machine.TestCase().runTest()
    seconds = time.perf_counter() - t0
    record_property("model_steps", machine.steps_taken)
    record_property("seconds", round(seconds, 1))
    assert machine.steps_taken >= MIN_STEPS, machine.steps_taken
    return (f"{machine.steps_taken} model steps in {machine.runs} runs over "
            f"{len(machine.bounds_choices)} bounds, {seconds:.1f} s "
            f"({machine.seconds:.1f} s in the steps)")


def test_vllm_conforms_to_the_spec(vllm_ready: Any, record_property: Any) -> None:
    from conformance.adapter import VLLMMachine

    figures = _long_run(vllm_ready, VLLMMachine, "VLLMConformance", record_property)
    print(f"vLLM {vllm_ready.vllm_version()}: {figures}")


def test_vllm_conforms_with_a_hybrid_kv_cache(vllm_ready: Any, record_property: Any) -> None:
    """The machine on vLLM's connector built with a full-attention and a sliding-window KV
    cache group (block size 16; 1, 2 and 4 blocks per chunk), with a full-attention and a
    Mamba group (the core's hand-offs played by the adapter) and on chunks of 2 blocks:
    refinement, every invariant after every hook, the drain (`HYBRID_VLLM_BOUNDS`)."""
    from conformance.adapter import VLLMHybridMachine

    figures = _long_run(vllm_ready, VLLMHybridMachine, "VLLMHybridConformance",
                        record_property)
    print(f"vLLM {vllm_ready.vllm_version()}, hybrid: {figures}")


DECODE_BESIDE_A_WINDOW = ("arrive(r0) ; arrive(r1) ; reset() ; step() ; step() ; "
                          "step(admit=r0) ; step(admit=r1) ; step() ; step()")
"""r0 decodes beside a sliding window: its third step gives it a new full-attention block,
the one its window had just freed, and stores it."""


def test_a_request_decoding_beside_a_window_keeps_its_new_blocks(vllm_ready: Any) -> None:
    """The hybrid machine's decoding bound (full attention beside a sliding window, 2-block
    chunks): blocks the core appends per group while a request decodes are the request's
    (the harness once dropped them for several groups, and INV-15 flagged the request's
    next store as reading a block it did not hold)."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import HYBRID_VLLM_BOUNDS, VLLMHybridMachine, for_release

    bounds = [b for b in for_release(HYBRID_VLLM_BOUNDS)
              if b.decode_tokens and "sliding" in b.groups]
    if not bounds:
        pytest.skip("this release has no decoding hybrid bound (conformance.adapter."
                    "features_needed)")
    _replay(VLLMHybridMachine, bounds[0], DECODE_BESIDE_A_WINDOW)


F2_RESET_WINDOW = ("arrive(r0) ; arrive(r1) ; step(admit=r0) ; step() ; step(admit=r1) ; "
                   "step() ; step() ; reset() ; finish(r0) ; step()")
"""The checker's shortest trace of `reset-keeps-stale-window-blocks` under the first hybrid
bounds (window 2): r0's first window block leaves the window and goes to r1; after the
reset r0's final store reads it."""


def test_finding_f2_stale_window_block_under_the_machine(vllm_ready: Any) -> None:
    """F2 through the machine: with the RESET-WINDOW restriction lifted, vLLM leaves the
    model at the final store after the reset (the spec zeroed the freed window position)
    and breaks INV-15; the trace up to the reset conforms."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import HYBRID_VLLM_BOUNDS, VLLMHybridMachine

    class Lifted(VLLMHybridMachine):
        allow_known_divergences = True

    bounds = HYBRID_VLLM_BOUNDS[0]
    prefix = F2_RESET_WINDOW.rsplit(" ; reset()", 1)[0]
    _replay(VLLMHybridMachine, bounds, prefix)
    with pytest.raises(AssertionError, match=r"INV-15|left the model"):
        _replay(Lifted, bounds, F2_RESET_WINDOW)


def _replay(machine: Any, bounds: M.Bounds, trace: str) -> Any:
    from statemachine.testing import replay

    return replay(M.parse_events(trace), bounds, machine)


B0 = M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=2,
              failures=0, preemptions=2)

F1_RESET_TWICE = "arrive(r0) ; step(admit=r0) ; reset() ; reset()"
D2_PREEMPT_THEN_FINISH = "arrive(r0) ; step(admit=r0) ; preempt(r0) ; abort(r0) ; step()"
D3_LOADED_UNSCHEDULED = ("arrive(r0) ; step(admit=r0) ; step() ; step() ; ack(job 0, count 2) "
                         "; ack(job 1, count 2) ; ack(job 2, count 2) ; arrive(r1) ; "
                         "step(admit=r1) ; ack(job 3, count 2) ; reset() ; abort(r1) ; step()")
"""D3: r1's async load (job 3) ends, a reset empties the CPU cache, and r1 is aborted before
the core ever schedules it."""


F3_BOUNDS = M.Bounds(requests=1, tokens=6, workers=1, cpu_chunks=5, gpu_blocks=12,
                     resets=0, failures=0, preemptions=0, groups=("mamba", "full"),
                     tokens_per_block=4, partial_tails=True,
                     request_settings=(M.RequestSettings(max_offload_tokens=4),))
F3_TAIL_PAST_THE_CAP = "arrive(r0) ; " + " ; ".join(["step(admit=r0)"] + ["step()"] * 5)


def test_finding_f3_partial_tail_past_the_offload_cap_crashes(vllm_ready: Any) -> None:
    """F3: with partial tails on, the core hands off a request's Mamba state at its prompt's
    last hash boundary whatever the request's `max_offload_tokens`; vLLM asserts that the
    boundary is within the offloadable tokens (S:1662-1668), so a request whose cap is below
    its boundary (here 16 tokens, the boundary at 20) crashes build_connector_meta. The spec
    does not store that tail; the reference conforms on the same trace."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMHybridMachine, offload_caps_past_the_tail
    from statemachine.testing import OffloadingStateMachine

    with pytest.raises(AssertionError) as err:
        _replay(VLLMHybridMachine, F3_BOUNDS, F3_TAIL_PAST_THE_CAP)
    assert "_build_partial_tail_store_jobs" in "".join(str(e.name) for e in err.traceback)
    _replay(OffloadingStateMachine, F3_BOUNDS, F3_TAIL_PAST_THE_CAP)
    # with the cap at the boundary (the machine's restriction) vLLM stores the tail
    _replay(VLLMHybridMachine, offload_caps_past_the_tail(F3_BOUNDS), F3_TAIL_PAST_THE_CAP)


def test_finding_f1_second_reset_before_a_step_crashes(vllm_ready: Any) -> None:
    """F1: reset_cache leaves its flush in _current_batch_jobs_to_flush for the next step,
    then asserts that set is empty: a second reset before that step raises."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMMachine

    if vllm_ready.has("second_reset_merges"):  # fixed in 0.34.0: the trace conforms
        _replay(VLLMMachine, B0, F1_RESET_TWICE)
        return
    with pytest.raises(AssertionError) as err:
        _replay(VLLMMachine, B0, F1_RESET_TWICE)
    assert "reset_cache" in "".join(str(e.name) for e in err.traceback)
    # the same trace with a step between the resets conforms
    _replay(VLLMMachine, B0, "arrive(r0) ; step(admit=r0) ; reset() ; step() ; reset()")


D7_BOUNDS = M.Bounds(requests=3, tokens=4, cpu_chunks=6, gpu_blocks=14, failures=2,
                     preemptions=2, families=2, groups=("full", "mamba"), tokens_per_block=2,
                     partial_tails=True, decode_tokens=3)
D7_TAIL_PAST_A_MISSING_STATE = (
    "arrive(r0) ; arrive(r2) ; step(admit=r0) ; step() ; ack(job 0, count 1) ; "
    "ack(job 1, count 1) ; step() ; ack(job 1, count 1) ; fail(job 0, count 1) ; step() ; "
    "ack(job 3, count 1) ; ack(job 3, count 1) ; step(admit=r2)")


def test_divergence_d7_a_tail_past_a_missing_mamba_state(vllm_ready: Any) -> None:
    """D7 (CONFORMANCE.md): r0's Mamba state at its first chunk edge fails to store, its
    chunk 0 and its tail at 3 tokens are stored. 0.34.0 (feature partial_tail_anchor)
    searches the tail from the full-attention prefix and hits 3 model tokens: the spec under
    0.34.0's rule (`PartialTailSearch.FROM_FULL_ATTENTION_PREFIX`) takes the same path;
    under 0.33's (FROM_COMPLETE_HIT) it searches past the complete-chunk hit (0) and
    answers 0. Fails once either changes."""
    if not vllm_ready.has("failure_reports"):
        pytest.skip("the program fails a store: this vLLM has no failure report")
    from conformance.adapter import RELEASE_RULES, VLLMHybridMachine
    from spec.rules import PartialTailSearch

    assert vllm_ready.has("partial_tail_anchor")
    assert RELEASE_RULES.partial_tail_search is PartialTailSearch.FROM_FULL_ATTENTION_PREFIX
    _replay(VLLMHybridMachine, replace(D7_BOUNDS, rules=RELEASE_RULES),
            D7_TAIL_PAST_A_MISSING_STATE)
    before = replace(RELEASE_RULES, partial_tail_search=PartialTailSearch.FROM_COMPLETE_HIT)
    with pytest.raises(AssertionError, match=r"answered \(3, True\), the model \(0, False\)"):
        _replay(VLLMHybridMachine, replace(D7_BOUNDS, rules=before),
                D7_TAIL_PAST_A_MISSING_STATE)


def test_divergence_d1_whole_prompt_hit(vllm_ready: Any) -> None:
    """D1: without the bound, vLLM offers a block-aligned prompt whole (the core recomputes
    its last token, CS:3515-3516); the spec leaves the last block to compute."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMAdapter, VLLMMachine

    trace = "arrive(r0) ; step(admit=r0) ; step() ; step() ; preempt(r0) ; " \
            "ack(job 0, count 2) ; ack(job 1, count 2) ; ack(job 2, count 2) ; step(admit=r0)"
    _replay(VLLMMachine, B0, trace)  # with the bound: conforms

    class Unbounded(VLLMAdapter):
        last_token_bound = False

    class UnboundedMachine(VLLMMachine):
        adapter_factory = Unbounded

    with pytest.raises(AssertionError, match=r"answered \(3, True\), the model \(2, True\)"):
        _replay(UnboundedMachine, B0, trace)


def test_d2_a_request_preempted_then_aborted_has_its_jobs_flushed(vllm_ready: Any) -> None:
    """D2, fixed: a request preempted outside schedule() and aborted before the next step is
    in both preempted_req_ids and finished_req_ids; vLLM's preemption flush reads only its
    status entry, so it flushes the finished request's store, and so does the spec now (the
    preempt row from FINISHED_PENDING_FINAL). The trace conforms with no restriction lifted."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMMachine

    _replay(VLLMMachine, B0, D2_PREEMPT_THEN_FINISH)
    s = M.initial(B0)
    for ev in M.parse_events(D2_PREEMPT_THEN_FINISH):
        s, _calls, _w = M.apply(s, ev)
    assert [(j.id, j.state, j.flush_requested) for j in s.jobs] == [
        (0, "FLUSH_REQUESTED", True)]
    assert [(r.id, r.state) for r in s.reqs] == [("r0", "FINISHED_DRAINING")]


def test_d3_a_loaded_request_aborted_before_its_schedule_conforms(vllm_ready: Any) -> None:
    """D3, fixed: the connector learns a request's block table when the core schedules it,
    so a loaded request aborted before that has nothing to store from, in vLLM and in the
    model (which recorded the table at the load until then, and stored the loaded chunks
    again after the reset). The trace conforms with no restriction lifted, and the final
    step creates no job."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMMachine

    _replay(VLLMMachine, B0, D3_LOADED_UNSCHEDULED)
    s = M.initial(B0)
    for ev in M.parse_events(D3_LOADED_UNSCHEDULED):
        s, _calls, _w = M.apply(s, ev)
    assert s.counter == 4, "the final step stored r1's loaded chunks (job 4)"
    assert "r1" not in {q.id for q in s.reqs}


def test_the_48102_trace_conforms_after_the_fix(vllm_ready: Any) -> None:
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLMMachine

    _replay(VLLMMachine, B0, "arrive(r0) ; step(admit=r0) ; reset() ; step() ; "
                             "ack(job 0, count 2)")


REACH_BOUNDS = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=4,
                       resets=2, failures=0, preemptions=2)
"""One request of two blocks, preempted and reset (the search that found the programs
below: `test_liveness_search_reaches_what_users_saw`)."""
STALE_ID_AT_PREEMPTION = ("arrive(r0) ; step(admit=r0) ; preempt(r0) ; reset() ; "
                          "ack(job 0, count 1) ; step()")
"""0.22-0.25: the preempted request's flush looks its stale job id up in `_jobs` (KeyError:
0 in build_connector_meta, S@0.25.1:1043)."""
STALE_ID_AT_STORE = "arrive(r0) ; step(admit=r0) ; reset() ; ack(job 0, count 1) ; step()"
"""0.22-0.25: the request's next store job looks its stale job id up (KeyError: 0 in
_build_store_jobs, S@0.25.1:994)."""
NEVER_RUNS_AGAIN = ("arrive(r0) ; step(admit=r0) ; preempt(r0) ; step() ; reset() ; "
                    "step() ; ack(job 0, count 1) ; step()")
"""0.22-0.25: preempted while its store is in flight, then a reset: the store's id stays in
the request's `transfer_jobs`, its ack is dropped (below the threshold), and every later
lookup is deferred (S@0.25.1:674-679): the drain's admission of r0 is deferred with every
report delivered."""


def test_the_025_machine_conforms_after_the_fix(vllm_ready: Any) -> None:
    """The 0.22-0.25 machine's events (shared prefixes, preemptions, resets, no finish) on a
    release with the fix: the programs that crash or hang on 0.25.1 conform, under
    refinement and under the liveness drain (every waiting request admitted again), and a
    short search of both machines finds nothing."""
    _needs(vllm_ready, at_least=True)
    from conformance.adapter import VLLM025LivenessMachine, VLLM025Machine

    for trace in (STALE_ID_AT_PREEMPTION, STALE_ID_AT_STORE, NEVER_RUNS_AGAIN):
        _replay(VLLM025Machine, REACH_BOUNDS, trace)
        _replay(VLLM025LivenessMachine, REACH_BOUNDS, trace)
    assert any(b.shared_prefix and b.preemptions for b in VLLM025Machine.bounds_choices)
    for base, examples in ((VLLM025Machine, 20), (VLLM025LivenessMachine, 6)):
        machine = _fresh(base, f"{base.__name__}AfterTheFix")
        machine.TestCase.settings = _settings(examples, 20)
        machine.TestCase().runTest()
        assert machine.steps_taken > examples, machine.steps_taken


# ============================================================================ before 0.26
OWN_PREFIXES = (M.Bounds(requests=2, tokens=2, shared_prefix=False, workers=2, cpu_chunks=3,
                         gpu_blocks=4, resets=2, failures=0, preemptions=0),)
"""The default run's searches: each request its own prefix, no preemption (a search of the
machine's full bounds finds the same failures, but its shrinking takes minutes: the opt-in
`test_liveness_search_reaches_what_users_saw`)."""


def test_machine_finds_the_48102_stuck_request(vllm_ready: Any, record_property: Any,
                                                tmp_path: Any) -> None:
    """The machine, not a scenario, finds PR #48102: after a reset a request keeps a job id
    that left `_jobs`; its next lookups answer None forever (stuck)."""
    _needs(vllm_ready, at_least=False)
    from conformance.adapter import VLLM025Machine

    machine = _fresh(VLLM025Machine, "VLLM025Search")
    machine.bounds_choices = OWN_PREFIXES
    # the first failure only, shrunk (with preemptions a run can also break INV-1 inside a
    # step, a second failure of the same finding that hypothesis would shrink on its own)
    machine.TestCase.settings = settings(_settings(50, 20), report_multiple_bugs=False)
    t0 = time.perf_counter()
    try:
        machine.TestCase().runTest()
    except AssertionError as exc:
        found: BaseException = exc
    except BaseException as exc:  # several distinct failures, or a crash: not the finding
        pytest.fail(f"the machine failed, but not (only) with the #48102 finding: {exc!r}")
    else:
        pytest.fail("the machine did not find the #48102 stuck request")
    seconds = time.perf_counter() - t0
    trace = list(machine.last_trace)
    text = (f"vLLM {vllm_ready.vllm_version()}: shrunk trace of {len(trace)} steps "
            f"(search and shrink {seconds:.1f} s):\n  " + " ;\n  ".join(trace)
            + f"\n{machine.last_error}")
    print(text)
    (tmp_path / "48102-trace.txt").write_text(text + "\n")
    record_property("trace", " ; ".join(trace))
    assert "INV-1" in str(found) or "stuck" in str(found), found
    assert "request 'r" in str(found) and "job" in str(found), found
    assert "reset()" in trace, trace
    assert 0 < len(trace) <= MAX_TRACE, trace


def test_liveness_alone_finds_the_48102_hang(vllm_ready: Any, record_property: Any) -> None:
    """With refinement and invariants off, the machine still finds #48102, by what it does
    next: the stale job id makes vLLM's next store for the request, or the flush of its
    preemption, look it up in `_jobs` (KeyError: 0 in offloading/scheduler.py, S@0.25.1:994
    or :1043); or, where no store follows, the drain finds the request stuck holding a job
    no ack can remove, or deferred forever (it never runs again)."""
    _needs(vllm_ready, at_least=False)
    from conformance.adapter import VLLM025LivenessMachine

    machine = _fresh(VLLM025LivenessMachine, "VLLM025Liveness")
    machine.bounds_choices = OWN_PREFIXES
    # without refinement a run goes on past the divergence, where vLLM fails in several
    # ways: report the simplest failure only
    machine.TestCase.settings = settings(_settings(100, 20), report_multiple_bugs=False)
    try:
        machine.TestCase().runTest()
    except (AssertionError, KeyError) as exc:
        found: BaseException = exc
    else:
        pytest.fail("the liveness machine did not find the #48102 hang")
    trace = list(machine.last_trace)
    print(f"shrunk trace of {len(trace)} steps: {' ; '.join(trace)}\n{machine.last_error}")
    record_property("trace", " ; ".join(trace))
    _is_what_users_saw(found)
    assert "reset()" in trace and 0 < len(trace) <= MAX_TRACE, trace


def _is_what_users_saw(found: BaseException) -> str:
    """The #48102 failure `found` is: "crash" (vLLM's own scheduler looks the stale id 0 up
    in `_jobs`), "stuck" (the drain: a request holds a job no ack can remove) or "never
    runs again" (the drain: its lookup is deferred with every report delivered)."""
    if isinstance(found, KeyError):
        assert found.args == (0,), found
        frames = [f.filename for f in traceback.extract_tb(found.__traceback__)]
        assert frames[-1].endswith("offloading/scheduler.py"), frames[-3:]
        return "crash"
    assert isinstance(found, AssertionError), found
    if "never runs again" in str(found):
        assert "request 'r" in str(found) and "live jobs []" in str(found), found
        return "never runs again"
    assert "requests stuck after the drain" in str(found), found
    return "stuck"


@pytest.mark.parametrize("trace,what,where", [
    (STALE_ID_AT_PREEMPTION, "crash", "build_connector_meta"),
    (STALE_ID_AT_STORE, "crash", "_build_store_jobs"),
    (NEVER_RUNS_AGAIN, "never runs again", "_drain_without_finishing"),
], ids=["crash-at-the-preemption", "crash-at-the-next-store", "never-runs-again"])
def test_liveness_reaches_what_users_saw(vllm_ready: Any, trace: str, what: str,
                                         where: str) -> None:
    """The programs the liveness machine's search found (`REACH_BOUNDS`, shrunk; the search
    itself is `test_liveness_search_reaches_what_users_saw`), replayed: the crash on the
    stale job id in a later hook (the preempted request's flush, the next store) and a
    request that never runs again (0.24-0.25; on 0.22-0.23, which admit it again, the crash
    at its next store). The same programs conform after the fix
    (`test_the_025_machine_conforms_after_the_fix`)."""
    _needs(vllm_ready, at_least=False)
    from conformance.adapter import VLLM025LivenessMachine, VLLM025Machine

    if trace == NEVER_RUNS_AGAIN and not vllm_ready.has("lookup_defers_in_flight"):
        # 0.22-0.23 do not defer a request's lookup on its own jobs: the drain admits r0
        # again and its next store crashes on the stale id
        what, where = "crash", "_build_store_jobs"
    with pytest.raises((AssertionError, KeyError)) as err:
        _replay(VLLM025LivenessMachine, REACH_BOUNDS, trace)
    assert _is_what_users_saw(err.value) == what
    assert where in [str(e.name) for e in err.traceback], err.traceback
    # the refinement machine stops earlier, at the reset: INV-1 on r0's stale job 0
    with pytest.raises(AssertionError, match=r"INV-1.*request 'r0'; job 0"):
        _replay(VLLM025Machine, REACH_BOUNDS, trace)


@pytest.mark.skipif(not os.environ.get("KVSPEC_REACH_SEARCH"),
                    reason="a search of minutes: set KVSPEC_REACH_SEARCH=1")
def test_liveness_search_reaches_what_users_saw(vllm_ready: Any) -> None:
    """The liveness machine's search on `REACH_BOUNDS` (preemptions and resets always on),
    every distinct failure shrunk (`report_multiple_bugs`): it reaches the crash on the
    stale id at a preemption and at the next store, and a request that never runs again
    (besides the drain's stuck request). About 5 minutes on 2 loaded cores."""
    _needs(vllm_ready, at_least=False)
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize

    from conformance.adapter import VLLM025LivenessMachine
    from statemachine.testing import OffloadingStateMachine

    class Reach(_fresh(VLLM025LivenessMachine, "VLLM025Reach")):  # type: ignore[misc]
        bounds_choices = (REACH_BOUNDS,)

        @initialize(which=st.integers(0, 100),
                    swarm=st.sets(st.sampled_from(("partial", "late"))))
        def start(self, which: int, swarm: set[str]) -> None:
            OffloadingStateMachine.start(self, which, swarm | {"preempt", "reset", "complete"})

    Reach.TestCase.settings = _settings(50, 12)
    with pytest.raises(BaseException):  # noqa: B017 (an ExceptionGroup of the failures)
        Reach.TestCase().runTest()
    for where, (trace, error) in sorted(Reach.found.items()):
        print(f"{where}: {' ; '.join(trace)}\n  {error}")
    wheres = " ".join(Reach.found)
    errors = " ".join(e for _t, e in Reach.found.values())
    assert "KeyError at offloading/scheduler.py" in wheres and "(build_connector_meta)" \
        in wheres and "(_build_store_jobs)" in wheres, wheres
    assert "never runs again" in errors, errors
