"""The request lifecycle, connector view (RequestOffloadState S:348-493, the hooks
S:1197-2433).

vLLM 0.33.0 keeps no state enum for a request: its state is implied by membership in
``_req_status``, the contents of ``transfer_jobs``, ``finished_signaled`` and the core
scheduler's status. Each state below names one such combination; ``vllm_predicate`` says
which. Job endings reach the request as one of four triggers (``store_ended``,
``load_ended``, ``load_failed``, ``load_timed_out``); the job machine (``spec.job``) decides
which one fires.
"""

from __future__ import annotations

from collections.abc import Iterable

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

ABSENT = "ABSENT"
IDLE = "IDLE"
LOOKUP_DEFERRED = "LOOKUP_DEFERRED"
LOADING_ASYNC = "LOADING_ASYNC"
LOADING_SYNC = "LOADING_SYNC"
RUNNING = "RUNNING"
STORING = "STORING"
PREEMPTED_FLUSHING = "PREEMPTED_FLUSHING"
WAITING_STORING = "WAITING_STORING"
ORPHANED_LOAD = "ORPHANED_LOAD"
RECOMPUTE = "RECOMPUTE"
TIMED_OUT = "TIMED_OUT"
FINISHED_PENDING_FINAL = "FINISHED_PENDING_FINAL"
FINISHED_DRAINING = "FINISHED_DRAINING"

STATES = (
    State(ABSENT, "not tracked: never added, or finished and cleaned up",
          "req_id not in _req_status"),
    State(IDLE, "tracked and unfinished, holds no job; waits to be looked up or scheduled",
          "tracked, not req.is_finished(), transfer_jobs == {}, not scheduled since admission"),
    State(LOOKUP_DEFERRED, "the last lookup answered None (backend RETRY/HIT_PENDING, or a hit "
          "chunk is being loaded by another request); retried next step",
          "transfer_jobs == {} and deferred_lookup_start_time is not None"),
    State(LOADING_ASYNC, "one asynchronous load in flight; the core waits for finished_recving",
          "transfer_jobs == {L}, not _jobs[L].is_store, not _jobs[L].is_sync_load; "
          "core status WAITING_FOR_REMOTE_KVS"),
    State(LOADING_SYNC, "a synchronous load in flight, waited on before this step's forward "
          "pass; store jobs may sit beside it",
          "some j in transfer_jobs with _jobs[j].is_sync_load; core status RUNNING"),
    State(RUNNING, "scheduled, holds no job", "scheduled, transfer_jobs == {}"),
    State(STORING, "scheduled, one or more store jobs in flight",
          "scheduled, transfer_jobs != {}, every _jobs[j].is_store"),
    State(PREEMPTED_FLUSHING, "preempted while holding jobs; every job was flushed and the "
          "request is not looked up again until they end",
          "in preempted_req_ids (this step or earlier), transfer_jobs != {}; core PREEMPTED"),
    State(WAITING_STORING, "waits in the core's queue with store jobs in flight: its async load "
          "ended, the core's waiting loop cached the loaded blocks and handed off the Mamba "
          "state the load ended on, but did not schedule the request in that step (no "
          "budget, no room); the connector stored the state",
          "transfer_jobs != {}, every _jobs[j].is_store, not scheduled and not in "
          "preempted_req_ids; core status WAITING (PREEMPTED if it was ever preempted) after "
          "_update_waiting_for_remote_kv"),
    State(ORPHANED_LOAD, "a reset made its async load stale: the connector holds no job, the "
          "core still waits for that load's finished_recving",
          "transfer_jobs == {} after reset_cache; core status WAITING_FOR_REMOTE_KVS"),
    State(RECOMPUTE, "a load of this request failed: the loaded tokens are invalid; the next "
          "lookup bypasses the offload tier and the request recomputes from its local prefix",
          "no vLLM predicate: vLLM asserts on a failed transfer (W:299-301)", beyond_vllm=True),
    State(TIMED_OUT, "a load of this request was given up after the job timeout: like "
          "RECOMPUTE, and the load's destination GPU blocks stay quarantined until its late "
          "acks arrive",
          "no vLLM predicate: vLLM has no job timeout (a lost report keeps a job forever)",
          beyond_vllm=True),
    State(FINISHED_PENDING_FINAL, "request_finished was called; the final store decision and "
          "on_request_finished happen at the next build_connector_meta",
          "req.is_finished() and not finished_signaled"),
    State(FINISHED_DRAINING, "finished and signaled; waits for its last jobs to end",
          "finished_signaled and transfer_jobs != {}"),
)

# --- the groups other layers test membership of -------------------------------------
UNFINISHED_TRACKED = StateGroup(
    "unfinished_tracked", "tracked and not finished: request_finished may end it",
    (IDLE, LOOKUP_DEFERRED, LOADING_ASYNC, LOADING_SYNC, RUNNING, STORING, PREEMPTED_FLUSHING,
     WAITING_STORING, ORPHANED_LOAD, RECOMPUTE, TIMED_OUT))
FINISHED = StateGroup(
    "finished", "request_finished was called (req.is_finished())",
    (FINISHED_PENDING_FINAL, FINISHED_DRAINING))
SCHEDULED = StateGroup(
    "scheduled", "the core runs the request: its block table grows, it stores, a preemption "
    "flushes its jobs, and a lookup of it means the core preempted it",
    (LOADING_SYNC, RUNNING, STORING))
STORE_CANDIDATES = StateGroup(
    "store_candidates", "build_connector_meta offers its new full chunks to the manager: a "
    "scheduled request, or a finished one's final store",
    (LOADING_SYNC, RUNNING, STORING, FINISHED_PENDING_FINAL))
PREEMPT_FLUSHED = StateGroup(
    "preempt_flushed", "in preempted_req_ids at build_connector_meta, the request's jobs are "
    "flushed: a scheduled request, or one finished since the core preempted it (vLLM's flush "
    "reads only the status entry, S:2136-2151); the sources of the preempt rows",
    (LOADING_SYNC, RUNNING, STORING, FINISHED_PENDING_FINAL))
HOLDS_GPU_BLOCKS = StateGroup(
    "holds_gpu_blocks", "the core holds the request's GPU blocks (freed at preemption and at "
    "finish; a loading request keeps them until its load ends)",
    (LOADING_ASYNC, LOADING_SYNC, RUNNING, STORING, ORPHANED_LOAD))
MUST_RECOMPUTE = StateGroup(
    "must_recompute", "a load of it failed or timed out: its next lookup answers 0 without "
    "asking the manager, and the core drops its blocks and recomputes it",
    (RECOMPUTE, TIMED_OUT))
PREEMPTED_IF_RUNNING = StateGroup(
    "preempted_if_running", "a request the core runs must be preempted and recomputed when the "
    "connector has it here: its KV is invalid (a load of it failed or timed out)",
    (PREEMPTED_FLUSHING, RECOMPUTE, TIMED_OUT))
MAY_HOLD_JOBS = StateGroup(
    "may_hold_jobs", "its transfer_jobs may be non-empty (every way out of these states that a "
    "reset takes must drop them: INV-1)",
    (LOADING_ASYNC, LOADING_SYNC, STORING, PREEMPTED_FLUSHING, WAITING_STORING,
     FINISHED_PENDING_FINAL, FINISHED_DRAINING))
HOLDS_JOBS = StateGroup(
    "holds_jobs", "its transfer_jobs is not empty (the state's vLLM predicate says so): a "
    "job is in flight for it", (LOADING_ASYNC, LOADING_SYNC, STORING, PREEMPTED_FLUSHING,
                                WAITING_STORING, FINISHED_DRAINING))
AWAITING_ADMISSION = StateGroup(
    "awaiting_admission", "the core's waiting queue holds it: its next admission starts with "
    "a lookup", (IDLE, LOOKUP_DEFERRED, PREEMPTED_FLUSHING, RECOMPUTE, TIMED_OUT))
QUIESCENT = StateGroup(
    "quiescent", "nothing of the request is in flight: it may wait here as long as the core "
    "wants (progress properties end here)",
    (IDLE, RUNNING, RECOMPUTE, TIMED_OUT))
WAITING_ON_CONNECTOR = StateGroup(
    "waiting_on_connector", "the request cannot run until something else ends (its flushed "
    "jobs, a backend retry, another request's load); P-2 demands it does not stay forever",
    (LOOKUP_DEFERRED, PREEMPTED_FLUSHING))
GROUPS = (UNFINISHED_TRACKED, FINISHED, SCHEDULED, PREEMPT_FLUSHED, STORE_CANDIDATES,
          HOLDS_GPU_BLOCKS,
          MUST_RECOMPUTE, PREEMPTED_IF_RUNNING, MAY_HOLD_JOBS, HOLDS_JOBS, AWAITING_ADMISSION,
          QUIESCENT, WAITING_ON_CONNECTOR)


def finished_keeps_destinations(kind: str, sync: bool) -> bool:
    """Whether a finished request still holds the GPU blocks a live job of it names: only an
    async load's destinations, which the core keeps until the load's finished_recving (an
    abort while loading, CS:3017-3027). A sync load's copy ended with the step that ran it
    (W:256-270), so the core freed its destinations at the finish like the request's other
    blocks, and may hand them to another request while the load's reports are still due."""
    return kind == "load" and not sync


def recving_is_stale(req_id: str, completed: int,
                     due: Iterable[tuple[str, str, bool, int]]) -> bool:
    """Whether a `finished_recving` that names `req_id` is stale. vLLM's worker names a
    request as soon as an async load of it completes on every rank (W:286-321, KU:90-101),
    whichever load that was; in vLLM a request has one async load at a time. Past a timeout
    (beyond vLLM) the spec admits a request again while its timed-out load still copies, so
    that load's late completion names a request whose newer async load (live, or orphaned by
    a reset and fenced) is still due. The connector then neither promotes the request
    (ORPHANED_LOAD's `load_recving`) nor lets the core promote it early: it takes the id out
    of `finished_recving` and counts it (`stale_recving_ignored`); the newer load's own
    completion names the request again. `completed`: the newest async load of the request
    whose last report the output carries; `due`: (owner, kind, sync, job id) of every job
    whose reports are still due once the output's reports are applied (live, quarantined or
    fenced)."""
    return any(owner == req_id and kind == "load" and not sync and job_id > completed
               for owner, kind, sync, job_id in due)


GUARDS = (
    Guard("other_jobs_remain", "after the ending job leaves, the request still holds a job"),
    Guard("has_transfer_jobs", "the request holds at least one job"),
    Guard("load_invalid", "a load of this request failed or timed out since it was last "
          "admitted: its loaded tokens must be recomputed"),
)

EFFECTS = (
    Effect("create_request_status", "create the request's status; manager.on_new_request"),
    Effect("restart_from_token_zero", "clear block_ids, store cursor to 0 (S:1242-1245); the "
           "request's KV no longer depends on any earlier load"),
    Effect("start_deferral_timer", "set deferred_lookup_start_time if unset"),
    Effect("record_lookup_hit", "num_hit_chunks; reserve the sync-load budget if it fits"),
    Effect("bypass_offload_lookup", "answer 0 without asking the manager; clear load_invalid"),
    Effect("create_load_job", "prepare_load (pins), new job id, pending_count = num_workers, "
           "id into transfer_jobs and _jobs; a sync load's id is remembered as the load the "
           "request's KV depends on until its next restart (beyond vLLM: its failure, even "
           "after a reset made it stale, invalidates the request)"),
    Effect("mark_chunks_being_loaded", "add the load's keys to _chunks_being_loaded"),
    Effect("record_block_ids", "the request's block table as the core schedules it (the "
           "connector learns it here, not at the load: a request never scheduled since its "
           "lookup has none to store from)"),
    Effect("create_store_job", "prepare_store; new job id into transfer_jobs and _jobs; fence "
           "sliding-window sources; advance the store cursor"),
    Effect("count_allocation_failure", "ALLOCATION_FAILURE counter; store cursor kept"),
    Effect("flush_request_jobs", "every job of the request into jobs_to_flush"),
    Effect("register_deferred_fences", "register each job's deferred source blocks in the "
           "block fence map: the blocks are about to be freed"),
    Effect("signal_request_finished", "finished_signaled = True; manager.on_request_finished"),
    Effect("delete_request_status", "remove the request from _req_status"),
    Effect("reset_store_cursor", "store cursors to 0, partial-tail boundary cleared; "
           "sliding-window positions the core freed (before the window) zeroed, so no store "
           "reads them again (beyond vLLM 0.33.0: F2)"),
    Effect("drop_request_jobs", "the request's jobs leave _jobs and transfer_jobs together "
           "and enter the reset fence (the job machine's reset)"),
    Effect("mark_load_invalid", "remember that the loaded tokens must be recomputed"),
    Effect("poison_request_stores", "the request's live stores read KV computed from the "
           "failed load: they end as failed and are rolled back (a worker reports a request's "
           "sync load before its later jobs, so none of them completed before the failure "
           "was known)"),
    Effect("quarantine_load_blocks", "the timed-out load's destination GPU blocks are held "
           "out of the free pool until its late acks arrive"),
    Effect("signal_untracked_finished", "manager.on_new_request then on_request_finished for "
           "a request the connector never tracked"),
    Effect("promote_after_recving", "core: the stale load's finished_recving moves the "
           "request back to WAITING (CS:3569-3575)"),
)

_ENDING_STORE = "update_connector_output"

TRANSITIONS = (
    # --- admission and lookup -------------------------------------------------------
    Transition("add", (ABSENT,), IDLE, "on_new_request", "S:1197-1208",
               effects=("create_request_status",)),
    Transition("lookup_deferred", (IDLE, LOOKUP_DEFERRED), LOOKUP_DEFERRED,
               "get_num_new_matched_tokens", "S:1262-1269",
               effects=("restart_from_token_zero", "start_deferral_timer"),
               note="backend RETRY/HIT_PENDING or a hit chunk in _chunks_being_loaded"),
    Transition("lookup_resolved", (IDLE, LOOKUP_DEFERRED), IDLE,
               "get_num_new_matched_tokens", "S:1272-1277",
               effects=("restart_from_token_zero", "record_lookup_hit"),
               note="hit of n >= 0 tokens; n > 0 is followed by update_state_after_alloc "
               "unless allocate_slots fails (then the request simply stays IDLE)"),
    Transition("lookup_resolved", (RECOMPUTE, TIMED_OUT), SAME,
               "get_num_new_matched_tokens", BEYOND_VLLM,
               effects=("restart_from_token_zero", "bypass_offload_lookup"),
               path=Path.FAILURE, note="after a failed or timed-out load the hit is 0; the "
               "request stays here until it is scheduled, so a failed allocate_slots does not "
               "let the next lookup load the same chunks again (a retry loop the job timeout "
               "could keep alive forever: P-1, P-4)"),
    Transition("lookup_blocked", (PREEMPTED_FLUSHING,), SAME,
               "get_num_new_matched_tokens", "S:1247-1252",
               effects=("restart_from_token_zero",), path=Path.PREEMPT,
               note="transfer_jobs non-empty: answer None, no lookup (issue #46014)"),
    Transition("load_async", (IDLE,), LOADING_ASYNC, "update_state_after_alloc",
               "S:1351-1499", unless=("has_transfer_jobs",),
               effects=("create_load_job", "mark_chunks_being_loaded")),
    Transition("load_sync", (IDLE,), LOADING_SYNC, "update_state_after_alloc",
               "S:1371, S:1484-1495", unless=("has_transfer_jobs",),
               effects=("create_load_job",)),
    Transition("schedule", (IDLE, RECOMPUTE, TIMED_OUT), RUNNING, "build_connector_meta",
               "S:1502-1552", effects=("record_block_ids",),
               note="_update_req_states for a scheduled request (a recomputing one too)"),
    Transition("schedule", (WAITING_STORING,), STORING, "build_connector_meta",
               "S:1502-1552", effects=("record_block_ids",),
               note="scheduled while the store of its loaded state is in flight"),
    # --- stores ---------------------------------------------------------------------
    Transition("store", (RUNNING, STORING), STORING, "build_connector_meta",
               "S:1815-2101, S:1554-1624", unless=("load_invalid",),
               effects=("create_store_job",),
               note="new full chunks from the block table; or a Mamba state the core handed "
               "off at a chunk boundary, stored alone and fenced at creation"),
    Transition("store", (LOADING_SYNC, FINISHED_PENDING_FINAL), SAME, "build_connector_meta",
               "S:1815-2101, S:2094-2099, S:1554-1624", unless=("load_invalid",),
               effects=("create_store_job",),
               note="beside a sync load; or the final store of a finished request; never "
               "from KV that a failed load invalidated (the hook offers nothing then)"),
    Transition("store", (IDLE, WAITING_STORING), WAITING_STORING, "build_connector_meta",
               "S:1554-1624, CS:3467-3535", unless=("load_invalid",),
               effects=("create_store_job",),
               note="a Mamba state the core handed off as its waiting loop cached the blocks an "
               "async load filled, without scheduling the request in that step; stored alone "
               "and fenced at creation (the CPU cache held it, unless a reset or an eviction "
               "emptied its chunk since the load)"),
    Transition("store_alloc_failed", (RUNNING, STORING, LOADING_SYNC, FINISHED_PENDING_FINAL,
                                      IDLE, WAITING_STORING),
               SAME, "build_connector_meta", "S:1988-1996", unless=("load_invalid",),
               effects=("count_allocation_failure",), note="prepare_store returned None"),
    # --- job endings ----------------------------------------------------------------
    Transition("store_ended", (STORING,), SAME, _ENDING_STORE, "S:2283-2308",
               requires=("other_jobs_remain",)),
    Transition("store_ended", (STORING,), RUNNING, _ENDING_STORE, "S:2283-2308",
               unless=("other_jobs_remain",)),
    Transition("store_ended", (LOADING_SYNC, FINISHED_PENDING_FINAL), SAME, _ENDING_STORE,
               "S:2283-2308", note="the sync load, or the pending finalisation, remains"),
    Transition("store_ended", (WAITING_STORING,), SAME, _ENDING_STORE, "S:2283-2308",
               requires=("other_jobs_remain",)),
    Transition("store_ended", (WAITING_STORING,), IDLE, _ENDING_STORE, "S:2283-2308",
               unless=("other_jobs_remain",), note="still waiting to be scheduled"),
    Transition("load_ended", (LOADING_ASYNC,), IDLE, _ENDING_STORE, "S:2283-2308, CS:3569-3575",
               note="then finished_recving: the core re-queues it with the loaded tokens"),
    Transition("load_ended", (LOADING_SYNC,), STORING, _ENDING_STORE, "S:2283-2308",
               requires=("other_jobs_remain",)),
    Transition("load_ended", (LOADING_SYNC,), RUNNING, _ENDING_STORE, "S:2283-2308",
               unless=("other_jobs_remain",)),
    Transition("load_ended", (FINISHED_PENDING_FINAL,), SAME, _ENDING_STORE, "S:2283-2308"),
    *(Transition(trig, (PREEMPTED_FLUSHING,), SAME, _ENDING_STORE, "S:2307-2308",
                 requires=("other_jobs_remain",), path=Path.PREEMPT)
      for trig in ("store_ended", "load_ended")),
    *(Transition(trig, (PREEMPTED_FLUSHING,), IDLE, _ENDING_STORE, "S:2307-2308",
                 unless=("other_jobs_remain", "load_invalid",), path=Path.PREEMPT)
      for trig in ("store_ended", "load_ended")),
    Transition("store_ended", (PREEMPTED_FLUSHING,), RECOMPUTE, _ENDING_STORE, BEYOND_VLLM,
               requires=("load_invalid",), unless=("other_jobs_remain",), path=Path.FAILURE,
               note="the poisoned stores of a failed sync load drained (a request holds one "
               "load at most, so the last job here is a store)"),
    *(Transition(trig, (FINISHED_DRAINING,), SAME, _ENDING_STORE, "S:2283-2308",
                 requires=("other_jobs_remain",), path=Path.FINISH)
      for trig in ("store_ended", "load_ended")),
    *(Transition(trig, (FINISHED_DRAINING,), ABSENT, _ENDING_STORE, "S:2309-2310",
                 unless=("other_jobs_remain",), effects=("delete_request_status",),
                 path=Path.FINISH)
      for trig in ("store_ended", "load_ended")),
    # --- preemption -----------------------------------------------------------------
    Transition("preempt", (RUNNING,), IDLE, "build_connector_meta", "CS:1799-1843",
               path=Path.PREEMPT, note="no job to flush"),
    Transition("preempt", (STORING, LOADING_SYNC), PREEMPTED_FLUSHING, "build_connector_meta",
               "S:2136-2151", effects=("flush_request_jobs",), path=Path.PREEMPT),
    Transition("preempt", (FINISHED_PENDING_FINAL,), SAME, "build_connector_meta",
               "S:2136-2151", effects=("flush_request_jobs",), path=Path.PREEMPT,
               note="preempted outside schedule() (a reset of the running requests), then "
               "finished before the next step: its jobs are flushed all the same (a flush "
               "only makes the workers finish a copy sooner; CONFORMANCE.md D2)"),
    # --- finish (and abort, legal in every state) -------------------------------------
    Transition("finish", UNFINISHED_TRACKED.states, FINISHED_PENDING_FINAL, "request_finished",
               "S:2361-2376, CS:3017-3027", effects=("register_deferred_fences",),
               path=Path.FINISH, note="finish or abort; an abort while loading keeps its "
               "blocks until finished_recving"),
    Transition("finish_untracked", (ABSENT,), SAME, "request_finished", "S:2352-2359",
               effects=("signal_untracked_finished",), path=Path.FINISH,
               note="the request was never tracked"),
    Transition("finalize", (FINISHED_PENDING_FINAL,), ABSENT, "build_connector_meta",
               "S:2177-2184", unless=("has_transfer_jobs",),
               effects=("signal_request_finished", "delete_request_status"), path=Path.FINISH),
    Transition("finalize", (FINISHED_PENDING_FINAL,), FINISHED_DRAINING, "build_connector_meta",
               "S:2177-2184", requires=("has_transfer_jobs",),
               effects=("signal_request_finished",), path=Path.FINISH),
    # --- reset_cache ---------------------------------------------------------------
    Transition("reset", FINISHED.states, ABSENT, "reset_cache", "S:2419-2423",
               effects=("drop_request_jobs", "signal_request_finished",
                        "delete_request_status"), path=Path.RESET),
    Transition("reset", (IDLE, LOOKUP_DEFERRED, RECOMPUTE, TIMED_OUT), SAME, "reset_cache",
               "S:2429-2433", effects=("reset_store_cursor",), path=Path.RESET),
    Transition("reset", (RUNNING, STORING), RUNNING, "reset_cache",
               "S:2429-2433", effects=("drop_request_jobs", "reset_store_cursor"),
               path=Path.RESET, note="the #48102 fix: transfer_jobs cleared with _jobs"),
    Transition("reset", (LOADING_SYNC,), RUNNING, "reset_cache",
               "S:2429-2433", unless=("load_invalid",),
               effects=("drop_request_jobs", "reset_store_cursor"), path=Path.RESET,
               note="the request keeps running on its sync load's KV; a failure reported for "
               "that load later (stale) still invalidates it (kv_invalidated)"),
    Transition("reset", (LOADING_SYNC,), RECOMPUTE, "reset_cache", BEYOND_VLLM,
               requires=("load_invalid",), effects=("drop_request_jobs", "reset_store_cursor"),
               path=Path.RESET, note="a worker already failed its sync load: recompute"),
    Transition("reset", (WAITING_STORING,), IDLE, "reset_cache", "S:2429-2433",
               effects=("drop_request_jobs", "reset_store_cursor"), path=Path.RESET,
               note="its loaded blocks stay with the core; it is scheduled without a lookup"),
    Transition("reset", (PREEMPTED_FLUSHING,), IDLE, "reset_cache", "S:2429-2433",
               unless=("load_invalid",), effects=("drop_request_jobs", "reset_store_cursor"),
               path=Path.RESET),
    Transition("reset", (PREEMPTED_FLUSHING,), RECOMPUTE, "reset_cache", BEYOND_VLLM,
               requires=("load_invalid",), effects=("drop_request_jobs", "reset_store_cursor"),
               path=Path.RESET),
    Transition("reset", (LOADING_ASYNC, ORPHANED_LOAD), ORPHANED_LOAD, "reset_cache",
               "S:2429-2433", effects=("drop_request_jobs", "reset_store_cursor"),
               path=Path.RESET, note="the flushed load still reports finished_recving"),
    Transition("load_recving", (ORPHANED_LOAD,), IDLE, "update_from_output",
               "S:2266-2282, CS:3569-3575", unless=("load_invalid",),
               effects=("promote_after_recving",), path=Path.RESET,
               note="the stale ack is filtered; the core still promotes, unless a worker "
               "named the request in failed_recving (Rules.stale_load_failure FENCE_ONLY: "
               "the core recomputes it)"),
    Transition("load_recving", (ORPHANED_LOAD,), RECOMPUTE, "update_from_output", BEYOND_VLLM,
               requires=("load_invalid",), path=Path.FAILURE,
               note="a worker failed the orphaned load: its tokens are recomputed, not "
               "trusted (vLLM has no failure report)"),
    # --- failures and timeouts (beyond vLLM) -----------------------------------------
    Transition("load_failed", (LOADING_ASYNC,), RECOMPUTE, _ENDING_STORE, BEYOND_VLLM,
               effects=("mark_load_invalid",), path=Path.FAILURE),
    Transition("load_failed", (LOADING_SYNC,), RECOMPUTE, _ENDING_STORE, BEYOND_VLLM,
               unless=("other_jobs_remain",), effects=("mark_load_invalid",),
               path=Path.FAILURE),
    Transition("load_failed", (LOADING_SYNC,), PREEMPTED_FLUSHING, _ENDING_STORE, BEYOND_VLLM,
               requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE,
               note="its stores read KV computed from the failed load: poisoned, they end "
               "FAILED and are rolled back, so their source blocks need no fence"),
    Transition("load_failed", (PREEMPTED_FLUSHING,), SAME, _ENDING_STORE, BEYOND_VLLM,
               requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE,
               note="the flushed stores read KV computed from the failed load"),
    Transition("load_failed", (PREEMPTED_FLUSHING,), RECOMPUTE, _ENDING_STORE, BEYOND_VLLM,
               unless=("other_jobs_remain",), effects=("mark_load_invalid",),
               path=Path.FAILURE),
    Transition("load_failed", (FINISHED_PENDING_FINAL,), SAME, _ENDING_STORE, BEYOND_VLLM,
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE,
               note="no final store is then made from its KV"),
    Transition("load_failed", (FINISHED_DRAINING,), SAME, _ENDING_STORE, BEYOND_VLLM,
               requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE),
    Transition("load_failed", (FINISHED_DRAINING,), ABSENT, _ENDING_STORE, BEYOND_VLLM,
               unless=("other_jobs_remain",), effects=("delete_request_status",),
               path=Path.FAILURE),
    # --- a failure reported for the sync load the request's KV depends on (beyond vLLM) ---
    Transition("kv_invalidated", (LOADING_SYNC, PREEMPTED_FLUSHING, FINISHED_PENDING_FINAL,
                                  FINISHED_DRAINING), SAME, _ENDING_STORE, BEYOND_VLLM,
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE,
               note="at the first failure report, before the load's other reports: no store "
               "reads that KV from now on"),
    Transition("kv_invalidated", (RUNNING,), RECOMPUTE, _ENDING_STORE, BEYOND_VLLM,
               effects=("mark_load_invalid",), path=Path.FAILURE,
               note="a reset made its sync load stale; a worker now reports it failed"),
    Transition("kv_invalidated", (STORING,), PREEMPTED_FLUSHING, _ENDING_STORE, BEYOND_VLLM,
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.FAILURE,
               note="as from RUNNING; its stores since the reset read that KV"),
    Transition("kv_invalidated", (IDLE, RECOMPUTE, TIMED_OUT), SAME, _ENDING_STORE,
               BEYOND_VLLM, path=Path.FAILURE,
               note="preempted (its KV was dropped) or already recomputing: nothing to do"),
    Transition("load_timed_out", (LOADING_ASYNC,), TIMED_OUT, "build_connector_meta",
               BEYOND_VLLM, effects=("mark_load_invalid", "quarantine_load_blocks"),
               path=Path.TIMEOUT),
    Transition("load_timed_out", (LOADING_SYNC,), TIMED_OUT, "build_connector_meta",
               BEYOND_VLLM, unless=("other_jobs_remain",),
               effects=("mark_load_invalid", "quarantine_load_blocks"), path=Path.TIMEOUT),
    Transition("load_timed_out", (LOADING_SYNC,), PREEMPTED_FLUSHING, "build_connector_meta",
               BEYOND_VLLM, requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "quarantine_load_blocks", "poison_request_stores"),
               path=Path.TIMEOUT),
    Transition("load_timed_out", (PREEMPTED_FLUSHING,), SAME, "build_connector_meta",
               BEYOND_VLLM, requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "poison_request_stores"), path=Path.TIMEOUT),
    Transition("load_timed_out", (PREEMPTED_FLUSHING,), RECOMPUTE, "build_connector_meta",
               BEYOND_VLLM, unless=("other_jobs_remain",), effects=("mark_load_invalid",),
               path=Path.TIMEOUT, note="preempted: its blocks were already freed behind the "
               "flush"),
    Transition("load_timed_out", (FINISHED_PENDING_FINAL,), SAME, "build_connector_meta",
               BEYOND_VLLM,
               effects=("mark_load_invalid", "quarantine_load_blocks", "poison_request_stores"),
               path=Path.TIMEOUT),
    Transition("load_timed_out", (FINISHED_DRAINING,), SAME, "build_connector_meta",
               BEYOND_VLLM, requires=("other_jobs_remain",),
               effects=("mark_load_invalid", "quarantine_load_blocks", "poison_request_stores"),
               path=Path.TIMEOUT),
    Transition("load_timed_out", (FINISHED_DRAINING,), ABSENT, "build_connector_meta",
               BEYOND_VLLM, unless=("other_jobs_remain",),
               effects=("quarantine_load_blocks", "delete_request_status"), path=Path.TIMEOUT),
)

REQUEST_MACHINE = MachineSpec(
    name="request",
    title="Request lifecycle (connector view)",
    subject="request",
    states=STATES,
    transitions=TRANSITIONS,
    initial=ABSENT,
    finals=(ABSENT,),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("any hook for a request in ABSENT other than add and finish",
         "typed error UnknownRequest; vLLM raises KeyError (S:1241, 1369, 1510)"),
    ),
)
