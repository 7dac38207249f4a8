"""The vLLM releases `make conformance` supports, and what each one has.

Every release on the package index from the first whose offloading connector has
`reset_cache` (0.22.0, see FIRST_RESET_CACHE) up to 0.33.0. Per release: whether it has the
PR #48102 bug (its `reset_cache` clears `_jobs` but not the requests' `transfer_jobs`),
whether it has the reset fence (`_reset_fence`), and the pip packages its scheduler-side
imports need beyond scripts/vllm-venv.sh's common list (found by building each release).

The feature table (FEATURES) says from which release on the scheduler side has each
difference the conformance code translates; `conformance.vllm_env` reads it. Every entry is
backed by a file:line of the first release that has it (FEATURE_EVIDENCE).

Standard library only, usable from the shell before any venv exists:

    python3 conformance/releases.py list            # the supported releases, one a line
    python3 conformance/releases.py check 0.26.0    # exit 1, naming the supported ones, if not
    python3 conformance/releases.py extras 0.22.0   # the extra pip packages, one a line
    python3 conformance/releases.py show            # the table
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
)

# ----------------------------------------------------------------------------- features
# feature -> the first release that has it. S = vllm/distributed/kv_transfer/kv_connector/
# v1/offloading/scheduler.py; the evidence is in FEATURE_EVIDENCE.
FEATURES: dict[str, str] = {
    "fix_48102": "0.26.0",
    "reset_fence": "0.33.0",
    "on_new_request": "0.23.0",
    "offload_caps": "0.23.0",
    "manager_finish_signal": "0.23.0",
    "transfer_job_fields": "0.25.0",
    "prefix_match_unit": "0.26.0",
    "blocks_per_chunk": "0.26.0",
    "finished_signal": "0.27.0",
    "partial_tails": "0.28.0",
    "kv_tensor_layers": "0.29.0",
    "block_state_handoffs": "0.29.0",
    "max_num_new_tokens": "0.30.0",
    "manager_chunks": "0.30.0",
    "manager_key_positions": "0.31.0",
    "store_admission_at_store": "0.30.0",
    "retention_interval": "0.30.0",
    "max_load_tokens": "0.31.0",
    "sync_loads": "0.33.0",
    "preempted_load_flush": "0.33.0",
    "lookup_resets_cursor": "0.33.0",
    "step_region": "0.33.0",
}

FEATURE_EVIDENCE: dict[str, str] = {
    "fix_48102": "0.26.0 S:1345 reset_cache (S:1323) clears each request's transfer_jobs "
                 "(`status.transfer_jobs.clear()`); 0.25.1's reset_cache (S:1231) does not",
    "reset_fence": "0.33.0 S:654 `_reset_fence` (stale job id -> reports due); absent before",
    "offload_caps": "0.23.0 S:183-197 `max_offload_tokens`, `offload_prompt_only` per "
                    "request; absent in 0.22.x",
    "on_new_request": "0.23.0 S:525 `def on_new_request` (0.22.0 creates a request's state "
                      "at its first lookup, S:525-528)",
    "transfer_job_fields": "0.25.0 offloading/common.py:54-66 TransferJob(req_id, src_spec, "
                           "dst_spec); 0.22.0-0.24.0 common.py:15-25 TransferJob(req_id, "
                           "transfer_spec=(src, dst))",
    "manager_finish_signal": "0.23.0 vllm/v1/kv_offload/base.py:242 `OffloadingManager."
                             "on_request_finished`, called at S:1014 (absent in 0.22.x)",
    "partial_tails": "0.28.0 S:1154 `_build_partial_tail_store_jobs`",
    "retention_interval": "0.30.0 S:216 reads `cache_config.prefix_cache_retention_interval`"
                          " (0.29.0 has the config field, the connector does not read it); "
                          "before, a sliding-window store keeps the trailing chunks of each "
                          "full-attention alignment segment (S:975-996 in 0.26.0)",
    "manager_chunks": "0.30.0 vllm/v1/kv_offload/cpu/manager.py:44 CPUOffloadingManager("
                      "num_chunks, ...), policies/lru.py:25 `self.chunks`; 0.29.0: "
                      "num_blocks, `blocks`",
    "manager_key_positions": "0.31.0 vllm/v1/kv_offload/base.py:112 "
                             "`ReqContext.set_offload_key_position` (absent in 0.30.0)",
    "store_admission_at_store": "0.30.0 vllm/v1/kv_offload/cpu/manager.py:106 "
                                "`_record_accesses` at prepare_store counts a chunk's offers "
                                "(the spec's store threshold); 0.29.0 and before count "
                                "lookups (manager.py:120-128 in 0.26.0)",
    "max_load_tokens": "0.31.0 S:367-391 the per-request `max_load_tokens` "
                       "(kv_transfer_params)",
    "prefix_match_unit": "0.26.0 vllm/config/cache.py:56 `prefix_match_unit`",
    "blocks_per_chunk": "0.26.0 S:238 `next_stored_chunk_idx`, S:403 "
                        "`_chunks_being_loaded` (0.25: `next_stored_block_idx`, "
                        "`_blocks_being_loaded`)",
    "finished_signal": "0.27.0 S:290 `RequestOffloadState.finished_signaled` (the manager "
                       "is signaled after the final store); 0.26.0 signals it in "
                       "request_finished (S:1292)",
    "kv_tensor_layers": "0.29.0 vllm/v1/kv_cache_interface.py:325 KVCacheTensor(size, "
                        "layers, layer_stride, block_stride); 0.28.0 kv_cache_interface.py:"
                        "935 KVCacheTensor(size, shared_by)",
    "block_state_handoffs": "0.29.0 vllm/v1/core/sched/output.py:209 "
                            "`class KVConnectorBlockState` (the core's Mamba hand-offs)",
    "max_num_new_tokens": "0.30.0 S:754 get_num_new_matched_tokens(..., "
                          "max_num_new_tokens); before, a full-attention lookup may hit the "
                          "whole prompt (S:549-554 in 0.26.0 bounds it only with a window)",
    "sync_loads": "0.33.0 S:168 `sync_load_budget_bytes`, S:89 "
                  "`TransferJobStatus.is_sync_load`",
    "step_region": "0.33.0 S:677 `_step_region` (S:1239, S:1367, S:2108-2113)",
    "lookup_resets_cursor": "0.33.0 S:1241-1245 get_num_new_matched_tokens puts every group's "
                            "`next_stored_chunk_idx` back to 0 (a restart offers every chunk "
                            "again); 0.26.0-0.32.0 keep it",
    "preempted_load_flush": "0.33.0 S:2136-2150 flushes a preempted request's jobs whatever "
                            "their kind; 0.22.0-0.32.0 assert they are stores "
                            "(`assert self._jobs[any_jid].is_store`, S:1138 in 0.26.0, "
                            "S:1862 in 0.32.0)",
}


def supported() -> list[str]:
    return [r.version for r in RELEASES]


def find(version: str) -> Release | None:
    return next((r for r in RELEASES if r.version == version.strip()), None)


def has(feature: str, version: Version) -> bool:
    """Whether a release (or a tree of that version, e.g. 0.33.1.dev3) has `feature`."""
    return version >= parse(FEATURES[feature])


def features(version: Version) -> frozenset[str]:
    return frozenset(f for f in FEATURES if has(f, version))


def _check_consistent() -> None:
    for r in RELEASES:
        assert r.bug_48102 == (not has("fix_48102", r.key)), r
        assert r.reset_fence == has("reset_fence", r.key), r


_check_consistent()


def main(argv: list[str]) -> int:
    usage = ("usage: releases.py list | show | check VERSION | extras VERSION | "
             "features VERSION")
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
