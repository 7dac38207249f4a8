"""`MonitoredOffloadingConnector`: vLLM's `OffloadingConnector` with the spec checked live.

Load it in any vLLM engine through the KV transfer config (the class is looked up in the
module `kv_connector_module_path` names):

    --kv-transfer-config '{"kv_connector": "MonitoredOffloadingConnector",
      "kv_connector_module_path": "statemachine.monitor.connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": 8589934592, "kvspec_mode": "warn",
        "kvspec_log": "/var/log/vllm/kvspec.jsonl"}}'

In the scheduler role every scheduler-side hook runs vLLM's own code, then the monitor
projects what the hook touched (`statemachine.monitor.live`), writes the event to the log
and, unless the mode is `log`, checks it (`statemachine.monitor.checker`): every move a
row of the tables, the invariants, a job held with no report. The worker role is vLLM's
connector unchanged. Settings (`kv_connector_extra_config`; every `kvspec_` key is the
monitor's, an unknown one is a configuration error):

- `kvspec_mode`: `log` (the event log only), `warn` (a violation is logged as a warning
  with the trace that led to it, once, and serving goes on), `raise` (a violation raises
  `MonitorViolation` from the hook, with the trace). Default `warn`.
- `kvspec_log`: the event log's path (default `kvspec-monitor-<pid>.jsonl` in the
  temporary folder); `""` writes none.
- `kvspec_stuck_after_steps`: a request holding a job id with no report for this many
  engine steps is reported (default 64; 0 turns the check off).
- `kvspec_whole_every`: re-project and check the whole state every this many steps
  (default 0: never; each hook's part is always checked).
- `kvspec_trace_len`: events kept for the traces (default 512).
- `kvspec_checker`: where `warn` mode checks: `inline` (in the hook, default) or `process`
  (a `kvspec replay --follow` process reads the log as it is written and checks it, each
  violation on its standard error with its trace, a step or so after the hook; the engine
  pays for the projection and the log only, as in `log` mode). `process` needs a log, and
  a stuck bound of 1 or more; `kvspec_whole_every` applies to it as to the inline checker
  (and the whole state is checked at the end). At shutdown the connector closes the
  process's standard input, waits for its verdict and keeps its findings.

`kvspec replay LOG` checks a log offline with the same checker.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from statemachine.errors import ConfigError, KVSpecError
from statemachine.monitor.checker import Finding, SpecMonitor, report_text, with_findings
from statemachine.monitor.live import LiveProjector
from statemachine.monitor.log import Event, Header, LogWriter, block_ids_per_group
from statemachine.monitor.translations import translations_of

logger = logging.getLogger("kvspec.monitor")

MODES = ("log", "warn", "raise")
CHECKERS = ("inline", "process")


class MonitorViolation(KVSpecError):
    """The spec monitor found a violation (mode `raise`): the finding and its trace."""

    def __init__(self, finding: Finding, trace: str) -> None:
        self.finding = finding
        self.trace = trace
        super().__init__(trace)


@dataclass(frozen=True)
class MonitorConfig:
    mode: str = "warn"
    log: str | None = None
    stuck_after_steps: int = 64
    whole_every: int = 0
    trace_len: int = 512
    checker: str = "inline"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> MonitorConfig:
        """The `kvspec_` settings of `kv_connector_extra_config` (`ConfigError` naming a bad
        one)."""
        extra = dict(extra or {})
        known = {"kvspec_mode", "kvspec_log", "kvspec_stuck_after_steps",
                 "kvspec_whole_every", "kvspec_trace_len", "kvspec_checker"}
        unknown = sorted(k for k in extra if k.startswith("kvspec_") and k not in known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown monitor setting "
                              f"{unknown[0]!r} (known: {', '.join(sorted(known))})")
        mode = extra.get("kvspec_mode", "warn")
        if mode not in MODES:
            raise ConfigError(f"kv_connector_extra_config: kvspec_mode {mode!r} is not one of "
                              f"{', '.join(MODES)}")
        ints = {}
        for name, default, low in (("kvspec_stuck_after_steps", 64, 0),
                                   ("kvspec_whole_every", 0, 0), ("kvspec_trace_len", 512, 1)):
            value = extra.get(name, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"kv_connector_extra_config: {name} must be an integer >= "
                                  f"{low}, got {value!r}")
            ints[name] = value
        log = extra.get("kvspec_log")
        if log is None:
            log = str(Path(tempfile.gettempdir()) / f"kvspec-monitor-{os.getpid()}.jsonl")
        if not isinstance(log, str):
            raise ConfigError(f"kv_connector_extra_config: kvspec_log must be a path, got "
                              f"{log!r}")
        checker = extra.get("kvspec_checker", "inline")
        if checker not in CHECKERS:
            raise ConfigError(f"kv_connector_extra_config: kvspec_checker {checker!r} is not "
                              f"one of {', '.join(CHECKERS)}")
        if checker == "process" and (mode != "warn" or not log
                                     or not ints["kvspec_stuck_after_steps"]):
            raise ConfigError("kv_connector_extra_config: kvspec_checker 'process' needs "
                              "kvspec_mode 'warn', a kvspec_log and kvspec_stuck_after_steps "
                              f">= 1 (got mode {mode!r}, log {log!r}, stuck after "
                              f"{ints['kvspec_stuck_after_steps']})")
        return cls(mode=mode, log=log or None,
                   stuck_after_steps=ints["kvspec_stuck_after_steps"],
                   whole_every=ints["kvspec_whole_every"], trace_len=ints["kvspec_trace_len"],
                   checker=checker)


class LiveMonitor:
    """The monitor of one scheduler-side connector: projector, log writer, checker."""

    def __init__(self, sched: Any, config: MonitorConfig, num_workers: int) -> None:
        self.config = config
        self.projector = LiveProjector(sched, num_workers)
        translations = translations_of(sched)
        inline = config.mode != "log" and config.checker == "inline"
        self.checker = None if not inline else SpecMonitor(
            num_workers, stuck_after_steps=config.stuck_after_steps or None,
            whole_every=config.whole_every, trace_len=config.trace_len,
            translations=translations)
        self.writer = None if config.log is None else LogWriter(config.log, Header(
            vllm=str(vllm.__version__), num_workers=num_workers, mode=config.mode,
            stuck_after_steps=config.stuck_after_steps or None, translations=translations))
        self.findings: list[Finding] = []
        self.follower: subprocess.Popen[str] | None = None
        self.follower_verdict: dict[str, Any] | None = None
        """The checker process's verdict (`kvspec replay --json`), once it has finished."""
        if config.checker == "process":
            assert config.log is not None
            self.follower = start_follower(config.log, config.whole_every)
        if config.log:
            logger.info("kvspec monitor: mode %s, event log %s, checker %s", config.mode,
                        config.log, config.checker)

    def record(self, hook: str, args: dict[str, Any], requests: Any = (), jobs: Any = (),
               everything: bool = False, error: str | None = None) -> None:
        p = self.projector
        whole = (self.config.whole_every and hook == "build_connector_meta"
                 and p.step % self.config.whole_every == 0)
        event = p.event(hook, args, requests, jobs, everything=everything or bool(whole))
        event.error = error
        found: list[Finding] = []
        if self.checker is not None:
            found = self.checker.observe(event)
        if self.writer is not None:
            self.writer.write(with_findings(event, found) if found else event)
        if found:
            self._report(event, found)

    def _report(self, event: Event, found: list[Finding]) -> None:
        assert self.checker is not None
        self.findings.extend(found)
        text = report_text(self.checker, found)
        if self.config.mode == "raise":
            raise MonitorViolation(found[0], text)
        logger.warning("kvspec monitor: %s", text)

    def close(self) -> None:
        if self.checker is not None:
            end = self.checker.finish()
            if end and self._last_event is not None:
                self.findings.extend(end)
        if self.writer is not None:
            self.writer.close()
        if self.follower is not None:
            self.follower_verdict = stop_follower(self.follower)
            self.follower = None
            if self.follower_verdict is not None:
                self.findings.extend(Finding.from_json(f)
                                     for f in self.follower_verdict["findings"])

    @property
    def _last_event(self) -> Event | None:
        return None if self.checker is None or not self.checker.trace \
            else self.checker.trace[-1].event


def start_follower(log: str, whole_every: int) -> subprocess.Popen[str]:
    """`kvspec replay --follow --json --whole-every N LOG` in a process of its own (the same
    Python; the package found as this process finds it), its standard error the
    engine's."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "statemachine.cli", "replay", "--follow",
                             "--json", "--whole-every", str(whole_every), log],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def stop_follower(proc: subprocess.Popen[str],
                  timeout: float = 300.0) -> dict[str, Any] | None:
    """Ends the follower's input, waits for it and returns its verdict (`kvspec replay
    --json`); None, logged as an error, if it could not check the log."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        logger.error("kvspec monitor: the checker process did not finish in %.0f s", timeout)
        return None
    if proc.returncode not in (0, 1):
        logger.error("kvspec monitor: the checker process exited with %d (its error is on "
                     "standard error)", proc.returncode)
        return None
    verdict: dict[str, Any] = json.loads(out)
    return verdict


def _finished_args(request: Any, block_ids: Any, out: Any) -> dict[str, Any]:
    result = None if out is None else [bool(out[0]), out[1] is not None]
    return {"request": request.request_id, "block_ids": block_ids_per_group(block_ids),
            "result": result}


def describe_error(exc: BaseException) -> str:
    """`Type: message (file:line)` of the innermost frame that raised."""
    tb = exc.__traceback__
    where = ""
    while tb is not None:
        frame = tb.tb_frame
        where = f"{frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    marker = "/vllm/"
    if marker in where:
        where = "vllm/" + where.split(marker, 1)[1]
    return f"{type(exc).__name__}: {exc} ({where})" if where else f"{type(exc).__name__}: {exc}"


class MonitoredOffloadingConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's `OffloadingConnector`, each scheduler-side hook checked against the spec."""

    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, role, *args, **kwargs)
        self.kvspec: LiveMonitor | None = None
        if getattr(self, "connector_scheduler", None) is None:
            return  # the worker role: vLLM's connector, unchanged
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        workers = int(vllm_config.parallel_config.world_size)
        self.kvspec = LiveMonitor(self.connector_scheduler, MonitorConfig.from_extra(extra),
                                  workers)

    def _mon(self) -> LiveMonitor:
        assert self.kvspec is not None, "a scheduler-side hook on the worker role"
        return self.kvspec

    def _checked(self, hook: str, call: Callable[[], Any],
                 args: Callable[[Any], dict[str, Any]], requests: Any = (), jobs: Any = (),
                 everything: bool = False) -> Any:
        """vLLM's hook, then its event (`args(result)`); a hook that raises is recorded with
        its error (the result None) and the error goes on."""
        mon = self._mon()
        try:
            out = call()
        except Exception as exc:
            mon.record(hook, args(None), requests, jobs, everything=everything,
                       error=describe_error(exc))
            raise
        mon.record(hook, args(out), requests, jobs, everything=everything)
        return out

    def on_new_request(self, request: Any) -> None:
        rid = request.request_id
        self._checked("on_new_request", lambda: super(MonitoredOffloadingConnector,
                                                      self).on_new_request(request),
                      lambda _out: {"request": rid,
                                    "prompt_tokens": int(request.num_prompt_tokens)}, (rid,))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   *args: Any, **kwargs: Any) -> Any:
        rid = request.request_id
        # a request whose load failed (0.34.0+): its next lookup (0, never deferred)
        # clears `load_invalid`; it stays RECOMPUTE until the core schedules it
        self._mon().projector.obs.invalid_loads.discard(rid)

        def answer(out: Any) -> dict[str, Any]:
            result = None if out is None else [out[0] if out[0] is None else int(out[0]),
                                               bool(out[1])]
            return {"request": rid, "num_computed_tokens": int(num_computed_tokens),
                    "result": result}

        return self._checked("get_num_new_matched_tokens", lambda: super(
            MonitoredOffloadingConnector, self).get_num_new_matched_tokens(
                request, num_computed_tokens, *args, **kwargs), answer, (rid,))

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        rid = request.request_id
        self._mon().projector.obs.allocated.add(rid)
        return self._checked("update_state_after_alloc", lambda: super(
            MonitoredOffloadingConnector, self).update_state_after_alloc(
                request, blocks, num_external_tokens),
            lambda _out: {"request": rid, "block_ids": block_ids_per_group(blocks),
                          "num_external_tokens": int(num_external_tokens)}, (rid,))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        mon = self._mon()
        args, touched = mon.projector.args_of_output(scheduler_output)
        jobs: set[int] = set()

        def built(meta: Any) -> dict[str, Any]:
            if meta is not None:
                shipped, ids = mon.projector.after_build(meta)
                args["shipped"] = shipped
                jobs.update(ids)
                touched.update(mon.projector.owners(ids))
            else:
                args["shipped"] = {"store": [], "load": [], "flush": []}
            return args

        return self._checked("build_connector_meta", lambda: super(
            MonitoredOffloadingConnector, self).build_connector_meta(scheduler_output),
            built, touched, jobs)

    def update_connector_output(self, connector_output: Any) -> None:
        mon = self._mon()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        acks = {int(j): int(n) for j, n in (getattr(meta, "completed_jobs", None) or {}).items()}
        sending = sorted(connector_output.finished_sending or ())
        recving = sorted(connector_output.finished_recving or ())
        touched = mon.projector.owners(acks) | set(sending) | set(recving)
        mon.projector.obs.loaded.update(recving)
        # 0.34.0+: the requests whose async load a worker failed, with their finished_recving
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        mon.projector.obs.recompute |= failed
        mon.projector.obs.invalid_loads |= failed
        args = {"acks": {str(j): n for j, n in sorted(acks.items())},
                "finished_sending": sending, "finished_recving": recving}
        self._checked("update_connector_output", lambda: super(
            MonitoredOffloadingConnector, self).update_connector_output(connector_output),
            lambda _out: args, touched, acks)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return self._checked("request_finished", lambda: super(
            MonitoredOffloadingConnector, self).request_finished(request, block_ids),
            lambda out: _finished_args(request, block_ids, out), (request.request_id,))

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._checked("request_finished", lambda: super(
            MonitoredOffloadingConnector, self).request_finished_all_groups(request, block_ids),
            lambda out: _finished_args(request, block_ids, out), (request.request_id,))

    def reset_cache(self) -> Any:
        self._mon().projector.obs.reset_since_last_step = True
        return self._checked("reset_cache", lambda: super(
            MonitoredOffloadingConnector, self).reset_cache(),
            lambda out: {"result": out}, everything=True)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.kvspec is not None:
                self.kvspec.close()


__all__ = ["CHECKERS", "MODES", "MonitorConfig", "MonitorViolation",
           "MonitoredOffloadingConnector"]
