"""The directed programs of `spec.regressions` against vLLM's own scheduler side: refinement,
every invariant after every hook (inside steps too) and the drain, as for the reference."""

from __future__ import annotations

from typing import Any

import pytest

from spec.regressions import REGRESSIONS, Regression

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
