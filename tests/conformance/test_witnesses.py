"""The row witnesses of `spec.witnesses` against vLLM's own scheduler side: every row of the
tables whose program vLLM can be driven down is taken on vLLM's connector, with every check
of the random runs (refinement, invariants after every hook, the drain). The rows a random
soak seldom reaches are checked against vLLM every run; the rest are skipped, each with what
keeps its program off this vLLM."""

from __future__ import annotations

from typing import Any

import pytest

from spec import witnesses as W
from tests.conformance.test_regressions import _bounds

pytestmark = pytest.mark.conformance


def off_vllm(w: W.Witness, failure_reports: bool) -> str | None:
    """Why the witness cannot run on this vLLM, or None."""
    from conformance.adapter import hybrid_setup
    from spec import model as M
    from spec.checker import replay

    try:
        hybrid_setup(w.bounds)
    except ValueError as exc:
        return f"its KV cache groups: {exc}"
    try:
        steps = replay(_bounds(w), w.events(), canonical_ids=False)
    except M.NotEnabled as exc:
        return (f"under this release's rules ({_bounds(w).rules}) the program is no path of "
                f"the model ({exc}): the witness was searched under the spec's own")
    if any(trigger == "time_out" for s in steps for *_, trigger in s.moves):
        return "a job times out: vLLM's connector has no timeout (the rows are beyond vLLM)"
    if not failure_reports and any(ev.kind == "report" and ev.failed for ev in w.events()):
        return "a failed report: this vLLM's connector has none"
    return None


@pytest.mark.parametrize("witness", W.WITNESSES, ids=[w.row for w in W.WITNESSES])
def test_witness_replays_clean_on_vllm(vllm_ready: Any, witness: W.Witness) -> None:
    """The program on vLLM's connector, event by event, as the machine's random runs take
    them: an event the machine keeps off this vLLM (a known crash such as RESET-TWICE, a
    failure vLLM takes otherwise, a stray report: `VLLMMachine.allows`, CONFORMANCE.md)
    skips the rest, naming it."""
    from conformance.adapter import VLLMMachine

    if vllm_ready.vllm_version() < (0, 26, 0):
        pytest.skip("the programs use preemption and finish, which the 0.22-0.25 machine "
                    "leaves out")
    why = off_vllm(witness, vllm_ready.has("failure_reports"))
    if why:
        pytest.skip(why)
    bounds = _bounds(witness)
    m = VLLMMachine()
    m.begin(bounds)
    for i, ev in enumerate(witness.events(), 1):
        if m.rule_for(ev) is None:
            pytest.skip(f"step {i}, {ev}: {_kept_off(m, ev)}")
        m._step(ev)
        m.invariants_hold()
    assert len(m.trace) == len(witness.events()), "an event of the witness was not taken"
    m.teardown()



def _kept_off(m: Any, ev: Any) -> str:
    """Why the machine takes no rule for `ev`, as CONFORMANCE.md names it."""
    from conformance.adapter import unfailable_in_vllm

    if ev.kind == "report" and not m._unreported(ev.job) and not m._held(ev):
        return "a stray report (every worker already reported the job)"
    if ev.kind == "report" and ev.failed and (why := unfailable_in_vllm(m.model, ev)):
        return f"a failure vLLM takes otherwise ({why}, CONFORMANCE.md)"
    return f"a restriction of VLLMMachine.allows on its {ev.kind} (CONFORMANCE.md)"
