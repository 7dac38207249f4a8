"""`kvspec replay LOG`: check a live monitor's event log against the spec."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from statemachine.cli.common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, note


def cmd_replay(args: argparse.Namespace) -> int:
    from statemachine.monitor.log import LogError
    from statemachine.monitor.replay import replay

    if args.stuck_after_steps is not None and args.stuck_after_steps < 1:
        print("kvspec replay: --stuck-after-steps must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.whole_every < 0:
        print("kvspec replay: --whole-every must be at least 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        verdict = _follow(args) if args.follow else replay(args.log, args.stuck_after_steps,
                                                           args.whole_every)
    except FileNotFoundError:
        print(f"kvspec replay: {args.log}: no such file", file=sys.stderr)
        return EXIT_USAGE
    except LogError as exc:
        print(f"kvspec replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    svg = None
    if args.svg and not verdict.clean:
        svg = _draw(verdict, Path(args.svg))
    if args.json:
        out = verdict.to_json()
        out["svg"] = str(svg) if svg else None
        print(json.dumps(out, indent=2))
    else:
        print(verdict.text())
        if svg:
            print(f"\ntrace drawn over the machines: {svg}")
    return EXIT_OK if verdict.clean else EXIT_FAIL


def _follow(args: argparse.Namespace) -> Any:
    """`--follow`: the log checked as it grows, each finding printed to stderr when found,
    until standard input ends (the monitored connector closes it at shutdown; Ctrl-D at a
    terminal) or Ctrl-C."""
    from statemachine.monitor.checker import report_text
    from statemachine.monitor.replay import follow

    done = threading.Event()

    def watch_stdin() -> None:
        try:
            while sys.stdin.read(4096):
                pass
        finally:
            done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    def report(monitor: Any, found: Any) -> None:
        print(f"kvspec monitor: {report_text(monitor, found)}", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        return follow(args.log, done.is_set, report, args.stuck_after_steps,
                      whole_every=args.whole_every)
    finally:
        signal.signal(signal.SIGINT, previous)


def _draw(verdict: Any, path: Path) -> Path:
    from statemachine.diagrams import INSTALL_HINT, counterexample_graph, have_dot
    from statemachine.monitor.replay import trace_counterexample

    graph = counterexample_graph(trace_counterexample(verdict))
    if have_dot():
        path.write_bytes(graph.pipe(format="svg"))
        return path
    dot = path.with_suffix(".dot")
    dot.write_text(graph.source)
    note(f"trace not rendered as SVG ({INSTALL_HINT}); its DOT source: {dot}")
    return dot


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="check a live monitor's event log against the spec",
                       description="Check an event log of the monitored connector "
                       "(statemachine.monitor.connector) against the spec: every move a "
                       "row of the tables, every invariant, and no request holding a job "
                       "with no report for N steps. Exit 0 clean, 1 violation, 2 bad usage "
                       "or a malformed log.")
    p.add_argument("log", help="the JSON-lines event log")
    p.add_argument("--stuck-after-steps", type=int, default=None, metavar="N",
                   help="report a request holding a job id with no report for N engine "
                   "steps (default: the log's header, else 32)")
    p.add_argument("--whole-every", type=int, default=1, metavar="N",
                   help="check the whole-state invariants every N engine steps (default 1; "
                   "0: only at the end of the log; the local ones after every event)")
    p.add_argument("--json", action="store_true", help="the verdict as JSON")
    p.add_argument("--follow", action="store_true",
                   help="check the log while it is written, printing each violation to "
                   "stderr when found, until standard input ends (the monitored connector "
                   "closes it at shutdown) or Ctrl-C; then the end-of-log checks and the "
                   "verdict")
    p.add_argument("--svg", metavar="PATH", help="draw the first violation's trace over the "
                   "request and job machines")
    p.set_defaults(func=cmd_replay)


__all__ = ["cmd_replay", "register"]
