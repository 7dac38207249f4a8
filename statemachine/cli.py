"""`kvspec`: the command line of kvoffload-spec.

Exit status: 0 when everything asked for holds, 1 when a check fails (stale diagrams, an
ill-formed table, a simulation that leaves a request stuck, a resource leaked or a byte
corrupted, ...), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import spec
from spec import wellformed
from statemachine import artifacts
from statemachine.lifecycle import Lifecycle

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _root(arg: str | None) -> Path:
    return Path(arg) if arg else Path.cwd()


def table_summary() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for m in spec.MACHINES:
        rows.append({
            "machine": m.name,
            "states": len(m.states),
            "beyond_vllm_states": sum(s.beyond_vllm for s in m.states),
            "transitions": len(m.transitions),
            "edges": len(m.edges()),
            "triggers": len(m.triggers),
            "guards": len(m.guards),
            "effects": len(m.effects),
            "problems": len(wellformed.problems(m)),
        })
    return rows


def _print_table(rows: list[dict[str, object]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    print("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))


def cmd_summary(args: argparse.Namespace) -> int:
    rows = table_summary()
    inv = {"safety_invariants": len(spec.SAFETY),
           "progress_properties": len(spec.PROGRESS),
           "invariants_total": len(spec.INVARIANTS)}
    if args.json:
        print(json.dumps({"machines": rows, **inv}, indent=2))
    else:
        _print_table(rows)
        print(f"\ninvariants: {inv['invariants_total']} "
              f"({inv['safety_invariants']} safety predicates checked on every state; the "
              f"other {inv['invariants_total'] - inv['safety_invariants']} are progress, "
              f"checked as {inv['progress_properties']} progress properties)")
    return EXIT_FAIL if any(r["problems"] for r in rows) else EXIT_OK


def cmd_diagrams(args: argparse.Namespace) -> int:
    root = _root(args.root)
    if args.check:
        stale = artifacts.stale(root)
        for p in stale:
            print(f"stale: {p.relative_to(root)}", file=sys.stderr)
        if stale:
            print("the committed diagrams or generated tables differ from the spec: run "
                  "`kvspec diagrams` and commit the result", file=sys.stderr)
            return EXIT_FAIL
        print(f"diagrams and generated tables up to date ({len(artifacts.derived(root))} files)")
        return EXIT_OK
    changed = artifacts.write(root)
    for p in changed:
        print(f"wrote {p.relative_to(root)}")
    print(f"{len(changed)} file(s) changed")
    return EXIT_OK


class _NoEffects:
    """A host that accepts every effect and does nothing: enough to build the machines."""

    def __getattr__(self, name: str) -> object:
        return lambda *a, **k: None


def cmd_demo(args: argparse.Namespace) -> int:
    from statemachine.models import JobStatus, RequestState, ResetFence
    from statemachine.worker import WorkerJob

    print("kvoffload-spec demo: the lifecycle tables, built into transitions machines\n")
    for m, subject in ((spec.REQUEST_MACHINE, RequestState), (spec.JOB_MACHINE, JobStatus),
                       (spec.FENCE_MACHINE, ResetFence), (spec.WORKER_MACHINE, WorkerJob)):
        Lifecycle(m, subject, _NoEffects())
    rc = cmd_summary(argparse.Namespace(json=False))
    print()
    rc |= cmd_diagrams(argparse.Namespace(root=args.root, check=False))
    return rc


def cmd_simulate(args: argparse.Namespace) -> int:
    from statemachine import simulate

    if args.steps < 1 or args.workers < 1 or (args.requests is not None and args.requests < 1):
        print("kvspec simulate: --steps, --workers and --requests must be >= 1",
              file=sys.stderr)
        return EXIT_USAGE
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("kvspec simulate: --device cuda, but CUDA is not available here",
                  file=sys.stderr)
            return EXIT_USAGE
    cfg = simulate.SimConfig(seed=args.seed, steps=args.steps, workers=args.workers,
                             requests=args.requests, device=args.device,
                             check_invariants=not args.no_invariants)
    show = None if args.no_progress else simulate.progress_bar(sys.stderr)
    result = simulate.run(cfg, show)
    if show is not None:
        show.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(simulate.render(result))
    return EXIT_OK if result.ok else EXIT_FAIL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvspec", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="the tables: states, transitions, invariants")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_summary)
    d = sub.add_parser("diagrams", help="write (or --check) the diagrams and generated tables")
    d.add_argument("--check", action="store_true", help="exit 1 if a committed file is stale")
    d.add_argument("--root", help="project root (default: the current directory)")
    d.set_defaults(func=cmd_diagrams)
    m = sub.add_parser("demo", help="the main job: build the machines, summarise, draw")
    m.add_argument("--root", help="project root (default: the current directory)")
    m.set_defaults(func=cmd_demo)
    sim = sub.add_parser("simulate", help="a seeded workload through engine, connector, "
                         "workers and copy kernels; exit 1 if a request is stuck, a resource "
                         "leaked or a byte corrupted")
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument("--steps", type=int, default=240,
                     help="steps during which requests arrive and faults strike (then drain)")
    sim.add_argument("--workers", type=int, default=2, help="worker ranks (default 2)")
    sim.add_argument("--requests", type=int, default=None,
                     help="requests in the workload (default: steps / 2)")
    sim.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="where the GPU KV lives (default cpu: the CPU stand-in, whose "
                     "runs are a function of the seed)")
    sim.add_argument("--json", action="store_true", help="the result as JSON on stdout")
    sim.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    sim.add_argument("--no-invariants", action="store_true",
                     help="do not check the invariants after every connector hook (faster)")
    sim.set_defaults(func=cmd_simulate)
    from statemachine import check_cli

    check_cli.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
