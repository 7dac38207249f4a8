"""The compiled search on several threads: the same answer as on one, field for field.

The search expands a batch of states on every thread and merges it on one, in the order a
search of one thread meets its states (statemachine/checker/c/search.c, the search); the
progress properties' instances are searched side by side and the first one in order that
fails is reported. So the states, transitions, depth, verdict, counterexample, message,
rows covered and progress properties held must not depend on the number of threads, for a
search that passes, one that stops on a finding, and one cut short by `max_states`. Every
scenario but the longest is searched on one thread and on several in
`test_checker.py::test_each_compiled_scenario_concludes_what_it_records`, once for both."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kernels import toolchain
from spec import model as M
from spec.scenarios import SCENARIOS, by_name, hunt_bounds
from statemachine import cli
from statemachine.checker import check, compiled


def _answer(r: compiled.Run) -> tuple[object, ...]:
    """Everything a run says but its time and its threads."""
    return (r.states, r.edges, r.depth, r.complete, r.verdict, r.invariant, r.inside_hook,
            r.request, r.prefix, r.cycle, r.stuck_states, r.message, r.covered, r.live_checked)


@pytest.fixture(autouse=True)
def _compiled() -> None:
    why = compiled.available()
    if why:
        pytest.skip(why)


def _fault_cases() -> list[tuple[str, M.Bounds, frozenset[str]]]:
    cases = []
    for f in M.Fault:
        b = hunt_bounds(f)
        if compiled.fits(b) is None:
            cases.append((f.value, b, frozenset()))
            cases.append((f.value, b, frozenset({"INV-1"})))
    return cases


@pytest.mark.parametrize("fault,b,without", _fault_cases(),
                         ids=lambda v: v if isinstance(v, str) else
                         ("no-INV-1" if v else "all") if isinstance(v, frozenset) else "")
def test_every_finding_is_the_same_on_four_threads(fault: str, b: M.Bounds,
                                                   without: frozenset[str]) -> None:
    """A search that stops: the same first finding (the one a search of one thread meets
    first), its counterexample (a lasso for liveness), its message, and only the rows fired
    up to it."""
    faults = frozenset([M.Fault(fault)])
    one = compiled.search(b, faults, without=without, threads=1)
    assert one.verdict != "ok"
    many = compiled.search(b, faults, without=without, threads=4)
    assert _answer(many) == _answer(one)


def test_a_lasso_is_the_same_on_sixteen_threads() -> None:
    """More members than the liveness pass lets hold a Tarjan scratch on a small graph (the
    scratches may take no more memory than the graph): the same lasso."""
    f = M.Fault.RESET_KEEPS_TRANSFER_JOBS
    b, without = hunt_bounds(f), frozenset({"INV-1"})
    one = compiled.search(b, frozenset([f]), without=without, threads=1)
    many = compiled.search(b, frozenset([f]), without=without, threads=16)
    assert one.verdict == "liveness" and one.cycle and many.threads == 16
    assert _answer(many) == _answer(one)


def test_the_findings_cover_every_kind_of_stop() -> None:
    """The cases above stop on an invariant, an illegal event and a progress property."""
    verdicts = set()
    for fault, b, without in _fault_cases():
        verdicts.add(compiled.search(b, frozenset([M.Fault(fault)]), without=without).verdict)
    assert {"invariant", "illegal", "liveness"} <= verdicts


@pytest.mark.parametrize("name", ["two-resets", "hybrid", "partial-tails"])
def test_a_search_cut_short_is_the_same_on_three_threads(name: str) -> None:
    """`max_states` stops after the state whose successors reached it, on any number of
    threads; the rows covered are those fired before the stop, so they grow with the cut,
    and the whole search covers rows the first state does not."""
    b = by_name(name).bounds
    full = compiled.search(b, threads=3)
    previous: frozenset[tuple[str, int]] = frozenset()
    for cut in (1, 10, 300, 5000):
        one = compiled.search(b, max_states=cut, threads=1)
        many = compiled.search(b, max_states=cut, threads=3)
        assert not one.complete and one.states >= cut
        assert _answer(many) == _answer(one)
        assert previous <= one.covered <= full.covered
        previous = frozenset(one.covered)
    first = compiled.search(b, max_states=1, threads=3)
    assert first.covered < full.covered


@st.composite
def _searches(draw: st.DrawFn) -> tuple[M.Bounds, M.Faults, frozenset[str], int | None, int]:
    """Perhaps a fault; a scenario's bounds or the fault's, with a few fields changed;
    perhaps INV-1 off; perhaps a cut; and a number of threads."""
    fault = draw(st.sampled_from([None, *M.Fault]))
    faults = M.NO_FAULTS if fault is None else frozenset([fault])
    if fault is not None and draw(st.booleans()):
        b = hunt_bounds(fault)  # where the fault is found
    else:
        b = draw(st.sampled_from([s for s in SCENARIOS
                                  if s.expect is not None and s.expect.states <= 150_000])).bounds
    changes = draw(st.fixed_dictionaries({}, optional={
        "workers": st.integers(1, 2), "resets": st.integers(0, 2),
        "failures": st.integers(0, 1), "preemptions": st.integers(0, 1),
        "timeout_steps": st.sampled_from([None, 2]), "sync_loads": st.booleans(),
        "cpu_chunks": st.integers(1, 3), "stray_reports": st.booleans()}))
    try:
        b = dataclasses.replace(b, **changes)
    except ValueError:
        assume(False)
    assume(compiled.fits(b) is None)
    without = draw(st.sampled_from([frozenset(), frozenset({"INV-1"})]))
    cut = draw(st.sampled_from([None, None, None, 1, 2, 50, 2_000]))
    return b, faults, without, cut, draw(st.integers(2, 5))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_searches())
def test_any_search_is_the_same_on_several_threads(
        search: tuple[M.Bounds, M.Faults, frozenset[str], int | None, int]) -> None:
    """Drawn bounds, faults and cuts: the first state's own finding, a cut inside the first
    batch, a finding past many batches, a lasso; every answer the same as on one thread. A
    search past 200,000 states is cut there, so that the draw stays quick."""
    b, faults, without, cut, threads = search
    cut = cut or 200_000
    one = compiled.search(b, faults, without=without, max_states=cut, threads=1)
    many = compiled.search(b, faults, without=without, max_states=cut, threads=threads)
    event(f"{one.verdict}, {'complete' if one.complete else 'cut'}")
    assert _answer(many) == _answer(one)


def test_the_older_progress_check_is_the_same_on_two_threads() -> None:
    b = by_name("sync-preemption").bounds
    one = compiled.search(b, stuck=True, threads=1)
    many = compiled.search(b, stuck=True, threads=2)
    assert one.verdict == "ok" and _answer(many) == _answer(one)


def test_at_most_sixty_four_threads_search() -> None:
    b = by_name("two-resets").bounds
    r = compiled.search(b, threads=100)
    assert r.threads == 64
    assert _answer(r) == _answer(compiled.search(b, threads=1))


def test_threads_must_be_a_count() -> None:
    b = by_name("two-resets").bounds
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            compiled.search(b, threads=bad)  # type: ignore[arg-type]


def test_the_checker_names_its_threads() -> None:
    b = by_name("two-resets").bounds
    assert check(b, engine="compiled").engine == "compiled"
    assert check(b, engine="compiled", threads=2).engine == "compiled, 2 threads"


def test_kvspec_check_takes_threads(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--scenario", "two-resets", "--threads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenarios"][0]["engine"] == "compiled, 2 threads"
    assert cli.main(["check", "--scenario", "two-resets", "--threads", "0"]) == 2
    assert "--threads must be 1 or more" in capsys.readouterr().err
    assert cli.main(["check", "--mutate", "--threads", "2"]) == 2
    assert "in --jobs processes" in capsys.readouterr().err
    assert cli.main(["check", "--tiering", "--threads", "2"]) == 2
    assert "tiering checker runs in Python" in capsys.readouterr().err


_TSAN_RUN = """
import sys
from spec import model as M
from spec.scenarios import by_name, hunt_bounds
from statemachine.checker import compiled as C
C.FLAGS = tuple(f for f in C.FLAGS if f != "-Wl,--no-undefined") + (
    "-fsanitize=thread", "-g", "-O1")
for name in ("hybrid", "partial-tails", "two-resets", "loaded-state-handoff"):
    r = C.search(by_name(name).bounds, threads=4)
    assert r.verdict == "ok", (name, r.verdict)
f = M.Fault.RESET_KEEPS_TRANSFER_JOBS
r = C.search(hunt_bounds(f), frozenset([f]), without=frozenset({"INV-1"}), threads=4)
assert r.verdict == "liveness", r.verdict
print("searched")
"""


@pytest.mark.deep
def test_the_threads_share_nothing_unguarded() -> None:
    """The search built with ThreadSanitizer, on four threads, over scenarios of every kind
    of group and a liveness finding: no data race reported."""
    cc = toolchain.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    tsan = subprocess.run([cc, "-print-file-name=libtsan.so"], capture_output=True,
                          text=True).stdout.strip()
    if not tsan or not Path(tsan).is_file():
        pytest.skip("the compiler has no ThreadSanitizer runtime")
    env = {**os.environ, "LD_PRELOAD": str(Path(tsan).resolve()),
           "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    run = subprocess.run([sys.executable, "-c", _TSAN_RUN], capture_output=True, text=True,
                         env=env, timeout=600)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0 and "searched" in run.stdout, run.stderr[-4000:]
