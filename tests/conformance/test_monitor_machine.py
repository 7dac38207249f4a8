"""The monitored connector under the conformance machine: every program the model-based
machine plays against vLLM's connector (`conformance.adapter.VLLMMachine`) runs again on
`MonitoredOffloadingConnector` in `warn` mode, with the whole state checked every step.

On a release with the PR #48102 fix the monitor must report nothing on any program (no
false alarm: every move vLLM makes is a row, every invariant holds); on a release with the
bug, the machine's own search for the stuck request must also trip the monitor (INV-1 at a
reset).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings

pytest.importorskip("vllm")

import conformance.vllm_env as E  # (before vLLM: offline, quiet, temporary caches)

# isort: split
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

from conformance import adapter as A
from statemachine.monitor.connector import MonitoredOffloadingConnector

pytestmark = pytest.mark.conformance

FIXED = E.has("fix_48102")


def monitored_setup(**kwargs: Any) -> E.VLLMSetup:
    """`vllm_env.make_setup`, its connector rebuilt as the monitored one (same config)."""
    setup = make_setup(**kwargs)
    extra = setup.vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.update({"kvspec_mode": "warn", "kvspec_log": "", "kvspec_whole_every": 1,
                  "kvspec_stuck_after_steps": 0})
    conn = MonitoredOffloadingConnector(setup.vllm_config, KVConnectorRole.SCHEDULER,
                                        setup.kv_cache_config)
    setup.connector, setup.scheduler = conn, conn.connector_scheduler
    setup.manager = conn.connector_scheduler.manager
    return setup


make_setup = E.make_setup


class MonitoredAdapter(A.VLLMAdapter):
    def __init__(self, bounds: Any) -> None:
        A.E.make_setup = monitored_setup  # type: ignore[assignment]
        try:
            super().__init__(bounds)
        finally:
            A.E.make_setup = make_setup  # type: ignore[assignment]

        # the adapter asks the connector's scheduler for lookups directly where it passes
        # vLLM's own bound (LAST-TOKEN-BOUND, CONFORMANCE.md): through the monitor too
        self.scheduler = _LookupsThroughMonitor(self.connector, self.scheduler)

    def findings(self) -> list[Any]:
        mon = self.connector.kvspec
        return list(mon.findings) if mon is not None else []


class _LookupsThroughMonitor:
    """The connector scheduler, its lookups recorded by the monitored connector."""

    def __init__(self, connector: MonitoredOffloadingConnector, sched: Any) -> None:
        self._connector = connector
        self._sched = sched

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   **kwargs: Any) -> Any:
        rid = request.request_id

        def answer(out: Any) -> dict[str, Any]:
            return {"request": rid, "num_computed_tokens": num_computed_tokens,
                    "result": None if out is None else [out[0], bool(out[1])]}

        return self._connector._checked(
            "get_num_new_matched_tokens",
            lambda: self._sched.get_num_new_matched_tokens(request, num_computed_tokens,
                                                           **kwargs), answer, (rid,))


class Monitored:
    """Mixed into a conformance machine: after every step, what the monitor found."""

    adapter_factory: ClassVar[type] = MonitoredAdapter
    seen: ClassVar[list[str]] = []
    programs: ClassVar[int] = 0

    def _step(self, ev: Any) -> None:
        try:
            super()._step(ev)  # type: ignore[misc]
        finally:  # the machine's own checks may raise first: what the monitor saw counts
            self._monitor_findings()

    def _monitor_findings(self) -> None:
        found = self.impl.findings()  # type: ignore[attr-defined]
        if found:
            type(self).seen.extend(str(f) for f in found)
            if FIXED:
                raise AssertionError("the monitor reported on vLLM's connector:\n"
                                     + "\n".join(str(f) for f in found))


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=40, deadline=None,
                    derandomize=True, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.skipif(not FIXED, reason="the release has the PR #48102 bug")
def test_the_monitor_raises_no_false_alarm(vllm_ready: Any) -> None:
    machine = type("MonitoredVLLM", (Monitored, A.VLLMMachine),
                   {"seen": [], "steps_taken": 0, "runs": 0})
    machine.TestCase.settings = _settings(
        int(os.environ.get("KVSPEC_MONITOR_EXAMPLES", "60")))
    machine.TestCase().runTest()
    assert machine.seen == []
    assert machine.steps_taken >= 500, machine.steps_taken
    print(f"monitor under the machine: {machine.steps_taken} model steps in {machine.runs} "
          "runs, no finding")


@pytest.mark.skipif(not FIXED, reason="the release has the PR #48102 bug")
def test_a_reset_fence_job_flushed_by_the_next_step_is_seen_flushed(vllm_ready: Any) -> None:
    """Found by `make conformance` (this machine, 2026-12-02): a store in flight at a reset
    moves to the fence, and the next step's metadata tells the workers to flush it. Its
    reports due do not change, so the monitor did not project the held job again, kept it
    unflushed, and reported INV-16 (pre-reset jobs not flushed before new submissions) on a
    connector that had flushed it."""
    from spec import model as M
    from statemachine.testing import replay

    machine = type("MonitoredVLLM", (Monitored, A.VLLMMachine),
                   {"seen": [], "steps_taken": 0, "runs": 0})
    b = M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=2,
                 failures=0, preemptions=2)
    replay(M.parse_events("arrive(r0) ; step(admit=r0) ; reset() ; step() ; "
                          "ack(job 1, count 2)"), b, machine)
    assert machine.seen == []


@pytest.mark.skipif(FIXED, reason="the release has the PR #48102 fix")
def test_the_monitor_sees_what_the_machine_finds(vllm_ready: Any) -> None:
    base = A.machine_for(E.vllm_version())
    machine = type("MonitoredVLLM025", (Monitored, base), {"seen": [], "steps_taken": 0,
                                                            "runs": 0})
    # the first failing program is enough (no shrinking: the machine's own test shrinks)
    machine.TestCase.settings = settings(_settings(100), report_multiple_bugs=False,
                                         phases=(Phase.explicit, Phase.reuse, Phase.generate))
    with pytest.raises(BaseException):  # noqa: B017 - the machine's own finding
        machine.TestCase().runTest()
    assert any(s.startswith("INV-1:") and "reset_cache" in s for s in machine.seen), \
        machine.seen[:5]
