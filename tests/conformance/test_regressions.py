"""The directed programs of `spec.regressions` against vLLM's own scheduler side: refinement,
every invariant after every hook (inside steps too) and the drain, as for the reference."""

from __future__ import annotations

from typing import Any

import pytest

from spec import model as M
from spec.regressions import REGRESSIONS, Regression, by_name

pytestmark = pytest.mark.conformance


@pytest.mark.parametrize("reg", REGRESSIONS, ids=[r.name for r in REGRESSIONS])
def test_regression_replays_clean_on_vllm(vllm_ready: Any, reg: Regression) -> None:
    if vllm_ready.vllm_version() < (0, 26, 0):
        pytest.skip("the programs use preemption and finish, which the 0.22-0.25 machine "
                    "leaves out")
    if any(ev.kind == "report" and ev.failed for ev in reg.events()):
        pytest.skip("a failed report: vLLM's connector has none (the machine takes no "
                    "worker failures, CONFORMANCE.md)")
    from conformance.adapter import VLLMMachine
    from statemachine.testing import replay

    replay(reg.events(), reg.bounds, VLLMMachine)


def test_an_evicted_loaded_state_is_stored_while_waiting_and_the_reset_rewinds_the_cursor(
        vllm_ready: Any) -> None:
    """The program that kills `reset(WAITING_STORING)->IDLE drop reset_store_cursor` takes
    the same path on vLLM's connector, whose LRU picks the victims the model follows: r1's
    stores evict the Mamba state r2 loaded, the core reaches r2 without scheduling it and
    vLLM stores the state again, so r2 waits with the store in flight and its store cursor
    past the loaded chunk; the reset puts that cursor back to 0, as the row says."""
    from conformance.adapter import VLLMMachine

    reg = by_name("evicted-loaded-state-stored-while-waiting-then-reset")
    m = VLLMMachine()
    m.model = M.initial(reg.bounds)
    m.impl = m.adapter_factory(reg.bounds)
    seen: dict[str, dict[str, tuple[str, int | None]]] = {}
    for ev in reg.events():
        m._step(ev)
        m.invariants_hold()
        seen[str(ev)] = {r.id: (r.state, r.store_cursor)
                         for r in m.impl.abstract_state().requests}
    assert len(m.trace) == len(reg.events()), "an event of the program was not taken"
    m.teardown()
    assert seen["promote(r2)"]["r2"] == ("WAITING_STORING", 1)
    assert seen["reset()"]["r2"] == ("IDLE", 0)
