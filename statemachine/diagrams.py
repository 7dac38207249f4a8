"""Diagrams of the tables: DOT and Mermaid sources written from the rows, SVG where
graphviz's `dot` is installed.

Never drawn by hand: `render` derives every file from `spec`, and `kvspec diagrams --check`
compares the committed sources with what the tables give now. An SVG carries the hash of the
DOT source it was rendered from, so the check tells a stale SVG apart without comparing its
bytes (which differ between graphviz versions). Edges are coloured by path (happy, preempt,
finish, reset, failure, timeout); states vLLM 0.33.0 lacks are dashed; a legend says so.
Guards appear on the edges as ``trigger [guard & !guard]``.
"""

from __future__ import annotations

import hashlib
import html
import re
import shutil
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any

import graphviz

from spec.schema import MachineSpec, Path, Transition

EDGE_STYLE: dict[Path, dict[str, str]] = {
    Path.HAPPY: {"color": "black", "fontcolor": "black", "style": "solid"},
    Path.PREEMPT: {"color": "royalblue3", "fontcolor": "royalblue4", "style": "solid"},
    Path.FINISH: {"color": "forestgreen", "fontcolor": "darkgreen", "style": "solid"},
    Path.RESET: {"color": "darkorange2", "fontcolor": "darkorange4", "style": "dashed"},
    Path.FAILURE: {"color": "firebrick3", "fontcolor": "firebrick4", "style": "dashed"},
    Path.TIMEOUT: {"color": "purple3", "fontcolor": "purple4", "style": "dotted"},
}
_PRIORITY = [Path.HAPPY, Path.FINISH, Path.PREEMPT, Path.RESET, Path.TIMEOUT, Path.FAILURE]

_LEGEND_TEXT = {
    Path.HAPPY: "happy path",
    Path.PREEMPT: "preemption / flush",
    Path.FINISH: "finish, abort, cleanup",
    Path.RESET: "reset_cache",
    Path.FAILURE: "failure (beyond vLLM)",
    Path.TIMEOUT: "timeout (beyond vLLM)",
}
_STROKE = {"solid": "━━━", "dashed": "╍╍╍", "dotted": "┄┄┄"}

INSTALL_HINT = "graphviz's `dot` is not installed (Debian: apt-get install -y graphviz)"


def have_dot() -> bool:
    """Whether graphviz's `dot` binary is on PATH (SVGs need it; the sources do not)."""
    return shutil.which("dot") is not None


def edge_label(t: Transition) -> str:
    return f"{t.trigger} [{t.guard_text}]" if t.guard_text else t.trigger


def _legend_label(spec: MachineSpec) -> str:
    used = {t.path for t in spec.transitions}
    rows = "".join(
        f'<TR><TD><FONT COLOR="{EDGE_STYLE[p]["color"]}">{_STROKE[EDGE_STYLE[p]["style"]]}'
        f'</FONT></TD><TD ALIGN="LEFT">{_LEGEND_TEXT[p]}</TD></TR>'
        for p in _PRIORITY if p in used)
    rows += ('<TR><TD BORDER="1" STYLE="dashed,rounded" BGCOLOR="lightyellow"> </TD>'
             '<TD ALIGN="LEFT">state beyond vLLM 0.33.0</TD></TR>')
    rows += ('<TR><TD><FONT COLOR="gray40">↺</FONT></TD><TD ALIGN="LEFT">stays in the state; '
             'label colour gives the path</TD></TR>')
    rows += ('<TR><TD><TABLE BORDER="1" CELLBORDER="1" CELLSPACING="2" CELLPADDING="1">'
             '<TR><TD> </TD></TR></TABLE></TD><TD ALIGN="LEFT">final state (double border)'
             '</TD></TR>')
    rows += ('<TR><TD>[g &amp; !h]</TD><TD ALIGN="LEFT">guards: g must hold, h must not</TD>'
             '</TR>')
    return (f'<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="2"><TR><TD COLSPAN="2">'
            f'<B>Legend</B></TD></TR>{rows}</TABLE>>')


def _node_attrs(spec: MachineSpec, name: str) -> dict[str, str]:
    state = spec.state(name)
    attrs: dict[str, str] = {}
    if state.beyond_vllm:
        attrs.update(style="dashed,rounded,filled", fillcolor="lightyellow")
    if name in spec.finals:
        attrs["peripheries"] = "2"
    elif name == spec.initial:
        attrs["penwidth"] = "2"
    return attrs


def to_graphviz(spec: MachineSpec) -> graphviz.Digraph:
    """The table as a graphviz Digraph: one edge per (source, destination, path) with its
    rows' labels stacked, one loop per state that stays, and a legend."""
    g = graphviz.Digraph(spec.name, graph_attr={
        "label": spec.title, "labelloc": "t", "fontname": "Helvetica", "fontsize": "18",
        "rankdir": "TB", "nodesep": "0.5", "ranksep": "0.6"})
    g.attr("node", shape="rectangle", style="rounded,filled", fillcolor="white",
           fontname="Helvetica", fontsize="11")
    g.attr("edge", fontname="Helvetica", fontsize="9")
    for name in spec.state_names:
        g.node(name, name, **_node_attrs(spec, name))
    labels: dict[tuple[str, str, Path], list[str]] = {}
    for src, dst, t in spec.edges():
        texts = labels.setdefault((src, dst, t.path), [])
        if edge_label(t) not in texts:
            texts.append(edge_label(t))
    loops: dict[str, list[tuple[str, Path]]] = {}
    for (src, dst, path), texts in labels.items():
        if src == dst:  # several loops on one node would overlap: draw one
            loops.setdefault(src, []).extend((t, path) for t in texts)
            continue
        g.edge(src, dst, label="\\l".join(texts) + "\\l", **EDGE_STYLE[path])
    for node, entries in loops.items():
        rows = "".join(f'<TR><TD ALIGN="LEFT"><FONT COLOR="{EDGE_STYLE[p]["fontcolor"]}">'
                       f"{html.escape(t)}</FONT></TD></TR>" for t, p in entries)
        g.edge(node, node, color="gray40", style="solid",
               label=f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="0">{rows}</TABLE>>')
    with g.subgraph(name="cluster_legend") as legend:
        legend.attr(label="", color="white", rank="sink")
        legend.node("legend", label=_legend_label(spec), shape="plaintext")
    return g


def to_mermaid(spec: MachineSpec) -> str:
    """A Mermaid stateDiagram of the table: one edge per (source, destination), its rows'
    labels joined by ``|``, the beyond-vLLM states classed apart."""
    lines = ["---", spec.title, "---", "stateDiagram-v2", "  direction LR", ""]
    lines += [f'  state "{name}" as {name}' for name in spec.state_names]
    lines.append("")
    labels: dict[tuple[str, str], list[str]] = {}
    for src, dst, t in spec.edges():
        texts = labels.setdefault((src, dst), [])
        if edge_label(t) not in texts:
            texts.append(edge_label(t))
    lines += [f"  {src} --> {dst}: {' | '.join(texts)}" for (src, dst), texts in labels.items()]
    lines.append(f"  [*] --> {spec.initial}")
    beyond = [s.name for s in spec.states if s.beyond_vllm]
    if beyond:
        lines.append("  classDef beyond fill:#ffffe0,stroke-dasharray: 5 5")
        lines += [f"  class {name} beyond" for name in beyond]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Rendered:
    path: FsPath
    content: bytes


_SOURCE_MARK = re.compile(rb"<!-- kvspec dot source sha256 ([0-9a-f]{64}) -->\n")


def source_hash(dot_source: str) -> str:
    return hashlib.sha256(dot_source.encode()).hexdigest()


def svg_of(dot_source: str, graph: Any) -> bytes:
    """The SVG `dot` renders from `graph`, stamped with its source's hash instead of the
    graphviz version (which `dot` writes in a comment)."""
    svg: bytes = graph.pipe(format="svg")
    svg = re.sub(rb"<!-- Generated by graphviz version [^>]*-->\n", b"", svg)
    mark = f"<!-- kvspec dot source sha256 {source_hash(dot_source)} -->\n".encode()
    head, sep, rest = svg.partition(b"<svg")
    return head + mark + sep + rest


def svg_source_hash(svg: bytes) -> str | None:
    """The hash of the DOT source an SVG of ours was rendered from (None: not ours)."""
    m = _SOURCE_MARK.search(svg)
    return m.group(1).decode() if m else None


def sources(spec: MachineSpec, out_dir: FsPath) -> list[Rendered]:
    """The text files of a table's diagrams: its DOT and Mermaid sources."""
    return [Rendered(out_dir / f"{spec.name}.dot", to_graphviz(spec).source.encode()),
            Rendered(out_dir / f"{spec.name}.mmd", to_mermaid(spec).encode())]


def svg(spec: MachineSpec, out_dir: FsPath) -> Rendered:
    """The table's SVG (needs `dot`: see `have_dot`)."""
    graph = to_graphviz(spec)
    return Rendered(out_dir / f"{spec.name}.svg", svg_of(graph.source, graph))


def counterexample_graph(ce: Any) -> graphviz.Digraph:
    """The counterexample's path drawn over the request and job machines: every table edge
    in grey, the edges the trace took in red, labelled with the step numbers. A lasso
    (liveness) draws its cycle's edges in blue, and the path of events beside the machines,
    its last step looping back to where the cycle starts."""
    from spec import MACHINES

    cycle_start: int | None = ce.cycle_start

    def in_cycle(n: int) -> bool:
        return cycle_start is not None and n > cycle_start

    taken: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
    for n, step in enumerate(ce.steps, 1):
        for machine, key, src, dst, trigger in step.moves:
            who = "" if key == -1 else f" {key}"  # -1: a job not yet numbered
            taken.setdefault((machine, src, dst), []).append((n, f"{n}: {trigger}{who}"))
    size = (f"{len(ce.steps)} steps" if cycle_start is None
            else f"{cycle_start} steps, then a cycle of {len(ce.steps) - cycle_start}")
    g = graphviz.Digraph("counterexample", graph_attr={
        "label": f"counterexample ({ce.kind}, {size}): {ce.summary}"[:160],
        "labelloc": "t", "fontname": "Helvetica", "rankdir": "TB", "compound": "true"})
    g.attr("node", shape="rectangle", style="rounded", fontname="Helvetica", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="9")
    for spec in MACHINES:
        if spec.name not in ("request", "job"):
            continue
        with g.subgraph(name=f"cluster_{spec.name}") as c:
            c.attr(label=spec.title, color="gray60")
            for state in spec.state_names:
                c.node(f"{spec.name}.{state}", state)
            drawn: set[tuple[str, str]] = set()
            for src, dst, _t in spec.edges():
                if (src, dst) in drawn:
                    continue
                drawn.add((src, dst))
                labels = taken.get((spec.name, src, dst))
                if labels:
                    color = "blue" if all(in_cycle(n) for n, _ in labels) else "red"
                    c.edge(f"{spec.name}.{src}", f"{spec.name}.{dst}",
                           label="\\l".join(t for _, t in labels) + "\\l", color=color,
                           fontcolor=color, penwidth="2.5")
                else:
                    c.edge(f"{spec.name}.{src}", f"{spec.name}.{dst}", color="gray85")
    if cycle_start is not None:
        with g.subgraph(name="cluster_lasso") as c:
            c.attr(label="the lasso: the prefix, then the cycle (blue) forever",
                   color="gray60")
            c.node("lasso.0", "initial state")
            for n, step in enumerate(ce.steps, 1):
                color = "blue" if in_cycle(n) else "black"
                c.node(f"lasso.{n}", f"after {n}", color=color)
                c.edge(f"lasso.{n - 1}", f"lasso.{n}", label=f"{n}: {step.event}",
                       color=color, fontcolor=color)
            c.edge(f"lasso.{len(ce.steps)}", f"lasso.{cycle_start}",
                   label="repeats forever", color="blue", fontcolor="blue", style="dashed")
    return g
