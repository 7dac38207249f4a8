"""`VLLM_SRC=path make conformance`: a vLLM source tree goes ahead of the installed wheel.

A reviewer points VLLM_SRC at a pull request's checkout; the Makefile puts that tree first on
PYTHONPATH, so vLLM's (pure Python) scheduler side is imported from it while the wheel
supplies nothing but the dependencies. These tests stand an unpacked wheel in for such a
checkout (its Python files only: a git checkout has no compiled parts either) and check that

- the tree, not the wheel, is what the tests import (the report header names it);
- the unchanged tree conforms on the PR #48102 trace;
- the same tree with PR #48102 put back (reset_cache no longer clears the requests'
  transfer_jobs) is caught: INV-1 names the request and the stale job id.

The tree comes from `pip download` of the installed release (pip's cache makes that cheap).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.conformance

ROOT = Path(__file__).resolve().parents[2]
TRACE = "arrive(r0) ; step(admit=r0) ; reset() ; step() ; ack(job 0, count 2)"
FIX_48102 = "            status.transfer_jobs.clear()\n"
"""The line of vLLM 0.33.0's `_reset_cache` that is the fix of PR #48102."""

REPLAY = f"""
import sys
from conformance import vllm_env
print("imported from", vllm_env.vllm_file(), flush=True)
from conformance.adapter import machine_for
from statemachine.testing import replay
from spec.model import parse_events
from tests.conformance.test_machine import B0
replay(parse_events({TRACE!r}), B0, machine_for(vllm_env.vllm_version()))
print("conforms", flush=True)
"""


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed release's Python tree, unpacked from its wheel (no compiled files)."""
    version = importlib.metadata.version("vllm")
    if version.split(".")[:2] != ["0", "33"]:
        pytest.skip(f"the #48102 patch below is written against 0.33's source ({version})")
    base = tmp_path_factory.mktemp("vllm-src")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    f"vllm=={version}", "-d", str(base / "wheel")], check=True)
    [wheel] = list((base / "wheel").glob("vllm-*.whl"))
    tree = base / "tree"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tree, members=[n for n in z.namelist()
                                    if n.startswith("vllm/") and not n.endswith(".so")])
    return tree


def _replay_from(tree: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(tree), VLLM_SRC=str(tree))  # what the Makefile sets
    return subprocess.run([sys.executable, "-c", REPLAY], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=600)


def test_the_source_tree_is_imported_and_conforms(source_tree: Path) -> None:
    run = _replay_from(source_tree)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"imported from {source_tree / 'vllm' / '__init__.py'}" in run.stdout, run.stdout
    assert "conforms" in run.stdout


def test_a_tree_with_pr_48102_undone_is_caught(source_tree: Path, tmp_path: Path) -> None:
    scheduler = Path("vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py")
    text = (source_tree / scheduler).read_text()
    assert text.count(FIX_48102) == 1, "the 0.33 fix of PR #48102 moved: update FIX_48102"
    broken = tmp_path / "tree"
    _copy_tree(source_tree / "vllm", broken / "vllm", skip=scheduler)
    (broken / scheduler).write_text(text.replace(FIX_48102, "            pass\n"))
    run = _replay_from(broken)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "INV-1" in out and "r0" in out, out[-3000:]


def _copy_tree(src: Path, dst: Path, skip: Path) -> None:
    """Hard links where possible (the tree is ~170 MB), `skip` left for the caller."""
    for path in src.rglob("*"):
        rel = path.relative_to(src.parent)
        target = dst.parent / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif rel != skip:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                target.write_bytes(path.read_bytes())


def test_a_vllm_src_run_tests_that_tree() -> None:
    """Under `VLLM_SRC=path make conformance`, every test here ran against that tree."""
    src = os.environ.get("VLLM_SRC")
    if not src:
        pytest.skip("not a VLLM_SRC run")
    from conformance import vllm_env

    assert Path(vllm_env.vllm_file()).resolve().is_relative_to(Path(src).resolve())
