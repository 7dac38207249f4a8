"""The lifecycle of a tier job: a cascade (CPU -> secondary tier) or a promotion
(secondary tier -> CPU), in the tiering manager's job table ``_jobs`` (TM:247-252,
TM:434-446; results TM:501-549; the reset TM:1140-1198).

A promotion starts as an entry of ``_pending_load_submissions`` (one per tier and request,
TM:263-267) and gets its job id when the step ends (TM:740-763); a cascade gets its id when
it is created (TM:985-1011). A job leaves ``_jobs`` exactly when the poll applies its result
(TM:525-549), or, beyond vLLM, when it times out or a reset finds its tier hung; such a job's
slots stay quarantined until its late result arrives, and the late result is discarded.
"""

from __future__ import annotations

from spec.schema import (
    BEYOND_VLLM,
    Effect,
    Guard,
    MachineSpec,
    Path,
    State,
    StateGroup,
    Transition,
)

UNALLOCATED = "UNALLOCATED"
QUEUED = "QUEUED"
SUBMITTED = "SUBMITTED"
REPORTED = "REPORTED"
DONE = "DONE"
FAILED = "FAILED"
DROPPED = "DROPPED"
TIMED_OUT = "TIMED_OUT"
STALE = "STALE"
LATE_DRAINED = "LATE_DRAINED"

STATES = (
    State(UNALLOCATED, "not created", "no entry"),
    State(QUEUED, "a promotion reserved its slots; submitted when the step ends",
          "(tier, req_id) in _pending_load_submissions"),
    State(SUBMITTED, "in the job table; the tier's I/O runs", "job_id in _jobs, the tier's "
          "pool has not finished it"),
    State(REPORTED, "the tier finished the I/O; the result waits for the next poll",
          "job_id in _jobs, its result in the tier's finished queue (TP:130-136)"),
    State(DONE, "the poll applied a success: cascade pins released, promoted keys ready",
          "job_id < _job_id_counter, not in _jobs, success"),
    State(FAILED, "the poll applied a failure: pins released, or the failed keys of a "
          "promotion freed (its successful keys ready)", "not in _jobs, success False"),
    State(DROPPED, "a queued promotion discarded by a reset before it was submitted",
          "cleared from _pending_load_submissions (TM:1171-1174)"),
    State(TIMED_OUT, "no result within the tier job timeout: out of _jobs, its slots "
          "quarantined, its deferred requests released", "no vLLM predicate: vLLM waits "
          "for the tier forever", beyond_vllm=True),
    State(STALE, "in flight when a reset found its tier hung past the drain deadline: out "
          "of _jobs, its slots quarantined", "no vLLM predicate: drain_jobs blocks",
          beyond_vllm=True),
    State(LATE_DRAINED, "the late result of a timed-out or stale job arrived and was "
          "discarded; its quarantine released", "no vLLM predicate", beyond_vllm=True),
)

IN_TABLE = StateGroup("in_table", "in the job table _jobs (TM:252)", (SUBMITTED, REPORTED))
QUARANTINED = StateGroup(
    "quarantined", "out of _jobs but its I/O may still touch CPU slots", (TIMED_OUT, STALE))
UNFINISHED = StateGroup(
    "unfinished", "has not ended: queued, in the table, or quarantined",
    (QUEUED, SUBMITTED, REPORTED, TIMED_OUT, STALE))
ENDED = StateGroup("ended", "a progress property's goal: the job ended (TP-2)",
                   (DONE, FAILED, DROPPED, TIMED_OUT, STALE, LATE_DRAINED))
GROUPS = (IN_TABLE, QUARANTINED, UNFINISHED, ENDED)

GUARDS = (
    Guard("io_ok", "the tier's I/O succeeded for every key"),
    Guard("tier_hung", "the tier stopped answering (its I/O never finishes on its own)"),
)

EFFECTS = (
    Effect("reserve_promotion", "append key and slot to the (tier, request) entry (TM:727-737)"),
    Effect("allocate_tier_job_id", "job_id = _job_id_counter; _job_id_counter += 1 "
           "(TM:434-438)"),
    Effect("enter_tier_job_table", "_jobs[job_id] = (job, tier) (TM:440-443)"),
    Effect("submit_io", "tier.submit_store / tier.submit_load (TB:208-259)"),
    Effect("queue_result", "the tier's pool puts (job_id, success) on its finished queue"),
    Effect("apply_result", "pop from _jobs; cascade: complete_read; promotion: "
           "complete_write (TM:525-549)"),
    Effect("count_failure", "count the failed job; a cascade feeds back-pressure (TM:559-587)"),
    Effect("quarantine_job", "out of _jobs; its slots and pins kept until the late result"),
    Effect("suspect_tier", "lookups skip the tier while it holds a timed-out or stale job, "
           "so a hung tier cannot start promotion after promotion, each swallowing a CPU "
           "slot into quarantine"),
    Effect("release_quarantine", "free the job's quarantined slots, drop its pins; count the "
           "discarded late result"),
    Effect("drop_reservation", "clear _pending_load_submissions (TM:1171-1174)"),
)

_META = "build_connector_meta"
_POLL = "poll"

TRANSITIONS = (
    Transition("promotion_queued", (UNALLOCATED,), QUEUED, "get_num_new_matched_tokens",
               "TM:686-738", effects=("reserve_promotion",)),
    Transition("submitted", (QUEUED,), SUBMITTED, _META, "TM:740-763",
               effects=("allocate_tier_job_id", "enter_tier_job_table", "submit_io"),
               note="on_schedule_end flushes the step's promotions"),
    Transition("cascade_created", (UNALLOCATED,), SUBMITTED, "update_connector_output",
               "TM:965-1011", effects=("allocate_tier_job_id", "enter_tier_job_table",
                                       "submit_io"),
               note="complete_store cascades to every tier the back-pressure admits"),
    Transition("dropped", (QUEUED,), DROPPED, "reset_cache", "TM:1171-1174",
               effects=("drop_reservation",), path=Path.RESET),
    Transition("io_finished", (SUBMITTED,), REPORTED, "tier I/O", "TP:162-194",
               effects=("queue_result",), note="a pool thread finished the job's last task"),
    Transition("polled", (REPORTED,), DONE, _POLL, "TM:501-549", requires=("io_ok",),
               effects=("apply_result",),
               note="lookup, prepare_store, on_schedule_end and reset_cache poll"),
    Transition("polled", (REPORTED,), FAILED, _POLL, "TM:460-549", unless=("io_ok",),
               effects=("apply_result", "count_failure"), path=Path.FAILURE),
    Transition("time_out", (SUBMITTED,), TIMED_OUT, _META, BEYOND_VLLM,
               effects=("quarantine_job", "suspect_tier"), path=Path.TIMEOUT,
               note="older than the tier job timeout: the tier is suspect (no promotion "
               "from it) until the late result arrives"),
    Transition("stale", (SUBMITTED,), STALE, "reset_cache", BEYOND_VLLM,
               requires=("tier_hung",), effects=("quarantine_job", "suspect_tier"),
               path=Path.RESET,
               note="the reset's drain deadline passed (vLLM blocks in drain_jobs, "
               "TM:1164-1165)"),
    Transition("late_result", (TIMED_OUT, STALE), LATE_DRAINED, _POLL, BEYOND_VLLM,
               effects=("release_quarantine",), path=Path.TIMEOUT),
)

TIER_JOB_MACHINE = MachineSpec(
    name="tier_job",
    title="A tier job: cascade or promotion",
    subject="tier job",
    states=STATES,
    transitions=TRANSITIONS,
    initial=UNALLOCATED,
    finals=(DONE, FAILED, DROPPED, LATE_DRAINED),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("a result for a job id not in _jobs and not quarantined",
         "vLLM asserts (TM:527-531); the reference raises UnknownTierJob"),
    ),
)
