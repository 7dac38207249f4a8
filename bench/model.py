"""The Python model's speed (`spec.model`: what the reference checker, the model-based tests,
the whole-space comparisons of `make test` and the soak run on), this tree against a git
revision, side by side in one run.

    python bench/model.py REV [--states N] [--rounds K] [--scenario NAME ...]

For each scenario (default: five of the whole-space comparisons' scenarios, of one and two
groups), two measures, in this tree and in a worktree of REV:
- `space`: the scenario's whole state space, as the whole-space comparisons of
  `tests/test_checker_compiled.py` enumerate it on the Python side (`_python_states`: every
  enabled event's successor, canonical; no invariant checked): what the model costs alone;
- `checker`: the reference checker (`spec.checker.check_model`: every invariant in every
  state and inside every step, liveness when it completes) over the first N distinct states
  (default 10,000; the whole scenario when smaller).
Each tree runs in a process of its own whose working directory is the tree (asserted: a
script run by its path would import the editable install), the two alternating for K rounds
(default 2), the best round of each kept. Prints states/s both ways and the ratio; the
states and edges are asserted equal (the same model, faster or not). Timings never go in
tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from trees import ROOT, worktree

SCENARIOS = ("loaded-state-handoff", "failures", "window-retention", "partial-tails",
             "store-admission")

MEASURES = ("space", "checker")

_RUN = """
import json, sys, time
from pathlib import Path
import spec
from spec.checker import check_model
from spec.scenarios import by_name
from tests.test_checker_compiled import _python_states
assert Path(spec.__file__).resolve().is_relative_to(Path.cwd().resolve()), spec.__file__
out = {}
for name in sys.argv[2:]:
    b = by_name(name).bounds
    t0 = time.perf_counter()
    states, edges = _python_states(b)
    out["space " + name] = [len(states), edges, time.perf_counter() - t0]
    t0 = time.perf_counter()
    r = check_model(b, max_states=int(sys.argv[1]))
    out["checker " + name] = [r.states, r.edges, time.perf_counter() - t0]
print(json.dumps(out))
"""


def _run(tree: Path, states: int, names: list[str]) -> dict[str, list[float]]:
    out = subprocess.run([sys.executable, "-c", _RUN, str(states), *names], cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision to compare with")
    ap.add_argument("--states", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenario", action="append", default=[])
    args = ap.parse_args()
    names = args.scenario or list(SCENARIOS)
    best: dict[str, dict[str, list[float]]] = {"here": {}, args.rev: {}}
    with worktree(args.rev) as other:
        for _ in range(args.rounds):
            for label, tree in ((args.rev, other), ("here", ROOT)):
                for name, run in _run(tree, args.states, names).items():
                    kept = best[label].get(name)
                    if kept is None or run[2] < kept[2]:
                        best[label][name] = run
    head = (f"{'scenario':32} {'states':>7} {'edges':>8} | {args.rev[:12]:>12} s "
            f"{'states/s':>9} | {'here':>12} s {'states/s':>9} | {'ratio':>6}")
    print(f"space: each whole state space; checker: the reference checker over the first "
          f"{args.states:,} states; best of {args.rounds} rounds each\n{head}")
    for measure in MEASURES:
        print("-" * len(head))
        totals = [0.0, 0.0, 0.0]
        for name in names:
            key = f"{measure} {name}"
            (s, e, then), (s2, e2, now) = best[args.rev][key], best["here"][key]
            assert (s, e) == (s2, e2), f"{key}: {args.rev} {s} states {e} edges, here {s2} {e2}"
            totals = [totals[0] + s, totals[1] + then, totals[2] + now]
            print(f"{key:32} {s:7,.0f} {e:8,.0f} | {then:12.2f}   {s / then:9,.0f} | "
                  f"{now:12.2f}   {s / now:9,.0f} | {then / now:5.2f}x")
        print(f"{measure + ', all':32} {totals[0]:7,.0f} {'':8} | {totals[1]:12.2f}   "
              f"{totals[0] / totals[1]:9,.0f} | {totals[2]:12.2f}   "
              f"{totals[0] / totals[2]:9,.0f} | {totals[1] / totals[2]:5.2f}x")


if __name__ == "__main__":
    main()
