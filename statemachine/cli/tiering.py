"""`kvspec check --tiering`: the tiering scenarios (`spec.tiering.scenarios`) through the
tiering model checker, with their pinned outcomes and the coverage of the four tiering tables;
`kvspec check --tiering --mutant NAME` hunts one seeded tiering fault."""

from __future__ import annotations

import argparse
import json
from typing import Any

from spec.tiering.checker import TierCheckResult, check_tiering_model
from spec.tiering.faults import TIER_FAULT_NAMES
from spec.tiering.progress import TIER_PROGRESS
from spec.tiering.scenarios import (
    TIER_FAULT_HUNTS,
    TIER_SCENARIOS,
    TierExpect,
    TierScenario,
    tier_scenario,
)
from statemachine.cli.common import EXIT_FAIL, EXIT_OK, Progress, print_table, usage_error

_COLS = ["scenario", "states", "transitions", "depth", "seconds", "result", "expected"]


def _row(sc: TierScenario, r: TierCheckResult) -> dict[str, Any]:
    ce = r.counterexample
    result = "pass" if ce is None else f"{r.verdict} ({len(ce)} events)"
    if ce is not None and ce.cycle_start is not None:
        result = (f"{r.verdict} ({ce.cycle_start} events + cycle of "
                  f"{len(ce) - ce.cycle_start})")
    got = TierExpect(r.verdict, r.states, r.depth)
    expected = "as expected" if got == sc.expect else (
        f"EXPECTED {sc.expect.verdict}, {sc.expect.states} states, depth {sc.expect.depth}")
    return {"scenario": sc.name, "bounds": sc.bounds.describe(),
            "faults": list(sc.faults.names), "states": r.states, "transitions": r.edges,
            "depth": r.depth, "seconds": round(r.seconds, 2), "result": result,
            "verdict": r.verdict, "expected": expected, "finding": sc.finding}


def _selected(args: argparse.Namespace) -> list[TierScenario]:
    if args.mutant:
        if args.mutant not in TIER_FAULT_NAMES:
            raise LookupError(f"no tiering fault {args.mutant!r}; known: "
                              f"{', '.join(TIER_FAULT_NAMES)}")
        return [tier_scenario(args.mutant)]
    if args.scenario:
        return [tier_scenario(n) for n in args.scenario]
    return list(TIER_SCENARIOS)


def cmd_check_tiering(args: argparse.Namespace) -> int:
    try:
        scenarios = _selected(args)
    except KeyError as exc:
        return usage_error("check", str(exc.args[0]) + "; known: " + ", ".join(
            s.name for s in (*TIER_SCENARIOS, *TIER_FAULT_HUNTS)))
    except LookupError as exc:
        return usage_error("check", str(exc))
    rows, fired, shown = [], set(), []
    unexpected = False
    last: TierCheckResult | None = None
    for sc in scenarios:
        show = Progress(sc.name)
        show("exploring")
        r = check_tiering_model(sc.bounds, sc.faults)
        show.close()
        row = _row(sc, r)
        rows.append(row)
        unexpected |= row["expected"] != "as expected"
        fired |= r.fired
        last = r
        if r.counterexample is not None:
            shown.append((sc, r))
    full = not args.mutant and not args.scenario
    assert last is not None
    last.fired = fired
    uncovered = last.uncovered() if full else []
    if args.json:
        print(json.dumps({
            "scenarios": rows,
            "progress": [{"id": p.id, "name": p.name, "statement": p.statement}
                         for p in TIER_PROGRESS],
            "covered_rows": len(fired), "uncovered": [" ".join(u) for u in uncovered],
            "counterexamples": [{"scenario": sc.name, "render": r.counterexample.render()}
                                for sc, r in shown if r.counterexample is not None],
        }, indent=2))
    else:
        print_table(rows, _COLS)
        if full:
            print(f"\ncoverage: {len(fired)} tiering table rows fired, "
                  f"{len(uncovered)} never")
            for u in uncovered:
                print(f"  never fired: {' '.join(u)}")
            print("liveness: " + ", ".join(f"{p.id} {p.name}" for p in TIER_PROGRESS))
        for sc, r in shown:
            assert r.counterexample is not None
            print()
            if sc.finding:
                print(f"{sc.name} (expected): {sc.finding}")
            print(r.counterexample.render())
    if unexpected or uncovered:
        return EXIT_FAIL
    if args.mutant:  # a fault hunt succeeds by finding the fault
        return EXIT_FAIL if rows and rows[0]["verdict"] != "pass" else EXIT_OK
    return EXIT_OK
