"""The checked scenarios: one bounded model per concern, with its expected outcome.

As in tlaplus/Examples, each scenario records what the checker must conclude, and CI checks
that it does. Together the scenarios fire every row of every table (`kvspec check` reports
coverage over their union). Bounds are small on purpose: every reachable state is visited.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from spec.model import Bounds, Fault


@dataclass(frozen=True)
class Scenario:
    name: str
    purpose: str
    bounds: Bounds


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("reset-during-transfers",
             "two requests sharing a prefix, 2 workers reporting in parts; a reset while "
             "stores and loads are in flight; GPU blocks reused behind the fence",
             Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=3, resets=1,
                    failures=0, preemptions=0)),
    Scenario("two-resets",
             "two resets, the second with the first's fence still held; a stale report "
             "after the fence drained",
             Bounds(requests=1, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=2, resets=2,
                    failures=1, preemptions=0, stray_reports=True)),
    Scenario("preemption-and-fences",
             "preemption with stores in flight, re-admission while flushing, re-allocation "
             "of fenced blocks, finish and abort everywhere",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=2, resets=1,
                    failures=0, preemptions=1)),
    Scenario("failures",
             "a worker fails a store or a load (async and sync), 2 workers",
             Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=4, resets=0,
                    failures=1, preemptions=0, sync_loads=False, partial_reports=True)),
    Scenario("sync-loads",
             "synchronous loads beside stores, their failure poisoning the stores at the "
             "first failure report; a reset after one worker failed the load (recompute)",
             Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=2, resets=1,
                    failures=1, preemptions=0, sync_loads=True)),
    Scenario("sync-preemption",
             "a request preempted while its synchronous load is unreported; that load fails, "
             "before or after a reset made it stale",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=2, resets=1,
                    failures=1, preemptions=1, sync_loads=True)),
    Scenario("sync-load-fails-after-reset",
             "a reset makes a sync load stale while its request keeps running and storing on "
             "its KV; the stale failure report invalidates the request and poisons its stores",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=1,
                    failures=1, preemptions=0, sync_loads=True)),
    Scenario("timeouts",
             "lost reports: jobs time out, late reports drain the quarantine, a reset moves "
             "it to the fence",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=0, preemptions=0, timeout_steps=1)),
    Scenario("orphaned-load-fails",
             "a reset orphans an async load, a worker then fails it: the request is "
             "recomputed, not promoted",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=1, preemptions=0)),
    Scenario("late-reports",
             "2 workers: a job times out after one worker reported; the other's late report "
             "(an ack or a failure) drains the quarantine",
             Bounds(requests=1, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=2, resets=0,
                    failures=1, preemptions=0, timeout_steps=1)),
    Scenario("sync-timeouts",
             "synchronous loads whose reports are lost: timeout beside stores, in a "
             "preempted or finished request",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=2, resets=0,
                    failures=0, preemptions=1, sync_loads=True, timeout_steps=2)),
    Scenario("aborted-load-timeout",
             "an aborted request's async load outlives finalisation and times out",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=0,
                    failures=0, preemptions=0, timeout_steps=2)),
    Scenario("eviction",
             "two prefixes competing for CPU chunks: eviction never takes a pinned or "
             "write-pending chunk; allocation failure retried",
             Bounds(requests=2, tokens=2, shared_prefix=False, workers=1, cpu_chunks=2,
                    gpu_blocks=4, resets=0, failures=0, preemptions=0)),
)


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"no scenario {name!r}; known: {', '.join(s.name for s in SCENARIOS)}")


# The bounds under which each fault of the mutant catalogue is looked for: small, since the
# search stops at the first counterexample, breadth first, so it is a shortest one.
HUNT_BOUNDS = Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=3, resets=1,
                     failures=0, preemptions=1)
_HUNT_OVERRIDE: dict[Fault, Bounds] = {
    Fault.EVICT_PINNED_CHUNKS: Bounds(requests=3, tokens=2, families=2, workers=1,
                                      cpu_chunks=2, gpu_blocks=6, resets=0, failures=0,
                                      preemptions=0),
    Fault.AGGREGATE_COUNTS_ONCE: Bounds(requests=1, tokens=2, workers=2, cpu_chunks=2,
                                        gpu_blocks=2, resets=0, failures=0, preemptions=0),
}


def hunt_bounds(fault: Fault) -> Bounds:
    """The bounds under which the checker looks for `fault`."""
    return _HUNT_OVERRIDE.get(fault, HUNT_BOUNDS)


def parse_bounds(text: str, base: Bounds) -> Bounds:
    """`requests=2,workers=1,timeout_steps=none` on top of `base`; ValueError if bad."""
    changes: dict[str, Any] = {}
    fields = Bounds.__dataclass_fields__
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in fields or not value:
            raise ValueError(f"bad bound {part!r}; known: {', '.join(fields)}")
        if value.lower() in ("none", "off"):
            changes[name] = None
        elif value.lower() in ("true", "false"):
            changes[name] = value.lower() == "true"
        else:
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"bad bound {part!r}: {name} takes an integer") from None
    return replace(base, **changes)
