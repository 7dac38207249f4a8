"""Several KV cache groups in the reference scheduler: the configuration, the per-group
block tables, and the sliding-window paths vLLM 0.33.0 takes (S:849-1054, S:1533-1552,
S:2002-2099) with a hybrid model, directed (the model-based tests draw them at random)."""

from __future__ import annotations

import pytest

from spec.groups import NULL_BLOCK
from statemachine import KVCacheGroup, OffloadingConfig, OffloadingScheduler
from statemachine.errors import ConfigError, InvalidArgument
from statemachine.messages import (
    CachedRequestData,
    KVConnectorOutput,
    NewRequestData,
    OffloadingWorkerMetadata,
    Request,
    SchedulerOutput,
)

BS = 4
HYBRID = (KVCacheGroup("full"), KVCacheGroup("sliding", sliding_window=BS + 1))
"""A window of 5 tokens: a block leaves it once the next block is computed."""


def _request(rid: str, blocks: int, family: int = 0) -> Request:
    hashes = [family * 1000 + b + 1 for b in range(blocks)]
    return Request(rid, [h * BS + i for h in hashes for i in range(BS)], block_hashes=hashes)


@pytest.mark.parametrize(("groups", "match"), [
    ((), "non-empty tuple"),
    ((KVCacheGroup("sliding"),), "needs sliding_window"),
    ((KVCacheGroup("full", sliding_window=8),), "has no sliding_window"),
    ((KVCacheGroup("ssm"),), "kind must be"),  # type: ignore[arg-type]
    ((KVCacheGroup("mamba", sliding_window=8),), "a mamba group has no sliding_window"),
])
def test_a_bad_group_configuration_is_a_typed_error(groups: tuple[KVCacheGroup, ...],
                                                     match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadingConfig(groups=groups)


def test_several_groups_need_one_block_table_per_group() -> None:
    s = OffloadingScheduler(OffloadingConfig(block_size=BS, groups=HYBRID))
    req = _request("r0", 3)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    with pytest.raises(InvalidArgument, match="one block table per group"):
        s.update_state_after_alloc(req, [0, 1, 2], 0)
    with pytest.raises(InvalidArgument, match="expected 2 block tables"):
        s.update_state_after_alloc(req, ([0, 1, 2],), 0)


def _step(s: OffloadingScheduler, req: Request, new: tuple[tuple[int, ...], ...] | None,
          tokens: int) -> dict[int, object]:
    out = SchedulerOutput(
        (NewRequestData(req.request_id, new),) if new is not None else (),
        () if new is not None else (CachedRequestData(req.request_id, ((), ())),),
        {req.request_id: tokens})
    meta = s.build_connector_meta(out)
    req.num_computed_tokens += tokens
    return dict(meta.store_jobs)


TABLE = ((0, 1, 2), (3, 4, 5))
"""r0's blocks: full attention 0-2, the window 3-5."""


def _admitted() -> tuple[OffloadingScheduler, Request]:
    """A hybrid scheduler with r0 (3 blocks) looked up (no hit) and allocated `TABLE`."""
    s = OffloadingScheduler(OffloadingConfig(block_size=BS, groups=HYBRID))
    req = _request("r0", 3)
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, TABLE, 0)
    return s, req


def test_window_sources_are_fenced_at_creation_and_full_ones_at_finish() -> None:
    s, req = _admitted()
    [(job_id, job)] = _step(s, req, TABLE, BS).items()
    status = s.job_status(job_id)
    assert status is not None
    assert status.fenced_block_ids == {3} and status.deferred_fence_block_ids == {0}
    assert s.block_fence == {3: {job_id}}  # the window block: the core may free it any step
    assert job.src.group_sizes == (1, 1) and job.src.block_indices == (0, 0)  # type: ignore[attr-defined]
    # the key of a group carries the group: the same block hash, two chunk keys
    assert len(set(status.keys)) == 2


def test_a_reset_zeroes_the_window_positions_the_core_freed() -> None:
    """F2: after the reset the cursor is back at 0; the window's first block (freed by the
    core once the second block was computed) must not be a store source again."""
    s, req = _admitted()
    jobs = _step(s, req, TABLE, BS)
    jobs.update(_step(s, req, None, BS))
    s.update_connector_output(KVConnectorOutput(OffloadingWorkerMetadata(
        {j: 1 for j in jobs})))
    s.reset_cache()
    state = s.requests["r0"]
    assert state.group_block_ids == [[0, 1, 2], [NULL_BLOCK, 4, 5]]
    [(_, job)] = _step(s, req, None, BS).items()
    assert 3 not in job.src.block_ids  # type: ignore[attr-defined]


# ============================================================================ a Mamba group
MAMBA = (KVCacheGroup("full"), KVCacheGroup("mamba"))


def _mamba_step(s: OffloadingScheduler, req: Request, new: tuple[tuple[int, ...], ...] | None,
                tokens: int, handoffs: tuple[tuple[int, int, int], ...] = ()
                ) -> dict[int, object]:
    out = SchedulerOutput(
        (NewRequestData(req.request_id, new),) if new is not None else (),
        () if new is not None else (CachedRequestData(req.request_id, ((), ())),),
        {req.request_id: tokens}, boundary_state_offloads={req.request_id: handoffs})
    meta = s.build_connector_meta(out)
    req.num_computed_tokens += tokens
    return dict(meta.store_jobs)


def test_a_mamba_state_is_stored_only_from_its_hand_off_fenced_at_creation() -> None:
    """Positional stores skip the Mamba group (S:1904-1905); the state block the core hands
    off at a chunk boundary is stored alone, into the chunk that ends there, fenced from the
    job's creation, and the store cursor stays (S:1554-1624)."""
    s = OffloadingScheduler(OffloadingConfig(block_size=BS, groups=MAMBA))
    req = _request("r0", 3)
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    table = ((0, 1, 2), (NULL_BLOCK, 4, NULL_BLOCK))  # the state after 2 blocks is in 4
    s.update_state_after_alloc(req, table, 0)
    jobs = _mamba_step(s, req, table, 2 * BS, handoffs=((1, 4, 2 * BS),))
    [(state_job, state), (_, full)] = sorted(
        jobs.items(), key=lambda kv: len(kv[1].src.block_ids))  # type: ignore[attr-defined]
    assert state.src.block_ids == (4,)  # type: ignore[attr-defined]
    assert state.src.group_sizes == (0, 1) and state.src.block_indices == (0, 1)  # type: ignore[attr-defined]
    assert full.src.block_ids == (0, 1)  # type: ignore[attr-defined]
    status = s.job_status(state_job)
    assert status is not None and status.fenced_block_ids == {4}
    assert s.block_fence[4] == {state_job}
    assert s.requests["r0"].next_stored_chunk_idx == 2  # moved by the positional store only
    # the store of the state keys the group's chunk 1: a lookup of a same-prefix request
    # hits both groups up to 2 blocks (a Mamba state needs only its last chunk); one of 3
    # blocks may hit 1 block at most (a token short of its last block, cut to a chunk),
    # and no state was stored there
    for job_id in jobs:
        s.update_connector_output(KVConnectorOutput(OffloadingWorkerMetadata({job_id: 1})))
    for rid, blocks, hit in (("r1", 4, 2 * BS), ("r2", 3, 0)):
        twin = _request(rid, blocks)
        s.on_new_request(twin)
        assert s.get_num_new_matched_tokens(twin, 0) == (hit, hit > 0)


def test_a_hand_off_vllm_skips_is_counted_and_a_bad_group_is_a_typed_error() -> None:
    s = OffloadingScheduler(OffloadingConfig(block_size=BS, blocks_per_chunk=2, groups=MAMBA))
    req = _request("r0", 4)
    s.on_new_request(req)
    s.get_num_new_matched_tokens(req, 0)
    table = ((0, 1, 2, 3), (NULL_BLOCK, NULL_BLOCK, 6, NULL_BLOCK))
    s.update_state_after_alloc(req, table, 0)
    # inside a chunk of 2 blocks, and the null block: vLLM skips both (S:1574-1579)
    jobs = _mamba_step(s, req, table, BS, handoffs=((1, 6, BS), (1, NULL_BLOCK, 2 * BS)))
    assert jobs == {} and s.get_stats()["handoffs_skipped"] == 2
    with pytest.raises(InvalidArgument, match="request 'r0': a hand-off names group 2 of 2"):
        _mamba_step(s, req, None, BS, handoffs=((2, 6, 2 * BS),))


def test_a_mamba_lookup_needs_only_the_state_at_a_chunk_edge() -> None:
    """The hit is cut one token short of the bound and down to a chunk (S:872-881); the
    window scan wants one chunk; the load fills the one state block (S:1385-1466)."""
    s = OffloadingScheduler(OffloadingConfig(block_size=BS, groups=MAMBA))
    src = _request("r0", 4)
    s.on_new_request(src)
    s.get_num_new_matched_tokens(src, 0)
    table = ((0, 1, 2, 3), (NULL_BLOCK, NULL_BLOCK, 6, NULL_BLOCK))
    s.update_state_after_alloc(src, table, 0)
    jobs = _mamba_step(s, src, table, 3 * BS, handoffs=((1, 6, 3 * BS),))
    for job_id in jobs:
        s.update_connector_output(KVConnectorOutput(OffloadingWorkerMetadata({job_id: 1})))
    twin = _request("r1", 5)
    s.on_new_request(twin)
    hit, is_async = s.get_num_new_matched_tokens(twin, 0)
    assert (hit, is_async) == (3 * BS, True)
    s.update_state_after_alloc(
        twin, ((8, 9, 10, 11, 14), (NULL_BLOCK, NULL_BLOCK, 12, 13, NULL_BLOCK)), hit)
    [load_id] = s.transfer_jobs("r1")
    load = s.job_status(load_id)
    assert load is not None and load.gpu_block_ids == (8, 9, 10, 12)
