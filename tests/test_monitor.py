"""The monitor's event log and its replay, without vLLM: logs of our reference scheduler
(`kvspec simulate --monitor-log`), of the reference with a catalogued fault switched on, and
hand-made logs for every way a log can be malformed."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spec import job as J
from spec import request as R
from spec.state import HeldJob, JobRecord, RequestRecord, record_builder
from statemachine import simulate
from statemachine.cli import main as kvspec
from statemachine.monitor.checker import Finding, SpecMonitor, is_move, path_of
from statemachine.monitor.log import (
    HOOK_ARGS,
    SCHEMA,
    SCHEMA_VERSION,
    Delta,
    Event,
    Header,
    LogFollower,
    LogWriter,
    MalformedLog,
    SchemaVersionMismatch,
    read_log,
)
from statemachine.monitor.replay import follow, replay
from statemachine.mutants import MUTANTS

MUTANT_DRAIN_STEPS = 40
"""A mutant's run drains for this many steps, not the default 600: its log is read for its
first finding, which each catalogued fault makes before the drain, and a run whose requests
the fault hangs would log every step of a long drain (`load-keeps-chunks-being-loaded`: 43k
events, 16 s, where 40 steps log 9k)."""


def reference_log(path: Path, seed: int = 1, mutant: str | None = None,
                  model: str = "full") -> Path:
    cfg = simulate.SimConfig(seed=seed, model=model, check_invariants=mutant is None,
                             monitor_log=str(path))
    if mutant is None:
        simulate.run(cfg)
    else:
        with next(m for m in MUTANTS if m.name == mutant).patch():
            simulate.run(replace(cfg, max_drain_steps=MUTANT_DRAIN_STEPS))
    return path


@pytest.fixture(scope="module")
def clean_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_log(tmp_path_factory.mktemp("logs") / "clean.jsonl")


@pytest.fixture(scope="module")
def bug_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reference_log(tmp_path_factory.mktemp("logs") / "48102.jsonl",
                         mutant="reset-keeps-transfer-jobs")


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def write(path: Path, rows: list[str], end: str = "\n") -> Path:
    path.write_text("\n".join(rows) + end)
    return path


# ----------------------------------------------------------------------------- real logs
@pytest.mark.parametrize("model", ["full", "hybrid"])
def test_a_reference_run_replays_clean(tmp_path: Path, model: str) -> None:
    log = reference_log(tmp_path / "run.jsonl", seed=2, model=model)
    v = replay(log)
    assert v.clean, v.text()
    hooks = {e.hook for e in v.log.events}
    assert {"on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
            "build_connector_meta", "update_connector_output", "request_finished",
            "reset_cache"} <= hooks
    assert v.moves > 500 and v.steps > 100 and v.requests > 50
    assert kvspec(["replay", str(log)]) == 0


def test_the_48102_fault_is_the_first_violation_with_its_trace(
        bug_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v = replay(bug_log)
    first = v.findings[0]
    assert (first.rule, first.hook) == ("INV-1", "reset_cache")
    assert first.request is not None and first.jobs
    # the trace: the request's arrival, its job's creation, then the reset that left the
    # job's id behind, numbered by event
    assert v.trace[0].event.hook == "on_new_request"
    assert v.trace[-1].event.seq == first.seq
    moved = [(m.subject, m.src, m.dst) for s in v.trace for m in s.moves]
    assert (first.request, R.ABSENT, R.IDLE) in moved
    assert (str(first.jobs[0]), J.UNALLOCATED, J.CREATED) in moved \
        or (str(first.jobs[0]), J.UNALLOCATED, J.SHIPPED) in moved
    # what users saw: the request holds the id forever
    stuck = [f for f in v.findings if f.rule.startswith("INV-13")
             and f.request == first.request]
    assert stuck and "not in the job table" in stuck[0].message
    assert kvspec(["replay", str(bug_log)]) == 1
    out = capsys.readouterr().out
    assert "first violation: INV-1" in out and f"#{first.seq}" in out


def test_replay_json_and_svg(bug_log: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "trace.svg"
    assert kvspec(["replay", str(bug_log), "--json", "--svg", str(svg)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "violation" and out["findings"][0]["rule"] == "INV-1"
    assert out["trace"][-1]["seq"] == out["findings"][0]["seq"]
    assert all(isinstance(t["line"], int) and t["line"] > 1 for t in out["trace"])
    drawn = Path(out["svg"])
    assert drawn.exists() and drawn.stat().st_size > 0
    assert "ORPHANED_LOAD" in drawn.read_text() or "STALE" in drawn.read_text()


@pytest.mark.parametrize("mutant,rule", [
    ("reset-skips-flush", "INV-16"),
    ("reset-keeps-stale-threshold", "INV-4"),
    ("aggregate-counts-once", "reports_complete"),
    ("pending-count-one", "allocate_job"),
    ("store-ready-on-first-ack", "INV-12"),
    ("load-keeps-chunks-being-loaded", "INV-8"),
    ("signal-before-final-store", "INV-10"),
    ("preempt-skips-flush", "INV-15"),
])
def test_replay_finds_catalogued_faults(tmp_path: Path, mutant: str, rule: str) -> None:
    v = replay(reference_log(tmp_path / "m.jsonl", mutant=mutant))
    assert v.findings and v.findings[0].rule == rule, v.text()


def test_the_stuck_bound_is_an_option(bug_log: Path) -> None:
    short = replay(bug_log, stuck_after_steps=1)
    long = replay(bug_log, stuck_after_steps=10_000)
    assert any(f.rule.startswith("INV-13") for f in short.findings)
    assert not any(f.rule.startswith("INV-13") for f in long.findings)
    assert kvspec(["replay", str(bug_log), "--stuck-after-steps", "0"]) == 2


# ----------------------------------------------------------------------------- moves
def test_moves_follow_the_rows_of_the_hook() -> None:
    from spec.job import JOB_MACHINE
    from spec.request import REQUEST_MACHINE

    assert is_move(REQUEST_MACHINE, "on_new_request", R.ABSENT, R.IDLE)
    assert not is_move(REQUEST_MACHINE, "on_new_request", R.ABSENT, R.RUNNING)
    # one call may fire several rows: a store is created and shipped by the same call
    assert [t for _a, _b, t in path_of(JOB_MACHINE, "build_connector_meta", J.UNALLOCATED,
                                       J.SHIPPED)] == ["create_store", "ship"]
    # the core's preemption is seen at whichever hook comes next
    assert is_move(REQUEST_MACHINE, "get_num_new_matched_tokens", R.RUNNING, R.IDLE)
    assert not is_move(JOB_MACHINE, "get_num_new_matched_tokens", J.SHIPPED, J.COMPLETED)


def _ev(seq: int, hook: str, args: dict[str, Any], delta: Delta, step: int = 0) -> Event:
    return Event(seq=seq, step=step, hook=hook, args=args, delta=delta)


def test_a_move_with_no_row_is_a_violation() -> None:
    mon = SpecMonitor(1)
    found = mon.observe(_ev(1, "on_new_request", {"request": "r0", "prompt_tokens": 8},
                            Delta(requests={"r0": RequestRecord("r0", R.RUNNING)})))
    assert [f.rule for f in found] == ["request table"]
    assert "ABSENT -> RUNNING" in found[0].message and found[0].request == "r0"


def test_an_over_count_ack_is_a_violation() -> None:
    mon = SpecMonitor(2)
    job = JobRecord(0, "store", "r0", J.SHIPPED, 2)
    mon.observe(_ev(1, "on_new_request", {}, Delta(requests={"r0": RequestRecord(
        "r0", R.IDLE)})))
    assert not mon.observe(_ev(2, "build_connector_meta", {}, Delta(
        requests={"r0": RequestRecord("r0", R.STORING, frozenset({0}))}, jobs={0: job},
        scalars={"job_counter": 1}), step=1))
    found = mon.observe(_ev(3, "update_connector_output", {"acks": {"0": 3}}, Delta(
        requests={"r0": RequestRecord("r0", R.RUNNING)}, jobs={0: None}), step=1))
    assert [f.rule for f in found] == ["reports_complete"]
    assert "over-count" in found[0].message and found[0].jobs == (0,)


# ----------------------------------------------------------------------------- bad logs
def test_a_truncated_last_line_is_reported_not_a_crash(
        clean_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = lines(clean_log)
    cut = write(tmp_path / "cut.jsonl", [*rows[:-1], rows[-1][: len(rows[-1]) // 2]], end="")
    log = read_log(cut)
    assert log.truncated == len(rows) and len(log.events) == len(rows) - 2
    followed = follow(cut, lambda: True, poll_s=0.001)   # the same, read as it grew
    assert (followed.log.truncated, followed.events) == (len(rows), len(rows) - 2)
    whole_last = write(tmp_path / "no-newline.jsonl", rows, end="")   # JSON, no newline
    assert len(read_log(whole_last).events) == len(rows) - 1 == \
        follow(whole_last, lambda: True, poll_s=0.001).events
    assert kvspec(["replay", str(cut)]) == 0
    assert f"line {len(rows)} is cut short" in capsys.readouterr().out


def _event2(rows: list[str], **change: Any) -> list[str]:
    """The log with its first event's fields changed (a None value removes the field)."""
    ev = {**json.loads(rows[1]), **change}
    return [rows[0], json.dumps({k: v for k, v in ev.items() if v is not None}), *rows[2:]]


@pytest.mark.parametrize("edit,line,field", [
    (lambda rows: [*rows[:5], "{not json", *rows[5:]], 6, "(line)"),
    (lambda rows: [*rows[:3], *rows[4:]], 4, "seq"),
    (lambda rows: _event2(rows, hook="frobnicate"), 2, "hook"),
    (lambda rows: _event2(rows, delta=None), 2, "delta"),
    (lambda rows: _event2(rows, delta={"requests": {"r": ["r", 3, [], False, False, False,
                                                         False, [], None]}}), 2,
     "delta.requests.r.state"),
    (lambda rows: _event2(rows, delta={"requests": {"r": {"id": "r", "state": "IDLE"}}}), 2,
     "delta.requests.r"),
    (lambda rows: [json.dumps({**json.loads(rows[0]), "records": {}}), *rows[1:]], 1,
     "records"),
    (lambda rows: _event2(rows, delta={"tables": {}}), 2, "delta.tables"),
    (lambda rows: _event2(rows, args={}), 2, "args.*"),
    (lambda rows: [json.dumps({"schema": SCHEMA, "schema_version": SCHEMA_VERSION}),
                   *rows[1:]], 1, "num_workers"),
    (lambda rows: rows[1:], 1, "schema"),
])
def test_a_malformed_log_names_its_line_and_field(
        clean_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        edit: Any, line: int, field: str) -> None:
    rows = lines(clean_log)
    if field == "args.*":  # the first argument of the hook of line 2
        field = "args." + HOOK_ARGS[json.loads(rows[1])["hook"]][0]
    bad = write(tmp_path / "bad.jsonl", edit(rows))
    with pytest.raises(MalformedLog) as exc:
        read_log(bad)
    assert (exc.value.line, exc.value.field) == (line, field)
    assert kvspec(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"bad.jsonl:{line}: field {field!r}" in err


@pytest.mark.parametrize("values", [
    (JobRecord, (7, "store", "r1", J.SHIPPED, 2, False, False, frozenset({3, 1}),
                 frozenset({5}), frozenset(), frozenset({5}), 1, False)),
    (RequestRecord, ("r1", R.STORING, frozenset({7}), False, False, False, False, (4, 2), 3)),
    (HeldJob, (9, "load", 1, frozenset({2}), frozenset({8}), True, False)),
])
def test_the_fast_record_builder_builds_the_same_record(values: tuple[type, tuple[Any, ...]]
                                                         ) -> None:
    cls, fields_ = values
    made, built = cls(*fields_), record_builder(cls)(*fields_)
    assert type(built) is cls and built == made and hash(built) == hash(made)
    assert repr(built) == repr(made) and not built < made and not made < built
    with pytest.raises(AttributeError):  # still frozen
        built.id = 0
    with pytest.raises(TypeError):  # every field, positionally
        record_builder(cls)(*fields_[:-1])


def test_a_step_logs_its_scheduled_requests_compactly(clean_log: Path) -> None:
    """Version 3's `build_connector_meta` arguments: every scheduled request with its token
    count; block ids only for the requests given new blocks, a request scheduled as new
    with its whole table; and the admitted ones (new or resumed) among the scheduled."""
    events = read_log(clean_log).events
    steps = [e for e in events if e.hook == "build_connector_meta"]
    assert steps and all(set(HOOK_ARGS["build_connector_meta"]) <= set(e.args) for e in steps)
    admitted_seen = grown = whole = 0
    allocated: dict[str, Any] = {}  # this step's allocations
    for e in events:
        if e.hook == "update_state_after_alloc":
            allocated[e.args["request"]] = e.args["block_ids"]
        if e.hook != "build_connector_meta":
            continue
        scheduled, blocks = e.args["scheduled"], e.args["new_block_ids"]
        assert all(isinstance(n, int) and n >= 0 for n in scheduled.values())
        assert set(blocks) <= set(scheduled) and set(e.args["admitted"]) <= set(scheduled)
        assert all(any(g) for g in blocks.values())  # no entry without a block
        for rid in e.args["admitted"]:
            admitted_seen += 1
            if rid in blocks and rid in allocated:
                assert blocks[rid] == allocated[rid]  # a new request's whole table
                whole += 1
        grown += sum(1 for rid in blocks if rid not in e.args["admitted"])
        allocated.clear()
    assert admitted_seen > 10 and whole > 10 and grown > 10  # every kind of entry occurs


def test_a_log_of_another_schema_version_is_refused(
        clean_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = lines(clean_log)
    head = json.loads(rows[0])
    for old in (1, 2):  # 1: records as objects; 2: `scheduled` as [tokens, blocks, resumed]
        other = write(tmp_path / f"v{old}.jsonl", [json.dumps({**head, "schema_version": old}),
                                                   *rows[1:]])
        with pytest.raises(SchemaVersionMismatch):
            read_log(other)
        assert kvspec(["replay", str(other)]) == 2
        assert f"version {old}" in capsys.readouterr().err
    assert kvspec(["replay", str(tmp_path / "none.jsonl")]) == 2


def test_the_writer_and_reader_agree(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    w = LogWriter(path, Header(vllm="x", num_workers=2, mode="warn", stuck_after_steps=5))
    d = Delta(requests={"r0": RequestRecord("r0", R.IDLE, store_cursor=None), "r1": None},
              jobs={3: JobRecord(3, "load", "r0", J.SHIPPED, 2, keys=frozenset({4, 5}))},
              ref_cnt={4: 1, 9: None}, block_fence={2: frozenset({3}), 7: None},
              signals={"r1": 1}, scalars={"job_counter": 4, "jobs_to_flush": frozenset({3})})
    w.write(Event(1, 0, "reset_cache", {"result": True}, d))
    w.close()
    log = read_log(path)
    assert log.header.stuck_after_steps == 5 and log.events[0].delta == d


# ----------------------------------------------------------------------------- following
def test_following_a_growing_log_finds_what_replay_finds(bug_log: Path, tmp_path: Path) -> None:
    """A writer appends the 48102 log in pieces cut anywhere (mid-line too) while `follow`
    checks it: the follower reports each finding as it comes, and ends with the same
    findings and first trace as `replay` of the whole log."""
    text = bug_log.read_text()
    grown = tmp_path / "grown.jsonl"
    grown.write_text(text[:50])                      # the header is not even complete yet
    written = threading.Event()

    def writer() -> None:
        with grown.open("a") as out:
            for at in range(50, len(text), 997):
                out.write(text[at:at + 997])
                out.flush()
                time.sleep(0.001)
        written.set()

    seen: list[Finding] = []
    thread = threading.Thread(target=writer)
    thread.start()
    v = follow(grown, written.is_set, lambda _m, found: seen.extend(found), poll_s=0.001)
    thread.join()
    whole = replay(bug_log)
    assert v.findings == whole.findings == seen
    assert [s.event.seq for s in v.trace] == [s.event.seq for s in whole.trace]
    assert (v.events, v.steps, v.requests, v.jobs, v.moves) == (
        len(whole.log.events), whole.steps, whole.requests, whole.jobs, whole.moves)


def test_replay_follow_stops_at_the_end_of_stdin(
        bug_log: Path, clean_log: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`kvspec replay --follow`: each violation on stderr as found, the verdict and exit
    code of `replay` once standard input ends."""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert kvspec(["replay", "--follow", str(bug_log)]) == 1
    out, err = capsys.readouterr()
    reports = err.split("kvspec monitor: ")[1:]
    assert reports[0].startswith("first violation: INV-1")
    assert all(str(f) in err for f in replay(bug_log).findings)
    assert "first violation: INV-1" in out and f"{len(lines(bug_log)) - 1} events" in out
    assert kvspec(["replay", "--follow", "--json", str(clean_log)]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "clean"
    assert kvspec(["replay", "--whole-every", "-1", str(clean_log)]) == 2
    assert "--whole-every must be at least 0" in capsys.readouterr().err


def test_whole_state_checks_can_be_spaced_out(bug_log: Path) -> None:
    """`whole_every`: the local checks after every event whatever it is; the whole-state
    ones every N steps, or only at the end (0). The 48102 fault is found either way, at
    the same first event."""
    every, spaced, end_only = (replay(bug_log, whole_every=n) for n in (1, 4, 0))
    assert every.findings[0] == spaced.findings[0] == end_only.findings[0]
    assert {f.rule for f in end_only.findings} <= {f.rule for f in every.findings}


def test_following_decodes_a_character_the_writer_split(clean_log: Path, tmp_path: Path) -> None:
    """A request id outside ASCII whose UTF-8 bytes reach the file in two writes: the
    follower decodes whole lines only, and agrees with `replay`."""
    rid = next(json.loads(r)["args"]["request"] for r in lines(clean_log)[1:]
               if "request" in json.loads(r)["args"])
    data = clean_log.read_text().replace(f'"{rid}"', '"réq-é"').encode("utf-8")
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(data)
    grown = tmp_path / "grown.jsonl"
    grown.write_bytes(b"")
    cuts = [i + 1 for i in range(len(data)) if data[i] == 0xC3]   # inside each 'é'
    assert len(cuts) > 4
    follower = LogFollower(grown)
    events: list[Event] = []
    with grown.open("ab") as out:
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            out.write(data[a:b])
            out.flush()
            events.extend(follower.poll())
    follower.close()
    assert [e.to_json() for e in events] == [e.to_json() for e in read_log(whole).events]
    assert any(e.args.get("request") == "réq-é" for e in events)
