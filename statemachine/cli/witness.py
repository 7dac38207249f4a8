"""`kvspec witness [ROW ...]`: for a row of the tables, a shortest program that fires it."""

from __future__ import annotations

import argparse
import json

from statemachine.cli.common import EXIT_FAIL, EXIT_OK, Progress, print_table, usage_error


def cmd_witness(args: argparse.Namespace) -> int:
    from spec import witnesses as W

    if args.write:
        return _write()
    rows = W.all_rows()
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        return usage_error("witness", f"no row {', '.join(unknown)}; rows are named as in "
                           f"spec/SPEC.md's tables: {next(iter(rows))} .. {list(rows)[-1]}")
    chosen = [W.by_row(r) for r in args.rows] if args.rows else list(W.WITNESSES)
    if args.json:
        print(json.dumps([{**w.__dict__, "steps": len(w.events()),
                           "row_text": W.describe_row(w.row)} for w in chosen], indent=2))
    elif args.rows:
        print("\n\n".join(W.render(w) for w in chosen))
    else:
        print_table([{"row": w.row, "transition": W.describe_row(w.row).partition(": ")[2],
                      "scenario": w.scenario, "steps": len(w.events())} for w in chosen])
        print(f"\n{len(chosen)} witnesses for {len(rows)} rows; `kvspec witness ROW` prints "
              "one step by step")
    return EXIT_OK if len(W.WITNESSES) == len(rows) or args.rows else EXIT_FAIL


def _write() -> int:
    from spec import model as M
    from spec import witnesses
    from statemachine.checker import check, compiled

    every = set(witnesses.all_rows().values())

    def covers(bounds: M.Bounds) -> set[tuple[str, int]]:
        """The compiled checker's coverage of a scenario, where it takes the bounds."""
        try:
            return check(bounds, liveness=False, engine="compiled").covered
        except compiled.CompiledUnavailable:
            return every

    progress = Progress("searching")
    found = witnesses.generate(lambda name, n: progress(f"{name}: {n} rows"), covers)
    progress.close()
    witnesses.write(found)
    missing = sorted(set(witnesses.all_rows()) - {w.row for w in found})
    print(f"wrote {witnesses.PATH}: {len(found)} witnesses"
          + (f"; no scenario fires {', '.join(missing)}" if missing else ""))
    return EXIT_FAIL if missing else EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("witness", help="a shortest program that fires a row of the tables",
                       description=(__doc__ or "").splitlines()[0] + " Without a row, the "
                       "list of every row's witness (spec/witnesses.json).")
    p.add_argument("rows", nargs="*", metavar="ROW",
                   help="a row as named in spec/SPEC.md's tables (r48, j20, f5)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true",
                   help="search every scenario again and rewrite spec/witnesses.json (minutes)")
    p.set_defaults(func=cmd_witness)
