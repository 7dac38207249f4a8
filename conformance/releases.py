"""The vLLM releases `make conformance` supports, and what each one has.

Every release on the package index from the first whose offloading connector has
`reset_cache` (0.22.0, see FIRST_RESET_CACHE) up to 0.34.0. Per release: whether it has the
PR #48102 bug (its `reset_cache` clears `_jobs` but not the requests' `transfer_jobs`),
whether it has the reset fence (`_reset_fence`), and the pip packages its scheduler-side
imports need beyond scripts/vllm-venv.sh's common list (found by building each release).

The feature table (FEATURES) says from which release on the scheduler side has each
difference the conformance code translates; `conformance.vllm_env` reads it. Every entry is
backed by lines of the first release that has it (FEATURE_EVIDENCE), cited as
`spec/vllm.py` writes a citation of another release (``S@0.26.0:1345``).

Standard library only, usable from the shell before any venv exists:

    python3 conformance/releases.py list            # the supported releases, one a line
    python3 conformance/releases.py check 0.26.0    # exit 1, naming the supported ones, if not
    python3 conformance/releases.py extras 0.22.0   # the extra pip packages, one a line
    python3 conformance/releases.py show            # the table

One command reads an installed vLLM instead, so the venv's python runs it once vLLM (with
--no-deps) and `packaging` are in:

    VENV/bin/python conformance/releases.py pins transformers fastapi ...
        # each package as a pip requirement, with the version range vLLM declares for it
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

Version = tuple[int, int, int]


def parse(text: str) -> Version:
    """'0.25.1' -> (0, 25, 1); a local or dev suffix is dropped ('0.33.1.dev3+g12' ->
    (0, 33, 1)); missing parts are 0."""
    parts: list[int] = []
    for piece in text.strip().split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def text(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Release:
    version: str
    bug_48102: bool
    """`reset_cache` clears `_jobs` but not each request's `transfer_jobs` (PR #48102)."""
    reset_fence: bool
    """`_reset_fence`: the reports still due for the jobs live at a reset."""
    extras: tuple[str, ...] = ()
    """pip packages its scheduler-side imports need beyond vllm-venv.sh's common list
    (0.22.0-0.23.0: `gguf`, imported at vllm/transformers_utils/gguf_utils.py:9, which
    vllm/transformers_utils/config.py:37 imports at module level on the way to
    `VllmConfig`; 0.24.0 imports it lazily. A build without it fails its import check with
    ModuleNotFoundError)."""

    @property
    def key(self) -> Version:
        return parse(self.version)


FIRST_RESET_CACHE = "0.22.0"
RESET_CACHE_EVIDENCE = (
    "0.22.0: vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py:177 "
    "`def reset_cache(self) -> bool | None` (calls the scheduler's), "
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:967 "
    "`def reset_cache(self) -> None`; 0.21.0: neither file has `def reset_cache` "
    "(OffloadingConnector inherits base.py:643, which logs that it is not implemented and "
    "returns None)")

# 0.22.0-0.25.1: reset_cache has no `transfer_jobs.clear()` (PR #48102); 0.26.0 adds it
# (offloading/scheduler.py:1323-); 0.33.0 adds `_reset_fence`.
RELEASES: tuple[Release, ...] = (
    Release("0.22.0", bug_48102=True, reset_fence=False, extras=("gguf",)),
    Release("0.22.1", bug_48102=True, reset_fence=False, extras=("gguf",)),
    Release("0.23.0", bug_48102=True, reset_fence=False, extras=("gguf",)),
    Release("0.24.0", bug_48102=True, reset_fence=False),
    Release("0.25.0", bug_48102=True, reset_fence=False),
    Release("0.25.1", bug_48102=True, reset_fence=False),
    Release("0.26.0", bug_48102=False, reset_fence=False),
    Release("0.27.0", bug_48102=False, reset_fence=False),
    Release("0.27.1", bug_48102=False, reset_fence=False),
    Release("0.28.0", bug_48102=False, reset_fence=False),
    Release("0.29.0", bug_48102=False, reset_fence=False),
    Release("0.30.0", bug_48102=False, reset_fence=False),
    Release("0.31.0", bug_48102=False, reset_fence=False),
    Release("0.32.0", bug_48102=False, reset_fence=False),
    Release("0.33.0", bug_48102=False, reset_fence=True),
    Release("0.34.0", bug_48102=False, reset_fence=True),
)

# ----------------------------------------------------------------------------- features
# feature -> the first release that has it; the evidence is in FEATURE_EVIDENCE.
FEATURES: dict[str, str] = {
    "fix_48102": "0.26.0",
    "reset_fence": "0.33.0",
    "on_new_request": "0.23.0",
    "offload_caps": "0.23.0",
    "manager_finish_signal": "0.23.0",
    "transfer_job_fields": "0.25.0",
    "lookup_defers_in_flight": "0.24.0",
    "prefix_match_unit": "0.26.0",
    "blocks_per_chunk": "0.26.0",
    "finished_signal": "0.27.0",
    "partial_tails": "0.28.0",
    "kv_tensor_layers": "0.29.0",
    "block_state_handoffs": "0.29.0",
    "block_state_resolver": "0.30.0",
    "max_num_new_tokens": "0.30.0",
    "manager_chunks": "0.30.0",
    "manager_key_positions": "0.31.0",
    "manager_request_recency": "0.31.0",
    "arc_eviction_fallback": "0.30.0",
    "store_admission_at_store": "0.30.0",
    "finished_commit_point": "0.30.0",
    "retention_interval": "0.30.0",
    "max_load_tokens": "0.31.0",
    "sync_loads": "0.33.0",
    "preempted_load_flush": "0.33.0",
    "lookup_resets_cursor": "0.33.0",
    "step_region": "0.33.0",
    "lru_request_ranks": "0.33.0",
    "failed_store_cleanup_event": "0.33.0",
    "mamba_last_edge_stop": "0.32.0",
    "resumed_as_new": "0.34.0",
    "null_pages_in_chunk": "0.34.0",
    "failure_reports": "0.34.0",
    "hybrid_hit_at_the_cap": "0.34.0",
    "second_reset_merges": "0.34.0",
    "manager_touch_removed": "0.34.0",
    "store_admission_once_per_request": "0.34.0",
    "tier_store_marks_present": "0.34.0",
    "partial_tail_anchor": "0.34.0",
}

FEATURE_EVIDENCE: dict[str, str] = {
    "fix_48102": "S@0.26.0:1345 reset_cache (S@0.26.0:1323) clears each request's "
                 "transfer_jobs (`status.transfer_jobs.clear()`); 0.25.1's reset_cache "
                 "(S@0.25.1:1231) does not",
    "reset_fence": "S:654 `_reset_fence` (stale job id -> reports due); absent before",
    "offload_caps": "S@0.23.0:97 the `offload_prompt_only` setting, S@0.23.0:183-207 the "
                    "per-request `max_offload_tokens`; absent in 0.22.x",
    "on_new_request": "S@0.23.0:525 `def on_new_request` (0.22.0 creates a request's state "
                      "at its first lookup, S@0.22.0:525-528)",
    "transfer_job_fields": "C@0.25.0:54-66 TransferJob(req_id, src_spec, dst_spec); "
                           "0.22.0-0.24.0 TransferJob(req_id, transfer_spec=(src, dst)), "
                           "C@0.22.0:15-25",
    "manager_finish_signal": "B@0.23.0:242 `OffloadingManager.on_request_finished`, called "
                             "at S@0.23.0:1014 (absent in 0.22.x)",
    "lookup_defers_in_flight": "S@0.24.0:662-667 get_num_new_matched_tokens answers (None, "
                               "False) while the request holds jobs in flight; 0.22.0-0.23.0 "
                               "look it up, and the Scheduler admits it again",
    "partial_tails": "S@0.28.0:1154 `_build_partial_tail_store_jobs`",
    "retention_interval": "S@0.30.0:216 reads `cache_config.prefix_cache_retention_interval`"
                          " (0.29.0 has the config field, the connector does not read it); "
                          "before, a sliding-window store keeps the trailing chunks of each "
                          "full-attention alignment segment (S@0.26.0:975-996)",
    "manager_chunks": "M@0.30.0:44 CPUOffloadingManager(num_chunks, ...), LRU@0.30.0:25 "
                      "`self.chunks`; 0.29.0: num_blocks, `blocks`",
    "manager_key_positions": "B@0.31.0:112 `ReqContext.set_offload_key_position` (absent in "
                             "0.30.0)",
    "arc_eviction_fallback": "ARC@0.30.0:140-156 when T1 and then T2 offer no eligible "
                             "chunk, evict tries T1 again (151-156); ARC@0.29.0:140-150 gives "
                             "up after T2 (149): a store is refused while T1 holds an idle "
                             "chunk, if |T1| < p",
    "manager_request_recency": "M@0.31.0:393-419 `on_request_finished` hands a request's "
                               "keys to the policy (LRU@0.31.0:96, ARC@0.31.0:115); 0.30.0's "
                               "manager has none (the base's no-op, B@0.30.0:338-356), its "
                               "LRU orders idle chunks by when they became idle "
                               "(LRU@0.30.0:81-90) and its ARC moves keys on `touch` only "
                               "(ARC@0.30.0:75-99)",
    "store_admission_at_store": "M@0.30.0:106 `_record_accesses` at prepare_store counts a "
                                "chunk's offers (the spec's store threshold); 0.29.0 and "
                                "before count lookups (M@0.26.0:120-128)",
    "max_load_tokens": "S@0.31.0:367-391 the per-request `max_load_tokens` "
                       "(kv_transfer_params)",
    "finished_commit_point": "S@0.30.0:1479-1485 a finished request offloads up to "
                             "`max(num_prompt_tokens, num_tokens - 1)` (its last sampled "
                             "token's slot is never committed); 0.26.0-0.29.0 up to "
                             "`num_tokens` (S@0.29.0:1337-1340)",
    "prefix_match_unit": "CFG@0.26.0:56 `prefix_match_unit`",
    "blocks_per_chunk": "S@0.26.0:238 `next_stored_chunk_idx`, S@0.26.0:403 "
                        "`_chunks_being_loaded` (0.25: `next_stored_block_idx`, "
                        "`_blocks_being_loaded`)",
    "finished_signal": "S@0.27.0:290 `RequestOffloadState.finished_signaled` (the manager "
                       "is signaled after the final store); 0.26.0 signals it in "
                       "request_finished (S@0.26.0:1292)",
    "kv_tensor_layers": "KCI@0.29.0:1165-1185 KVCacheTensor(size, layers, "
                        "layer_stride, block_stride); 0.28.0: KVCacheTensor(size, "
                        "shared_by), KCI@0.28.0:929-937",
    "block_state_handoffs": "SO@0.29.0:209 `class KVConnectorBlockState` (the core's Mamba "
                            "hand-offs)",
    "block_state_resolver": "SO@0.30.0:212-214 `KVConnectorBlockState(req_ids, "
                            "resolve_block_ids, ...)` resolves a table on access; 0.29.0 takes "
                            "the tables as a snapshot (SO@0.29.0:213 `block_ids`)",
    "max_num_new_tokens": "S@0.30.0:754 get_num_new_matched_tokens(..., "
                          "max_num_new_tokens); before, a full-attention lookup may hit the "
                          "whole prompt (S@0.26.0:549-554 bounds it only with a window)",
    "sync_loads": "S:168 `sync_load_budget_bytes`, S:89 `TransferJobStatus.is_sync_load`",
    "step_region": "S:677 `_step_region` (S:1239, S:1367, S:2108-2113)",
    "lookup_resets_cursor": "S:1241-1245 get_num_new_matched_tokens puts every group's "
                            "`next_stored_chunk_idx` back to 0 (a restart offers every chunk "
                            "again); 0.26.0-0.32.0 keep it",
    "preempted_load_flush": "S:2136-2150 flushes a preempted request's jobs whatever "
                            "their kind; 0.22.0-0.32.0 assert they are stores "
                            "(`assert self._jobs[any_jid].is_store`, S@0.26.0:1138, "
                            "S@0.32.0:1862)",
    "lru_request_ranks": "LRU:108-117 an inserted key takes its request's rank "
                         "`(request_rank, -position)` (LRU:51-61), LRU:133-153 a reused key is "
                         "raised to it on access (M:181-182 `on_request_access`): within an "
                         "active request the tail is evicted before the head; 0.31.0-0.32.0 "
                         "rank each key by insertion (LRU@0.31.0:77-80), the request's order "
                         "only at its finish (LRU@0.31.0:96-104)",
    "failed_store_cleanup_event": "M:402-410 a failed store's keys get a removal event "
                                  "with `metadata_only=True` (B:176-177; M:466-479 drop "
                                  "the keys a retry re-allocated); 0.31.0-0.32.0 free them "
                                  "without an event (M@0.31.0:375-381) and "
                                  "`OffloadingEvent` has no `metadata_only` "
                                  "(B@0.31.0:165-173)",
    "mamba_last_edge_stop": "CS:579-583 the core's align-mode prefill split stops at "
                            "`get_mamba_prefill_checkpoint_position(num_tokens, ...)`, the "
                            "last block edge before the last token (an 80-token prompt of "
                            "16-token blocks: 64, then 16); 0.30.0-0.31.0 stop at "
                            "`num_tokens - num_tokens % block_size` (CS@0.31.0:444: 80 in "
                            "one chunk). Measured with `make conformance-all`: the chunk "
                            "test fails on 0.30.0 and 0.31.0, passes on 0.32.0",
    "resumed_as_new": "CS@0.34.0:1619-1626 a request scheduled again after a preemption "
                      "goes into `scheduled_new_reqs` with its whole table; "
                      "SO@0.34.0:139-147 `CachedRequestData` has no `resumed_req_ids` "
                      "(SO:143) and SO@0.34.0:58-63 `NewRequestData.from_request` needs "
                      "`prefill_token_ids`",
    "null_pages_in_chunk": "S@0.34.0:2203-2215 a store keeps a chunk's null blocks (block "
                           "0) among its sources, so each block keeps its sub-block of "
                           "the CPU chunk and a null one copies the null block's zeros; "
                           "S:2032-2036 skips them: a null block's sub-block is not "
                           "written",
    "failure_reports": "W@0.34.0:304-316 a worker reports a failed transfer "
                       "(`mark_completed(job_id, success=False)`, C@0.34.0:91-95) and an "
                       "async load's request in `failed_recving`; S@0.34.0:2458-2459 the job "
                       "is marked failed, and at its last report a store ends with "
                       "`complete_store(success=False)` (S@0.34.0:2466-2478) and a load sets "
                       "the request's `load_failed` (S@0.34.0:2479-2487), which answers every "
                       "later lookup 0 (S@0.34.0:1411); the failure of a load a reset made "
                       "stale is only counted against the fence (S@0.34.0:2440-2456) and "
                       "the core recomputes the request on `failed_recving` "
                       "(CS@0.34.0:3839-3852); before, W:299-301 asserts success",
    "hybrid_hit_at_the_cap": "S@0.34.0:921-931 with a sliding-window (or Mamba) group the "
                             "lookup takes one token off the request's length before "
                             "`max_num_new_tokens` and `max_load_tokens` cap it, so a cap "
                             "on a hash block is kept; S:872-876 takes it off after the "
                             "caps, so the hit ends one token short of the cap",
    "second_reset_merges": "S@0.34.0:2609-2616 `reset_cache` no longer asserts that "
                           "`_current_batch_jobs_to_flush` is empty and merges a second "
                           "reset's jobs into it (S@0.34.0:2626); S:2406 asserts it (F1)",
    "manager_touch_removed": "the manager and its policies have no `touch` (M:244-245 and "
                             "LRU:128-130 have one, which no scheduler code calls; "
                             "PB@0.34.0:75-83 `on_store_miss` no longer falls back to it)",
    "store_admission_once_per_request": "M@0.34.0:46-49 `counted_keys`: a key counts toward "
                                        "`store_threshold` once per request "
                                        "(M@0.34.0:133-147, M@0.34.0:290-298), so a re-offer "
                                        "after a preemption does not admit it; M:129-136 counts "
                                        "every offer",
    "tier_store_marks_present": "TF@0.34.0:286-288 a successful cascade calls "
                                "`mark_present` (TAL@0.34.0:234-260): the keys' cached "
                                "verdicts become hits under a new generation; TAL:220-230 "
                                "only marks misses (finding T2)",
    "partial_tail_anchor": "S@0.34.0:1174-1177 the partial-tail search starts from the "
                           "full-attention hit boundary when it is past the complete-chunk "
                           "hit (`anchor_boundary`); S:1084 from the complete-chunk hit",
}


FEATURE_TAKEN: dict[str, str] = {
    "fix_48102": "`adapter.machine_for`: `VLLM025Machine` (finds #48102) before, "
                 "`VLLMMachine` from; `test_vllm_src.py`",
    "reset_fence": "the adapter counts the reports still due at a reset itself "
                   "(`Observations.emulated_fence`) where vLLM has no fence",
    "on_new_request": "`VLLMAdapter._as_of_release`: a request never looked up is projected "
                      "IDLE",
    "offload_caps": "`vllm_env.make_setup` sets `offload_prompt_only` only from 0.23.0; "
                    "bounds with `max_offload_tokens` left out",
    "manager_finish_signal": "`conformance.projection.count_manager_calls` counts no signal "
                             "where the manager has no `on_request_finished`",
    "transfer_job_fields": "`vllm_env.transfer_specs`",
    "lookup_defers_in_flight": "`test_core_scheduler.py`: on 0.22.0-0.23.0 the #48102 holder, "
                               "admitted again, crashes its next store on the stale id "
                               "(S@0.22.0:805); on 0.24.0-0.25.1 it is deferred for ever",
    "prefix_match_unit": "`make_setup` refuses a finer hash; partial-tail bounds left out",
    "blocks_per_chunk": "bounds with more than one block per chunk left out",
    "finished_signal": "`adapter.FINISHES_AS_THE_SPEC` (EARLY-FINISH-SIGNAL): no "
                       "finish/abort events, a drain that does not finish; D2/D3 and the "
                       "programs that finish skip",
    "partial_tails": "partial-tail bounds left out; F3 skips",
    "kv_tensor_layers": "`vllm_env._kv_tensor` (`shared_by` before), and a hybrid chunk's "
                        "CPU bytes (all layers before: OCF@0.26.0:90-103 sums every tensor)",
    "block_state_handoffs": "Mamba bounds left out; the Mamba hand-off test and F3 skip",
    "block_state_resolver": "`vllm_env.scheduler_output` builds the block state with "
                            "`block_ids={}` on 0.29.0 (its connector reads only the "
                            "hand-offs, S@0.29.0:1221-1222)",
    "max_num_new_tokens": "`VLLMMachine.whole_prompt_hit` (WHOLE-PROMPT-HIT); D1, D3 and "
                          "one regression program skip; Mamba bounds with shared prefixes "
                          "left out (PENDING-PAST-THE-HIT)",
    "manager_chunks": "`test_manager_vs_vllm.py` skips (it builds "
                      "`CPUOffloadingManager(num_chunks=...)`)",
    "manager_key_positions": "`test_manager_vs_vllm.py`: the contexts get no key positions "
                             "(ours none either)",
    "arc_eviction_fallback": "finding ARC-NO-FALLBACK: "
                             "`test_arc_evicts_from_t1_when_t2_has_no_eligible_chunk` is a "
                             "strict xfail",
    "manager_request_recency": "`test_manager_vs_vllm.py`: vLLM's LRU and ARC compared with "
                               "our `ReleaseLRUPolicy` (`lru-release`, a key ranked when it "
                               "last became idle) and `TouchARCPolicy` (`arc-touch`, lists "
                               "moved by `touch` only)",
    "store_admission_at_store": "the store-threshold bound left out (STORE-ADMISSION)",
    "retention_interval": "`make_setup` passes `prefix_cache_retention_interval` only from "
                          "0.30.0; the retention bound left out; F4 skips",
    "max_load_tokens": "bounds with `max_load_tokens` left out",
    "finished_commit_point": "decoding bounds (`Bounds.decode_tokens`) left out",
    "sync_loads": "sync-load bounds left out; the sync-load programs skip",
    "preempted_load_flush": "`VLLMMachine.readmits_preempted` / `preempts_a_load` "
                            "(PREEMPTED-LOAD); D1 skips",
    "lookup_resets_cursor": "`VLLMAdapter._as_of_release`: store cursor not compared "
                            "(CURSOR-KEPT)",
    "step_region": "`VLLMAdapter._as_of_release`: `step_open` from the adapter",
    "lru_request_ranks": "`test_manager_vs_vllm.py`: vLLM's LRU compared with our "
                         "`InsertionLRUPolicy` (`lru-insertion`, keys ranked by insertion), "
                         "not our `LRUPolicy`",
    "failed_store_cleanup_event": "`test_manager_vs_vllm.py`: our metadata-only removals "
                                  "left out of the event comparison, vLLM's events read "
                                  "as not metadata-only",
    "mamba_last_edge_stop": "`test_core_mamba.py::test_the_cores_prefill_chunks_end_where_"
                            "the_spec_says` skips (the spec's `mamba_chunk_end` is 0.32's "
                            "rule)",
    "resumed_as_new": "`vllm_env.scheduler_output` sends a resumed request as a cached "
                      "one marked resumed; `CoreDriver` reads `resumed_req_ids`",
    "null_pages_in_chunk": "`test_f4_...` expects the window chunk's source without the "
                           "null block, at sub-block 3",
    "failure_reports": "`VLLMMachine` draws no worker failure (`failures=0`, no "
                       "`failure` in the swarm); `vllm_env.connector_output` refuses one",
    "hybrid_hit_at_the_cap": "the spec's rule `LastTokenCut.AFTER_CAPS` (0.33's; with the "
                             "feature the bounds take `BEFORE_CAPS`: `RULE_FEATURES`, D5); "
                             "for the directed programs, under 0.33's cut, the adapter "
                             "lowers its LAST-TOKEN-BOUND cap by one token "
                             "(`cap_keeps_the_last_token`)",
    "second_reset_merges": "`VLLMMachine.reset_would_trip` (RESET-TWICE, finding F1); "
                           "`test_finding_f1_...` expects the crash",
    "manager_touch_removed": "`test_manager_vs_vllm.py` draws `touch` (TOUCH)",
    "store_admission_once_per_request": "the spec's rule `StoreAdmission.PER_OFFER` "
                                        "(0.33's; with the feature the bounds take "
                                        "`PER_REQUEST`: `RULE_FEATURES`, D6)",
    "tier_store_marks_present": "the tiering machine's reference without `marks_present` "
                                "(`vllm_like_reference`); the T2 reproducer expects the "
                                "stale verdict",
    "partial_tail_anchor": "the spec's rule `PartialTailSearch.FROM_COMPLETE_HIT` (0.33's; "
                           "with the feature the bounds take `FROM_FULL_ATTENTION_PREFIX`: "
                           "`RULE_FEATURES`, D7)",
}
"""Feature -> where the conformance code takes a release without it."""


RULE_FEATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "store_admission_once_per_request": (("store_admission", "per-request"),),
    "hybrid_hit_at_the_cap": (("last_token_cut", "before-caps"),),
    "failure_reports": (("failed_load_lookup", "for-life"),
                        ("stale_load_failure", "fence-only")),
    "partial_tail_anchor": (("partial_tail_search", "from-full-attention-prefix"),),
}
"""Feature -> the rules of `spec.rules.Rules` a release with it has (field, value); a release
without it has 0.33.0's (`adapter.RELEASE_RULES`)."""


def feature_table() -> str:
    """Markdown: each feature, the first release with it, the evidence, where it is taken
    (citations in the short form; CONFORMANCE.md renders them as links)."""
    rows = ["| feature (from) | what changes | where it is taken |", "|---|---|---|"]
    rows += [f"| `{f}` ({first}) | {FEATURE_EVIDENCE[f]} | {FEATURE_TAKEN[f]} |"
             for f, first in FEATURES.items()]
    return "\n".join(rows)

def supported() -> list[str]:
    return [r.version for r in RELEASES]


def find(version: str) -> Release | None:
    return next((r for r in RELEASES if r.version == version.strip()), None)


def has(feature: str, version: Version) -> bool:
    """Whether a release (or a tree of that version, e.g. 0.33.1.dev3) has `feature`."""
    return version >= parse(FEATURES[feature])


def features(version: Version) -> frozenset[str]:
    return frozenset(f for f in FEATURES if has(f, version))


def pins(packages: list[str], requires: list[str]) -> list[str]:
    """Each of `packages` as a pip requirement bounded as vLLM's own requirements
    (`requires`, `importlib.metadata.requires("vllm")`) bound it, where they name it and
    apply here (markers evaluated, extras' requirements left out); the bare name where they
    do not. The venv installs vLLM with --no-deps, so without this a package would come at
    the index's newest version, which vLLM may exclude: transformers 5.25.0 (vLLM 0.33.0
    asks for <5.21.0) pulls in Hugging Face's `kernels`, whose name this project's
    `kernels/` shadows."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    bounds: dict[str, list[str]] = {}
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if str(req.specifier):
            bounds.setdefault(canonicalize_name(req.name), []).append(str(req.specifier))
    return [package + ",".join(bounds.get(canonicalize_name(package), []))
            for package in packages]


def _check_consistent() -> None:
    assert FEATURES.keys() == FEATURE_EVIDENCE.keys() == FEATURE_TAKEN.keys()
    for r in RELEASES:
        assert r.bug_48102 == (not has("fix_48102", r.key)), r
        assert r.reset_fence == has("reset_fence", r.key), r


_check_consistent()


def main(argv: list[str]) -> int:
    usage = ("usage: releases.py list | show | check VERSION | extras VERSION | "
             "features VERSION | pins PACKAGE...")
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "list":
        print("\n".join(supported()))
        return 0
    if cmd == "show":
        print(f"{'release':<8} {'#48102 bug':<11} {'reset fence':<12} extras")
        for r in RELEASES:
            print(f"{r.version:<8} {'yes' if r.bug_48102 else 'no':<11} "
                  f"{'yes' if r.reset_fence else 'no':<12} {' '.join(r.extras) or '-'}")
        return 0
    if cmd == "pins" and args:
        from importlib.metadata import requires

        print("\n".join(pins(args, requires("vllm") or [])))
        return 0
    if cmd in ("check", "extras", "features") and len(args) == 1:
        release = find(args[0])
        if release is None:
            print(f"vLLM {args[0]!r} is not a supported release. Supported (from "
                  f"{FIRST_RESET_CACHE}, the first whose offloading connector has "
                  f"reset_cache): {' '.join(supported())}", file=sys.stderr)
            return 1
        if cmd == "extras":
            print("\n".join(release.extras))
        elif cmd == "features":
            print("\n".join(sorted(features(release.key))))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
