"""`kvspec check` and `kvspec mutants`: the model checker and the mutant catalogue."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spec import model as M
from spec.checker import CheckResult, check_model
from spec.scenarios import SCENARIOS, Scenario, by_name, hunt_bounds, parse_bounds
from statemachine.cli.common import (
    EXIT_FAIL,
    EXIT_OK,
    Progress,
    note,
    print_table,
    usage_error,
)
from statemachine.mutants import MUTANTS
from statemachine.mutants import by_name as mutant_by_name

MUTANT_SCENARIO = "mutant-hunt"
_COLS = ["scenario", "states", "transitions", "depth", "seconds", "states_per_s", "result"]


def _row(name: str, r: CheckResult) -> dict[str, Any]:
    ce = r.counterexample
    return {
        "scenario": name, "states": r.states, "transitions": r.edges, "depth": r.depth,
        "seconds": round(r.seconds, 2), "states_per_s": round(r.states_per_second),
        "complete": r.complete, "stuck_states": r.stuck_states,
        "result": "pass" if ce is None else f"{ce.kind} ({len(ce)} steps)",
    }


def write_counterexample_svg(result: CheckResult, path: Path) -> Path | None:
    """The counterexample drawn over the machines, as SVG where `dot` is installed, else as
    its DOT source beside the asked path (and a note saying so)."""
    from statemachine.diagrams import INSTALL_HINT, counterexample_graph, have_dot

    if result.counterexample is None:
        return None
    graph = counterexample_graph(result.counterexample)
    if have_dot():
        path.write_bytes(graph.pipe(format="svg"))
        return path
    dot = path.with_suffix(".dot")
    dot.write_text(graph.source)
    note(f"counterexample not rendered as SVG ({INSTALL_HINT}); its DOT source: {dot}")
    return dot


def cmd_check(args: argparse.Namespace) -> int:
    try:
        if args.mutant:
            mutant = mutant_by_name(args.mutant)
            if mutant.model_fault is None:
                return usage_error("check", f"mutant {mutant.name} is not expressible in the "
                                   f"abstract model ({mutant.description}); the model-based "
                                   f"tests catch it: pytest tests/test_mutants.py -k "
                                   f"{mutant.name}")
            faults: M.Faults = frozenset([mutant.model_fault])
            base = hunt_bounds(mutant.model_fault)
            scenarios = [Scenario(f"{MUTANT_SCENARIO}:{mutant.name}", mutant.description,
                                  parse_bounds(args.bounds or "", base))]
        else:
            faults = M.NO_FAULTS
            if args.bounds:
                scenarios = [Scenario("custom", "bounds from the command line",
                                      parse_bounds(args.bounds, SCENARIOS[0].bounds))]
            elif args.scenario:
                scenarios = [by_name(n) for n in args.scenario]
            else:
                scenarios = list(SCENARIOS)
    except (KeyError, ValueError) as exc:
        return usage_error("check", str(exc))

    rows: list[dict[str, Any]] = []
    covered: set[tuple[str, int]] = set()
    failed: CheckResult | None = None
    for sc in scenarios:
        show = Progress(sc.name)

        def report(states: int, edges: int, depth: int, show: Progress = show) -> None:
            show(f"{states} states, {edges} transitions, depth {depth}")

        r = check_model(sc.bounds, faults, max_states=args.max_states,
                        progress=None if args.json else report)
        show.close()
        rows.append(_row(sc.name, r))
        covered |= r.covered
        if not r.ok:
            failed = r
            break
    uncovered = [(m, i, M.MACHINES[m].transitions[i])
                 for m, i in sorted(M.coverage_universe() - covered)]
    full_suite = not args.mutant and not args.bounds and not args.scenario
    coverage_gap = full_suite and failed is None and bool(uncovered)
    svg = None
    if failed is not None and args.svg:
        svg = write_counterexample_svg(failed, Path(args.svg))
    if args.json:
        print(json.dumps({
            "scenarios": rows, "faults": sorted(faults),
            "covered_transitions": len(covered),
            "total_transitions": len(M.coverage_universe()),
            "uncovered": [f"{m}: {t.trigger} {list(t.sources)} -> {t.dest} [{t.guard_text}]"
                          for m, _, t in uncovered],
            "counterexample": None if failed is None or failed.counterexample is None else {
                "kind": failed.counterexample.kind,
                "summary": failed.counterexample.summary,
                "steps": [str(s.event) for s in failed.counterexample.steps],
                "violations": [asdict(v) for v in failed.counterexample.violations],
                "svg": str(svg) if svg else None,
            },
        }, indent=2))
    else:
        print_table(rows, _COLS)
        if full_suite:
            print(f"\ncoverage: {len(covered)} of {len(M.coverage_universe())} table "
                  "transitions fired")
        for m, i, t in uncovered if full_suite else []:
            print(f"  never fired: {m} #{i + 1} {t.trigger} {list(t.sources)} -> {t.dest} "
                  f"[{t.guard_text}]")
        if failed is not None and failed.counterexample is not None:
            print()
            print(failed.counterexample.render())
            if svg:
                print(f"\ncounterexample drawn over the machines: {svg}")
    if failed is not None or coverage_gap:
        return EXIT_FAIL
    return EXIT_OK


def cmd_mutants(args: argparse.Namespace) -> int:
    rows = [{"mutant": m.name, "area": m.area, "stands for": m.stands_for,
             "abstract": "yes" if m.abstract else "no", "what": m.description}
            for m in MUTANTS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for r in rows:
        print(f"{r['mutant']:32} {r['area']:11} abstract={r['abstract']:3} {r['stands for']}")
        print(f"{'':32} {r['what']}")
    return EXIT_OK


def register(sub: Any) -> None:
    c = sub.add_parser("check", help="exhaustive model check of the spec (or of a mutant)")
    c.add_argument("--mutant", help="switch on a catalogued fault (kvspec mutants)")
    c.add_argument("--scenario", action="append",
                   help="check only this scenario (repeatable): "
                   + ", ".join(s.name for s in SCENARIOS))
    c.add_argument("--bounds", help="custom bounds, e.g. requests=2,workers=1,resets=1")
    c.add_argument("--max-states", type=int, default=None)
    c.add_argument("--svg", help="write the counterexample drawn over the machines here")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
    m = sub.add_parser("mutants", help="the catalogue of named faults")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_mutants)
