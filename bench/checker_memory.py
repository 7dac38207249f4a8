"""The compiled search's memory: each search's peak resident memory and time, on this tree and,
with --against REV, on a git revision side by side in the same run, with the ratios. Each
search runs in a process of its own, so its peak resident set is its own. Prints a table;
timings never go in tests.

    python bench/checker_memory.py [--against REV] [--threads N] [--from STATES] [--reps N]
                                   [--no-liveness] [--only NAME,...] [--instructions]
    python bench/checker_memory.py --parts [SCENARIO] [--every N]

The searches: every scenario of more than --from states (default 1,000,000) and the README's
example of three groups (`kvspec check --bounds groups=full+sliding+mamba,...`), liveness
included (--no-liveness: the safety search alone, as `kvspec check --no-liveness` runs it).
The figures per search: seconds, peak resident set (what the kernel counts: the interpreter
and the compiled library included), the search's own count of its data at its peak
(`Run.memory`; `-` where the revision has none), and bytes a state of each. The answers
(states, transitions, depth, verdict) are asserted equal between the two trees. With --reps N
each search runs N times in each tree, the trees' order alternating, and the fastest run of
each is shown (the peak resident set is the same in each run). --only names the scenarios to
search instead.

With --instructions, each search runs under valgrind's callgrind, which counts the
instructions executed in the compiled library's own functions: a count that is the same from
run to run, where a shared machine's timings of one search vary by half. The table then
shows those instructions and their ratio; a search runs on one thread unless --threads says
otherwise, and about 50 times slower than without callgrind, so pick searches of a few
hundred thousand states (--only). Needs `valgrind` (and its `callgrind_annotate`).

With --parts, what the collapsed visited set rests on, for one scenario (default
store-admission-three-requests): the distinct parts its states hold (each request's, the job
records', the rest, cut by the search's own split, `compiled.part_splitter`, of the states
the search visits), and how many of a state's parts a successor changes (a part it shares with the
state it was made from takes that part's leaf without a look-up): the successors of every
N-th state (--every, default 50), each made by the compiled model (`kv_step`, canonical).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import callgrind
from trees import ROOT, worktree

EXAMPLE = "groups=full+sliding+mamba,sliding_window=3,decode_tokens=2,tokens_per_block=2," \
          "gpu_blocks=12"
"""The README's example of `kvspec check --bounds`."""

_ONE = """
import json, resource, sys
from spec.scenarios import SCENARIOS, by_name, parse_bounds
from statemachine.checker import compiled
name, threads, liveness = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
b = (parse_bounds(name[7:], SCENARIOS[0].bounds) if name.startswith("bounds:")  # as kvspec check
     else by_name(name).bounds)
r = compiled.search(b, threads=threads, liveness=liveness)
print(json.dumps({"states": r.states, "edges": r.edges, "depth": r.depth,
                  "verdict": r.verdict, "seconds": r.seconds,
                  "memory": getattr(r, "memory", None),
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def one(tree: Path, search: str, threads: int, liveness: bool,
        instructions: bool = False) -> dict[str, object]:
    """One search in a process of its own, in `tree`; under callgrind with `instructions`
    (the result's "instructions": `library_instructions`)."""
    command = [sys.executable, "-c", _ONE, search, str(threads), str(int(liveness))]
    if not instructions:
        out = subprocess.run(command, cwd=tree, check=True, capture_output=True,
                             text=True).stdout
        return dict(json.loads(out.splitlines()[-1]))
    with callgrind.profile(command, tree) as (out, counts):
        return {**json.loads(out.splitlines()[-1]), "instructions": library_instructions(counts)}


def library_instructions(counts: Path) -> int:
    """The instructions a callgrind profile counts in the compiled library's own functions
    (each function's own, the libc it calls not included). Not a count inside one entry
    point: the model's `longjmp` (a rejected event) leaves callgrind's call stack unmatched,
    so it cannot tell what runs under `kv_search_run`."""
    table = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100",
                            str(counts)], check=True, capture_output=True, text=True).stdout
    return sum(int(line.split()[0].replace(",", "")) for line in table.splitlines()
               if "kvspec_checker" in line and line.strip()[:1].isdigit())


def _ratio(runs: list[dict[str, object]], key: str) -> float:
    """This tree's figure over the revision's."""
    return float(runs[1][key]) / float(runs[0][key])  # type: ignore[arg-type]


def _mb(n: object) -> str:
    return "-" if n is None else f"{int(n) / 1e6:,.0f}"  # type: ignore[call-overload]


def count_parts(scenario: str, every: int) -> None:
    """Prints the distinct parts of the scenario's states and the parts its successors change
    (--parts)."""
    from spec import model as M
    from spec.scenarios import by_name
    from statemachine.checker import compiled

    b = by_name(scenario).bounds
    lib = compiled.library().lib
    cb = compiled.c_bounds(b)
    split = compiled.part_splitter(b)
    rows, nrows = compiled.rows_of(M.SPEC_TABLES)
    events = (ctypes.c_uint32 * compiled.MAX_EVENTS)()
    out = ctypes.create_string_buffer(compiled.ENC_MAX)
    kinds = ("request", "jobs", "rest")
    distinct: dict[str, set[bytes]] = {k: set() for k in kinds}
    changed: collections.Counter[int] = collections.Counter()
    states = 0
    for i, enc in enumerate(compiled.all_states(b)):
        states += 1
        parts = split(enc)
        distinct["request"].update(parts[:b.requests])
        distinct["jobs"].add(parts[b.requests])
        distinct["rest"].add(parts[-1])
        if i % every:
            continue
        for k in range(lib.kv_events_of(ctypes.byref(cb), enc, events)):
            n = lib.kv_step(ctypes.byref(cb), rows, nrows, 0, enc, events[k], out)
            if n >= 0:
                after = split(out.raw[:n])
                changed[sum(a != c for a, c in zip(parts, after, strict=True))] += 1
    print(f"{scenario}: {states:,} states; distinct parts: "
          + ", ".join(f"{len(distinct[k]):,} {k}" for k in kinds))
    total = sum(changed.values())
    print(f"parts a successor changes, of {b.requests + 2} (the successors of every "
          f"{every}th state, {total:,}): "
          + ", ".join(f"{n} {100 * c / total:.1f}%" for n, c in sorted(changed.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="a git revision to measure side by side")
    ap.add_argument("--threads", type=int,
                    help="threads a search (default: every core; one with --instructions)")
    ap.add_argument("--from", dest="floor", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--no-liveness", dest="liveness", action="store_false",
                    help="the safety search alone")
    ap.add_argument("--only", help="the scenarios to search (comma-separated), not --from's")
    ap.add_argument("--instructions", action="store_true",
                    help="count each search's instructions under callgrind instead of timing it")
    ap.add_argument("--parts", nargs="?", const="store-admission-three-requests",
                    metavar="SCENARIO", help="count the parts of a scenario's states instead")
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    if args.threads is None:  # a crew's waits would count as instructions
        args.threads = 1 if args.instructions else len(os.sched_getaffinity(0))
    sys.path.insert(0, str(ROOT))
    if args.parts:
        count_parts(args.parts, args.every)
        return
    from spec.scenarios import SCENARIOS

    if args.only:
        searches = args.only.split(",")
    else:
        searches = [sc.name for sc in SCENARIOS
                    if sc.expect is not None and sc.expect.states > args.floor]
        searches.append("bounds:" + EXAMPLE)
    if args.instructions and (why := callgrind.missing()):
        sys.exit(f"--instructions needs callgrind: {why}")
    with contextlib.ExitStack() as stack:
        trees = [("this tree", ROOT)]
        if args.against:
            trees.insert(0, (args.against, stack.enter_context(worktree(args.against))))
        print(f"machine: {os.cpu_count()} cores; {args.threads} threads a search; "
              f"liveness {'included' if args.liveness else 'not searched'}; "
              + ("instructions: the compiled library's own, under callgrind"
                 if args.instructions else
                 "MB: 10^6 bytes; B/state: of the peak resident set"))
        head = f"{'search':32} {'tree':>10} {'states':>11} " + (
            f"{'10^6 instructions':>17} {'a state':>8}" if args.instructions else
            f"{'seconds':>8} {'peak RSS MB':>11} {'B/state':>7} {'memory MB':>9}")
        print(head)
        print("-" * len(head))
        for search in searches:
            best: dict[str, dict[str, object]] = {}
            for rep in range(args.reps):
                for label, tree in trees[::-1] if rep % 2 else trees:
                    r = one(tree, search, args.threads, args.liveness, args.instructions)
                    if label not in best or r["seconds"] < best[label]["seconds"]:  # type: ignore[operator]
                        best[label] = r
            runs = [best[label] for label, _ in trees]
            for (label, _), r in zip(trees, runs, strict=True):
                name = "README example" if search.startswith("bounds:") else search
                n = int(r["states"])  # type: ignore[call-overload]
                print(f"{name:32} {label[:10]:>10} {n:11,} " + (
                    f"{int(r['instructions']) / 1e6:17,.0f} "  # type: ignore[call-overload]
                    f"{int(r['instructions']) // n:8,}"  # type: ignore[call-overload]
                    if args.instructions else
                    f"{r['seconds']:8.2f} {_mb(r['rss']):>11} "
                    f"{int(r['rss']) // n:7} "  # type: ignore[call-overload]
                    f"{_mb(r['memory']):>9}"), flush=True)
            if len(runs) == 2:
                key = ("states", "edges", "depth", "verdict")
                assert [runs[0][k] for k in key] == [runs[1][k] for k in key], search
                print(f"{'':32} {'ratio':>10} {'':11} " + (
                    f"{_ratio(runs, 'instructions'):16.2f}x" if args.instructions else
                    f"{_ratio(runs, 'seconds'):7.2f}x {_ratio(runs, 'rss'):10.2f}x"))


if __name__ == "__main__":
    main()
