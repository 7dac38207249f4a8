"""Each rule in one place: checked on the source, so a second copy fails here.

- Sets of state names that code tests membership of are `spec` data (`StateGroup`): no
  module outside `spec/` writes a tuple, list or set of state names for an `in` test or as a
  named constant.
- `transitions` is used through its public API: no private attribute of a machine, event or
  transition is touched, none of its classes is subclassed, and no machine's models list or
  transition class is replaced.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import spec

ROOT = Path(__file__).resolve().parents[1]
STATE_MODULES = {"R": spec.REQUEST_MACHINE, "J": spec.JOB_MACHINE, "F": spec.FENCE_MACHINE,
                 "W": spec.WORKER_MACHINE}
STATE_NAMES = {s for m in spec.MACHINES for s in m.state_names}


def _sources(*, outside_spec: bool) -> Iterator[Path]:
    for top in ("spec", "statemachine", "kernels", "conformance", "bench", "tests"):
        if outside_spec and top == "spec":
            continue
        yield from sorted((ROOT / top).rglob("*.py"))
    yield ROOT / "kvspec.py"


def _is_state(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        m = STATE_MODULES.get(node.value.id)
        return m is not None and node.attr in m.state_names
    return isinstance(node, ast.Constant) and node.value in STATE_NAMES


def _state_literals(node: ast.AST) -> bool:
    return (isinstance(node, ast.Tuple | ast.List | ast.Set)
            and sum(_is_state(e) for e in node.elts) >= 2)


def state_lists(path: Path) -> list[str]:
    """`x in (R.A, R.B)` tests and module- or class-level constants listing states."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and _state_literals(right):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        if isinstance(node, ast.Module | ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None \
                        and _state_literals(stmt.value):
                    found.append(f"{path.relative_to(ROOT)}:{stmt.lineno}")
    return found


def test_no_module_outside_spec_lists_states_for_membership() -> None:
    found = [hit for p in _sources(outside_spec=True) for hit in state_lists(p)]
    assert found == [], "name the group in spec/ (a StateGroup) and use it: " + ", ".join(found)


def test_the_scan_finds_a_state_list() -> None:
    probe = ROOT / "tests" / "_probe_state_list.py"
    probe.write_text("from spec import request as R\nBUSY = (R.RUNNING, R.STORING)\n"
                     "def f(s):\n    return s in {'IDLE', 'RUNNING'}\n")
    try:
        assert sorted(h.split(":")[1] for h in state_lists(probe)) == ["2", "4"]
    finally:
        probe.unlink()


_TRANSITIONS_CLASSES = {"Machine", "Transition", "Event", "EventData", "State", "Condition",
                        "GraphMachine", "HierarchicalMachine", "LockedMachine"}


def transitions_private_uses(path: Path) -> list[str]:
    text = path.read_text()
    if "transitions" not in text:
        return []
    tree = ast.parse(text, str(path))
    where = str(path.relative_to(ROOT))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                     for b in node.bases}
            if bases & _TRANSITIONS_CLASSES:
                out.append(f"{where}:{node.lineno}: subclasses {sorted(bases)}")
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value).lower()
            touches = any(w in base for w in ("machine", "event", "transition"))
            if touches and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            if touches and node.attr in ("models", "transition_cls") and isinstance(
                    getattr(node, "ctx", None), ast.Store):
                out.append(f"{where}:{node.lineno}: replaces {ast.unparse(node)}")
    return out


def test_transitions_is_used_through_its_public_api_only() -> None:
    found = [hit for p in _sources(outside_spec=False) for hit in transitions_private_uses(p)]
    assert found == []


def test_the_api_scan_finds_a_private_use() -> None:
    probe = ROOT / "tests" / "_probe_transitions.py"
    probe.write_text("from transitions import Machine, Transition\n"
                     "class T(Transition): pass\n"
                     "def f(machine):\n    machine.models = []\n    return machine._process\n")
    try:
        assert len(transitions_private_uses(probe)) == 3
    finally:
        probe.unlink()
