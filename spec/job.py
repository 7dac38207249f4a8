"""The transfer-job lifecycle, scheduler view (TransferJobStatus S:77-93, `_jobs` S:656, the
reports S:2218-2310, the reset S:2404-2457).

A job is live while it is in the global job table ``_jobs``. It leaves the table in exactly
three ways, and each of them removes it from its owner's ``transfer_jobs`` in the same step
(INV-1 and INV-2 cannot break):
- its last worker report arrives (COMPLETED, or FAILED if any worker reported a failure);
- the job timeout expires (TIMED_OUT: the job moves to the timeout quarantine);
- ``reset_cache`` (STALE: the job moves to the reset fence).
Reports for jobs that left the table are matched against the quarantine and the reset fence
and counted; anything else is an unknown job (typed error).
"""

from __future__ import annotations

from spec.schema import (
    BEYOND_VLLM,
    SAME,
    Effect,
    Guard,
    MachineSpec,
    Path,
    State,
    StateGroup,
    Transition,
)

UNALLOCATED = "UNALLOCATED"
CREATED = "CREATED"
SHIPPED = "SHIPPED"
PARTIALLY_ACKED = "PARTIALLY_ACKED"
FLUSH_REQUESTED = "FLUSH_REQUESTED"
FAILING = "FAILING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
TIMED_OUT = "TIMED_OUT"
TIMED_OUT_DRAINED = "TIMED_OUT_DRAINED"
STALE = "STALE"
STALE_DRAINED = "STALE_DRAINED"

STATES = (
    State(UNALLOCATED, "the id is not yet handed out", "id >= _job_counter"),
    State(CREATED, "created in this step's schedule, not yet shipped to the workers",
          "id in _jobs and in _current_batch_load_jobs or the local store_jobs of "
          "build_connector_meta"),
    State(SHIPPED, "sent to the workers in a step's metadata; no report yet",
          "id in _jobs, pending_count == num_workers"),
    State(PARTIALLY_ACKED, "some workers acked, others have not reported",
          "id in _jobs, 0 < pending_count < num_workers"),
    State(FLUSH_REQUESTED, "live, and the workers were told to finish it before the step's "
          "loads and forward pass (owner preempted, fenced block re-allocated, or reset)",
          "id in _current_batch_jobs_to_flush, or shipped in meta.jobs_to_flush, and in _jobs"),
    State(FAILING, "a worker reported the copy failed; waiting for the other workers' reports "
          "before anything is released", "no vLLM predicate: a failure asserts (W:299-301)",
          beyond_vllm=True),
    State(COMPLETED, "every worker acked: complete_store/complete_load called, removed from "
          "_jobs, transfer_jobs and the fence map", "id < _job_counter, not in _jobs, "
          "not stale"),
    State(FAILED, "every worker reported and one failed: a store rolled back "
          "(complete_store(success=False)), a load unpinned and its request sent to recompute",
          "no vLLM predicate", beyond_vllm=True),
    State(TIMED_OUT, "not acked by every worker within job_timeout_steps: out of _jobs and "
          "transfer_jobs; its chunks and blocks held in quarantine until the late reports",
          "no vLLM predicate: vLLM has no job timeout (a lost report keeps a job forever)",
          beyond_vllm=True),
    State(TIMED_OUT_DRAINED, "every late report of a timed-out job arrived; its quarantine "
          "released", "no vLLM predicate", beyond_vllm=True),
    State(STALE, "alive at a reset: out of _jobs and transfer_jobs, in the reset fence until "
          "every worker reported", "id < _stale_job_threshold and id in _reset_fence"),
    State(STALE_DRAINED, "every report of a stale job arrived", "id < _stale_job_threshold, "
          "id not in _reset_fence"),
)

# --- the groups other layers test membership of -------------------------------------
LIVE = StateGroup(
    "live", "shipped and in the job table, reports due from the workers",
    (SHIPPED, PARTIALLY_ACKED, FLUSH_REQUESTED, FAILING))
IN_TABLE = StateGroup(
    "in_table", "in the job table `_jobs` and its owner's transfer_jobs (created or live)",
    (CREATED, *LIVE.states))
REPORTING = StateGroup(
    "reporting", "live and not failing: a worker's ack or failure moves it",
    (SHIPPED, PARTIALLY_ACKED, FLUSH_REQUESTED))
TO_SHIP = StateGroup(
    "to_ship", "goes into this step's metadata at the end of build_connector_meta",
    (CREATED, FLUSH_REQUESTED))
HELD = StateGroup(
    "held", "out of the job table but still due worker reports: in the reset fence or the "
    "timeout quarantine", (TIMED_OUT, STALE))
GROUPS = (LIVE, IN_TABLE, REPORTING, TO_SHIP, HELD)

ENDING_TRIGGER: dict[tuple[str, str], str] = {
    ("store", COMPLETED): "store_ended",
    ("store", FAILED): "store_ended",
    ("store", TIMED_OUT): "store_ended",
    ("load", COMPLETED): "load_ended",
    ("load", FAILED): "load_failed",
    ("load", TIMED_OUT): "load_timed_out",
}
"""The request trigger a job's leaving the table fires: (kind, the job's new state) -> trigger
(`leave_job_table`; a reset, which moves jobs to STALE, moves their owner itself)."""

GUARDS = (
    Guard("owner_has_no_jobs", "the owning request's transfer_jobs is empty (S:1487)"),
    Guard("reports_complete", "with this report, every worker has reported the job"),
)

EFFECTS = (
    Effect("allocate_job_id", "id = _job_counter; _job_counter += 1 (S:750-753)"),
    Effect("pin_load_chunks", "manager.prepare_load: ref_cnt += 1 on each key"),
    Effect("protect_store_chunks", "record the slots manager.prepare_store gave; the keys are "
           "write-pending (ref_cnt -1) and protected from eviction until the job ends"),
    Effect("enter_job_table", "_jobs[id] = status(pending_count = num_workers); id into the "
           "owner's transfer_jobs"),
    Effect("register_store_fences", "sliding-window / boundary sources into the block fence "
           "map; deferred sources too if the owner is finished"),
    Effect("put_in_metadata", "into meta.load_jobs or meta.store_jobs"),
    Effect("add_to_jobs_to_flush", "into _current_batch_jobs_to_flush"),
    Effect("count_report", "pending_count -= count"),
    Effect("mark_failed", "remember that a worker failed the copy"),
    Effect("complete_in_manager", "complete_store(success=True) / complete_load; an async "
           "load's keys leave _chunks_being_loaded"),
    Effect("roll_back_in_manager", "store: complete_store(success=False); load: "
           "complete_load; an async load's keys leave _chunks_being_loaded"),
    Effect("leave_job_table", "remove from _jobs, the owner's transfer_jobs and the fence map; "
           "the owner's ending trigger fires"),
    Effect("enter_timeout_quarantine", "remaining reports recorded; store keys dropped from the "
           "index but their slots kept; load pins kept"),
    Effect("release_quarantine", "free the quarantined slots and pins"),
    Effect("enter_reset_fence", "_reset_fence[id] = remaining reports (S:2437-2441)"),
    Effect("count_stale_report", "_reset_fence[id] -= count; counted as a stale ack"),
    Effect("invalidate_orphaned_load", "a failed stale load whose request still waits for it "
           "(ORPHANED_LOAD) marks the request's loaded tokens invalid; under "
           "Rules.stale_load_failure FENCE_ONLY (0.34.0) nothing: the worker's failed_recving "
           "tells the core, which recomputes the request"),
    Effect("invalidate_owner_kv", "a failed sync load whose request still runs on its KV "
           "(live, stale or timed out) fires the request's kv_invalidated at once"),
    Effect("leave_reset_fence", "delete the fence entry; on_reset_flushed if the fence empties"),
)

_ACK = "update_connector_output"

TRANSITIONS = (
    Transition("create_load", (UNALLOCATED,), CREATED, "update_state_after_alloc",
               "S:1474-1495", requires=("owner_has_no_jobs",),
               effects=("allocate_job_id", "pin_load_chunks", "enter_job_table")),
    Transition("create_store", (UNALLOCATED,), CREATED, "build_connector_meta",
               "S:2058-2080, S:1593-1602, S:1739-1749",
               effects=("allocate_job_id", "protect_store_chunks", "enter_job_table",
                        "register_store_fences")),
    Transition("ship", (CREATED,), SHIPPED, "build_connector_meta", "S:2169-2173",
               effects=("put_in_metadata",)),
    Transition("ship", (FLUSH_REQUESTED,), SAME, "build_connector_meta", "S:2094-2099",
               effects=("put_in_metadata",), path=Path.PREEMPT,
               note="a final store whose deferred block was re-allocated this very step"),
    Transition("flush", (CREATED, SHIPPED, PARTIALLY_ACKED), FLUSH_REQUESTED,
               "build_connector_meta", "S:2136-2165, S:2094-2099",
               effects=("add_to_jobs_to_flush",), path=Path.PREEMPT),
    Transition("flush", (FLUSH_REQUESTED, FAILING), SAME, "build_connector_meta",
               "S:2136-2165", effects=("add_to_jobs_to_flush",), path=Path.PREEMPT,
               note="already flushed, or failing: the flush demand is idempotent"),
    Transition("ack", (SHIPPED, PARTIALLY_ACKED), PARTIALLY_ACKED, _ACK, "S:2283-2286",
               unless=("reports_complete",), effects=("count_report",)),
    Transition("ack", (FLUSH_REQUESTED, FAILING), SAME, _ACK, "S:2283-2286",
               unless=("reports_complete",), effects=("count_report",)),
    Transition("ack", (SHIPPED, PARTIALLY_ACKED, FLUSH_REQUESTED), COMPLETED, _ACK,
               "S:2287-2310", requires=("reports_complete",),
               effects=("count_report", "complete_in_manager", "leave_job_table")),
    Transition("ack", (FAILING,), FAILED, _ACK, BEYOND_VLLM, requires=("reports_complete",),
               effects=("count_report", "roll_back_in_manager", "leave_job_table"),
               path=Path.FAILURE),
    Transition("fail", (*REPORTING, FAILING), FAILING, _ACK, BEYOND_VLLM,
               unless=("reports_complete",),
               effects=("count_report", "mark_failed", "invalidate_owner_kv"),
               path=Path.FAILURE),
    Transition("fail", (*REPORTING, FAILING), FAILED, _ACK, BEYOND_VLLM,
               requires=("reports_complete",),
               effects=("count_report", "mark_failed", "invalidate_owner_kv",
                        "roll_back_in_manager", "leave_job_table"), path=Path.FAILURE),
    Transition("poison", REPORTING.states, FAILING, _ACK, BEYOND_VLLM, effects=("mark_failed",),
               path=Path.FAILURE, note="a store of a request whose sync load failed: the KV it "
               "reads was computed from bad data, so it must not become loadable"),
    Transition("time_out", LIVE.states, TIMED_OUT, "build_connector_meta", BEYOND_VLLM,
               effects=("leave_job_table", "enter_timeout_quarantine"), path=Path.TIMEOUT),
    Transition("ack", (TIMED_OUT,), SAME, _ACK, BEYOND_VLLM, unless=("reports_complete",),
               effects=("count_report",), path=Path.TIMEOUT),
    Transition("fail", (TIMED_OUT,), SAME, _ACK, BEYOND_VLLM, unless=("reports_complete",),
               effects=("count_report", "invalidate_owner_kv"), path=Path.TIMEOUT),
    Transition("ack", (TIMED_OUT,), TIMED_OUT_DRAINED, _ACK, BEYOND_VLLM,
               requires=("reports_complete",), effects=("count_report", "release_quarantine"),
               path=Path.TIMEOUT),
    Transition("fail", (TIMED_OUT,), TIMED_OUT_DRAINED, _ACK, BEYOND_VLLM,
               requires=("reports_complete",),
               effects=("count_report", "invalidate_owner_kv", "release_quarantine"),
               path=Path.TIMEOUT),
    Transition("reset", (*(s for s in LIVE if s != FAILING), TIMED_OUT), STALE, "reset_cache",
               "S:2417, S:2436-2450",
               effects=("add_to_jobs_to_flush", "leave_job_table", "enter_reset_fence"),
               path=Path.RESET, note="a timed-out job's quarantine is dropped with the "
               "manager's reset; its late reports now drain the reset fence"),
    Transition("reset", (FAILING,), STALE, "reset_cache", BEYOND_VLLM,
               effects=("add_to_jobs_to_flush", "leave_job_table", "enter_reset_fence",
                        "invalidate_orphaned_load"),
               path=Path.RESET, note="a worker already failed this load: the request the "
               "reset orphans must not be promoted on the other workers' stale acks (its KV "
               "is invalid; found by INV-20). Under 0.34.0's rule "
               "(Rules.stale_load_failure FENCE_ONLY) the core keeps it from that instead"),
    Transition("ack", (STALE,), SAME, _ACK, "S:2266-2268", unless=("reports_complete",),
               effects=("count_stale_report",), path=Path.RESET),
    Transition("ack", (STALE,), STALE_DRAINED, _ACK, "S:2269-2276",
               requires=("reports_complete",),
               effects=("count_stale_report", "leave_reset_fence"), path=Path.RESET),
    Transition("fail", (STALE,), SAME, _ACK, BEYOND_VLLM, unless=("reports_complete",),
               effects=("count_stale_report", "invalidate_orphaned_load",
                        "invalidate_owner_kv"), path=Path.FAILURE),
    Transition("fail", (STALE,), STALE_DRAINED, _ACK, BEYOND_VLLM,
               requires=("reports_complete",),
               effects=("count_stale_report", "invalidate_orphaned_load", "invalidate_owner_kv",
                        "leave_reset_fence"),
               path=Path.FAILURE, note="a failed stale load must not be promoted as loaded"),
)

JOB_MACHINE = MachineSpec(
    name="job",
    title="Transfer-job lifecycle (scheduler view)",
    subject="job",
    states=STATES,
    transitions=TRANSITIONS,
    initial=UNALLOCATED,
    finals=(COMPLETED, FAILED, TIMED_OUT_DRAINED, STALE_DRAINED),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("a report for a STALE_DRAINED id (below the stale threshold, not in the fence)",
         "counted as ignored_stale_reports (S:2277-2282 logs it)"),
        ("a report for a COMPLETED, FAILED or TIMED_OUT_DRAINED id, or an id never allocated",
         "typed error UnknownJob; vLLM raises KeyError (S:2283)"),
        ("a report whose count exceeds the reports still due",
         "typed error OverAck, nothing changed; vLLM asserts (S:2287)"),
    ),
)
