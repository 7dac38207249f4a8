"""Model-checker throughput: the compiled checker (what `kvspec check` runs) against the
reference checker in Python (`spec.checker.check_model`, kept as the baseline), side by side
in one run, per scenario and in total; and the time to the PR #48102 counterexample (safety,
and the liveness lasso with INV-1 off). Prints tables; timings never go in tests.

    python bench/checker.py [--baseline-states N] [--skip SCENARIO ...]

The baseline explores each scenario up to N distinct states (default 20,000; the whole
scenario when smaller): at its throughput the full scenario set would take hours. Its rate
over those first states is the baseline's states/s; the ratio compares rates on the same
scenario, measured in the same run. Both checkers check every invariant in every state and
inside every step; the compiled one also checks liveness (the baseline does when it completes).

Then the compiled search on one thread and on --threads (default: every core this process may
use), side by side on each scenario of more than --threads-from states (default 200,000),
with the speed-up; the two answers are asserted equal. --threads-only runs that table alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# this folder holds kernels.py: keep it from shadowing the `kernels` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

from spec.checker import check_model  # noqa: E402
from spec.model import Fault  # noqa: E402
from spec.scenarios import SCENARIOS, hunt_bounds  # noqa: E402
from statemachine.checker import check, compiled  # noqa: E402


def threads_table(threads: int, floor: int) -> None:
    """The compiled search of each scenario above `floor` states on one thread and on
    `threads`, interleaved, with the speed-up and the answers compared."""
    print(f"\nthe compiled search on 1 and {threads} threads ({os.cpu_count()} cores; liveness "
          "included; the answers asserted equal):")
    head = (f"{'scenario':32} {'states':>11} {'1 thread s':>10} {f'{threads} threads s':>11} "
            f"{'speed-up':>8}")
    print(head)
    print("-" * len(head))
    t1 = tn = 0.0
    for sc in SCENARIOS:
        if sc.expect is None or sc.expect.states < floor:
            continue
        one = compiled.search(sc.bounds, threads=1)
        many = compiled.search(sc.bounds, threads=threads)
        assert (many.states, many.edges, many.depth, many.verdict, many.covered) == \
            (one.states, one.edges, one.depth, one.verdict, one.covered), sc.name
        t1 += one.seconds
        tn += many.seconds
        print(f"{sc.name:32} {one.states:11,} {one.seconds:10.2f} {many.seconds:11.2f} "
              f"{one.seconds / many.seconds:7.2f}x", flush=True)
    print("-" * len(head))
    print(f"{'all':32} {'':11} {t1:10.2f} {tn:11.2f} {t1 / tn:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-states", type=int, default=20_000)
    ap.add_argument("--skip", action="append", default=[])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--threads-from", type=int, default=200_000)
    ap.add_argument("--threads-only", action="store_true")
    args = ap.parse_args()
    if args.threads_only:
        threads_table(args.threads, args.threads_from)
        return
    print(f"machine: {os.cpu_count()} cores; compiled checker one core; baseline one core, "
          f"first {args.baseline_states:,} states of each scenario\n")
    head = (f"{'scenario':28} {'states':>11} {'depth':>5} {'seconds':>8} {'states/s':>9} | "
            f"{'baseline states':>15} {'seconds':>8} {'states/s':>9} | {'ratio':>6}")
    print(head)
    print("-" * len(head))
    tot_c = tot_cs = tot_b = tot_bs = 0.0
    for sc in SCENARIOS:
        if sc.name in args.skip:
            continue
        c = check(sc.bounds)
        assert c.ok and c.complete, sc.name
        limit = args.baseline_states if c.states > args.baseline_states else None
        b = check_model(sc.bounds, max_states=limit)
        assert b.ok, sc.name
        tot_c += c.states
        tot_cs += c.seconds
        tot_b += b.states
        tot_bs += b.seconds
        ratio = c.states_per_second / b.states_per_second
        print(f"{sc.name:28} {c.states:11,} {c.depth:5} {c.seconds:8.2f} "
              f"{c.states_per_second:9,.0f} | {b.states:15,} {b.seconds:8.2f} "
              f"{b.states_per_second:9,.0f} | {ratio:5.0f}x", flush=True)
    rate_c, rate_b = tot_c / tot_cs, tot_b / tot_bs
    print("-" * len(head))
    print(f"{'all':28} {tot_c:11,.0f} {'':5} {tot_cs:8.2f} {rate_c:9,.0f} | {tot_b:15,.0f} "
          f"{tot_bs:8.2f} {rate_b:9,.0f} | {rate_c / rate_b:5.0f}x")

    fault = Fault.RESET_KEEPS_TRANSFER_JOBS
    print("\nPR #48102 (reset-keeps-transfer-jobs), the whole command path (search, replay, "
          "certification):")
    for label, without in (("safety (INV-1)", frozenset[str]()),
                           ("liveness, INV-1 off", frozenset({"INV-1"}))):
        for engine in ("compiled", "python"):
            t0 = time.perf_counter()
            r = check(hunt_bounds(fault), frozenset([fault]), without=without, engine=engine)
            dt = time.perf_counter() - t0
            ce = r.counterexample
            assert ce is not None
            shape = (f"{len(ce)} steps" if ce.cycle_start is None else
                     f"{ce.cycle_start} steps + a cycle of {len(ce.cycle)}")
            print(f"  {label:22} {engine:9} {r.verdict:16} {shape:26} after {r.states:7,} "
                  f"states in {dt * 1000:9.1f} ms")
    threads_table(args.threads, args.threads_from)


if __name__ == "__main__":
    main()
