"""The abstract model's values: `Bounds` as a dict key and a pickle (its cached templates and
hash stay out of both), and the events `spec.model.events` offers (none that needs a spent
budget; `apply` refuses the same ones)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest

from spec import model as M

CACHED = M.Bounds._CACHED
"""What `Bounds` caches (its own list, which `__getstate__` leaves out)."""


def test_bounds_cache_their_templates_and_hash_outside_eq_copies_and_pickles() -> None:
    b = M.Bounds(requests=2, groups=("full", "sliding"), sliding_window=2)
    assert [t.req_id for t in b.templates()] == ["r0", "r1"] and hash(b)
    assert b.template("r1").family == 0  # one shared prefix
    assert all(name in b.__dict__ for name in CACHED)
    other = dataclasses.replace(b, requests=3)  # a new value: its own templates
    assert other != b and [t.req_id for t in other.templates()] == ["r0", "r1", "r2"]
    same = dataclasses.replace(b)
    assert same == b and hash(same) == hash(b) and {b: 1}[same] == 1
    copy = pickle.loads(pickle.dumps(b))
    assert not any(name in copy.__dict__ for name in CACHED)
    assert copy == b and hash(copy) == hash(b) and copy.template("r1") == b.template("r1")


def test_a_bounds_pickled_after_hashing_hashes_afresh_in_another_interpreter() -> None:
    """A string's hash differs from one interpreter to the next: a cached hash carried over
    would put the bounds (and every state holding them) in the wrong slot there."""
    b = M.Bounds(groups=("full", "mamba"))
    hash(b)
    code = ("import dataclasses, pickle, sys; b = pickle.loads(sys.stdin.buffer.read()); "
            "print(hash(b) == hash(dataclasses.replace(b)) and {b: 1}["
            "dataclasses.replace(b)] == 1)")
    env = {**os.environ, "PYTHONHASHSEED": str(hash("seed") % 1000 + 1)}
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(b), env=env,
                         capture_output=True, check=True).stdout
    assert out.strip() == b"True"


def _budget_events(s: M.ModelState) -> set[str]:
    return {ev.kind + ("-failed" if ev.failed else "") for ev in M.events(s)
            if ev.kind in ("reset", "preempt") or ev.failed}


def test_no_event_offered_needs_a_spent_budget_and_apply_refuses_the_same() -> None:
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                 failures=1, preemptions=1)
    s, _, _ = M.apply(M.initial(b), M.Event("arrive", "r0"))
    s, _, _ = M.apply(s, M.Event("step", "r0"))
    store = next(j for j in s.jobs if j.kind == "store")
    assert _budget_events(s) == {"reset", "preempt", "report-failed"}
    spent, _, _ = M.apply(s, M.Event("report", job=store.id, count=1, failed=True))
    assert "report-failed" not in _budget_events(spent)
    spent, _, _ = M.apply(spent, M.Event("preempt", "r0"))
    spent, _, _ = M.apply(spent, M.Event("reset"))
    assert spent.budget == (1, 1, 1) and _budget_events(spent) == set()
    with pytest.raises(M.NotEnabled, match="reset budget"):
        M.apply(spent, M.Event("reset"))
