"""The batched strategy: descriptors, the CUDA driver binding, and the byte oracle.

Descriptors are checked against a direct oracle (per run or per row, per tensor). The
``ctypes`` binding of ``cuMemcpyBatchAsync`` is checked against the CUDA headers themselves:
a stand-in driver library, compiled against ``cuda.h`` with the header's own prototypes,
records what it receives and copies host memory, so a wrong structure layout, argument order
or entry point fails here, on a machine without a GPU (skipped where no ``cuda.h`` is
installed). The strategy's byte oracle on CUDA is in ``test_kernels_cuda.py``; on host memory
the same descriptors run through the compiled loop (``POLICIES`` in ``test_kernels.py``).
"""

from __future__ import annotations

import array
import ctypes
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import (
    CopyEngine,
    CopyPolicy,
    KernelSpecError,
    KVLayout,
    RowMapping,
    Strategy,
    TransferSpec,
    block_rows,
    choose_strategy,
    cudriver,
    native,
    toolchain,
)
from kernels.copy import BATCH_INDEX_BELOW, BATCH_INDEX_MIN_ROWS, batch_descriptors, run_batch
from kernels.descriptors import DescriptorPlan, Descriptors
from tests.kernel_oracle import oracle_load, oracle_store
from tests.test_kernels import assert_equal_all, random_kv

needs_native = pytest.mark.skipif(not native.available(), reason="no compiled copy")


# -- descriptors ------------------------------------------------------------------------------


def _pair_runs(src: list[int], dst: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in range(len(src)):
        if runs and src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@st.composite
def mappings(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], int, int]:
    """Row sizes of 1-4 tensors, a mapping of 1-40 rows (runs likely), the row counts."""
    pages = draw(st.lists(st.sampled_from([8, 16, 24, 64, 4096]), min_size=1, max_size=4))
    n = draw(st.integers(1, 40))
    src_rows, dst_rows = 2 * n + 3, 2 * n + 5
    src = draw(st.permutations(range(src_rows)))[:n]
    dst = draw(st.permutations(range(dst_rows)))[:n]
    for i in range(1, n):  # make some pairs follow their predecessor on both sides
        if draw(st.booleans()) and src[i - 1] + 1 < src_rows and dst[i - 1] + 1 < dst_rows \
                and src[i - 1] + 1 not in src[:i] and dst[i - 1] + 1 not in dst[:i]:
            src[i], dst[i] = src[i - 1] + 1, dst[i - 1] + 1
    if len(set(src)) < n or len(set(dst)) < n:
        src, dst = list(range(n)), list(range(n))
    return pages, src, dst, src_rows, dst_rows


BUILDERS = [pytest.param(True, id="compiled", marks=needs_native),
            pytest.param(False, id="tensor_ops")]


@pytest.mark.parametrize("compiled", BUILDERS)
@settings(max_examples=80, deadline=None)
@given(case=mappings(), merge=st.booleans())
def test_descriptors_match_the_oracle(case: tuple[list[int], list[int], list[int], int, int],
                                      merge: bool, compiled: bool) -> None:
    pages, src, dst, src_rows, dst_rows = case
    src_t = [torch.empty(src_rows, p, dtype=torch.int8) for p in pages]
    dst_t = [torch.empty(dst_rows, p, dtype=torch.int8) for p in pages]
    plan = DescriptorPlan(dst_t, src_t, compiled=compiled)
    mapping = RowMapping(torch.tensor(src), torch.tensor(dst))
    got = plan.descriptors(mapping.dst, mapping.src, merge_runs=merge)
    runs = _pair_runs(src, dst) if merge else [(i, 1) for i in range(len(src))]
    want = [(d.data_ptr() + dst[p] * page, s.data_ptr() + src[p] * page, length * page)
            for d, s, page in zip(dst_t, src_t, pages, strict=True) for p, length in runs]
    assert list(zip(got.dst.tolist(), got.src.tolist(), got.sizes.tolist(),
                    strict=True)) == want
    assert got.nbytes == sum(got.sizes.tolist()) == len(src) * sum(pages)
    assert got.count == len(runs) * len(pages)
    # rows held as arrays (a short job's, by the engine) give the same descriptors
    held = plan.descriptors(array.array("q", dst), array.array("q", src), merge_runs=merge)
    assert [t.tolist() for t in (held.dst, held.src, held.sizes)] == \
        [t.tolist() for t in (got.dst, got.src, got.sizes)]


def test_vllm_form_is_one_descriptor_per_block_and_tensor() -> None:
    """vLLM 0.33.0's worker: a descriptor per block and KV tensor, each one page
    (``vllm/v1/kv_offload/cpu/gpu_worker.py:407-447``)."""
    gpu, cpu = random_kv(KVLayout((64, 32, 32), 1), 12, 12, seed=1)
    g, c = block_rows(TransferSpec([4, 5, 6, 9], [1, 2, 3, 7]), 1, 12, 12)
    plan = DescriptorPlan(cpu, gpu)
    merged = plan.descriptors(c, g, merge_runs=True)
    per_row = plan.descriptors(c, g)
    assert per_row.count == 4 * 3 and merged.count == 2 * 3  # [4,5,6]->[1,2,3] is one run
    assert per_row.sizes.tolist() == [64] * 4 + [32] * 8
    assert merged.sizes.tolist() == [192, 64, 96, 32, 96, 32]
    assert per_row.nbytes == merged.nbytes == 4 * 128


@pytest.mark.parametrize("compiled", BUILDERS)
def test_rows_out_of_range_make_no_descriptor(compiled: bool) -> None:
    plan = DescriptorPlan([torch.empty(4, 8, dtype=torch.int8)],
                          [torch.empty(6, 8, dtype=torch.int8)], compiled=compiled)
    with pytest.raises(KernelSpecError, match=r"source row 6 at position 1 is out of range"):
        plan.descriptors(torch.tensor([0, 1]), torch.tensor([2, 6]))
    with pytest.raises(KernelSpecError, match=r"destination row -1 at position 0"):
        plan.descriptors(torch.tensor([-1]), torch.tensor([0]))
    with pytest.raises(KernelSpecError, match=r"source row 6 at position 1 is out of range"):
        plan.descriptors(array.array("q", [0, 1]), array.array("q", [2, 6]))
    with pytest.raises(KernelSpecError, match="one non-zero length"):
        plan.descriptors(torch.tensor([0, 1]), torch.tensor([0]))


def test_plan_errors() -> None:
    a = torch.empty(4, 8, dtype=torch.int8)
    with pytest.raises(KernelSpecError, match="as many source as destination"):
        DescriptorPlan([a], [])
    with pytest.raises(KernelSpecError, match="rows differ in size"):
        DescriptorPlan([a], [torch.empty(4, 16, dtype=torch.int8)])
    with pytest.raises(KernelSpecError, match="differ in row count"):
        DescriptorPlan([a, torch.empty(5, 8, dtype=torch.int8)], [a, a])
    with pytest.raises(KernelSpecError, match="contiguous 2-D"):
        DescriptorPlan([a.t()], [a.t()])
    with pytest.raises(KernelSpecError, match="at least one group"):
        Descriptors.concat([])


@needs_native
def test_groups_concatenate_in_order_and_run_on_the_host() -> None:
    gpu, cpu = random_kv(KVLayout((32, 16), 2), 10, 6, seed=4)
    spec = TransferSpec([1, 2, 7, 3], [4, 0, 5], group_sizes=[2, 2], block_indices=[0, 1])
    expected = oracle_store(gpu, cpu, spec, 2, groups=((0,), (1,)))
    g, c = block_rows(spec, 2, 10, 6)
    whole = RowMapping(g, c)
    parts = [whole.part(seg.start, seg.size) for seg in spec.segments]
    plans = [DescriptorPlan([cpu[t].view(-1, gpu[t].shape[1])], [gpu[t]]) for t in (0, 1)]
    batch = batch_descriptors(plans, parts, CopyPolicy(batch_dma=True))
    assert batch.count == 1 + 2  # group 0: blocks 1, 2 into one chunk; group 1: two runs
    run_batch(batch, torch.device("cpu"), False, CopyPolicy(batch_dma=True))
    assert_equal_all(cpu, expected)


# -- the strategy's choice and the engine ----------------------------------------------------


def test_batched_strategy_choice_and_vllms_split() -> None:
    def mapping(n: int) -> RowMapping:
        return RowMapping(torch.arange(n) * 2, torch.arange(n) * 3)

    cuda = CopyPolicy(index_kernels=True, runs_by_dma=True, native=False, batch_dma=True,
                      batch_index_below=BATCH_INDEX_BELOW)
    small, large = BATCH_INDEX_BELOW - 1024, BATCH_INDEX_BELOW
    many, few = mapping(BATCH_INDEX_MIN_ROWS), mapping(BATCH_INDEX_MIN_ROWS - 1)
    assert choose_strategy(many, small, cuda) is Strategy.BATCH_DMA  # stores: always the DMA
    assert choose_strategy(many, small, cuda, load=True) is Strategy.TWO_PASS  # SM kernels
    assert choose_strategy(few, small, cuda, load=True) is Strategy.BATCH_DMA
    assert choose_strategy(many, large, cuda, load=True) is Strategy.BATCH_DMA
    unmapped = CopyPolicy(index_kernels=False, native=False, batch_dma=True,
                          batch_index_below=BATCH_INDEX_BELOW)
    assert choose_strategy(many, small, unmapped, load=True) is Strategy.BATCH_DMA
    assert choose_strategy(mapping(1), 64, CopyPolicy(batch_dma=True)) is Strategy.BATCH_DMA
    for mapped in (True, False):  # the CUDA default: every job, exactly where the driver has it
        policy = CopyPolicy.for_device(torch.device("cuda"), host_mapped=mapped)
        assert policy.batch_dma == (cudriver.batch_copy() is not None)
        assert policy.batch_index_below is None
    assert not CopyPolicy.for_device(torch.device("cpu")).batch_dma


@needs_native
@pytest.mark.parametrize("merge", [True, False], ids=["runs", "rows"])
def test_engine_batches_a_whole_job_of_several_groups(merge: bool) -> None:
    layout = KVLayout((32, 16, 48), 3, ((0, 2), (1,)))
    gpu, cpu = random_kv(layout, 14, 8, seed=int(merge))
    engine = CopyEngine(gpu, cpu, 3, groups=layout.groups,
                        policy=CopyPolicy(batch_dma=True, batch_merge_runs=merge))
    store = TransferSpec([1, 2, 3, 9, 5, 6], [7, 2, 0], group_sizes=[4, 2],
                         block_indices=[2, 0])
    load = TransferSpec([10, 11, 12, 13, 0, 4], [7, 2, 0], group_sizes=[4, 2],
                        block_indices=[2, 0])
    expected_cpu = oracle_store(gpu, cpu, store, 3, groups=layout.groups)
    engine.submit_store(1, store)
    assert [(r.job_id, r.success) for r in engine.poll()] == [(1, True)]
    assert_equal_all(cpu, expected_cpu)
    expected_gpu = oracle_load(gpu, cpu, load, 3, groups=layout.groups)
    engine.submit_load(2, load)
    [result] = engine.poll()
    assert result.bytes == 4 * (32 + 48) + 2 * 16
    assert_equal_all(gpu, expected_gpu)


# -- the driver binding, against the CUDA headers --------------------------------------------


def _cuda_include() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").is_file():
            return Path(root) / "include"
    return None


CUDA_INCLUDE = _cuda_include()
needs_header = pytest.mark.skipif(CUDA_INCLUDE is None or toolchain.compiler() is None,
                                  reason="no cuda.h (CUDA toolkit) or no C compiler")

# A driver library's stand-in: the header's own prototypes (a signature that differs from
# cuda.h does not compile), the calls recorded, host memory copied, failures on demand.
_FAKE_DRIVER = r"""
#include <stddef.h>
#include <string.h>
#include <cuda.h>

static int fake_version = FAKE_VERSION;
static CUresult fake_result = CUDA_SUCCESS;
static size_t fake_fail_at = 0;
static long long fake_seen[16];
static long long fake_calls = 0;

void fake_fail(int result, size_t at) { fake_result = (CUresult)result; fake_fail_at = at; }
long long fake_get(int i) { return fake_seen[i]; }
long long fake_call_count(void) { return fake_calls; }

long long fake_layout(int what) {
    switch (what) {
    case 0: return (long long)sizeof(CUmemLocation);
    case 1: return (long long)sizeof(CUmemcpyAttributes);
    case 2: return (long long)offsetof(CUmemcpyAttributes, srcLocHint);
    case 3: return (long long)offsetof(CUmemcpyAttributes, dstLocHint);
    case 4: return (long long)offsetof(CUmemcpyAttributes, flags);
    case 5: return (long long)offsetof(CUmemLocation, id);
    case 6: return CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    case 7: return CU_MEMCPY_SRC_ACCESS_ORDER_ANY;
    case 8: return CU_MEM_LOCATION_TYPE_DEVICE;
    case 9: return CU_MEM_LOCATION_TYPE_HOST;
    case 10: return (long long)sizeof(CUdeviceptr);
    }
    return -1;
}

CUresult CUDAAPI cuDriverGetVersion(int *version) { *version = fake_version; return 0; }

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **name) {
    *name = error == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

static CUresult fake_batch(int form, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                           size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                           size_t numAttrs, size_t *failIdx, CUstream stream) {
    long long seen[16] = {form, (long long)count, (long long)numAttrs,
                          (long long)attrsIdxs[0], attrs[0].srcAccessOrder,
                          attrs[0].srcLocHint.type, attrs[0].srcLocHint.id,
                          attrs[0].dstLocHint.type, attrs[0].dstLocHint.id,
                          (long long)attrs[0].flags, (long long)(size_t)stream};
    memcpy(fake_seen, seen, sizeof seen);
    ++fake_calls;
    size_t n = fake_result == CUDA_SUCCESS ? count : fake_fail_at;
    for (size_t i = 0; i < n; ++i)
        memcpy((void *)(size_t)dsts[i], (const void *)(size_t)srcs[i], sizes[i]);
    if (fake_result != CUDA_SUCCESS && failIdx) *failIdx = fake_fail_at;
    return fake_result;
}

#ifdef FAKE_V2
CUresult CUDAAPI cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                       size_t count, CUmemcpyAttributes *attrs,
                                       size_t *attrsIdxs, size_t numAttrs, CUstream hStream) {
    return fake_batch(2, dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, hStream);
}
#endif

#undef cuMemcpyBatchAsync
CUresult CUDAAPI cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                    size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                                    size_t numAttrs, size_t *failIdx, CUstream hStream) {
    return fake_batch(1, dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx,
                      hStream);
}
"""


def _fake_driver(version: int, v2: bool) -> ctypes.CDLL:
    assert CUDA_INCLUDE is not None
    flags = ["-O1", "-shared", "-fPIC", "-Werror", f"-I{CUDA_INCLUDE}",
             f"-DFAKE_VERSION={version}", *(["-DFAKE_V2"] if v2 else [])]
    path = toolchain.build("kvspec_fake_cuda", {"fake_cuda.c": _FAKE_DRIVER}, flags)
    lib = ctypes.CDLL(str(path))
    lib.fake_get.restype = lib.fake_layout.restype = ctypes.c_longlong
    lib.fake_call_count.restype = ctypes.c_longlong
    lib.fake_fail.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.path = str(path)  # type: ignore[attr-defined]
    return lib


@needs_header
def test_structures_match_cuda_h() -> None:
    fake = _fake_driver(13000, True)
    attrs = cudriver.CUmemcpyAttributes
    assert [fake.fake_layout(i) for i in range(11)] == [
        ctypes.sizeof(cudriver.CUmemLocation), ctypes.sizeof(attrs), attrs.srcLocHint.offset,
        attrs.dstLocHint.offset, attrs.flags.offset, cudriver.CUmemLocation.id.offset,
        cudriver.SrcAccessOrder.STREAM, cudriver.SrcAccessOrder.ANY, 1, 2, 8]


def _host_batch(n: int = 5, page: int = 24) -> tuple[torch.Tensor, torch.Tensor, Descriptors]:
    src = torch.randint(-128, 128, (n, page), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(n))
    dst = torch.zeros(n + 2, page, dtype=torch.int8)
    plan = DescriptorPlan([dst], [src])
    rows = torch.tensor([3, 0, 1, 6, 4][:n])
    return src, dst, plan.descriptors(rows, torch.arange(n))


@needs_header
@pytest.mark.parametrize(("version", "v2", "form"), [(13000, True, 2), (12080, False, 1)],
                         ids=["cuda13-v2", "cuda12.8-failidx"])
def test_batch_copy_passes_the_batch_as_the_header_declares(version: int, v2: bool,
                                                            form: int) -> None:
    fake = _fake_driver(version, v2)
    op = cudriver.load(fake.path)
    assert (op.driver_version, op.takes_fail_index) == (version, not v2)
    src, dst, batch = _host_batch()
    calls = fake.fake_call_count()
    op(batch, 0xBEEF, op.attributes(cudriver.SrcAccessOrder.ANY, 3, store=False))
    for i, row in enumerate([3, 0, 1, 6, 4]):
        assert torch.equal(dst[row], src[i])
    assert [fake.fake_get(i) for i in range(11)] == [
        form, 5, 1, 0, cudriver.SrcAccessOrder.ANY, 2, 0, 1, 3, 0, 0xBEEF]  # host -> device 3
    op(batch, 7, op.attributes(cudriver.SrcAccessOrder.STREAM, 0, store=True))
    assert [fake.fake_get(i) for i in (4, 5, 6, 7, 10)] == [
        cudriver.SrcAccessOrder.STREAM, 1, 0, 2, 7]  # device 0 -> host
    assert fake.fake_call_count() == calls + 2


@needs_header
def test_a_failed_batch_is_a_typed_error_naming_the_result_and_the_copy() -> None:
    fake = _fake_driver(12080, False)
    op = cudriver.load(fake.path)
    _, _, batch = _host_batch()
    calls = fake.fake_call_count()
    fake.fake_fail(1, 2)  # CUDA_ERROR_INVALID_VALUE at copy 2
    attrs = op.attributes(cudriver.SrcAccessOrder.STREAM, 0, store=True)
    with pytest.raises(cudriver.CudaDriverError,
                       match=r"cuMemcpyBatchAsync failed with CUDA_ERROR_INVALID_VALUE at copy 2:"
                             r" a batch of 5 copies, 120 bytes"):
        op(batch, 9, attrs)
    fake.fake_fail(0, 0)
    with pytest.raises(cudriver.CudaDriverError, match="legacy null stream"):
        op(batch, 0, attrs)
    assert fake.fake_call_count() == calls + 1  # the null stream never reached the driver


@needs_header
def test_drivers_without_the_batched_copy_are_refused_with_a_reason() -> None:
    with pytest.raises(cudriver.DriverUnavailable, match=r"version 12060; .* needs 12080"):
        cudriver.load(_fake_driver(12060, True).path)
    with pytest.raises(cudriver.DriverUnavailable, match="no CUDA driver library"):
        cudriver.load("/nonexistent/libcuda.so.1")


def test_without_a_driver_the_batched_policy_is_refused_on_cuda() -> None:
    if cudriver.batch_copy() is not None:
        pytest.skip("this machine's driver has cuMemcpyBatchAsync")
    assert cudriver.unavailable_reason()
    batch = _host_batch()[2]
    with pytest.raises(KernelSpecError, match="needs the CUDA driver's cuMemcpyBatchAsync"):
        run_batch(batch, torch.device("cuda", 0), True, CopyPolicy(batch_dma=True))
