"""Subprocesses a conformance test needs, started when the run starts.

Some tests run vLLM in fresh processes (a source tree ahead of the wheel, another
PYTHONHASHSEED); each such process spends most of its time importing vLLM. A test module
that has them defines ``start_early(selected)``: the conftest calls it once the run's tests
are collected (with the names of the module's tests that will run), the module starts its
processes with `start`, and each test collects its own with `result`. They then run on the
second core while the in-process tests run on the first, instead of one after the other at
the end of the run.

A process that was not started early (the module's hook not called, e.g. a run that
imports the module another way) is started when its test asks for it, so the outcome never
depends on the hook; only the run time does.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 600
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


def start(key: str, argv: list[str], *, cwd: Path, env: dict[str, str]) -> Spawned:
    """Start `argv` under `key` unless a process is already started under it."""
    if key not in _STARTED:
        out, err = _DIR / f"{len(_STARTED)}.out", _DIR / f"{len(_STARTED)}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=o, stderr=e,
                                    stdin=subprocess.DEVNULL)
        _STARTED[key] = Spawned(argv, proc, out, err)
    return _STARTED[key]


def result(key: str, argv: list[str], *, cwd: Path,
           env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The finished process started under `key` (started now if it was not yet)."""
    return start(key, argv, cwd=cwd, env=env).result()


def stop_all() -> None:
    """Kill what is still running (a run interrupted, or a test deselected after the start)."""
    for spawned in _STARTED.values():
        if spawned.proc.poll() is None:
            spawned.proc.kill()
            spawned.proc.wait()


atexit.register(stop_all)
