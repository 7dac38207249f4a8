"""Diagrams and generated tables: derived from the tables, readable, and never stale."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import spec
from spec import render
from spec.tiering import TIERING_MACHINES
from statemachine import artifacts, cli, diagrams
from statemachine.diagrams import EDGE_STYLE, to_graphviz, to_mermaid

ROOT = Path(__file__).resolve().parents[1]
ALL_MACHINES = (*spec.MACHINES, *TIERING_MACHINES)

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' missing")


def test_committed_artifacts_are_up_to_date() -> None:
    """Text by content, SVGs by the hash of their DOT source: no `dot` needed."""
    assert [str(p.relative_to(ROOT)) for p in artifacts.stale(ROOT)] == []


def _copy_project(tmp_path: Path) -> Path:
    for sub in ("diagrams", "spec"):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_check_fails_on_a_stale_diagram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    root = str(_copy_project(tmp_path))
    assert cli.main(["diagrams", "--check", "--root", root]) == 0
    (tmp_path / "diagrams" / "job.mmd").write_text("stateDiagram-v2\n")
    assert cli.main(["diagrams", "--check", "--root", root]) == 1
    assert "stale: diagrams/job.mmd" in capsys.readouterr().err
    assert cli.main(["diagrams", "--root", root]) == 0
    assert cli.main(["diagrams", "--check", "--root", root]) == 0


def test_an_svg_drawn_from_another_dot_source_is_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "diagrams" / "fence.svg"
    _copy_project(tmp_path)
    svg.write_bytes(svg.read_bytes().replace(b"sha256 ", b"sha256 0", 1)[:-1])
    assert cli.main(["diagrams", "--check", "--root", str(tmp_path)]) == 1
    assert "stale: diagrams/fence.svg" in capsys.readouterr().err


def test_without_dot_the_commands_say_so_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A machine without graphviz's binary: the check passes (the sources are compared),
    writing renders no SVG and says so, naming the install; a stale SVG it cannot
    render makes it fail, naming the file."""
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    root = str(_copy_project(tmp_path))
    assert cli.main(["diagrams", "--check", "--root", root]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SVGs were not rendered" in err and "apt-get" in err
    assert cli.main(["diagrams", "--root", root]) == 0
    assert "apt-get install -y graphviz" in capsys.readouterr().err
    (tmp_path / "diagrams" / "job.svg").unlink()
    assert cli.main(["diagrams", "--root", root]) == 1
    assert "stale: diagrams/job.svg" in capsys.readouterr().err


@pytest.mark.parametrize("m", ALL_MACHINES, ids=lambda m: m.name)
def test_dot_has_every_state_guarded_edges_styles_and_a_legend(m: spec.MachineSpec) -> None:
    dot = to_graphviz(m).source
    for s in m.state_names:
        assert f"\t{s} [" in dot
    assert "Legend" in dot
    for t in (t for t in m.transitions if t.guard_names):
        label = f"{t.trigger} [{t.guard_text}]"
        assert label in dot.replace("&amp;", "&"), label
    for path in {t.path for t in m.transitions if t.sources != (t.dest,)}:
        if any(src != t.dest_from(src) for t in m.transitions if t.path == path
               for src in t.sources):
            assert f'color={EDGE_STYLE[path]["color"]}' in dot, path


def test_beyond_vllm_states_are_drawn_apart() -> None:
    dot = to_graphviz(spec.REQUEST_MACHINE).source
    line = next(x for x in dot.splitlines() if x.strip().startswith("RECOMPUTE ["))
    assert "dashed" in line and "lightyellow" in line


@needs_dot
@pytest.mark.parametrize("m", ALL_MACHINES, ids=lambda m: m.name)
def test_every_diagram_renders_as_svg(m: spec.MachineSpec) -> None:
    """Where `dot` is installed (CI installs it): each SVG parses, shows every state and
    the legend, and carries the hash of the DOT source it was drawn from."""
    import xml.etree.ElementTree as ET

    folder = ROOT / ("diagrams/tiering" if m in TIERING_MACHINES else "diagrams")
    rendered = diagrams.svg(m, folder)
    root = ET.fromstring(rendered.content)
    assert root.tag.endswith("svg")
    texts = {t.text for t in root.iter() if t.tag.endswith("text")}
    assert set(m.state_names) <= texts and "Legend" in texts
    assert diagrams.svg_source_hash(rendered.content) == \
        diagrams.source_hash(to_graphviz(m).source)


def test_mermaid_lists_every_state_and_edge() -> None:
    text = to_mermaid(spec.REQUEST_MACHINE)
    assert text.splitlines()[3] == "stateDiagram-v2"
    for s in spec.REQUEST_MACHINE.state_names:
        assert f'state "{s}" as {s}' in text
    for src, dst, _ in spec.REQUEST_MACHINE.edges():
        assert f"{src} --> {dst}:" in text
    assert "class RECOMPUTE beyond" in text
    assert "Class " not in text  # no leftover active-state marks


def test_spec_md_holds_every_generated_block() -> None:
    names = render.block_names((ROOT / "spec" / "SPEC.md").read_text())
    for m in ALL_MACHINES:
        for part in ("states", "transitions", "guards", *(("groups",) if m.groups else ())):
            assert f"{m.name}.{part}" in names
    assert {"invariants", "progress", "tiering.invariants", "tiering.progress"} <= set(names)


def test_splice_replaces_only_block_bodies() -> None:
    doc = "intro\n<!-- BEGIN GENERATED: x -->\nold\n<!-- END GENERATED: x -->\noutro\n"
    out = render.splice(doc, {"x": lambda: "new"})
    assert out == "intro\n<!-- BEGIN GENERATED: x -->\nnew\n<!-- END GENERATED: x -->\noutro\n"
    with pytest.raises(KeyError):
        render.splice(doc, {})


def test_transitions_table_lists_every_row_with_its_reference() -> None:
    table = render.transitions_table(spec.JOB_MACHINE)
    assert len(table.splitlines()) == 2 + len(spec.JOB_MACHINE.transitions)
    assert "S:2283-2286" in table and "beyond vLLM" in table


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "```sh"
    assert lines[1].startswith("make demo")
    assert lines[2].startswith("make test")
    assert lines[3] == "```"
    assert "```mermaid" in (ROOT / "README.md").read_text()


def test_every_citation_in_the_documents_links_to_its_lines_at_the_tag() -> None:
    from spec import vllm

    for doc in (ROOT / "spec" / "SPEC.md", ROOT / "CONFORMANCE.md"):
        text = doc.read_text()
        assert vllm.linkify(text) == text, f"{doc.name} has a bare citation"
        assert "blob/v0.33.0/vllm/distributed/kv_transfer/kv_connector/v1/offloading/" \
               "scheduler.py#L" in text


def test_a_citation_of_another_release_names_it_and_links_to_its_tag() -> None:
    from spec import vllm

    old, now = vllm.citations("fixed at S@0.26.0:1345-1346, S:2432 now")
    assert (old.abbr, old.release, old.first, old.last) == ("S", "0.26.0", 1345, 1346)
    assert old.text == "S@0.26.0:1345-1346" and now.text == "S:2432"
    assert now.release == vllm.RELEASE
    assert old.url.endswith("/blob/v0.26.0/vllm/distributed/kv_transfer/kv_connector/v1/"
                            "offloading/scheduler.py#L1345-L1346")
    assert "/blob/v0.33.0/" in now.url
    linked = vllm.linkify("at S@0.25.1:994.")
    assert linked == f"at [S@0.25.1:994]({vllm.Citation('S', 994, 994, '0.25.1').url})."
    assert vllm.linkify(linked) == linked


def test_table_citations_parse() -> None:
    """A row cites vLLM (every part a citation) or says it is beyond vLLM."""
    from spec import vllm
    from spec.schema import BEYOND_VLLM

    for m in spec.MACHINES:
        for t in m.transitions:
            if t.vllm_ref == BEYOND_VLLM:
                continue
            for part in (p.strip() for p in t.vllm_ref.split(",")):
                assert [c.text for c in vllm.citations(part)] == [part], (m.name, t.trigger)


def test_the_documents_state_each_scenarios_pinned_outcome() -> None:
    """Where SPEC.md or the README gives a scenario's count ("`name` ... N states" and
    perhaps ", depth D", before the next scenario's name), it is the one `spec/scenarios.py`
    pins: the counts live there, and a change that moves them moves the prose too."""
    import re

    from spec.scenarios import SCENARIOS

    pinned = {sc.name: sc.expect for sc in SCENARIOS if sc.expect is not None}
    names = "|".join(sorted(map(re.escape, pinned), key=len, reverse=True))
    mention = re.compile(rf"`({names})`")
    outcome = re.compile(r"(\d{1,3}(?:,\d{3})*)\s+states(?:,\s+depth\s+(\d+))?")
    stated, wrong = 0, []
    for doc in (ROOT / "spec" / "SPEC.md", ROOT / "README.md"):
        text = doc.read_text()
        marks = list(mention.finditer(text))
        ends = [after.start() for after in marks[1:]] + [len(text)]  # the next mention
        for m, end in zip(marks, ends, strict=False):  # ends is longer only without a mention
            span = text[m.end():end][:400]
            found = outcome.search(span)
            if found is None:
                continue
            stated += 1
            expect = pinned[m.group(1)]
            says = (int(found.group(1).replace(",", "")),
                    int(found.group(2) or expect.depth))  # the depth, where it is given
            if says != (expect.states, expect.depth):
                wrong.append(f"{doc.name}: {m.group(1)} says {says}, pinned "
                             f"{(expect.states, expect.depth)}")
    assert stated >= 10 and not wrong, (stated, wrong)
