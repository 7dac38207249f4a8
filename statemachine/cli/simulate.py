"""`kvspec simulate`: a seeded workload through the engine, the connector, the workers and
the copy kernels (torch is imported here, when the command runs)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spec.rules import BY_RELEASE
from statemachine.cli.common import EXIT_FAIL, EXIT_OK, note, usage_error
from statemachine.config import KV_CACHE_MODELS, TIER_KINDS


def parse_tiers(text: str) -> tuple[str, ...] | None:
    """``cpu,fs`` -> ``("fs",)``: the tiers below the CPU tier, in order; None if `text` is
    not "cpu" followed by tier kinds."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or parts[0] != "cpu" or not all(p in TIER_KINDS for p in parts[1:]):
        return None
    return tuple(parts[1:])


def cmd_simulate(args: argparse.Namespace) -> int:
    from statemachine import simulate

    if args.steps < 1 or args.workers < 1 or (args.requests is not None and args.requests < 1):
        return usage_error("simulate", "--steps, --workers and --requests must be >= 1")
    tiers = parse_tiers(args.tiers)
    if tiers is None:
        return usage_error("simulate", f"--tiers {args.tiers!r}: expected 'cpu' followed by "
                           f"tiers among {', '.join(TIER_KINDS)}, comma-separated (e.g. "
                           "cpu,fs or cpu,memory,fs)")
    if args.tier_threads < 0:
        return usage_error("simulate", "--tier-threads must be >= 0")
    if (args.tier_threads or args.keep_tier_dir) and not tiers:
        return usage_error("simulate", "--tier-threads and --keep-tier-dir need secondary "
                           "tiers (e.g. --tiers cpu,fs)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return usage_error("simulate", "--device cuda, but CUDA is not available here")
    cfg = simulate.SimConfig(seed=args.seed, model=args.model, steps=args.steps,
                             workers=args.workers,
                             requests=args.requests, device=args.device,
                             check_invariants=not args.no_invariants, tiers=tiers,
                             tier_threads=args.tier_threads,
                             keep_tier_dir=args.keep_tier_dir,
                             monitor_log=args.monitor_log, rules=BY_RELEASE[args.rules])
    show = None if args.no_progress else simulate.progress_bar(sys.stderr)
    result = simulate.run(cfg, show)
    if show is not None:
        show.close()
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(simulate.render(result))
    if args.device == "cpu":
        from kernels import native

        if not native.available() and "KVSPEC_NATIVE=0" not in native.unavailable_reason():
            note(f"the compiled CPU copy was not used ({native.unavailable_reason()}); the "
                 "pure-torch copies ran (install a C compiler, e.g. apt-get install -y gcc)")
    return EXIT_OK if result.ok else EXIT_FAIL


def register(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="a seeded workload through engine, connector, "
                         "workers and copy kernels; exit 1 if a request is stuck, a resource "
                         "leaked or a byte corrupted")
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument("--model", choices=tuple(KV_CACHE_MODELS), default="full",
                     help="the KV cache groups: full (one full-attention group) or hybrid "
                     "(full attention beside a 40-token sliding window, pages of their own "
                     "size)")
    sim.add_argument("--steps", type=int, default=240,
                     help="steps during which requests arrive and faults strike (then drain)")
    sim.add_argument("--workers", type=int, default=2, help="worker ranks (default 2)")
    sim.add_argument("--requests", type=int, default=None,
                     help="requests in the workload (default: steps / 2)")
    sim.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="where the GPU KV lives (default cpu: the CPU stand-in, whose "
                     "runs are a function of the seed)")
    sim.add_argument("--tiers", default="cpu", metavar="cpu[,TIER...]",
                     help="the offloading tiers, top down: cpu alone (default), or cpu over "
                     "secondary tiers (memory, fs), e.g. cpu,fs or cpu,memory,fs: a small CPU "
                     "tier whose evicted chunks come back from a tier by promotions; fs "
                     "tiers write files under a temporary directory")
    sim.add_argument("--tier-threads", type=int, default=0, metavar="N",
                     help="I/O threads per tier (default 0: the tiers' I/O runs once per "
                     "step, so a run is a function of its seed)")
    sim.add_argument("--keep-tier-dir", action="store_true",
                     help="keep the fs tiers' directory after the run (its path is printed)")
    sim.add_argument("--monitor-log", metavar="PATH", default=None,
                     help="write the spec monitor's event log of the connector's hooks "
                     "(check it with kvspec replay PATH)")
    sim.add_argument("--rules", choices=tuple(BY_RELEASE), default="0.33",
                     help="the connector's rules (spec.rules): 0.33 (default) or 0.34, whose "
                     "failed loads are never retried and whose stale load failures are left "
                     "to the core")
    sim.add_argument("--json", action="store_true", help="the result as JSON on stdout")
    sim.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    sim.add_argument("--no-invariants", action="store_true",
                     help="do not check the invariants after every connector hook (faster)")
    sim.set_defaults(func=cmd_simulate)
