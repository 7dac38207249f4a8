"""A minimal stand-in for vLLM's core scheduler, for the scheduler-side tests.

It calls the connector's hooks in the core's order: lookup, allocation,
update_state_after_alloc, build_connector_meta; then the workers' reports through
update_connector_output. It hands out GPU block ids from a pool it never refills (no reuse
unless a test frees blocks), keeps each request's `num_computed_tokens`, and records the
step with the core's shared `StepLedger` (`statemachine.core`). The full engine lives in
`statemachine.engine`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from statemachine.config import OffloadingConfig
from statemachine.core import BlockPool, block_hashes, blocks_needed
from statemachine.messages import (
    CachedRequestData,
    KVConnectorOutput,
    NewRequestData,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from statemachine.scheduler import OffloadingScheduler


@dataclass
class Driver:
    config: OffloadingConfig = field(default_factory=OffloadingConfig)
    pool: BlockPool = field(default_factory=lambda: BlockPool(1 << 20))
    blocks: dict[str, list[int]] = field(default_factory=dict)
    reqs: dict[str, Request] = field(default_factory=dict)
    metas: list[OffloadingConnectorMetadata] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.s = OffloadingScheduler(self.config)

    @classmethod
    def make(cls, **cfg: Any) -> Driver:
        return cls(OffloadingConfig(**cfg))

    # -- requests -------------------------------------------------------------------
    def add(self, rid: str, num_tokens: int, family: int = 0) -> Request:
        tokens = [family * 100_000 + i for i in range(num_tokens)]
        req = Request(rid, tokens, block_hashes=block_hashes(tokens, self.config.block_size))
        self.reqs[rid] = req
        self.s.on_new_request(req)
        return req

    def alloc(self, rid: str, n: int) -> list[int]:
        new = self.pool.allocate(n)
        self.blocks.setdefault(rid, []).extend(new)
        return new

    # -- one step -------------------------------------------------------------------
    def admit(self, rid: str, local_tokens: int = 0, schedule_tokens: int | None = None,
              alloc_ok: bool = True) -> tuple[int | None, bool, OffloadingConnectorMetadata]:
        """One step in which `rid` (waiting) is looked up and, unless deferred or loading
        asynchronously, scheduled for `schedule_tokens` (default: the rest of its prompt)."""
        req = self.reqs[rid]
        hit, is_async = self.s.get_num_new_matched_tokens(req, local_tokens)
        new: list[NewRequestData] = []
        sched: dict[str, int] = {}
        if hit is not None and alloc_ok:
            bs = self.config.block_size
            todo = req.num_tokens - local_tokens - hit if schedule_tokens is None \
                else schedule_tokens
            self.blocks[rid] = []
            self.alloc(rid, blocks_needed(local_tokens + hit + (0 if is_async else todo), bs, 0))
            self.s.update_state_after_alloc(req, self.blocks[rid], hit)
            if is_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = local_tokens
            else:
                req.status = RequestStatus.RUNNING
                new.append(NewRequestData(rid, tuple(self.blocks[rid])))
                sched[rid] = todo
                req.num_computed_tokens = local_tokens + hit
        meta = self.build(new=new, sched=sched)
        for r, n in sched.items():
            self.reqs[r].num_computed_tokens += n
        return hit, is_async, meta

    def build(self, new: Iterable[NewRequestData] = (),
              cached: Iterable[CachedRequestData] = (), sched: dict[str, int] | None = None,
              finished: Iterable[str] = (), preempted: Iterable[str] = ()) \
            -> OffloadingConnectorMetadata:
        out = SchedulerOutput(tuple(new), tuple(cached), dict(sched or {}),
                              frozenset(finished), frozenset(preempted))
        meta = self.s.build_connector_meta(out)
        self.metas.append(meta)
        return meta

    def decode(self, rids: Iterable[str], tokens: int = 1, new_blocks: int = 0,
               finished: Iterable[str] = (), preempted: Iterable[str] = ()) \
            -> OffloadingConnectorMetadata:
        """A step that runs `rids` for `tokens` more tokens each."""
        cached = []
        sched = {}
        for rid in rids:
            req = self.reqs[rid]
            req.output_token_ids.extend([7] * tokens)
            req.block_hashes = block_hashes(req.all_token_ids, self.config.block_size)
            cached.append(CachedRequestData(rid, tuple(self.alloc(rid, new_blocks))))
            sched[rid] = tokens
        meta = self.build(cached=cached, sched=sched, finished=finished, preempted=preempted)
        for rid, n in sched.items():
            self.reqs[rid].num_computed_tokens += n
        return meta

    def finish(self, rid: str, aborted: bool = False) -> None:
        req = self.reqs[rid]
        req.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        self.s.request_finished(req)

    # -- worker reports ---------------------------------------------------------------
    def report(self, completed: dict[int, int] | None = None,
               failed: dict[int, int] | None = None, recving: Iterable[str] = ()) -> None:
        meta = OffloadingWorkerMetadata(dict(completed or {}), dict(failed or {}))
        self.s.update_connector_output(KVConnectorOutput(meta, set(recving)))

    def ack_all(self, job_ids: Iterable[int]) -> None:
        self.report({j: self.config.num_workers for j in job_ids})

    def state(self, rid: str) -> str:
        return self.s.request_state(rid)
