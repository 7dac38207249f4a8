"""The kernels round-trip oracle on a real CUDA device: side streams, events, pinned memory."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import (
    CopyEngine,
    CopyPolicy,
    Direction,
    KVLayout,
    Strategy,
    TransferSpec,
    allocate_cpu_kv,
    allocate_gpu_kv,
    cudriver,
)
from tests.kernel_oracle import oracle_load, oracle_store

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def random_kv(layout: KVLayout, num_blocks: int, num_chunks: int,
              seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    gpu = allocate_gpu_kv(layout, num_blocks, "cuda")
    cpu = allocate_cpu_kv(layout, num_chunks)
    assert all(c.is_pinned() for c in cpu)
    for t in (*gpu, *cpu):
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=gen))
    torch.cuda.synchronize()
    return gpu, cpu


def assert_equal_all(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for t, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a.cpu(), e.cpu()), f"tensor {t} differs"


def test_pinned_chunks_are_host_mapped() -> None:
    layout = KVLayout((512,), 2)
    gpu, cpu = random_kv(layout, 4, 2, seed=0)
    assert CopyEngine(gpu, cpu, 2).host_mapped
    assert not CopyEngine(gpu, cpu, 2, policy=CopyPolicy()).policy.native  # host-only copy
    assert not CopyEngine(gpu, cpu, 2, host_mapping=False).host_mapped


ENGINES = {  # (host_mapping, policy)
    "mapped-default": (None, None),
    "mapped-two_pass": (True, CopyPolicy(run_min_bytes=None, runs_by_dma=True,
                                         workspace_bytes=None)),
    "mapped-dma_runs": (True, CopyPolicy(run_min_bytes=1, runs_by_dma=True,
                                         workspace_bytes=None)),
    "unmapped-default": (False, None),
    "unmapped-torch_policy": (False, CopyPolicy(index_kernels=False)),  # native: switched off
    # one cuMemcpyBatchAsync per job: descriptors per pair run, and per row (vLLM's form)
    "unmapped-batch_runs": (False, CopyPolicy(index_kernels=False, batch_dma=True)),
    "unmapped-batch_rows": (False, CopyPolicy(index_kernels=False, batch_dma=True,
                                              batch_merge_runs=False)),
    "mapped-batch_runs": (True, CopyPolicy(runs_by_dma=True, workspace_bytes=None,
                                           batch_dma=True)),
    "mapped-batch_small_loads_indexed": (True, CopyPolicy(
        runs_by_dma=True, workspace_bytes=None, batch_dma=True, batch_index_below=1 << 30)),
}
needs_batch = pytest.mark.skipif(cudriver.batch_copy() is None,
                                 reason=f"no batched copy: {cudriver.unavailable_reason()}")


@pytest.mark.parametrize(("host_mapping", "policy"), [
    pytest.param(*engine, marks=needs_batch) if engine[1] is not None and engine[1].batch_dma
    else engine for engine in ENGINES.values()], ids=ENGINES.keys())
@pytest.mark.parametrize("bpc", [1, 3, 4])
@pytest.mark.parametrize("pages", [(512,), (1024, 4096), (16384, 1 << 20)],
                         ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("first_block_index", [0, 5])
def test_round_trip(host_mapping: bool | None, policy: CopyPolicy | None, bpc: int,
                    pages: tuple[int, ...], first_block_index: int) -> None:
    layout = KVLayout(pages, bpc)
    num_blocks, num_chunks, n = 32, 20, 9
    gpu, cpu = random_kv(layout, num_blocks, num_chunks, seed=bpc + first_block_index)
    rng = random.Random(bpc)
    blocks = rng.sample(range(num_blocks), 2 * n)
    chunks = rng.sample(range(num_chunks), -(-(n + first_block_index % bpc) // bpc))
    store = TransferSpec(blocks[:n], chunks, first_block_index)
    load = TransferSpec(blocks[n:], chunks, first_block_index)
    gpu_before = [g.cpu() for g in gpu]
    expected_cpu = oracle_store(gpu, cpu, store, bpc)

    engine = CopyEngine(gpu, cpu, bpc, host_mapping=host_mapping, policy=policy)
    engine.submit_store(1, store)
    engine.wait([1])
    [result] = engine.poll()
    assert (result.job_id, result.direction, result.success) == (1, Direction.STORE, True)
    assert result.bytes == n * sum(pages) and result.seconds >= 0.0
    assert_equal_all(cpu, expected_cpu)
    assert_equal_all(gpu, gpu_before)

    expected_gpu = oracle_load(gpu, cpu, load, bpc)
    engine.submit_load(2, load)
    engine.wait([2])
    assert [r.job_id for r in engine.poll()] == [2]
    assert_equal_all(gpu, expected_gpu)
    assert_equal_all(cpu, expected_cpu)
    engine.shutdown()


def test_store_waits_for_the_compute_stream_and_poll_does_not_block() -> None:
    layout = KVLayout((4096,), 2)
    gpu, cpu = random_kv(layout, 8, 4, seed=1)
    engine = CopyEngine(gpu, cpu, 2)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy for a while
    gpu[0][3].fill_(7)  # written by the compute stream after the sleep
    engine.submit_store(1, TransferSpec([3, 5], [2]))
    assert engine.poll() == []  # the side stream is still waiting on the compute stream
    engine.wait([1])
    [result] = engine.poll()
    assert result.success
    assert torch.all(cpu[0][2, :4096] == 7)


def test_fifo_and_failure_on_cuda() -> None:
    layout = KVLayout((2048, 512), 2)
    gpu, cpu = random_kv(layout, 16, 8, seed=2)
    engine = CopyEngine(gpu, cpu, 2)
    first, second, third = (TransferSpec([1, 2], [4]), TransferSpec([6, 7], [4]),
                            TransferSpec([8, 9], [5]))
    expected = oracle_store(gpu, oracle_store(gpu, cpu, first, 2), second, 2)
    engine.inject_failure(12)
    engine.submit_store(10, first)
    engine.submit_store(11, second)
    engine.submit_store(12, third)
    engine.wait([12])  # completes 10 and 11 too
    results = engine.poll()
    assert [(r.job_id, r.success) for r in results] == [(10, True), (11, True), (12, False)]
    assert results[2].bytes == 0
    assert_equal_all(cpu, expected)  # the later store won; the failed one wrote nothing
    engine.wait([999])  # unknown: ignored
    engine.shutdown()


@needs_batch
def test_the_default_engine_batches_stores_and_keeps_the_descriptors_until_complete() -> None:
    """A driver of CUDA 12.8 or later: the default policy stores through one
    cuMemcpyBatchAsync, ordered after the compute stream, and the job holds its descriptors
    (the driver's arrays) until it is reported."""
    layout = KVLayout((4096, 1024), 2)
    gpu, cpu = random_kv(layout, 16, 8, seed=3)
    engine = CopyEngine(gpu, cpu, 2)
    assert engine.policy.batch_dma
    spec = TransferSpec([3, 4, 9, 1], [2, 5])
    expected = oracle_store(gpu, cpu, spec, 2)
    torch.cuda._sleep(100_000_000)
    gpu[0][9].fill_(5)  # on the compute stream, before the submit: the store must see it
    expected[0][5, :4096].fill_(5)
    engine.submit_store(1, spec)
    [job] = engine._fifo[Direction.STORE]
    assert engine._backend.copier.strategy(job) is Strategy.BATCH_DMA  # type: ignore[attr-defined]
    assert job.batch is not None and job.batch.count == 2 * 3  # runs [3,4], [9], [1] x 2
    engine.wait([1])
    assert engine.poll()[0].success
    assert_equal_all(cpu, expected)

