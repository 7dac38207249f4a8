"""The model checker: every compiled scenario concludes what it records (verdict, distinct
states, depth; the others: `test_checker_groups.py`), each abstract mutant yields a short,
readable, certified counterexample, and the progress properties are found as liveness
(lassos)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spec import model as M
from spec.checker import CheckResult, check_model
from spec.scenarios import SCENARIOS, Expect, Scenario, by_name, hunt_bounds, parse_bounds
from statemachine import cli, diagrams
from statemachine.checker import check, compiled
from statemachine.mutants import MUTANTS, Mutant

KEEP = M.Fault.RESET_KEEPS_TRANSFER_JOBS
COMPILED = tuple(sc for sc in SCENARIOS if compiled.fits(sc.bounds) is None)
"""The scenarios the compiled twin takes: every one (`test_checker_groups.py`)."""
LONGEST = "three-requests"
"""The one scenario of more than a minute on one thread (12.9 million states, about 100 to
145 s on this 2-core machine): its outcome is checked by `make check-groups` and, in CI, by
`make check` on every core, not by `make test`."""


THREADS = {LONGEST: 1, "store-admission-three-requests": 2}
"""The threads each scenario is searched on again, after one: three, but two for the second
longest (2.4 million states in some 1,200 batches of 2,048: the merge and the members' lists
under real contention), and none again for the longest."""


def _answer(r: CheckResult) -> CheckResult:
    """Everything a check says but its time, its threads and its memory (whose scratch grows
    with the threads)."""
    return replace(r, seconds=0.0, engine="", memory=0)


@pytest.mark.exhaustive
@pytest.mark.parametrize("scenario", [
    pytest.param(sc, marks=pytest.mark.deep) if sc.name == LONGEST else sc for sc in COMPILED],
    ids=lambda s: s.name)
def test_each_compiled_scenario_concludes_what_it_records(scenario: Scenario) -> None:
    """Each scenario is searched in its own test, so the workers share the searches out, on
    one thread and then on several (`THREADS`): the same answer, field for field (the
    compiled search's threads: `test_checker_threads.py`)."""
    assert scenario.expect is not None
    r = check(scenario.bounds)
    assert r.complete and r.engine == "compiled"
    assert Expect(r.verdict, r.states, r.depth) == scenario.expect, (
        r.counterexample.render() if r.counterexample else r)
    assert r.liveness == ("P-1", "P-2", "P-3", "P-4", "P-5")
    threads = THREADS.get(scenario.name, 3)
    if threads > 1:
        many = check(scenario.bounds, threads=threads)
        assert many.engine == f"compiled, {threads} threads"
        assert _answer(many) == _answer(r)


def test_the_scenario_set_reaches_three_requests_of_three_tokens() -> None:
    big = [s.bounds for s in SCENARIOS if s.bounds.requests >= 3 and s.bounds.tokens >= 3
           and s.bounds.workers >= 2 and s.bounds.resets >= 2 and s.bounds.preemptions >= 1]
    assert big


def test_the_48102_counterexample_is_shortest() -> None:
    r = check(hunt_bounds(KEEP), frozenset([KEEP]))
    ce = r.counterexample
    assert ce is not None and ce.kind == "invariant" and len(ce) == 3
    assert ce.violations[0].invariant == "INV-1"
    assert [str(s.event) for s in ce.steps][-1] == "reset()"


def test_with_inv1_off_the_48102_hang_is_a_liveness_lasso() -> None:
    """PR #48102 is a hang: the preempted request waits forever for ids no report can end."""
    r = check(hunt_bounds(KEEP), frozenset([KEEP]), without=frozenset({"INV-1"}))
    ce = r.counterexample
    assert ce is not None and ce.kind == "liveness" and ce.property_id == "P-2"
    assert ce.request == "r0" and ce.cycle_start is not None and ce.cycle
    assert "PREEMPTED_FLUSHING" in ce.summary
    events = [str(s.event) for s in ce.steps]
    assert "preempt(r0)" in events[:ce.cycle_start] and "reset()" in events[:ce.cycle_start]
    text = ce.render()
    assert "the cycle: steps" in text and "repeat forever" in text
    assert "the admission of r0: taken at step" in text and "P-2" in text


def test_a_job_that_never_completes_is_a_p1_lasso_and_the_old_check_agrees() -> None:
    bounds = hunt_bounds(M.Fault.AGGREGATE_COUNTS_ONCE)
    faults = frozenset([M.Fault.AGGREGATE_COUNTS_ONCE])
    r = check(bounds, faults)
    assert r.counterexample is not None and r.verdict == "liveness P-1"
    old = check_model(bounds, faults, liveness=False, stuck=True)
    assert old.counterexample is not None and old.counterexample.kind == "stuck"
    assert old.stuck_states > 0


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.abstract], ids=lambda m: m.name)
def test_the_checker_finds_each_abstract_mutant(mutant: Mutant) -> None:
    assert mutant.model_fault is not None and mutant.model_fault.value == mutant.name
    bounds = hunt_bounds(mutant.model_fault)
    r = check(bounds, frozenset([mutant.model_fault]))
    assert r.counterexample is not None, mutant.name
    assert r.engine == "compiled"  # and certify() replayed it on the Python model


def test_cli_check_exit_codes_and_json(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    assert cli.main(["check", "--scenario", "late-reports", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["scenarios"][0]
    assert (row["result"], row["expected"], row["verdict"]) == ("pass", "as expected", "pass")
    assert [p["property"] for p in row["liveness"]] == ["P-1", "P-2", "P-3", "P-4", "P-5"]
    assert "WF(report)" in row["liveness"][0]["fairness"]
    assert {f["class"] for f in data["fairness"]["weak"]} == {"step", "admit", "finish",
                                                              "report"}
    svg = tmp_path / "ce.svg"
    assert cli.main(["check", "--mutant", "reset-keeps-transfer-jobs", "--svg", str(svg)]) == 1
    out = capsys.readouterr().out
    assert "INV-1" in out and "1. arrive(r0)" in out
    if diagrams.have_dot():
        assert svg.read_text().startswith("<?xml")
    else:
        assert (tmp_path / "ce.dot").read_text().startswith("digraph counterexample")
    assert cli.main(["check", "--mutant", "no-such"]) == 2
    assert cli.main(["check", "--bounds", "requests=x"]) == 2
    assert cli.main(["check", "--mutant", "pending-count-one"]) == 2
    assert cli.main(["check", "--scenario", "late-reports", "--without", "INV-99"]) == 2


def test_check_without_liveness_searches_safety_alone_in_less_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--no-liveness: the same states and transitions, every invariant, no progress property
    (the PR #48102 hang with INV-1 off passes: only P-2 finds it), and fewer bytes."""
    argv = ["check", "--mutant", "reset-keeps-transfer-jobs", "--without", "INV-1", "--json"]
    assert cli.main([*argv, "--no-liveness"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["counterexample"] is None and bare["scenarios"][0]["liveness"] == []
    assert cli.main(argv) == 1
    live = json.loads(capsys.readouterr().out)
    assert live["counterexample"]["property"] == "P-2"
    assert cli.main(["check", "--scenario", "hybrid", "--json", "--no-liveness"]) == 0
    bare_row = json.loads(capsys.readouterr().out)["scenarios"][0]
    assert cli.main(["check", "--scenario", "hybrid", "--json"]) == 0
    live_row = json.loads(capsys.readouterr().out)["scenarios"][0]
    assert bare_row["expected"] == live_row["expected"] == "as expected"
    assert (bare_row["states"], bare_row["transitions"]) == (live_row["states"],
                                                             live_row["transitions"])
    assert 2 * bare_row["memory_bytes"] < live_row["memory_bytes"]
    assert cli.main(["check", "--mutate", "--no-liveness"]) == 2
    assert cli.main(["check", "--tiering", "--no-liveness"]) == 2
    assert "--no-liveness" in capsys.readouterr().err


def test_cli_json_gives_the_lasso(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--mutant", "reset-keeps-transfer-jobs", "--without", "INV-1",
                     "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    ce = data["counterexample"]
    assert ce["kind"] == "liveness" and ce["property"] == "P-2"
    assert 0 < ce["cycle_start"] < len(ce["steps"]) and ce["fairness"]
    assert data["without"] == ["INV-1"]


def test_a_changed_outcome_fails_the_check(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A silently weakened model changes a scenario's state count: `kvspec check` fails."""
    from spec import scenarios

    sc = scenarios.by_name("late-reports")
    assert sc.expect is not None
    wrong = type(sc)(sc.name, sc.purpose, sc.bounds,
                     Expect("pass", sc.expect.states + 1, sc.expect.depth))
    monkeypatch.setattr(scenarios, "SCENARIOS", (wrong,))
    monkeypatch.setattr("statemachine.cli.check.by_name", lambda name: wrong)
    assert cli.main(["check", "--scenario", "late-reports"]) == 1
    assert "EXPECTED pass" in capsys.readouterr().out


def test_the_lasso_is_drawn(tmp_path: Path) -> None:
    r = check(hunt_bounds(KEEP), frozenset([KEEP]), without=frozenset({"INV-1"}))
    assert r.counterexample is not None
    source = diagrams.counterexample_graph(r.counterexample).source
    assert "repeats forever" in source and "color=blue" in source


def test_bounds_parsing() -> None:
    b = parse_bounds("requests=1,timeout_steps=none,sync_loads=true", M.Bounds())
    assert (b.requests, b.timeout_steps, b.sync_loads) == (1, None, True)
    with pytest.raises(ValueError, match="bad bound"):
        parse_bounds("nope=1", M.Bounds())
    b = parse_bounds("sync_loads=on,stray_reports=off,timeout_steps=off", M.Bounds())
    assert (b.sync_loads, b.stray_reports, b.timeout_steps) == (True, False, None)


@pytest.mark.parametrize("text, says", [
    ("sync_loads=none", "sync_loads is a switch"),
    ("partial_reports=1", "partial_reports is a switch"),
    ("timeout_steps=true", "timeout_steps takes an integer or none"),
    ("requests=none", "requests takes an integer"),
    ("gpu_blocks=off", "gpu_blocks takes an integer"),
])
def test_a_bound_of_the_wrong_type_is_refused_by_name(text: str, says: str) -> None:
    """Each bound takes the values of its type: a switch true or false (on, off), a count
    an integer, a count that may be None also none; before, `none` made a count None and
    `true` made a timeout of one step."""
    with pytest.raises(ValueError, match=f"bad bound '{text}': {says}"):
        parse_bounds(text, M.Bounds())


_SMALL = M.Bounds(requests=1, workers=1, cpu_chunks=2, resets=0, failures=0, preemptions=0)


@pytest.mark.parametrize("tokens, decode, faults, floor", [
    (1, 0, {}, 1), (3, 0, {}, 3), (2, 2, {}, 2), (3, 1, {}, 3),
    (2, 2, {"failures": 1}, 2), (3, 2, {"timeout_steps": 1}, 3),
    (2, 1, {"preemptions": 1}, 2), (1, 3, {"preemptions": 1}, 3),
    (3, 2, {"preemptions": 1, "failures": 1, "resets": 1}, 4)])
def test_the_gpu_block_floor_is_exact_for_full_attention(
        tokens: int, decode: int, faults: dict[str, int], floor: int) -> None:
    """One block fewer than `gpu_blocks_floor` and the request never finishes (P-4); at the
    floor it does. Output adds to it only where a preemption re-admits a request with its
    output (a decoding request may stop after any token), and never its last token: a
    request that sampled it finishes, it is not preempted."""
    b = replace(_SMALL, tokens=tokens, decode_tokens=decode, **faults)
    assert b.gpu_blocks_floor() == floor
    below = check(replace(b, gpu_blocks=floor - 1), engine="compiled")
    assert below.counterexample is not None and below.counterexample.property_id == "P-4"
    assert check(replace(b, gpu_blocks=floor), engine="compiled").ok


def test_the_gpu_block_floor_is_a_lower_bound_beside_a_window_group() -> None:
    b = replace(_SMALL, tokens=2, groups=("full", "sliding"), sliding_window=1)
    assert b.gpu_blocks_floor() == 3
    below = check(replace(b, gpu_blocks=2))
    assert below.counterexample is not None and below.counterexample.property_id == "P-4"


def test_every_scenario_gives_a_request_its_gpu_block_floor() -> None:
    low = [sc.name for sc in SCENARIOS if sc.bounds.gpu_blocks < sc.bounds.gpu_blocks_floor()]
    assert not low


def test_check_changes_the_bounds_of_each_named_scenario(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--scenario A --scenario B --bounds X` checks A and B with X changed on each one's
    bounds (before, --bounds alone counted and the scenarios were dropped)."""
    assert cli.main(["check", "--scenario", "late-reports", "--scenario", "two-resets",
                     "--bounds", "workers=1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["scenarios"]
    assert [r["scenario"] for r in rows] == ["late-reports+workers=1", "two-resets+workers=1"]
    for row, name in zip(rows, ("late-reports", "two-resets"), strict=True):
        b = replace(by_name(name).bounds, workers=1)
        assert b != by_name(name).bounds
        assert row["states"] == check(b).states


def test_check_names_a_gpu_block_bound_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--bounds", "requests=1,tokens=3,gpu_blocks=2,workers=1,"
                     "resets=0,failures=0,preemptions=0"]) == 1
    captured = capsys.readouterr()
    assert "gpu_blocks=2 is below the 3 a request holds" in captured.err
    assert "liveness P-4" in captured.out


def test_check_svg_without_dot_writes_the_dot_source(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    assert cli.main(["check", "--mutant", "reset-keeps-transfer-jobs",
                     "--svg", str(tmp_path / "ce.svg")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "apt-get install -y graphviz" in err and "ce.dot" in err
    assert "color=red" in (tmp_path / "ce.dot").read_text()


def test_the_reference_checker_is_kept_behind_a_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--scenario", "late-reports", "--engine", "python",
                     "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["scenarios"][0]
    assert row["engine"] == "python" and row["expected"] == "as expected"
