"""Model-checker throughput on the default scenarios, and the time to the PR #48102
counterexample. Prints one table; timings never go in tests.

    python bench/checker.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

# this folder holds kernels.py: keep it from shadowing the `kernels` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

from spec.checker import check_model  # noqa: E402
from spec.model import Fault  # noqa: E402
from spec.scenarios import SCENARIOS, hunt_bounds  # noqa: E402


def main() -> None:
    print(f"{'scenario':26} {'states':>8} {'transitions':>12} {'depth':>6} {'seconds':>8} "
          f"{'states/s':>9}")
    total_states, total_s = 0, 0.0
    for sc in SCENARIOS:
        r = check_model(sc.bounds)
        total_states += r.states
        total_s += r.seconds
        print(f"{sc.name:26} {r.states:8} {r.edges:12} {r.depth:6} {r.seconds:8.2f} "
              f"{r.states_per_second:9.0f}")
    print(f"{'all':26} {total_states:8} {'':12} {'':6} {total_s:8.2f} "
          f"{total_states / total_s:9.0f}")
    t0 = time.perf_counter()
    r = check_model(hunt_bounds(Fault.RESET_KEEPS_TRANSFER_JOBS),
                    frozenset([Fault.RESET_KEEPS_TRANSFER_JOBS]))
    dt = time.perf_counter() - t0
    assert r.counterexample is not None
    print(f"\nPR #48102 (reset-keeps-transfer-jobs): counterexample of "
          f"{len(r.counterexample)} steps after {r.states} states in {dt * 1000:.1f} ms")


if __name__ == "__main__":
    main()
