"""The compiled one-pass gather-scatter copy (kernels.native) and its fallback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import (
    CopyEngine,
    CopyPolicy,
    KernelSpecError,
    KVLayout,
    Strategy,
    TransferSpec,
    copy_blocks_to_chunks,
    native,
)
from kernels.copy import RowMapping, RowTensor, copy_rows
from tests.kernel_oracle import oracle_store

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"no native copy: {native.unavailable_reason()}")


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, width), dtype=torch.int8, generator=gen)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 40])
def test_copy_rows_matches_indexing(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # the threads the test names
    src, dst = rows(50, 4096, 1), rows(40, 4096, 2)
    src_rows = torch.randperm(50)[:30]
    dst_rows = torch.randperm(40)[:30]
    expected = dst.clone()
    expected[dst_rows] = src[src_rows]
    native.copy_rows(dst, src, dst_rows, src_rows, num_threads=threads)
    assert torch.equal(dst, expected)


@needs_native
def test_large_jobs_are_split_over_threads_and_stay_exact() -> None:
    page = 256 * 1024
    n = native.PARALLEL_MIN_BYTES // page + 3  # above the threshold: the threaded path
    src, dst = rows(2 * n, page, 3), torch.zeros(2 * n, page, dtype=torch.int8)
    src_rows, dst_rows = torch.randperm(2 * n)[:n], torch.randperm(2 * n)[:n]
    native.copy_rows(dst, src, dst_rows, src_rows, num_threads=2)
    assert torch.equal(dst[dst_rows], src[src_rows])
    untouched = torch.ones(2 * n, dtype=torch.bool)
    untouched[dst_rows] = False
    assert int(dst[untouched].abs().sum()) == 0


@needs_native
@pytest.mark.parametrize(("src_bad", "dst_bad"), [(50, 0), (0, 40), (-1, 0), (0, -7)])
def test_out_of_range_rows_copy_nothing(src_bad: int, dst_bad: int) -> None:
    src, dst = rows(50, 64, 4), rows(40, 64, 5)
    before = dst.clone()
    src_rows = torch.tensor([1, 2, 3, src_bad if src_bad else 4])
    dst_rows = torch.tensor([5, 6, 7, dst_bad if dst_bad else 8])
    with pytest.raises(native.NativeCopyError, match="row pair 3") as info:
        native.copy_rows(dst, src, dst_rows, src_rows)
    assert "nothing was copied" in str(info.value)
    assert torch.equal(dst, before)  # the earlier, valid pairs were not copied either


@needs_native
def test_bad_arguments_are_rejected() -> None:
    src, dst = rows(4, 64, 6), rows(4, 64, 7)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="differ in size"):
        native.copy_rows(dst, rows(4, 32, 8), idx, idx)
    with pytest.raises(ValueError, match="int64"):
        native.copy_rows(dst, src, idx.to(torch.int32), idx)
    with pytest.raises(ValueError, match="differ in length"):
        native.copy_rows(dst, src, idx, torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        native.copy_rows(dst.t(), src, idx, idx)


@needs_native
def test_the_native_strategy_is_used_and_matches_the_oracle() -> None:
    layout = KVLayout((512, 256), 4)
    gpu = [rows(16, p, 10 + i) for i, p in enumerate(layout.page_bytes)]
    cpu = [rows(6, p * 4, 20 + i) for i, p in enumerate(layout.page_bytes)]
    spec = TransferSpec([9, 1, 4, 6, 3, 12], [5, 1], 2)
    expected = oracle_store(gpu, cpu, spec, 4)
    copy_blocks_to_chunks(gpu, cpu, spec, 4, CopyPolicy())
    for a, e in zip(cpu, expected, strict=True):
        assert torch.equal(a, e)
    mapping = RowMapping(torch.tensor([3, 0]), torch.tensor([1, 2]))
    dst, src = RowTensor.of(cpu[0], 512), RowTensor.of(gpu[0], 512)
    assert copy_rows(dst, src, mapping, CopyPolicy()) is Strategy.NATIVE


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    native._load.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    native._load.cache_clear()


NO_HOST_BATCH = r"policy\.batch_dma on host memory needs the compiled copy"


def test_switched_off_falls_back_to_torch(fresh_native: pytest.MonkeyPatch) -> None:
    fresh_native.setenv("KVSPEC_NATIVE", "0")
    assert not native.available()
    assert "KVSPEC_NATIVE=0" in native.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        native.copy_rows(rows(2, 8, 0), rows(2, 8, 1), torch.tensor([0]), torch.tensor([1]))
    layout = KVLayout((64,), 2)
    gpu, cpu = [rows(12, 64, 2)], [rows(6, 128, 3)]
    spec = TransferSpec([9, 1, 4, 6, 3], [5, 1, 3], 1)
    expected = oracle_store(gpu, cpu, spec, 2)
    mapping = RowMapping(*reversed(_rows_of(spec, layout)))
    assert copy_rows(RowTensor.of(cpu[0], 64), RowTensor.of(gpu[0], 64), mapping,
                     CopyPolicy()) is Strategy.TWO_PASS
    assert torch.equal(cpu[0], expected[0])
    before = cpu[0].clone()  # the batched stand-in runs on the compiled loop: refused, untouched
    with pytest.raises(KernelSpecError, match=NO_HOST_BATCH):
        copy_rows(RowTensor.of(cpu[0], 64), RowTensor.of(gpu[0], 64), mapping,
                  CopyPolicy(batch_dma=True))
    assert torch.equal(cpu[0], before)
    with pytest.raises(KernelSpecError, match=NO_HOST_BATCH):
        CopyEngine(gpu, cpu, 2, policy=CopyPolicy(batch_dma=True))


def _rows_of(spec: TransferSpec, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels import block_rows
    cpu_rows, gpu_rows = block_rows(spec, layout.blocks_per_chunk, 12, 6)[::-1]
    return cpu_rows, gpu_rows


def test_no_compiler_is_reported(fresh_native: pytest.MonkeyPatch, tmp_path: object) -> None:
    fresh_native.delenv("CC", raising=False)
    fresh_native.setenv("PATH", "/nonexistent")
    assert native.library_path() is None
    assert not native.available()
    assert "no C compiler" in native.unavailable_reason()


def test_a_failed_build_is_reported(fresh_native: pytest.MonkeyPatch, tmp_path: object) -> None:
    fresh_native.setenv("KVSPEC_NATIVE_CACHE", str(tmp_path))
    fresh_native.setattr(native, "_FLAGS", ["-definitely-not-a-flag"])
    fresh_native.setattr(native, "_SERIAL_FLAGS", ["-definitely-not-a-flag"])
    assert not native.available()
    assert "build or load failed" in native.unavailable_reason()


def test_without_openmp_the_copy_builds_serial(fresh_native: pytest.MonkeyPatch,
                                               tmp_path: object) -> None:
    """A compiler without OpenMP (no libgomp): the same source builds without it (its jobs
    then run serially) and copies exactly."""
    fresh_native.setenv("KVSPEC_NATIVE_CACHE", str(tmp_path))
    fresh_native.setattr(native, "_FLAGS", ["-definitely-not-a-flag"])
    fresh_native.setattr(native, "PARALLEL_MIN_BYTES", 0)
    if native.library_path() is None:
        pytest.skip("no C compiler")
    assert native.available(), native.unavailable_reason()
    src, dst = _tensor_set([64, 32], 8, 1), _tensor_set([64, 32], 8, 2)
    native.TensorPairs(dst, src).copy(torch.tensor([7, 0]), torch.tensor([1, 2]), num_threads=2)
    assert all(torch.equal(d[7], s[1]) and torch.equal(d[0], s[2])
               for d, s in zip(dst, src, strict=True))


@needs_native
@pytest.mark.parametrize("width", [4096, 4144, 4100])  # whole lines; a 48-byte tail; unaligned
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_stores_for_jobs_larger_than_the_caches(width: int, threads: int) -> None:
    n = native.STREAM_MIN_BYTES // width + 5  # above the threshold: non-temporal stores
    src, dst = rows(2 * n, width, 9), torch.zeros(2 * n + 1, width, dtype=torch.int8)
    src_rows, dst_rows = torch.randperm(2 * n)[:n], torch.randperm(2 * n + 1)[:n]
    native.copy_rows(dst, src, dst_rows, src_rows, num_threads=threads)
    assert torch.equal(dst[dst_rows], src[src_rows])
    untouched = torch.ones(2 * n + 1, dtype=torch.bool)
    untouched[dst_rows] = False
    assert int(dst[untouched].abs().sum()) == 0


def _tensor_set(pages: list[int], n: int, seed: int) -> list[torch.Tensor]:
    return [rows(n, page, seed + i) for i, page in enumerate(pages)]


@needs_native
@pytest.mark.parametrize(("pages", "threads"), [([64], 2), ([16, 48, 4096], 1),
                                                ([16, 48, 4096], 2), ([32] * 40, 16),
                                                ([32] * 3, 7)])
def test_one_call_copies_every_tensor_of_a_job(pages: list[int], threads: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's plan (TensorPairs): every tensor, its own page size, one call; threads share
    either the tensors or (fewer tensors than threads) the pairs."""
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # small jobs take the threads too
    src, dst = _tensor_set(pages, 30, 10), _tensor_set(pages, 20, 50)
    src_rows, dst_rows = torch.randperm(30)[:12], torch.randperm(20)[:12]
    expected = [d.clone() for d in dst]
    for e, s in zip(expected, src, strict=True):
        e[dst_rows] = s[src_rows]
    native.TensorPairs(dst, src).copy(dst_rows, src_rows, num_threads=threads)
    assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True))


@needs_native
def test_a_bad_pair_copies_nothing_in_any_tensor() -> None:
    src, dst = _tensor_set([16, 64], 10, 1), _tensor_set([16, 64], 10, 2)
    before = [d.clone() for d in dst]
    with pytest.raises(native.NativeCopyError, match="row pair 2"):
        native.TensorPairs(dst, src).copy(torch.tensor([0, 1, 10]), torch.tensor([0, 1, 2]))
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


@needs_native
def test_a_plan_refuses_tensors_that_do_not_pair() -> None:
    with pytest.raises(ValueError, match="as many"):
        native.TensorPairs([rows(4, 16, 0)], [])
    with pytest.raises(ValueError, match="differ in size"):
        native.TensorPairs([rows(4, 16, 0)], [rows(4, 32, 0)])
    with pytest.raises(ValueError, match="row count"):
        native.TensorPairs([rows(4, 16, 0), rows(5, 16, 0)], [rows(4, 16, 0), rows(4, 16, 0)])
    with pytest.raises(ValueError, match="contiguous"):
        native.TensorPairs([rows(4, 16, 0).t()], [rows(16, 4, 0)])


def _copy_in_child(conn: object) -> None:
    src, dst = _tensor_set([64] * 4, 8, 3), _tensor_set([64] * 4, 8, 4)
    native.TensorPairs(dst, src).copy(torch.tensor([7, 0]), torch.tensor([1, 2]), num_threads=2)
    conn.send(all(torch.equal(d[7], s[1]) and torch.equal(d[0], s[2])  # type: ignore[attr-defined]
                  for d, s in zip(dst, src, strict=True)))


@needs_native
def test_a_forked_child_copies_serially(monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU OpenMP cannot run a parallel region in a forked child of a process that ran one
    (it hangs): a job in a child (a process pool's worker) runs serially and completes."""
    import multiprocessing

    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # every copy is split over threads

    src, dst = _tensor_set([64] * 4, 8, 1), _tensor_set([64] * 4, 8, 2)
    native.TensorPairs(dst, src).copy(torch.tensor([0, 1]), torch.tensor([2, 3]), num_threads=2)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_copy_in_child, args=(child,))
    proc.start()
    proc.join(timeout=30)
    assert proc.exitcode == 0 and parent.poll(1) and parent.recv() is True


@needs_native
def test_a_cpu_engine_runs_a_job_in_one_native_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine plans each direction once: a job over every KV tensor (here three, of
    different pages, 2 blocks per chunk, a first-chunk skip) is one call, byte-exact."""
    from kernels import CopyEngine, allocate_cpu_kv, allocate_gpu_kv
    from tests.kernel_oracle import oracle_load

    layout = KVLayout((16, 48, 256), 2)
    gpu = allocate_gpu_kv(layout, 12, "cpu")
    cpu = allocate_cpu_kv(layout, 8, pin=False)
    for i, t in enumerate((*gpu, *cpu)):
        t.copy_(rows(t.shape[0], t.shape[1], i))
    calls: list[int] = []
    real = native.TensorPairs.copy

    def counted(self: native.TensorPairs, *args: object, **kw: object) -> None:
        calls.append(self.num_tensors)
        real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native.TensorPairs, "copy", counted)
    store, load = TransferSpec([7, 2, 9], [5, 1], 1), TransferSpec([0, 4, 11], [3, 6], 1)
    want_cpu = oracle_store(gpu, cpu, store, 2)
    with CopyEngine(gpu, cpu, 2, "cpu") as engine:
        engine.submit_store(1, store)
        assert [r.success for r in engine.poll()] == [True]
        assert all(torch.equal(c, w) for c, w in zip(cpu, want_cpu, strict=True))
        want_gpu = oracle_load(gpu, cpu, load, 2)
        engine.submit_load(2, load)
        engine.poll()
    assert all(torch.equal(g, w) for g, w in zip(gpu, want_gpu, strict=True))
    assert calls == [3, 3]
