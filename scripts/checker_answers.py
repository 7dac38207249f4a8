"""Every answer of the compiled search, here and at a git revision, field for field: the check
that a change to the search (its memory, its threads, its speed) leaves what it finds alone.

    python scripts/checker_answers.py REV [--long]

The searches: every scenario whole, for safety alone (`liveness=False`: no edges kept), cut at
3,000 states and with the older progress check (`stuck`), and every fault's finding with INV-1
on and off (invariants, illegal events, lassos); `--long` adds the two longest scenarios
whole. The fields: states, transitions, depth, completeness, verdict, invariant, hook,
request, the counterexample's prefix and cycle (its events), stuck states, rows covered,
properties held. Each tree runs in a process of its own whose working directory is the
tree, and the script asserts that the process imported the tree's own `spec` and checker: a
script run by its path from the tree would import the editable install instead, and compare
this tree with itself. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "bench"))  # last: bench/kernels.py must not shadow `kernels`

from trees import worktree  # noqa: E402

_ANSWERS = """
import json, sys
from pathlib import Path
import spec
from spec import model as M
from spec.scenarios import SCENARIOS, hunt_bounds
from statemachine.checker import compiled
assert Path(spec.__file__).resolve().is_relative_to(Path.cwd().resolve()), spec.__file__
assert Path(compiled.__file__).resolve().is_relative_to(Path.cwd().resolve()), compiled.__file__
LONG = ("three-requests", "store-admission-three-requests")
def answer(r):
    return [r.states, r.edges, r.depth, r.complete, r.verdict, r.invariant, r.inside_hook,
            r.request, list(r.prefix), list(r.cycle), r.stuck_states, sorted(r.covered),
            r.live_checked]
out = {}
for sc in SCENARIOS:
    if sc.name in LONG and sys.argv[1] != "long":
        continue
    out[sc.name] = answer(compiled.search(sc.bounds, threads=2))
    out[sc.name + " safety"] = answer(compiled.search(sc.bounds, liveness=False, threads=2))
    out[sc.name + " cut at 3000"] = answer(compiled.search(sc.bounds, max_states=3000, threads=2))
    out[sc.name + " stuck"] = answer(compiled.search(sc.bounds, stuck=True, liveness=False,
                                                     threads=2))
for fault in M.Fault:
    b = hunt_bounds(fault)
    if compiled.fits(b) is None:
        for off in (frozenset(), frozenset({"INV-1"})):
            out[f"{fault.value} without {sorted(off)}"] = answer(
                compiled.search(b, frozenset([fault]), without=off, threads=2))
print(json.dumps(out, default=str))
"""

FIELDS = ("states", "transitions", "depth", "complete", "verdict", "invariant", "hook",
          "request", "prefix", "cycle", "stuck states", "rows covered", "properties held")


def answers(tree: Path, long: bool) -> dict[str, list[object]]:
    out = subprocess.run([sys.executable, "-c", _ANSWERS, "long" if long else "short"],
                         cwd=tree, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision to compare with")
    ap.add_argument("--long", action="store_true", help="the two longest scenarios too")
    args = ap.parse_args()
    with worktree(args.rev) as other:
        theirs = answers(other, args.long)
    ours = answers(ROOT, args.long)
    differ = 0
    for name in sorted(set(ours) | set(theirs)):
        a, b = theirs.get(name), ours.get(name)
        if a == b:
            continue
        differ += 1
        if a is None or b is None:
            print(f"{name}: only {'here' if a is None else args.rev}")
            continue
        for field, x, y in zip(FIELDS, a, b, strict=True):
            if x != y:
                print(f"{name}: {field}: {args.rev} {x!r}, here {y!r}")
    verdicts: dict[str, int] = {}
    for a in ours.values():
        verdicts[str(a[4])] = verdicts.get(str(a[4]), 0) + 1
    print(f"{len(ours)} searches ({', '.join(f'{n} {v}' for v, n in sorted(verdicts.items()))})"
          f": {differ} differ from {args.rev}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
