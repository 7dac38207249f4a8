"""The worker table drives the copy kernels: a copy is launched only on entering SUBMITTED,
observed only when polled; flushes are waited for before the step's loads; failures and
hangs are injected per rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import spec
from spec import worker as W
from statemachine.errors import IllegalTransition
from statemachine.messages import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    OffloadingConnectorMetadata,
    TransferJob,
)
from statemachine.worker import Worker, WorkerError
from statemachine.worker import aggregate as aggregate_reports

from kernels import KVLayout  # isort: skip

LAYOUT = KVLayout((32, 16), blocks_per_chunk=2)


def make_worker(rank: int = 0) -> Worker:
    w = Worker(rank, LAYOUT, num_gpu_blocks=8, num_cpu_chunks=4, device="cpu")
    for t, gpu in enumerate(w.gpu):
        for b in range(gpu.shape[0]):
            gpu[b].fill_(10 * b + t + 1)
    for t, cpu in enumerate(w.cpu):
        for c in range(cpu.shape[0]):
            cpu[c].fill_(-(10 * c + t + 1))
    w.record_fired = True
    return w


def store(req: str, blocks: tuple[int, ...], chunks: tuple[int, ...], first: int = 0) \
        -> TransferJob:
    return TransferJob(req, GPULoadStoreSpec(blocks, first), CPULoadStoreSpec(chunks))


def load(req: str, chunks: tuple[int, ...], blocks: tuple[int, ...], sync: bool = False) \
        -> TransferJob:
    return TransferJob(req, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks, 0), sync)


def meta(loads: dict[int, TransferJob] | None = None, stores: dict[int, TransferJob] | None
         = None, flush: frozenset[int] = frozenset()) -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(dict(loads or {}), dict(stores or {}), flush)


def run_step(w: Worker, m: OffloadingConnectorMetadata) -> Any:
    w.handle_preemptions(m)
    w.start_kv_transfers(m)
    w.prepare_store_kv(m)
    return w.get_finished()


def chunk_rows(w: Worker, chunk: int, t: int = 0) -> torch.Tensor:
    page = LAYOUT.page_bytes[t]
    return w.cpu[t].view(-1, page)[chunk * 2:(chunk + 1) * 2]


def test_the_worker_machine_is_a_spec_machine() -> None:
    assert spec.WORKER_MACHINE in spec.MACHINES
    assert set(spec.WORKER_MACHINE.state_names) == {
        "QUEUED", "SUBMITTED", "FLUSHED", "COPIED", "REPORTED", "FAILED"}


def test_a_copy_is_launched_only_on_entering_submitted(monkeypatch: pytest.MonkeyPatch) -> None:
    w = make_worker()
    launched: list[tuple[str, int, str]] = []
    for name in ("submit_store", "submit_load"):
        original = getattr(w.engine, name)

        def spy(job_id: int, ts: Any, _orig: Any = original, _name: str = name) -> None:
            launched.append((_name, job_id, w.jobs[job_id].state))
            _orig(job_id, ts)

        monkeypatch.setattr(w.engine, name, spy)
    m0 = meta(stores={1: store("a", (0, 1), (0,))})
    w.handle_preemptions(m0)
    w.start_kv_transfers(m0)
    w.prepare_store_kv(m0)  # queued: nothing launched in the step that created it
    assert launched == [] and w.states() == {1: W.QUEUED}
    assert w.get_finished().meta is None
    m1 = meta(loads={2: load("b", (1,), (4, 5))})
    w.handle_preemptions(m1)
    w.start_kv_transfers(m1)  # last step's store first, then the load
    assert launched == [("submit_store", 1, W.SUBMITTED), ("submit_load", 2, W.SUBMITTED)]
    submits = [f for f in w.fired if f.trigger == "submit"]
    assert [(f.key, f.source, f.dest) for f in submits] == [
        (1, W.QUEUED, W.SUBMITTED), (2, W.QUEUED, W.SUBMITTED)]


def test_completion_is_observed_only_when_polled() -> None:
    w = make_worker()
    m = meta(stores={1: store("a", (2, 3), (1,))})
    run_step(w, m)
    run_step(w, meta())  # no wait: the next start_kv_transfers submits it
    assert 1 not in w.jobs
    before = chunk_rows(w, 1).clone()
    w2 = make_worker()
    run_step(w2, m)
    w2.handle_preemptions(meta())
    w2.start_kv_transfers(meta())
    assert w2.states() == {1: W.SUBMITTED}
    assert torch.equal(chunk_rows(w2, 1), chunk_rows(make_worker(), 1))  # not copied yet
    report = w2.get_finished()
    assert report.meta is not None and report.meta.completed_jobs == {1: 1}
    assert w2.states() == {}
    assert torch.equal(chunk_rows(w2, 1), before)
    assert torch.equal(chunk_rows(w2, 1)[0], w2.gpu[0][2]) and torch.equal(
        chunk_rows(w2, 1)[1], w2.gpu[0][3])
    trail = [(f.trigger, f.dest) for f in w2.fired if f.key == 1]
    assert trail == [("submit", W.SUBMITTED), ("copy_done", W.COPIED),
                     ("report", W.REPORTED)]


def test_a_flush_is_waited_for_before_the_step_loads_and_forward_pass() -> None:
    def step_with(flush: frozenset[int]) -> Worker:
        w = make_worker()
        run_step(w, meta(stores={1: store("a", (0, 1), (0,))}))  # S1 queued
        # next step: S2 created (and maybe flushed) in this very step, and a load
        m = meta(loads={3: load("c", (3,), (6, 7))}, stores={2: store("b", (2, 3), (1,))},
                 flush=flush)
        w.handle_preemptions(m)
        w.start_kv_transfers(m)
        for gpu in w.gpu:  # the forward pass of this step overwrites the source blocks
            gpu[0:4].fill_(77)
        w.prepare_store_kv(m)
        w.get_finished()
        run_step(w, meta())
        assert w.states() == {}
        return w

    flushed = step_with(frozenset({2, 99}))  # 99: unknown to this rank, ignored
    assert torch.equal(chunk_rows(flushed, 1)[0], make_worker().gpu[0][2])  # old bytes
    order = [(f.trigger, f.key, f.dest) for f in flushed.fired
             if f.trigger in ("submit", "flush")]
    assert order == [("submit", 1, W.SUBMITTED), ("submit", 2, W.SUBMITTED),
                     ("flush", 2, W.FLUSHED), ("submit", 3, W.SUBMITTED)]
    unflushed = step_with(frozenset())
    assert bool((chunk_rows(unflushed, 1) == 77).all())  # copied after the overwrite


def test_handle_preemptions_submits_the_queue_then_waits_before_any_load() -> None:
    w = make_worker()
    run_step(w, meta(stores={1: store("a", (0, 1), (0,))}))
    m = meta(loads={3: load("c", (3,), (6, 7))}, stores={2: store("b", (2, 3), (1,))},
             flush=frozenset({2}))
    w.handle_preemptions(m)
    assert w.states() == {1: W.SUBMITTED, 2: W.FLUSHED}  # the load is not even received
    assert torch.equal(chunk_rows(w, 1)[0], w.gpu[0][2])  # S2 copied
    assert torch.equal(chunk_rows(w, 0)[0], w.gpu[0][0])  # and S1 before it (FIFO)
    w.start_kv_transfers(m)
    w.prepare_store_kv(m)  # S2 was taken by handle_preemptions: not queued again
    report = w.get_finished()
    assert report.meta is not None and report.meta.completed_jobs == {1: 1, 2: 1, 3: 1}


def test_sync_loads_land_before_the_forward_pass_async_loads_report_recving() -> None:
    w = make_worker()
    m = meta(loads={1: load("s", (0,), (4, 5), sync=True), 2: load("a", (1,), (6, 7))})
    w.handle_preemptions(m)
    w.start_kv_transfers(m)
    assert torch.equal(w.gpu[0][4], chunk_rows(w, 0)[0])  # sync: already landed
    assert not torch.equal(w.gpu[0][6], chunk_rows(w, 1)[0])  # async: not yet
    assert w.states() == {1: W.SUBMITTED, 2: W.SUBMITTED}
    w.prepare_store_kv(m)
    report = w.get_finished()
    assert torch.equal(w.gpu[1][7], chunk_rows(w, 1, t=1)[1])
    assert report.meta is not None and report.meta.completed_jobs == {1: 1, 2: 1}
    assert report.finished_recving == {"a"} and report.recving_jobs == {2: "a"}


def test_copies_are_handed_to_the_oracle_once_when_known_complete() -> None:
    w = make_worker()
    m = meta(loads={1: load("s", (0,), (4, 5), sync=True), 2: load("a", (1,), (6, 7))},
             stores={3: store("b", (2, 3), (2,))})
    w.handle_preemptions(m)
    w.start_kv_transfers(m)
    assert [j.job_id for j in w.take_copied_jobs()] == [1]  # waited for: before forward
    w.prepare_store_kv(m)
    w.get_finished()
    assert [j.job_id for j in w.take_copied_jobs()] == [2]  # polled
    run_step(w, meta())
    (stored,) = w.take_copied_jobs()
    (seg,) = stored.segments
    assert stored.job_id == 3 and (seg.first_block_index, seg.size) == (0, 2)
    assert torch.equal(w.cpu_rows(1, stored, seg), w.gpu[1][2:4])  # the rows it wrote
    assert w.take_copied_jobs() == []


def test_an_injected_failure_copies_nothing_and_is_reported_failed() -> None:
    w = make_worker()
    w.fail_job(1)  # before the job even arrived
    m = meta(loads={1: load("a", (1,), (6, 7))})
    before = w.gpu[0][6].clone()
    report = run_step(w, m)
    assert torch.equal(w.gpu[0][6], before)
    assert report.meta is not None and report.meta.failed_jobs == {1: 1}
    assert report.meta.completed_jobs == {}
    assert report.finished_recving == {"a"}  # the load is over on this rank
    assert w.take_copied_jobs() == []
    assert [f.dest for f in w.fired] == [W.SUBMITTED, W.FAILED, W.REPORTED]


def test_a_failure_cannot_be_injected_after_the_copy_was_launched() -> None:
    w = make_worker()
    m = meta(loads={1: load("a", (1,), (6, 7))})
    w.handle_preemptions(m)
    w.start_kv_transfers(m)
    with pytest.raises(WorkerError, match="already SUBMITTED"):
        w.fail_job(1)


def test_a_hung_job_is_not_reported_until_released() -> None:
    w = make_worker()
    w.hang_job(1, release_after=2)
    m = meta(loads={1: load("a", (1,), (6, 7))})
    assert run_step(w, m).meta is None
    assert w.states() == {1: W.SUBMITTED} and w.hung_jobs() == {1}
    assert run_step(w, meta()).meta is None
    report = run_step(w, meta())
    assert report.meta is not None and report.meta.completed_jobs == {1: 1}
    w.hang_job(2)  # forever, until released by hand
    run_step(w, meta(loads={2: load("b", (2,), (4, 5))}))
    for _ in range(3):
        assert run_step(w, meta()).meta is None
    w.release_job(2)
    report = run_step(w, meta())
    assert report.meta is not None and report.meta.completed_jobs == {2: 1}
    with pytest.raises(WorkerError):
        w.release_job(2)
    with pytest.raises(WorkerError):
        w.hang_job(3, release_after=0)


def test_a_flushed_hung_job_is_waited_for_but_not_reported() -> None:
    w = make_worker()
    w.hang_job(1)
    run_step(w, meta(stores={1: store("a", (0, 1), (0,))}))
    report = run_step(w, meta(flush=frozenset({1})))
    assert report.meta is None and w.states() == {1: W.FLUSHED}
    assert torch.equal(chunk_rows(w, 0)[1], w.gpu[0][1])  # the copy itself ran
    run_step(w, meta(flush=frozenset({1})))  # flushed again: already waited for
    w.release_job(1)
    report = run_step(w, meta())
    assert report.meta is not None and report.meta.completed_jobs == {1: 1}


def test_a_failed_hung_job_that_is_flushed_is_not_handed_to_the_oracle() -> None:
    w = make_worker()
    w.fail_job(1)
    w.hang_job(1)
    run_step(w, meta(loads={1: load("a", (1,), (6, 7))}))  # failed, result withheld
    run_step(w, meta(flush=frozenset({1})))  # a reset flushes it: waited for again
    assert w.states() == {1: W.FLUSHED} and w.take_copied_jobs() == []
    w.release_job(1)
    report = run_step(w, meta())
    assert report.meta is not None and report.meta.failed_jobs == {1: 1}
    assert w.take_copied_jobs() == []


def test_protocol_errors_are_typed() -> None:
    w = make_worker()
    m = meta(stores={1: store("a", (0, 1), (0,))})
    w.prepare_store_kv(m)
    with pytest.raises(WorkerError, match="received twice"):
        w.prepare_store_kv(m)
    with pytest.raises(IllegalTransition, match="QUEUED"):
        w.life.fire(w.jobs[1], "flush")  # waiting for a copy that was never launched
    with pytest.raises(IllegalTransition):
        w.life.fire(w.jobs[1], "report")


def test_several_ranks_report_once_each_and_aggregate() -> None:
    workers = [make_worker(rank) for rank in range(3)]
    workers[2].fail_job(5)
    m = meta(loads={5: load("a", (1,), (6, 7))})
    reports = [run_step(w, m) for w in workers]
    total = aggregate_reports(reports)
    assert total is not None
    assert total.completed_jobs == {5: 2} and total.failed_jobs == {5: 1}
    assert all(r.recving_jobs == {5: "a"} for r in reports)
    assert aggregate_reports([run_step(w, meta()) for w in workers]) is None
