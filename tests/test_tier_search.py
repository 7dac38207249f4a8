"""`statemachine.checker.tier_search`: the shortest program after which a mutant of the tables
holds another CPU tier than the spec, the way to a directed program that kills a mutant no
invariant sees (`kvspec check --mutate --only TEXT --tier-program`)."""

from __future__ import annotations

import json

import pytest

from spec.regressions import by_name
from spec.scenarios import by_name as scenario
from statemachine import cli
from statemachine.checker.tier_search import NoTierProgram, TierProgram, tier_program
from tests.test_spec_mutation import _named

FENCE_SLOTS = ("job: reset(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,TIMED_OUT)->STALE "
               "drop enter_reset_fence")


def test_the_search_finds_the_program_that_pins_the_tier_of_a_reset_fence_mutant() -> None:
    """The directed program `reset-frees-the-slot-of-a-timed-out-store` is what the search
    answers: its events and, as the pin, the spec's tier after them."""
    found = tier_program(scenario("timeouts").bounds, _named(FENCE_SLOTS).tables())
    assert isinstance(found, TierProgram)
    reg = by_name("reset-frees-the-slot-of-a-timed-out-store")
    assert found.program == reg.program and found.spec_tier == reg.tier
    assert found.mutant_tier == () and found.spec_tier != found.mutant_tier
    assert reg.bounds == scenario("timeouts").bounds


def test_a_mutant_of_bookkeeping_alone_leaves_every_tier_as_the_spec_has_it() -> None:
    found = tier_program(scenario("late-reports").bounds,
                         _named("request: add(ABSENT)->IDLE drop create_request_status").tables())
    assert isinstance(found, NoTierProgram) and found.complete and found.pairs > 1000


def test_the_search_stops_at_its_limit_and_says_so() -> None:
    found = tier_program(scenario("late-reports").bounds,
                         _named("request: add(ABSENT)->IDLE drop create_request_status").tables(),
                         max_pairs=50)
    assert isinstance(found, NoTierProgram) and not found.complete and found.pairs == 50


def test_the_cli_prints_the_program_and_both_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--mutate", "--only", "TIMED_OUT)->STALE drop enter_reset_fence",
                     "--tier-program", "--scenario", "timeouts", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    reg = by_name("reset-frees-the-slot-of-a-timed-out-store")
    assert out["mutant"] == FENCE_SLOTS and out["program"] == reg.program
    assert tuple(out["spec_tier"]) == reg.tier and out["mutant_tier"] == []
    assert cli.main(["check", "--mutate", "--only", "create_request_status",
                     "--tier-program", "--scenario", "late-reports"]) == 1
    assert "no program tells the tiers apart" in capsys.readouterr().out


@pytest.mark.parametrize("argv,why", [
    (["--only", "enter_reset_fence", "--scenario", "timeouts"], "--only TEXT must name one"),
    (["--only", FENCE_SLOTS], "one --scenario"),
    (["--only", FENCE_SLOTS, "--scenario", "timeouts", "--bounds", "nonsense=1"], "bad bound"),
])
def test_the_cli_refuses_a_search_it_cannot_run(argv: list[str], why: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--mutate", "--tier-program", *argv]) == 2
    assert why in capsys.readouterr().err
