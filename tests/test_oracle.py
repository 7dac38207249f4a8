"""The byte oracle: the pattern is a pure function of the prefix, every load is checked, and
a skipped fence (a store copying a block after it was reused) is caught as wrong bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from statemachine.engine import Engine, EngineConfig
from statemachine.errors import KVSpecError
from statemachine.messages import OffloadingConnectorMetadata, SchedulerOutput
from statemachine.oracle import CorruptedBytes, first_mismatch, pattern_for
from statemachine.scheduler import OffloadingScheduler
from statemachine.worker import Worker, WorkerJob


class NoFlushScheduler(OffloadingScheduler):
    """A connector that decides every flush but never ships one (a skipped fence): its own
    invariants hold, only the bytes can tell."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) \
            -> OffloadingConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        return dataclasses.replace(meta, jobs_to_flush=frozenset())


class FlushIgnoringWorker(Worker):
    """A worker rank that never waits for flushed jobs."""

    def handle_preemptions(self, meta: OffloadingConnectorMetadata) -> None:
        return None


class ScramblingWorker(Worker):
    """A worker whose loads read the CPU chunks in reverse order (a wrong row mapping)."""

    def launch_copy_kernel(self, job: WorkerJob, **kwargs: Any) -> None:
        if not job.is_store and len(job.transfer.cpu_chunks) > 1:
            t = job.transfer
            job.transfer = type(t)(t.gpu_blocks, tuple(reversed(t.cpu_chunks)),
                                   t.first_block_index)
        super().launch_copy_kernel(job, **kwargs)


def test_the_pattern_is_a_pure_function_of_hash_layer_and_rank() -> None:
    a = pattern_for([11, 12], layer=0, rank=0, page_bytes=64)
    assert a.dtype == torch.int8 and a.shape == (2, 64)
    assert torch.equal(a, pattern_for([11, 12], 0, 0, 64))
    assert not torch.equal(a[0], a[1])
    for other in (pattern_for([11], 1, 0, 64), pattern_for([11], 0, 1, 64),
                  pattern_for([13], 0, 0, 64)):
        assert (other[0] != a[0]).sum() > 32  # not a near miss
    assert len(set(a[0].tolist())) > 32  # bytes vary within a page


def test_first_mismatch_points_at_the_wrong_byte() -> None:
    gpu = torch.zeros((4, 32), dtype=torch.int8)
    gpu[1] = pattern_for([5], 0, 0, 32)[0]
    gpu[3] = pattern_for([6], 0, 0, 32)[0]
    assert first_mismatch(gpu, [1, 3], [5, 6], 0, 0) is None
    gpu[3, 7] += 1
    m = first_mismatch(gpu, [1, 3], [5, 6], 0, 0)
    assert m is not None and (m.position, m.offset, m.bad_blocks) == (1, 7, 1)
    assert first_mismatch(gpu, [1, 3], [5, 6], 1, 0) is not None  # another layer's bytes


def preempting_workload(e: Engine) -> None:
    """'old' needs a block when the pool is full: 'new' is preempted while its store is
    still queued, and its last block (freed first) goes to 'old', whose forward pass writes
    it in the same step. Then 'new' comes back and loads its chunks."""
    e.add_request("old", list(range(48)), max_tokens=2)
    e.add_request("new", list(range(100, 164)), max_tokens=4)
    e.step()
    result = e.step()
    assert result.preempted == {"new"}
    e.run_until_idle(50)


def fence_cfg(check_stores: bool = True) -> EngineConfig:
    return EngineConfig(num_gpu_blocks=7, num_cpu_chunks=16, blocks_per_chunk=1,
                        check_stores=check_stores, device="cpu")


def test_with_the_fence_every_copy_is_right() -> None:
    e = Engine(fence_cfg())
    preempting_workload(e)
    assert e.stats["loaded_blocks_verified"] == 4 * 2
    assert e.stats["stored_blocks_verified"] >= 4 * 2
    assert not e.has_pending_work()


def test_a_skipped_preemption_flush_is_caught_at_the_store() -> None:
    cfg = fence_cfg()
    e = Engine(cfg, scheduler=NoFlushScheduler(cfg.offloading_config()))
    with pytest.raises(CorruptedBytes) as info:
        preempting_workload(e)
    err = info.value
    assert isinstance(err, KVSpecError)
    assert (err.what, err.req_id, err.block_index) == ("stored block", "new", 3)
    assert err.job_id is not None and err.chunk is not None and err.chunk_key is not None
    assert f"store job {err.job_id}" in str(err) and "received wrong bytes" in str(err)


def test_a_skipped_preemption_flush_is_caught_by_the_load_that_reads_it() -> None:
    cfg = fence_cfg(check_stores=False)
    e = Engine(cfg, scheduler=NoFlushScheduler(cfg.offloading_config()))
    with pytest.raises(CorruptedBytes) as info:
        preempting_workload(e)
    err = info.value
    assert (err.what, err.req_id, err.block_index) == ("loaded block", "new", 3)
    assert err.writer_request == "new" and err.writer_job is not None
    assert err.job_id is not None and err.writer_job < err.job_id
    assert f"last written by store job {err.writer_job} of request 'new'" in str(err)


def test_a_worker_that_ignores_flushes_is_caught() -> None:
    cfg = fence_cfg()
    workers = [FlushIgnoringWorker(r, cfg.layout, cfg.num_gpu_blocks, cfg.num_cpu_chunks,
                                   "cpu") for r in range(cfg.num_workers)]
    e = Engine(cfg, workers=workers)
    with pytest.raises(CorruptedBytes, match="block 3 of the request"):
        preempting_workload(e)


@pytest.mark.parametrize("check_stores", [True, False])
def test_a_skipped_fence_for_a_finished_request_is_caught(check_stores: bool) -> None:
    """The final store of a finished request reads blocks the core freed at finish; when
    they are re-allocated the store must be flushed in that very step."""

    def run(e: Engine) -> None:
        # fin's last chunk completes in its last step: that store is still queued at finish
        e.add_request("fin", list(range(100, 163)), max_tokens=2)
        e.add_request("filler", list(range(300, 348)), max_tokens=20)
        e.step()
        assert e.step().finished == ["fin"]
        e.add_request("taker", list(range(700, 764)), max_tokens=2)  # takes fin's blocks
        e.step()
        e.add_request("again", [*e.done["fin"].request.all_token_ids[:64], 1, 2], 2)
        e.run_until_idle(50)

    cfg = EngineConfig(num_gpu_blocks=8, num_cpu_chunks=16, blocks_per_chunk=1, num_workers=1,
                       check_stores=check_stores, device="cpu")
    good = Engine(cfg)
    run(good)
    assert good.stats["loaded_blocks_verified"] >= 4
    with pytest.raises(CorruptedBytes) as info:
        run(Engine(cfg, scheduler=NoFlushScheduler(cfg.offloading_config())))
    err = info.value
    if check_stores:
        assert (err.what, err.req_id, err.block_index) == ("stored block", "fin", 3)
    else:
        assert (err.what, err.req_id, err.block_index) == ("loaded block", "again", 3)
        assert err.writer_request == "fin"


def test_a_load_from_the_wrong_chunks_is_caught() -> None:
    cfg = EngineConfig(num_gpu_blocks=32, num_cpu_chunks=32, num_workers=2, device="cpu")
    workers = [Worker(0, cfg.layout, 32, 32, "cpu"),
               ScramblingWorker(1, cfg.layout, 32, 32, "cpu")]
    e = Engine(cfg, workers=workers)
    prefix = list(range(1000, 1064))
    e.add_request("a", [*prefix, 1], max_tokens=2)
    e.run_until_idle(20)
    e.add_request("b", [*prefix, 2], max_tokens=2)
    with pytest.raises(CorruptedBytes) as info:
        e.run_until_idle(20)
    assert info.value.rank == 1 and info.value.req_id == "b"


def test_a_computed_block_overwritten_is_caught_when_its_request_finishes() -> None:
    e = Engine(EngineConfig(num_gpu_blocks=16, num_cpu_chunks=16, device="cpu"))
    e.add_request("a", list(range(40)), max_tokens=3)
    e.step()
    e.step()  # the store of a's first chunk has run: overwriting its blocks is now silent
    assert e.verify_request("a") == 2 and e.stats["stored_blocks_verified"] == 2 * 2
    block = e.requests["a"].blocks[1]
    e.workers[1].gpu[0][block, 5] += 1
    with pytest.raises(CorruptedBytes, match="computed block of request 'a'") as info:
        e.run_until_idle(10)
    assert (info.value.rank, info.value.block_index, info.value.gpu_block) == (1, 1, block)
