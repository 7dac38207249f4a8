"""Diagrams of the tables, drawn through transitions' GraphMachine (graphviz and mermaid).

Never drawn by hand: `render_all` derives every file from `spec`, and `check` compares the
committed files with what the tables give now. Edges are coloured by path (happy, preempt,
finish, reset, failure, timeout); states vLLM 0.33.0 lacks are dashed; a legend says so.
Guards appear on the edges as ``trigger [guard & !guard]``.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import Any, Literal

from transitions.extensions import GraphMachine

from spec.schema import SAME, MachineSpec, Path, guard_name, guard_negated

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


class _Subject:
    """A stand-in model: GraphMachine needs one to draw; it never moves."""

    state: str


def _graph_machine(spec: MachineSpec, engine: Literal["graphviz", "mermaid"]) -> Any:
    machine = GraphMachine(
        model=_Subject(),
        states=list(spec.state_names),
        initial=spec.initial,
        auto_transitions=False,
        show_conditions=True,
        graph_engine=engine,
        title=spec.title,
    )
    for t in spec.transitions:
        machine.add_transition(
            t.trigger, list(t.sources), "=" if t.dest == SAME else t.dest,
            conditions=[g for g in t.guards if not guard_negated(g)],
            unless=[guard_name(g) for g in t.guards if guard_negated(g)],
        )
    return machine


def _legend_label(spec: MachineSpec) -> str:
    used = {t.path for t in spec.transitions}
    rows = "".join(
        f'<TR><TD><FONT COLOR="{EDGE_STYLE[p]["color"]}">'
        f'{"━━━" if EDGE_STYLE[p]["style"] == "solid" else "╍╍╍" if EDGE_STYLE[p]["style"] == "dashed" else "┄┄┄"}'  # noqa: E501
        f'</FONT></TD><TD ALIGN="LEFT">{_LEGEND_TEXT[p]}</TD></TR>'
        for p in _PRIORITY if p in used
    )
    rows += ('<TR><TD BORDER="1" STYLE="dashed,rounded" BGCOLOR="lightyellow"> </TD>'
             '<TD ALIGN="LEFT">state beyond vLLM 0.33.0</TD></TR>')
    rows += ('<TR><TD><FONT COLOR="gray40">↺</FONT></TD><TD ALIGN="LEFT">stays in the state; '
             'label colour gives the path</TD></TR>')
    rows += ('<TR><TD><TABLE BORDER="1" CELLBORDER="1" CELLSPACING="2" CELLPADDING="1">'
             '<TR><TD> </TD></TR></TABLE></TD><TD ALIGN="LEFT">final state (double border)'
             '</TD></TR>')
    rows += ('<TR><TD>[g &amp; !h]</TD><TD ALIGN="LEFT">guards: g must hold, h must not</TD>'
             '</TR>')
    return f'<<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="2"><TR><TD COLSPAN="2">' \
           f'<B>Legend</B></TD></TR>{rows}</TABLE>>'


def _stacked_graph_cls(base: type, spec: MachineSpec) -> type:
    """transitions' graphviz Graph, drawing one edge per (source, destination, path) with its
    labels stacked, so that every edge has the style of its own path."""
    path_of = {(t.trigger, src, t.dest_from(src), frozenset(t.guards)): t.path
               for src, _, t in spec.edges()}

    def guards_of(tr: dict[str, Any]) -> frozenset[str]:
        return frozenset((*tr.get("conditions", []), *("!" + u for u in tr.get("unless", []))))

    class StackedGraph(base):  # type: ignore[misc]
        def _add_edges(self, transitions: list[dict[str, Any]], container: Any) -> None:
            labels: dict[tuple[str, str, Path], list[str]] = {}
            for tr in transitions:
                src, dst = tr["source"], tr.get("dest", tr["source"])
                path = path_of[(tr["trigger"], src, dst, guards_of(tr))]
                label = self._transition_label(tr)
                if label not in labels.setdefault((src, dst, path), []):
                    labels[(src, dst, path)].append(label)
            loops: dict[str, list[tuple[str, Path]]] = {}
            for (src, dst, path), texts in labels.items():
                if src == dst:  # several loops on one node would overlap: draw one
                    loops.setdefault(src, []).extend((t, path) for t in texts)
                    continue
                container.edge(src, dst, label="\\l".join(texts) + "\\l",
                               **EDGE_STYLE[path])
            for node, entries in loops.items():
                rows = "".join(
                    f'<TR><TD ALIGN="LEFT"><FONT COLOR="{EDGE_STYLE[p]["fontcolor"]}">'
                    f"{html.escape(t)}</FONT></TD></TR>" for t, p in entries)
                container.edge(node, node, color="gray40", style="solid",
                               label=f'<<TABLE BORDER="0" CELLSPACING="0" CELLPADDING="0">'
                                     f"{rows}</TABLE>>")

    return StackedGraph


def to_graphviz(spec: MachineSpec) -> Any:
    """A graphviz.Digraph of the table, styled and with its legend."""
    machine = _graph_machine(spec, "graphviz")
    drawer = _stacked_graph_cls(machine.graph_cls, spec)(machine)
    styles: dict[str, dict[str, dict[str, str]]] = {
        "node": dict(machine.style_attributes["node"]),
        "edge": {"default": EDGE_STYLE[Path.HAPPY]},
        "graph": dict(machine.style_attributes["graph"]),
    }
    styles["node"]["beyond"] = {"style": "dashed,rounded,filled", "fillcolor": "lightyellow"}
    styles["node"]["final"] = {"peripheries": "2"}
    styles["node"]["beyond_final"] = {**styles["node"]["beyond"], "peripheries": "2"}
    styles["node"]["initial"] = {"penwidth": "2"}
    machine.style_attributes = styles
    machine.machine_attributes = {
        "directed": "true", "strict": "false", "rankdir": "TB", "nodesep": "0.5",
        "ranksep": "0.6", "fontname": "Helvetica", "labelloc": "t", "fontsize": "18",
    }
    for s in spec.states:
        if s.beyond_vllm:
            drawer.set_node_style(s.name, "beyond_final" if s.name in spec.finals else "beyond")
        elif s.name in spec.finals:
            drawer.set_node_style(s.name, "final")
        elif s.name == spec.initial:
            drawer.set_node_style(s.name, "initial")
    graph = drawer.get_graph(title=spec.title)
    graph.attr("node", fontname="Helvetica", fontsize="11")
    graph.attr("edge", fontname="Helvetica", fontsize="9")
    with graph.subgraph(name="cluster_legend") as legend:
        legend.attr(label="", color="white", rank="sink")
        legend.node("legend", label=_legend_label(spec), shape="plaintext")
    return graph


def to_mermaid(spec: MachineSpec) -> str:
    """Mermaid stateDiagram from transitions' mermaid engine, without its active-state marks
    (a table has no current state), with the beyond-vLLM states classed apart."""
    machine = _graph_machine(spec, "mermaid")
    source: str = machine.get_graph(title=spec.title).source
    lines = [line.rstrip() for line in source.splitlines()
             if not line.lstrip().startswith(("classDef s_", "Class "))]
    beyond = [s.name for s in spec.states if s.beyond_vllm]
    if beyond:
        lines.append("  classDef beyond fill:#ffffe0,stroke-dasharray: 5 5")
        lines.extend(f"  class {name} beyond" for name in beyond)
    return "\n".join(line for i, line in enumerate(lines)
                     if line or (i and lines[i - 1])) + "\n"


@dataclass(frozen=True)
class Rendered:
    path: FsPath
    content: bytes


def render(spec: MachineSpec, out_dir: FsPath) -> list[Rendered]:
    graph = to_graphviz(spec)
    dot_source: str = graph.source
    svg: bytes = graph.pipe(format="svg")
    # graphviz stamps its version in a comment; drop it so a diagram depends on the table only
    svg = re.sub(rb"<!-- Generated by graphviz version [^>]*-->\n", b"", svg)
    return [
        Rendered(out_dir / f"{spec.name}.dot", dot_source.encode()),
        Rendered(out_dir / f"{spec.name}.svg", svg),
        Rendered(out_dir / f"{spec.name}.mmd", to_mermaid(spec).encode()),
    ]


def counterexample_svg(ce: Any) -> bytes:
    """The counterexample's path drawn over the request and job machines: every table edge
    in grey, the edges the trace took in red, labelled with the step numbers."""
    import graphviz

    from spec import MACHINES

    taken: dict[tuple[str, str, str], list[str]] = {}
    for n, step in enumerate(ce.steps, 1):
        for machine, key, src, dst, trigger in step.moves:
            who = "" if key == -1 else f" {key}"  # -1: a job not yet numbered
            taken.setdefault((machine, src, dst), []).append(f"{n}: {trigger}{who}")
    g = graphviz.Digraph("counterexample", graph_attr={
        "label": f"counterexample ({ce.kind}, {len(ce.steps)} steps): {ce.summary}"[:160],
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
                key = (src, dst)
                if key in drawn:
                    continue
                drawn.add(key)
                labels = taken.get((spec.name, src, dst))
                if labels:
                    c.edge(f"{spec.name}.{src}", f"{spec.name}.{dst}",
                           label="\\l".join(labels) + "\\l", color="red", fontcolor="red",
                           penwidth="2.5")
                else:
                    c.edge(f"{spec.name}.{src}", f"{spec.name}.{dst}", color="gray85")
    svg: bytes = g.pipe(format="svg")
    return svg
