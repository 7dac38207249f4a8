"""`kvspec check --mutate`: the kill matrix of the spec's own mutants."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from spec.equivalents import EQUIVALENT
from statemachine.checker import mutation
from statemachine.checker.mutation import (
    PROOF,
    SpecMutant,
    counterexample_of,
    kill_matrix,
    matrix_scenarios,
    proven_survivors,
    spec_mutants,
    write_proof,
)
from statemachine.checker.tier_search import TierProgram, tier_program
from statemachine.cli.check import (
    chosen_scenarios,
    counterexample_json,
    print_counterexample,
    write_counterexample_svg,
)
from statemachine.cli.common import EXIT_FAIL, EXIT_OK, Progress, print_table, usage_error


def cmd_mutate(args: argparse.Namespace) -> int:
    mutants = spec_mutants()
    if args.only:
        mutants = [m for m in mutants if args.only in m.name]
        if not mutants:
            return usage_error("check", f"no mutant of the tables has {args.only!r} in its "
                               "name (kvspec check --mutate lists them)")
    if args.tier_program:
        return _tier_program(args, mutants)
    scenarios = matrix_scenarios()
    proven = {} if args.reprove else proven_survivors(scenarios)
    show = Progress("mutants")
    kills = list(kill_matrix(mutants, jobs=args.jobs, proven=proven,
                             progress=None if args.json else
                             lambda n, total: show(f"{n} of {total}")))
    show.close()
    reused = sorted({k.mutant for k in kills} & set(proven) & set(EQUIVALENT))
    gaps = [k for k in kills if not k.killed and k.equivalent is None]
    wrong = [k for k in kills if k.by == "disagreement"]
    # a listed survivor that is killed now, or that no longer exists: its reason is stale
    listed = set(EQUIVALENT) if not args.only else set(EQUIVALENT) & {m.name for m in mutants}
    stale = sorted(listed - {k.mutant for k in kills if not k.killed})
    tally = Counter(k.by.split()[0] if k.killed else
                    ("equivalent" if k.equivalent else "survived") for k in kills)
    complete = not reused and {k.mutant for k in kills} == \
        {m.name for m in mutation.spec_mutants()}
    if complete and not (gaps or wrong or stale):
        write_proof(kills, scenarios)  # every mutant searched: the survivors are proven
    # one mutant asked for: the whole counterexample of its kill, for a reader
    ce = counterexample_of(kills[0], mutants[0]) if args.only and len(kills) == 1 else None
    svg = write_counterexample_svg(ce, Path(args.svg)) if ce is not None and args.svg else None
    if args.json:
        print(json.dumps({
            "proven_before": reused,
            "scenarios": [s.name for s in matrix_scenarios()],
            "mutants": len(kills), "tally": dict(tally),
            "non_equivalent_survivors": [k.mutant for k in gaps],
            "stale_equivalents": stale,
            "matrix": [asdict(k) for k in kills],
            "counterexample": None if ce is None else counterexample_json(ce, svg),
        }, indent=2, ensure_ascii=False))
    else:
        rows = [{"mutant": k.mutant,
                 "killed by": k.by if k.killed else
                 ("equivalent" if k.equivalent else "SURVIVED"),
                 "in": k.scenario or "-", "steps": k.steps or "-"} for k in kills]
        print_table(rows, ["mutant", "killed by", "in", "steps"])
        print(f"\n{len(kills)} mutants over {len(matrix_scenarios())} scenarios: "
              + ", ".join(f"{n} {what}" for what, n in sorted(tally.items())))
        if reused:
            print(f"  {len(reused)} listed survivors proven at this fingerprint "
                  f"({PROOF.relative_to(mutation.ROOT)}), not searched again "
                  "(--reprove searches them)")
        for k in gaps:
            print(f"  survived, not listed as equivalent in spec/equivalents.py: {k.mutant}")
        if gaps:
            print("  a survivor that changes only what the CPU tier holds is killed by a "
                  "directed program that pins the tier:\n    kvspec check --mutate --only "
                  "TEXT --tier-program --scenario NAME  finds one")
        for k in wrong:
            print(f"  the compiled checker and the model disagree on {k.mutant}: {k.detail}")
        for name in stale:
            print(f"  listed in spec/equivalents.py but killed or gone: {name}")
        if ce is not None:
            print_counterexample(ce, svg)
    return EXIT_FAIL if gaps or wrong or stale else EXIT_OK


def _tier_program(args: argparse.Namespace, mutants: list[SpecMutant]) -> int:
    """`--tier-program`: the shortest program after which one mutant's tier differs from the
    spec's, under one scenario's bounds (changed by --bounds)."""
    if not args.only or len(mutants) != 1:
        return usage_error("check", "--tier-program searches for one mutant: --only TEXT must "
                           f"name one ({len(mutants)} match)")
    if not args.scenario or len(args.scenario) != 1:
        return usage_error("check", "--tier-program searches under one --scenario's bounds "
                           "(--bounds changes them)")
    try:
        (sc,), _ = chosen_scenarios(args)
    except (LookupError, ValueError) as exc:
        return usage_error("check", str(exc))
    m = mutants[0]
    found = tier_program(sc.bounds, m.tables(), args.max_states or 2_000_000)
    if args.json:
        print(json.dumps({"mutant": m.name, "scenario": sc.name, "pairs": found.pairs,
                          **({"program": found.program, "spec_tier": found.spec_tier,
                              "mutant_tier": found.mutant_tier}
                             if isinstance(found, TierProgram) else
                             {"program": None, "complete": found.complete})}, indent=2))
    elif isinstance(found, TierProgram):
        print(f"{m.name}\nunder {sc.name}: after {len(found.events)} events "
              f"({found.pairs} pairs of states searched) the tiers differ:\n"
              f"  program: {found.program}\n"
              f"  the spec's tier (the pin): {', '.join(found.spec_tier) or 'nothing'}\n"
              f"  the mutant's tier:         {', '.join(found.mutant_tier) or 'nothing'}\n"
              "Add it to spec/regressions.py with tier= the spec's tier.")
    else:
        print(f"{m.name}\nunder {sc.name}: no program tells the tiers apart in "
              f"{found.pairs} pairs of states"
              + ("" if found.complete else " (the search stopped at its limit: --max-states)"))
    return EXIT_OK if isinstance(found, TierProgram) else EXIT_FAIL
