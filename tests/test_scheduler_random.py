"""Random event sequences through the scheduler side, invariants checked after every hook
(the scheduler does it itself), and a drain at the end that must leave nothing behind."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from spec import request as R
from statemachine.core import block_hashes
from statemachine.messages import CachedRequestData, NewRequestData, RequestStatus
from statemachine.policies import POLICY_NAMES
from tests.driver import Driver


class SchedulerEvents(RuleBasedStateMachine):
    @initialize(workers=st.integers(1, 3), bpc=st.integers(1, 2), chunks=st.integers(2, 8),
                sync=st.booleans(), timeout=st.sampled_from([None, 2, 4]),
                policy=st.sampled_from(POLICY_NAMES))
    def setup(self, workers: int, bpc: int, chunks: int, sync: bool,
              timeout: int | None, policy: str) -> None:
        self.d = Driver.make(num_workers=workers, blocks_per_chunk=bpc, num_cpu_chunks=chunks,
                             eviction_policy=policy,
                             block_size=4, sync_load_budget_bytes=200 if sync else 0,
                             kv_bytes_per_token=1 if sync else 0, job_timeout_steps=timeout)
        self.n = 0
        self.in_flight: dict[int, int] = {}  # job id -> reports still to send

    def _track(self, meta: object) -> None:
        for jid in [*meta.load_jobs, *meta.store_jobs]:  # type: ignore[attr-defined]
            self.in_flight[jid] = self.d.config.num_workers

    @rule(family=st.integers(0, 2), tokens=st.integers(4, 40))
    def new_request(self, family: int, tokens: int) -> None:
        self.n += 1
        self.d.add(f"r{self.n}", tokens, family)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        waiting = sorted(r for r in self.d.s.requests
                         if self.d.state(r) in R.AWAITING_ADMISSION
                         and not self.d.reqs[r].is_finished())
        if not waiting:
            return
        rid = data.draw(st.sampled_from(waiting))
        req = self.d.reqs[rid]
        req.num_computed_tokens = 0
        _, _, meta = self.d.admit(rid, alloc_ok=data.draw(st.booleans()))
        self._track(meta)

    @rule(data=st.data())
    def promote_loaded(self, data: st.DataObject) -> None:
        """A request whose async load ended (or was orphaned and reported) runs."""
        idle = sorted(r for r in self.d.s.requests if self.d.state(r) == R.IDLE
                      and self.d.reqs[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        if not idle:
            return
        rid = data.draw(st.sampled_from(idle))
        req = self.d.reqs[rid]
        req.status = RequestStatus.RUNNING
        self.d.alloc(rid, 2)
        meta = self.d.build(new=[NewRequestData(rid, tuple(self.d.blocks[rid]))],
                            sched={rid: 1})
        self._track(meta)

    @rule(tokens=st.integers(1, 8))
    def decode(self, tokens: int) -> None:
        running = sorted(r for r in self.d.s.requests if self.d.state(r) in R.SCHEDULED)
        cached, sched = [], {}
        for rid in running:
            req = self.d.reqs[rid]
            req.output_token_ids.extend([3] * tokens)
            req.block_hashes = block_hashes(req.all_token_ids, 4)
            need = -(-req.num_tokens // 4) - len(self.d.blocks[rid])
            cached.append(CachedRequestData(rid, tuple(self.d.alloc(rid, max(need, 0)))))
            sched[rid] = tokens
        meta = self.d.build(cached=cached, sched=sched)
        for rid in running:
            self.d.reqs[rid].num_computed_tokens += tokens
        self._track(meta)

    @rule(data=st.data(), fail=st.booleans(), partial=st.booleans())
    def report(self, data: st.DataObject, fail: bool, partial: bool) -> None:
        if not self.in_flight:
            return
        jid = data.draw(st.sampled_from(sorted(self.in_flight)))
        due = self.in_flight[jid]
        count = 1 if partial else due
        recving = {r for r in self.d.s.requests if self.d.state(r) == R.ORPHANED_LOAD}
        self.d.report(failed={jid: count} if fail else None,
                      completed=None if fail else {jid: count}, recving=recving)
        self.in_flight[jid] -= count
        if not self.in_flight[jid]:
            del self.in_flight[jid]

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        running = sorted(r for r in self.d.s.requests if self.d.state(r) in R.SCHEDULED)
        if running:
            rid = data.draw(st.sampled_from(running))
            self.d.reqs[rid].status = RequestStatus.PREEMPTED
            self._track(self.d.build(preempted=[rid]))

    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data: st.DataObject, aborted: bool) -> None:
        live = sorted(r for r in self.d.s.requests if not self.d.reqs[r].is_finished())
        if live:
            rid = data.draw(st.sampled_from(live))
            self.d.finish(rid, aborted)
            self._track(self.d.build(finished=[rid]))

    @rule()
    def reset(self) -> None:
        self.d.s.reset_cache()

    @rule()
    def idle_step(self) -> None:
        self._track(self.d.build())

    @invariant()
    def counters_are_consistent(self) -> None:
        if hasattr(self, "d"):
            assert self.d.s.manager.check_consistency() == []

    def teardown(self) -> None:
        if not hasattr(self, "d"):
            return
        for rid in sorted(self.d.s.requests):
            if not self.d.reqs[rid].is_finished():
                self.d.finish(rid, aborted=True)
        self._track(self.d.build(finished=set(self.d.s.requests)))
        recving = set(self.d.reqs)
        self.d.report({j: n for j, n in self.in_flight.items()}, recving=recving)
        self.d.build()
        s = self.d.s
        assert s.requests == {}, {r: s.request_state(r) for r in s.requests}
        assert not s.has_pending_work()
        assert all(n == 0 for n in s.manager.chunk_ref_counts().values())
        assert s.block_fence == {} and not s.chunks_being_loaded


SchedulerEvents.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                             deadline=None)
test_scheduler_events = SchedulerEvents.TestCase
