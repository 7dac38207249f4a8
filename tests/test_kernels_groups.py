"""The kernels with several KV cache groups: each group's blocks land in its own tensors (its
own page size), each group takes its own CPU chunks with its own first-chunk skip, and the
other groups' tensors are untouched (vLLM 0.33.0:
`vllm/v1/kv_offload/cpu/gpu_worker.py:597-669`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import (
    CopyEngine,
    CopyPolicy,
    KernelSpecError,
    KVLayout,
    TransferSpec,
    block_rows,
    copy_blocks_to_chunks,
    copy_chunks_to_blocks,
)
from kernels.layout import _PY_IDS_MAX, block_row_ids
from tests.kernel_oracle import group_positions, oracle_load, oracle_store, sub_block
from tests.test_kernels import POLICIES, assert_equal_all, random_kv

# two groups: full attention (two tensors of 64-byte pages), sliding window (one of 24)
LAYOUT = KVLayout((64, 64, 24), 4, groups=((0, 1), (2,)))


def _grouped(sizes: tuple[int, ...], starts: tuple[int, ...], blocks: list[int],
             chunks: list[int]) -> TransferSpec:
    return TransferSpec(blocks, chunks, group_sizes=sizes, block_indices=starts)


def test_each_group_lands_in_its_own_tensors_at_its_own_skip() -> None:
    gpu, cpu = random_kv(LAYOUT, 16, 8, seed=1)
    gpu_before = [g.clone() for g in gpu]
    # group 0: blocks 4, 5 of the request (chunk-aligned), one chunk; group 1: blocks 5, 6, 7
    # (skip 1), one chunk
    spec = _grouped((2, 3), (4, 5), [3, 9, 11, 2, 7], [6, 1])
    expected = oracle_store(gpu, cpu, spec, 4, LAYOUT.groups)
    engine = CopyEngine(gpu, cpu, 4, groups=LAYOUT.groups)
    engine.submit_store(1, spec)
    [result] = engine.poll()
    assert result.success and result.bytes == 2 * 128 + 3 * 24
    assert_equal_all(cpu, expected)
    for t in (0, 1):
        assert torch.equal(sub_block(cpu[t], 6, 0, 64), gpu[t][3])
        assert torch.equal(sub_block(cpu[t], 6, 1, 64), gpu[t][9])
    assert torch.equal(sub_block(cpu[2], 1, 1, 24), gpu[2][11])
    assert torch.equal(sub_block(cpu[2], 1, 3, 24), gpu[2][7])
    assert_equal_all(gpu, gpu_before)
    # and back into other blocks: only each group's own tensors change
    load = _grouped((2, 3), (4, 5), [0, 1, 12, 13, 14], [6, 1])
    expected_gpu = oracle_load(gpu, cpu, load, 4, LAYOUT.groups)
    engine.submit_load(2, load)
    [result] = engine.poll()
    assert result.success
    assert_equal_all(gpu, expected_gpu)
    assert torch.equal(gpu[0][0], gpu[0][3]) and torch.equal(gpu[2][14], gpu[2][7])
    assert torch.equal(gpu[2][0], gpu_before[2][0])  # group 0's block, not in group 1's tensor
    assert torch.equal(gpu[0][12], gpu_before[0][12])  # group 1's block, not in group 0's
    engine.shutdown()


def test_a_group_without_blocks_takes_no_chunk() -> None:
    spec = _grouped((0, 2), (0, 6), [4, 5], [3])
    assert [(s.group, s.start, s.size) for s in spec.segments] == [(1, 0, 2)]
    assert spec.expected_chunks(4) == 1 and spec.first_block_index == 6
    gpu_rows, cpu_rows = block_rows(spec, 4, 16, 8)
    assert gpu_rows.tolist() == [4, 5] and cpu_rows.tolist() == [3 * 4 + 2, 3 * 4 + 3]


def test_chunk_position_follows_each_group() -> None:
    spec = _grouped((3, 3), (1, 5), [0, 1, 2, 3, 4, 5], [10, 11, 12, 13])
    # bpc 2: group 0 skip 1 -> chunks 0, 1 (positions 0, 1); group 1 skip 1 -> chunks 2, 3
    assert [spec.chunk_position(i, 2) for i in range(6)] == [0, 1, 1, 2, 3, 3]
    assert [c for _, _, c, _ in group_positions(spec, 2)] == [10, 11, 11, 12, 13, 13]
    with pytest.raises(IndexError):
        spec.chunk_position(6, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"group_sizes": (2,)}, "go together"),
    ({"group_sizes": (1, 1), "block_indices": (0,)}, "one entry per KV cache group"),
    ({"group_sizes": (1, 2), "block_indices": (0, 0)}, "add up to 3, but the job names 2"),
    ({"group_sizes": (2, -0.5), "block_indices": (0, 0)}, r"group_sizes\[1\] must be an int"),
    ({"group_sizes": (2, 0), "block_indices": (0, -1)}, r"block_indices\[1\] must be >= 0"),
])
def test_group_layout_errors(kwargs: dict[str, tuple[float, ...]], match: str) -> None:
    with pytest.raises(KernelSpecError, match=match):
        TransferSpec([1, 2], [0], **kwargs)  # type: ignore[arg-type]


def test_first_block_index_must_agree_with_block_indices() -> None:
    with pytest.raises(KernelSpecError, match="contradicts block_indices"):
        TransferSpec([1, 2], [0], 3, group_sizes=(1, 1), block_indices=(2, 2))
    with pytest.raises(KernelSpecError, match=r"block_indices\[1\]=5"):
        TransferSpec([1, 2], [0], 3, group_sizes=(0, 2), block_indices=(2, 5))
    assert TransferSpec([1, 2], [0, 1], 2, group_sizes=(1, 1),
                        block_indices=(2, 2)).first_block_index == 2


def test_layout_group_errors() -> None:
    with pytest.raises(KernelSpecError, match="group 1 has no KV tensor"):
        KVLayout((64, 32), 1, groups=((0, 1), ()))
    with pytest.raises(KernelSpecError, match="group 0 names tensor 2"):
        KVLayout((64, 32), 1, groups=((0, 2),))
    with pytest.raises(KernelSpecError, match="names a tensor twice"):
        KVLayout((64, 32), 1, groups=((0, 0), (1,)))
    with pytest.raises(KernelSpecError, match=r"tensors \[1\] belong to no group"):
        KVLayout((64, 32), 1, groups=((0,),))
    shared = KVLayout((64, 32), 1, groups=((0, 1), (0, 1)))  # vLLM's aliased tensors
    assert shared.num_groups == 2 and shared.group_block_bytes(1) == 96
    assert KVLayout((64, 32), 1).groups == ((0, 1),)


def test_a_job_of_a_group_the_layout_lacks_is_refused() -> None:
    gpu, cpu = random_kv(LAYOUT, 16, 8, seed=2)
    engine = CopyEngine(gpu, cpu, 4, groups=LAYOUT.groups)
    spec = _grouped((1, 0, 1), (0, 0, 0), [1, 2], [0, 1])
    with pytest.raises(KernelSpecError, match="group 2; the layout has 2 groups"):
        engine.submit_store(1, spec)
    with pytest.raises(KernelSpecError, match="group 2; the layout has 2 groups"):
        copy_blocks_to_chunks(gpu, cpu, spec, 4, groups=LAYOUT.groups)
    with pytest.raises(KernelSpecError, match=r"group 1: 3 from index 5 \(skip 1\)"):
        engine.submit_load(2, _grouped((2, 3), (4, 5), [3, 9, 11, 2, 7], [6, 1, 2]))
    assert engine.pending() == set()


@st.composite
def grouped_jobs(draw: st.DrawFn) -> tuple[KVLayout, int, int, TransferSpec, TransferSpec]:
    bpc = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 3))
    pages: list[int] = []
    groups: list[tuple[int, ...]] = []
    for _ in range(num_groups):
        width = draw(st.integers(1, 2))
        groups.append(tuple(range(len(pages), len(pages) + width)))
        pages += draw(st.lists(st.sampled_from([8, 16, 24, 48]), min_size=width,
                               max_size=width))
    sizes = draw(st.lists(st.integers(0, 4), min_size=num_groups, max_size=num_groups)
                 .filter(lambda s: sum(s) > 0))
    starts = draw(st.lists(st.integers(0, 3 * bpc), min_size=num_groups,
                           max_size=num_groups))
    n = sum(sizes)
    chunks = sum(-(-(s + b % bpc) // bpc) for s, b in zip(sizes, starts, strict=True) if s)
    num_blocks = 2 * n + draw(st.integers(0, 4))
    num_chunks = chunks + draw(st.integers(0, 3))
    perm = draw(st.permutations(range(num_blocks)))
    chunk_ids = draw(st.permutations(range(num_chunks)))[:chunks]
    store = _grouped(tuple(sizes), tuple(starts), perm[:n], chunk_ids)
    load = _grouped(tuple(sizes), tuple(starts), perm[n:2 * n], chunk_ids)
    return KVLayout(tuple(pages), bpc, tuple(groups)), num_blocks, num_chunks, store, load


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@settings(max_examples=25, deadline=None)
@given(job=grouped_jobs())
def test_grouped_round_trip_matches_the_oracle(
        policy: CopyPolicy, job: tuple[KVLayout, int, int, TransferSpec, TransferSpec]) -> None:
    """Every strategy, through the engine and through the one-call API."""
    layout, num_blocks, num_chunks, store, load = job
    bpc = layout.blocks_per_chunk
    gpu, cpu = random_kv(layout, num_blocks, num_chunks, seed=bpc)
    expected_cpu = oracle_store(gpu, cpu, store, bpc, layout.groups)
    expected_gpu = oracle_load(gpu, expected_cpu, load, bpc, layout.groups)
    gpu2, cpu2 = [g.clone() for g in gpu], [c.clone() for c in cpu]
    engine = CopyEngine(gpu, cpu, bpc, groups=layout.groups, policy=policy)
    engine.submit_store(1, store)
    engine.submit_load(2, load)
    results = engine.poll()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    assert results[0].bytes == layout.job_bytes(store) == sum(
        seg.size * sum(layout.page_bytes[t] for t in layout.groups[seg.group])
        for seg in store.segments)
    assert_equal_all(cpu, expected_cpu)
    assert_equal_all(gpu, expected_gpu)
    copy_blocks_to_chunks(gpu2, cpu2, store, bpc, policy, groups=layout.groups)
    copy_chunks_to_blocks(cpu2, gpu2, load, bpc, policy, groups=layout.groups)
    assert_equal_all(cpu2, expected_cpu)
    assert_equal_all(gpu2, expected_gpu)
    engine.shutdown()


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_block_rows_follow_the_oracle_for_short_and_long_jobs(data: st.DataObject) -> None:
    """A job's rows, computed in Python up to `_PY_IDS_MAX` blocks and with tensor ops
    above it, are the oracle's (group, block, chunk, sub-block) positions: each group from
    its own first chunk at its own skip. The engine's arrays and the public tensors agree."""
    bpc = data.draw(st.integers(1, 5), label="bpc")
    sizes = data.draw(st.lists(st.integers(0, 60), min_size=1, max_size=3)
                      .filter(lambda s: sum(s) > 0), label="sizes")
    starts = data.draw(st.lists(st.integers(0, 3 * bpc), min_size=len(sizes),
                                max_size=len(sizes)), label="starts")
    n = sum(sizes)
    chunks = sum(-(-(size + start % bpc) // bpc) for size, start in zip(sizes, starts,
                                                                      strict=True) if size)
    gpu = data.draw(st.permutations(range(n + 4)))[:n]
    cpu = data.draw(st.permutations(range(chunks + 4)))[:chunks]
    spec = TransferSpec(gpu, cpu, group_sizes=sizes, block_indices=starts)
    expected = [(b, chunk * bpc + sub) for _, b, chunk, sub in group_positions(spec, bpc)]
    gpu_rows, cpu_rows = block_rows(spec, bpc, n + 4, chunks + 4)
    assert list(zip(gpu_rows.tolist(), cpu_rows.tolist(), strict=True)) == expected
    gpu_ids, cpu_ids = block_row_ids(spec, bpc, n + 4, chunks + 4)
    assert list(zip(gpu_ids.tolist(), cpu_ids.tolist(), strict=True)) == expected
    # a short job keeps arrays (no tensor made), a long one with chunks of several blocks
    # tensors
    assert isinstance(cpu_ids, torch.Tensor) == (bpc > 1 and n > _PY_IDS_MAX)


def test_a_long_and_a_short_grouped_job_move_the_oracles_bytes() -> None:
    """Both ways of computing a job's rows, through the engine and every policy."""
    for sizes in ((2, 3), (_PY_IDS_MAX, 9)):  # 5 blocks; 73 blocks
        n = sum(sizes)
        spec = _grouped(sizes, (4, 5), list(range(n)), list(range(sum(
            -(-(size + start % 4) // 4) for size, start in zip(sizes, (4, 5), strict=True)))))
        for policy in POLICIES.values():
            gpu, cpu = random_kv(LAYOUT, n, 40, seed=n)
            expected = oracle_store(gpu, cpu, spec, 4, LAYOUT.groups)
            with CopyEngine(gpu, cpu, 4, policy=policy, groups=LAYOUT.groups) as engine:
                engine.submit_store(1, spec)
                assert [r.success for r in engine.poll()] == [True]
            assert_equal_all(cpu, expected)
