"""The kvspec command: exit statuses and output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statemachine import cli


def test_summary_json_counts_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["summary", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {m["machine"]: m for m in data["machines"]}
    assert set(by_name) == {"request", "job", "fence", "worker"}
    assert by_name["worker"]["states"] == 6
    assert by_name["request"]["states"] == 13
    assert all(m["problems"] == 0 for m in data["machines"])
    assert data["invariants_total"] == 19


def test_bad_usage_exits_2() -> None:
    assert cli.main(["no-such-command"]) == 2
    assert cli.main([]) == 2


def test_console_script_entry_point_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "kvspec", "summary"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "request" in out.stdout and "invariants: 19" in out.stdout
