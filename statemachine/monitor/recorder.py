"""Event logs of any scheduler side that projects itself: our reference, or your own.

`HookRecorder(scheduler, writer, monitor)` wraps the scheduler-side hooks of an object with
vLLM's hook names and an `abstract_state()` (our `OffloadingScheduler`, or an engineer's
own scheduler with a projection onto `spec.AbstractState`). After each hook it projects the
whole state, writes the event (`delta_between` the state before and after) to the log and
hands it to the monitor, if given. It projects everything after every hook, so it is for
tests and simulations, not for production (the live connector projects only what each hook
touched).

    recorder = HookRecorder(engine.scheduler, LogWriter(path, Header("reference", 2)))
    ...                      # drive the engine
    recorder.close()         # then: kvspec replay path
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spec.state import AbstractState
from statemachine.monitor.checker import Finding, SpecMonitor
from statemachine.monitor.log import (
    Delta,
    Event,
    LogWriter,
    block_ids_per_group,
    connector_meta_args,
)

HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
         "build_connector_meta", "update_connector_output", "request_finished",
         "reset_cache")


def _by_id(records: Any) -> dict[Any, Any]:
    return {r.id: r for r in records}


def delta_between(before: AbstractState | None, after: AbstractState) -> Delta:
    """What changed from `before` (None: nothing yet) to `after`, as a log's delta."""
    d = Delta()
    b = before or AbstractState(num_workers=after.num_workers)
    for part, old, new in (("requests", _by_id(b.requests), _by_id(after.requests)),
                           ("jobs", _by_id(b.jobs), _by_id(after.jobs)),
                           ("fence", _by_id(b.reset_fence), _by_id(after.reset_fence)),
                           ("quarantine", _by_id(b.quarantine), _by_id(after.quarantine))):
        out = getattr(d, part)
        for k in old.keys() | new.keys():
            if old.get(k) != new.get(k):
                out[k] = new.get(k)
    for part, old_t, new_t in (("ref_cnt", b.chunk_ref_cnt, after.chunk_ref_cnt),
                               ("block_fence", b.block_fence, after.block_fence)):
        old_m, new_m, out = dict(old_t), dict(new_t), getattr(d, part)
        for k in old_m.keys() | new_m.keys():
            if old_m.get(k) != new_m.get(k):
                out[k] = new_m.get(k)
    old_s, new_s = dict(b.finished_signals), dict(after.finished_signals)
    for r in new_s.keys() | old_s.keys():
        if old_s.get(r, 0) != new_s.get(r, 0):
            d.signals[r] = new_s.get(r, 0)
    for name in ("job_counter", "stale_threshold", "chunks_being_loaded", "jobs_to_flush",
                 "step_open", "reset_since_last_step"):
        if getattr(b, name) != getattr(after, name) or before is None:
            d.scalars[name] = getattr(after, name)
    if b.stores_after_signal != after.stores_after_signal or before is None:
        d.scalars["stores_after_signal"] = frozenset(after.stores_after_signal)
    return d


def _rid(request: Any) -> str:
    return str(getattr(request, "request_id", getattr(request, "req_id", request)))


def hook_args(hook: str, args: tuple[Any, ...], result: Any) -> dict[str, Any]:
    """The schema's arguments of a hook call on our own message types."""
    if hook == "on_new_request":
        return {"request": _rid(args[0]), "prompt_tokens": len(args[0].prompt_token_ids)}
    if hook == "get_num_new_matched_tokens":
        hits, is_async = result
        return {"request": _rid(args[0]), "num_computed_tokens": int(args[1]),
                "result": [hits, bool(is_async)]}
    if hook == "update_state_after_alloc":
        return {"request": _rid(args[0]), "block_ids": block_ids_per_group(args[1]),
                "num_external_tokens": int(args[2])}
    if hook == "build_connector_meta":
        out, meta = args[0], result
        scheduled = {rid: int(n) for rid, n in out.num_scheduled_tokens.items()}
        for rid in (*(n.req_id for n in out.scheduled_new_reqs),
                    *(c.req_id for c in out.scheduled_cached_reqs)):
            scheduled.setdefault(rid, 0)   # our output lists a request given no token too
        return {**connector_meta_args(
                    scheduled, ((n.req_id, n.block_ids) for n in out.scheduled_new_reqs),
                    ((c.req_id, c.new_block_ids) for c in out.scheduled_cached_reqs),
                    (c.req_id for c in out.scheduled_cached_reqs if c.resumed_from_preemption),
                    out.finished_req_ids, out.preempted_req_ids),
                "shipped": {"store": sorted(meta.store_jobs), "load": sorted(meta.load_jobs),
                            "flush": sorted(meta.jobs_to_flush)}}
    if hook == "update_connector_output":
        out = args[0]
        meta = out.kv_connector_worker_meta
        acks = dict(meta.completed_jobs) if meta is not None else {}
        failed = dict(meta.failed_jobs) if meta is not None else {}
        return {"acks": {str(j): n for j, n in sorted(acks.items())},
                "failed": {str(j): n for j, n in sorted(failed.items())},
                "finished_sending": [], "finished_recving": sorted(out.finished_recving)}
    if hook == "request_finished":
        delay, params = result
        return {"request": _rid(args[0]), "block_ids": [], "result": [bool(delay),
                                                                       params is not None]}
    return {"result": result}


class HookRecorder:
    """Wraps `scheduler`'s hooks (see the module docstring)."""

    def __init__(self, scheduler: Any, writer: LogWriter | None = None,
                 monitor: SpecMonitor | None = None) -> None:
        self.scheduler = scheduler
        self.writer = writer
        self.monitor = monitor
        self.findings: list[Finding] = []
        self.last: AbstractState | None = None
        self.seq = 0
        self.step = 0
        for hook in HOOKS:
            setattr(scheduler, hook, self._wrap(hook, getattr(scheduler, hook)))

    def _wrap(self, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if hook == "build_connector_meta":
                self.step += 1
            state = self.scheduler.abstract_state()
            self.seq += 1
            event = Event(seq=self.seq, step=self.step, hook=hook,
                          args=hook_args(hook, args, result),
                          delta=delta_between(self.last, state))
            self.last = state
            if self.monitor is not None:
                found = self.monitor.observe(event)
                self.findings.extend(found)
                if found:
                    event.findings = [f.to_json() for f in found]
            if self.writer is not None:
                self.writer.write(event)
            return result
        return call

    def close(self) -> None:
        if self.monitor is not None:
            self.findings.extend(self.monitor.finish())
        if self.writer is not None:
            self.writer.close()


__all__ = ["HOOKS", "HookRecorder", "delta_between", "hook_args"]
