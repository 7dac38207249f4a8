"""Subprocesses a conformance test needs, started when the run starts.

Some tests run vLLM in fresh processes (a source tree ahead of the wheel, another
PYTHONHASHSEED); each such process spends most of its time importing vLLM. They are
started once the run's tests are collected, and each test collects its own. They then run on
the
second core while the in-process tests run on the first, instead of one after the other at
the end of the run.

A module declares its processes as data, `EARLY_JOBS`: test name -> a function giving that
test's processes by key (argv and environment, run in the repository root). The conftest
starts those of the selected tests (`start_selected`); a test collects one with `result_of`.

A process that was not started early (the module's hook not called, e.g. a run that
imports the module another way) is started when its test asks for it, so the outcome never
depends on the hook; only the run time does.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 600
ROOT = Path(__file__).resolve().parents[2]
"""Where every process runs: the repository root."""

Job = tuple[list[str], dict[str, str]]
"""A process: argv and environment."""
Jobs = Mapping[str, Callable[[], dict[str, Job]]]
"""A module's `EARLY_JOBS`: test name -> that test's processes by key."""
_DIR = Path(tempfile.mkdtemp(prefix="kvspec-early-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


@dataclass
class Spawned:
    argv: list[str]
    proc: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the process (at most TIMEOUT_S) and return what it printed."""
        try:
            code = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return subprocess.CompletedProcess(self.argv, code, self.stdout.read_text(),
                                           self.stderr.read_text())


_STARTED: dict[str, Spawned] = {}


def _start(key: str, job: Job) -> Spawned:
    """Start `job` under `key` unless a process is already started under it."""
    if key not in _STARTED:
        argv, env = job
        out, err = _DIR / f"{len(_STARTED)}.out", _DIR / f"{len(_STARTED)}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=o, stderr=e,
                                    stdin=subprocess.DEVNULL)
        _STARTED[key] = Spawned(argv, proc, out, err)
    return _STARTED[key]


def start_selected(jobs: Jobs, selected: set[str]) -> None:
    """Start the processes of the `selected` tests."""
    for name in sorted(selected & jobs.keys()):
        for key, job in jobs[name]().items():
            _start(key, job)


def result_of(jobs: Jobs, test: str, key: str) -> subprocess.CompletedProcess[str]:
    """`test`'s finished process `key` (started now if it was not yet)."""
    return _start(key, jobs[test]()[key]).result()


def stop_all() -> None:
    """Kill what is still running (a run interrupted, or a test deselected after the start)."""
    for spawned in _STARTED.values():
        if spawned.proc.poll() is None:
            spawned.proc.kill()
            spawned.proc.wait()


atexit.register(stop_all)
