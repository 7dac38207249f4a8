"""A git revision checked out beside this tree, for the scripts that compare the two side by
side (bench/model.py, bench/checker_memory.py, scripts/checker_answers.py)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached git worktree of `rev` in a temporary folder, removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "against"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            yield other
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT,
                           check=True, capture_output=True)
