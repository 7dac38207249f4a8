"""The kvspec command: exit statuses and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from statemachine import cli


def test_summary_json_counts_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["summary", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {m["machine"]: m for m in data["machines"]}
    assert set(by_name) == {"request", "job", "fence", "worker"}
    assert by_name["worker"]["states"] == 6
    assert by_name["request"]["states"] == 14
    assert all(m["problems"] == 0 for m in data["machines"])
    assert data["invariants_total"] == 24


def test_bad_usage_exits_2() -> None:
    assert cli.main(["no-such-command"]) == 2
    assert cli.main([]) == 2


def test_console_script_entry_point_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "kvspec", "summary"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "request" in out.stdout and "invariants: 24" in out.stdout


@pytest.mark.parametrize("argv", [["summary"], ["check", "--help"], ["mutants"],
                                  ["diagrams", "--check"],
                                  ["check", "--scenario", "late-reports"]],
                         ids=lambda a: " ".join(a))
def test_the_table_commands_never_import_torch(argv: list[str]) -> None:
    """torch is imported only where bytes are copied (kernels, workers, engine, simulate);
    of `kernels`, the checker uses only its torch-free C build helper (`kernels.toolchain`)."""
    code = ("import sys, contextlib, io, kvspec\n"
            f"sys.argv = ['kvspec', *{argv!r}]\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    kvspec.main()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in"
            " ('torch', 'numpy', 'hypothesis', 'kernels')"
            " and m not in ('kernels', 'kernels.toolchain')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_import_spec_never_imports_torch() -> None:
    code = "import sys, spec, spec.model, spec.checker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_package_sharing_an_import_name_is_reported_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    import kvspec

    real = importlib.metadata.distribution

    def fake(name: str) -> object:
        if name == "python-statemachine":
            return object()
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    assert kvspec.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python-statemachine" in err and "fresh venv" in err


def test_no_clash_in_this_environment() -> None:
    import kvspec

    assert kvspec.import_clash() is None


def test_progress_lines_only_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from statemachine.cli.common import Progress

    quiet = Progress("scenario")  # stderr captured: not a terminal, as in a CI log
    quiet("10 states")
    quiet.close()
    assert capsys.readouterr().err == ""
    stream = io.StringIO()
    shown = Progress("scenario", stream)
    shown("10 states")
    assert "scenario: 10 states" in stream.getvalue()
    shown.close()
    assert stream.getvalue().endswith("\r")


def test_check_takes_a_fault_of_the_window_paths(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvspec check --mutant` on a fault of the sliding-window paths: F2's trace, INV-15."""
    code = cli.main(["check", "--mutant", "reset-keeps-stale-window-blocks", "--json"])
    out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    assert code == 1, text  # found, as for a catalogue mutant
    assert "INV-15" in text and "reset()" in text, text
