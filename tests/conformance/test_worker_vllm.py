"""vLLM's worker side on the reports of its transfers: the real `OffloadingConnectorWorker`
of the release under test, over a transfer medium that completes or fails the jobs it is
given (`_Medium`, the one stand-in: vLLM's CPU medium needs a GPU), on CPU tensors.

The other conformance tests drive vLLM's scheduler side and build each worker report the
way vLLM's worker would (`conformance.vllm_env.connector_output`). Here vLLM's worker builds
it, and the tests check the two agree: what a worker reports for a completed store, a
completed sync load, a failed async load. And they check the one report the machines never
build, SYNC-LOAD-FAILURE (CONFORMANCE.md): a worker of vLLM 0.34 raises on the failure of a
sync load (W@0.34.0:309-312), whose request already ran on the KV it did not get, where the
spec takes the failure and recomputes the request."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

pytestmark = pytest.mark.conformance

_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
_MEDIUM = "vllm.v1.kv_offload.base"


class _Medium:
    """A transfer medium (vLLM's `OffloadingWorker` interface): each job submitted finishes
    by the next `get_finished`, failed if its id is in `fail`; it records what it was asked."""

    def __init__(self, result: Any, fail: Iterable[int] = ()) -> None:
        self._result = result
        self.fail = set(fail)
        self.submitted: list[tuple[str, int, bool]] = []
        self.waited: list[set[int]] = []
        self._due: list[int] = []

    def submit_store(self, job_id: int, *args: Any) -> bool:
        self.submitted.append(("store", job_id, False))
        self._due.append(job_id)
        return True

    def submit_load(self, job_id: int, *args: Any, expedited: bool = False) -> bool:
        self.submitted.append(("load", job_id, expedited))
        self._due.append(job_id)
        return True

    def get_finished(self) -> list[Any]:
        due, self._due = self._due, []
        return [self._result(job_id, job_id not in self.fail) for job_id in due]

    def wait(self, job_ids: set[int]) -> None:
        self.waited.append(set(job_ids))

    def shutdown(self) -> None:
        return None


class _Spec:
    """The offloading spec as the worker side reads it: one layout for every rank (so each
    rank writes its stores) and the medium."""

    replicated_layout = False

    def __init__(self, medium: _Medium) -> None:
        self.medium = medium

    def get_worker(self, kv_caches: Any) -> _Medium:
        return self.medium


def _connector_worker(fail: Iterable[int] = ()) -> tuple[Any, _Medium]:
    """vLLM's worker side over a medium failing `fail`, its KV caches one CPU tensor of 8
    blocks of 64 bytes (one group, one layer)."""
    import torch

    base = importlib.import_module(_MEDIUM)
    medium = _Medium(base.TransferResult, fail)
    worker = importlib.import_module(f"{_CONNECTOR}.worker").OffloadingConnectorWorker(
        _Spec(medium), None, None)
    tensor = torch.zeros((8, 64), dtype=torch.int8)
    worker._init_worker(base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(tensor, 64)], [[base.CanonicalKVCacheRef(0, 64)]]))
    return worker, medium


def _metadata(loads: Mapping[int, tuple[str, bool]] | None = None,
              stores: Mapping[int, str] | None = None) -> Any:
    """Connector metadata of a step: loads (job -> request, sync) into GPU blocks 1 and 2,
    stores (job -> request) from them."""
    common = importlib.import_module(f"{_CONNECTOR}.common")
    gpu = importlib.import_module(_MEDIUM).GPULoadStoreSpec([1, 2], [2], [0])
    return common.OffloadingConnectorMetadata(
        load_jobs={j: common.TransferJob(r, None, gpu, sync=sync)
                   for j, (r, sync) in (loads or {}).items()},
        store_jobs={j: common.TransferJob(r, gpu, None) for j, r in (stores or {}).items()})


def _step(worker: Any, meta: Any) -> tuple[set[str], set[str]]:
    """One engine step of the worker side, in the connector's order (OC@0.34.0:126-152): the
    transfers started (`start_load_kv`), the step's stores queued after the forward pass
    (`wait_for_save`), the results taken (`get_finished`)."""
    worker.start_kv_transfers(meta)
    worker.prepare_store_kv(meta)
    return worker.get_finished(set())


def _jobs(meta: Any) -> tuple[dict[int, int], set[int]]:
    """A worker metadata's jobs: each completed one's count, and the failed ones (none
    before 0.34.0, which has no `failed_jobs`)."""
    return dict(meta.completed_jobs), set(getattr(meta, "failed_jobs", set()))


def _as_built(out: Any) -> tuple[dict[int, int], set[int], set[str], set[str]]:
    """A connector output's fields the scheduler side reads."""
    return (*_jobs(out.kv_connector_worker_meta), set(out.finished_recving or ()),
            set(getattr(out, "failed_recving", ()) or ()))


def test_a_completed_store_and_sync_load_are_reported_as_the_harness_builds_them(
        vllm_ready: Any) -> None:
    """A store and a sync load that complete: each counted once, no request named (a sync
    load's request already ran; a store never names its request). The stores are deferred
    to the next step's start, as vLLM's worker defers them."""
    from conformance import vllm_env as E

    worker, medium = _connector_worker()
    _step(worker, _metadata(stores={3: "r0"}))
    assert medium.submitted == [] and worker.build_connector_worker_meta() is None
    _, recving = _step(worker, _metadata(loads={5: ("r1", True)}))
    assert medium.submitted == [("store", 3, False), ("load", 5, True)]
    assert medium.waited == [{5}]
    got = (*_jobs(worker.build_connector_worker_meta()), recving)
    built = _as_built(E.connector_output({3: 1, 5: 1}))
    assert got == built[:3] == ({3: 1, 5: 1}, set(), set())


def test_a_failed_async_load_is_reported_as_the_harness_builds_it(vllm_ready: Any) -> None:
    """From 0.34.0 a worker reports a failed async load as a completion of the job, the job
    in `failed_jobs`, and its request in `finished_recving` and in `failed_recving` (which
    the core recomputes): what `connector_output` builds for the machines' failure reports
    (`conformance.adapter`, `_report`)."""
    from conformance import vllm_env as E

    worker, medium = _connector_worker(fail={7})
    _, recving = _step(worker, _metadata(loads={7: ("r0", False)}))
    failed_recving = worker.take_failed_recving()
    got = (*_jobs(worker.build_connector_worker_meta()), recving, failed_recving)
    built = _as_built(E.connector_output({7: 1}, finished_recving={"r0"}, failed_jobs={7},
                                         failed_recving={"r0"}))
    assert got == built == ({7: 1}, {7}, {"r0"}, {"r0"})
    assert medium.waited == [] and worker.take_failed_recving() == set()


def _a_failed_sync_load() -> tuple[Any, Any, Any]:
    """The first state the model reaches, breadth first, in which a worker's failed report
    of a live sync load is enabled; that report; the state after it."""
    from spec import model as M
    from spec.scenarios import by_name

    first = M.initial(by_name("sync-load-fails-after-reset").bounds)
    frontier, seen = [first], {first}
    while frontier:
        later = []
        for s in frontier:
            for ev, t, _, _ in M.successors(s):
                if not isinstance(t, M.ModelState):
                    continue
                job = next((j for j in s.jobs if j.id == ev.job), None)
                if (ev.kind == "report" and ev.failed and job is not None
                        and job.kind == "load" and job.sync):
                    return s, ev, t
                if t not in seen:
                    seen.add(t)
                    later.append(t)
        frontier = later
    raise AssertionError("no sync load fails within the scenario's bounds")


def test_a_failed_sync_load_raises_in_vllm_where_the_spec_recomputes(
        vllm_ready: Any) -> None:
    """SYNC-LOAD-FAILURE: vLLM 0.34's worker raises on it (its request ran this step on KV
    the load did not write, and `failed_recving` cannot undo that); the spec takes it: the
    job leaves the table, and its request is marked to recompute with its stores poisoned.
    `conformance.adapter.unfailable_in_vllm` names it, so no machine sends it to vLLM."""
    from conformance.adapter import unfailable_in_vllm
    from spec import model as M
    from spec.invariants import check

    worker, medium = _connector_worker(fail={9})
    with pytest.raises(RuntimeError, match=r"\b9\b"):
        _step(worker, _metadata(loads={9: ("r0", True)}))
    assert medium.submitted == [("load", 9, True)] and medium.waited == [{9}]

    s, ev, t = _a_failed_sync_load()
    assert unfailable_in_vllm(s, ev) == "SYNC-LOAD-FAILURE"
    owner = next(j.owner for j in s.jobs if j.id == ev.job)
    assert not next(q for q in s.reqs if q.id == owner).load_invalid
    assert ev.job not in {j.id for j in t.jobs}
    assert next(q for q in t.reqs if q.id == owner).load_invalid
    assert check(M.abstract(t)) == []


def test_before_failure_reports_any_failed_transfer_trips_the_workers_assert(
        vllm_ready: Any) -> None:
    """Before 0.34.0 vLLM's worker takes no failed transfer: it asserts each succeeded
    (W:299-301), so the machines send no failed report to those releases
    (`tests/conformance/test_witnesses.py`, `off_vllm`)."""
    if vllm_ready.has("failure_reports"):
        pytest.skip("this release reports failures (the tests above)")
    worker, _ = _connector_worker(fail={7})
    with pytest.raises(AssertionError):
        _step(worker, _metadata(loads={7: ("r0", False)}))
