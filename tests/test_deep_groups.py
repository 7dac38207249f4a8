"""`make check-groups`: exhaustive checks of several KV cache groups past the pinned
scenarios. Not in `make test`.

The compiled twin takes every kind of group (full attention, sliding windows in chunks of
one block or several under dense or sparse retention, Mamba groups, partial tails). These
cases take the scenarios further, with faults, timeouts, output tokens, more workers, a
third group or a third request the scenarios lack, and record what the checker concludes,
as a scenario does (the verdict, the distinct states, the depth of the search), with every
progress property held. A change to the model that moves a count shows here. Each is the
check `kvspec check --engine ENGINE --scenario NAME --bounds TEXT` runs. Every Python case
runs on both engines: they agree at 498,248, 233,621, 130,687, 324,517 and 168,857 states;
so do the scenarios of window groups (`hybrid`, `hybrid-reset-window`, `multi-token-blocks`,
`window-partial-chunk`, `window-retention`, `window-aligned-prompt`,
`window-only`, `hybrid-load-cap-0.34`, `hybrid-mamba`, `partial-tails`,
`loaded-state-handoff`, `loaded-states-of-two-groups`, `partial-tails-0.34`), which run here
on the Python model too.
"""

from __future__ import annotations

import pytest

from spec.progress import PROGRESS
from spec.scenarios import SCENARIOS, Expect, Scenario, by_name, parse_bounds
from statemachine.checker import check, compiled

pytestmark = pytest.mark.deep

DEEP: tuple[tuple[str, str, Expect], ...] = (
    # a window beside full attention, decoding, a job timeout and a reset
    ("hybrid", "resets=1,timeout_steps=2,decode_tokens=1", Expect("pass", 498_248, 28)),
    # chunks of two blocks a window leaves partly behind, with a failure and a preemption
    ("window-partial-chunk", "failures=1,preemptions=1", Expect("pass", 233_621, 28)),
    # a Mamba group beside full attention, async loads, a failure and a preemption
    ("hybrid-mamba", "sync_loads=false,failures=1,preemptions=1", Expect("pass", 130_687, 21)),
    # partial tails with a failure and a preemption
    ("partial-tails", "failures=1,preemptions=1", Expect("pass", 324_517, 22)),
    # three groups: full attention, a sliding window and a Mamba group, with a failure
    ("hybrid", "groups=full+sliding+mamba,gpu_blocks=9,cpu_chunks=4,preemptions=0",
     Expect("pass", 168_857, 21)),
)


DEEP_COMPILED: tuple[tuple[str, str, Expect], ...] = (
    # the first Python case again: the compiled twin finds the same states and depth
    ("hybrid", "resets=1,timeout_steps=2,decode_tokens=1", Expect("pass", 498_248, 28)),
    # a window beside full attention, 2 workers reporting in parts, a reset
    ("hybrid", "workers=2,resets=1", Expect("pass", 1_102_986, 25)),
    # two output tokens each, eight GPU blocks for two requests of two groups, a reset
    ("hybrid", "decode_tokens=2,gpu_blocks=8,resets=1", Expect("pass", 1_078_502, 28)),
    # blocks of two tokens, a window of 3, two output tokens (7 tokens a request), a reset
    ("multi-token-blocks", "resets=1,decode_tokens=2", Expect("pass", 1_110_738, 32)),
    # three requests sharing a prefix beside a window, a failure and a preemption
    ("hybrid", "requests=3,gpu_blocks=10", Expect("pass", 17_113_878, 30)),
    # two full-attention groups and a window (vLLM's groups of a 2:1 model), a reset
    ("hybrid", "groups=full+full+sliding,gpu_blocks=10,cpu_chunks=4,resets=1",
     Expect("pass", 125_037, 24)),
    # two full-attention groups, 2 workers reporting in parts
    ("two-full-groups", "workers=2", Expect("pass", 475_145, 23)),
    # the second Python case again: windows in chunks of 2 blocks, stored in part
    ("window-partial-chunk", "failures=1,preemptions=1", Expect("pass", 233_621, 28)),
    # chunks of 2 blocks, 2 workers reporting in parts, a failure
    ("window-partial-chunk", "workers=2,failures=1", Expect("pass", 225_219, 21)),
    # chunks of 3 blocks, prompts that end on a chunk's edge, a failure and a preemption
    ("window-aligned-prompt", "failures=1,preemptions=1", Expect("pass", 215_426, 30)),
    # vLLM's default retention, three requests sharing a prefix
    ("window-retention", "requests=3,gpu_blocks=15,cpu_chunks=6", Expect("pass", 303_308, 25)),
    # a window on every layer at retention 0, a failure and a preemption
    ("window-only", "failures=1,preemptions=1", Expect("pass", 436_009, 25)),
    # the same decoding two tokens: output chunks no tail needs, passed over unstored
    ("window-only", "preemptions=1,decode_tokens=2,gpu_blocks=6", Expect("pass", 1_126_744, 29)),
    # the last three Python cases again: a Mamba group, partial tails and three groups
    ("hybrid-mamba", "sync_loads=false,failures=1,preemptions=1", Expect("pass", 130_687, 21)),
    ("partial-tails", "failures=1,preemptions=1", Expect("pass", 324_517, 22)),
    ("hybrid", "groups=full+sliding+mamba,gpu_blocks=9,cpu_chunks=4,preemptions=0",
     Expect("pass", 168_857, 21)),
    # three groups with a preemption in place of the failure
    ("hybrid", "groups=full+sliding+mamba,gpu_blocks=9,cpu_chunks=4,failures=0",
     Expect("pass", 377_788, 31)),
    # a Mamba group alone, the state a load ended on handed off; a preemption, decoding
    ("loaded-state-handoff", "preemptions=1,decode_tokens=1", Expect("pass", 153_003, 20)),
    # the same with a failure
    ("loaded-state-handoff", "failures=1,preemptions=1,decode_tokens=1",
     Expect("pass", 319_845, 20)),
    # two Mamba groups, a failure and a preemption
    ("loaded-states-of-two-groups", "failures=1,preemptions=1", Expect("pass", 1_695_121, 25)),
    # three requests sharing a prefix beside a Mamba group, async loads
    ("hybrid-mamba", "sync_loads=false,requests=3,gpu_blocks=12,cpu_chunks=6",
     Expect("pass", 411_260, 23)),
    # a Mamba group in chunks of 2 blocks (a hand-off writes its chunk's last block), a
    # reset and a failure
    ("hybrid-mamba", "sync_loads=false,blocks_per_chunk=2,tokens=4,gpu_blocks=8,resets=1,"
     "failures=1", Expect("pass", 142_739, 22)),
    # vLLM's default retention (only the replay boundary's state), 5-token prompts
    ("hybrid-mamba", "sync_loads=false,tokens=5,retention_interval=0,gpu_blocks=10,resets=1,"
     "failures=1", Expect("pass", 2_125_428, 27)),
    # partial tails under 0.34.0's search, with a reset
    ("partial-tails-0.34", "resets=1", Expect("pass", 2_202_387, 24)),
    # partial tails, a reset, a failure and an output token
    ("partial-tails", "resets=1,failures=1,decode_tokens=1", Expect("pass", 2_099_397, 23)),
    # three requests sharing a prefix and its tail
    ("partial-tails", "requests=3,gpu_blocks=12", Expect("pass", 578_529, 22)),
    # 2 workers reporting in parts, a failure
    ("partial-tails", "workers=2,failures=1", Expect("pass", 498_761, 19)),
)


@pytest.mark.parametrize(("name", "bounds", "expect"), DEEP,
                         ids=[f"{n}+{t}" for n, t, _e in DEEP])
def test_a_deep_check_of_the_groups_concludes_what_it_records(
        name: str, bounds: str, expect: Expect) -> None:
    _concludes(name, bounds, expect, "python")


@pytest.mark.parametrize(("name", "bounds", "expect"), DEEP_COMPILED,
                         ids=[f"{n}+{t}" for n, t, _e in DEEP_COMPILED])
def test_a_deep_compiled_check_of_the_groups_concludes_what_it_records(
        name: str, bounds: str, expect: Expect) -> None:
    _concludes(name, bounds, expect, "compiled")


COMPILED_WINDOWS = tuple(sc for sc in SCENARIOS if sc.bounds.window_groups()
                         and compiled.fits(sc.bounds) is None)
"""The scenarios of window groups (sliding or Mamba) the compiled twin takes
(`test_checker.py` pins them there)."""


@pytest.mark.parametrize("scenario", COMPILED_WINDOWS, ids=lambda s: s.name)
def test_each_compiled_window_scenario_concludes_the_same_on_the_python_model(
        scenario: Scenario) -> None:
    """The Python model, which states the window groups' rules, concludes what the compiled
    twin does on each window scenario it takes (states, depth, every progress property
    held)."""
    assert scenario.expect is not None
    r = check(scenario.bounds, engine="python")
    assert r.complete and r.engine == "python"
    assert Expect(r.verdict, r.states, r.depth) == scenario.expect, (
        r.counterexample.render() if r.counterexample else r)
    assert r.liveness == tuple(p.id for p in PROGRESS)


def _concludes(name: str, bounds: str, expect: Expect, engine: str) -> None:
    b = parse_bounds(bounds, by_name(name).bounds)
    assert b != by_name(name).bounds
    r = check(b, engine=engine)
    assert r.complete and r.engine == engine, r
    assert Expect(r.verdict, r.states, r.depth) == expect, (
        r.counterexample.render() if r.counterexample else r)
    assert r.liveness == tuple(p.id for p in PROGRESS)
