"""The monitor's checker: one event at a time, the same for a live vLLM and a replayed log.

`SpecMonitor.observe(event)` applies the event's delta to its mirror of the abstract state
and reports, as `Finding`s:
- **moves off the tables**: every request, job and the reset fence that the delta changed
  moved from its state before to its state after by a path of rows of its table whose hooks
  the called hook may fire (`spec.hooks.rows_within`); a subject that appears starts in its
  table's initial state, a job that leaves both the job table and the reset fence ends in a
  final or held state (`spec.job` STALE, TIMED_OUT);
- **invariants**: the local invariants of `spec.invariants` over the part of the state the
  event touched (its requests, their jobs and those jobs' owners), and those of
  `WHOLE_STATE` over the whole mirror every `whole_every` steps (0: only at `finish`);
- **progress a finite log can refute**: a request that has held a job id for
  `stuck_after_steps` engine steps with no report of it (INV-13/INV-14; a job id that is not
  in the job table can never be reported, so it is named as such).
`finish()` runs the whole-state invariants and the progress check once more at the end.
Each finding is reported once (per rule, request and jobs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, TypeVar

from spec import job as J
from spec import request as R
from spec.fence import FENCE_MACHINE
from spec.hooks import CORE_TRIGGERS, rows_within
from spec.invariants import WHOLE_STATE, Violation
from spec.invariants import check as check_invariants
from spec.job import JOB_MACHINE
from spec.request import REQUEST_MACHINE
from spec.schema import MachineSpec
from spec.state import AbstractState, HeldJob, JobRecord, RequestRecord
from statemachine.monitor.log import SCALARS, Delta, Event
from statemachine.monitor.translations import extra_triggers


@dataclass(frozen=True)
class Finding:
    """One violation the monitor found: `kind` is `move`, `invariant` or `progress`."""

    kind: str
    rule: str
    message: str
    seq: int
    step: int
    hook: str
    request: str | None = None
    jobs: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = [f"request {self.request!r}"] if self.request else []
        if self.jobs:
            where.append("job" + ("s " if len(self.jobs) > 1 else " ")
                         + ", ".join(map(str, self.jobs)))
        at = f"event {self.seq} (step {self.step}, {self.hook})"
        return f"{self.rule}: {self.message}" + (f" [{'; '.join(where)}]" if where else "") \
            + f" at {at}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rule": self.rule, "message": self.message,
                "seq": self.seq, "step": self.step, "hook": self.hook,
                "request": self.request, "jobs": list(self.jobs)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Finding:
        """The finding `to_json` wrote."""
        return cls(kind=data["kind"], rule=data["rule"], message=data["message"],
                   seq=int(data["seq"]), step=int(data["step"]), hook=data["hook"],
                   request=data.get("request"), jobs=tuple(int(j) for j in data["jobs"]))


# ----------------------------------------------------------------------------- moves
_MACHINES = {m.name: m for m in (REQUEST_MACHINE, JOB_MACHINE, FENCE_MACHINE)}


def _allowed(hook: str, translations: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                 tuple[str, ...]]:
    """The hooks whose rows, and the extra triggers, a call of `hook` may fire."""
    return rows_within(hook), (*CORE_TRIGGERS, *extra_triggers(translations, hook))


@cache
def _closure_of(name: str, hooks: tuple[str, ...],
                triggers: tuple[str, ...]) -> dict[str, frozenset[str]]:
    """state -> every state a path of rows of `hooks` leads to (itself included), in the
    machine `name` (cached by name: hashing a whole table per call would cost more than
    the search)."""
    machine = _MACHINES[name]
    step: dict[str, set[str]] = {}
    for src, dst, t in machine.edges():
        if t.hook in hooks or t.trigger in triggers:
            step.setdefault(src, set()).add(dst)
    out: dict[str, frozenset[str]] = {}
    for s in machine.state_names:
        seen, todo = {s}, [s]
        while todo:
            for d in step.get(todo.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        out[s] = frozenset(seen)
    return out


def is_move(machine: MachineSpec, hook: str, src: str, dst: str | Iterable[str],
            translations: tuple[str, ...] = ()) -> bool:
    """Whether a path of rows that a call of `hook` may fire (with the core's own moves,
    `spec.hooks.CORE_TRIGGERS`) leads from `src` to `dst` (or to one of the states `dst`
    lists), under the release's `translations` (`statemachine.monitor.translations`)."""
    reach = _closure_of(machine.name, *_allowed(hook, translations)).get(src,
                                                                         frozenset({src}))
    return dst in reach if isinstance(dst, str) else any(d in reach for d in dst)


def path_of(machine: MachineSpec, hook: str, src: str, dst: str | Iterable[str],
            translations: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """The shortest path of rows (source, destination, trigger) that a call of `hook` may
    fire from `src` to `dst` (or to the first of the states `dst` lists it reaches); empty
    where there is none or `src` is already there."""
    targets = (dst,) if isinstance(dst, str) else tuple(dst)
    return list(_path_of(machine.name, *_allowed(hook, translations), src, targets))


@cache
def _path_of(name: str, hooks: tuple[str, ...], triggers: tuple[str, ...], src: str,
             targets: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    machine = _MACHINES[name]
    if src in targets:
        return ()
    back: dict[str, tuple[str, str, str]] = {}
    frontier = [src]
    while frontier:
        nxt = []
        for s in frontier:
            for a, b, t in machine.edges():
                if a == s and (t.hook in hooks or t.trigger in triggers) \
                        and b not in back and b != src:
                    back[b] = (a, b, t.trigger)
                    if b in targets:
                        out = [back[b]]
                        while out[0][0] != src:
                            out.insert(0, back[out[0][0]])
                        return tuple(out)
                    nxt.append(b)
        frontier = nxt
    return ()


JOB_GONE = (*JOB_MACHINE.finals, *J.HELD)
"""Where a job that left the job table and the reset fence may be: ended, or held (`spec.job`
HELD) by a release that keeps no fence (it forgets stale jobs)."""


# ----------------------------------------------------------------------------- the mirror
K = TypeVar("K")
V = TypeVar("V")


def _merge(table: dict[K, V], part: Mapping[K, V | None]) -> None:
    """`part`'s records into `table`; None removes one."""
    for k, v in part.items():
        if v is None:
            table.pop(k, None)
        else:
            table[k] = v


@dataclass
class Mirror:
    """The monitor's copy of the abstract state, kept by the deltas."""

    num_workers: int
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    jobs: dict[int, JobRecord] = field(default_factory=dict)
    fence: dict[int, HeldJob] = field(default_factory=dict)
    quarantine: dict[int, HeldJob] = field(default_factory=dict)
    ref_cnt: dict[int, int] = field(default_factory=dict)
    block_fence: dict[int, frozenset[int]] = field(default_factory=dict)
    signals: dict[str, int] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=lambda: {
        "job_counter": 0, "stale_threshold": 0, "chunks_being_loaded": frozenset(),
        "jobs_to_flush": frozenset(), "step_open": False, "reset_since_last_step": False,
        "stores_after_signal": frozenset()})

    def apply(self, d: Delta) -> None:
        _merge(self.requests, d.requests)
        _merge(self.jobs, d.jobs)
        _merge(self.fence, d.fence)
        _merge(self.quarantine, d.quarantine)
        _merge(self.ref_cnt, d.ref_cnt)
        _merge(self.block_fence, d.block_fence)
        self.signals.update(d.signals)
        self.scalars.update(d.scalars)

    def state(self, requests: Iterable[str] | None = None,
              jobs: Iterable[int] = ()) -> AbstractState:
        """The whole state, or the part closed under ownership around `requests` and
        `jobs`: those requests, every job they hold, those jobs' owners (and theirs)."""
        if requests is None:
            reqs, js = list(self.requests.values()), list(self.jobs.values())
        else:
            want, held = set(requests), set(jobs)
            todo = list(want)
            for j in held:
                if j in self.jobs and self.jobs[j].owner not in want:
                    want.add(self.jobs[j].owner)
                    todo.append(self.jobs[j].owner)
            while todo:
                r = self.requests.get(todo.pop())
                if r is None:
                    continue
                for j in r.transfer_jobs:
                    held.add(j)
                    owner = self.jobs[j].owner if j in self.jobs else None
                    if owner is not None and owner not in want:
                        want.add(owner)
                        todo.append(owner)
            reqs = [self.requests[r] for r in sorted(want) if r in self.requests]
            js = [self.jobs[j] for j in sorted(held) if j in self.jobs]
        sc = self.scalars
        if requests is None:
            ref_cnt = tuple(sorted(self.ref_cnt.items()))
            block_fence = tuple(sorted(self.block_fence.items()))
            signals = tuple(sorted((r, n) for r, n in self.signals.items() if n))
        else:  # the local invariants read no block fence, and the pins of the part's chunks
            keys = {k for j in js for k in j.keys}
            ref_cnt = tuple(sorted((k, self.ref_cnt[k]) for k in keys if k in self.ref_cnt))
            block_fence = ()
            signals = tuple((r, self.signals[r]) for r in sorted(want) if self.signals.get(r))
        return AbstractState(
            num_workers=self.num_workers, requests=tuple(reqs), jobs=tuple(js),
            job_counter=sc["job_counter"], stale_threshold=sc["stale_threshold"],
            reset_fence=tuple(sorted(self.fence.values())),
            quarantine=tuple(sorted(self.quarantine.values())),
            chunks_being_loaded=sc["chunks_being_loaded"], chunk_ref_cnt=ref_cnt,
            block_fence=block_fence, jobs_to_flush=sc["jobs_to_flush"],
            step_open=sc["step_open"], reset_since_last_step=sc["reset_since_last_step"],
            finished_signals=signals,
            stores_after_signal=tuple(sorted(sc["stores_after_signal"])))

    def job_state(self, job_id: int) -> str | None:
        if job_id in self.jobs:
            return self.jobs[job_id].state
        if job_id in self.fence:
            return J.STALE
        if job_id in self.quarantine:
            return J.TIMED_OUT
        return None

    def fence_state(self) -> str:
        return "FENCE_HELD" if self.fence else "FENCE_IDLE"


assert set(Mirror(1).scalars) == set(SCALARS)


# ----------------------------------------------------------------------------- the monitor
@dataclass
class Move:
    machine: str
    subject: str
    src: str
    dst: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    """The rows it took (source, destination, trigger); empty for a move off the tables."""


@dataclass
class Seen:
    """One event as the trace shows it: the event and the moves it made."""

    event: Event
    moves: list[Move]


class SpecMonitor:
    """Checks events against the spec (see the module docstring)."""

    def __init__(self, num_workers: int, *, stuck_after_steps: int | None = 32,
                 whole_every: int = 1, trace_len: int | None = 512,
                 translations: tuple[str, ...] = ()) -> None:
        self.translations = translations
        self.mirror = Mirror(num_workers)
        self.stuck_after_steps = stuck_after_steps
        self.whole_every = whole_every
        self.trace: deque[Seen] = deque(maxlen=trace_len)
        self.findings: list[Finding] = []
        self._reported: set[tuple[str, str | None, tuple[int, ...]]] = set()
        self._since: dict[int, int] = {}
        """job id -> the step of its creation or of its last report (held ids only)."""
        self._holder: dict[int, str] = {}
        self._held_by: dict[str, frozenset[int]] = {}
        self.step = 0
        self.events = 0
        self._last: Event | None = None
        self._verdicts: dict[tuple[str, str, str, str | tuple[str, ...]],
                             tuple[bool, list[tuple[str, str, str]]]] = {}

    # -- the event ---------------------------------------------------------------------
    def observe(self, event: Event) -> list[Finding]:
        m = self.mirror
        self.events += 1
        self.step = event.step
        self._last = event
        before_req = {r: m.requests.get(r) for r in event.delta.requests}
        before_job = {j: m.job_state(j) for j in (*event.delta.jobs, *event.delta.fence,
                                                  *event.delta.quarantine)}
        before_fence = m.fence_state()
        due = self._due(event) if event.hook == "update_connector_output" else {}
        m.apply(event.delta)
        out: list[Finding] = []
        moves = self._moves(event, before_req, before_job, before_fence, out)
        if due:
            self._count_reports(event, due, out)
        if event.error is not None:
            self._add(out, Finding("crash", "hook raised", event.error, event.seq, event.step,
                                   event.hook, event.args.get("request")))
        self.trace.append(Seen(event, moves))
        self._reports(event)
        touched_jobs = set(event.delta.jobs) | set(event.delta.fence) \
            | set(event.delta.quarantine)
        if event.hook == "reset_cache":
            self._invariants(event, check_invariants(m.state(), without=WHOLE_STATE), out)
        elif event.delta:  # an event that changed nothing breaks nothing local
            part = m.state(event.delta.requests, touched_jobs)
            self._invariants(event, check_invariants(part, without=WHOLE_STATE), out)
        if self.whole_every and event.hook == "build_connector_meta" \
                and event.step % self.whole_every == 0:
            self._whole(event, out)
        if event.hook in ("build_connector_meta", "update_connector_output"):
            self._progress(event, out)
        return out

    def finish(self) -> list[Finding]:
        """The checks of the end of a log: the whole-state invariants, and progress."""
        if self._last is None:
            return []
        out: list[Finding] = []
        self._whole(self._last, out)
        self._progress(self._last, out)
        return out

    # -- checks ------------------------------------------------------------------------
    def _add(self, out: list[Finding], f: Finding) -> None:
        key = (f.rule, f.request, f.jobs)
        if key in self._reported:
            return
        self._reported.add(key)
        self.findings.append(f)
        out.append(f)

    def _verdict(self, machine: MachineSpec, hook: str, src: str,
                 dst: str | tuple[str, ...]) -> tuple[bool, list[tuple[str, str, str]]]:
        """Whether `src` -> `dst` is a move a call of `hook` may make (`is_move`) and the
        rows it took (`path_of`), remembered per (machine, hook, src, dst): a handful of
        combinations recur at every step."""
        key = (machine.name, hook, src, dst)
        got = self._verdicts.get(key)
        if got is None:
            got = self._verdicts[key] = (
                is_move(machine, hook, src, dst, self.translations),
                path_of(machine, hook, src, dst, self.translations))
        return got

    def _moves(self, ev: Event, before_req: dict[str, RequestRecord | None],
               before_job: dict[int, str | None], before_fence: str,
               out: list[Finding]) -> list[Move]:
        m, moves, hook = self.mirror, [], ev.hook
        requests, jobs, verdict = m.requests, m.jobs, self._verdict
        for rid, old in before_req.items():
            new = requests.get(rid)
            src = old.state if old else R.ABSENT
            dst = new.state if new else R.ABSENT
            if src != dst:
                ok, rows = verdict(REQUEST_MACHINE, hook, src, dst)
                moves.append(Move("request", rid, src, dst, list(rows)))
                if not ok:
                    self._add(out, Finding(
                        "move", "request table", f"{src} -> {dst} is no path of rows that "
                        f"{hook} may fire", ev.seq, ev.step, hook, rid))
        for jid, src_state in before_job.items():
            rec = jobs.get(jid)
            dst_state = rec.state if rec is not None else m.job_state(jid)
            src = src_state or JOB_MACHINE.initial
            owner = rec.owner if rec is not None else None
            if src_state is None and rec is not None and rec.pending_count != m.num_workers:
                self._add(out, Finding("invariant", "allocate_job", f"a new job is due "
                                       f"{rec.pending_count} report(s), not one per "
                                       f"worker ({m.num_workers})", ev.seq, ev.step, hook,
                                       owner, (jid,)))
            if dst_state is None:
                ok, rows = verdict(JOB_MACHINE, hook, src, JOB_GONE)
                dst = "(left the table)"
            else:
                ok, rows = verdict(JOB_MACHINE, hook, src, dst_state)
                dst = dst_state
            if src != dst:
                moves.append(Move("job", str(jid), src, dst, list(rows)))
            if not ok:
                self._add(out, Finding("move", "job table", f"{src} -> {dst} is no path of "
                                       f"rows that {hook} may fire", ev.seq, ev.step,
                                       hook, owner, (jid,)))
        after_fence = m.fence_state()
        if after_fence != before_fence:
            ok, rows = verdict(FENCE_MACHINE, hook, before_fence, after_fence)
            moves.append(Move("fence", "reset fence", before_fence, after_fence, list(rows)))
            if not ok:
                self._add(out, Finding("move", "fence table", f"{before_fence} -> "
                                       f"{after_fence} is no path of rows that {hook} "
                                       "may fire", ev.seq, ev.step, hook))
        return moves

    def _due(self, ev: Event) -> dict[int, tuple[str, int, int]]:
        """For each job the event reports: where it is held, the reports it was due, and the
        reports this event brings (acks and failures)."""
        m = self.mirror
        reports: dict[int, int] = {}
        for part in ("acks", "failed"):
            for j, n in (ev.args.get(part) or {}).items():
                reports[int(j)] = reports.get(int(j), 0) + int(n)
        out: dict[int, tuple[str, int, int]] = {}
        for j, n in reports.items():
            if j in m.jobs:
                out[j] = ("jobs", m.jobs[j].pending_count, n)
            elif j in m.fence:
                out[j] = ("fence", m.fence[j].reports_due, n)
            elif j in m.quarantine:
                out[j] = ("quarantine", m.quarantine[j].reports_due, n)
        return out

    def _count_reports(self, ev: Event, due: dict[int, tuple[str, int, int]],
                       out: list[Finding]) -> None:
        """The job table's guard `reports_complete` (`spec.job`): a job ends exactly when
        its last report arrives, and no job gets more reports than it is due."""
        m = self.mirror
        for j, (where, was, got) in sorted(due.items()):
            left = was - got
            table = getattr(m, where)
            owner = m.jobs[j].owner if j in m.jobs else None
            if left < 0:
                self._add(out, Finding("invariant", "reports_complete", f"job was due {was} "
                                       f"report(s) and got {got}: an over-count report",
                                       ev.seq, ev.step, ev.hook, owner, (j,)))
            elif j not in table and left > 0:
                self._add(out, Finding("invariant", "reports_complete", f"job ended with "
                                       f"{left} of its reports still due (due {was}, got "
                                       f"{got})", ev.seq, ev.step, ev.hook, owner, (j,)))
            elif j in table:
                now = (table[j].pending_count if where == "jobs" else table[j].reports_due)
                if left == 0:
                    place = {"jobs": "job table", "fence": "reset fence"}.get(where, where)
                    self._add(out, Finding("invariant", "reports_complete", "every report "
                                           f"arrived but the job stays in the {place}",
                                           ev.seq, ev.step, ev.hook, owner, (j,)))
                elif left > 0 and now != left:
                    self._add(out, Finding("invariant", "reports_complete", f"{now} report(s) "
                                           f"still due after this one; {was} - {got} = "
                                           f"{left} expected", ev.seq, ev.step, ev.hook,
                                           owner, (j,)))

    def _invariants(self, ev: Event, violations: Sequence[Violation],
                    out: list[Finding]) -> None:
        for v in violations:
            self._add(out, Finding("invariant", v.invariant, v.message, ev.seq, ev.step,
                                   ev.hook, v.request, v.jobs))

    def _whole(self, ev: Event, out: list[Finding]) -> None:
        state = self.mirror.state()
        only = [v for v in check_invariants(state) if v.invariant in WHOLE_STATE]
        self._invariants(ev, only, out)

    def _reports(self, ev: Event) -> None:
        """Keeps, for every job id a request holds, the step of its last report."""
        m = self.mirror
        for rid in ev.delta.requests:
            r = m.requests.get(rid)
            held = r.transfer_jobs if r else frozenset()
            had = self._held_by.get(rid, frozenset())
            if held == had:
                continue
            for j in held - had:
                self._since.setdefault(j, ev.step)
                self._holder[j] = rid
            for j in had - held:
                if self._holder.get(j) == rid:
                    del self._holder[j]
                    self._since.pop(j, None)
            if held:
                self._held_by[rid] = held
            else:
                self._held_by.pop(rid, None)
        if ev.hook == "update_connector_output":
            for j in (*ev.args.get("acks", {}), *ev.args.get("failed", {})):
                jid = int(j)
                if jid in self._since:
                    self._since[jid] = ev.step

    def _progress(self, ev: Event, out: list[Finding]) -> None:
        n = self.stuck_after_steps
        if not n:
            return
        m = self.mirror
        for jid, since in sorted(self._since.items()):
            if ev.step - since < n:
                continue
            rid = self._holder[jid]
            known = jid in m.jobs or jid in m.fence or jid in m.quarantine
            why = ("" if known else f": job {jid} is not in the job table, so no report can "
                   "ever end it and the request never runs again")
            self._add(out, Finding(
                "progress", "INV-13 jobs-drain", f"request has held job {jid} for "
                f"{ev.step - since} steps with no report of it{why}", ev.seq, ev.step,
                ev.hook, rid, (jid,)))

    # -- the trace ---------------------------------------------------------------------
    def trace_of(self, finding: Finding) -> list[Seen]:
        """The events (of those kept) that led to `finding`: each event up to it that moved
        or named its request or its jobs, and every reset."""
        jobs = {str(j) for j in finding.jobs}
        out = []
        for seen in self.trace:
            ev = seen.event
            if ev.seq > finding.seq:
                break
            if ev.seq == finding.seq or ev.hook == "reset_cache" or _names(seen, finding.request,
                                                                          jobs):
                out.append(seen)
        return out


def _names(seen: Seen, request: str | None, jobs: set[str]) -> bool:
    """Whether the event moved `request` or one of `jobs`, was a hook called for the
    request, or reported one of the jobs."""
    ev = seen.event
    if request is not None and (request in ev.delta.requests
                                or ev.args.get("request") == request):
        return True
    if jobs and (jobs & {str(j) for j in ev.delta.jobs} or jobs & set(ev.args.get("acks", {}))):
        return True
    return any(mv.subject in jobs for mv in seen.moves)


def relevant_moves(seen: Seen, finding: Finding) -> list[Move]:
    """The moves of `seen` a reader of `finding` needs: those of its request and jobs (all
    of them where the finding names neither)."""
    if finding.request is None and not finding.jobs:
        return seen.moves
    jobs = {str(j) for j in finding.jobs}
    return [mv for mv in seen.moves if mv.subject == finding.request or mv.subject in jobs
            or mv.machine == "fence"]


def format_trace(seen: Sequence[Seen], finding: Finding) -> str:
    """The numbered trace a reviewer reads: one line per event, the moves of the finding's
    request and jobs under it."""
    lines = [f"first violation: {finding}", ""]
    for s in seen:
        ev = s.event
        lines.append(f"  #{ev.seq:<5} step {ev.step:<4} {ev.hook}({_short(ev.args)})")
        for mv in relevant_moves(s, finding):
            rows = " (" + ", ".join(t for _a, _b, t in mv.rows) + ")" if mv.rows else ""
            lines.append(f"           {mv.machine} {mv.subject}: {mv.src} -> {mv.dst}{rows}")
    return "\n".join(lines)


def _short(args: dict[str, Any], limit: int = 110) -> str:
    parts = []
    for k, v in args.items():
        if v in (None, [], {}, ()):
            continue
        text = f"{k}={v}"
        parts.append(text)
    out = ", ".join(parts)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def with_findings(event: Event, findings: Sequence[Finding]) -> Event:
    return replace(event, findings=[f.to_json() for f in findings])


def report_text(monitor: SpecMonitor, found: Sequence[Finding]) -> str:
    """What a monitor reports for one event's findings: the first with the trace that led
    to it, then the others."""
    first = found[0]
    text = format_trace(monitor.trace_of(first), first)
    if len(found) > 1:
        text += "\n  and " + "\n  and ".join(str(f) for f in found[1:])
    return text


__all__ = ["JOB_GONE", "Finding", "Mirror", "Move", "Seen", "SpecMonitor", "format_trace",
           "is_move", "path_of", "relevant_moves", "report_text", "with_findings"]
