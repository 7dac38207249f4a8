"""The environment: the events that may happen (`Event`), what each does to a `ModelState`
(`apply`), and the hook calls it stands for (`Call`), which the refinement tests replay
against an implementation. `events` lists what the environment may send in a state;
`successors` is the checker's transition relation.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from spec import job as J
from spec import request as R
from spec.groups import NULL_BLOCK
from spec.model import truth
from spec.model.core import follow_connector, free
from spec.model.faults import NO_FAULTS, Fault, Faults
from spec.model.hooks import (
    alloc,
    build_meta,
    finish,
    handoffs,
    lookup,
    report,
    reset,
    tail_handoffs,
)
from spec.model.interpreter import SPEC_TABLES, Tables, fire
from spec.model.projection import abstract
from spec.model.state import (
    Bounds,
    MCore,
    MJob,
    ModelError,
    ModelState,
    NotEnabled,
    World,
)
from spec.rules import StaleLoadFailure


@dataclass(frozen=True)
class Call:
    """One hook call an event stands for, with the answer the model expects."""

    hook: str
    args: tuple[Any, ...]
    answer: Any = None


@dataclass(frozen=True)
class Event:
    kind: Literal["arrive", "step", "promote", "report", "finish", "abort", "preempt",
                  "reset"]
    req: str | None = None
    job: int | None = None
    count: int = 0
    failed: bool = False

    def __str__(self) -> str:
        if self.kind == "step":
            return f"step(admit={self.req})" if self.req else "step()"
        if self.kind == "report":
            what = "fail" if self.failed else "ack"
            return f"{what}(job {self.job}, count {self.count})"
        return f"{self.kind}({self.req})" if self.req else f"{self.kind}()"


def parse_events(text: str) -> list[Event]:
    """The inverse of `str(Event)` over a `;`-separated program:
    ``"arrive(r0) ; step(admit=r0) ; ack(job 0, count 2) ; reset()"`` -> events."""
    out: list[Event] = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        m = re.fullmatch(r"(\w+)\((.*)\)", item)
        if m is None:
            raise ValueError(f"not an event: {item!r}")
        kind, arg = m.group(1), m.group(2).strip()
        if kind == "step":
            out.append(Event("step", arg.split("=", 1)[1] if arg else None))
        elif kind in ("ack", "fail"):
            nums = re.fullmatch(r"job (\d+), count (\d+)", arg)
            if nums is None:
                raise ValueError(f"not a report: {item!r}")
            out.append(Event("report", job=int(nums.group(1)), count=int(nums.group(2)),
                             failed=kind == "fail"))
        elif kind in ("arrive", "promote", "finish", "abort", "preempt", "reset"):
            out.append(Event(kind, arg or None))  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown event kind {kind!r} in {item!r}")
    return out


def initial(bounds: Bounds) -> ModelState:
    return ModelState(bounds, free_blocks=frozenset(range(bounds.gpu_blocks)))


def _allocation(b: Bounds, tokens: int, computed: int, short: bool = False
                ) -> tuple[int, ...]:
    """The shape of the block table the core allocates for a request admitted with
    `computed` tokens already computed (the hit): a block per `tokens_per_block` tokens in
    each group, 0 for a block to allocate, NULL_BLOCK where a window group needs none (before
    the window of the first token to compute: for a Mamba group, every position before the
    hit's state). A `short` hit ends one (vLLM) token before its last model token's end, so
    a window reaches as far back as it does from one model token less (vLLM's core skips
    the tokens before the window of `computed - 1`)."""
    return tuple(NULL_BLOCK if p < b.skipped_blocks(g, max(0, computed - short)) else 0
                 for g in range(len(b.groups)) for p in range(b.blocks_of(tokens)))


def _free_before_window(w: World) -> None:
    """The core frees a running request's window-group blocks that fell out of the window
    (`remove_skipped_blocks`, which vLLM runs as it schedules the request's next step)."""
    b = w.bounds
    if not b.window_groups():
        return
    for r, c in sorted(w.core.items()):
        if c.status != "running" or not c.blocks:
            continue
        table = list(c.blocks)
        freed: list[int] = []
        for i in b.freed_positions(len(table), c.computed):
            if table[i] != NULL_BLOCK:
                freed.append(table[i])
                table[i] = NULL_BLOCK
        if freed:
            free(w, tuple(freed))
            w.core[r] = c._replace(blocks=tuple(table))


def _decode_blocks(w: World, r: str) -> tuple[int, ...] | None:
    """The blocks the core adds to running request `r`'s table for its next token (one per
    group, group by group, when the token starts a block; none otherwise), taken from the
    free pool and added to its table; None: no free block, so the core does not schedule it
    this step (vLLM would preempt a request for room: the environment's `preempt`)."""
    c, b = w.core[r], w.bounds
    n = len(b.groups)
    if b.blocks_of(c.computed + 1) <= len(c.blocks) // n:
        return ()
    if len(w.free_blocks) < n:
        return None
    grown = tuple(sorted(w.free_blocks)[:n])
    w.free_blocks.difference_update(grown)
    w.core[r] = c._replace(blocks=w.extend_table(c.blocks, grown))
    return grown


def _name_in_failed_recving(w: World, load: MJob) -> None:
    """Under `Rules.stale_load_failure` FENCE_ONLY the core learns of a failed async load
    from the worker (`failed_recving`, W@0.34.0:306-316), not from the connector: the
    request that waits for that load is marked for recompute (`MCore.recv_failed`)."""
    if (w.bounds.rules.stale_load_failure is not StaleLoadFailure.FENCE_ONLY
            or load.kind != "load" or load.sync):
        return
    c = w.core.get(load.owner)
    if c is not None and c.status == "remote" and c.load_job == load.id:
        w.core[load.owner] = c._replace(recv_failed=True)


def _behind_a_sync_load(w: World, j: MJob) -> bool:
    """An earlier sync load of the same request still has reports due. A worker waits for a
    sync load before the step's forward pass and reports it in that step (W:256-270,
    W:286-329), before any later job of the request, which it submits in a later step
    (W:272-284): so no worker reports a later job first."""
    return any(o.owner == j.owner and o.kind == "load" and o.sync and o.id < j.id
               and o.unreported > 0 for o in (*w.jobs.values(), *w.held.values()))


def _inside(w: World, call: Call) -> None:
    """Keep the abstract state as the hook `call` left it, inside the step."""
    if w.keep_inside:
        w.inside.append((call, abstract(w.freeze(), step_open=True)))


def apply(s: ModelState, ev: Event, faults: Faults = NO_FAULTS,
          victims: tuple[int, ...] | None = None, inside: bool = False,
          tables: Tables = SPEC_TABLES) -> tuple[ModelState, list[Call], World]:
    """The state after `ev`, the hook calls it stands for, and the working world (for its
    coverage record). NotEnabled: the environment cannot send `ev` here; any other
    ModelError: the spec (or a fault) breaks on it. With `inside`, the world also keeps the
    abstract state after each hook that returns inside a step (`World.inside`), where the
    implementation checks the invariants too."""
    w = World.thaw(s)
    w.faults = faults
    w.tables = tables
    w.victim_choice = victims
    w.keep_inside = inside
    calls: list[Call] = []
    b = s.bounds
    if ev.kind == "arrive":
        assert ev.req is not None
        if ev.req in w.core:
            raise NotEnabled("already arrived")
        w.core[ev.req] = MCore()
        fire(w, "request", ev.req, "add")
        calls.append(Call("on_new_request", (ev.req,)))
    elif ev.kind in ("step", "promote"):
        new: dict[str, tuple[int, ...]] = {}
        cached: dict[str, tuple[int, ...]] = {}
        sched: dict[str, int] = {}
        resumed: frozenset[str] = frozenset()
        if ev.kind == "promote":
            # the core's waiting loop reaches a request whose async load ended, caches the
            # loaded blocks (handing off their state) but does not schedule it in this step
            # (no budget, no room); it admits no one else
            r = ev.req
            assert r is not None
            c = w.core.get(r)
            if not b.handoff_groups():
                raise NotEnabled("no hand-off groups: a promotion is not seen by the connector")
            if c is None or c.status != "waiting" or not c.blocks or c.promoted:
                raise NotEnabled("no loaded request to promote")
            w.core[r] = c._replace(promoted=True)
            resumed = frozenset({r})
        elif ev.req is not None:
            r = ev.req
            c = w.core.get(r)
            if c is None or c.status != "waiting":
                raise NotEnabled("not waiting")
            tokens = w.num_tokens(r)
            if not c.blocks:
                hit, is_async = lookup(w, r)
                calls.append(Call("get_num_new_matched_tokens", (r, 0), (hit, is_async)))
                _inside(w, calls[-1])
                shape = _allocation(b, tokens, hit or 0, w.short_hit)
                need = sum(1 for x in shape if x != NULL_BLOCK)
                if hit is not None and len(w.free_blocks) >= need:
                    pool = iter(sorted(w.free_blocks)[:need])
                    blocks = tuple(x if x == NULL_BLOCK else next(pool) for x in shape)
                    w.free_blocks.difference_update(blocks)
                    w.core[r] = c._replace(blocks=blocks)  # allocate_slots, then the hook
                    alloc(w, r, blocks, hit)
                    calls.append(Call("update_state_after_alloc", (r, blocks, hit)))
                    _inside(w, calls[-1])
                    loader = w.last_job if hit else None  # the load just created
                    if hit and is_async:
                        w.core[r] = MCore("remote", 0, blocks, loading=hit, load_job=loader,
                                          generated=c.generated)
                    else:
                        w.core[r] = MCore("running", hit, blocks, load_job=loader,
                                          generated=c.generated)
                        new[r] = blocks
                        sched[r] = 1
            else:  # an async load ended: it runs now, without a lookup
                w.core[r] = c._replace(status="running", promoted=False)
                new[r] = c.blocks
                sched[r] = 1
                if not c.promoted:
                    resumed = frozenset({r})  # the core caches the loaded blocks now
        for r, c in sorted(w.core.items()):
            if c.status == "running" and r not in sched and c.computed < w.tokens_to_compute(r):
                grown = _decode_blocks(w, r)
                if grown is not None:
                    cached[r] = grown
                    sched[r] = 1
        fin, pre = frozenset(w.pending_finished), frozenset(w.pending_preempted)
        given = handoffs(w, sched, resumed)
        tails, copies = tail_handoffs(w, new, sched)
        for r, entries in tails.items():
            given[r] = given.get(r, ()) + entries
        given = dict(sorted(given.items()))  # by request id: the builders' order
        build_meta(w, new, cached, sched, fin, pre, given)
        free(w, tuple(dst for _, dst in copies))
        computed = {r: (c.computed, c.aborted) for r, c in w.core.items()}
        for r, n in sched.items():
            c = w.core[r]
            w.core[r] = c._replace(computed=min(c.computed + n, w.num_tokens(r)))
            w.sample(r)
        # the output each request holds once the step ran (vLLM's update_from_output)
        outputs = {r: c.generated for r, c in sorted(w.core.items()) if c.generated}
        calls.append(Call("build_connector_meta", (dict(new), dict(cached), dict(sched),
                                                   fin, pre, computed, given, copies,
                                                   outputs)))
        _free_before_window(w)
        w.pending_finished.clear()
        w.pending_preempted.clear()
        follow_connector(w)
    elif ev.kind == "report" and ev.job is not None and ev.job < w.threshold and \
            ev.job not in w.held:
        if not b.stray_reports:
            raise NotEnabled("no stray reports in these bounds")
        fire(w, "fence", None, "drained_report", count=ev.count)
        calls.append(Call("update_connector_output", (ev.job, ev.count, 0, frozenset())))
    elif ev.kind == "report":
        assert ev.job is not None
        due = (w.jobs.get(ev.job) or w.held.get(ev.job))
        if due is None or (due.age is None and ev.job in w.jobs):
            raise NotEnabled("not shipped")
        if ev.count < 1 or ev.count > due.unreported:
            raise NotEnabled("count")
        if _behind_a_sync_load(w, due):
            raise NotEnabled("each worker reports a request's sync load before its later jobs")
        if ev.count > due.pending:
            raise ModelError(f"job {ev.job}: {ev.count} reports from the workers but only "
                             f"{due.pending} due by the scheduler's count (over-ack)")
        if ev.failed:
            if w.budget[1] >= b.failures:
                raise NotEnabled("failure budget")
            w.budget[1] += 1
        owner = due.owner
        completes = ev.count == due.unreported and due.kind == "load" and not due.sync
        if ev.failed:
            truth.failed_copy(w, ev.job)  # before the connector hears of it
            _name_in_failed_recving(w, due)
        report(w, ev.job, 0 if ev.failed else ev.count, ev.count if ev.failed else 0)
        for table in (w.jobs, w.held):
            if ev.job in table:
                table[ev.job] = table[ev.job]._replace(
                    unreported=table[ev.job].unreported - ev.count)
        recving = {owner} if completes and w.core.get(owner, MCore()).status in (
            "remote", "finished") else set()
        still_due = ((j.owner, j.kind, j.sync, j.id)
                     for j in (*w.jobs.values(), *w.held.values()))
        if recving and owner in w.reqs and w.reqs[owner].state == R.ORPHANED_LOAD and \
                (Fault.STALE_RECVING_PROMOTES in w.faults
                 or not R.recving_is_stale(owner, ev.job, still_due)):
            fire(w, "request", owner, "load_recving")
        calls.append(Call("update_connector_output", (ev.job, 0 if ev.failed else ev.count,
                                                      ev.count if ev.failed else 0,
                                                      frozenset(recving))))
        follow_connector(w)
    elif ev.kind == "abort" and ev.req not in w.core:
        assert ev.req is not None  # aborted before the connector ever saw it
        w.core[ev.req] = MCore("finished", aborted=True)
        finish(w, ev.req)
        calls.append(Call("request_finished", (ev.req, True)))
    elif ev.kind in ("finish", "abort"):
        assert ev.req is not None
        r = ev.req
        c = w.core.get(r)
        if c is None or c.status == "finished":
            raise NotEnabled("not live")
        if ev.kind == "finish" and not w.may_finish(r):
            raise NotEnabled("not done")
        keep = c.status == "remote"
        if not keep:
            free(w, c.blocks)
        w.core[r] = c._replace(status="finished", blocks=c.blocks if keep else (),
                               aborted=ev.kind == "abort", loading=0, recv_failed=False)
        finish(w, r)
        calls.append(Call("request_finished", (r, ev.kind == "abort")))
        w.pending_finished.add(r)
    elif ev.kind == "preempt":
        assert ev.req is not None
        r = ev.req
        c = w.core.get(r)
        if c is None or c.status != "running":
            raise NotEnabled("not running")
        if w.sampled_last(r):
            raise NotEnabled("sampled its last token: it finishes")
        if w.budget[2] >= b.preemptions:
            raise NotEnabled("preemption budget")
        w.budget[2] += 1
        free(w, c.blocks)
        w.core[r] = c.restarted()
        w.pending_preempted.add(r)
    elif ev.kind == "reset":
        if w.budget[0] >= b.resets:
            raise NotEnabled("reset budget")
        w.budget[0] += 1
        reset(w)
        calls.append(Call("reset_cache", ()))
        follow_connector(w)
    return w.freeze(), calls, w


def events(s: ModelState) -> Iterator[Event]:
    """Every event the environment may send in `s` (the checker tries each; `apply` raises
    NotEnabled on those it cannot take after all). None that needs a spent budget: a reset,
    a preemption, a failed report (`apply` checks the same budgets)."""
    b = s.bounds
    resets, failures, preemptions = s.budget
    core = dict(s.core)
    for t in b.templates():
        if t.req_id not in core:
            yield Event("arrive", t.req_id)
            yield Event("abort", t.req_id)
    yield Event("step")
    for r, c in sorted(core.items()):
        if c.status == "waiting":
            yield Event("step", r)
            if c.blocks and not c.promoted and b.handoff_groups():
                yield Event("promote", r)
        if c.status == "running":
            if c.computed >= b.tokens:
                yield Event("finish", r)
            if preemptions < b.preemptions:
                yield Event("preempt", r)
        if c.status != "finished":
            yield Event("abort", r)
    for j in (*s.jobs, *s.held):
        if j.age is None and j.state not in J.HELD:
            continue
        if j.unreported == 0:
            continue
        counts = sorted({1, j.unreported}) if b.partial_reports else [j.unreported]
        for n in counts:
            yield Event("report", job=j.id, count=n)
            if failures < b.failures:
                yield Event("report", job=j.id, count=n, failed=True)
    if b.stray_reports:
        for jid in range(s.threshold):
            if all(j.id != jid for j in s.held):
                yield Event("report", job=jid, count=1)
                break
    if resets < b.resets:
        yield Event("reset")


FairClass = tuple[str, str | int | None]
"""A weakly fair class of `spec.progress.FAIRNESS`: (its name, the request or job it is
for, or None)."""


def fair_class(ev: Event, s: ModelState) -> FairClass | None:
    """The weakly fair class `ev` belongs to in `s` (None: an environment's choice). A report
    of a job that is neither in the table nor held (a stray report of a drained stale id) is
    the environment's."""
    if ev.kind == "step":
        return ("admit", ev.req) if ev.req is not None else ("step", None)
    if ev.kind == "finish":
        return ("finish", ev.req)
    if ev.kind == "report" and any(j.id == ev.job for j in (*s.jobs, *s.held)):
        return ("report", ev.job)
    return None


def successors(s: ModelState, faults: Faults = NO_FAULTS, inside: bool = False,
               tables: Tables = SPEC_TABLES) -> Iterator[
        tuple[Event, ModelState | ModelError, list[Call], World | None]]:
    """(event, next state or the ModelError it raised, calls, world) for every enabled event."""
    for ev in events(s):
        try:
            nxt, calls, w = apply(s, ev, faults, inside=inside, tables=tables)
        except NotEnabled:
            continue
        except ModelError as exc:
            yield ev, exc, [], None
            continue
        yield ev, nxt, calls, w

