"""The invariants of the lifecycle as named predicates over `AbstractState`.

Safety invariants are predicates on one state: `check(state)` lists every violation, each
naming the invariant, the request and the job ids, so a failure reads as a diagnosis.
INV-13 and INV-14 are progress properties (they speak of futures, not of one state); they
are listed here with the rest and defined in `spec.progress`, where the model checker finds
them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from spec import job as J
from spec import request as R
from spec.state import AbstractState


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    request: str | None = None
    jobs: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = []
        if self.request is not None:
            where.append(f"request {self.request!r}")
        if self.jobs:
            where.append("job" + ("s " if len(self.jobs) > 1 else " ")
                         + ", ".join(map(str, self.jobs)))
        return f"{self.invariant}: {self.message}" + (f" ({'; '.join(where)})" if where else "")


Check = Callable[[AbstractState], Iterator[Violation]]


@dataclass(frozen=True)
class Invariant:
    id: str
    name: str
    statement: str
    vllm_ref: str
    check: Check | None
    """None for progress properties (see spec.progress)."""

    @property
    def is_progress(self) -> bool:
        return self.check is None


def _inv1(s: AbstractState) -> Iterator[Violation]:
    live = s.live_job_ids
    for r in s.requests:
        stray = sorted(r.transfer_jobs - live)
        if stray:
            yield Violation("INV-1", "request holds job ids that are not in the job table",
                            r.id, tuple(stray))


def _inv2(s: AbstractState) -> Iterator[Violation]:
    for j in s.jobs:
        owner = s.request(j.owner)
        if owner is None:
            yield Violation("INV-2", "job's owner is not tracked", j.owner, (j.id,))
        elif j.id not in owner.transfer_jobs:
            yield Violation("INV-2", "job is not in its owner's transfer_jobs", j.owner, (j.id,))


def _inv3(s: AbstractState) -> Iterator[Violation]:
    seen: dict[int, str] = {}
    for r in s.requests:
        for jid in sorted(r.transfer_jobs):
            if jid in seen:
                yield Violation("INV-3", f"job id also held by request {seen[jid]!r}",
                                r.id, (jid,))
            seen[jid] = r.id


def _inv4(s: AbstractState) -> Iterator[Violation]:
    if not s.stale_threshold <= s.job_counter:
        yield Violation("INV-4", f"stale threshold {s.stale_threshold} is above the job "
                        f"counter {s.job_counter}")
    for j in s.jobs:
        if not s.stale_threshold <= j.id < s.job_counter:
            yield Violation("INV-4", f"live job id outside [threshold {s.stale_threshold}, "
                            f"counter {s.job_counter})", j.owner, (j.id,))
    for h in s.reset_fence:
        if not h.id < s.stale_threshold:
            yield Violation("INV-4", f"fence id not below the stale threshold "
                            f"{s.stale_threshold}", jobs=(h.id,))


def _inv5(s: AbstractState) -> Iterator[Violation]:
    for j in s.jobs:
        if not 1 <= j.pending_count <= s.num_workers:
            yield Violation("INV-5", f"pending_count {j.pending_count} outside "
                            f"[1, {s.num_workers}]", j.owner, (j.id,))
    for h in (*s.reset_fence, *s.quarantine):
        if not 1 <= h.reports_due <= s.num_workers:
            yield Violation("INV-5", f"held job due {h.reports_due} reports, outside "
                            f"[1, {s.num_workers}]", jobs=(h.id,))


def _inv6(s: AbstractState) -> Iterator[Violation]:
    for r in s.requests:
        jobs = [s.job(i) for i in sorted(r.transfer_jobs)]
        loads = [j for j in jobs if j is not None and j.kind == "load"]
        if len(loads) > 1:
            yield Violation("INV-6", "request holds more than one load", r.id,
                            tuple(j.id for j in loads))
        if any(not j.sync for j in loads) and len(jobs) > 1:
            yield Violation("INV-6", "an async load shares transfer_jobs with other jobs",
                            r.id, tuple(sorted(r.transfer_jobs)))


def _inv7(s: AbstractState) -> Iterator[Violation]:
    fence = dict(s.block_fence)
    for block, ids in s.block_fence:
        if not ids:
            yield Violation("INV-7", f"block {block} has an empty fence set")
        for jid in sorted(ids):
            j = s.job(jid)
            if j is None or j.kind != "store":
                yield Violation("INV-7", f"block {block} fenced by a job that is not a live "
                                "store", jobs=(jid,))
            elif block not in j.fenced_blocks | j.deferred_fence_blocks:
                yield Violation("INV-7", f"block {block} fenced by a job that does not read it",
                                j.owner, (jid,))
    for j in s.jobs:
        owner = s.request(j.owner)
        must = set(j.fenced_blocks)
        if owner is not None and owner.finished:
            must |= j.deferred_fence_blocks
        for b in sorted(must):
            if j.id not in fence.get(b, frozenset()):
                yield Violation("INV-7", f"source block {b} is not registered in the fence map",
                                j.owner, (j.id,))


def _inv8(s: AbstractState) -> Iterator[Violation]:
    async_keys: set[int] = set()
    for j in s.jobs:
        if j.kind == "load" and not j.sync:
            async_keys |= j.keys
            missing = sorted(j.keys - s.chunks_being_loaded)
            if missing:
                yield Violation("INV-8", f"async load keys {missing} missing from "
                                "chunks_being_loaded", j.owner, (j.id,))
    orphan = sorted(s.chunks_being_loaded - async_keys)
    if orphan:
        yield Violation("INV-8", f"chunks_being_loaded holds keys {orphan} of no live async "
                        "load (later lookups of them defer forever)")


def _inv9(s: AbstractState) -> Iterator[Violation]:
    if s.step_open:
        return
    for j in s.jobs:
        if j.state == J.CREATED:
            yield Violation("INV-9", "job created but not shipped at the end of the step",
                            j.owner, (j.id,))
    if s.jobs_to_flush and not s.reset_since_last_step:
        yield Violation("INV-9", "jobs_to_flush not empty between steps without a reset",
                        jobs=tuple(sorted(s.jobs_to_flush)))


def _inv10(s: AbstractState) -> Iterator[Violation]:
    for r in s.requests:
        if r.finished_signaled and not r.finished:
            yield Violation("INV-10", "finished_signaled on an unfinished request", r.id)
        if r.finished_signaled and not r.transfer_jobs:
            yield Violation("INV-10", "signaled request with no job is still tracked", r.id)
        if r.finished != (r.state in R.FINISHED):
            yield Violation("INV-10", f"finished flag {r.finished} disagrees with state "
                            f"{r.state}", r.id)


def _inv11(s: AbstractState) -> Iterator[Violation]:
    for req_id, n in s.finished_signals:
        if n > 1:
            yield Violation("INV-11", f"on_request_finished called {n} times", req_id)
    for req_id in s.stores_after_signal:
        yield Violation("INV-11", "prepare_store after on_request_finished", req_id)


def _inv12(s: AbstractState) -> Iterator[Violation]:
    readers: dict[int, int] = {}
    for j in s.jobs:
        if j.kind == "load":
            for k in j.keys:
                readers[k] = readers.get(k, 0) + 1
    for h in s.quarantine:
        if h.kind == "load":
            for k in h.keys:
                readers[k] = readers.get(k, 0) + 1
    for j in s.jobs:
        if j.kind == "store" and not j.failed:
            for k in sorted(j.keys):
                if s.ref_cnt(k) != -1:
                    yield Violation("INV-12", f"store key {k} is not write-pending "
                                    f"(ref_cnt {s.ref_cnt(k)})", j.owner, (j.id,))
    for k, n in s.chunk_ref_cnt:
        if n >= 0 and n != readers.get(k, 0):
            yield Violation("INV-12", f"chunk {k} ref_cnt {n} but {readers.get(k, 0)} live "
                            "loads read it")
    for k, n in sorted(readers.items()):
        if s.ref_cnt(k) is None or (s.ref_cnt(k) or 0) < n:
            yield Violation("INV-12", f"chunk {k} read by {n} loads is not pinned that often "
                            f"(ref_cnt {s.ref_cnt(k)})")


def _inv15(s: AbstractState) -> Iterator[Violation]:
    owner_of: dict[int, str] = {}
    for r in s.requests:
        for b in r.gpu_blocks:
            owner_of[b] = r.id
    fence = dict(s.block_fence)
    for j in s.jobs:
        for b in sorted(j.blocks):
            holder = owner_of.get(b)
            if j.kind == "load":
                # a flushed load (its owner was preempted) is finished by the workers before
                # the step's loads and forward pass can reuse its blocks (W:219-244)
                # a sync load was waited for before its step's forward pass: once that step
                # ended (age >= 1) its copy is done, whatever the reports say (W:256-270)
                done = j.sync and j.age >= 1
                # inside a step the connector has not yet seen this step's preemptions
                # (preempted_req_ids arrive with build_connector_meta): judge between steps
                if holder != j.owner and not j.flush_requested and not done \
                        and not s.step_open:
                    yield Violation("INV-15", f"load destination block {b} is held by "
                                    f"{holder!r}, not by the loading request, and the load "
                                    "is not flushed", j.owner, (j.id,))
                continue
            if holder == j.owner or j.flush_requested or j.failed:
                continue  # still held; or finished before any reuse; or its bytes are void
            if s.step_open:
                # inside a step the core may already have preempted the owner and handed
                # its blocks to a request admitted in the same step; the connector learns
                # of the preemption in build_connector_meta, which flushes the store before
                # the workers run the step's loads or forward pass: judge between steps
                continue
            if j.id not in fence.get(b, frozenset()):
                yield Violation("INV-15", f"store source block {b} left its owner without a "
                                "fence entry or a flush", j.owner, (j.id,))
            elif holder is not None and not s.step_open:
                yield Violation("INV-15", f"store source block {b} re-allocated to "
                                f"{holder!r} without flushing the store", j.owner, (j.id,))
    for h in s.quarantine:  # a timed-out async load may still write its destination blocks
        if h.kind == "load" and not h.sync:  # (a sync load's copy ended with its step)
            for b in sorted(h.blocks):
                if b in owner_of:
                    yield Violation("INV-15", f"block {b}, which a timed-out load may still "
                                    f"write, is held by {owner_of[b]!r} (not quarantined)",
                                    owner_of[b], (h.id,))


def _inv16(s: AbstractState) -> Iterator[Violation]:
    writer: dict[int, int] = {}
    for j in s.jobs:
        if j.kind != "store":
            continue
        for k in sorted(j.keys):
            if k in writer:
                yield Violation("INV-16", f"chunk {k} written by two live stores", j.owner,
                                (writer[k], j.id))
            writer[k] = j.id
    for j in s.jobs:
        if j.kind == "load":
            both = sorted(j.keys & set(writer))
            if both:
                yield Violation("INV-16", f"chunks {both} read by a load while a store writes "
                                "them", j.owner, (j.id,))
    unflushed = sorted(h.id for h in s.reset_fence
                       if not h.flushed and h.id not in s.jobs_to_flush)
    if unflushed:
        yield Violation("INV-16", "pre-reset jobs neither flushed nor due to be flushed "
                        "before the next submissions", jobs=tuple(unflushed))


def _inv17(s: AbstractState) -> Iterator[Violation]:
    groups = (s.live_job_ids, s.fence_ids, s.quarantine_ids)
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            both = sorted(groups[a] & groups[b])
            if both:
                yield Violation("INV-17", "job id in two tables at once", jobs=tuple(both))
    for jid in sorted(set().union(*groups)):
        if jid >= s.job_counter:
            yield Violation("INV-17", f"job id not below the counter {s.job_counter}",
                            jobs=(jid,))


def _inv18(s: AbstractState) -> Iterator[Violation]:
    if s.step_open:
        return
    for r in s.requests:
        if r.lookup_hit_pending:
            yield Violation("INV-18", "a lookup hit outlived its step without being pinned",
                            r.id)


def _inv19(s: AbstractState) -> Iterator[Violation]:
    for r in s.requests:
        if not r.load_invalid:
            continue
        for jid in sorted(r.transfer_jobs):
            j = s.job(jid)
            if j is not None and j.kind == "store" and not j.failed:
                yield Violation("INV-19", "a live store reads KV that a failed load "
                                "invalidated and is not poisoned (it would publish that KV)",
                                r.id, (jid,))


def _inv20(s: AbstractState) -> Iterator[Violation]:
    for k in sorted(s.invalid_chunks):
        ref = s.ref_cnt(k)
        if ref is not None and ref >= 0:
            yield Violation("INV-20", f"chunk {k} is ready (ref_cnt {ref}) but holds invalid "
                            "KV: a store of data a failed, timed-out or invalid copy produced "
                            "was published")


def _inv21(s: AbstractState) -> Iterator[Violation]:
    if not s.reset_since_last_step or s.step_open:
        return
    for r in s.requests:
        if r.store_cursor not in (None, 0):
            yield Violation("INV-21", f"store cursor {r.store_cursor} after a reset: the "
                            "reset forgot every chunk, the request must store from chunk 0",
                            r.id)


def _inv22(s: AbstractState) -> Iterator[Violation]:
    for k in sorted(s.misplaced_chunks):
        yield Violation("INV-22", f"chunk {k} was copied from or to a block at another "
                        "position than its own (a partial tail's key: the block its boundary "
                        "falls in)")


def _inv24(s: AbstractState) -> Iterator[Violation]:
    for r in s.requests:
        if r.state in R.HOLDS_JOBS and not r.transfer_jobs:
            yield Violation("INV-24", f"request in {r.state} holds no job (its state says a "
                            "job is in flight)", r.id)
        elif r.state not in R.MAY_HOLD_JOBS and r.transfer_jobs:
            yield Violation("INV-24", f"request in {r.state} holds jobs (its state says none "
                            "is in flight)", r.id, tuple(sorted(r.transfer_jobs)))


def _inv23(s: AbstractState) -> Iterator[Violation]:
    for k in sorted(s.unwritten_reads):
        yield Violation("INV-23", f"a load read a block of chunk {k} that no store wrote (the "
                        "chunk was stored without blocks the core had freed)")


INVARIANTS: tuple[Invariant, ...] = (
    Invariant("INV-1", "jobs-in-table", "every id in any transfer_jobs is a key of _jobs",
              "implicit; broken before PR #48102", _inv1),
    Invariant("INV-2", "table-owned", "every job in _jobs belongs to a tracked request that "
              "lists it in transfer_jobs", "implicit; S:2289, S:2308", _inv2),
    Invariant("INV-3", "disjoint-ownership", "transfer_jobs sets are pairwise disjoint",
              "implicit", _inv3),
    Invariant("INV-4", "stale-threshold", "stale_threshold <= live id < job_counter; fence ids "
              "< stale_threshold", "implicit; S:647-649", _inv4),
    Invariant("INV-5", "pending-bounds", "1 <= pending_count <= num_workers; fence and "
              "quarantine entries due >= 1", "S:2265, S:2287", _inv5),
    Invariant("INV-6", "load-exclusive", "an async load is alone in transfer_jobs; at most one "
              "load per request", "S:1487, S:2060-2063, S:2148-2150", _inv6),
    Invariant("INV-7", "block-fence", "fence map: no empty sets; entries are live stores that "
              "read the block; every fenced (and, once finished, deferred) source registered",
              "S:658-663, S:755-760, S:2371-2374", _inv7),
    Invariant("INV-8", "chunks-being-loaded", "chunks_being_loaded is exactly the keys of live "
              "async loads", "S:639-643, S:1498-1499, S:2290-2295", _inv8),
    Invariant("INV-9", "step-scoped", "between steps no job is unshipped and jobs_to_flush is "
              "empty unless a reset happened since the last step", "S:2185-2189, S:2404-2407",
              _inv9),
    Invariant("INV-10", "finished-signaled", "finished_signaled implies finished; signaled "
              "with no job implies untracked", "S:2181-2184, S:2309-2310", _inv10),
    Invariant("INV-11", "finish-once", "on_request_finished once per request, after its last "
              "prepare_store", "B:430-448, M:424-431", _inv11),
    Invariant("INV-12", "manager-pins", "live store keys are write-pending; a ready chunk's "
              "ref_cnt equals the live (and quarantined) loads reading it",
              "M:233-238, M:251-258, M:387-391", _inv12),
    Invariant("INV-13", "jobs-drain", "if the engine keeps stepping and workers report (or the "
              "timeout fires), every live job leaves the table and the fence drains",
              "S:2213-2214, CS:3177", None),
    Invariant("INV-14", "no-permanent-wait", "no unfinished request stays PREEMPTED_FLUSHING or "
              "LOOKUP_DEFERRED forever", "S:1247-1252", None),
    Invariant("INV-15", "gpu-data-safety", "between steps, a GPU block a live store reads is "
              "held by its owner, or the store is flushed or failing (its bytes are rolled "
              "back), or the block is fenced and the store flushed in the step that "
              "re-allocates it; a live load's destination blocks are held by its request, or "
              "the load is flushed (inside a step the connector has not yet seen the core's "
              "preemptions of that step: build_connector_meta flushes their jobs before the "
              "workers run the step); a timed-out async load's destination blocks are held by "
              "no request until its late reports drain the quarantine (beyond vLLM)",
              "S:658-663, S:2136-2151, W:219-244", _inv15),
    Invariant("INV-16", "cpu-data-safety", "no chunk written by two live stores, or written "
              "while a live load reads it; pre-reset jobs flushed before new submissions",
              "M:452-456", _inv16),
    Invariant("INV-17", "unique-ids", "job ids are unique across the job table, the reset "
              "fence and the quarantine, and below the counter", "S:750-753", _inv17),
    Invariant("INV-18", "hit-pinned-in-step", "a lookup HIT is pinned by prepare_load in the "
              "same step or dropped", "S:687-693, S:1365-1367", _inv18),
    Invariant("INV-19", "invalid-kv-unpublished", "a request whose loaded tokens are "
              "invalid (a load of it failed or timed out) holds no live store that is not "
              "failing: no chunk is made loadable from KV a failed load produced",
              "beyond vLLM (a failed transfer asserts, W:299-301)", _inv19),
    Invariant("INV-20", "valid-kv-published", "no chunk the manager holds ready holds invalid "
              "KV (the data's truth, which the model keeps beside the spec's state: a store "
              "of KV a failed or timed-out load produced, or a copy a worker failed, is never "
              "made loadable); the implementation's engine checks the same on the bytes",
              "beyond vLLM (CorruptedBytes in the data plane)", _inv20),
    Invariant("INV-21", "store-cursor-reset", "between a reset and the next step every "
              "tracked request's store cursor is 0: the reset forgot every chunk, so each "
              "request stores its prefix again", "S:2429-2433", _inv21),
    Invariant("INV-22", "copy-placement", "every job copies each chunk from or to the blocks "
              "at the chunk's own positions in its group's table: a partial tail's key is "
              "stored from, and loaded into, only the block its boundary falls in (the data's "
              "truth, kept by the model; the engine checks the same on the bytes)",
              "S:1428-1442, S:1688-1737", _inv22),
    Invariant("INV-23", "loads-read-written-blocks", "every block a load copies from a chunk "
              "was written by the store that published the chunk: a chunk stored without "
              "some of its blocks (a sliding window's leading blocks the core had freed, "
              "kept out by the reachable-block mask) never serves a load that needs them "
              "(the data's truth, kept by the model; the engine checks the same on the "
              "bytes)", "S:1904-1980, S:2024-2045", _inv23),
    Invariant("INV-24", "state-holds-jobs", "a request's state agrees with its transfer_jobs: "
              "a state whose vLLM predicate has a job in flight (`holds_jobs`) holds one, a "
              "state that may hold none (outside `may_hold_jobs`) holds none",
              "S:348-493", _inv24),
)

SAFETY = tuple(i for i in INVARIANTS if not i.is_progress)

WHOLE_STATE = frozenset({"INV-3", "INV-7", "INV-8", "INV-12", "INV-15", "INV-16", "INV-17"})
"""The safety invariants that relate records of different requests (a job id held twice,
the fence map against every live store, the chunks being loaded against every async load,
each chunk's pins against every load, the GPU blocks of every request, two stores of one
chunk, an id in two tables): over a part of the state they can miss a violation or report
a false one. Every other one is local: it holds of a state when it holds of every part
closed under ownership (a set of requests, the jobs they hold, those jobs' owners, and all
of the state's global fields). An incremental checker (the live monitor) checks the local
ones over the part each hook touched and these over the whole state."""


def check(state: AbstractState, without: frozenset[str] = frozenset()) -> list[Violation]:
    """Every violation of every safety invariant in `state` (empty when all hold), except
    those of the invariants `without` names (switched off, to see what else catches a fault)."""
    out: list[Violation] = []
    for inv in SAFETY:
        assert inv.check is not None
        if inv.id in without:
            continue
        out.extend(inv.check(state))
    return out


def by_id(inv_id: str) -> Invariant:
    for inv in INVARIANTS:
        if inv.id == inv_id:
            return inv
    raise KeyError(inv_id)
