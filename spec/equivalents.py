"""The spec's own mutants (`kvspec check --mutate`) that survive every check, each with the
reason. The tests demand that the survivors of the kill matrix are exactly these, so a new
survivor (a gap in the checks) and a listed mutant that starts being killed (a stale reason)
both fail.

Every survivor is `equivalent`: the mutant does not change what the model can observe or do
(an effect that keeps only the implementation's bookkeeping, a second way of doing what
another row already does, a flag read by nothing before it is cleared). A mutant that changes
only what the offload tier is used for (a chunk stored once less, a slot counted longer) is
no survivor: no invariant or progress property is about cache efficiency, and none should
be, as vLLM may skip a load or a store at any time, but the directed programs pin what the
tier holds at their end (`spec.regressions.Regression.tier`), and a program that reaches the
mutant's row kills it (verdict `tier`). Four such mutants were listed here as `cache-only`
until programs that pin their tiers were added.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Survivor:
    """Why a mutant is equivalent to the spec: what it changes, and why nothing the model
    can observe or do depends on that."""
    reason: str


BOOKKEEPING = Survivor(
    "the effect keeps only the implementation's bookkeeping (a status object, a timer, a "
    "statistic, the flushed signal of the reset fence): the model runs it as a no-op, so the "
    "mutant is the spec itself")

JOB_ENDS = Survivor(
    "the job leaves the table (or the reset fence) on this row: the count it would lower, or "
    "the flag it would set, is dropped with it and read by no later row")

STATE_SAYS = Survivor(
    "the row's destination says it already: FAILING is a failed job's state, and the flag is "
    "read only by rows and invariants that see FAILING too")

INVALID_UNTIL_LOOKUP = Survivor(
    "the row leads to RECOMPUTE or TIMED_OUT (directly, or through PREEMPTED_FLUSHING once the "
    "other jobs end): the request holds no store and creates none before its next lookup, "
    "whose bypass_offload_lookup clears the flag; nothing reads it in between")

SYNC_TWICE = Survivor(
    "a failed or timed-out sync load is handled twice: the job's row fires kv_invalidated on "
    "its request (invalidate_owner_kv), which marks the loaded tokens invalid and poisons the "
    "request's stores, and the request's own load_failed/load_timed_out row does the same; "
    "either one suffices in every reachable state. Both stay: kv_invalidated also serves the "
    "stores that outlive the load (a request running on KV a later failure invalidates)")

QUARANTINE_SYNC = Survivor(
    "the worker waits for a sync load's copy before the step's forward pass (W:269-270): when "
    "the connector times it out only its report is late, the copy is over, so no byte reaches "
    "its destination blocks after the timeout and quarantining them changes nothing the "
    "invariants can see")

FLUSH_AGAIN = Survivor(
    "the job is already in jobs_to_flush (FLUSH_REQUESTED) or failing, whose rollback does not "
    "depend on the flush: adding it again changes nothing")

RESTART_AGAIN = Survivor(
    "the request is not scheduled from this state: its next lookup runs "
    "restart_from_token_zero again before anything reads the cursor, the block table or the "
    "hit")

FLUSH_OF_A_FINISHED = Survivor(
    "the request finished before this preemption reached the connector, and its finish "
    "registered the deferred fences of its stores' source blocks (register_deferred_fences), "
    "so INV-15 holds without the flush; a flush only asks the workers to finish a shipped "
    "copy sooner, and no check depends on when its reports arrive (CONFORMANCE.md D2: the "
    "row is there because vLLM flushes, not for safety)")

FENCE_NOTHING = Survivor(
    "leave_job_table already moves the stale job into the reset fence; enter_reset_fence only "
    "drops the CPU slots a timed-out store kept quarantined, and a failing job keeps none")

EQUIVALENT: dict[str, Survivor] = {
    "request: add(ABSENT)->IDLE drop create_request_status": BOOKKEEPING,
    ("request: lookup_deferred(IDLE,LOOKUP_DEFERRED)->LOOKUP_DEFERRED drop "
     "restart_from_token_zero"):
        RESTART_AGAIN,
    ("request: lookup_deferred(IDLE,LOOKUP_DEFERRED)->LOOKUP_DEFERRED drop start_deferral_timer"):
        BOOKKEEPING,
    "request: lookup_blocked(PREEMPTED_FLUSHING)->= drop restart_from_token_zero": RESTART_AGAIN,
    ("request: store_alloc_failed(RUNNING,STORING,LOADING_SYNC,FINISHED_PENDING_FINAL,IDLE,"
     "WAITING_STORING)->= [!load_invalid] drop count_allocation_failure"):
        BOOKKEEPING,
    "request: preempt(FINISHED_PENDING_FINAL)->= drop flush_request_jobs": FLUSH_OF_A_FINISHED,
    ("request: load_recving(ORPHANED_LOAD)->IDLE [!load_invalid] drop promote_after_recving"):
        BOOKKEEPING,
    "request: load_failed(LOADING_ASYNC)->RECOMPUTE drop mark_load_invalid": INVALID_UNTIL_LOOKUP,
    ("request: load_failed(LOADING_SYNC)->RECOMPUTE [!other_jobs_remain] drop mark_load_invalid"):
        INVALID_UNTIL_LOOKUP,
    ("request: load_failed(LOADING_SYNC)->PREEMPTED_FLUSHING [other_jobs_remain] drop "
     "mark_load_invalid"):
        SYNC_TWICE,
    ("request: load_failed(LOADING_SYNC)->PREEMPTED_FLUSHING [other_jobs_remain] drop "
     "poison_request_stores"):
        SYNC_TWICE,
    ("request: load_failed(PREEMPTED_FLUSHING)->= [other_jobs_remain] drop mark_load_invalid"):
        SYNC_TWICE,
    ("request: load_failed(PREEMPTED_FLUSHING)->RECOMPUTE [!other_jobs_remain] drop "
     "mark_load_invalid"):
        INVALID_UNTIL_LOOKUP,
    "request: load_failed(FINISHED_PENDING_FINAL)->= drop mark_load_invalid": SYNC_TWICE,
    ("request: load_failed(FINISHED_DRAINING)->= [other_jobs_remain] drop mark_load_invalid"):
        SYNC_TWICE,
    "request: kv_invalidated(RUNNING)->RECOMPUTE drop mark_load_invalid": INVALID_UNTIL_LOOKUP,
    "request: kv_invalidated(STORING)->PREEMPTED_FLUSHING drop mark_load_invalid": SYNC_TWICE,
    ("request: load_timed_out(LOADING_ASYNC)->TIMED_OUT drop mark_load_invalid"):
        INVALID_UNTIL_LOOKUP,
    ("request: load_timed_out(LOADING_SYNC)->TIMED_OUT [!other_jobs_remain] drop "
     "mark_load_invalid"):
        INVALID_UNTIL_LOOKUP,
    ("request: load_timed_out(LOADING_SYNC)->TIMED_OUT [!other_jobs_remain] drop "
     "quarantine_load_blocks"):
        QUARANTINE_SYNC,
    ("request: load_timed_out(LOADING_SYNC)->PREEMPTED_FLUSHING [other_jobs_remain] drop "
     "quarantine_load_blocks"):
        QUARANTINE_SYNC,
    ("request: load_timed_out(PREEMPTED_FLUSHING)->= [other_jobs_remain] drop mark_load_invalid"):
        SYNC_TWICE,
    ("request: load_timed_out(PREEMPTED_FLUSHING)->RECOMPUTE [!other_jobs_remain] drop "
     "mark_load_invalid"):
        INVALID_UNTIL_LOOKUP,
    ("request: load_timed_out(FINISHED_DRAINING)->= [other_jobs_remain] drop mark_load_invalid"):
        SYNC_TWICE,
    ("request: load_timed_out(FINISHED_DRAINING)->= [other_jobs_remain] drop "
     "quarantine_load_blocks"):
        QUARANTINE_SYNC,
    "job: create_store(UNALLOCATED)->CREATED drop protect_store_chunks": BOOKKEEPING,
    "job: flush(FLUSH_REQUESTED,FAILING)->= drop add_to_jobs_to_flush": FLUSH_AGAIN,
    ("job: ack(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED)->COMPLETED [reports_complete] drop "
     "count_report"):
        JOB_ENDS,
    "job: ack(FAILING)->FAILED [reports_complete] drop count_report": JOB_ENDS,
    ("job: fail(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,FAILING)->FAILING [!reports_complete] "
     "drop mark_failed"):
        STATE_SAYS,
    ("job: fail(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,FAILING)->FAILED [reports_complete] "
     "drop count_report"):
        JOB_ENDS,
    ("job: fail(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,FAILING)->FAILED [reports_complete] "
     "drop mark_failed"):
        JOB_ENDS,
    ("job: fail(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,FAILING)->FAILED [reports_complete] "
     "drop invalidate_owner_kv"):
        SYNC_TWICE,
    "job: fail(TIMED_OUT)->= [!reports_complete] drop invalidate_owner_kv": SYNC_TWICE,
    "job: ack(TIMED_OUT)->TIMED_OUT_DRAINED [reports_complete] drop count_report": JOB_ENDS,
    "job: fail(TIMED_OUT)->TIMED_OUT_DRAINED [reports_complete] drop count_report": JOB_ENDS,
    ("job: fail(TIMED_OUT)->TIMED_OUT_DRAINED [reports_complete] drop invalidate_owner_kv"):
        SYNC_TWICE,
    "job: reset(FAILING)->STALE drop enter_reset_fence": FENCE_NOTHING,
    "job: ack(STALE)->STALE_DRAINED [reports_complete] drop count_stale_report": JOB_ENDS,
    "job: fail(STALE)->STALE_DRAINED [reports_complete] drop count_stale_report": JOB_ENDS,
    ("fence: reset(FENCE_IDLE,FENCE_HELD)->FENCE_HELD [has_live_jobs] drop extend_fence"):
        BOOKKEEPING,
    "fence: reset(FENCE_IDLE)->= [!has_live_jobs] drop signal_reset_flushed": BOOKKEEPING,
    ("fence: stale_report(FENCE_HELD)->FENCE_IDLE [fence_empties] drop signal_reset_flushed"):
        BOOKKEEPING,
    "fence: drained_report(FENCE_IDLE,FENCE_HELD)->= drop count_ignored_report": BOOKKEEPING,
}
"""Mutant name (`statemachine.checker.mutation.SpecMutant.name`) -> why it survives."""
