"""The scheduler-side hooks of vLLM 0.33.0's offloading connector, and how the tables cover
them.

A lifecycle hook changes request or job state, so some table transition must name it. A
query hook (has_pending_push_work, take_events, get_stats, ...) changes no state; it is listed
so that the implementation offers it and the coverage test can tell an omission from a
choice.
"""

from __future__ import annotations

LIFECYCLE_HOOKS: dict[str, str] = {
    "on_new_request": "S:1197-1208",
    "get_num_new_matched_tokens": "S:1210-1277",
    "update_state_after_alloc": "S:1351-1500",
    "build_connector_meta": "S:2103-2196",
    "update_connector_output": "S:2218-2310",
    "request_finished": "S:2336-2376",
    "reset_cache": "S:2401-2459",
    "update_from_output": "CS:3566-3578 (finished_recving, core side)",
}

QUERY_HOOKS: dict[str, str] = {
    "has_pending_push_work": "S:2198-2216",
    "take_events": "S:2378-2399",
    "get_stats": "S:2312-2334",
    "get_external_cache_hit_sources": "S:1304-1349",
    "shutdown": "S:2461-2462",
}

OBSERVED_WITHIN: dict[str, tuple[str, ...]] = {
    "update_connector_output": ("update_connector_output", "update_from_output"),
}
"""The hooks whose rows one connector hook call may fire, where it is more than the hook
itself: vLLM's core calls `update_connector_output` inside `update_from_output` and then
moves the requests whose loads it reports (`finished_recving`), so a monitor that wraps the
connector sees the core's rows of `update_from_output` within that call."""


CORE_TRIGGERS: tuple[str, ...] = ("preempt",)
"""Triggers the core fires on its own, outside the connector's hooks: it preempts a request
inside `schedule()` (or `reset_prefix_cache(reset_running_requests=True)`) before the
connector hears of it through `build_connector_meta`'s `preempted_req_ids`, so a monitor
that reads the core's view (the request's status) sees the move at whichever hook comes
next."""


def rows_within(hook: str) -> tuple[str, ...]:
    """The hooks of the table rows that a call of `hook` may fire (`OBSERVED_WITHIN`)."""
    return OBSERVED_WITHIN.get(hook, (hook,))
