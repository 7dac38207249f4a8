"""The soak driver (`statemachine.soak`): seeded, counted, bounded shrinking, and a failure
reported by its first violation, never by what the teardown drain found afterwards."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from spec import model as M
from spec.regressions import by_name
from spec.rules import VLLM_0_34
from spec.witnesses import all_rows as witness_rows
from statemachine import soak
from statemachine.errors import InvariantViolation
from statemachine.mutants import MUTANTS
from statemachine.mutants import by_name as mutant_by_name
from statemachine.testing import (
    AsyncLoadDataPlaneStateMachine,
    DefaultRetentionHybridDataPlaneStateMachine,
    OffloadingStateMachine,
    WindowDataPlaneStateMachine,
)


def test_a_seed_is_a_reproducible_run_of_counted_steps() -> None:
    a = soak.soak_model(3, 600)
    b = soak.soak_model(3, 600)
    assert a.failures == [] and a.steps >= 600 and a.programs >= 2
    assert (a.steps, a.programs) == (b.steps, b.programs)
    d = soak.soak_data_plane(3, 150)
    assert d.failures == [] and d.steps >= 150


def test_a_model_soak_counts_the_rows_it_fired_and_names_those_it_never_did() -> None:
    """The soak sums the rows the model fired in each program
    (`OffloadingStateMachine.rows_fired`); a seed gives the same counts; the summary names
    every row never fired, so a soak that misses a row says so."""
    r = soak.soak_model(3, 2_000)
    again = soak.soak_model(3, 2_000)
    assert r.rows == again.rows and all(n > 0 for n in r.rows.values())
    assert r.rows["r1"] > 0  # every program's requests arrive (request row 1, add)
    assert soak.SoakResult.from_dict(r.as_dict()).rows == r.rows
    every = witness_rows()
    assert set(r.rows) <= set(every)
    [line] = [x for x in soak.summary([r]).splitlines() if x.startswith("model rows:")]
    never = [row for row in every if row not in r.rows]
    assert line.startswith(f"model rows: {len(every) - len(never)} of {len(every)} fired")
    assert f"never {' '.join(never)};" in line or f"never {' '.join(never)} " in line


def test_programs_seeded_with_witnesses_fire_every_row() -> None:
    """With every program seeded (`witness_every=1`), 99 programs fire all 99 rows: each
    replays its row's witness under the witness's scenario, checks that the row fired, and
    goes on at random; none counts as a random program's coverage."""
    every = witness_rows()
    r = soak.soak_model(5, 40 * len(every), program_length=16, witness_every=1)
    assert r.failures == [] and r.seeded == r.programs >= len(every)
    assert set(r.rows) == set(every) and not r.random_rows
    line = next(x for x in soak.summary([r]).splitlines() if x.startswith("model rows:"))
    assert line.startswith(f"model rows: {len(every)} of {len(every)} fired")
    plain = soak.soak_model(5, 2_000, witness_every=0)
    assert plain.seeded == 0 and plain.rows == plain.random_rows


def test_a_witness_that_misses_its_row_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded program whose witness does not fire its row (the model or the reference
    left the path the witness was found on) fails the soak, naming the row."""
    [first] = [w for w in soak.WITNESSES if w.row == "r1"]
    wrong = dataclasses.replace(first, row="f6")  # arrive(r0) never drains a stray report
    monkeypatch.setattr(soak, "WITNESSES", (wrong,))
    r = soak.soak_model(0, 10, witness_every=1)
    [f] = r.failures
    assert "WitnessMissed" in f.error and "witness of f6" in f.error


def test_a_seeded_fault_is_found_shrunk_and_named_by_its_first_violation() -> None:
    # seed 10's first failing program is 17 events long (the seed only picks one to shrink;
    # which one follows from the bounds the programs draw from); it shrinks to 3: a request
    # admitted, then the reset
    r = soak.soak_model(10, 20_000, shrink_seconds=10, mutant="reset-keeps-transfer-jobs")
    [f] = r.failures
    assert f.render().splitlines()[-1].endswith("--seed 10 --mutant reset-keeps-transfer-jobs")
    first_line = f.render().splitlines()[0]
    assert "InvariantViolation" in first_line and "after reset_cache()" in first_line
    assert "INV-1" in f.error.splitlines()[1]
    assert "drain" not in f.error
    assert "reset()" in f.shrunk and f.shrunk_length <= 5 < f.original_length
    # the shrunk program fails the same way when replayed
    with soak.mutant_on("reset-keeps-transfer-jobs"):
        exc = soak._model_replay(OffloadingStateMachine, _bounds(f.bounds),
                                 M.parse_events(f.shrunk))
    # the #48102 state breaks INV-1 and, its request RUNNING with those ids, INV-24 too
    assert exc is not None and soak.signature(exc) == "InvariantViolation: INV-1 INV-24"


def test_the_data_plane_soak_takes_turns_over_the_models_and_finds_group_faults() -> None:
    """The data-plane programs take turns over one group, a sliding window beside full
    attention, a Mamba group beside it, one group under vLLM 0.34.0's rules, the async-load
    and tight machines, and, at vLLM's default retention (0), a window on every layer, the
    window and Mamba groups beside full attention, and a window narrower than a block on
    every layer: a fault of the per-group copy is found in a program of two groups, by the
    bytes, and named with that machine."""
    assert [(m.kv_model, m.retention_interval, str(m.connector_rules),
             m.sync_load_budget_bytes, m.num_gpu_blocks, m.sliding_window)
            for m in soak.DATA_PLANE_MACHINES] == [
        ("full", None, "0.33", None, None, 6), ("hybrid", None, "0.33", None, None, 6),
        ("mamba", None, "0.33", None, None, 6), ("full", None, str(VLLM_0_34), None, None, 6),
        ("full", None, "0.33", 0, None, 6), ("full", None, str(VLLM_0_34), 0, None, 6),
        ("full", None, "0.33", 0, 10, 6), ("window", 0, "0.33", None, None, 10),
        ("hybrid", 0, "0.33", None, None, 10), ("mamba", 0, "0.33", None, None, 10),
        ("window", 0, "0.33", None, None, 3)]
    r = soak.soak_data_plane(0, 400, shrink_seconds=10, mutant="kernel-copies-into-first-group")
    [f] = r.failures
    machine = soak.DATA_PLANE_MACHINES[f.program % len(soak.DATA_PLANE_MACHINES)]
    assert machine.kv_model != "full" and f.bounds == f"{machine.__name__}'s engine"
    assert f.error.startswith("CorruptedBytes") and "layer 1" in f.error.splitlines()[0]
    assert soak.soak_data_plane(0, 80).failures == []


def test_the_async_load_machines_orphan_and_fail_loads_with_real_bytes() -> None:
    """The machines whose every hit loads asynchronously reach what the others never do
    (their loads are sync): async loads a reset orphans, and failures of such loads that
    arrive after the reset, under both releases' rules. The counts come back in the result
    and its summary; the spec's rule switched off in the reference
    (`stale-load-failure-ignored`) is caught there (the next test)."""
    r = soak.soak_data_plane(0, 24_000)
    assert r.failures == []
    assert r.paths["async_loads_orphaned_by_reset"] > 0
    assert r.paths["stale_loads_failed"] > 0
    assert r.paths["failed_recving_recomputes"] > 0  # 0.34.0's core recomputed one
    assert r.paths["loads_promoted"] > 0 and r.paths["loaded_blocks_verified"] > 0
    assert soak.SoakResult.from_dict(r.as_dict()).paths == r.paths
    [line] = [x for x in soak.summary([r]).splitlines() if x.startswith("data-plane paths:")]
    assert f"stale_loads_failed {r.paths['stale_loads_failed']}" in line


def test_the_default_retention_machines_store_tails_alone_and_load_from_inside_chunks(
        ) -> None:
    """`WindowDataPlaneStateMachine` runs vLLM's default retention (0): over the same 20
    programs its window group stores fewer blocks than the same machine under dense
    retention (only the tails of replay boundaries), the byte oracle checks every block
    either stores and loads, and some loads begin inside a chunk (the kernels' first-chunk
    skip, `loads_inside_a_chunk`)."""
    dense = type("DenseWindow", (WindowDataPlaneStateMachine,), {"retention_interval": None})
    stored = {}
    for machine in (WindowDataPlaneStateMachine, dense):
        rng, paths = random.Random(1), Counter[str]()
        for _ in range(20):
            _, exc = soak._run_actions((), rng, 40, machine, paths)
            assert exc is None, exc
        assert paths["loaded_blocks_verified"] > 0 and paths["loads_inside_a_chunk"] > 0, paths
        stored[machine.retention_interval] = paths["stored_blocks_verified"]
    assert 0 < stored[0] < stored[None], stored


@pytest.mark.parametrize("window", [3, 5, 13])
def test_the_default_retention_machines_hold_at_other_windows(window: int) -> None:
    """The default-retention machines take a window of 10 tokens (2.5 blocks of 4); their
    programs hold at other windows too (no violation, every block the byte oracle checks
    intact): under a block (3), a block and a quarter (5), more than a chunk and a half
    (13), each tail meeting the chunk edges otherwise."""
    for base in (WindowDataPlaneStateMachine, DefaultRetentionHybridDataPlaneStateMachine):
        machine = type(f"{base.__name__}Window{window}", (base,), {"sliding_window": window})
        rng, paths = random.Random(window), Counter[str]()
        for _ in range(12):
            _, exc = soak._run_actions((), rng, 40, machine, paths)
            assert exc is None, exc
        assert paths["loaded_blocks_verified"] > 0, paths


@pytest.mark.parametrize("name, seed, error, says, shrunk_to", [
    ("stale-load-failure-ignored", 0, "EngineError", "a rank failed its load", "reset("),
    ("stale-recving-promotes", 0, "EngineError",
     "its load ended but the connector has it in LOADING_ASYNC", "reset("),
    ("kernel-ignores-first-chunk-skip", 1, "CorruptedBytes", "loaded block", "new_request(")])
def test_the_data_plane_soak_catches_the_mutants_that_say_so(
        name: str, seed: int, error: str, says: str, shrunk_to: str) -> None:
    """The mutants table's claim (`Mutant.data_plane_soak`): the soak's first failure is on
    a machine the mutant names, by the engine or the bytes, shrunk to a shorter program
    that keeps what matters. A reset orphans async loads: those of the async-load machines
    (stale-recving-promotes: in a program that began with its opener, random programs all
    but never reaching the path) and the Mamba hits too large for the sync-load budget, so
    those faults shrink to a program with the reset. The first-chunk skip is caught by the
    machines at vLLM's default retention, whose programs hit often and whose window tails
    load from inside a chunk; a soak over the other seven machines alone did not catch it
    in 60,000 steps on either of two seeds."""
    assert {m.name: m.data_plane_soak for m in MUTANTS if m.data_plane_soak} == {
        "stale-load-failure-ignored": ("AsyncLoadDataPlaneStateMachine",
                                       "TightDataPlaneStateMachine",
                                       "DefaultRetentionMambaDataPlaneStateMachine"),
        "stale-recving-promotes": ("AsyncLoadDataPlaneStateMachine",),
        "kernel-ignores-first-chunk-skip": ("WindowDataPlaneStateMachine",
                                            "DefaultRetentionHybridDataPlaneStateMachine",
                                            "NarrowWindowDataPlaneStateMachine")}
    m = soak.soak_data_plane(seed, 20_000, shrink_seconds=10, mutant=name)
    [f] = m.failures
    machine = soak.DATA_PLANE_MACHINES[f.program % len(soak.DATA_PLANE_MACHINES)]
    assert machine.__name__ in mutant_by_name(name).data_plane_soak
    assert f.error.startswith(error) and says in f.error.splitlines()[0], f.error
    assert shrunk_to in f.shrunk and f.shrunk_length < f.original_length


def test_each_opener_takes_its_path_and_a_soak_counts_the_programs_it_began() -> None:
    """An opener on its machine alone raises its counter; in a soak every
    `OPENER_EVERY`-th turn of that machine begins with it, and the summary names them."""
    for opener in soak.DATA_PLANE_OPENERS:
        paths: Counter[str] = Counter()
        _, exc = soak._run_actions(opener.actions, machine=opener.machine, paths=paths)
        assert exc is None and paths[opener.path] > 0, (opener.name, exc)
    r = soak.soak_data_plane(3, 6_000)
    which = soak.DATA_PLANE_MACHINES.index(AsyncLoadDataPlaneStateMachine)
    turns = len(range(which, r.programs, len(soak.DATA_PLANE_MACHINES)))  # that machine's
    assert r.failures == [] and r.opened["stale-recving"] == -(-turns // soak.OPENER_EVERY)
    assert r.paths["stale_recvings"] >= r.opened["stale-recving"] > 0
    assert soak.SoakResult.from_dict(r.as_dict()).opened == r.opened
    assert f"stale-recving {r.opened['stale-recving']} (stale_recvings)" in soak.summary([r])


def test_an_opener_that_misses_its_path_is_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """An opener that no longer takes its path (the engine or the machine changed under it)
    stops the soak and is named, not shrunk."""
    [real] = soak.DATA_PLANE_OPENERS
    broken = dataclasses.replace(real, actions=real.actions[:7])  # no second request
    monkeypatch.setattr(soak, "DATA_PLANE_OPENERS", (broken,))
    r = soak.soak_data_plane(0, 2_000)
    [f] = r.failures
    assert f.error.startswith("OpenerMissed") and "stale-recving" in f.error
    assert f.shrunk_length == f.original_length == len(broken.actions)


def _bounds(text: str) -> M.Bounds:
    """The bounds a failure prints (their repr), read back."""
    names = {name: getattr(M, name) for name in ("Bounds", "RequestSettings")}
    bounds = eval(text, {"__builtins__": {}}, names)
    assert isinstance(bounds, M.Bounds)
    return bounds


def test_the_teardown_leaves_a_failed_run_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue-10 program under INV-15's old statement: the step raises; the teardown
    must not drain the half-updated implementation and replace that error with its own."""
    import spec.invariants as inv
    from tests.test_regressions import _old_inv15

    monkeypatch.setattr(inv, "SAFETY", tuple(
        i if i.id != "INV-15" else type(i)(i.id, i.name, i.statement, i.vllm_ref, _old_inv15)
        for i in inv.SAFETY))
    reg = by_name("store-block-reused-inside-the-step")
    m = OffloadingStateMachine()
    m.begin(reg.bounds)
    with pytest.raises(InvariantViolation, match="INV-15"):
        for ev in reg.events():
            m._step(ev)
    m.teardown()  # no drain, no second error
    assert isinstance(m.failure, InvariantViolation) and "INV-15" in str(m.failure)


def test_shrinking_keeps_the_failure_and_stops_in_time() -> None:
    def fails(items: list[int]) -> BaseException | None:
        return ValueError("bad pair") if 3 in items and 7 in items else None

    assert soak.shrink(list(range(10)), fails, "ValueError: bad pair", 5.0) == [3, 7]
    assert soak.shrink(list(range(10)), fails, "ValueError: bad pair", 0.0) == list(range(10))


def test_signature_names_the_invariants_or_the_masked_first_line() -> None:
    assert soak.signature(AssertionError("x\nINV-3: a\nINV-1: b")) == \
        "AssertionError: INV-1 INV-3"
    assert soak.signature(KeyError(12)) == "KeyError: N"


def test_a_machine_behind_another_adapter_is_soaked_under_its_own_name() -> None:
    """`soak_model` drives any subclass of the machine (vLLM's in `make conformance-soak`):
    its result and failure carry the name given, the failure the rerun command given, and
    the summary lists that machine beside the project's own."""
    rerun = "make conformance-soak VLLM_VERSION=0.33.0 SEED=2 SOAK_SEEDS=1 VLLM_STEPS=20000"
    r = soak.soak_model(2, 20_000, shrink_seconds=5, mutant="reset-keeps-transfer-jobs",
                        name="vllm", rerun=rerun)
    [f] = r.failures
    assert r.machine == f.machine == "vllm"
    assert f.render().splitlines()[0].startswith("vllm seed 2, program ")
    assert f.render().splitlines()[-1] == f"  rerun: {rerun}"
    mine = soak.soak_model(3, 300)
    rows = soak.summary([mine, r]).splitlines()
    assert [row.split()[0] for row in rows[1:3]] == ["model", "vllm"]
    assert rows[2].split()[-1] == "1" and rows[1].split()[-1] == "0"
    assert soak.SoakResult.from_dict(r.as_dict()).failures[0].rerun == rerun
