"""What the compiled model takes from the tables: names as C enumerations and state groups
as masks (a header generated at build time), and the rows as data (passed at run time, so a
mutated table runs without a rebuild).

The header is part of the library's cache key: a table that adds a state, trigger, guard or
effect gets a new build, and a name the C model does not implement (an effect `eff_<name>`, a
guard `guard_<machine>_<name>`) fails that build, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

from spec import fence as F
from spec import job as J
from spec import request as R
from spec.model.faults import Fault
from spec.progress import FAIRNESS, PROGRESS
from spec.schema import SAME, MachineSpec

MACHINES: tuple[tuple[str, str, MachineSpec], ...] = (
    ("request", "R", R.REQUEST_MACHINE), ("job", "J", J.JOB_MACHINE),
    ("fence", "F", F.FENCE_MACHINE))
"""(machine name, C prefix, table) in the order of the C enumeration `M_*`."""

MAX_EFFECTS = 8
ROW_WIDTH = 7 + MAX_EFFECTS
"""A row as C reads it: machine, trigger, sources mask, destination (-1: the same),
requires mask, unless mask, number of effects, then the effects."""


def effect_names() -> tuple[str, ...]:
    """Every effect of every machine, in one enumeration (names are unique across them)."""
    return tuple(e for _, _, m in MACHINES for e in m.effect_names)


def header() -> str:
    out = ["/* Generated from the tables of spec/ by statemachine/checker/gen.py. */",
           "#ifndef KV_TABLES_H", "#define KV_TABLES_H", ""]

    def enum(prefix: str, names: tuple[str, ...], count: str) -> None:
        body = ", ".join(f"{prefix}{n}" for n in names)
        out.append(f"enum {{ {body}, {count} }};")

    enum("M_", tuple(n.upper() for n, _, _ in MACHINES), "N_MACHINES")
    for _, p, m in MACHINES:
        enum(f"{p}_", m.state_names, f"N_{p}_STATES")
        enum(f"{p}T_", m.triggers, f"N_{p}_TRIGGERS")
        enum(f"{p}G_", m.guard_names, f"N_{p}_GUARDS")
        for g in m.groups:
            mask = " | ".join(f"(1u << {p}_{s})" for s in g.states)
            out.append(f"#define {p}S_{g.name.upper()} ({mask})")
    enum("E_", effect_names(), "N_EFFECTS")
    enum("FT_", tuple(f.name for f in Fault), "N_FAULTS")
    # fairness and progress: the C search names each class and property; one that the
    # spec drops or renames fails the build, one it adds lacks its C predicate (`dispatch`)
    enum("FAIR_", tuple(f.name for f in FAIRNESS), "N_FAIR")
    enum("PROP_", tuple(p.id.replace("-", "_") for p in PROGRESS), "N_PROPS")
    scopes = ", ".join("1" if p.scope == "request" else "0" for p in PROGRESS)
    out.append(f"static const int PROP_PER_REQUEST[N_PROPS] = {{{scopes}}};")
    out.append(f"#define MAX_EFFECTS {MAX_EFFECTS}")
    out.append(f"#define ROW_WIDTH {ROW_WIDTH}")
    # the request trigger a job's leaving the table fires, by (kind, new state)
    for kind in ("load", "store"):
        cells = []
        for state in J.JOB_MACHINE.state_names:
            trig = J.ENDING_TRIGGER.get((kind, state))
            cells.append(f"RT_{trig}" if trig else "-1")
        out.append(f"static const int ENDING_{kind.upper()}[N_J_STATES] = "
                   f"{{{', '.join(cells)}}};")
    for _, p, m in MACHINES:
        names = ", ".join(f'"{s}"' for s in m.state_names)
        out.append(f"static const char *const {p}_NAMES[N_{p}_STATES] = {{{names}}};")
    out += ["", "#endif", ""]
    return "\n".join(out)


def dispatch() -> str:
    """Prototypes of every guard and effect the tables name, and the tables of them: a name
    the C model lacks is an undefined function, so the build fails naming it."""
    out = ["/* Generated from the tables of spec/ by statemachine/checker/gen.py. */",
           "#ifndef KV_DISPATCH_H", "#define KV_DISPATCH_H", ""]
    for _, p, m in MACHINES:
        for g in m.guard_names:
            out.append(f"static int guard_{p}_{g}(World *w, int subject, const Kw *kw);")
    for e in effect_names():
        out.append(f"static void eff_{e}(World *w, int subject, const Kw *kw);")
    for _, p, m in MACHINES:
        fns = ", ".join(f"guard_{p}_{g}" for g in m.guard_names)
        out.append(f"static GuardFn *const {p}_GUARDS[N_{p}_GUARDS] = {{{fns}}};")
    fns = ", ".join(f"eff_{e}" for e in effect_names())
    out.append(f"static EffectFn *const EFFECTS[N_EFFECTS] = {{{fns}}};")
    return "\n".join([*out, "", "#endif", ""])


def progress() -> str:
    """The `waiting` predicate of every progress property, in check order: a property the C
    search does not implement (`waiting_P_n`) fails the build."""
    out = ["/* Generated from spec/progress.py by statemachine/checker/gen.py. */",
           "#ifndef KV_PROGRESS_H", "#define KV_PROGRESS_H", ""]
    names = [p.id.replace("-", "_") for p in PROGRESS]
    out += [f"static int waiting_{n}(const Bounds *b, const State *s, int r);" for n in names]
    fns = ", ".join(f"waiting_{n}" for n in names)
    out.append("typedef int WaitingFn(const Bounds *b, const State *s, int r);")
    out.append(f"static WaitingFn *const WAITING[N_PROPS] = {{{fns}}};")
    out += ["", "#endif", ""]
    return "\n".join(out)


def encode_rows(machines: Mapping[str, MachineSpec]) -> list[int]:
    """The rows of `machines` (the spec's, or a mutated copy with the same names) as C reads
    them: `ROW_WIDTH` ints each, in the order of `MACHINES` then of each table."""
    effects = {e: i for i, e in enumerate(effect_names())}
    out: list[int] = []
    for index, (name, _, spec) in enumerate(MACHINES):
        m = machines[name]
        states = {s: i for i, s in enumerate(spec.state_names)}
        triggers = {t: i for i, t in enumerate(spec.triggers)}
        guards = {g: i for i, g in enumerate(spec.guard_names)}
        for t in m.transitions:
            if len(t.effects) > MAX_EFFECTS:
                raise ValueError(f"{name} row {t.trigger}: more than {MAX_EFFECTS} effects")
            row = [index, triggers[t.trigger], sum(1 << states[s] for s in t.sources),
                   -1 if t.dest == SAME else states[t.dest],
                   sum(1 << guards[g] for g in t.requires),
                   sum(1 << guards[g] for g in t.unless), len(t.effects),
                   *(effects[e] for e in t.effects)]
            out += row + [0] * (ROW_WIDTH - len(row))
    return out


def row_origins(machines: Mapping[str, MachineSpec]) -> list[tuple[str, int]]:
    """(machine, row index in its table) of each encoded row, in `encode_rows` order."""
    return [(name, i) for name, _, _ in MACHINES
            for i in range(len(machines[name].transitions))]
