"""`kvspec check --mutate`: the kill matrix of the spec's own mutants."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict

from spec.equivalents import EQUIVALENT
from statemachine.checker.mutation import kill_matrix, matrix_scenarios, spec_mutants
from statemachine.cli.common import EXIT_FAIL, EXIT_OK, Progress, print_table


def cmd_mutate(args: argparse.Namespace) -> int:
    mutants = spec_mutants()
    show = Progress("mutants")
    kills = list(kill_matrix(mutants, jobs=args.jobs,
                             progress=None if args.json else
                             lambda n, total: show(f"{n} of {total}")))
    show.close()
    gaps = [k for k in kills if not k.killed and k.equivalent is None]
    wrong = [k for k in kills if k.by == "disagreement"]
    # a listed survivor that is killed now, or that no longer exists: its reason is stale
    stale = sorted(set(EQUIVALENT) - {k.mutant for k in kills if not k.killed})
    tally = Counter(k.by.split()[0] if k.killed else
                    (k.equivalent.kind if k.equivalent else "survived") for k in kills)
    if args.json:
        print(json.dumps({
            "scenarios": [s.name for s in matrix_scenarios()],
            "mutants": len(kills), "tally": dict(tally),
            "non_equivalent_survivors": [k.mutant for k in gaps],
            "stale_equivalents": stale,
            "matrix": [asdict(k) for k in kills],
        }, indent=2, ensure_ascii=False))
    else:
        rows = [{"mutant": k.mutant,
                 "killed by": k.by if k.killed else
                 (k.equivalent.kind if k.equivalent else "SURVIVED"),
                 "in": k.scenario or "-", "steps": k.steps or "-"} for k in kills]
        print_table(rows, ["mutant", "killed by", "in", "steps"])
        print(f"\n{len(kills)} mutants over {len(matrix_scenarios())} scenarios: "
              + ", ".join(f"{n} {what}" for what, n in sorted(tally.items())))
        for k in gaps:
            print(f"  survived, not listed as equivalent in spec/equivalents.py: {k.mutant}")
        for k in wrong:
            print(f"  the compiled checker and the model disagree on {k.mutant}: {k.detail}")
        for name in stale:
            print(f"  listed in spec/equivalents.py but killed or gone: {name}")
    return EXIT_FAIL if gaps or wrong or stale else EXIT_OK
