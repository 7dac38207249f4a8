"""Markdown tables generated from the spec, and their splicing into hand-written documents.

A document holds generated blocks between ``<!-- BEGIN GENERATED: name -->`` and
``<!-- END GENERATED: name -->``; `splice` replaces each block's body with what the spec gives
now, so the prose stays hand-written and the tables never drift (a test compares).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from spec.invariants import INVARIANTS
from spec.progress import FAIRNESS, PROGRESS, UNFAIR
from spec.schema import SAME, MachineSpec, Transition


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _guards(t: Transition) -> str:
    return " & ".join((*(f"`{g}`" for g in t.requires), *(f"`!{g}`" for g in t.unless))) or "—"


def states_table(m: MachineSpec) -> str:
    rows = ["| state | meaning | vLLM 0.33.0 predicate |", "|---|---|---|"]
    for s in m.states:
        mark = " *(beyond vLLM)*" if s.beyond_vllm else ""
        tags = []
        if s.name == m.initial:
            tags.append("initial")
        if s.name in m.finals:
            tags.append("final")
        tag = f" ({', '.join(tags)})" if tags else ""
        rows.append(f"| `{s.name}`{tag}{mark} | {_cell(s.meaning)} | {_cell(s.vllm_predicate)} |")
    return "\n".join(rows)


def transitions_table(m: MachineSpec) -> str:
    rows = ["| # | trigger | from | to | guards | effects | vLLM hook | code | path |",
            "|---|---|---|---|---|---|---|---|---|"]
    for i, t in enumerate(m.transitions):
        dest = "(same)" if t.dest == SAME else f"`{t.dest}`"
        effects = ", ".join(t.effects) or "—"
        note = f" {_cell(t.note)}" if t.note else ""
        rows.append(
            f"| {m.row_id(i)} | `{t.trigger}` | {', '.join(f'`{s}`' for s in t.sources)} | "
            f"{dest} | {_guards(t)} | {effects}{';' if note else ''}{note} | "
            f"`{t.hook}` | {t.vllm_ref} | {t.path.value} |")
    return "\n".join(rows)


def groups_table(m: MachineSpec) -> str:
    rows = ["| group | states | meaning |", "|---|---|---|"]
    rows += [f"| `{g.name}` | {', '.join(f'`{s}`' for s in g.states)} | {_cell(g.meaning)} |"
             for g in m.groups]
    return "\n".join(rows)


def guards_effects_table(m: MachineSpec) -> str:
    rows = ["| kind | name | meaning |", "|---|---|---|"]
    rows += [f"| guard | `{g.name}` | {_cell(g.meaning)} |" for g in m.guards]
    rows += [f"| effect | `{e.name}` | {_cell(e.meaning)} |" for e in m.effects]
    rows += [f"| ignored input | {_cell(a)} | {_cell(b)} |" for a, b in m.ignored]
    return "\n".join(rows)


def invariants_table() -> str:
    rows = ["| id | name | statement | vLLM | kind |", "|---|---|---|---|---|"]
    for inv in INVARIANTS:
        kind = "progress (see below)" if inv.is_progress else "safety, checked on every state"
        rows.append(f"| {inv.id} | `{inv.name}` | {_cell(inv.statement)} | "
                    f"{_cell(inv.vllm_ref)} | {kind} |")
    return "\n".join(rows)


def progress_table() -> str:
    rows = ["| id | property | temporal form | for | invariants |", "|---|---|---|---|---|"]
    rows += [f"| {p.id} | {_cell(p.statement)} | `{p.formula}` | "
             f"{'each request' if p.scope == 'request' else 'the system'} | {p.invariant} |"
             for p in PROGRESS]
    return "\n".join(rows)


def tiering_invariants_table() -> str:
    from spec.tiering.invariants import DATA_INVARIANTS, TIER_INVARIANTS

    rows = ["| id | name | statement | checked on |", "|---|---|---|---|"]
    rows += [f"| {i.id} | `{i.name}` | {_cell(i.meaning)} | every projected `TieringState`: "
             "the model, the reference, vLLM |" for i in TIER_INVARIANTS]
    rows += [f"| {i} | `{n}` | {_cell(m)} | the model's byte truth; real bytes in the tests "
             "and the data plane |" for i, n, m in DATA_INVARIANTS]
    return "\n".join(rows)


def tiering_progress_table() -> str:
    from spec.tiering.progress import TIER_PROGRESS

    rows = ["| id | name | property | for |", "|---|---|---|---|"]
    scope = {"request": "each request", "request-key": "each key of each request",
             "system": "the system"}
    rows += [f"| {p.id} | `{p.name}` | {_cell(p.statement)} | {scope[p.scope]} |"
             for p in TIER_PROGRESS]
    return "\n".join(rows)


def fairness_table() -> str:
    rows = ["| class | one per | events | weak fairness because |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.per} | {_cell(f.events)} | {_cell(f.reason)} |"
             for f in FAIRNESS]
    rows.append(f"| (none) | | {', '.join(UNFAIR)} | the environment's choices: no fairness |")
    return "\n".join(rows)


def equivalents_table() -> str:
    from spec.equivalents import EQUIVALENT

    rows = ["| mutant of the spec | why it is equivalent: no check can kill it |", "|---|---|"]
    rows += [f"| `{_cell(name)}` | {_cell(s.reason)} |"
             for name, s in sorted(EQUIVALENT.items())]
    return "\n".join(rows)


_BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- END GENERATED: (?P=name) -->)", re.S)


def splice(document: str, blocks: Mapping[str, Callable[[], str]]) -> str:
    """`document` with each generated block's body replaced; unknown block names raise."""

    def repl(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in blocks:
            raise KeyError(f"no generator for block {name!r}")
        return f"{match.group(1)}{blocks[name]().rstrip()}\n{match.group(4)}"

    return _BLOCK.sub(repl, document)


def block_names(document: str) -> list[str]:
    return [m.group("name") for m in _BLOCK.finditer(document)]
