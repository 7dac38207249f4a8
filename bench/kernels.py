"""Throughput of the kernels layer's store/load jobs against two baselines.

For each GPU page size and job size (blocks per job), measured side by side in one run
(repetitions interleaved, median of several):

* ``job``: ``CopyEngine.submit_store/submit_load`` + completion (validation and planning
  included), with random GPU block ids and random CPU chunk ids, as in a running server;
  like the baselines, a sample issues its repetitions back to back and waits once at the end
  (a server keeps several jobs in flight, and the baselines' copies queue the same way);
* ``contig``: one ``copy_`` of the same number of bytes between contiguous buffers (the
  memory-bandwidth limit; pinned host memory <-> device on CUDA);
* ``loop``: one ``copy_`` per block from Python (``cpu[row].copy_(gpu[b])``; on CUDA issued
  ``non_blocking`` on a stream, a stand-in for one cudaMemcpyAsync per block).

On CUDA, per shape, the strategies side by side (to choose the policy by measurement): the
default (every job one ``cuMemcpyBatchAsync``, a descriptor per pair run and tensor), the
engine with the batched copy off (``unbatched``: index kernels over mapped host memory, or
one DMA per run), with vLLM's split for small loads (``split28k``: loads of pages under
28 KiB to index kernels), and ``vllm``: vLLM 0.33.0's op as its worker issues it
(``VllmOp``: a descriptor per block and tensor, built from the ids each job, one
``cuMemcpyBatchAsync`` on a side stream ordered after the compute stream and the previous
job; ``vllm/_custom_ops.py:3039-3065``, ``vllm/v1/kv_offload/cpu/gpu_worker.py:563-716``).

Then the jobs vLLM 0.33.0 produces (a request's store of 1, 4 or 16 new chunks over 32 or
64 layers, GQA K/V pages or an MLA latent page, one or two groups; a step's 64 requests
storing back to back), per job against one contiguous copy of the same bytes (and on CUDA
against ``VllmOp`` on the same jobs), and on the CPU the fixed cost of the smallest job in
microseconds.

Usage: ``python bench/kernels.py [--quick] [--json] [--bpc N] [--threads N] [--reps N]
[--budget S] [--device cpu|cuda|all] [--no-vllm]``. The default grid takes well under a
minute on an idle 2-core machine (``--budget`` bounds it on a busy one); ``--quick`` a few
seconds. Rows the host disturbed are flagged NOISY and left out of the targets. Timings are
reported here only; tests never look at them.
"""

from __future__ import annotations

import argparse
import array
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import callgrind  # bench/callgrind.py: this script's folder is still first on sys.path

# This file is named like the package it measures: make ``import kernels`` find the package
# (repository root), not this script (whose folder Python puts first on sys.path).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

from kernels import (  # noqa: E402
    CopyEngine,
    CopyPolicy,
    KernelSpecError,
    KVLayout,
    RowMapping,
    TransferSpec,
    allocate_cpu_kv,
    allocate_gpu_kv,
    block_rows,
    choose_strategy,
    cudriver,
)
from kernels.copy import BATCH_INDEX_BELOW  # noqa: E402
from kernels.descriptors import DescriptorPlan, Descriptors  # noqa: E402
from kernels.layout import RowIds  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
PAGES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
BLOCKS = [1, 8, 64, 256, 512, 4096]
QUICK_PAGES = [4 * KIB, 16 * KIB, 256 * KIB, 2 * MIB]
QUICK_BLOCKS = [64, 512]
BUFFER_CAP = 512 * MIB  # per buffer (GPU pool, CPU pool); pools hold 2x the job's blocks
# Small copies are repeated until one sample lasts at least this long. On CUDA a sample is
# longer: the first launch of a sample (Python planning before the first DMA is queued) is
# latency, not throughput, and must be small against the sample for every column alike.
MIN_SAMPLE_S = {"cpu": 0.003, "cuda": 0.02}
# Targets are judged on jobs of at least TARGET_MIN_BLOCKS blocks (smaller jobs are dominated by
# the fixed per-job cost of validation and planning); the bandwidth targets moreover on jobs of
# at least TARGET_MIN_BYTES, larger than a last-level cache, since only then does the
# contiguous copy measure memory bandwidth rather than cache bandwidth.
TARGET_MIN_BLOCKS = 64
TARGET_MIN_BYTES = 64 * MIB
STALL_MS = 0.5  # a 1 MiB host copy slower than this means the thread pool is stalling
NOISE_RATIO = 1.5  # a measurement whose median sample is this much slower than its best is noise


@dataclass
class Row:
    device: str
    page: int
    blocks: int
    job_mib: float
    contig_store: float
    contig_load: float
    job_store: float
    job_load: float
    loop_store: float
    loop_load: float
    strategy_store: str
    strategy_load: str
    noisy: bool = False  # the host disturbed this measurement (see NOISE_RATIO): left out
    variants: dict[str, tuple[float, float]] | None = None
    """CUDA: GB/s (store, load) of each strategy measured beside the default (STRATEGIES)."""

    @property
    def vs_contig(self) -> tuple[float, float]:
        return self.job_store / self.contig_store, self.job_load / self.contig_load

    @property
    def vs_loop(self) -> tuple[float, float]:
        return self.job_store / self.loop_store, self.job_load / self.loop_load


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nothing() -> None:
    pass


def _calibrate(fn: Callable[[], None], drain: Callable[[], None], device: torch.device) -> int:
    """Repetitions per sample so that one sample lasts at least MIN_SAMPLE_S[device]."""
    fn()
    drain()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    drain()
    _sync(device)
    once = time.perf_counter() - t0
    return max(1, min(1000, math.ceil(MIN_SAMPLE_S[device.type] / max(once, 1e-7))))


def _measure(fns: dict[str, Callable[[], None]], nbytes: int, reps: int,
             device: torch.device, deadline: float,
             drains: dict[str, Callable[[], None]] | None = None,
             ) -> tuple[dict[str, float], bool]:
    """GB/s of each function (repetitions interleaved across functions, median of ``reps``),
    and whether the run was noisy (some median sample > NOISE_RATIO x its best sample).
    ``drains[name]`` runs once after a sample's repetitions (inside the timed region)."""
    drain = {name: (drains or {}).get(name, _nothing) for name in fns}
    inner = {name: _calibrate(fn, drain[name], device) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            drain[name]()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / inner[name])
        if time.perf_counter() > deadline:  # a disturbed host: stop with fewer samples
            break
    noisy = any(statistics.median(s) > NOISE_RATIO * min(s) for s in samples.values())
    return {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}, noisy


class VllmOp:
    """vLLM 0.33.0's batched op as its offloading worker issues it, over one worker's tensors:
    per job, the ids made a spec, a descriptor per block and KV tensor
    (``vllm/v1/kv_offload/cpu/gpu_worker.py:407-447``), one ``cuMemcpyBatchAsync`` on a side
    stream that waits for the compute stream and for the previous job (stores in stream
    order, loads in any order: ``gpu_worker.py:700-716``) between a start and an end event
    (timing events from a pool, as vLLM's). :meth:`drain` completes the jobs as vLLM's
    ``get_finished`` does, each end event queried and each job's time read
    (``vllm/v1/kv_offload/cpu/gpu_worker.py:735-757``). The descriptors are built as this
    project builds them (in one compiled call), not with vLLM's numpy loop over the tensors:
    a baseline no slower than vLLM's own."""

    def __init__(self, gpu: list[torch.Tensor], cpu: list[torch.Tensor], bpc: int,
                 device: torch.device) -> None:
        op = cudriver.batch_copy()
        if op is None:
            raise RuntimeError(f"no batched copy: {cudriver.unavailable_reason()}")
        self.op, self.device, self.bpc = op, device, bpc
        sub_rows = [c.view(-1, g.shape[1]) for g, c in zip(gpu, cpu, strict=True)]
        self.store_plan = DescriptorPlan(sub_rows, gpu)
        self.load_plan = DescriptorPlan(gpu, sub_rows)
        self.num_blocks, self.num_chunks = int(gpu[0].shape[0]), int(cpu[0].shape[0])
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.attrs = {True: op.attributes(cudriver.SrcAccessOrder.STREAM, index, True),
                      False: op.attributes(cudriver.SrcAccessOrder.ANY, index, False)}
        self.stream = torch.cuda.Stream(device)
        self.last: torch.cuda.Event | None = None
        self.kept: list[Descriptors] = []
        self.events: list[torch.cuda.Event] = []
        self.jobs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self) -> torch.cuda.Event:
        return self.events.pop() if self.events else torch.cuda.Event(enable_timing=True)

    def submit(self, store: bool, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        g, c = block_rows(TransferSpec(gpu_ids, cpu_ids), self.bpc, self.num_blocks,
                          self.num_chunks)
        batch = (self.store_plan.descriptors(c, g, rows_checked=True) if store  # as vLLM's
                 else self.load_plan.descriptors(g, c, rows_checked=True))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.last is not None:
            self.stream.wait_event(self.last)
        start, end = self._event(), self._event()
        start.record(self.stream)
        self.op(batch, self.stream.cuda_stream, self.attrs[store])
        end.record(self.stream)
        self.last = end
        self.jobs.append((start, end))
        self.kept.append(batch)

    def drain(self) -> None:
        if self.last is not None:
            self.last.synchronize()
        for start, end in self.jobs:
            assert end.query()
            start.elapsed_time(end)
            self.events += (start, end)
        self.last = None
        self.jobs.clear()
        self.kept.clear()


STRATEGIES = {  # CUDA policies measured beside the default (every job batched), per shape
    "unbatched": lambda mapped: replace(CopyPolicy.for_device(torch.device("cuda"), mapped),
                                        batch_dma=False),  # index kernels or a DMA per run
    "split28k": lambda mapped: replace(CopyPolicy.for_device(torch.device("cuda"), mapped),
                                       batch_index_below=BATCH_INDEX_BELOW),  # vLLM's split
}


def bench_one(device: torch.device, page: int, n: int, bpc: int, reps: int,
              seed: int, deadline: float) -> Row:
    gen = torch.Generator().manual_seed(seed)
    pool = 2 * n
    num_chunks = math.ceil(pool / bpc) + 1
    layout = KVLayout((page,), bpc)
    gpu = allocate_gpu_kv(layout, pool, device)
    cpu = allocate_cpu_kv(layout, num_chunks, pin=device.type == "cuda")
    gpu[0].fill_(1)  # first touch, outside the timed region
    cpu[0].fill_(2)
    gpu_ids = torch.randperm(pool, generator=gen)[:n].tolist()
    chunk_ids = torch.randperm(num_chunks, generator=gen)[:math.ceil(n / bpc)].tolist()
    spec = TransferSpec(gpu_ids, chunk_ids, 0)
    engine = CopyEngine(gpu, cpu, bpc, device)
    job_ids = itertools.count()

    def job(submit: Callable[[int, TransferSpec], None]) -> Callable[[], None]:
        def run() -> None:
            submit(next(job_ids), spec)
        return run

    nbytes = n * page
    gpu_flat, cpu_flat = gpu[0].view(-1)[:nbytes], cpu[0].view(-1)[:nbytes]
    gpu_blocks, sub_rows = gpu[0], cpu[0].view(-1, page)
    gpu_rows, cpu_rows = block_rows(spec, bpc, pool, num_chunks)
    pairs = list(zip(gpu_ids, cpu_rows.tolist(), strict=True))
    non_blocking = device.type == "cuda"
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def loop(store: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if store:
                    for b, r in pairs:
                        sub_rows[r].copy_(gpu_blocks[b], non_blocking=non_blocking)
                else:
                    for b, r in pairs:
                        gpu_blocks[b].copy_(sub_rows[r], non_blocking=non_blocking)
        return run

    def contig_store() -> None:
        cpu_flat.copy_(gpu_flat, non_blocking=non_blocking)

    def contig_load() -> None:
        gpu_flat.copy_(cpu_flat, non_blocking=non_blocking)

    fns: dict[str, Callable[[], None]] = {
        "contig_store": contig_store,
        "contig_load": contig_load,
        "job_store": job(engine.submit_store),
        "job_load": job(engine.submit_load),
        "loop_store": loop(True),
        "loop_load": loop(False),
    }
    drains = {"job_store": _drain(engine), "job_load": _drain(engine)}
    others: dict[str, CopyEngine] = {}
    if device.type == "cuda" and cudriver.batch_copy() is not None:
        for name, policy in STRATEGIES.items():
            other = CopyEngine(gpu, cpu, bpc, device, policy=policy(engine.host_mapped))
            others[name] = other
            for direction, submit in (("store", other.submit_store), ("load", other.submit_load)):
                fns[f"{name}_{direction}"] = job(submit)
                drains[f"{name}_{direction}"] = _drain(other)
        vllm = VllmOp(gpu, cpu, bpc, device)
        for store in (True, False):
            key = f"vllm_{'store' if store else 'load'}"
            fns[key] = functools.partial(vllm.submit, store, gpu_ids, chunk_ids)
            drains[key] = vllm.drain
    measured, noisy = _measure(fns, nbytes, reps, device, deadline, drains)
    gbps = {k: v for k, v in measured.items() if k.split("_")[0] in ("contig", "job", "loop")}
    variants = {name: (measured[f"{name}_store"], measured[f"{name}_load"])
                for name in (*others, "vllm") if f"{name}_store" in measured} or None
    for other in others.values():
        other.shutdown()
    # check (whatever the buffers hold now): after a store, every job block equals its sub-row
    engine.submit_store(next(job_ids), spec)
    engine.wait(engine.in_flight())
    engine.poll()
    _sync(device)
    assert torch.equal(sub_rows[cpu_rows], gpu_blocks[gpu_rows.to(device)].cpu())
    if "vllm" in (variants or {}):  # and vLLM's op, on a fresh pattern
        gpu_blocks.copy_(torch.randint(-128, 128, gpu_blocks.shape, dtype=torch.int8,
                                       generator=gen).to(device))
        vllm.submit(True, gpu_ids, chunk_ids)
        vllm.drain()
        assert torch.equal(sub_rows[cpu_rows], gpu_blocks[gpu_rows.to(device)].cpu())
    engine.shutdown()
    store_map = RowMapping(gpu_rows, cpu_rows)
    return Row(
        device=device.type, page=page, blocks=n, job_mib=nbytes / MIB,
        strategy_store=choose_strategy(store_map, page, engine.policy).value,
        strategy_load=choose_strategy(store_map.inverse(), page, engine.policy, load=True).value,
        noisy=noisy, variants=variants, **gbps,
    )


def _drain(engine: CopyEngine) -> Callable[[], None]:
    """Complete every job in flight on ``engine``; each must have succeeded."""
    def drain() -> None:
        engine.wait(engine.in_flight())
        assert all(r.success for r in engine.poll())
    return drain


def _fmt_size(page: int) -> str:
    return f"{page // MIB}M" if page >= MIB else f"{page // KIB}K"


def print_table(rows: list[Row], skipped: list[tuple[int, int]],
                no_time: list[tuple[int, int]]) -> None:
    head = (f"{'page':>5} {'blocks':>6} {'MiB':>7} | {'contig S/L GB/s':>15} | "
            f"{'job S/L GB/s':>13} | {'loop S/L GB/s':>13} | {'job/contig S/L':>14} | "
            f"{'job/loop S/L':>13} | strategy S/L")
    print(head)
    print("-" * len(head))
    for r in rows:
        cs, cl = r.vs_contig
        ls, ll = r.vs_loop
        print(f"{_fmt_size(r.page):>5} {r.blocks:>6} {r.job_mib:>7.2f} | "
              f"{r.contig_store:>7.2f} {r.contig_load:>7.2f} | "
              f"{r.job_store:>6.2f} {r.job_load:>6.2f} | "
              f"{r.loop_store:>6.2f} {r.loop_load:>6.2f} | "
              f"{cs:>6.2f} {cl:>7.2f} | {ls:>6.1f}x {ll:>5.1f}x | "
              f"{r.strategy_store}/{r.strategy_load}{'  NOISY' if r.noisy else ''}")
    if any(r.noisy for r in rows):
        print(f"NOISY: the host disturbed these measurements (some median sample > "
              f"{NOISE_RATIO}x the best, or a 1 MiB copy right after took > {STALL_MS} ms: busy "
              "CPUs, stalled threads); they are left out of the targets. Rerun on a quiet "
              "machine (or with --threads 1).")
    if skipped:
        print("skipped (a pool of 2x the job's blocks would exceed "
              f"{BUFFER_CAP // MIB} MiB per buffer): "
              + ", ".join(f"{_fmt_size(p)}x{n}" for p, n in skipped))
    if no_time:
        print("not measured (time budget spent, or the host stalled; see --budget): "
              + ", ".join(f"{_fmt_size(p)}x{n}" for p, n in no_time))


def print_strategies(rows: list[Row]) -> None:
    """CUDA: each strategy's GB/s per shape beside the default, and the fastest."""
    measured = [r for r in rows if r.variants]
    if not measured:
        return
    names = ["default", *(measured[0].variants or {})]
    print("\nstrategies per shape (GB/s store/load; default = the engine's own choice, "
          "vllm = vLLM's op; * = fastest):")
    print(f"{'page':>5} {'blocks':>6} | " + " | ".join(f"{n:>15}" for n in names)
          + " | fastest S/L")
    for r in measured:
        each = {"default": (r.job_store, r.job_load), **(r.variants or {})}
        best = [max(each, key=lambda n, d=d: each[n][d]) for d in (0, 1)]
        cells = [f"{each[n][0]:>6.2f}{'*' if best[0] == n else ' '} "
                 f"{each[n][1]:>6.2f}{'*' if best[1] == n else ' '}" for n in names]
        print(f"{_fmt_size(r.page):>5} {r.blocks:>6} | " + " | ".join(cells)
              + f" | {best[0]}/{best[1]}{'  NOISY' if r.noisy else ''}")


@dataclass
class Target:
    device: str
    name: str
    met: bool | None  # None: not judged (no clean measurement of that kind)
    detail: str


def check_targets(device: str, rows: list[Row]) -> list[Target]:
    big = [r for r in rows if r.blocks >= TARGET_MIN_BLOCKS and not r.noisy]
    large = [r for r in big if r.job_mib * MIB >= TARGET_MIN_BYTES]
    targets: list[Target] = []

    def add(name: str, sel: list[Row], ok: Callable[[Row], bool],
            show: Callable[[Row], str]) -> None:
        if not sel:
            targets.append(Target(device, name, None, "no clean measurement"))
            return
        detail = ", ".join(f"{_fmt_size(r.page)}x{r.blocks}: {show(r)}" for r in sel)
        targets.append(Target(device, name, all(ok(r) for r in sel), detail))

    def contig(r: Row) -> str:
        return "S {:.2f} L {:.2f}".format(*r.vs_contig)

    def loop(r: Row) -> str:
        return "S {:.1f}x L {:.1f}x".format(*r.vs_loop)

    if device == "cpu":
        add(">= 0.8 of contiguous at >= 256 KiB", [r for r in large if r.page >= 256 * KIB],
            lambda r: min(r.vs_contig) >= 0.8, contig)
        add(">= 10x the per-block loop at 4 KiB", [r for r in big if r.page == 4 * KIB],
            lambda r: min(r.vs_loop) >= 10.0, loop)
    else:
        add(">= 0.9 of contiguous pinned copy at 2 MiB",
            [r for r in large if r.page == 2 * MIB],
            lambda r: min(r.vs_contig) >= 0.9, contig)
        add("faster than per-block copies at 16 KiB", [r for r in big if r.page == 16 * KIB],
            lambda r: min(r.vs_loop) > 1.0, loop)
    return targets


def parallel_copy_ms() -> float:
    """Time of a 1 MiB host copy (~0.03 ms normally; the worse of the median and a quarter of
    the slowest of 21). On a busy machine, or a VM whose second vCPU is descheduled, every
    intra-op parallel region can stall for milliseconds; timings taken then are noise."""
    src = torch.ones(1 << 20, dtype=torch.int8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), max(times) / 4) * 1e3


def _wait_for_quiet(deadline: float) -> bool:
    """Whether the host's thread pool runs normally, waiting for it until ``deadline``."""
    while parallel_copy_ms() > STALL_MS:
        if time.perf_counter() + 1.0 > deadline:
            return False
        time.sleep(1.0)
    return True


def run_device(device: torch.device, pages: list[int], blocks: list[int], bpc: int,
               reps: int, deadline: float, verbose: bool
               ) -> tuple[list[Row], list[tuple[int, int]], list[tuple[int, int]]]:
    """Rows measured, combinations over the buffer cap, combinations not measured (time budget
    spent, or the host stalled until the deadline)."""
    rows: list[Row] = []
    over_cap: list[tuple[int, int]] = []
    no_time: list[tuple[int, int]] = []
    for page in pages:
        for n in blocks:
            if 2 * n * page > BUFFER_CAP:
                over_cap.append((page, n))
                continue
            if time.perf_counter() > deadline:
                no_time.append((page, n))
                continue
            if not _wait_for_quiet(deadline):  # measuring while stalled takes ages, for noise
                no_time.append((page, n))
                continue
            row = bench_one(device, page, n, bpc, reps, seed=page + n,
                            deadline=deadline + 10.0)
            row.noisy = row.noisy or parallel_copy_ms() > STALL_MS
            rows.append(row)
            if verbose:
                print(f"  measured {_fmt_size(page)} x {n}", file=sys.stderr, flush=True)
    return rows, over_cap, no_time


# -- vLLM-shaped jobs -------------------------------------------------------------------------
# What vLLM 0.33.0's offloading worker submits: a store of a request's new full chunks (or a
# load of its hit) over every layer of a KV cache group, one job per group; blocks_per_chunk 1
# (vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py:121). Pages of real
# models: 8 KV heads x 128 dims x 16 tokens in bf16 (K and V: two tensors per layer), and an
# MLA-style single latent page of 576 dims x 16 tokens in bf16 (one tensor per layer).
VLLM_PAGES = {"gqa 8x128": (8 * 128 * 16 * 2, 2), "mla 576": (576 * 16 * 2, 1)}
VLLM_SHAPES = [  # (page, layers, groups, chunks)
    ("gqa 8x128", 32, 1, 1), ("gqa 8x128", 32, 1, 4), ("gqa 8x128", 32, 1, 16),
    ("gqa 8x128", 64, 1, 4), ("gqa 8x128", 64, 2, 4), ("mla 576", 32, 1, 4),
    ("mla 576", 64, 1, 16),
]
STEP_REQUESTS = 64
CPU = torch.device("cpu")


@dataclass
class VllmRow:
    device: str
    shape: str
    layers: int
    groups: int
    chunks: int
    jobs: int
    job_kib: float
    job_us: float
    contig_us: float
    vllm_us: float | None = None
    """CUDA: vLLM's batched op on the same jobs (VllmOp)."""

    @property
    def vs_contig(self) -> float:
        return self.contig_us / self.job_us

    @property
    def vs_vllm(self) -> float | None:
        return None if self.vllm_us is None else self.vllm_us / self.job_us


def _engines(page: int, tensors: int, groups: int, pool: int,
             device: torch.device) -> tuple[list[CopyEngine], list[VllmOp]]:
    """One engine per KV cache group over its share of the tensors (a worker's view), and on
    CUDA vLLM's op over the same tensors."""
    per = tensors // groups
    out, ops = [], []
    for _ in range(groups):
        layout = KVLayout((page,) * per, 1)
        gpu = allocate_gpu_kv(layout, pool, device)
        cpu = allocate_cpu_kv(layout, pool, pin=device.type == "cuda")
        for t in (*gpu, *cpu):
            t.fill_(1)  # first touch, outside the timed region
        out.append(CopyEngine(gpu, cpu, 1, device))
        if device.type == "cuda" and cudriver.batch_copy() is not None:
            ops.append(VllmOp(gpu, cpu, 1, device))
    return out, ops


def bench_vllm_jobs(shape: str, layers: int, groups: int, chunks: int, jobs: int,
                    reps: int, seed: int, device: torch.device = CPU) -> VllmRow:
    """`jobs` requests each store `chunks` new chunks (one job per group each), issued back to
    back and then completed, against one contiguous copy of the same bytes (device to pinned
    host memory on CUDA). A job's time includes building its TransferSpec from the block and
    chunk ids, as a worker does."""
    page, per_layer = VLLM_PAGES[shape]
    tensors = layers * per_layer
    pool = 2 * chunks * jobs + 1
    engines, ops = _engines(page, tensors, groups, pool, device)
    gen = torch.Generator().manual_seed(seed)
    ids = [(torch.randperm(pool, generator=gen)[:chunks].tolist(),
            torch.randperm(pool, generator=gen)[:chunks].tolist()) for _ in range(jobs)]
    counter = itertools.count()
    nbytes = jobs * chunks * page * tensors
    src = torch.ones(nbytes, dtype=torch.int8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.int8, pin_memory=device.type == "cuda")
    non_blocking = device.type == "cuda"

    def run_jobs() -> None:
        for gpu_ids, cpu_ids in ids:
            for e in engines:
                e.submit_store(next(counter), TransferSpec(gpu_ids, cpu_ids))
        for e in engines:
            _drain(e)()

    def contig() -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def run_vllm() -> None:
        for gpu_ids, cpu_ids in ids:
            for op in ops:
                op.submit(True, gpu_ids, cpu_ids)
        for op in ops:
            op.drain()

    fns = {"job": run_jobs, "contig": contig, **({"vllm": run_vllm} if ops else {})}
    gbps, _ = _measure(fns, nbytes, reps, device, time.perf_counter() + 60.0)
    n_jobs = jobs * groups

    def us(name: str) -> float:
        return nbytes / gbps[name] / 1e3 / n_jobs

    return VllmRow(device.type, shape, layers, groups, chunks, n_jobs, nbytes / n_jobs / KIB,
                   us("job"), us("contig"), us("vllm") if ops else None)


def smallest_jobs(blocks_per_chunk: int = 1) -> Callable[[int], None]:
    """A run of `n` smallest jobs: one chunk of `blocks_per_chunk` blocks (one block by
    default) of a 16-byte page, one tensor, each job's TransferSpec built, submitted, run and
    polled (the bytes cost nothing there)."""
    layout = KVLayout((16,), blocks_per_chunk)
    engine = CopyEngine(allocate_gpu_kv(layout, 8 + blocks_per_chunk, "cpu"),
                        allocate_cpu_kv(layout, 8, pin=False), blocks_per_chunk, "cpu")
    counter = itertools.count()
    blocks = list(range(3, 3 + blocks_per_chunk))

    def run(n: int) -> None:
        for _ in range(n):
            engine.submit_store(next(counter), TransferSpec(blocks, [5]))
            engine.poll()
    return run


CHUNK_BLOCKS = 4
"""The blocks of the one-chunk job whose fixed cost is reported beside the smallest job's
(vLLM offloads in chunks of several GPU blocks; no target)."""


def fixed_cost_us(reps: int, blocks_per_chunk: int = 1) -> float:
    """Microseconds per job for the smallest job of one chunk (`smallest_jobs`), median of
    `reps` samples of 1,000 jobs."""
    run, batch = smallest_jobs(blocks_per_chunk), 1000

    def sample() -> float:
        t0 = time.perf_counter()
        run(batch)
        return (time.perf_counter() - t0) / batch * 1e6

    sample()
    return statistics.median(sample() for _ in range(reps))


FEW, MANY = 1_000, 3_000
"""The smallest jobs a process runs under callgrind for `fixed_cost_instructions`."""


def fixed_cost_instructions() -> float:
    """Instructions per smallest job, every thread's, counted by callgrind: two processes run
    FEW and MANY jobs after the same start (interpreter, torch, engine), and the difference
    of their counts is divided by the jobs between. The same from run to run, where the
    wall-clock fixed cost on this VM swings by a factor of two or more."""
    command = [sys.executable, str(Path(__file__).resolve()), "--smallest-jobs"]

    def count(n: int) -> int:
        with callgrind.profile([*command, str(n)], _HERE.parent) as (_, counts):
            return callgrind.total_instructions(counts)

    with ThreadPoolExecutor(2) as pool:
        few, many = pool.map(count, (FEW, MANY))
    return (many - few) / (MANY - FEW)


def descriptor_cost_us(reps: int) -> dict[str, float]:
    """Microseconds to build a batched job's descriptors (a store of 4 blocks over 64 tensors
    of 32 KiB pages, rows already checked), by the compiled builder and by tensor ops, one
    per row (vLLM's form) and one per run: the host's share of a batched job on CUDA. The
    rows are tensors, and for the compiled builder also arrays, as the engine holds a short
    job's rows (`kernels.layout.block_row_ids`)."""
    tensors = [torch.empty(64, 32 * KIB, dtype=torch.int8) for _ in range(128)]
    gen = torch.Generator().manual_seed(0)
    rows: list[tuple[RowIds, RowIds]] = [
        (torch.randperm(64, generator=gen)[:4], torch.randperm(64, generator=gen)[:4])
        for _ in range(50)]
    held: list[tuple[RowIds, RowIds]] = [
        (array.array("q", d.tolist()), array.array("q", s.tolist())) for d, s in rows]
    out: dict[str, float] = {}
    for compiled, form, pairs in ((True, "", rows), (True, " as arrays", held),
                                  (False, "", rows)):
        try:
            plan = DescriptorPlan(tensors[:64], tensors[64:], compiled=compiled)
        except KernelSpecError:  # no compiled builder here
            continue
        for merge in (False, True):
            def sample(plan: DescriptorPlan = plan, merge: bool = merge,
                       pairs: list[tuple[RowIds, RowIds]] = pairs) -> float:
                t0 = time.perf_counter()
                for i in range(1000):
                    plan.descriptors(*pairs[i % 50], merge_runs=merge, rows_checked=True)
                return (time.perf_counter() - t0) / 1000 * 1e6
            sample()
            key = (f"{'compiled' if compiled else 'tensor ops'}, {'runs' if merge else 'rows'}"
                   f"{form}")
            out[key] = statistics.median(sample() for _ in range(reps))
    return out


def print_vllm(rows: list[VllmRow], fixed_us: float | None,
               chunk_us: float | None = None) -> None:
    device = rows[0].device if rows else "-"
    print(f"\n== vLLM-shaped store jobs ({device}, blocks_per_chunk 1): time per job, and one "
          "contiguous copy of the same bytes")
    vllm = any(r.vllm_us is not None for r in rows)
    print(f"{'page':>10} {'layers':>6} {'groups':>6} {'chunks':>6} {'jobs':>5} "
          f"{'KiB/job':>8} {'us/job':>9} {'contig us':>9} {'vs contig':>9}"
          + (f" {'vllm us':>9} {'vs vllm':>8}" if vllm else ""))
    for r in rows:
        print(f"{r.shape:>10} {r.layers:6} {r.groups:6} {r.chunks:6} {r.jobs:5} "
              f"{r.job_kib:8.0f} {r.job_us:9.1f} {r.contig_us:9.1f} {r.vs_contig:9.2f}"
              + (f" {r.vllm_us:9.1f} {r.vs_vllm:7.2f}x" if r.vllm_us is not None
                 and r.vs_vllm is not None else ""))
    if fixed_us is not None:
        print(f"fixed cost of the smallest job (1 block of 16 bytes, 1 tensor, spec built, "
              f"submitted, run, polled): {fixed_us:.1f} us")
    if chunk_us is not None:
        print(f"fixed cost of a job of one chunk ({CHUNK_BLOCKS} blocks of 16 bytes, "
              f"blocks_per_chunk {CHUNK_BLOCKS}): {chunk_us:.1f} us")


def vllm_gpu_targets(rows: list[VllmRow]) -> list[Target]:
    """CUDA: at least vLLM's own batched op on every vLLM-shaped job, and 0.8 of one
    contiguous pinned copy on those of 4 MiB and more."""
    versus = [r for r in rows if r.vs_vllm is not None]
    large = [r for r in rows if r.job_kib * KIB >= 4 * MIB]

    def show(sel: list[VllmRow], value: Callable[[VllmRow], float]) -> str:
        return ", ".join(f"{r.shape} {r.layers}L {r.chunks}c x{r.jobs}: {value(r):.2f}"
                         for r in sel) or "not measured"

    return [
        Target("cuda", ">= 1.0x vLLM's batched op on every vLLM-shaped job",
               all((r.vs_vllm or 0.0) >= 1.0 for r in versus) if versus else None,
               show(versus, lambda r: r.vs_vllm or 0.0)),
        Target("cuda", ">= 0.8 of a contiguous pinned copy on jobs of >= 4 MiB",
               all(r.vs_contig >= 0.8 for r in large) if large else None,
               show(large, lambda r: r.vs_contig)),
    ]


def vllm_targets(rows: list[VllmRow], fixed_us: float) -> list[Target]:
    four = [r for r in rows if (r.shape, r.layers, r.groups, r.chunks, r.jobs) ==
            ("gqa 8x128", 32, 1, 4, 1)]
    return [
        Target("cpu", "smallest job's fixed cost <= 15 us", fixed_us <= 15.0,
               f"{fixed_us:.1f} us"),
        Target("cpu", ">= 0.6 of contiguous: store of 4 chunks over 32 layers",
               all(r.vs_contig >= 0.6 for r in four) if four else None,
               ", ".join(f"{r.vs_contig:.2f}" for r in four) or "not measured"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (< 30 s)")
    parser.add_argument("--json", action="store_true", help="print JSON results only")
    parser.add_argument("--bpc", type=int, default=1, help="GPU blocks per CPU chunk")
    parser.add_argument("--reps", type=int, default=None, help="samples per measurement")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no new measurement starts "
                        "(default 150, --quick 20)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's default)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="leave out the vLLM-shaped jobs and the fixed-cost figure")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                        help="all: cpu, and cuda when available")
    parser.add_argument("--instructions", action="store_true",
                        help="only the smallest job's fixed cost in instructions, under "
                        "valgrind's callgrind (a few minutes)")
    parser.add_argument("--smallest-jobs", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smallest_jobs is not None:  # a process that fixed_cost_instructions counts
        smallest_jobs()(args.smallest_jobs)
        return 0
    if args.instructions:
        why = callgrind.missing()
        if why:
            print(f"--instructions needs callgrind: {why}", file=sys.stderr)
            return 1
        per_job = fixed_cost_instructions()
        print(json.dumps({"fixed_cost_instructions": per_job}) if args.json else
              f"fixed cost of the smallest job: {per_job / 1000:.1f}k instructions "
              f"(callgrind, every thread; {MANY:,} jobs against {FEW:,})")
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pages = QUICK_PAGES if args.quick else PAGES
    blocks = QUICK_BLOCKS if args.quick else BLOCKS
    reps = args.reps if args.reps is not None else (3 if args.quick else 7)
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    if args.device == "cuda" and not devices:
        print("no CUDA device", file=sys.stderr)
        return 1

    t0 = time.perf_counter()
    stall_ms = parallel_copy_ms()
    load = os.getloadavg()[0]
    if not args.json:
        if stall_ms > STALL_MS:
            print(f"WARNING: a 1 MiB host copy takes {stall_ms:.1f} ms (expected ~0.03 ms): the "
                  "CPUs are busy or the intra-op thread pool stalls; results will be noise. "
                  "Rerun later (or with --threads 1).", file=sys.stderr)
        if load > 0.5:
            print(f"WARNING: load average {load:.1f} before the run: other processes compete "
                  "for the CPUs and memory bandwidth.", file=sys.stderr)
    report: dict[str, object] = {
        "parallel_copy_ms": stall_ms,
        "load_average": load,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "bpc": args.bpc,
        "reps": reps, "buffer_cap_mib": BUFFER_CAP // MIB,
        "target_min_blocks": TARGET_MIN_BLOCKS, "target_min_mib": TARGET_MIN_BYTES // MIB,
        "devices": {},
    }
    all_targets: list[Target] = []
    for device in devices:
        budget = args.budget if args.budget is not None else (20.0 if args.quick else 150.0)
        deadline = t0 + budget * (devices.index(device) + 1) / len(devices)
        rows, skipped, no_time = run_device(device, pages, blocks, args.bpc, reps, deadline,
                                            not args.json)
        targets = check_targets(device.type, rows)
        all_targets += targets
        report["devices"][device.type] = {  # type: ignore[index]
            "rows": [asdict(r) | {"job_vs_contig": r.vs_contig, "job_vs_loop": r.vs_loop}
                     for r in rows],
            "skipped": [{"page": p, "blocks": n} for p, n in skipped],
            "not_measured": [{"page": p, "blocks": n} for p, n in no_time],
            "targets": [asdict(t) for t in targets],
        }
        if not args.json:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"\n== {device} ({name}), torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads, {args.bpc} blocks per chunk, "
                  f"median of {reps}; S = store (GPU->CPU), L = load (CPU->GPU)")
            print_table(rows, skipped, no_time)
            print_strategies(rows)
            print(f"targets (jobs of >= {TARGET_MIN_BLOCKS} blocks; bandwidth targets on jobs "
                  f"of >= {TARGET_MIN_BYTES // MIB} MiB):")
            for t in targets:
                verdict = "n/a" if t.met is None else "met" if t.met else "NOT MET"
                print(f"  [{verdict}] {t.name}: {t.detail}")
    vllm_report: dict[str, object] = {}
    report["vllm_shaped"] = vllm_report
    for device in [] if args.no_vllm else devices:
        vrows = [bench_vllm_jobs(shape, layers, groups, chunks, 1, reps, seed=i, device=device)
                 for i, (shape, layers, groups, chunks) in enumerate(VLLM_SHAPES)]
        vrows.append(bench_vllm_jobs("gqa 8x128", 32, 1, 1, STEP_REQUESTS, reps, seed=99,
                                     device=device))
        # the CPU targets; on CUDA the targets compare with vLLM's batched op
        fixed = fixed_cost_us(reps) if device.type == "cpu" else None
        chunk = fixed_cost_us(reps, CHUNK_BLOCKS) if device.type == "cpu" else None
        build = descriptor_cost_us(reps)
        vtargets = vllm_targets(vrows, fixed) if fixed is not None else vllm_gpu_targets(vrows)
        all_targets += vtargets
        vllm_report[device.type] = {
            "rows": [asdict(r) | {"vs_contig": r.vs_contig, "vs_vllm": r.vs_vllm}
                     for r in vrows],
            "fixed_cost_us": fixed, "chunk_fixed_cost_us": chunk, "descriptor_us": build,
            "targets": [asdict(t) for t in vtargets]}
        if not args.json:
            print_vllm(vrows, fixed, chunk)
            print("descriptors of a batched store of 4 blocks over 64 tensors: "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in build.items()))
            for t in vtargets:
                verdict = "n/a" if t.met is None else "met" if t.met else "NOT MET"
                print(f"  [{verdict}] {t.name}: {t.detail}")
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"\ntotal {report['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
