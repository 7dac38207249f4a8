"""`VLLM_SRC=path make conformance`: a vLLM source tree goes ahead of the installed wheel.

A reviewer points VLLM_SRC at a pull request's checkout; the Makefile puts that tree first on
PYTHONPATH, so vLLM's (pure Python) scheduler side is imported from it while the wheel
supplies nothing but the dependencies. These tests stand an unpacked wheel in for such a
checkout (its Python files only: a git checkout has no compiled parts either) and check that

- the tree, not the wheel, is what the tests import (the report header names it);
- the unchanged tree gives the release's verdict on the PR #48102 trace: it conforms where the
  release has the fix (0.26+), INV-1 where it has the bug (0.22-0.25);
- the same tree with PR #48102 put back (reset_cache no longer clears the requests'
  transfer_jobs) is caught: INV-1 names the request and the stale job id (releases with the
  fix);
- under `VLLM_SRC=path make conformance`, every vLLM module the run imported comes from that
  tree (`test_a_vllm_src_run_tests_that_tree`), and that check itself fails on a run that
  names a tree but imports the wheel.

The tree comes from `pip download` of the installed release (pip's cache makes that cheap).
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.conformance import early

pytestmark = pytest.mark.conformance

TRACE = "arrive(r0) ; step(admit=r0) ; reset() ; step() ; ack(job 0, count 2)"
FIX_48102 = "            status.transfer_jobs.clear()\n"
"""The line of `reset_cache` that is the fix of PR #48102 (the same from 0.26.0,
S@0.26.0:1345, to 0.33.0, S:2432)."""

REPLAY = f"""
import sys
from conformance import vllm_env
print("imported from", vllm_env.vllm_file(), flush=True)
from tests.conformance.test_vllm_src import test_a_vllm_src_run_tests_that_tree
test_a_vllm_src_run_tests_that_tree()
print("VLLM_SRC check passed", flush=True)
from conformance.adapter import machine_for
from statemachine.testing import replay
from spec.model import parse_events
from tests.conformance.test_machine import B0
replay(parse_events({TRACE!r}), B0, machine_for(vllm_env.vllm_version()))
print("conforms", flush=True)
"""


@functools.cache
def _source_tree() -> Path:
    """The installed release's Python tree, unpacked from its wheel (no compiled files)."""
    version = importlib.metadata.version("vllm")
    base = Path(tempfile.mkdtemp(prefix="kvspec-vllm-src-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    f"vllm=={version}", "-d", str(base / "wheel")], check=True)
    [wheel] = list((base / "wheel").glob("vllm-*.whl"))
    tree = base / "tree"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tree, members=[n for n in z.namelist()
                                    if n.startswith("vllm/") and not n.endswith(".so")])
    return tree


SCHEDULER = Path("vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py")


@functools.cache
def _tree_with_the_fix_undone() -> Path:
    """The same tree with PR #48102 put back: reset_cache no longer clears transfer_jobs."""
    tree = _source_tree()
    text = (tree / SCHEDULER).read_text()
    assert text.count(FIX_48102) == 1, "the fix of PR #48102 moved: update FIX_48102"
    broken = tree.parent / "undone"
    _copy_tree(tree / "vllm", broken / "vllm", skip=SCHEDULER)
    (broken / SCHEDULER).write_text(text.replace(FIX_48102, "            pass\n"))
    return broken


def _replay_from(tree: Path) -> early.Job:
    env = dict(os.environ, PYTHONPATH=str(tree), VLLM_SRC=str(tree))  # what the Makefile sets
    return [sys.executable, "-c", REPLAY], env


def _has_the_fix() -> bool:
    from conformance import vllm_env

    return vllm_env.has("fix_48102")


EARLY_JOBS: early.Jobs = {
    "test_the_source_tree_is_imported_and_conforms":
        lambda: {"src-replay": _replay_from(_source_tree())},
    "test_a_tree_with_pr_48102_undone_is_caught":
        lambda: ({"src-undone-replay": _replay_from(_tree_with_the_fix_undone())}
                 if _has_the_fix() else {}),
    "test_the_vllm_src_check_fails_a_run_that_imports_the_wheel":
        lambda: {"src-replay": _replay_from(_source_tree())},
}
"""Test -> the subprocesses it checks, by key (started early: tests/conformance/early.py)."""


def _run(test: str, key: str) -> subprocess.CompletedProcess[str]:
    return early.result_of(EARLY_JOBS, test, key)


def test_the_source_tree_is_imported_and_conforms() -> None:
    """The unchanged tree, imported ahead of the wheel: the #48102 trace conforms on a
    release with the fix, and shows the bug (INV-1 on r0) on one without it."""
    run = _run("test_the_source_tree_is_imported_and_conforms", "src-replay")
    out = run.stdout + run.stderr
    assert f"imported from {_source_tree() / 'vllm' / '__init__.py'}" in run.stdout, out
    if _has_the_fix():
        assert run.returncode == 0, out
        assert "conforms" in run.stdout
    else:
        assert run.returncode != 0, out
        assert "INV-1" in out and "r0" in out, out[-3000:]


def test_a_tree_with_pr_48102_undone_is_caught() -> None:
    if not _has_the_fix():
        pytest.skip("the release has the #48102 bug already (feature fix_48102, from 0.26.0)")
    run = _run("test_a_tree_with_pr_48102_undone_is_caught", "src-undone-replay")
    out = run.stdout + run.stderr
    assert f"imported from {_tree_with_the_fix_undone() / 'vllm' / '__init__.py'}" \
        in run.stdout, out
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
    """Under `VLLM_SRC=path make conformance`, every test here ran against that tree: vLLM
    and every vLLM module this run imported (the scheduler side among them) come from it."""
    src = os.environ.get("VLLM_SRC")
    if not src:
        pytest.skip("not a VLLM_SRC run")
    from conformance import vllm_env

    tree = Path(src).resolve()
    assert Path(vllm_env.vllm_file()).resolve().is_relative_to(tree), (
        f"VLLM_SRC={src}, but vllm was imported from {vllm_env.vllm_file()}")
    scheduler = sys.modules[vllm_env.make_setup(num_gpu_blocks=4, num_cpu_chunks=2)
                            .scheduler.__class__.__module__]
    elsewhere = sorted(f"{name} ({mod.__file__})" for name, mod in list(sys.modules.items())
                       if (name == "vllm" or name.startswith("vllm."))
                       and getattr(mod, "__file__", None)
                       and not Path(str(mod.__file__)).resolve().is_relative_to(tree))
    assert not elsewhere, f"VLLM_SRC={src}, but imported from elsewhere: {elsewhere[:5]}"
    assert Path(str(scheduler.__file__)).resolve().is_relative_to(tree), scheduler.__file__


def test_the_vllm_src_check_fails_a_run_that_imports_the_wheel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The VLLM_SRC check tests the tree it names: it passes in the process that has the
    tree ahead of the wheel (the replay's, as the Makefile sets it up), and fails here, a
    run that names the tree but imported the installed wheel."""
    if os.environ.get("VLLM_SRC"):
        pytest.skip("a VLLM_SRC run (this test names a tree of its own)")
    tree = _source_tree()
    good = _run("test_the_vllm_src_check_fails_a_run_that_imports_the_wheel", "src-replay")
    assert "VLLM_SRC check passed" in good.stdout, good.stdout[-3000:] + good.stderr[-2000:]
    monkeypatch.setenv("VLLM_SRC", str(tree))
    with pytest.raises(AssertionError, match=re.escape(
            f"VLLM_SRC={tree}, but vllm was imported from")):
        test_a_vllm_src_run_tests_that_tree()
