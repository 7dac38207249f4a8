"""Soaks: long, seeded random runs of the model-based machines, with bounded shrinking.

A soak drives `OffloadingStateMachine` (the reference scheduler against the abstract model)
or `DataPlaneStateMachine` (engine, scheduler, workers, kernels, byte oracle) with programs
drawn from a seeded `random.Random`, rule by rule as hypothesis would (each enabled rule
equally likely), every check of the machines on. Unlike a hypothesis campaign, a soak:
- counts model steps (events the model and the implementation both took) and stops at a
  budget, so its size is a number of steps, not of examples;
- reports a failure by the *first* thing that went wrong: the step that raised, never what
  the teardown drain finds in the broken implementation afterwards;
- shrinks a failing program within a time budget (a failing program is replayed with events
  removed, keeping each removal that still fails the same way), then prints the seed, the
  shrunk program and the command that reruns the seed.

The tiering soak runs `statemachine.tiering.testing.TieringStateMachine` (the reference
tiering manager on filesystem tiers against itself on memory tiers, the spec's invariants,
table moves, real bytes and the drain after every program) through hypothesis itself, seeded,
for a budget of rule calls; hypothesis shrinks a failure, and it is reported with the
machine's numbered trace.

`make soak` splits the seeds over every core with pytest-xdist (`tests/test_soak.py`) and
prints the totals; `python -m statemachine.soak --seed N` reruns one seed in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from spec import model as M
from spec.witnesses import WITNESSES, Witness, all_rows
from statemachine.testing import (
    AsyncLoadDataPlaneStateMachine,
    DataPlaneStateMachine,
    DefaultRetentionHybridDataPlaneStateMachine,
    DefaultRetentionMambaDataPlaneStateMachine,
    HybridDataPlaneStateMachine,
    MambaDataPlaneStateMachine,
    NarrowWindowDataPlaneStateMachine,
    OffloadingStateMachine,
    Release034AsyncLoadDataPlaneStateMachine,
    Release034DataPlaneStateMachine,
    TightDataPlaneStateMachine,
    WindowDataPlaneStateMachine,
)

MACHINES = ("model", "data-plane", "tiering")

Action = tuple[str, dict[str, Any]]
"""One data-plane rule call: its method name and arguments."""


@dataclass
class Failure:
    machine: str
    seed: int
    program: int
    """Which program of the seed (0 is the first)."""
    error: str
    """The first failure of the shrunk program: its type and message."""
    shrunk: str
    """The shrunk program, as text (model events, or data-plane rule calls)."""
    bounds: str
    original_length: int
    shrunk_length: int
    shrink_seconds: float
    mutant: str | None = None
    rerun: str | None = None
    """The command that reruns the seed (by default this module's, for its own machines)."""

    def render(self) -> str:
        first, _, rest = self.error.partition("\n")
        lines = [f"{self.machine} seed {self.seed}, program {self.program}: {first}"]
        lines += [f"    {line}" for line in rest.splitlines()[:12]]
        lines.append(f"  shrunk program ({self.shrunk_length} of {self.original_length} "
                     f"steps, {self.shrink_seconds:.1f} s of shrinking), {self.bounds}:")
        lines.append(f"    {self.shrunk}")
        flag = f" --mutant {self.mutant}" if self.mutant else ""
        lines.append("  rerun: " + (self.rerun or f"python -m statemachine.soak --machine "
                                    f"{self.machine} --seed {self.seed}{flag}"))
        return "\n".join(lines)


@dataclass
class SoakResult:
    machine: str
    seed: int
    steps: int = 0
    programs: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)
    """How often the programs took each path of `PATHS` (data-plane soaks)."""
    rows: Counter[str] = field(default_factory=Counter)
    """How often the model fired each row of the tables, by id (model soaks)."""
    random_rows: Counter[str] = field(default_factory=Counter)
    """The same, in the programs drawn at random from the start (not from a witness)."""
    seeded: int = 0
    """Programs that began with a row's witness (`WITNESS_EVERY`)."""
    opened: Counter[str] = field(default_factory=Counter)
    """Data-plane programs that began with each opener (`DATA_PLANE_OPENERS`)."""

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "seed": self.seed, "steps": self.steps,
                "programs": self.programs, "seconds": round(self.seconds, 3),
                "failures": [f.__dict__ for f in self.failures], "paths": dict(self.paths),
                "rows": dict(self.rows), "random_rows": dict(self.random_rows),
                "seeded": self.seeded, "opened": dict(self.opened)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SoakResult:
        return cls(d["machine"], d["seed"], d["steps"], d["programs"], d["seconds"],
                   [Failure(**f) for f in d["failures"]], Counter(d.get("paths", {})),
                   Counter(d.get("rows", {})), Counter(d.get("random_rows", {})),
                   d.get("seeded", 0), Counter(d.get("opened", {})))


# ============================================================================ signatures
def signature(exc: BaseException) -> str:
    """What must stay the same while a program shrinks: the exception type and the
    invariants it names (or, naming none, its first line with numbers masked)."""
    text = str(exc)
    invariants = sorted(set(re.findall(r"INV-\d+", text)))
    if invariants:
        return f"{type(exc).__name__}: {' '.join(invariants)}"
    first = re.sub(r"\d+", "N", text.split("\n", 1)[0])
    first = re.sub(r"after .*?: ", "", first)[:80]
    return f"{type(exc).__name__}: {first}"


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def shrink(items: list[Any], fails: Callable[[list[Any]], BaseException | None], target: str,
           seconds: float) -> list[Any]:
    """Remove chunks of `items`, then single items, keeping each removal after which
    `fails` still returns an exception of signature `target`; stop after `seconds`."""
    deadline = time.monotonic() + seconds
    best = list(items)
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, removed = 0, False
        while i < len(best) and time.monotonic() < deadline:
            trial = best[:i] + best[i + chunk:]
            exc = fails(trial) if trial else None
            if exc is not None and signature(exc) == target:
                best, removed = trial, True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return best


# ============================================================================ the model machine
def _swarm(rng: random.Random, kinds: Sequence[str]) -> set[str]:
    n = rng.randint(2, len(kinds))
    return set(rng.sample(list(kinds), n))


ROWS = all_rows()
"""Each table row's id (`r17`) and its (machine, index)."""

WITNESS_EVERY = 8
"""One model program in this many begins with a row's witness (`spec.witnesses`), the rows
in turn, and goes on at random from where it fired its row: a random program from the
start reaches some rows seldom or never (a Mamba group's WAITING_STORING, a stray report),
and what follows a rare row is where a soak finds what a test of the row alone misses."""


class WitnessMissed(AssertionError):
    """A witness replayed on the machine did not fire its row."""


def _model_program(cls: type[OffloadingStateMachine], rng: random.Random, length: int,
                   witness: Witness | None = None
                   ) -> tuple[OffloadingStateMachine, BaseException | None]:
    """One random program of up to `length` rule draws, then the teardown drain; with
    `witness`, its program first, under its scenario's bounds (counted among the draws)."""
    m = cls()
    if witness is None:
        m.start(which=rng.randrange(101), swarm=_swarm(rng, m.SWARM))
    else:
        m.begin(witness.bounds, _swarm(rng, m.SWARM))
    try:
        if witness is not None:
            prefix = witness.events()
            for ev in prefix:
                m._step(ev)
                m.invariants_hold()
            if not m.rows_fired[ROWS[witness.row]]:
                raise WitnessMissed(f"the witness of {witness.row} did not fire it "
                                    f"(`kvspec witness {witness.row}`)")
            length -= len(prefix)
        for _ in range(length):
            rules = [r for r, _, _ in m.EVENT_RULES if m.candidates(r)]
            pick = rng.randrange(len(rules) + 1)
            if pick == len(rules):  # hypothesis's rule of checks, drawn as often as any
                m.duplicate_report_is_rejected()
                continue
            m._step(rng.choice(m.candidates(rules[pick])))
            m.invariants_hold()
        m.teardown()
    except BaseException as exc:  # every check raises: the machine keeps the first
        return m, m.failure or exc
    return m, None


def _model_replay(cls: type[OffloadingStateMachine], bounds: M.Bounds,
                  events: list[M.Event]) -> BaseException | None:
    from statemachine.testing import replay

    try:
        replay(events, bounds, cls)
    except BaseException as exc:
        return exc
    return None


def soak_model(seed: int, steps: int, cls: type[OffloadingStateMachine] = OffloadingStateMachine,
               program_length: int = 50, shrink_seconds: float = 60.0,
               mutant: str | None = None, name: str = "model",
               rerun: str | None = None, witness_every: int = WITNESS_EVERY) -> SoakResult:
    """Programs of `cls` drawn from `seed` until `steps` model steps ran or one failed; with
    `mutant`, that fault of `statemachine.mutants` is on in the implementation. `cls` may be
    any subclass of the machine (another implementation behind its adapter: vLLM's, in
    tests/conformance/test_soak_vllm.py); `name` is its name in the report and `rerun` the
    command that reruns the seed there. One program in `witness_every` (0: none) begins
    with a row's witness, the rows in turn from one the seed picks."""
    with mutant_on(mutant):
        return _soak_model(seed, steps, cls, program_length, shrink_seconds, mutant, name,
                           rerun, witness_every)


def _soak_model(seed: int, steps: int, cls: type[OffloadingStateMachine], program_length: int,
                shrink_seconds: float, mutant: str | None, name: str,
                rerun: str | None, witness_every: int) -> SoakResult:
    rng = random.Random(seed)
    out = SoakResult(name, seed)
    t0 = time.perf_counter()
    first = rng.randrange(len(WITNESSES))
    while out.steps < steps:
        witness = None
        if witness_every and out.programs % witness_every == witness_every - 1:
            witness = WITNESSES[(first + out.seeded) % len(WITNESSES)]
            out.seeded += 1
        m, exc = _model_program(cls, rng, program_length, witness)
        out.steps += len(m.events)
        fired = {M.MACHINES[machine].row_id(i): n for (machine, i), n in m.rows_fired.items()}
        out.rows.update(fired)
        if witness is None:
            out.random_rows.update(fired)
        out.programs += 1
        if exc is None:
            continue
        assert m.model is not None
        bounds, events = m.model.bounds, list(m.events)
        t1 = time.perf_counter()
        small = shrink(events, functools.partial(_model_replay, cls, bounds), signature(exc),
                       shrink_seconds)
        final = _model_replay(cls, bounds, small) or exc
        out.failures.append(Failure(
            name, seed, out.programs - 1, describe(final),
            " ; ".join(map(str, small)), _bounds_text(bounds), len(events), len(small),
            time.perf_counter() - t1, mutant, rerun))
        break
    out.seconds = time.perf_counter() - t0
    return out


def _bounds_text(b: M.Bounds) -> str:
    default = M.Bounds()
    return "Bounds(" + ", ".join(f"{k}={getattr(b, k)!r}" for k in b.__dataclass_fields__
                                 if getattr(b, k) != getattr(default, k)) + ")"


# ============================================================================ the data plane
def _data_actions(m: DataPlaneStateMachine, rng: random.Random) -> Action:
    live = sorted(m.engine.requests)
    rules = ["new_request", "step", "worker_failure", "worker_hang", "worker_stall", "reset"]
    if live:
        rules.append("abort_request")
    weights = type(m).program_weights
    rule = rng.choices(rules, [weights.get(r, 1) for r in rules])[0]
    if rule == "new_request":
        return rule, {"family": rng.randint(0, 2), "tokens": rng.randint(5, 20),
                      "max_tokens": rng.randint(1, 6)}
    if rule == "worker_hang":
        return rule, {"worker": rng.randint(0, 1), "release_after": rng.randint(2, 8)}
    if rule == "worker_stall":
        return rule, {"worker": rng.randint(0, 1), "polls": rng.randint(1, 5)}
    if rule == "worker_failure":
        return rule, {"worker": rng.randint(0, 1)}
    if rule == "abort_request":
        return rule, {"req_id": rng.choice(live)}
    if rule == "reset":
        return rule, {"running": rng.random() < 0.5, "connector": rng.random() < 0.5}
    return rule, {}


DATA_PLANE_MACHINES: tuple[type[DataPlaneStateMachine], ...] = (
    DataPlaneStateMachine, HybridDataPlaneStateMachine, MambaDataPlaneStateMachine,
    Release034DataPlaneStateMachine, AsyncLoadDataPlaneStateMachine,
    Release034AsyncLoadDataPlaneStateMachine, TightDataPlaneStateMachine,
    WindowDataPlaneStateMachine, DefaultRetentionHybridDataPlaneStateMachine,
    DefaultRetentionMambaDataPlaneStateMachine, NarrowWindowDataPlaneStateMachine)
"""The data-plane soak takes its programs in turn over these (one KV cache group, full
attention beside a sliding window, full attention beside a Mamba group, one group under
vLLM 0.34.0's rules, one group whose hits all load asynchronously, under each release's
rules, and the same over 10 GPU blocks, where the core preempts for room; then, at vLLM's
default retention (0), a sliding window on every layer, the window and Mamba groups beside
full attention, and a window on every layer narrower than a block)."""

PATHS = ("loads_inside_a_chunk", "async_loads_scheduled", "loads_promoted",
         "async_loads_orphaned_by_reset", "stale_loads_failed", "failed_recving_recomputes",
         "stale_recvings",
         "quarantined_loads", "quarantined_blocks_already_freed", "recomputes",
         "preemptions", "preemptions_by_reset",
         "loaded_blocks_verified", "stored_blocks_verified")
"""The engine's counters a data-plane soak adds up over its programs and prints: how often
it took the paths a soak exists to reach (a soak that never orphans a load proves nothing
about orphaned loads)."""


@dataclass(frozen=True)
class Opener:
    """A data-plane program that takes a path random programs all but never reach, and the
    counter of `PATHS` it must raise: some soak programs begin with it and go on at random
    from there (`OPENER_EVERY`), as model programs begin with a row's witness."""

    name: str
    path: str
    machine: type[DataPlaneStateMachine]
    actions: tuple[Action, ...]


def _steps(n: int) -> tuple[Action, ...]:
    return (("step", {}),) * n


DATA_PLANE_OPENERS: tuple[Opener, ...] = (
    Opener("stale-recving", "stale_recvings", AsyncLoadDataPlaneStateMachine, (
        # a prefix stored, then a request whose async load of it a rank withholds past the
        # job timeout: it recomputes and runs; a reset of the GPU prefix cache alone
        # preempts it and it loads the prefix again while rank 0 stalls, and the first
        # load's late completion names it while it waits on the second
        # (spec.request.recving_is_stale)
        ("new_request", {"family": 0, "tokens": 20, "max_tokens": 2}), *_steps(6),
        ("worker_hang", {"worker": 1, "release_after": 6}),
        ("new_request", {"family": 0, "tokens": 20, "max_tokens": 12}), *_steps(5),
        ("reset", {"running": True, "connector": False}), ("worker_stall", {"worker": 0}),
        *_steps(3))),
)

OPENER_EVERY = 4
"""One program in this many on an opener's machine begins with an opener of that machine
(the openers in turn)."""


class OpenerMissed(AssertionError):
    """An opener run on its machine did not take its path."""


def _run_actions(actions: Sequence[Action], rng: random.Random | None = None,
                 length: int = 0, machine: type[DataPlaneStateMachine] = DataPlaneStateMachine,
                 paths: Counter[str] | None = None, opener: Opener | None = None
                 ) -> tuple[list[Action], BaseException | None]:
    """Run `actions` (or, with `rng`, `length` random ones) on a fresh data-plane machine,
    then its teardown; the actions taken and the first failure. `paths` adds up the engine's
    counters of `PATHS`. With `opener`, its actions come first and must take its path
    (`OpenerMissed`), counted among the `length`."""
    m = machine()
    try:
        return _run_on(m, actions, rng, length, opener)
    finally:
        if paths is not None:
            paths.update({k: m.engine.stats[k] for k in PATHS if m.engine.stats[k]})


def _run_on(m: DataPlaneStateMachine, actions: Sequence[Action], rng: random.Random | None,
            length: int, opener: Opener | None = None
            ) -> tuple[list[Action], BaseException | None]:
    taken: list[Action] = []

    def run(todo: Iterable[Action]) -> None:
        for name, kwargs in todo:
            taken.append((name, kwargs))
            getattr(m, name)(**kwargs)

    try:
        if opener is not None:
            run(opener.actions)
            if not m.engine.stats[opener.path]:
                raise OpenerMissed(f"the opener {opener.name} did not take its path "
                                   f"({opener.path} stayed 0)")
            length -= len(opener.actions)
        run(actions if rng is None else (_data_actions(m, rng) for _ in range(length)))
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            m.engine.shutdown()
        return taken, exc
    try:
        m.teardown()
    except BaseException as exc:
        return taken, exc
    return taken, None


def _failure_of(actions: Sequence[Action], machine: type[DataPlaneStateMachine]
                ) -> BaseException | None:
    return _run_actions(actions, machine=machine)[1]


def _action_text(a: Action) -> str:
    return f"{a[0]}({', '.join(f'{k}={v!r}' for k, v in a[1].items())})"


def soak_data_plane(seed: int, steps: int, program_length: int = 40,
                    shrink_seconds: float = 60.0, mutant: str | None = None) -> SoakResult:
    """Data-plane programs drawn from `seed` until `steps` rule calls ran or one failed."""
    with mutant_on(mutant):
        return _soak_data_plane(seed, steps, program_length, shrink_seconds, mutant)


def _soak_data_plane(seed: int, steps: int, program_length: int, shrink_seconds: float,
                     mutant: str | None) -> SoakResult:
    rng = random.Random(seed)
    out = SoakResult("data-plane", seed)
    t0 = time.perf_counter()
    while out.steps < steps:
        turn, which = divmod(out.programs, len(DATA_PLANE_MACHINES))
        machine = DATA_PLANE_MACHINES[which]
        openers = [o for o in DATA_PLANE_OPENERS if o.machine is machine]
        opener = openers[turn // OPENER_EVERY % len(openers)] \
            if openers and turn % OPENER_EVERY == 0 else None
        taken, exc = _run_actions((), rng, program_length, machine, out.paths, opener)
        out.steps += len(taken)
        out.programs += 1
        if opener is not None:
            out.opened[opener.name] += 1
        if exc is None:
            continue
        if isinstance(exc, OpenerMissed):  # not the program's to shrink: the opener's own
            out.failures.append(Failure(
                "data-plane", seed, out.programs - 1, describe(exc),
                " ; ".join(map(_action_text, taken)), f"{machine.__name__}'s engine",
                len(taken), len(taken), 0.0, mutant))
            break
        t1 = time.perf_counter()
        small = shrink(taken, functools.partial(_failure_of, machine=machine),
                       signature(exc), shrink_seconds)
        final = _run_actions(small, machine=machine)[1] or exc
        out.failures.append(Failure(
            "data-plane", seed, out.programs - 1, describe(final),
            " ; ".join(map(_action_text, small)), f"{machine.__name__}'s engine",
            len(taken), len(small), time.perf_counter() - t1, mutant))
        break
    out.seconds = time.perf_counter() - t0
    return out


# ============================================================================ tiering
def soak_tiering(seed: int, steps: int, program_length: int = 40,
                 shrink_seconds: float = 60.0, mutant: str | None = None) -> SoakResult:
    """Tiering-machine programs from hypothesis seeded with `seed` until `steps` rule calls
    ran or one failed; `mutant` names a fault of `statemachine.tiering.mutants`."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import get_state_machine_test

    from statemachine.tiering.mutants import tier_mutant
    from statemachine.tiering.testing import TieringStateMachine, reference_system

    out = SoakResult("tiering", seed)
    counted = {"steps": 0, "programs": 0}

    class Soaked(TieringStateMachine):
        system_factory = staticmethod(lambda setup: reference_system(setup, "fs"))
        reference_factory = staticmethod(lambda setup: reference_system(setup, "memory"))

        def teardown(self) -> None:
            counted["steps"] += len(self.trace)
            counted["programs"] += 1
            super().teardown()

    phases = (Phase.generate, Phase.shrink) if shrink_seconds > 0 else (Phase.generate,)
    budget = settings(max_examples=max(1, -(-steps // program_length)),
                      stateful_step_count=program_length, deadline=None, database=None,
                      derandomize=False, phases=phases,
                      suppress_health_check=list(HealthCheck))
    test = hypothesis_seed(seed)(get_state_machine_test(Soaked, settings=budget))
    ctx = tier_mutant(mutant).patch() if mutant else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx:
        try:
            test()
        except Exception as exc:  # the first broken check, shrunk by hypothesis
            notes = "\n".join(getattr(exc, "__notes__", []))
            out.failures.append(Failure(
                "tiering", seed, counted["programs"] - 1, describe(exc),
                " ; ".join(line.strip() for line in notes.splitlines() if line.strip()),
                "reference on filesystem tiers against memory tiers", counted["steps"],
                notes.count("\n") + 1, time.perf_counter() - t0, mutant))
    out.steps, out.programs = counted["steps"], counted["programs"]
    out.seconds = time.perf_counter() - t0
    return out


# ============================================================================ reporting
def summary(results: Sequence[SoakResult]) -> str:
    lines = [f"{'machine':12} {'seeds':>5} {'programs':>9} {'steps':>10} {'seconds':>9} "
             f"{'steps/s':>8} {'failures':>8}"]
    names = [*MACHINES, *sorted({r.machine for r in results} - set(MACHINES))]
    for name in names:
        rs = [r for r in results if r.machine == name]
        if not rs:
            continue
        steps = sum(r.steps for r in rs)
        secs = sum(r.seconds for r in rs)
        lines.append(f"{name:12} {len(rs):5} {sum(r.programs for r in rs):9} {steps:10} "
                     f"{secs:9.1f} {steps / secs if secs else 0:8.0f} "
                     f"{sum(len(r.failures) for r in rs):8}")
    every = list(ROWS)
    for name in names:
        paths: Counter[str] = sum((r.paths for r in results if r.machine == name), Counter())
        if paths:
            lines.append(f"{name} paths: " + ", ".join(
                f"{k} {paths[k]}" for k in PATHS if k in paths))
        opened: Counter[str] = sum((r.opened for r in results if r.machine == name), Counter())
        if opened:
            lines.append(f"{name} openers (programs that began with one, each taking its "
                         "path): " + ", ".join(f"{o.name} {opened[o.name]} ({o.path})"
                                               for o in DATA_PLANE_OPENERS if o.name in opened))
        mine = [r for r in results if r.machine == name]
        rows: Counter[str] = sum((r.rows for r in mine), Counter())
        seeded = sum(r.seeded for r in mine)
        if rows:
            lines.append(f"{name} rows: {_coverage(every, rows)}")
        if seeded:
            lines.append(f"{name} rows of random programs alone ({seeded} of "
                         f"{sum(r.programs for r in mine)} programs began with a witness): "
                         f"{_coverage(every, sum((r.random_rows for r in mine), Counter()))}")
    failures = [f for r in results for f in r.failures]
    if failures:
        lines.append("")
        lines.extend(f.render() for f in failures)
    return "\n".join(lines)


def _coverage(every: list[str], rows: Counter[str]) -> str:
    never = [row for row in every if row not in rows]
    rare = sorted((row for row in every if 0 < rows[row] < 10), key=every.index)
    return (f"{len(every) - len(never)} of {len(every)} fired"
            + (f"; never {' '.join(never)}" if never else "")
            + (f"; fewer than 10 times {' '.join(rare)}" if rare else "")
            + (" (`kvspec witness ROW`: a program that fires it)" if never or rare else ""))


@contextlib.contextmanager
def mutant_on(name: str | None) -> Iterator[None]:
    """Switch the named fault of `statemachine.mutants` on in the implementation (the soak
    then checks the faulty implementation against the correct model)."""
    if not name:
        yield
        return
    from statemachine.mutants import by_name

    with by_name(name).patch():
        yield


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m statemachine.soak",
                                 description="Rerun one soak seed in this process.")
    ap.add_argument("--machine", choices=MACHINES, default="model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--mutant", default=None, help="a fault of statemachine.mutants")
    ap.add_argument("--shrink-seconds", type=float, default=60.0)
    args = ap.parse_args(argv)
    if args.machine == "model":
        r = soak_model(args.seed, args.steps, shrink_seconds=args.shrink_seconds,
                       mutant=args.mutant)
    elif args.machine == "tiering":
        r = soak_tiering(args.seed, args.steps, shrink_seconds=args.shrink_seconds,
                         mutant=args.mutant)
    else:
        r = soak_data_plane(args.seed, args.steps, shrink_seconds=args.shrink_seconds,
                            mutant=args.mutant)
    print(summary([r]))
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
