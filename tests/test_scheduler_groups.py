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
    ((KVCacheGroup("mamba"),), "kind must be"),  # type: ignore[arg-type]
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
