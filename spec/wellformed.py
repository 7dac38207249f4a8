"""Well-formedness of the tables, as functions that list problems (empty means well formed).

Run them on a modified table before anything else: a table that fails here makes every
later check meaningless.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from spec.hooks import LIFECYCLE_HOOKS
from spec.schema import SAME, MachineSpec, Transition


def reachable_states(m: MachineSpec) -> set[str]:
    seen = {m.initial}
    todo = deque([m.initial])
    while todo:
        s = todo.popleft()
        for src, dst, _ in m.edges():
            if src == s and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


def unreachable_states(m: MachineSpec) -> list[str]:
    reach = reachable_states(m)
    return [s for s in m.state_names if s not in reach]


def dead_ends(m: MachineSpec) -> list[str]:
    """Non-final states with no transition to another state."""
    return [s for s in m.state_names
            if s not in m.finals and not any(src == s and dst != s for src, dst, _ in m.edges())]


def absorbing_violations(m: MachineSpec) -> list[str]:
    """Final states (other than the initial one) that a transition leaves."""
    return [f"{src} --{t.trigger}--> {dst}" for src, dst, t in m.edges()
            if src in m.finals and src != m.initial and dst != src]


def _exclusive(a: Transition, b: Transition) -> bool:
    """Some guard one row requires, the other lists under `unless`."""
    return bool(set(a.requires) & set(b.unless) or set(a.unless) & set(b.requires))


def nondeterminism(m: MachineSpec) -> list[str]:
    """(state, trigger) pairs with two transitions whose guards are not exclusive."""
    out = []
    for state in m.state_names:
        for trig in m.triggers:
            rows = m.outgoing(state, trig)
            for i in range(len(rows)):
                for k in range(i + 1, len(rows)):
                    if not _exclusive(rows[i], rows[k]):
                        out.append(f"{state} --{trig}--> {rows[i].dest_from(state)} | "
                                   f"{rows[k].dest_from(state)}: guards "
                                   f"[{rows[i].guard_text}] and [{rows[k].guard_text}] are "
                                   "not exclusive")
    return out


def unresolved_names(m: MachineSpec) -> list[str]:
    out = []
    names = set(m.state_names)
    if m.initial not in names:
        out.append(f"initial state {m.initial} undeclared")
    out += [f"final state {f} undeclared" for f in m.finals if f not in names]
    used_guards: set[str] = set()
    used_effects: set[str] = set()
    for t in m.transitions:
        for s in (*t.sources, *(() if t.dest == SAME else (t.dest,))):
            if s not in names:
                out.append(f"{t.trigger}: state {s} undeclared")
        used_guards.update(t.guard_names)
        both = set(t.requires) & set(t.unless)
        if both:
            out.append(f"{t.trigger}: guards {sorted(both)} both required and excluded")
        used_effects.update(t.effects)
        if not t.hook or not t.vllm_ref:
            out.append(f"{t.trigger}: hook or vLLM reference missing")
    out += [f"guard {g} used but undeclared" for g in sorted(used_guards - set(m.guard_names))]
    out += [f"guard {g} declared but unused" for g in sorted(set(m.guard_names) - used_guards)]
    out += [f"effect {e} used but undeclared"
            for e in sorted(used_effects - set(m.effect_names))]
    out += [f"effect {e} declared but unused"
            for e in sorted(set(m.effect_names) - used_effects)]
    for g in m.groups:
        out += [f"group {g.name}: state {s} undeclared" for s in g.states if s not in names]
        if list(g.states) != [s for s in m.state_names if s in g.states]:
            out.append(f"group {g.name}: states not in the machine's order")
    return out


def shared_effect_names(machines: Iterable[MachineSpec]) -> list[str]:
    """Effect names declared by two machines: one host executes all effects, so they clash."""
    seen: dict[str, str] = {}
    out = []
    for m in machines:
        for e in m.effect_names:
            if e in seen:
                out.append(f"effect {e} declared by both {seen[e]} and {m.name}")
            seen[e] = m.name
    return out


def uncovered_hooks(machines: Iterable[MachineSpec]) -> list[str]:
    used = {t.hook for m in machines for t in m.transitions}
    return [h for h in LIFECYCLE_HOOKS if h not in used]


def problems(m: MachineSpec) -> list[str]:
    return [
        *(f"unreachable state {s}" for s in unreachable_states(m)),
        *(f"non-final state {s} has no exit" for s in dead_ends(m)),
        *(f"final state left: {e}" for e in absorbing_violations(m)),
        *nondeterminism(m),
        *unresolved_names(m),
    ]
