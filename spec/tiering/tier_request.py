"""The lifecycle of a request in the tiering manager (``_req_state``, TM:100-106,
TM:1013-1080): when the secondary tiers may be told that a request finished.

A request's final GPU store can complete after the scheduler reported the request finished;
that completion still cascades, so the tiers are told only once no GPU store of the request is
pending (TM:1056-1080). Telling them earlier made the late `complete_store` look the request
up after it was gone (a KeyError); in the tables that is a `store_completed` with no row.
"""

from __future__ import annotations

from spec.schema import SAME, Effect, Guard, MachineSpec, Path, State, StateGroup, Transition

UNKNOWN = "UNKNOWN"
ACTIVE = "ACTIVE"
FINISH_PENDING = "FINISH_PENDING"
FINALIZED = "FINALIZED"

STATES = (
    State(UNKNOWN, "not yet seen by the tiering manager", "req_id not in _req_state"),
    State(ACTIVE, "registered, not finished", "_req_state[req_id].is_finished is False"),
    State(FINISH_PENDING, "finished, but a GPU store of it is still pending",
          "is_finished and pending_primary_stores > 0"),
    State(FINALIZED, "the secondary tiers were told; the record is gone",
          "req_id not in _req_state after on_request_finished"),
)

OPEN = StateGroup("open", "in _req_state: GPU stores of it may still complete",
                  (ACTIVE, FINISH_PENDING))
GROUPS = (OPEN,)

GUARDS = (
    Guard("stores_pending", "pending_primary_stores > 0 (TM:1069-1070)"),
    Guard("last_pending_store", "this completion drops pending_primary_stores to 0"),
    Guard("stores_offered", "prepare_store allocated at least one key (TM:862-864)"),
)

EFFECTS = (
    Effect("register_request", "_req_state[req_id] = RequestState (TM:1025-1035)"),
    Effect("count_pending_store", "pending_primary_stores += 1 (TM:862-864)"),
    Effect("count_store_completed", "pending_primary_stores -= 1 (TM:979-983)"),
    Effect("mark_finished", "is_finished = True (TM:1051-1054)"),
    Effect("finalize_in_tiers", "tier.on_request_finished for every tier; del _req_state "
           "(TM:1074-1080)"),
    Effect("clear_pending_stores", "pending_primary_stores = 0 (TM:1178-1181)"),
)

TRANSITIONS = (
    Transition("registered", (UNKNOWN,), ACTIVE, "get_num_new_matched_tokens", "TM:1013-1042",
               effects=("register_request",), note="on_new_request"),
    Transition("store_prepared", (ACTIVE,), SAME, "build_connector_meta", "TM:857-864",
               requires=("stores_offered",), effects=("count_pending_store",)),
    Transition("store_completed", (ACTIVE,), SAME, "update_connector_output", "TM:977-983",
               effects=("count_store_completed",)),
    Transition("store_completed", (FINISH_PENDING,), FINALIZED, "update_connector_output",
               "TM:977-983, TM:1056-1080", requires=("last_pending_store",),
               effects=("count_store_completed", "finalize_in_tiers"), path=Path.FINISH),
    Transition("store_completed", (FINISH_PENDING,), SAME, "update_connector_output",
               "TM:977-983", unless=("last_pending_store",),
               effects=("count_store_completed",), path=Path.FINISH),
    Transition("finished", (ACTIVE,), FINISH_PENDING, "request_finished", "TM:1044-1054",
               requires=("stores_pending",), effects=("mark_finished",), path=Path.FINISH),
    Transition("finished", (ACTIVE,), FINALIZED, "request_finished", "TM:1044-1080",
               unless=("stores_pending",), effects=("mark_finished", "finalize_in_tiers"),
               path=Path.FINISH),
    Transition("reset", (ACTIVE,), SAME, "reset_cache", "TM:1178-1181",
               effects=("clear_pending_stores",), path=Path.RESET,
               note="its pre-reset stores will never complete (the scheduler drops them)"),
    Transition("reset", (FINISH_PENDING,), FINALIZED, "reset_cache", "TM:1178-1192",
               effects=("finalize_in_tiers",), path=Path.RESET),
)

TIER_REQUEST_MACHINE = MachineSpec(
    name="tier_request",
    title="A request in the tiering manager",
    subject="request",
    states=STATES,
    transitions=TRANSITIONS,
    initial=UNKNOWN,
    finals=(FINALIZED,),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
)
