"""The monitored connector inside vLLM's real core Scheduler (`conformance.core_scheduler`:
the Scheduler built from `kv_transfer_config` with `kv_connector_module_path`, the workers
played, acks one step later and split over two steps for two workers, a
`reset_prefix_cache` mid-run, preemption by running out of GPU blocks, decoding).

On a release with the PR #48102 fix (0.26+) the live monitor finds nothing and the log
replays clean. On a release with the bug the monitor flags the stuck request from that real
run, in `warn` and in `raise` mode, and `kvspec replay` of the log gives the same verdict and
trace. A run whose acks are deliberately corrupted is flagged, live and in replay.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import conformance.vllm_env  # (before vLLM: offline, quiet, temporary caches)

# isort: split
from conformance.core_scheduler import (
    SCENARIO_GPU_BLOCKS,
    SCENARIO_WINDOW,
    CoreDriver,
    CoreRun,
    HookError,
    RunSummary,
    make_core_scheduler,
    reset_outcome,
    scenario,
    scenario_requests,
)
from statemachine.cli import main as kvspec
from statemachine.errors import ConfigError
from statemachine.monitor.connector import (
    MonitorConfig,
    MonitoredOffloadingConnector,
    MonitorViolation,
)
from statemachine.monitor.replay import replay

pytestmark = pytest.mark.conformance

OUTCOME = reset_outcome()
"""Where the scenario's reset leads on this release (`conformance.core_scheduler`)."""
FIXED = OUTCOME == "finishes"
CPU_CHUNKS = 64
STUCK_AFTER = 8


def monitored(log: Path, mode: str, workers: int = 2, **extra: Any) -> CoreRun:
    run = make_core_scheduler(
        num_gpu_blocks=SCENARIO_GPU_BLOCKS, num_cpu_chunks=CPU_CHUNKS, num_workers=workers,
        kv_connector="MonitoredOffloadingConnector",
        kv_connector_module_path="statemachine.monitor.connector",
        extra_config={"kvspec_mode": mode, "kvspec_log": str(log),
                      "kvspec_stuck_after_steps": STUCK_AFTER, "kvspec_whole_every": 1,
                      **extra})
    assert type(run.connector) is MonitoredOffloadingConnector
    return run


def findings(run: CoreRun) -> list[Any]:
    mon = run.connector.kvspec
    assert mon is not None
    return list(mon.findings)


@pytest.fixture(scope="module")
def warn_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CoreRun, RunSummary,
                                                                          Path]]:
    log = tmp_path_factory.mktemp("monitor") / "warn.jsonl"
    run = monitored(log, "warn")
    summary = scenario(run, seed=0)
    run.connector.kvspec.close()
    yield run, summary, log


def test_the_scenario_reaches_preemption_loads_and_the_reset(
        warn_run: tuple[CoreRun, RunSummary, Path]) -> None:
    _run, summary, _log = warn_run
    assert summary.preemptions >= 1 and summary.stores
    assert summary.resets and any(r.in_flight for r in summary.resets)
    assert any(summary.output_tokens.values())
    if OUTCOME != "crashes":  # the shared prefix is loaded after the reset
        assert summary.loads


def test_the_checker_process_finds_what_the_inline_checker_finds(
        warn_run: tuple[CoreRun, RunSummary, Path], tmp_path: Path) -> None:
    """`kvspec_checker: process`: the same scenario, checked by a `kvspec replay --follow`
    process while the engine runs; after shutdown the connector holds that process's
    findings, the same as the inline checker's, and its verdict covers every event."""
    inline_run, _summary, _log = warn_run
    log = tmp_path / "process.jsonl"
    run = monitored(log, "warn", kvspec_checker="process")
    mon = run.connector.kvspec
    assert mon.checker is None and mon.follower is not None
    scenario(run, seed=0)
    mon.close()
    assert mon.follower is None and mon.follower_verdict is not None
    assert mon.follower_verdict["events"] == len(replay(log).log.events) > 0
    assert [(f.rule, f.request, f.jobs, f.seq) for f in findings(run)] == \
        [(f.rule, f.request, f.jobs, f.seq) for f in findings(inline_run)]


@pytest.mark.skipif(not FIXED, reason="the release has the PR #48102 bug")
def test_a_fixed_release_is_clean_live_and_in_replay(
        warn_run: tuple[CoreRun, RunSummary, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, summary, log = warn_run
    assert summary.idle and not summary.stuck and summary.error is None
    live = findings(run)
    if not conformance.vllm_env.has("finished_signal"):
        # 0.26: EARLY-FINISH-SIGNAL (CONFORMANCE.md): request_finished signals the manager
        # (S@0.26.0:1292) before the final store the next step makes: INV-11, nothing else
        assert live and {(f.rule, f.message, f.hook) for f in live} == {
            ("INV-11", "prepare_store after on_request_finished", "build_connector_meta")}
        assert [(f.rule, f.seq) for f in replay(log).findings] == \
            [(f.rule, f.seq) for f in live]
        return
    assert live == []
    v = replay(log)
    assert v.clean, v.text()
    hooks = {e.hook for e in v.log.events}
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "update_connector_output", "request_finished", "reset_cache"} <= hooks
    assert kvspec(["replay", str(log)]) == 0
    assert "clean" in capsys.readouterr().out


@pytest.mark.skipif(OUTCOME != "crashes",
                    reason="the release has the PR #48102 fix, or defers the holder")
def test_a_buggy_release_flags_the_cause_then_the_crash_live_and_in_replay(
        warn_run: tuple[CoreRun, RunSummary, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """0.22-0.23: INV-1 at the reset names the preempted holder and its stale job; the crash
    that follows (KeyError on that id, building the holder's next store) is the log's last
    event, recorded with its error, and a "hook raised" finding."""
    run, summary, log = warn_run
    (reset,) = summary.resets
    (holder,) = reset.holders
    assert summary.error is not None and isinstance(summary.error.error, KeyError)
    stale = summary.error.error.args[0]
    live = findings(run)
    first = live[0]
    assert (first.rule, first.hook, first.request) == ("INV-1", "reset_cache", holder)
    assert stale in first.jobs
    crash = [f for f in live if f.rule == "hook raised"]
    assert crash and crash[-1].hook == "build_connector_meta"
    assert "KeyError" in crash[-1].message and "scheduler.py:" in crash[-1].message
    assert crash[-1].seq > first.seq
    v = replay(log)
    assert [(f.rule, f.request, f.jobs, f.seq) for f in v.findings] == \
        [(f.rule, f.request, f.jobs, f.seq) for f in live]
    assert kvspec(["replay", str(log)]) == 1
    assert "first violation: INV-1" in capsys.readouterr().out


@pytest.mark.skipif(OUTCOME != "strands",
                    reason="the release has the PR #48102 fix, or crashes instead")
def test_a_buggy_release_flags_the_stuck_request_live_and_in_replay(
        warn_run: tuple[CoreRun, RunSummary, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run, summary, log = warn_run
    (stuck_id, stuck), = summary.stuck.items()
    live = findings(run)
    first = live[0]
    # the cause, at the reset: the request keeps a job id the table no longer has
    assert (first.rule, first.hook, first.request) == ("INV-1", "reset_cache", stuck_id)
    assert set(first.jobs) == set(stuck.stale_jobs)
    # what the user saw: the request never runs again
    hang = [f for f in live if f.rule.startswith("INV-13") and f.request == stuck_id]
    assert hang and "never runs again" in hang[0].message
    # the replay of the log: the same verdict and the same trace
    v = replay(log)
    assert [(f.rule, f.request, f.jobs, f.seq) for f in v.findings] == \
        [(f.rule, f.request, f.jobs, f.seq) for f in live]
    mon = run.connector.kvspec
    assert [s.event.seq for s in v.trace] == [s.event.seq for s in mon.checker.trace_of(first)]
    assert kvspec(["replay", str(log)]) == 1
    out = capsys.readouterr().out
    assert "first violation: INV-1" in out and f"#{first.seq}" in out


@pytest.mark.skipif(FIXED, reason="the release has the PR #48102 fix")
def test_raise_mode_stops_at_the_reset(tmp_path: Path) -> None:
    run = monitored(tmp_path / "raise.jsonl", "raise")
    with pytest.raises(HookError) as exc:  # the harness names the call that raised
        scenario(run, seed=0)
    violation = exc.value.__cause__
    assert isinstance(violation, MonitorViolation)  # out of the Scheduler's reset, unchanged
    f = violation.finding
    assert (f.rule, f.hook) == ("INV-1", "reset_cache")
    assert "first violation: INV-1" in str(violation) and f"#{f.seq}" in str(violation)
    # the log holds the event that raised, with its finding: the replay agrees
    v = replay(tmp_path / "raise.jsonl")
    assert (v.findings[0].rule, v.findings[0].request, v.findings[0].seq) == \
        (f.rule, f.request, f.seq)


@pytest.mark.skipif(FIXED, reason="the release has the PR #48102 fix")
def test_with_one_worker_the_monitor_names_the_cause_before_the_crash(tmp_path: Path) -> None:
    """One worker: no waiting holder at the reset; a running request keeps the stale id and
    vLLM raises KeyError at its next store. The monitor reported INV-1 at the reset."""
    run = monitored(tmp_path / "one.jsonl", "warn", workers=1)
    summary = scenario(run, seed=0)
    assert summary.error is not None and "KeyError" in repr(summary.error)
    first = findings(run)[0]
    assert (first.rule, first.hook) == ("INV-1", "reset_cache")
    run.connector.kvspec.close()
    assert replay(tmp_path / "one.jsonl").findings[0].seq == first.seq


def test_a_corrupted_ack_is_flagged(tmp_path: Path) -> None:
    """The workers' combined output reports one job once more than there are workers."""
    log = tmp_path / "corrupt.jsonl"
    run = monitored(log, "warn")
    driver = CoreDriver(run, seed=0)
    aggregate = driver._aggregator.aggregate
    corrupted: list[int] = []

    def over_count(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = aggregate(outputs, *args, **kwargs)
        meta = out.kv_connector_output.kv_connector_worker_meta
        done = getattr(meta, "completed_jobs", None)
        if done and not corrupted:
            job = min(done)
            done[job] += 1
            corrupted.append(job)
        return out

    driver._aggregator.aggregate = over_count
    driver.add_request("r0", list(range(100, 164)), max_tokens=4)
    crashed = None
    for _ in range(8):
        try:
            driver.step()
        except HookError as exc:  # vLLM 0.33 asserts on it (S:2287); older ones go on
            crashed = exc
            break
    run.connector.kvspec.close()
    assert corrupted
    live = findings(run)
    f = next(f for f in live if f.rule == "reports_complete")
    assert f.jobs == (corrupted[0],) and "over-count" in f.message
    if crashed is not None:  # the monitor recorded the hook's own error with the event
        assert any(g.rule == "hook raised" and "AssertionError" in g.message and g.seq == f.seq
                   for g in live)
    v = replay(log)
    assert [(g.rule, g.jobs, g.seq) for g in v.findings][:2] == \
        [(g.rule, g.jobs, g.seq) for g in live][:2]


HYBRID_GPU_BLOCKS = 18
"""GPU blocks for both groups together: tight enough that the Scheduler preempts."""


HYBRID_CORES: dict[str, tuple[dict[str, Any], list[str], tuple[str, ...], dict[str, Any]]] = {
    "sliding": ({"sliding_window": SCENARIO_WINDOW}, ["FullAttentionSpec", "SlidingWindowSpec"],
                ("retention_interval",), {}),
    "mamba": ({"groups": ("full", "mamba")}, ["FullAttentionSpec", "MambaSpec"],
              ("retention_interval", "block_state_handoffs"), {}),
    # a request holds a block or two: few blocks, so that the core evicts and preempts;
    # its requests are done in 28 steps, so the reset comes by step 15
    "pure-mamba": ({"groups": ("mamba",), "num_gpu_blocks": 6}, ["MambaSpec"],
                   ("retention_interval", "block_state_handoffs"), {"reset_latest": 15}),
    # a window on every layer; every tail kept (at retention 0 the scenario's requests
    # find no window tail to load), 8 blocks: fewer and the core cannot fit a window
    "pure-sliding": ({"groups": ("sliding",), "sliding_window": SCENARIO_WINDOW,
                      "num_gpu_blocks": 8, "retention_interval": None},
                     ["SlidingWindowSpec"], ("retention_interval",), {"reset_latest": 15}),
    # the three kinds at once, one layer each
    "three-kinds": ({"groups": ("full", "sliding", "mamba"), "sliding_window": SCENARIO_WINDOW},
                    ["FullAttentionSpec", "SlidingWindowSpec", "MambaSpec"],
                    ("retention_interval", "block_state_handoffs"), {}),
}
"""Per model beyond one full-attention group: the core's arguments, its KV cache groups,
the features it needs, the scenario's arguments."""


@pytest.mark.parametrize("model", sorted(HYBRID_CORES))
def test_a_hybrid_model_in_the_real_core_is_clean_live_and_in_replay(
        tmp_path: Path, model: str) -> None:
    """The monitored connector in vLLM's real core Scheduler with a full-attention group
    and a sliding-window group, or a Mamba group in align mode (the core then commits the
    states at block edges and hands them to the connector), or both beside it, or one group
    over every layer
    (a pure Mamba model, a sliding window on every layer), at vLLM's default retention
    (every window tail kept on the pure window model): the scenario preempts, loads, resets
    with jobs in flight and decodes (past the window), and the monitor (every hook, the
    whole state each step) finds nothing, live or in replay."""
    kwargs, specs, features, moments = HYBRID_CORES[model]
    lacking = conformance.vllm_env.missing(*features, "finished_signal")
    if not FIXED or lacking:
        pytest.skip(f"a hybrid core ({model}) with the #48102 fix needs {lacking or 'it'}")
    log = tmp_path / f"{model}.jsonl"
    run = make_core_scheduler(
        num_cpu_chunks=CPU_CHUNKS, num_workers=2,
        kv_connector="MonitoredOffloadingConnector",
        kv_connector_module_path="statemachine.monitor.connector",
        extra_config={"kvspec_mode": "warn", "kvspec_log": str(log),
                      "kvspec_stuck_after_steps": STUCK_AFTER, "kvspec_whole_every": 1},
        **{"num_gpu_blocks": HYBRID_GPU_BLOCKS, **kwargs})
    assert [type(g.kv_cache_spec).__name__ for g in run.kv_cache_config.kv_cache_groups] == \
        specs
    summary = scenario(run, seed=0, **moments)
    run.connector.kvspec.close()
    assert summary.idle and not summary.stuck and summary.error is None
    assert summary.preemptions >= 1 and summary.loads and summary.stores
    assert summary.resets and any(r.in_flight for r in summary.resets)
    assert any(summary.output_tokens.values())
    assert findings(run) == []
    v = replay(log)
    assert v.clean, v.text()
    prompts = {r.req_id: len(r.prompt) for r in scenario_requests(run.block_size, seed=0)}
    groups = kwargs.get("groups", ("full", "sliding"))
    if "sliding" in groups:
        # the window at work: requests run past it by two blocks and more (the core frees
        # their window blocks as they go; the live monitor does not observe its tables)
        assert any(prompts[r] + len(out) >= SCENARIO_WINDOW + 2 * run.block_size
                   for r, out in summary.output_tokens.items())
    if "mamba" in groups:
        # the core's state hand-offs became stores of one Mamba block each
        state = tuple(int(kind == "mamba") for kind in groups)
        assert any(rec.handoffs for rec in summary.records)
        assert any(sizes == state for rec in summary.records
                   for _, sizes, _ in rec.store_sources.values())


@pytest.mark.parametrize(("extra", "names"), [
    ({"kvspec_mood": "warn"}, "unknown monitor setting 'kvspec_mood'"),
    ({"kvspec_mode": "loud"}, "kvspec_mode 'loud' is not one of log, warn, raise"),
    ({"kvspec_trace_len": 0}, "kvspec_trace_len must be an integer >= 1, got 0"),
    ({"kvspec_stuck_after_steps": True}, "kvspec_stuck_after_steps must be an integer"),
    ({"kvspec_log": 3}, "kvspec_log must be a path, got 3"),
    ({"kvspec_checker": "thread"}, "kvspec_checker 'thread' is not one of inline, process"),
    ({"kvspec_checker": "process", "kvspec_mode": "raise"}, "needs kvspec_mode 'warn'"),
    ({"kvspec_checker": "process", "kvspec_log": ""}, "a kvspec_log"),
    ({"kvspec_checker": "process", "kvspec_stuck_after_steps": 0}, "stuck after 0"),
])
def test_a_bad_monitor_setting_is_a_config_error_naming_it(extra: dict[str, Any],
                                                           names: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(names)):
        MonitorConfig.from_extra(extra)


def test_monitor_settings_are_read() -> None:
    config = MonitorConfig.from_extra({"kvspec_mode": "warn", "kvspec_log": "/tmp/x.jsonl",
                                       "kvspec_checker": "process", "other": 1})
    assert (config.mode, config.log, config.checker, config.stuck_after_steps) == \
        ("warn", "/tmp/x.jsonl", "process", 64)
    assert MonitorConfig.from_extra({"kvspec_log": ""}).log is None
