"""Every file derived from the tables: the diagrams, SPEC.md's tables, the README's diagram.

`derived(root)` computes them all in memory; `write` puts them on disk; `stale` lists those
whose committed content differs (what `kvspec diagrams --check` reports).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from spec import MACHINES, REQUEST_MACHINE
from spec import render as md
from statemachine.diagrams import render as render_diagrams
from statemachine.diagrams import to_mermaid

Blocks = dict[str, Callable[[], str]]


def _spec_md_blocks() -> Blocks:
    blocks: Blocks = {
        "invariants": md.invariants_table,
        "progress": md.progress_table,
        "mutants": mutants_table,
    }
    for m in MACHINES:
        blocks[f"{m.name}.states"] = partial(md.states_table, m)
        blocks[f"{m.name}.transitions"] = partial(md.transitions_table, m)
        blocks[f"{m.name}.guards"] = partial(md.guards_effects_table, m)
    return blocks


def mutants_table() -> str:
    """Mutant, what catches it, the shortest counterexample (breadth-first, deterministic)."""
    from spec.checker import check_model
    from statemachine.check_cli import mutant_bounds
    from statemachine.mutants import MUTANTS

    rows = ["| mutant | area | stands for | caught by the checker | caught by the tests |",
            "|---|---|---|---|---|"]
    for m in MUTANTS:
        if m.model_fault is not None:
            r = check_model(mutant_bounds(m.name), frozenset([m.model_fault]))
            ce = r.counterexample
            checker = (f"{ce.kind}, {len(ce)} steps, {r.states} states: "
                       f"{ce.summary.split(' (')[0]}" if ce else "**not caught**")
            tests = "model-based replay of that counterexample"
        else:
            checker = "not expressible in the abstract model"
            tests = ("byte oracle (kernel round trip)" if m.area == "kernels"
                     else "model-based random search")
        rows.append(f"| `{m.name}` | {m.area} | {m.stands_for} | {checker} | {tests} |")
    return "\n".join(rows)


def _readme_blocks() -> Blocks:
    return {"request.mermaid": lambda: f"```mermaid\n{to_mermaid(REQUEST_MACHINE)}```"}


def derived(root: Path) -> dict[Path, bytes]:
    out: dict[Path, bytes] = {}
    for m in MACHINES:
        for r in render_diagrams(m, root / "diagrams"):
            out[r.path] = r.content
    for doc, blocks in ((root / "spec" / "SPEC.md", _spec_md_blocks()),
                        (root / "README.md", _readme_blocks())):
        if doc.exists():
            text = doc.read_text()
            out[doc] = md.splice(text, blocks).encode()
    return out


def write(root: Path) -> list[Path]:
    changed = []
    for path, content in derived(root).items():
        if not path.exists() or path.read_bytes() != content:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            changed.append(path)
    return changed


def stale(root: Path) -> list[Path]:
    return [p for p, c in derived(root).items() if not p.exists() or p.read_bytes() != c]
