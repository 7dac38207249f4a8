"""`kvspec`: the command line of kvoffload-spec.

One module per group of commands (`tables`: summary, diagrams, demo; `check`: check,
mutants; `simulate`; `replay`: a monitor's event log; `witness`: a row's shortest program),
each registering its parsers; `common` holds the exit codes, table printing and progress
lines they share.

Exit status: 0 when everything asked for holds, 1 when a check fails (stale diagrams, an
ill-formed table, a simulation that leaves a request stuck, a resource leaked or a byte
corrupted, ...), 2 on bad usage.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from statemachine.cli import check, replay, simulate, tables, witness
from statemachine.cli.common import EXIT_OK, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvspec", description=(__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for group in (tables, simulate, check, replay, witness):
        group.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    rc: int = args.func(args)
    return rc


__all__ = ["build_parser", "main"]
