"""A command run under valgrind's callgrind, for the benchmarks whose wall-clock figures this
shared machine disturbs (bench/checker_memory.py, bench/kernels.py): an instruction count is
the same from run to run where a timing of the same work varies by half or more."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def missing() -> str | None:
    """Why callgrind cannot run here, or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not on the PATH (Debian: apt-get install valgrind)"
    return None


@contextmanager
def profile(command: list[str], cwd: Path) -> Iterator[tuple[str, Path]]:
    """Run `command` in `cwd` under callgrind; yield its stdout and the profile's path (the
    profile is removed on exit). A failing command raises CalledProcessError."""
    with tempfile.TemporaryDirectory() as tmp:
        counts = Path(tmp) / "callgrind.out"
        out = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={counts}",
                              *command], cwd=cwd, check=True, capture_output=True,
                             text=True).stdout
        yield out, counts


def total_instructions(counts: Path) -> int:
    """Every instruction a profile counts, in every thread (its `totals:` line)."""
    for line in counts.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError(f"{counts}: no totals line; not a callgrind profile?")
