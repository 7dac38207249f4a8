"""`kvspec check` and `kvspec mutants`: the model checker, the spec's own mutants, and the
mutant catalogue."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spec import model as M
from spec.checker import CheckResult, Counterexample
from spec.invariants import INVARIANTS
from spec.progress import FAIRNESS, PROGRESS, UNFAIR
from spec.scenarios import SCENARIOS, Expect, Scenario, by_name, hunt_bounds, parse_bounds
from spec.tiering.faults import TIER_FAULT_NAMES
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
_COLS = ["scenario", "states", "transitions", "depth", "seconds", "states_per_s", "memory_mb",
         "result", "expected"]


def _expected(sc: Scenario, r: CheckResult) -> str:
    """`as expected`, or what differs from the scenario's pinned outcome."""
    if sc.expect is None:
        return "-"
    got = Expect(r.verdict, r.states, r.depth)
    if not r.complete or got == sc.expect:
        return "as expected" if r.complete else "(incomplete)"
    return (f"EXPECTED {sc.expect.verdict}, {sc.expect.states} states, depth "
            f"{sc.expect.depth}")


def _row(sc: Scenario, r: CheckResult) -> dict[str, Any]:
    ce = r.counterexample
    result = "pass" if ce is None else f"{r.verdict} ({len(ce)} steps)"
    if ce is not None and ce.cycle_start is not None:
        result = f"{r.verdict} ({ce.cycle_start} steps + cycle of {len(ce.cycle)})"
    return {
        "scenario": sc.name, "states": r.states, "transitions": r.edges, "depth": r.depth,
        "seconds": round(r.seconds, 2), "states_per_s": round(r.states_per_second),
        "memory_mb": round(r.memory / 1e6) if r.memory else "-", "memory_bytes": r.memory,
        "complete": r.complete, "result": result, "verdict": r.verdict,
        "expected": _expected(sc, r),
        "liveness": [{"property": p.id, "formula": p.formula, "for": p.scope,
                      "fairness": [f"WF({f.name})" for f in FAIRNESS]}
                     for p in PROGRESS if p.id in r.liveness],
        "stuck_states": r.stuck_states, "engine": r.engine,
    }


def write_counterexample_svg(ce: Counterexample | None, path: Path) -> Path | None:
    """The counterexample drawn over the machines, as SVG where `dot` is installed, else as
    its DOT source beside the asked path (and a note saying so)."""
    from statemachine.diagrams import INSTALL_HINT, counterexample_graph, have_dot

    if ce is None:
        return None
    graph = counterexample_graph(ce)
    if have_dot():
        path.write_bytes(graph.pipe(format="svg"))
        return path
    dot = path.with_suffix(".dot")
    dot.write_text(graph.source)
    note(f"counterexample not rendered as SVG ({INSTALL_HINT}); its DOT source: {dot}")
    return dot


def print_counterexample(ce: Counterexample, svg: Path | None) -> None:
    """The counterexample, step by step, after a blank line, and where it is drawn."""
    print()
    print(ce.render())
    if svg:
        print(f"\ncounterexample drawn over the machines: {svg}")


def counterexample_json(ce: Counterexample, svg: Path | None) -> dict[str, Any]:
    return {
        "kind": ce.kind, "summary": ce.summary,
        "steps": [str(s.event) for s in ce.steps],
        "cycle_start": ce.cycle_start, "property": ce.property_id, "request": ce.request,
        "fairness": ce.fairness,
        "violations": [asdict(v) for v in ce.violations],
        "svg": str(svg) if svg else None,
    }


def _without(values: list[str] | None) -> frozenset[str]:
    names = {i.id for i in INVARIANTS}
    out = frozenset(v.strip().upper() for arg in values or [] for v in arg.split(",")
                    if v.strip())
    unknown = sorted(out - names)
    if unknown:
        raise ValueError(f"no invariant {', '.join(unknown)}; known: INV-1 .. "
                         f"INV-{len(INVARIANTS)}")
    return out


def chosen_scenarios(args: argparse.Namespace) -> tuple[list[Scenario], M.Faults]:
    """The scenarios the command line names (--scenario, --bounds, --mutant), and the
    faults they run with."""
    if args.mutant:
        mutant = mutant_by_name(args.mutant)
        if mutant.model_fault is None:
            raise LookupError(f"mutant {mutant.name} is not expressible in the abstract model "
                              f"({mutant.description}); the model-based tests catch it: "
                              f"pytest tests/test_mutants.py -k {mutant.name}")
        base = hunt_bounds(mutant.model_fault)
        return [Scenario(f"{MUTANT_SCENARIO}:{mutant.name}", mutant.description,
                         parse_bounds(args.bounds or "", base), None)], \
            frozenset([mutant.model_fault])
    if args.bounds and args.scenario:  # each named scenario, its bounds changed
        return [Scenario(f"{sc.name}+{args.bounds}", f"{sc.purpose} (with {args.bounds})",
                         parse_bounds(args.bounds, sc.bounds), None)
                for sc in map(by_name, args.scenario)], M.NO_FAULTS
    if args.bounds:
        return [Scenario("custom", "bounds from the command line",
                         parse_bounds(args.bounds, SCENARIOS[0].bounds), None)], M.NO_FAULTS
    if args.scenario:
        return [by_name(n) for n in args.scenario], M.NO_FAULTS
    return list(SCENARIOS), M.NO_FAULTS


def cmd_check(args: argparse.Namespace) -> int:
    tiering = args.tiering or (args.mutant and args.mutant in TIER_FAULT_NAMES)
    if args.threads is not None and (tiering or args.mutate):
        return usage_error("check", "--threads sets the threads of the compiled search; "
                           + ("--mutate runs the mutants in --jobs processes of one thread "
                              "each" if args.mutate else "the tiering checker runs in Python "
                              "on one thread"))
    if not args.liveness and (tiering or args.mutate):
        return usage_error("check", "--no-liveness searches the spec's scenarios for safety "
                           "alone; " + ("a mutant's verdict may be a liveness one" if args.mutate
                                        else "the tiering checker has no such switch"))
    if tiering:
        from statemachine.cli.tiering import cmd_check_tiering

        return cmd_check_tiering(args)
    if args.only and not args.mutate:
        return usage_error("check", "--only picks mutants of the tables: it goes with --mutate")
    if args.mutate:
        from statemachine.cli.mutate import cmd_mutate

        return cmd_mutate(args)
    from statemachine.checker import check  # the C build helper: only when a check runs

    try:
        scenarios, faults = chosen_scenarios(args)
        without = _without(args.without)
    except LookupError as exc:
        return usage_error("check", str(exc).strip("'\""))
    except ValueError as exc:
        return usage_error("check", str(exc))
    threads = args.threads if args.threads is not None else len(os.sched_getaffinity(0))
    if threads < 1:
        return usage_error("check", f"--threads must be 1 or more, got {threads}")

    for sc in scenarios:
        floor = sc.bounds.gpu_blocks_floor()
        if sc.bounds.gpu_blocks < floor:
            note(f"{sc.name}: gpu_blocks={sc.bounds.gpu_blocks} is below the {floor} a request "
                 "holds (Bounds.gpu_blocks_floor: its prompt, and its output but the last token "
                 "once a preemption re-admits it, in each full-attention group; a block in "
                 "each window group): no request can finish, so expect P-4 (a bound too "
                 "small, not a fault); raise gpu_blocks")
    rows: list[dict[str, Any]] = []
    covered: set[tuple[str, int]] = set()
    failed: CheckResult | None = None
    unexpected = False
    for sc in scenarios:
        show = Progress(sc.name)

        def report(states: int, edges: int, depth: int, show: Progress = show) -> None:
            show(f"{states} states, {edges} transitions, depth {depth}")

        r = check(sc.bounds, faults, max_states=args.max_states,
                  progress=None if args.json else report, stuck=args.stuck, without=without,
                  engine=args.engine, threads=threads, liveness=args.liveness)
        show.close()
        if r.engine.startswith("python (") and sc is scenarios[0]:
            note(f"the compiled checker is not available ({r.engine[8:-1]}); the reference "
                 "checker runs instead (about 50x slower)")
        row = _row(sc, r)
        rows.append(row)
        covered |= r.covered
        unexpected |= row["expected"].startswith("EXPECTED") and not without
        if not r.ok:
            failed = r
            break
    uncovered = [(m, i, M.MACHINES[m].transitions[i])
                 for m, i in sorted(M.coverage_universe() - covered)]
    full_suite = not args.mutant and not args.bounds and not args.scenario
    coverage_gap = full_suite and failed is None and bool(uncovered)
    svg = None
    if failed is not None and args.svg:
        svg = write_counterexample_svg(failed.counterexample, Path(args.svg))
    if args.json:
        print(json.dumps({
            "scenarios": rows, "faults": sorted(faults), "without": sorted(without),
            "fairness": {"weak": [{"class": f.name, "per": f.per, "events": f.events}
                                  for f in FAIRNESS], "none": list(UNFAIR)},
            "covered_transitions": len(covered),
            "total_transitions": len(M.coverage_universe()),
            "uncovered": [f"{m}: {t.trigger} {list(t.sources)} -> {t.dest} [{t.guard_text}]"
                          for m, _, t in uncovered],
            "counterexample": None if failed is None or failed.counterexample is None
            else counterexample_json(failed.counterexample, svg),
        }, indent=2))
    else:
        print_table(rows, _COLS)
        print("\nengine: " + "; ".join(dict.fromkeys(row["engine"] for row in rows)))
        if full_suite:
            print(f"\ncoverage: {len(covered)} of {len(M.coverage_universe())} table "
                  "transitions fired")
            print("liveness: " + (", ".join(p.id for p in PROGRESS) + " under weak fairness "
                                  "of " + ", ".join(f.name for f in FAIRNESS) + " (none for "
                                  + ", ".join(UNFAIR) + ")" if args.liveness
                                  else "not searched (--no-liveness)"))
        for m, i, t in uncovered if full_suite else []:
            print(f"  never fired: {m} #{i + 1} {t.trigger} {list(t.sources)} -> {t.dest} "
                  f"[{t.guard_text}]")
        if failed is not None and failed.counterexample is not None:
            print_counterexample(failed.counterexample, svg)
    if failed is not None or coverage_gap or unexpected:
        return EXIT_FAIL
    return EXIT_OK


def cmd_mutants(args: argparse.Namespace) -> int:
    from statemachine.tiering.mutants import TIER_MUTANTS

    rows = [{"mutant": m.name, "area": m.area, "stands for": m.stands_for,
             "abstract": "yes" if m.abstract else "no", "what": m.description}
            for m in MUTANTS]
    rows += [{"mutant": m.name, "area": "tiering", "stands for": m.stands_for,
              "abstract": "yes", "what": m.description} for m in TIER_MUTANTS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for r in rows:
        print(f"{r['mutant']:32} {r['area']:11} abstract={r['abstract']:3} {r['stands for']}")
        print(f"{'':32} {r['what']}")
    return EXIT_OK


def register(sub: Any) -> None:
    c = sub.add_parser(
        "check", help="exhaustive model check of the spec (or of a mutant): safety, "
        "table legality, liveness under fairness")
    c.add_argument("--mutant", help="switch on a catalogued fault (kvspec mutants)")
    c.add_argument("--tiering", action="store_true",
                   help="check the tiering model (the CPU tier and secondary tiers) instead: "
                   "its scenarios, or with --mutant one of its faults: "
                   + ", ".join(TIER_FAULT_NAMES))
    c.add_argument("--mutate", action="store_true",
                   help="mutate the tables themselves (an effect removed, a guard negated) "
                   "and print which check kills each mutant")
    c.add_argument("--scenario", action="append",
                   help="check only this scenario (repeatable): "
                   + ", ".join(s.name for s in SCENARIOS))
    c.add_argument("--bounds", help="custom bounds, e.g. requests=2,workers=1,resets=1, on "
                   "top of each --scenario's bounds (else the first scenario's); "
                   "rules=0.34 takes vLLM 0.34.0's rules (spec.rules) where it changed one, "
                   "and a rule by name sets that one alone (stale_load_failure=fence-only)")
    c.add_argument("--without", action="append", metavar="INV-n",
                   help="switch a safety invariant off (repeatable, or comma-separated): "
                   "what else catches the fault, e.g. --without INV-1 for PR #48102's hang")
    c.add_argument("--engine", choices=("auto", "compiled", "python"), default="auto",
                   help="the compiled checker (auto: where a C compiler is) or the reference "
                   "one in Python")
    c.add_argument("--threads", type=int, default=None,
                   help="the compiled search's threads, at most 64 (default: every core this "
                   "process may use); the result is the same, state for state, on any number")
    c.add_argument("--no-liveness", dest="liveness", action="store_false",
                   help="safety alone: every invariant and table row's legality in every "
                   "state, no progress property (the compiled search then keeps no edges: "
                   "about a third of the bytes a state, so larger bounds fit)")
    c.add_argument("--stuck", action="store_true",
                   help="also run the older reachability check (a quiescent state reachable "
                   "from every state; implied by liveness P-3)")
    c.add_argument("--max-states", type=int, default=None)
    c.add_argument("--only", metavar="TEXT",
                   help="with --mutate: only the mutants whose name contains TEXT; when one "
                   "is killed, its counterexample in full (--svg draws it)")
    c.add_argument("--reprove", action="store_true",
                   help="with --mutate: search the listed survivors again, even where "
                   "spec/equivalents.proof.json proved them at this fingerprint")
    c.add_argument("--jobs", type=int, default=None,
                   help="with --mutate: processes (default: every core)")
    c.add_argument("--tier-program", action="store_true",
                   help="with --mutate --only TEXT (one mutant) and one --scenario: the "
                   "shortest program under its bounds after which the mutant's CPU tier "
                   "differs from the spec's (a directed program of spec/regressions.py, "
                   "pinned to the spec's tier, then kills it); --max-states bounds the "
                   "pairs of states searched")
    c.add_argument("--svg", help="write the counterexample drawn over the machines here")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
    m = sub.add_parser("mutants", help="the catalogue of named faults")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_mutants)
