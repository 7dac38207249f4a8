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
    }
    for m in MACHINES:
        blocks[f"{m.name}.states"] = partial(md.states_table, m)
        blocks[f"{m.name}.transitions"] = partial(md.transitions_table, m)
        blocks[f"{m.name}.guards"] = partial(md.guards_effects_table, m)
    return blocks


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
