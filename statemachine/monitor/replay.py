"""`kvspec replay LOG`: a monitor's event log checked offline against the spec.

The same checker as the live monitor (`statemachine.monitor.checker`), with everything on:
every move of every event a row of the tables, the local invariants after every event and
the whole-state ones after every step, and at the end of the log the progress a finite log
can refute (a request holding a job with no report for `stuck_after_steps` steps). The
verdict is the list of findings, the first one with the numbered trace that led to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from statemachine.monitor.checker import (
    Finding,
    Seen,
    SpecMonitor,
    format_trace,
    relevant_moves,
)
from statemachine.monitor.log import Header, Log, LogFollower, MalformedLog, read_log

DEFAULT_STUCK_AFTER_STEPS = 32


@dataclass
class Verdict:
    log: Log
    findings: list[Finding]
    trace: list[Seen] = field(default_factory=list)
    """The trace of the first finding."""
    steps: int = 0
    requests: int = 0
    jobs: int = 0
    moves: int = 0
    event_count: int | None = None
    """The events checked, where the log's events were not kept (`follow`)."""

    @property
    def events(self) -> int:
        return len(self.log.events) if self.event_count is None else self.event_count

    @property
    def clean(self) -> bool:
        return not self.findings

    def text(self) -> str:
        h = self.log.header
        source = f"vLLM {h.vllm}" if h.vllm[:1].isdigit() else h.vllm
        lines = [f"{self.log.path}: {source}, {h.num_workers} worker(s), monitor mode "
                 f"{h.mode}; {self.events} events, {self.steps} steps, "
                 f"{self.requests} requests, {self.jobs} jobs, {self.moves} moves checked"]
        if self.log.truncated is not None:
            lines.append(f"note: line {self.log.truncated} is cut short (the writer stopped "
                         "in the middle of it); the events before it were checked")
        if self.clean:
            lines.append("clean: every move is a row of the tables, every invariant holds, "
                         "no request holds a job unreported past the bound")
            return "\n".join(lines)
        lines.append(f"{len(self.findings)} violation(s)\n")
        lines.append(format_trace(self.trace, self.findings[0]))
        if len(self.findings) > 1:
            lines.append("\nthen:")
            lines.extend(f"  {f}" for f in self.findings[1:])
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        h = self.log.header
        return {
            "log": self.log.path, "vllm": h.vllm, "num_workers": h.num_workers,
            "mode": h.mode, "events": self.events, "steps": self.steps,
            "requests": self.requests, "jobs": self.jobs, "moves": self.moves,
            "truncated_line": self.log.truncated,
            "verdict": "clean" if self.clean else "violation",
            "findings": [f.to_json() for f in self.findings],
            "trace": [{"seq": s.event.seq, "step": s.event.step, "hook": s.event.hook,
                       "line": s.event.line, "args": s.event.args,
                       "moves": [{"machine": m.machine, "subject": m.subject, "from": m.src,
                                  "to": m.dst, "rows": [t for _a, _b, t in m.rows]}
                                 for m in relevant_moves(s, self.findings[0])]}
                      for s in self.trace],
        }


def replay(path: str | Path, stuck_after_steps: int | None = None,
           whole_every: int = 1) -> Verdict:
    """Checks the log at `path` (`LogError` where it cannot be read); `stuck_after_steps`
    overrides the bound the log's header names (default 32); the whole-state invariants
    are checked every `whole_every` steps (0: only at the end of the log)."""
    log = read_log(path)
    mon = _monitor(log.header, stuck_after_steps, whole_every, None)
    requests: set[str] = set()
    jobs: set[int] = set()
    for ev in log.events:
        mon.observe(ev)
        requests.update(ev.delta.requests)
        jobs.update(ev.delta.jobs)
    mon.finish()
    verdict = Verdict(log=log, findings=list(mon.findings),
                      steps=log.events[-1].step if log.events else 0,
                      requests=len(requests), jobs=len(jobs),
                      moves=sum(len(s.moves) for s in mon.trace))
    if mon.findings:
        verdict.trace = mon.trace_of(mon.findings[0])
    return verdict


def _monitor(header: Header, stuck_after_steps: int | None, whole_every: int,
             trace_len: int | None) -> SpecMonitor:
    """The checker of a log with this header: `stuck_after_steps` overrides the header's
    bound (default 32)."""
    bound = stuck_after_steps or header.stuck_after_steps or DEFAULT_STUCK_AFTER_STEPS
    return SpecMonitor(header.num_workers, stuck_after_steps=bound, whole_every=whole_every,
                       trace_len=trace_len, translations=header.translations)


def follow(path: str | Path, stop: Callable[[], bool],
           on_findings: Callable[[SpecMonitor, list[Finding]], None] | None = None,
           stuck_after_steps: int | None = None, poll_s: float = 0.05,
           trace_len: int = 512, whole_every: int = 1) -> Verdict:
    """Checks the log at `path` while its writer appends to it, as `replay` does, and hands
    each event's findings to `on_findings` as they are found. When no new line has come
    and `stop()` says the writer is done, it reads what is left, runs the end-of-log
    checks and returns the verdict. Memory stays bounded: the events are not kept, only
    the last `trace_len` for the traces, and requests and jobs are counted as they first
    appear (`LogError` as `replay`)."""
    follower = LogFollower(path)
    mon: SpecMonitor | None = None
    requests = jobs = moves = steps = 0
    done = last = False
    first_trace: list[Seen] = []
    try:
        while not last:
            events = follower.poll()
            if not events:
                if done:  # the writer stopped: what it left without a newline, if any
                    events, last = follower.finish(), True
                else:
                    if stop():
                        done = True  # one more read: what it wrote before it stopped
                    else:
                        time.sleep(poll_s)
                    continue
            if mon is None and follower.header is not None:
                mon = _monitor(follower.header, stuck_after_steps, whole_every, trace_len)
            for ev in events:
                assert mon is not None
                seen_r, seen_j = mon.mirror.requests, mon.mirror.jobs  # counted as they
                requests += sum(1 for r, rec in ev.delta.requests.items()  # appear, not kept
                                if rec is not None and r not in seen_r)
                jobs += sum(1 for j, rec in ev.delta.jobs.items()
                            if rec is not None and j not in seen_j)
                found = mon.observe(ev)
                moves += len(mon.trace[-1].moves)
                steps = ev.step
                if found and not first_trace:  # kept now: the window moves on
                    first_trace = mon.trace_of(mon.findings[0])
                if found and on_findings is not None:
                    on_findings(mon, found)
    finally:
        follower.close()
    if follower.header is None:
        raise MalformedLog(str(path), 1, "schema", "empty log: no header line")
    if mon is None:
        mon = _monitor(follower.header, stuck_after_steps, whole_every, trace_len)
    end = mon.finish()
    if end and not first_trace:
        first_trace = mon.trace_of(mon.findings[0])
    if end and on_findings is not None:
        on_findings(mon, end)
    log = Log(path=str(path), header=follower.header, events=[],
              truncated=follower.truncated)
    verdict = Verdict(log=log, findings=list(mon.findings), steps=steps, requests=requests,
                      jobs=jobs, moves=moves, event_count=follower.events, trace=first_trace)
    return verdict


def trace_counterexample(verdict: Verdict) -> Any:
    """The first finding's trace in the shape `statemachine.diagrams.counterexample_graph`
    draws (steps with their moves as table rows)."""
    steps = []
    for s in verdict.trace:
        moves = [(m.machine, m.subject, a, b, t) for m in relevant_moves(s, verdict.findings[0])
                 for a, b, t in m.rows]
        steps.append(SimpleNamespace(moves=moves, event=f"#{s.event.seq} {s.event.hook}"))
    first = verdict.findings[0]
    return SimpleNamespace(steps=steps, cycle_start=None, kind=first.kind,
                           summary=str(first))


__all__ = ["DEFAULT_STUCK_AFTER_STEPS", "Verdict", "follow", "replay", "trace_counterexample"]
