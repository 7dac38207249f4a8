"""The spec monitor's cost per engine step in vLLM's real core Scheduler.

`bench/scheduler.py` times the connector's hooks alone; this times what an engine pays per
step: vLLM's `Scheduler.schedule()` and `update_from_output()` with the offloading
connector inside, at N active requests, the connector plain (`OffloadingConnector`) and
monitored (`MonitoredOffloadingConnector` in `log` and `warn` mode, loaded through
`kv_connector_module_path`), on the same seeded workload (`conformance.core_scheduler`:
prompts of 64 to 640 tokens, half of them sharing one of N/16 prefixes, 16 to 64 output
tokens each, a finished request replaced at once, acks one step later). Timed: one
`CoreDriver.step()` (schedule, the harness's model and worker outputs, the same on every
side, and update_from_output). Sides alternate; the figure per side is the median over
repetitions of the mean CPU ms per counted step, and the floor: each counted step's least
CPU time over the repetitions (the workload is seeded, so step k is the same step in every
repetition), summed and divided by the steps. On a loaded machine other processes only add
to a step's time, so the floor is the steadier figure there.

The monitor's own time, in the same run: on this shared machine the plain and monitored
runs' step times swing by 30% from run to run (the same code gives 1.00x to 1.26x), far more
than a 5% target. So each monitored run also times the monitor inside itself: every
scheduler-side hook of `MonitoredOffloadingConnector` whole, minus the vLLM call inside it
(the monitor's projection, log and checks, its wrappers and the timers themselves, so it
errs high), per counted step. The in-run ratio is step / (step - monitor) over the same
steps: what the step would cost without the monitor, with the noise of the run in both.

`--process` adds `vLLM+warn/process`: `warn` mode with `kvspec_checker: process`, the
checks in a `kvspec replay --follow` process beside the engine. The engine's step and the
monitor's own time are the engine process's; the checker process's CPU is printed apart
(its whole run per step, from `getrusage` of the children after shutdown).

`--floors` adds two sides that are not modes of the monitor but bounds on any monitor that
hooks each call: `vLLM+args`, the `log` mode with the projection cut out (each event's
arguments written, its delta left empty), and `vLLM+hooks`, that and no log either (the
hooks wrapped, their arguments built, nothing kept). What `log` costs above `vLLM+args` is
the projection and its delta; what `vLLM+args` costs is the floor of a log of the calls.

    .venv-vllm/bin/python bench/engine_monitor.py [--active 256] [--steps 30] [--reps 3]
        [--floors] [--process]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import conformance.vllm_env  # noqa: E402,F401  (before vLLM: offline, quiet)
from conformance.core_scheduler import CoreDriver, make_core_scheduler  # noqa: E402
from statemachine.monitor.log import Delta, Event  # noqa: E402

BLOCK = 16


def workload(active: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(rng.choice((128, 256, 384)))]
                for _ in range(max(1, active // 16))]
    out = []
    for _ in range(active * 4):
        body = [rng.randrange(1000, 30000) for _ in range(rng.randrange(64, 640))]
        prompt = (rng.choice(prefixes) + body)[:640] if rng.random() < 0.5 else body
        out.append((prompt, rng.randrange(16, 65)))
    return out


PROCESS_MODE = "warn/process"
"""`warn` mode with `kvspec_checker: process` (`--process`)."""
FLOORS = ("vLLM+args", "vLLM+hooks")
"""The `--floors` sides (see the module docstring)."""


def cut_projection(projector: Any) -> None:
    """Each event of `projector` (a `LiveProjector`) with its arguments and an empty delta:
    the projection cut out, for the `--floors` sides only."""
    def event(hook: str, args: dict[str, Any], *rest: Any, **kw: Any) -> Event:
        projector.seq += 1
        return Event(seq=projector.seq, step=projector.step, hook=hook, args=args,
                     delta=Delta())
    projector.event = event


_HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
          "build_connector_meta", "update_connector_output", "request_finished",
          "request_finished_all_groups", "reset_cache")


class SelfTimer:
    """Times the monitor inside a monitored run (see the module docstring): `own_ns` grows
    by each hook's CPU time less the vLLM call inside it, while `counting`."""

    def __init__(self) -> None:
        self.child_s = 0.0
        """The checker process's CPU seconds over the whole run (`warn/process` only)."""
        self.own_ns = 0
        self.counting = False
        self._inner = 0

    def install(self, connector: Any) -> None:
        clock = time.process_time_ns
        checked = connector._checked

        def timed_checked(hook: str, call: Any, *args: Any, **kwargs: Any) -> Any:
            def vllm_call() -> Any:
                t0 = clock()
                try:
                    return call()
                finally:
                    self._inner += clock() - t0
            return checked(hook, vllm_call, *args, **kwargs)

        connector._checked = timed_checked
        for name in _HOOKS:
            hook = getattr(connector, name, None)
            if hook is not None:
                setattr(connector, name, self._outer(hook, clock))

    def _outer(self, hook: Any, clock: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            inner, t0 = self._inner, clock()
            try:
                return hook(*args, **kwargs)
            finally:
                if self.counting:
                    self.own_ns += clock() - t0 - (self._inner - inner)
        return timed


def run(side: str, active: int, steps: int, warmup: int, seed: int,
        log_dir: Path, timer: SelfTimer | None = None) -> list[int]:
    """The CPU ns of each counted step; `timer` (a monitored side): the monitor's own."""
    extra: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    if side != "vLLM":
        mode = side.split("+")[1]
        kw = {"kv_connector": "MonitoredOffloadingConnector",
              "kv_connector_module_path": "statemachine.monitor.connector"}
        log = "" if mode == "hooks" else str(log_dir / f"{mode}.jsonl")
        extra = {"kvspec_mode": "warn" if mode.startswith("warn") else "log",
                 "kvspec_log": log}
        if mode == PROCESS_MODE:
            extra["kvspec_checker"] = "process"
    core = make_core_scheduler(num_gpu_blocks=active * 48, num_cpu_chunks=active * 8,
                               max_num_seqs=active, max_model_len=1024,
                               max_num_batched_tokens=8192, extra_config=extra, **kw)
    if side in FLOORS:
        cut_projection(core.connector.kvspec.projector)
    if timer is not None:
        timer.install(core.connector)
    driver = CoreDriver(core, seed=seed, split_acks=False)
    pending = workload(active, seed)
    n = 0

    def top_up() -> None:
        nonlocal n
        while pending and len(driver.unfinished()) < active:
            prompt, max_tokens = pending.pop(0)
            driver.add_request(f"r{n}", prompt, max_tokens)
            n += 1

    gc.collect()
    gc.freeze()
    times = []
    for k in range(warmup + steps):
        top_up()
        if timer is not None:
            timer.counting = k >= warmup
        t0 = time.process_time_ns()
        driver.step()
        if k >= warmup:
            times.append(time.process_time_ns() - t0)
    if timer is not None:
        timer.counting = False
    gc.unfreeze()
    mon = getattr(core.connector, "kvspec", None)
    if mon is not None and mon.follower is not None:
        child_s = children_cpu_s(mon.close)
        if timer is not None:
            timer.child_s = child_s
    if mon is not None and mon.findings:
        raise SystemExit(f"{side}: the monitor reported {len(mon.findings)} finding(s)")
    return times


def follower_start_ms(log_dir: Path) -> float:
    """The CPU ms of a checker process that follows a log with a header and no event."""
    from statemachine.monitor.connector import start_follower, stop_follower
    from statemachine.monitor.log import Header, LogWriter

    path = log_dir / "empty.jsonl"
    LogWriter(path, Header(vllm="none", num_workers=1)).close()
    return children_cpu_s(lambda: stop_follower(start_follower(str(path), 0))) * 1e3


def children_cpu_s(call: Any) -> float:
    """The CPU seconds of the child processes that `call()` waits for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    call()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--active", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--floors", action="store_true",
                   help="also the sides vLLM+args and vLLM+hooks (the module docstring)")
    p.add_argument("--process", action="store_true",
                   help=f"also the side vLLM+{PROCESS_MODE} (the module docstring)")
    args = p.parse_args(argv)
    sides = ["vLLM", "vLLM+log", "vLLM+warn",
             *([f"vLLM+{PROCESS_MODE}"] if args.process else ()),
             *(FLOORS if args.floors else ())]
    child: list[float] = []
    """The checker process's CPU ms per step (all steps of the run, warm-up too)."""
    ms: dict[str, list[float]] = {s: [] for s in sides}
    own: dict[str, list[float]] = {s: [] for s in sides[1:]}
    """Per monitored side and repetition: the monitor's own CPU ms per counted step."""
    inrun: dict[str, list[float]] = {s: [] for s in sides[1:]}
    """... and that repetition's step / (step - monitor)."""
    floor: dict[str, list[int]] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="kvspec-bench-engine-"))
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):
            timer = SelfTimer() if side != "vLLM" else None
            times = run(side, args.active, args.steps, args.warmup, args.seed, log_dir,
                        timer)
            step = statistics.fmean(times) / 1e6
            ms[side].append(step)
            if timer is not None:
                mine = timer.own_ns / args.steps / 1e6
                own[side].append(mine)
                inrun[side].append(step / (step - mine))
                if side.endswith(PROCESS_MODE):
                    child.append(timer.child_s * 1e3 / (args.steps + args.warmup))
            floor[side] = [min(a, b) for a, b in zip(floor.get(side, times), times,
                                                     strict=True)]
    base = statistics.median(ms["vLLM"])
    base_floor = statistics.fmean(floor["vLLM"]) / 1e6
    print(f"engine step CPU ms (Scheduler.schedule + update_from_output, connector inside), "
          f"{args.active} active requests, {args.steps} counted steps, {args.reps} reps; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"  {'':10} {'median':>8}       {'':6} {'floor':>8}")
    for side in sides:
        m = statistics.median(ms[side])
        f = statistics.fmean(floor[side]) / 1e6
        print(f"  {side:10} {m:8.3f} ms  {m / base:5.2f}x {f:8.3f} ms  {f / base_floor:5.2f}x")
    print("the monitor's own CPU ms per counted step, timed inside each monitored run, and "
          "that run's step / (step - monitor); medians over the repetitions [range]")
    for side in sides[1:]:
        o, r = own[side], inrun[side]
        print(f"  {side:10} {statistics.median(o):8.3f} ms  [{min(o):.3f} to {max(o):.3f}]  "
              f"in-run {statistics.median(r):5.3f}x [{min(r):.3f} to {max(r):.3f}]")
    if child:
        start = follower_start_ms(log_dir)
        steady = [c - start / (args.steps + args.warmup) for c in child]
        print(f"the checker process of vLLM+{PROCESS_MODE}, CPU ms per step of the run "
              f"(warm-up too), less its start-up ({start:.0f} ms: a follower of a log with "
              f"no event): median {statistics.median(steady):.3f} [{min(steady):.3f} to "
              f"{max(steady):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
