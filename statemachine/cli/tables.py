"""`kvspec summary`, `kvspec diagrams`, `kvspec demo`: the tables, and what is drawn from
them. None of these imports torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import spec
from spec import wellformed
from statemachine import artifacts
from statemachine.cli.common import EXIT_FAIL, EXIT_OK, note, print_table
from statemachine.diagrams import INSTALL_HINT, have_dot


def _root(arg: str | None) -> Path:
    return Path(arg) if arg else Path.cwd()


def table_summary() -> list[dict[str, object]]:
    return [{
        "machine": m.name,
        "states": len(m.states),
        "beyond_vllm_states": sum(s.beyond_vllm for s in m.states),
        "transitions": len(m.transitions),
        "edges": len(m.edges()),
        "triggers": len(m.triggers),
        "guards": len(m.guards),
        "effects": len(m.effects),
        "groups": len(m.groups),
        "problems": len(wellformed.problems(m)),
    } for m in spec.MACHINES]


def cmd_summary(args: argparse.Namespace) -> int:
    rows = table_summary()
    inv = {"safety_invariants": len(spec.SAFETY),
           "progress_properties": len(spec.PROGRESS),
           "invariants_total": len(spec.INVARIANTS)}
    if args.json:
        print(json.dumps({"machines": rows, **inv}, indent=2))
    else:
        print_table(rows)
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
        print(f"diagrams and generated tables up to date ({len(artifacts.derived(root))} "
              "text files; SVGs checked by the hash of the DOT they were drawn from)")
        if not have_dot():
            note(f"SVGs were not rendered: {INSTALL_HINT}")
        return EXIT_OK
    changed, not_rendered = artifacts.write(root)
    for p in changed:
        print(f"wrote {p.relative_to(root)}")
    print(f"{len(changed)} file(s) changed")
    if not have_dot():
        which = ""
        if not_rendered:
            which = " (stale: " + ", ".join(str(p.relative_to(root)) for p in not_rendered) + ")"
        note(f"SVGs were not rendered{which}: {INSTALL_HINT}")
        return EXIT_FAIL if not_rendered else EXIT_OK
    return EXIT_OK


class _NoEffects:
    """A host that accepts every effect and does nothing: enough to build the machines."""

    def __getattr__(self, name: str) -> object:
        return lambda *a, **k: None


def cmd_demo(args: argparse.Namespace) -> int:
    from statemachine.lifecycle import Lifecycle
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


def register(sub: Any) -> None:
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
