"""Test-session hooks shared by every test directory."""

from __future__ import annotations

import json

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After `make soak`: the totals of every seed (the workers' results come back as
    `record_property("soak", ...)`), then each failure, first violation first."""
    from statemachine.soak import SoakResult, summary

    results = []
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            for name, value in getattr(report, "user_properties", ()):
                if name == "soak":
                    results.append(SoakResult.from_dict(json.loads(value)))
    if results:
        terminalreporter.write_sep("=", "soak")
        terminalreporter.write_line(summary(results))
