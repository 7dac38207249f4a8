"""`kvspec check --tiering`: the scenarios' table with their pinned outcomes, a fault hunt
printing its counterexample, and usage errors."""

from __future__ import annotations

import json

import pytest

from statemachine.cli import main


def test_a_tiering_scenario_reports_its_pinned_outcome(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    rc = main(["check", "--tiering", "--scenario", "tier-promotion-eviction-pressure",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    (row,) = out["scenarios"]
    assert (row["verdict"], row["states"], row["expected"]) == ("pass", 1208, "as expected")


def test_a_tiering_fault_hunt_prints_its_trace_and_fails(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    rc = main(["check", "--mutant", "finalize-before-final-store"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "no row for 'store_completed' in FINALIZED" in out
    assert "4. finish(0)" in out and "5. store_done(0, 1)" in out


def test_an_unknown_tiering_scenario_is_a_usage_error(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    assert main(["check", "--tiering", "--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no tiering scenario 'nope'" in err and "tier-hung" in err
