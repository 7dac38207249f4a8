"""Tests of the kernels layer on CPU: byte-exact copies, asynchrony, ordering, failures, errors."""

from __future__ import annotations

import array
import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import (
    CopyEngine,
    CopyPolicy,
    Direction,
    KernelSpecError,
    KernelStateError,
    KVLayout,
    RowMapping,
    Strategy,
    TransferSpec,
    allocate_cpu_kv,
    allocate_gpu_kv,
    block_rows,
    choose_strategy,
    copy_blocks_to_chunks,
    copy_chunks_to_blocks,
    native,
)
from tests.kernel_oracle import oracle_load, oracle_store, positions, sub_block


def random_kv(layout: KVLayout, num_blocks: int, num_chunks: int,
              seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    gpu = allocate_gpu_kv(layout, num_blocks, "cpu")
    cpu = allocate_cpu_kv(layout, num_chunks, pin=False)
    for t in (*gpu, *cpu):
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, generator=gen))
    return gpu, cpu


def random_spec(rng: random.Random, bpc: int, num_blocks: int, num_chunks: int,
                n: int, first_block_index: int) -> TransferSpec:
    skip = first_block_index % bpc
    chunks = -(-(n + skip) // bpc)
    return TransferSpec(rng.sample(range(num_blocks), n), rng.sample(range(num_chunks), chunks),
                        first_block_index)


def assert_equal_all(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for t, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"tensor {t} differs"


# -- round trips -----------------------------------------------------------------------------

PAGES = [(512,), (1024, 4096), (512, 1024, 4096)]


@pytest.mark.parametrize("bpc", [1, 3, 4])
@pytest.mark.parametrize("pages", PAGES, ids=lambda p: "x".join(map(str, p)))
@pytest.mark.parametrize("first_block_index", [0, 1, 5])
def test_store_then_load_round_trip(bpc: int, pages: tuple[int, ...],
                                    first_block_index: int) -> None:
    layout = KVLayout(pages, bpc)
    num_blocks, num_chunks, n = 40, 24, 11
    gpu, cpu = random_kv(layout, num_blocks, num_chunks, seed=bpc * 100 + first_block_index)
    rng = random.Random(bpc * 7 + first_block_index)
    blocks = rng.sample(range(num_blocks), 2 * n)
    src_blocks, dst_blocks = blocks[:n], blocks[n:]
    skip = first_block_index % bpc
    chunks = rng.sample(range(num_chunks), -(-(n + skip) // bpc))
    store = TransferSpec(src_blocks, chunks, first_block_index)
    gpu_before = [g.clone() for g in gpu]
    expected_cpu = oracle_store(gpu, cpu, store, bpc)

    engine = CopyEngine(gpu, cpu, bpc)
    engine.submit_store(1, store)
    [result] = engine.poll()
    assert (result.job_id, result.direction, result.success) == (1, Direction.STORE, True)
    assert result.bytes == n * sum(pages)
    # sub-block by sub-block, then the whole tensors (untouched chunks and sub-blocks too)
    for t, page in enumerate(pages):
        for b, chunk, sub in positions(store, bpc):
            assert torch.equal(sub_block(cpu[t], chunk, sub, page), gpu[t][b])
    assert_equal_all(cpu, expected_cpu)
    assert_equal_all(gpu, gpu_before)  # the source is unchanged

    load = TransferSpec(dst_blocks, chunks, first_block_index)
    cpu_before = [c.clone() for c in cpu]
    expected_gpu = oracle_load(gpu, cpu, load, bpc)
    engine.submit_load(2, load)
    [result] = engine.poll()
    assert (result.job_id, result.direction, result.success) == (2, Direction.LOAD, True)
    for t in range(len(pages)):
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(gpu[t][dst], gpu_before[t][src])
    assert_equal_all(gpu, expected_gpu)  # blocks outside the job are unchanged
    assert_equal_all(cpu, cpu_before)
    engine.shutdown()


def test_nan_and_special_patterns_are_copied_bit_exactly() -> None:
    patterns = [0x7FF0000000000001, 0x7FF8000000000001, 0xFFF0000000000001, 0x8000000000000000,
                0x0000000000000001, 0x7FF0000000000000, 0xFFFFFFFFFFFFFFFF, 0x7FF7FFFFFFFFFFFF]
    raw = b"".join(struct.pack("<Q", p) for p in patterns)
    page = len(raw) * 4
    layout = KVLayout((page,), 2)
    gpu = allocate_gpu_kv(layout, 8, "cpu")
    cpu = allocate_cpu_kv(layout, 6, pin=False)
    block = torch.tensor(list(raw * 4), dtype=torch.uint8).view(torch.int8)
    for b in range(8):
        gpu[0][b].copy_(block.roll(b * 8))
    spec = TransferSpec([5, 1, 6, 3], [4, 0, 2], first_block_index=1)
    expected = oracle_store(gpu, cpu, spec, 2)
    engine = CopyEngine(gpu, cpu, 2)
    engine.submit_store(1, spec)
    engine.poll()
    assert_equal_all(cpu, expected)
    load = TransferSpec([0, 2, 4, 7], [4, 0, 2], first_block_index=1)
    expected_gpu = oracle_load(gpu, cpu, load, 2)
    engine.submit_load(2, load)
    engine.poll()
    assert_equal_all(gpu, expected_gpu)


@pytest.mark.parametrize("page", [4, 6, 7, 24, 40, 48])
def test_odd_page_sizes_use_narrower_views(page: int) -> None:
    layout = KVLayout((page, 16), 3)
    gpu, cpu = random_kv(layout, 12, 8, seed=page)
    spec = TransferSpec([9, 2, 4, 0, 11], [7, 1, 3], first_block_index=2)
    expected = oracle_store(gpu, cpu, spec, 3)
    assert copy_blocks_to_chunks(gpu, cpu, spec, 3) == 5 * (page + 16)
    assert_equal_all(cpu, expected)
    load = TransferSpec([1, 3, 5, 6, 8], [7, 1, 3], first_block_index=2)
    expected_gpu = oracle_load(gpu, cpu, load, 3)
    copy_chunks_to_blocks(cpu, gpu, load, 3)
    assert_equal_all(gpu, expected_gpu)


# -- strategies ------------------------------------------------------------------------------

POLICIES = {  # every torch strategy with the compiled copy off, and the default (native)
    "default": CopyPolicy(),
    "torch_default": CopyPolicy(native=False),
    "two_pass": CopyPolicy(run_min_bytes=None, native=False),
    "two_pass_tiled": CopyPolicy(run_min_bytes=None, workspace_bytes=1, native=False),
    "two_pass_untiled": CopyPolicy(run_min_bytes=None, workspace_bytes=None, native=False),
    "runs": CopyPolicy(run_min_bytes=1, native=False),
    "pair_runs": CopyPolicy(index_kernels=False, native=False),
    "dma_runs": CopyPolicy(run_min_bytes=1, runs_by_dma=True, native=False),
    # the batched strategy's descriptors, run on the host by the compiled loop
    "batch_runs": CopyPolicy(batch_dma=True),
    "batch_rows": CopyPolicy(batch_dma=True, batch_merge_runs=False),  # vLLM's form
}

SHAPES = {  # (gpu_blocks, cpu_chunks, first_block_index) with bpc = 2
    "slice": ([4, 5, 6, 7], [2, 3], 0),
    "gather_store": ([9, 1, 4, 6], [2, 3], 0),
    "scatter_store": ([4, 5, 6, 7], [3, 1], 0),
    "scattered": ([9, 1, 4, 6, 3], [5, 1, 3], 1),
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_every_strategy_matches_the_oracle(policy: CopyPolicy,
                                           shape: tuple[list[int], list[int], int]) -> None:
    layout = KVLayout((64, 32), 2)
    gpu, cpu = random_kv(layout, 12, 6, seed=3)
    spec = TransferSpec(*shape)
    expected = oracle_store(gpu, cpu, spec, 2)
    copy_blocks_to_chunks(gpu, cpu, spec, 2, policy)
    assert_equal_all(cpu, expected)
    load = TransferSpec([b + 1 if b < 11 else 0 for b in shape[0]], shape[1], shape[2])
    expected_gpu = oracle_load(gpu, cpu, load, 2)
    copy_chunks_to_blocks(cpu, gpu, load, 2, policy)
    assert_equal_all(gpu, expected_gpu)


def test_strategy_choice() -> None:
    def mapping(spec: TransferSpec, store: bool = True) -> RowMapping:
        g, c = block_rows(spec, 2, 16, 8)
        return RowMapping(g, c) if store else RowMapping(c, g)

    cpu = CopyPolicy(native=False)
    assert choose_strategy(mapping(TransferSpec([4, 5, 6], [2, 3], 1)), 64, cpu) is \
        Strategy.SLICE
    assert choose_strategy(mapping(TransferSpec([4, 5, 6], [2, 3], 1)), 64, CopyPolicy()) is (
        Strategy.NATIVE if native.available() else Strategy.SLICE)
    assert choose_strategy(mapping(TransferSpec([9, 1, 4, 6], [2, 3])), 64, cpu) is \
        Strategy.GATHER
    assert choose_strategy(mapping(TransferSpec([9, 1, 4, 6], [2, 3]), False), 64, cpu) is \
        Strategy.SCATTER
    scattered = mapping(TransferSpec([9, 1, 4, 6], [3, 1]))
    assert choose_strategy(scattered, 64, cpu) is Strategy.TWO_PASS
    assert choose_strategy(scattered, 1 << 20, cpu) is Strategy.DST_RUNS
    assert choose_strategy(scattered.inverse(), 1 << 20, cpu) is Strategy.SRC_RUNS
    assert choose_strategy(scattered, 64, CopyPolicy(index_kernels=False)) is \
        Strategy.PAIR_RUNS
    assert scattered.num_dst_runs == 2 and scattered.num_src_runs == 4
    assert scattered.num_pair_runs == 4
    assert choose_strategy(scattered, 64, CopyPolicy()) is (
        Strategy.NATIVE if native.available() else Strategy.TWO_PASS)
    for mapped in (True, False):  # never the host-only compiled copy for a CUDA device
        cuda = CopyPolicy.for_device(torch.device("cuda"), host_mapped=mapped)
        assert choose_strategy(scattered, 64, cuda) is not Strategy.NATIVE


# -- asynchrony and ordering -----------------------------------------------------------------


def small_engine(bpc: int = 2) -> tuple[CopyEngine, list[torch.Tensor], list[torch.Tensor]]:
    layout = KVLayout((256, 128), bpc)
    gpu, cpu = random_kv(layout, 16, 8, seed=11)
    return CopyEngine(gpu, cpu, bpc), gpu, cpu


def test_copies_happen_at_poll_not_at_submit() -> None:
    engine, gpu, cpu = small_engine()
    store = TransferSpec([3, 8], [5])
    cpu_before = [c.clone() for c in cpu]
    expected = oracle_store(gpu, cpu, store, 2)
    engine.submit_store(1, store)
    assert engine.pending() == {1} and engine.in_flight() == {1}
    assert_equal_all(cpu, cpu_before)  # stale until polled
    assert [r.job_id for r in engine.poll()] == [1]
    assert_equal_all(cpu, expected)
    assert engine.pending() == set() and engine.poll() == []

    load = TransferSpec([0, 1], [5])
    gpu_before = [g.clone() for g in gpu]
    expected_gpu = oracle_load(gpu, cpu, load, 2)
    engine.submit_load(2, load)
    assert_equal_all(gpu, gpu_before)
    engine.poll()
    assert_equal_all(gpu, expected_gpu)


def test_store_reads_the_source_when_it_runs() -> None:
    """A block overwritten after submit but before the copy ran is stored with the new bytes
    (what a missing fence does on a GPU)."""
    engine, gpu, cpu = small_engine()
    engine.submit_store(1, TransferSpec([3, 8], [5]))
    for g in gpu:
        g[3].fill_(42)
    engine.poll()
    assert torch.all(cpu[0][5, :256] == 42) and torch.all(cpu[1][5, :128] == 42)


def test_fifo_per_direction() -> None:
    engine, gpu, cpu = small_engine()
    first, second = TransferSpec([1, 2], [4]), TransferSpec([6, 7], [4])
    engine.submit_store(10, first)
    engine.submit_store(11, second)
    after_first = oracle_store(gpu, cpu, first, 2)
    after_both = oracle_store(gpu, after_first, second, 2)
    [r] = engine.poll(limit=1)
    assert r.job_id == 10
    assert_equal_all(cpu, after_first)
    assert engine.pending() == {11}
    assert [r.job_id for r in engine.poll()] == [11]
    assert_equal_all(cpu, after_both)


def test_directions_run_in_submission_order_on_poll() -> None:
    engine, gpu, _ = small_engine()
    engine.submit_store(1, TransferSpec([1, 2], [4]))
    engine.submit_load(2, TransferSpec([9, 10], [4]))
    engine.submit_store(3, TransferSpec([5], [6]))
    results = engine.poll()
    assert [(r.job_id, r.direction) for r in results] == [
        (1, Direction.STORE), (2, Direction.LOAD), (3, Direction.STORE)]
    for g in gpu:  # the load ran after the store it follows
        assert torch.equal(g[9], g[1]) and torch.equal(g[10], g[2])


def test_wait_completes_a_prefix_of_one_direction() -> None:
    engine, gpu, cpu = small_engine()
    engine.submit_store(1, TransferSpec([1, 2], [4]))
    engine.submit_load(2, TransferSpec([9, 10], [0]))
    engine.submit_store(3, TransferSpec([5], [6]))
    gpu_before = [g.clone() for g in gpu]
    engine.wait([3, 99, -5])  # unknown ids are ignored
    assert engine.in_flight() == {2}
    assert engine.pending() == {1, 2, 3}
    assert_equal_all(gpu, gpu_before)  # the load has not run
    assert torch.equal(cpu[0][6, :256], gpu[0][5])
    engine.wait([1, 3])  # already complete: ignored
    assert [r.job_id for r in engine.poll()] == [1, 3, 2]


def test_failure_injection_copies_nothing() -> None:
    engine, gpu, cpu = small_engine()
    engine.inject_failure(2)
    engine.submit_store(1, TransferSpec([1, 2], [4]))
    engine.submit_store(2, TransferSpec([3, 4], [5]))
    engine.submit_store(3, TransferSpec([5, 6], [6]))
    expected = oracle_store(gpu, oracle_store(gpu, cpu, TransferSpec([1, 2], [4]), 2),
                            TransferSpec([5, 6], [6]), 2)
    results = engine.poll()
    assert [(r.job_id, r.success, r.bytes) for r in results] == [
        (1, True, 2 * 384), (2, False, 0), (3, True, 2 * 384)]
    assert_equal_all(cpu, expected)  # chunk 5 untouched

    engine.inject_failure(4)
    gpu_before = [g.clone() for g in gpu]
    engine.submit_load(4, TransferSpec([0, 1], [6]))
    [r] = engine.poll()
    assert (r.job_id, r.direction, r.success, r.seconds) == (4, Direction.LOAD, False, 0.0)
    assert_equal_all(gpu, gpu_before)


def test_failure_injection_after_submit_is_rejected() -> None:
    engine, _, _ = small_engine()
    engine.submit_store(1, TransferSpec([1, 2], [4]))
    with pytest.raises(KernelStateError, match="already submitted"):
        engine.inject_failure(1)


def test_job_ids_and_shutdown() -> None:
    engine, gpu, cpu = small_engine()
    engine.submit_store(1, TransferSpec([1, 2], [4]))
    with pytest.raises(KernelStateError, match="still pending"):
        engine.submit_load(1, TransferSpec([1, 2], [4]))
    engine.shutdown()  # completes the in-flight store
    assert engine.closed and engine.in_flight() == set()
    assert torch.equal(cpu[0][4, :256], gpu[0][1])
    assert [r.job_id for r in engine.poll()] == [1]
    with pytest.raises(KernelStateError, match="shut down"):
        engine.submit_store(2, TransferSpec([1, 2], [4]))
    engine.shutdown()  # idempotent
    with CopyEngine(gpu, cpu, 2) as again:
        again.submit_store(1, TransferSpec([3], [0]))  # an id may be reused once reported
    assert torch.equal(cpu[1][0, :128], gpu[1][3])


def test_poll_limit_validation() -> None:
    engine, _, _ = small_engine()
    with pytest.raises(ValueError, match="limit"):
        engine.poll(limit=-1)
    assert engine.poll(limit=0) == []


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(("gpu_blocks", "cpu_chunks", "first", "match"), [
    ([1, 2, 3], [0], 0, "need 2 CPU chunks, got 1"),
    ([1, 2, 3], [0, 1, 2], 0, "need 2 CPU chunks, got 3"),
    ([1, 2], [0], 1, "need 2 CPU chunks, got 1"),
    ([1, 16], [0], 0, r"gpu_blocks \[16\] out of range"),
    ([1, 2], [8], 0, r"cpu_chunks \[8\] out of range"),
])
def test_layout_dependent_errors(gpu_blocks: list[int], cpu_chunks: list[int], first: int,
                                 match: str) -> None:
    engine, _, _ = small_engine()
    spec = TransferSpec(gpu_blocks, cpu_chunks, first)
    with pytest.raises(KernelSpecError, match=match):
        engine.submit_store(1, spec)
    with pytest.raises(KernelSpecError, match=match):
        engine.submit_load(1, spec)
    assert engine.pending() == set()


@pytest.mark.parametrize(("gpu_blocks", "cpu_chunks", "first", "match"), [
    ([1, 2, 1], [0, 1], 0, r"gpu_blocks contains duplicate ids \[1\]"),
    ([1, 2, 3], [4, 4], 0, r"cpu_chunks contains duplicate ids \[4\]"),
    ([], [0], 0, "gpu_blocks is empty"),
    ([1, -2], [0], 0, "gpu_blocks contains negative ids"),
    ([1.0, 2], [0], 0, "gpu_blocks must be a flat sequence of ints"),
    ([1, 2], ["a"], 0, "cpu_chunks must be a flat sequence of ints"),
    ([1, 2], [0], -1, "first_block_index must be >= 0"),
    ([1, 2], [0], 1.5, "first_block_index must be an int"),
])
def test_spec_errors(gpu_blocks: list[object], cpu_chunks: list[object], first: object,
                     match: str) -> None:
    with pytest.raises(KernelSpecError, match=match):
        TransferSpec(gpu_blocks, cpu_chunks, first)  # type: ignore[arg-type]


def test_engine_tensor_errors() -> None:
    layout = KVLayout((64, 32), 2)
    gpu, cpu = random_kv(layout, 8, 4, seed=0)
    with pytest.raises(KernelSpecError, match="2 GPU tensors but 1 CPU tensors"):
        CopyEngine(gpu, cpu[:1], 2)
    with pytest.raises(KernelSpecError, match="no KV tensors"):
        CopyEngine([], [], 2)
    with pytest.raises(KernelSpecError, match="rows are 128 bytes; expected page 64 x 3"):
        CopyEngine(gpu, cpu, 3)
    with pytest.raises(KernelSpecError, match="contiguous 2-D int8"):
        CopyEngine([gpu[0].float(), gpu[1]], cpu, 2)
    with pytest.raises(KernelSpecError, match="contiguous 2-D int8"):
        CopyEngine([gpu[0].t(), gpu[1]], cpu, 2)
    with pytest.raises(KernelSpecError, match="GPU tensor 1 has 7 blocks"):
        CopyEngine([gpu[0], gpu[1][:7]], cpu, 2)
    with pytest.raises(KernelSpecError, match="CPU tensor 1 has 3 chunks"):
        CopyEngine(gpu, [cpu[0], cpu[1][:3]], 2)
    with pytest.raises(KernelSpecError, match="blocks_per_chunk must be >= 1"):
        CopyEngine(gpu, cpu, 0)
    with pytest.raises(KernelSpecError, match="GPU tensors are on cpu, engine on meta"):
        CopyEngine(gpu, cpu, 2, device="meta")
    with pytest.raises(KernelSpecError, match="unsupported device meta"):
        CopyEngine([g.to("meta") for g in gpu], cpu, 2)
    with pytest.raises(KernelSpecError, match="num_streams must be >= 1"):
        CopyEngine(gpu, cpu, 2, num_streams=0)
    with pytest.raises(KernelSpecError, match="CPU tensor 0 is on meta"):
        CopyEngine(gpu, [c.to("meta") for c in cpu], 2)
    engine = CopyEngine(gpu, cpu, 2)
    with pytest.raises(KernelSpecError, match="must be a TransferSpec"):
        engine.submit_store(1, ([1], [0], 0))  # type: ignore[arg-type]


def test_layout_errors() -> None:
    with pytest.raises(KernelSpecError, match="page_bytes is empty"):
        KVLayout((), 1)
    with pytest.raises(KernelSpecError, match=r"page_bytes\[1\] must be >= 1"):
        KVLayout((64, 0), 1)
    with pytest.raises(KernelSpecError, match="blocks_per_chunk must be >= 1"):
        KVLayout((64,), 0)
    layout = KVLayout((64, 32), 4)
    assert layout.block_bytes == 96 and layout.chunk_bytes(1) == 128
    with pytest.raises(KernelSpecError, match="num_chunks must be >= 1"):
        allocate_cpu_kv(layout, 0)


def test_spec_is_a_value() -> None:
    spec = TransferSpec(range(3), [7], 1)
    assert spec == TransferSpec((0, 1, 2), (7,), 1)
    assert spec.gpu_blocks == (0, 1, 2) and hash(spec) == hash(TransferSpec([0, 1, 2], [7], 1))
    assert spec.skip(4) == 1 and spec.expected_chunks(4) == 1 and spec.expected_chunks(2) == 2
    with pytest.raises(KernelSpecError, match="not a tensor"):
        TransferSpec(torch.arange(3), [0])  # type: ignore[arg-type]
    with pytest.raises(KernelSpecError, match="two 1-D int64 CPU tensors"):
        RowMapping(torch.arange(3), torch.arange(2))
    with pytest.raises(KernelSpecError, match="at least one row"):
        RowMapping(torch.arange(0), torch.arange(0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pinning_without_cuda_is_an_error() -> None:
    with pytest.raises(KernelSpecError, match="pin=True needs CUDA"):
        allocate_cpu_kv(KVLayout((64,), 1), 2, pin=True)
    assert not allocate_cpu_kv(KVLayout((64,), 1), 2)[0].is_pinned()


# -- property test ---------------------------------------------------------------------------


@st.composite
def jobs(draw: st.DrawFn) -> tuple[KVLayout, int, int, TransferSpec, TransferSpec, int]:
    bpc = draw(st.integers(1, 5))
    pages = tuple(draw(st.lists(st.sampled_from([8, 12, 16, 24, 48, 64]), min_size=1,
                                max_size=3)))
    num_blocks = draw(st.integers(2, 24))
    n = draw(st.integers(1, num_blocks // 2))
    first = draw(st.integers(0, 3 * bpc))
    chunks = -(-(n + first % bpc) // bpc)
    num_chunks = draw(st.integers(chunks, chunks + 4))
    perm = draw(st.permutations(range(num_blocks)))
    chunk_ids = draw(st.permutations(range(num_chunks)))[:chunks]
    store = TransferSpec(perm[:n], chunk_ids, first)
    load = TransferSpec(perm[n:2 * n], chunk_ids, first)
    return (KVLayout(pages, bpc), num_blocks, num_chunks, store, load,
            draw(st.integers(0, len(POLICIES) - 1)))


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_property_round_trip(job: tuple[KVLayout, int, int, TransferSpec, TransferSpec,
                                        int]) -> None:
    layout, num_blocks, num_chunks, store, load, pick = job
    policy = list(POLICIES.values())[pick]
    gpu, cpu = random_kv(layout, num_blocks, num_chunks, seed=pick)
    bpc = layout.blocks_per_chunk
    expected_cpu = oracle_store(gpu, cpu, store, bpc)
    expected_gpu = oracle_load(gpu, expected_cpu, load, bpc)
    engine = CopyEngine(gpu, cpu, bpc, policy=policy)
    engine.submit_store(1, store)
    engine.submit_load(2, load)
    assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True), (2, True)]
    assert_equal_all(cpu, expected_cpu)
    assert_equal_all(gpu, expected_gpu)
    for t in range(layout.num_tensors):  # each loaded block equals the block stored
        for s, d in zip(store.gpu_blocks, load.gpu_blocks, strict=True):
            assert torch.equal(gpu[t][d], gpu[t][s])


def _oracle_runs(rows: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        if runs and rows[i - 1] + 1 == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), min_size=1, max_size=40),
       st.randoms(use_true_random=False))
def test_run_analysis(pieces: list[tuple[int, int]], rnd: random.Random) -> None:
    """Short (Python) and long (tensor) mappings find the same runs as a direct loop."""
    src = [start + k for start, length in pieces for k in range(length)]
    dst = list(range(len(src)))
    for i in range(len(dst) - 1, 0, -1):  # shuffle a few stretches of dst
        if rnd.random() < 0.2:
            dst[i], dst[i - 1] = dst[i - 1], dst[i]
    m = RowMapping(torch.tensor(src), torch.tensor(dst))
    pair = [(i, dst[i] - src[i]) for i in range(len(src))]
    pair_runs: list[tuple[int, int]] = []
    for i, (_, delta) in enumerate(pair):
        if pair_runs and src[i - 1] + 1 == src[i] and pair[i - 1][1] == delta:
            pair_runs[-1] = (pair_runs[-1][0], pair_runs[-1][1] + 1)
        else:
            pair_runs.append((i, 1))
    assert m.runs("src") == _oracle_runs(src)
    assert m.runs("dst") == _oracle_runs(dst)
    assert m.runs("pair") == pair_runs
    assert (m.num_src_runs, m.num_dst_runs, m.num_pair_runs) == (
        len(_oracle_runs(src)), len(_oracle_runs(dst)), len(pair_runs))
    assert (m.first_src, m.first_dst) == (src[0], dst[0])
    # held as arrays (a short job's, by the engine): the same runs, tensors on demand, parts
    held = RowMapping.of_block_rows(array.array("q", src), array.array("q", dst))
    assert (held.first_src, held.first_dst, len(held)) == (src[0], dst[0], len(src))
    assert [held.runs(side) for side in ("src", "dst", "pair")] == \
        [m.runs(side) for side in ("src", "dst", "pair")]
    assert held.src.tolist() == src and held.dst.tolist() == dst
    start = rnd.randrange(len(src))
    part = held.part(start, len(src) - start)
    assert (part.src_ids.tolist(), part.dst_ids.tolist()) == (src[start:], dst[start:])
    assert part.runs("pair") == m.part(start, len(src) - start).runs("pair")


def test_index_kernels_need_a_shared_address_space() -> None:
    layout = KVLayout((64,), 1)
    gpu, cpu = random_kv(layout, 4, 4, seed=0)
    with pytest.raises(KernelSpecError, match="index kernels across devices"):
        copy_blocks_to_chunks([g.to("meta") for g in gpu], cpu, TransferSpec([0], [1]), 1,
                              CopyPolicy())
