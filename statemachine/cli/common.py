"""What every `kvspec` command shares: exit codes, tables, progress lines, one-line notes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
"""0: everything asked for holds; 1: a check failed; 2: bad usage (or a missing system
piece the command cannot do without)."""


def print_table(rows: Sequence[dict[str, Any]], cols: Sequence[str] | None = None,
                out: TextIO | None = None) -> None:
    """Rows as left-aligned columns under a header and a rule."""
    if not rows:
        return
    stream = out or sys.stdout
    names = list(cols or rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in names}
    print("  ".join(c.ljust(widths[c]) for c in names).rstrip(), file=stream)
    print("  ".join("-" * widths[c] for c in names), file=stream)
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in names).rstrip(), file=stream)


def note(text: str) -> None:
    """One line on stderr about something the command could not do, and how to get it."""
    print(f"note: {text}", file=sys.stderr)


def usage_error(command: str, text: str) -> int:
    print(f"kvspec {command}: {text}", file=sys.stderr)
    return EXIT_USAGE


class Progress:
    """A progress line on stderr, rewritten in place, erased by `close`; silent where stderr
    is not a terminal (a CI log would keep every rewrite)."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.shown = False
        self.live = stream is not None or sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        if not self.live:
            return
        print(f"\r  {self.label}: {text} ...", end="", file=self.stream, flush=True)
        self.shown = True

    def close(self) -> None:
        if self.shown:
            print("\r" + " " * 78 + "\r", end="", file=self.stream, flush=True)
            self.shown = False


Command = Callable[[Any], int]
