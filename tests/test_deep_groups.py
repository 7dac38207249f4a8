"""`make check-groups`: exhaustive checks of window and Mamba groups past the pinned
scenarios, on the Python model. Not in `make test`.

The compiled twin has one full-attention group, so the scenarios of sliding windows and
Mamba groups stay small enough for the Python model in `make test` (5,000 to 75,000
states). These cases take some of them further, with faults, timeouts or output tokens
they lack, and record what the checker concludes, as a scenario does (the verdict, the
distinct states, the depth of the search), with every progress property held. A change to
the model that moves a count shows here. Each is the check
`kvspec check --engine python --scenario NAME --bounds TEXT` runs.
"""

from __future__ import annotations

import pytest

from spec.progress import PROGRESS
from spec.scenarios import Expect, by_name, parse_bounds
from statemachine.checker import check

pytestmark = pytest.mark.deep

DEEP: tuple[tuple[str, str, Expect], ...] = (
    # a window beside full attention, decoding, a job timeout and a reset
    ("hybrid", "resets=1,timeout_steps=2,decode_tokens=1", Expect("pass", 498_248, 28)),
    # chunks of two blocks a window leaves partly behind, with a failure and a preemption
    ("window-partial-chunk", "failures=1,preemptions=1", Expect("pass", 233_621, 28)),
    # a Mamba group beside full attention, async loads, a failure and a preemption
    ("hybrid-mamba", "sync_loads=false,failures=1,preemptions=1", Expect("pass", 130_687, 21)),
    # a Mamba group alone, the state a load ended on handed off; a preemption, decoding
    ("loaded-state-handoff", "preemptions=1,decode_tokens=1", Expect("pass", 153_003, 20)),
    # partial tails with a failure and a preemption
    ("partial-tails", "failures=1,preemptions=1", Expect("pass", 324_517, 22)),
    # three groups: full attention, a sliding window and a Mamba group, with a failure
    ("hybrid", "groups=full+sliding+mamba,gpu_blocks=9,cpu_chunks=4,preemptions=0",
     Expect("pass", 168_857, 21)),
    # the same with a preemption in place of the failure
    ("hybrid", "groups=full+sliding+mamba,gpu_blocks=9,cpu_chunks=4,failures=0",
     Expect("pass", 377_788, 31)),
)


@pytest.mark.parametrize(("name", "bounds", "expect"), DEEP,
                         ids=[f"{n}+{t}" for n, t, _e in DEEP])
def test_a_deep_check_of_the_groups_concludes_what_it_records(
        name: str, bounds: str, expect: Expect) -> None:
    b = parse_bounds(bounds, by_name(name).bounds)
    assert b != by_name(name).bounds
    r = check(b, engine="python")
    assert r.complete, r
    assert Expect(r.verdict, r.states, r.depth) == expect, (
        r.counterexample.render() if r.counterexample else r)
    assert r.liveness == tuple(p.id for p in PROGRESS)
