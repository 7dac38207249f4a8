"""The connector-global reset fence (S:650-655, S:2437-2448; stale reports S:2266-2282).

``_reset_fence`` maps each job id alive at a reset to the worker reports still due. While it
is non-empty the manager must not assume that pre-reset copies have stopped writing;
``manager.on_reset_flushed()`` is called exactly when it becomes (or already is) empty.
"""

from __future__ import annotations

from spec.schema import SAME, Effect, Guard, MachineSpec, Path, State, Transition

FENCE_IDLE = "FENCE_IDLE"
FENCE_HELD = "FENCE_HELD"

STATES = (
    State(FENCE_IDLE, "no pre-reset job is still due a report", "_reset_fence == {}"),
    State(FENCE_HELD, "some pre-reset job is still due a report", "_reset_fence != {}"),
)

GUARDS = (
    Guard("has_live_jobs", "_jobs (or the timeout quarantine) is non-empty at the reset"),
    Guard("fence_empties", "the stale report just counted removed the last fence entry"),
)

EFFECTS = (
    Effect("extend_fence", "_reset_fence.update({id: remaining reports}); note the time"),
    Effect("signal_reset_flushed", "manager.on_reset_flushed()"),
    Effect("count_ignored_report", "a report for a stale id that already drained: counted"),
)

_ACK = "update_connector_output"

TRANSITIONS = (
    Transition("reset", (FENCE_IDLE, FENCE_HELD), FENCE_HELD, "reset_cache", "S:2437-2441",
               requires=("has_live_jobs",), effects=("extend_fence",), path=Path.RESET),
    Transition("reset", (FENCE_IDLE,), SAME, "reset_cache", "S:2442-2445",
               unless=("has_live_jobs",), effects=("signal_reset_flushed",), path=Path.RESET),
    Transition("reset", (FENCE_HELD,), SAME, "reset_cache", "S:2446-2448",
               unless=("has_live_jobs",), path=Path.RESET,
               note="no new entries; the older fence still drains"),
    Transition("stale_report", (FENCE_HELD,), SAME, _ACK, "S:2266-2268",
               unless=("fence_empties",), path=Path.RESET,
               note="the stale job counted the report (job machine)"),
    Transition("stale_report", (FENCE_HELD,), FENCE_IDLE, _ACK, "S:2269-2276",
               requires=("fence_empties",), effects=("signal_reset_flushed",), path=Path.RESET),
    Transition("drained_report", (FENCE_IDLE, FENCE_HELD), SAME, _ACK, "S:2277-2282",
               effects=("count_ignored_report",), path=Path.RESET,
               note="a late report for a stale id that already drained"),
)

FENCE_MACHINE = MachineSpec(
    name="fence",
    title="Reset fence (connector-global)",
    subject="connector",
    states=STATES,
    transitions=TRANSITIONS,
    initial=FENCE_IDLE,
    finals=(),
    guards=GUARDS,
    effects=EFFECTS,
)
