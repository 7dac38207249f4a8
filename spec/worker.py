"""The transfer-job lifecycle, worker view: one rank's copy of one job (W:219-329,
GW:674-763).

Every worker rank receives every job of a step's metadata and runs its own copy of it on its
own KV shard. The scheduler's job machine (`spec.job`) counts the ranks' reports; this
machine says what one rank does between receiving a job and reporting it, and it is the only
place a copy kernel is launched: entering ``SUBMITTED`` launches the copy, and ``COPIED``
(or ``FAILED``) is entered only when the copy's completion is observed by polling.

Per step a rank runs, in vLLM's order (W:219-329, MX:67-107): ``handle_preemptions`` (only
when the step flushes jobs: this step's flushed stores are taken from the store list, every
queued store is submitted, then every flushed job is waited for), ``start_kv_transfers``
(the stores queued by the previous step are submitted, then this step's loads; sync loads
are waited for before the forward pass), the forward pass, ``prepare_store_kv`` (this step's
stores are queued, to be submitted at the start of the next step) and ``get_finished``
(completions polled and reported).

A job enters this machine in ``QUEUED`` when the rank receives it: a store in
``prepare_store_kv`` (or in ``handle_preemptions`` if this very step flushes it), a load in
``start_kv_transfers``, where it is submitted at once.
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

QUEUED = "QUEUED"
SUBMITTED = "SUBMITTED"
FLUSHED = "FLUSHED"
COPIED = "COPIED"
FAILED = "FAILED"
REPORTED = "REPORTED"

STATES = (
    State(QUEUED, "received from a step's metadata, copy not launched: a store waits for the "
          "next step's submission; a load is submitted in the same call",
          "store: (job_id, src, dst) in _unsubmitted_store_jobs (W:272-284); load: between its "
          "receipt and transfer_async in start_kv_transfers (W:253-266)"),
    State(SUBMITTED, "its copy was launched on this rank's copy engine; completion not yet "
          "observed", "in a handler's transfer queue, end event not yet seen by get_finished; "
          "a load is in _load_jobs (W:253-266, GW:674-733)"),
    State(FLUSHED, "a flush demand named it: the rank waited for its copy synchronously, "
          "before the step's loads and forward pass; completion not yet observed by polling",
          "job_id in meta.jobs_to_flush and worker.wait returned (W:242-244, GW:759-763)"),
    State(COPIED, "the copy's successful completion was observed by polling (DMA done); it is "
          "reported in the same get_finished",
          "TransferResult(success=True) popped by worker.get_finished (GW:735-757)"),
    State(FAILED, "the copy's completion was observed and it failed; reported as failed in the "
          "same get_finished", "no vLLM predicate: get_finished asserts success (W:299-301)",
          beyond_vllm=True),
    State(REPORTED, "reported in this rank's worker metadata (completed, or beyond vLLM failed); "
          "an async load also in finished_recving. The rank forgets the job",
          "id in _connector_worker_meta.completed_jobs (mark_completed, C:90-92) until "
          "build_connector_worker_meta (W:323-329)"),
)

# --- the groups other layers test membership of -------------------------------------
COPYING = StateGroup(
    "copying", "its copy was launched and its completion not yet observed: polling may "
    "complete it", (SUBMITTED, FLUSHED))
NOT_YET_COPIED = StateGroup(
    "not_yet_copied", "its completion not observed yet: a hang may still withhold it",
    (QUEUED, SUBMITTED, FLUSHED))
OBSERVED = StateGroup(
    "observed", "its completion was observed: get_finished reports it", (COPIED, FAILED))
GROUPS = (COPYING, NOT_YET_COPIED, OBSERVED)

GUARDS = (
    Guard("copy_succeeded", "the polled CopyResult says success"),
    Guard("sync_load", "the job is a load the forward pass of its step waits for"),
    Guard("async_load", "the job is a load the core waits for through finished_recving"),
)

EFFECTS = (
    Effect("launch_copy_kernel", "CopyEngine.submit_store / submit_load with the job's "
           "TransferSpec; a store records itself as the last writer of its CPU chunks"),
    Effect("wait_for_copy", "CopyEngine.wait([job_id]): block until the copy has run (its "
           "result is still collected by polling)"),
    Effect("record_copy_result", "keep the polled CopyResult (bytes, seconds, success)"),
    Effect("report_completed", "mark_completed: completed_jobs[id] = 1 in this rank's worker "
           "metadata"),
    Effect("report_failed", "failed_jobs[id] = 1 in this rank's worker metadata"),
    Effect("report_finished_recving", "the load's request into this rank's finished_recving"),
)

TRANSITIONS = (
    Transition("submit", (QUEUED,), SUBMITTED, "start_kv_transfers", "W:246-270, GW:674-733",
               effects=("launch_copy_kernel",),
               note="the stores queued by the previous step, then this step's loads; also in "
               "handle_preemptions, before waiting, when the step flushes jobs (W:236-240)"),
    Transition("await_sync", (SUBMITTED,), SAME, "start_kv_transfers", "W:256-270",
               requires=("sync_load",), effects=("wait_for_copy",),
               note="every sync load is waited for before the forward pass that reads it"),
    Transition("flush", (SUBMITTED,), FLUSHED, "handle_preemptions", "W:219-244, GW:759-763",
               effects=("wait_for_copy",), path=Path.PREEMPT,
               note="before this step's loads and forward pass may overwrite its source "
               "blocks (owner preempted, block re-allocated) or a reset reuses its slots"),
    Transition("flush", (FLUSHED,), SAME, "handle_preemptions", "GW:759-763",
               path=Path.PREEMPT, note="flushed again before its completion was observed: "
               "already waited for"),
    Transition("copy_done", (SUBMITTED, FLUSHED), COPIED, "get_finished",
               "W:286-301, GW:735-757", requires=("copy_succeeded",),
               effects=("record_copy_result",)),
    Transition("copy_done", (SUBMITTED, FLUSHED), FAILED, "get_finished", BEYOND_VLLM,
               unless=("copy_succeeded",), effects=("record_copy_result",),
               path=Path.FAILURE, note="vLLM asserts success here (W:299-301)"),
    Transition("report", (COPIED,), REPORTED, "get_finished", "W:302-321, C:90-92",
               requires=("async_load",), effects=("report_completed", "report_finished_recving")),
    Transition("report", (COPIED,), REPORTED, "get_finished", "W:302-311, C:90-92",
               unless=("async_load",), effects=("report_completed",),
               note="stores never report finished_sending; sync loads report no "
               "finished_recving"),
    Transition("report", (FAILED,), REPORTED, "get_finished", BEYOND_VLLM, requires=("async_load",),
               effects=("report_failed", "report_finished_recving"), path=Path.FAILURE,
               note="the load is over on this rank: the core stops waiting for it"),
    Transition("report", (FAILED,), REPORTED, "get_finished", BEYOND_VLLM, unless=("async_load",),
               effects=("report_failed",), path=Path.FAILURE),
)

WORKER_MACHINE = MachineSpec(
    name="worker",
    title="Transfer-job lifecycle (one worker rank)",
    subject="worker job",
    states=STATES,
    transitions=TRANSITIONS,
    initial=QUEUED,
    finals=(REPORTED,),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("a flush for a job id this rank does not hold (never received, or already reported)",
         "ignored, as vLLM's worker.wait ignores unknown or finished ids (GW:759-763)"),
        ("a job id received twice, or a completion polled for a job the rank never submitted",
         "typed error WorkerError, nothing changed"),
        ("a hung job (fault injection): its completion is polled but withheld",
         "stays SUBMITTED or FLUSHED until released: the scheduler sees a lost report (vLLM "
         "has no job timeout: such a job would hold its request forever)"),
    ),
)
