"""`kvspec simulate`: the seeded run passes, and it fails (exit 1) when a request is stuck,
a resource leaks or bytes are corrupted."""

from __future__ import annotations

import json

import pytest
import torch

from statemachine import cli, engine, simulate, worker
from statemachine.mutants import MUTANTS
from statemachine.simulate import SimConfig


def test_seed_1_drains_clean_with_every_kind_of_trouble() -> None:
    result = simulate.run(SimConfig(seed=1))
    m = result.metrics
    assert result.ok, (result.error, result.stuck, result.leaks)
    assert result.stuck == [] and result.leaked == 0 and result.corrupted == 0
    assert m["resets"] >= 1 and m["preemptions"] >= 1 and m["injected_failures"] >= 1
    assert m["loads"] >= 100 and m["timeouts"] >= 1 and m["failed_jobs"] >= 1
    assert m["requests_finished"] + m["requests_aborted"] == m["requests_added"]
    assert m["loaded_blocks_verified"] > 0 and m["computed_blocks_verified"] > 0
    assert "PASS" in simulate.render(result)


def test_a_hybrid_model_drains_clean_with_trouble_in_every_group() -> None:
    """Full attention beside a sliding window, pages of two sizes: loads, stores, failures,
    resets and preemptions touch both groups; nothing is stuck, leaked or corrupted."""
    result = simulate.run(SimConfig(seed=1, model="hybrid"))
    assert result.ok, (result.error, result.stuck, result.leaks)
    assert simulate.exercised_everywhere(result) == []
    full, window = result.metrics["groups"]
    assert (full["kind"], window["kind"], window["sliding_window"]) == ("full", "sliding", 40)
    assert (full["page_bytes"], window["page_bytes"]) == (64, 32)
    assert window["blocks_freed_before_window"] > 0 == full["blocks_freed_before_window"]
    # a group's chunks of one store need not be consecutive, and a timed-out sync load may
    # name blocks the window had freed: both happened, and the oracle followed
    assert result.metrics["stores_with_gaps"] > 0
    assert result.metrics["quarantined_blocks_already_freed"] > 0
    text = simulate.render(result)
    assert "group 1 (sliding window 40, page 32 B)" in text and "PASS" in text


@pytest.mark.parametrize("name,model", [(m.name, model) for m in MUTANTS
                                        for model in m.data_plane_models])
def test_the_data_plane_catches_the_group_mutants(name: str, model: str) -> None:
    """With the connector's invariant checks off, the data plane alone catches each fault:
    the bytes (in the second group's tensor: the sliding window's, the Mamba state's), or a
    store's keys that name another group than its blocks'."""
    from statemachine.mutants import by_name

    with by_name(name).patch():
        result = simulate.run(SimConfig(seed=1, model=model, check_invariants=False))
    assert result.error is not None and not result.ok
    if name == "keys-without-group-index":
        assert "blocks of group 1 are stored under key" in result.error
    else:
        assert result.corrupted and "layer 2" in result.error


def test_a_mamba_model_drains_clean_with_trouble_in_every_group() -> None:
    """Full attention beside a Mamba group (align mode) whose state pages are three times
    an attention page: the core splits prefills at block edges and hands off the states it
    commits; those at a chunk edge are stored into the last block of their chunk, and hits
    load the state at the hit's end back. Loads, stores, failures, resets and preemptions
    touch both groups; nothing is stuck, leaked or corrupted."""
    result = simulate.run(SimConfig(seed=1, model="mamba"))
    assert result.ok, (result.error, result.stuck, result.leaks)
    assert simulate.exercised_everywhere(result) == []
    full, mamba = result.metrics["groups"]
    assert (full["kind"], mamba["kind"]) == ("full", "mamba")
    assert (full["page_bytes"], mamba["page_bytes"]) == (64, 192)
    # the core keeps one state block per request: every other one it frees as it goes
    assert mamba["blocks_freed_before_window"] > full["blocks_freed_before_window"] == 0
    # a Mamba load fills one block: the state at the hit's end
    assert 0 < mamba["loaded_blocks_verified"] <= mamba["loads"] * 2  # 2 workers
    assert result.metrics["states_handed_off"] >= mamba["stores"]
    text = simulate.render(result)
    assert "group 1 (Mamba state, page 192 B)" in text and "PASS" in text


@pytest.mark.parametrize("release", ["0.33", "0.34"])
def test_a_reset_orphaned_load_that_failed_is_recomputed_under_either_release_s_rule(
        capsys: pytest.CaptureFixture[str], release: str) -> None:
    """Seed 1 fails an async load on one rank and holds it on the other just before a reset.
    Under 0.33.0's rules the connector marks the orphaned request; under 0.34.0's
    (`kvspec simulate --rules 0.34`: `spec.rules.StaleLoadFailure.FENCE_ONLY`) the
    connector only drains the fence and the engine, as 0.34.0's core, recomputes the request
    on the ranks' failed_recving. Either way nothing loaded from the failed copy is trusted:
    the byte oracle checks every block the request computes and stores."""
    assert cli.main(["simulate", "--seed", "1", "--rules", release, "--json",
                     "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["corrupted_bytes"] == 0
    assert data["orphaned_loads_failed"] >= 1
    by_core = data["orphaned_loads_failed"] if release == "0.34" else 0
    assert data["orphaned_loads_failed_left_to_the_core"] == by_core


def test_the_run_is_a_function_of_the_seed() -> None:
    def numbers(seed: int) -> dict[str, object]:
        out = simulate.run(SimConfig(seed=seed, steps=40)).as_dict()
        for timing in ("seconds", "load_gbps", "store_gbps", "steps_per_second"):
            out.pop(timing)
        return out

    assert numbers(3) == numbers(3)
    assert numbers(3) != numbers(4)


def test_cli_json_and_exit_status_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--seed", "2", "--steps", "60", "--workers", "3",
                     "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ok"] and data["workers"] == 3
    assert (data["stuck_requests"], data["leaked"], data["corrupted_bytes"]) == (0, 0, 0)
    assert captured.err.startswith("\r[") and "finished 30/30" in captured.err  # progress
    assert cli.main(["simulate", "--model", "hybrid", "--steps", "60", "--json",
                     "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and [g["kind"] for g in data["groups"]] == ["full", "sliding"]


def test_cli_exits_1_when_a_worker_skips_flushes(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(worker.Worker, "handle_preemptions", lambda self, meta: None)
    assert cli.main(["simulate", "--seed", "1", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "received wrong bytes" in out and "store job" in out
    line = next(x for x in out.splitlines() if x.startswith("corrupted bytes"))
    assert int(line.split()[-1]) >= 1
    assert "leaked           not measured: the run stopped at step" in out
    assert cli.main(["simulate", "--seed", "1", "--no-progress", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["corrupted_bytes"] >= 1 and data["leaked"] is None and not data["ok"]


def test_cli_exits_1_on_a_leak(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    original = engine.Engine._take_released

    def lose_released_blocks(self: engine.Engine) -> list[int]:
        original(self)
        return []  # the quarantined blocks never come back to the pool

    monkeypatch.setattr(engine.Engine, "_take_released", lose_released_blocks)
    assert cli.main(["simulate", "--seed", "1", "--steps", "60", "--no-progress",
                     "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["leaks"]["gpu_blocks_not_free"] > 0 and not data["ok"]


def test_a_stuck_request_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.Engine, "_promote", lambda self, r: None)  # recving ignored
    result = simulate.run(SimConfig(seed=1, steps=40, max_drain_steps=20))
    assert result.stuck and not result.ok
    assert "stuck:" in simulate.render(result)


def test_bad_usage_exits_2() -> None:
    assert cli.main(["simulate", "--steps", "0"]) == 2
    assert cli.main(["simulate", "--workers", "two"]) == 2
    assert cli.main(["simulate", "--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        assert cli.main(["simulate", "--device", "cuda"]) == 2


def test_without_a_c_compiler_simulate_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kernels import native

    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason",
                        lambda: "no C compiler (cc, gcc or clang) on PATH")
    assert cli.main(["simulate", "--seed", "2", "--steps", "20", "--no-progress"]) in (0, 1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C compiler" in err and "pure-torch" in err
