"""Well-formedness of the tables (DESIGN 1): reachable, no dead ends, deterministic, resolved."""

from __future__ import annotations

import dataclasses
import re

import pytest

import spec
from spec import request as R
from spec import wellformed as wf
from spec.hooks import LIFECYCLE_HOOKS
from spec.schema import BEYOND_VLLM, SAME, MachineSpec, Transition
from spec.tiering import TIERING_MACHINES

MACHINES = {m.name: m for m in (*spec.MACHINES, *TIERING_MACHINES)}


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_state_reachable_from_initial(name: str) -> None:
    m = MACHINES[name]
    assert wf.reachable_states(m) == set(m.state_names)


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_non_final_state_has_an_exit(name: str) -> None:
    assert wf.dead_ends(MACHINES[name]) == []


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_final_states_are_absorbing(name: str) -> None:
    assert wf.absorbing_violations(MACHINES[name]) == []


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_state_trigger_pairs_are_deterministic_or_exclusively_guarded(name: str) -> None:
    assert wf.nondeterminism(MACHINES[name]) == []


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_name_resolves_and_every_declaration_is_used(name: str) -> None:
    assert wf.unresolved_names(MACHINES[name]) == []


def test_effect_names_are_unique_across_machines() -> None:
    assert wf.shared_effect_names(spec.MACHINES) == []
    assert wf.shared_effect_names(TIERING_MACHINES) == []


_TIER_REF = re.compile(r"^((TM|TB|TF|TIO|TP|TAL|TEX|M):\d+(-\d+)?)"
                       r"(, (TM|TB|TF|TIO|TP|TAL|TEX|M):\d+(-\d+)?)*$")


def test_every_tiering_transition_cites_vllm_tiering_code_or_says_beyond_vllm() -> None:
    for m in TIERING_MACHINES:
        for t in m.transitions:
            assert t.vllm_ref == BEYOND_VLLM or _TIER_REF.match(t.vllm_ref), (m.name, t)


def test_every_lifecycle_hook_of_reference_section_2_has_a_transition() -> None:
    assert wf.uncovered_hooks(spec.MACHINES) == []
    used = {t.hook for m in spec.MACHINES for t in m.transitions}
    assert set(LIFECYCLE_HOOKS) <= used


_REF = re.compile(r"^((S|CS|W|GW|M|C|B|OC|KU):\d+(-\d+)?)(, (S|CS|W|GW|M|C|B|OC|KU):\d+(-\d+)?)*$")


def test_every_transition_cites_vllm_code_or_says_beyond_vllm() -> None:
    for m in spec.MACHINES:
        for t in m.transitions:
            assert t.vllm_ref == BEYOND_VLLM or _REF.match(t.vllm_ref), (m.name, t)


def test_beyond_vllm_states_are_only_entered_by_beyond_vllm_transitions() -> None:
    for m in MACHINES.values():
        beyond = {s.name for s in m.states if s.beyond_vllm}
        for src, dst, t in m.edges():
            if dst in beyond and src not in beyond:
                assert t.beyond_vllm, (m.name, src, dst, t.trigger)


def test_issue_states_are_present() -> None:
    req = set(spec.REQUEST_MACHINE.state_names)
    assert {"ABSENT", "IDLE", "LOOKUP_DEFERRED", "LOADING_ASYNC", "LOADING_SYNC", "RUNNING",
            "STORING", "PREEMPTED_FLUSHING", "FINISHED_PENDING_FINAL", "FINISHED_DRAINING",
            "RECOMPUTE", "TIMED_OUT"} <= req
    job = set(spec.JOB_MACHINE.state_names)
    assert {"CREATED", "SHIPPED", "PARTIALLY_ACKED", "COMPLETED", "FLUSH_REQUESTED", "STALE",
            "STALE_DRAINED", "FAILED", "TIMED_OUT"} <= job


def test_abort_is_legal_in_every_tracked_state() -> None:
    """Issue #49118: aborting must be legal wherever a request can be."""
    m = spec.REQUEST_MACHINE
    for s in m.state_names:
        ends = {t.trigger for t in m.transitions if s in t.sources}
        assert ends & {"finish", "finish_untracked", "finalize", "store_ended",
                       "load_ended"}, s
        if s in R.UNFINISHED_TRACKED:
            assert "finish" in ends, s


def test_the_preempt_flush_group_is_the_preempt_rows_sources() -> None:
    """Every layer decides which requests of preempted_req_ids to preempt by the group
    `preempt_flushed`; the table's preempt rows must start from exactly those states (a
    row from elsewhere would never fire, a member without a row would be illegal)."""
    sources = {s for t in spec.REQUEST_MACHINE.transitions if t.trigger == "preempt"
               for s in t.sources}
    assert sources == set(R.PREEMPT_FLUSHED.states)
    assert R.FINISHED_PENDING_FINAL in sources  # vLLM's flush reads only the status (D2)


# -- the checks themselves must be able to fail ---------------------------------------

def _with(m: MachineSpec, *extra: Transition, drop: str | None = None) -> MachineSpec:
    rows = tuple(t for t in m.transitions if t.trigger != drop) + extra
    return dataclasses.replace(m, transitions=rows)


def test_checks_detect_an_unreachable_state_and_a_dead_end() -> None:
    broken = _with(spec.FENCE_MACHINE, drop="reset")
    assert wf.unreachable_states(broken) == ["FENCE_HELD"]
    broken = _with(spec.FENCE_MACHINE, drop="stale_report")
    assert wf.dead_ends(broken) == ["FENCE_HELD"]


def test_checks_detect_nondeterminism_and_unknown_names() -> None:
    extra = Transition("reset", ("FENCE_IDLE",), "FENCE_HELD", "reset_cache", "S:1",
                       requires=("no_such_guard",), effects=("no_such_effect",))
    broken = _with(spec.FENCE_MACHINE, extra)
    assert any("not exclusive" in p for p in wf.nondeterminism(broken))
    assert "guard no_such_guard used but undeclared" in wf.unresolved_names(broken)
    assert "effect no_such_effect used but undeclared" in wf.unresolved_names(broken)


def test_checks_detect_an_uncovered_hook() -> None:
    broken = dataclasses.replace(spec.REQUEST_MACHINE, transitions=tuple(
        t for t in spec.REQUEST_MACHINE.transitions if t.hook != "on_new_request"))
    assert wf.uncovered_hooks([broken, spec.JOB_MACHINE]) == ["on_new_request"]


def test_reflexive_rows_expand_to_self_edges() -> None:
    rows = [t for t in spec.FENCE_MACHINE.transitions if t.dest == SAME]
    assert rows
    for t in rows:
        for s in t.sources:
            assert (s, s, t) in spec.FENCE_MACHINE.edges()
