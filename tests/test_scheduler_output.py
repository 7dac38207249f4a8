"""update_connector_output (S:2218-2310): acks over several workers, stale
filtering, and every kind of bad report, rejected with nothing changed."""

from __future__ import annotations

from typing import Any

import pytest

from spec import job as J
from spec import request as R
from statemachine.errors import MalformedMessage, OverAck, UnknownJob
from statemachine.messages import KVConnectorOutput, OffloadingWorkerMetadata
from tests.driver import Driver


def storing(workers: int = 3) -> tuple[Driver, int]:
    d = Driver.make(num_workers=workers)
    d.add("a", 20)
    _, _, meta = d.admit("a")
    (jid,) = meta.store_jobs
    return d, jid


def test_partial_acks_over_three_workers() -> None:
    """test_complete_store_waits_for_all_worker_acks."""
    d, jid = storing(3)
    d.report({jid: 1})
    job = d.s.jobs.get(jid)
    assert job is not None and job.pending_count == 2 and job.state == J.PARTIALLY_ACKED
    assert d.s.manager.chunk_ref_counts() == {d.reqs["a"].block_hashes[0]: -1}
    d.report({jid: 1})
    assert d.s.jobs.get(jid).pending_count == 1  # type: ignore[union-attr]
    d.report({jid: 1})
    assert jid not in d.s.jobs and d.state("a") == R.RUNNING
    assert d.s.manager.chunk_ref_counts() == {d.reqs["a"].block_hashes[0]: 0}


def test_aggregated_acks_complete_at_once() -> None:
    d, jid = storing(3)
    metas = [OffloadingWorkerMetadata({jid: 1}) for _ in range(3)]
    agg = OffloadingWorkerMetadata.aggregate([*metas, None])
    assert agg is not None and agg.completed_jobs == {jid: 3}
    d.s.update_connector_output(KVConnectorOutput(agg))
    assert d.s.transfer_jobs("a") == frozenset()


def test_empty_output_changes_nothing() -> None:
    d, _ = storing()
    before = d.s.abstract_state()
    d.s.update_connector_output(KVConnectorOutput())
    assert d.s.abstract_state() == before


def _rejected(d: Driver, exc: type[Exception], match: str, meta: Any) -> None:
    before = d.s.abstract_state()
    refs = d.s.manager.chunk_ref_counts()
    with pytest.raises(exc, match=match):
        d.s.update_connector_output(meta if isinstance(meta, KVConnectorOutput)
                                    else KVConnectorOutput(meta))
    assert d.s.abstract_state() == before
    assert d.s.manager.chunk_ref_counts() == refs


def test_over_ack_is_rejected_with_nothing_changed() -> None:
    d, jid = storing(3)
    d.report({jid: 2})
    _rejected(d, OverAck, rf"job {jid} in state PARTIALLY_ACKED: report count 2 exceeds the 1",
              OffloadingWorkerMetadata({jid: 2}))
    _rejected(d, OverAck, "exceeds", OffloadingWorkerMetadata({jid: 1}, {jid: 1}))


def test_unknown_and_duplicate_acks_are_rejected() -> None:
    d, jid = storing(1)
    _rejected(d, UnknownJob, "job 99: never allocated", OffloadingWorkerMetadata({99: 1}))
    d.report({jid: 1})
    _rejected(d, UnknownJob, f"job {jid}: reported after it ended",
              OffloadingWorkerMetadata({jid: 1}))


def test_a_rejected_message_applies_none_of_its_entries() -> None:
    d, jid = storing(1)
    _rejected(d, UnknownJob, "job 42", OffloadingWorkerMetadata({jid: 1, 42: 1}))
    assert d.s.transfer_jobs("a") == {jid}


@pytest.mark.parametrize("meta,match", [
    ("not a meta", "OffloadingWorkerMetadata or None"),
    (OffloadingWorkerMetadata({0: 0}), "counts > 0"),
    (OffloadingWorkerMetadata({0: -1}), "counts > 0"),
    (OffloadingWorkerMetadata({"0": 1}), "must be ints"),  # type: ignore[dict-item]
    (OffloadingWorkerMetadata({0: True}), "must be ints"),
    (OffloadingWorkerMetadata([(0, 1)]), "must be a dict"),  # type: ignore[arg-type]
    (KVConnectorOutput(None, {1}), "finished_recving"),  # type: ignore[arg-type]
])
def test_malformed_messages_are_rejected(meta: Any, match: str) -> None:
    d, _ = storing(1)
    _rejected(d, MalformedMessage, match, meta)


def test_not_a_connector_output() -> None:
    d, _ = storing(1)
    with pytest.raises(MalformedMessage, match="expects a KVConnectorOutput"):
        d.s.update_connector_output({"completed_jobs": {}})  # type: ignore[arg-type]


def test_load_ack_releases_pins_and_chunks_being_loaded() -> None:
    d = Driver.make(num_workers=2)
    d.add("a", 40)
    _, _, meta = d.admit("a")
    d.ack_all(meta.store_jobs)
    d.finish("a")
    d.build(finished=["a"])
    d.add("b", 40)
    _, _, meta = d.admit("b")
    (lid,) = meta.load_jobs
    assert set(d.s.manager.chunk_ref_counts().values()) == {1}
    d.report({lid: 1})
    assert d.state("b") == R.LOADING_ASYNC and d.s.chunks_being_loaded
    d.report({lid: 1}, recving=["b"])
    assert d.state("b") == R.IDLE
    assert set(d.s.manager.chunk_ref_counts().values()) == {0}
    assert not d.s.chunks_being_loaded
