"""Every file derived from the tables: the diagrams, SPEC.md's tables, the README's diagram.

`derived(root)` computes the text ones in memory (DOT, Mermaid, the documents); `write`
puts them on disk and renders the SVGs where `dot` is installed; `stale` lists the committed
files that differ (what `kvspec diagrams --check` reports): text by content, an SVG by the
hash of the DOT source it was rendered from, never by its bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from spec import MACHINES, REQUEST_MACHINE, vllm
from spec import render as md
from spec.schema import MachineSpec
from spec.tiering import TIERING_MACHINES
from statemachine.diagrams import have_dot, source_hash, svg_source_hash, to_graphviz, to_mermaid
from statemachine.diagrams import sources as diagram_sources
from statemachine.diagrams import svg as render_svg

if TYPE_CHECKING:
    from statemachine.mutants import Mutant

Blocks = dict[str, Callable[[], str]]

DIAGRAM_SETS: tuple[tuple[tuple[MachineSpec, ...], str], ...] = (
    (MACHINES, "diagrams"),
    (TIERING_MACHINES, "diagrams/tiering"),
)
"""Each group of tables and the folder its diagrams go to: the connector's lifecycles, and
the tiering ones (the CPU tier and the secondary tiers) apart."""


def _drawn() -> list[tuple[MachineSpec, str]]:
    return [(m, folder) for machines, folder in DIAGRAM_SETS for m in machines]


def _spec_md_blocks() -> Blocks:
    blocks: Blocks = {
        "vllm.files": vllm.legend,
        "invariants": md.invariants_table,
        "progress": md.progress_table,
        "fairness": md.fairness_table,
        "equivalents": md.equivalents_table,
        "mutants": mutants_table,
        "tiering.invariants": md.tiering_invariants_table,
        "tiering.progress": md.tiering_progress_table,
    }
    for m, _ in _drawn():
        blocks[f"{m.name}.states"] = partial(md.states_table, m)
        blocks[f"{m.name}.transitions"] = partial(md.transitions_table, m)
        blocks[f"{m.name}.guards"] = partial(md.guards_effects_table, m)
        if m.groups:
            blocks[f"{m.name}.groups"] = partial(md.groups_table, m)
    # every citation of vLLM in a generated table links to its lines at the tag
    return {name: _linked(fn) for name, fn in blocks.items()}


def _linked(fn: Callable[[], str]) -> Callable[[], str]:
    return lambda: vllm.linkify(fn())


def mutants_table() -> str:
    """Mutant, what catches it, the shortest counterexample (breadth-first, deterministic)."""
    from spec.scenarios import hunt_bounds
    from statemachine.checker import check
    from statemachine.mutants import MUTANTS

    rows = ["| mutant | area | stands for | caught by the checker | caught by the tests |",
            "|---|---|---|---|---|"]
    for m in MUTANTS:
        if m.model_fault is not None:
            r = check(hunt_bounds(m.model_fault), frozenset([m.model_fault]))
            ce = r.counterexample
            size = (f"{len(ce.prefix)} steps to a cycle of {len(ce.cycle)}"
                    if ce is not None and ce.cycle_start is not None else f"{len(ce or ())} steps")
            what = str(ce.violations[0]) if ce is not None and ce.violations else \
                (ce.summary if ce is not None else "")
            checker = (f"{r.verdict}, {size}, {r.states} states: {what.split(' (')[0]}"
                       if ce else "**not caught**")
            tests = "model-based replay of that counterexample"
            if m.data_plane_models:
                tests += f"; the byte oracle of {_simulate_runs(m)}"
            tests += _soaked(m)
        else:
            checker = "not expressible in the abstract model"
            tests = (f"byte oracle (kernel round trip; {_simulate_runs(m)})"
                     if m.area == "kernels" else "model-based random search")
            if m.data_plane_models and m.area != "kernels":
                tests += f"; {_simulate_runs(m)}"
            tests += _soaked(m)
        rows.append(f"| `{m.name}` | {m.area} | {m.stands_for} | {checker} | {tests} |")
    return "\n".join(rows)


def _soaked(m: Mutant) -> str:
    if not m.data_plane_soak:
        return ""
    return ("; the data-plane soak ("
            + " or ".join(f"`{name}`" for name in m.data_plane_soak) + "'s engine)")


def _simulate_runs(m: Mutant) -> str:
    return " and ".join(f"`kvspec simulate --model {name}`" for name in m.data_plane_models)


def _readme_blocks() -> Blocks:
    return {"request.mermaid": lambda: f"```mermaid\n{to_mermaid(REQUEST_MACHINE)}```"}


def _conformance_md_blocks() -> Blocks:
    from conformance import releases

    return {"releases.features": lambda: vllm.linkify(releases.feature_table())}


def derived(root: Path) -> dict[Path, bytes]:
    """Every text file derived from the tables: DOT and Mermaid sources, and the documents
    with their generated blocks spliced in."""
    out: dict[Path, bytes] = {}
    for m, folder in _drawn():
        for r in diagram_sources(m, root / folder):
            out[r.path] = r.content
    for doc, blocks in ((root / "spec" / "SPEC.md", _spec_md_blocks()),
                        (root / "README.md", _readme_blocks()),
                        (root / "CONFORMANCE.md", _conformance_md_blocks())):
        if doc.exists():
            text = doc.read_text()
            out[doc] = md.splice(text, blocks).encode()
    return out


def stale_svgs(root: Path) -> list[Path]:
    """SVGs missing, or rendered from another DOT source than the tables give now."""
    out = []
    for m, folder in _drawn():
        path = root / folder / f"{m.name}.svg"
        dot = to_graphviz(m).source
        if not path.exists() or svg_source_hash(path.read_bytes()) != source_hash(dot):
            out.append(path)
    return out


def write(root: Path) -> tuple[list[Path], list[Path]]:
    """Write what changed: (files written, SVGs left stale because `dot` is missing)."""
    changed = []
    for path, content in derived(root).items():
        if not path.exists() or path.read_bytes() != content:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            changed.append(path)
    stale = stale_svgs(root)
    if not have_dot():
        return changed, stale
    for path in stale:
        machine = next(m for m, folder in _drawn()
                       if path == root / folder / f"{m.name}.svg")
        r = render_svg(machine, path.parent)
        r.path.write_bytes(r.content)
        changed.append(r.path)
    return changed, []


def stale(root: Path) -> list[Path]:
    """Committed files that differ from what the tables give (SVGs by their source hash)."""
    return [p for p, c in derived(root).items()
            if not p.exists() or p.read_bytes() != c] + stale_svgs(root)
