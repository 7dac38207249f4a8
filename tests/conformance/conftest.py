"""Conformance tests: the project's machine against vLLM's own scheduler-side connector.

They need vLLM (make conformance builds `.venv-vllm`); without it every test here is
skipped. The report header names the vLLM under test and where it was imported from, so a
`VLLM_SRC=path make conformance` run shows which source tree it tested, the features of its
release (conformance/releases.py) and the machines' bounds it leaves out, and how the run is
made reproducible.

Reproducible by default: `make conformance` loads the hypothesis profile registered here
(`--hypothesis-profile=kvspec-conformance`: derandomized, each test's seed derived from its
name, no example database) and fixes PYTHONHASHSEED.

A test that needs a feature the release lacks (`NEEDS`) is skipped with a reason naming the
feature and the first release that has it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

HERE = Path(__file__).parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

PROFILE = "kvspec-conformance"
settings.register_profile(PROFILE, derandomize=True, database=None)
"""Each test's examples follow from its name; nothing is read or written in an example
database (no `.hypothesis` folder in the repository)."""

NEEDS: dict[str, tuple[str, ...]] = {
    # a full-attention and a Mamba group: the core's hand-offs (KVConnectorBlockState)
    "test_hybrid_vllm.py::test_a_mamba_state_handed_off_is_stored_alone_and_fenced_as_the_"
    "reference_does": ("block_state_handoffs",),
    # F3 is a partial tail of a Mamba group past its offload cap
    "test_machine.py::test_finding_f3_partial_tail_past_the_offload_cap_crashes": (
        "block_state_handoffs", "partial_tails", "offload_caps"),
    # D1 compares vLLM with and without its bound on the hit; its trace admits r0 again in
    # the step that reports its preemption (PREEMPTED-LOAD before 0.33)
    "test_machine.py::test_divergence_d1_whole_prompt_hit": ("max_num_new_tokens",
                                                             "preempted_load_flush"),
    # F4: a window chunk of 2 blocks under vLLM's default retention
    "test_hybrid_vllm.py::test_f4_a_window_chunk_stored_without_a_block_serves_a_short_hit": (
        "retention_interval",),
    # D2 and D3 end in an abort: before 0.27 vLLM signals the manager at request_finished
    # (EARLY-FINISH-SIGNAL); D3 loads a whole block-aligned prompt, which only the bound on
    # the hit (0.30) keeps from diverging as D1 before D3 is reached
    "test_machine.py::test_d2_a_request_preempted_then_aborted_has_its_jobs_flushed": (
        "finished_signal",),
    "test_machine.py::test_d3_a_loaded_request_aborted_before_its_schedule_conforms": (
        "finished_signal", "max_num_new_tokens"),
    # WHOLE-PROMPT-HIT: r1's lookup meets the whole prompt (its last chunk still being
    # stored) and, without the bound on the hit, defers where the spec hits one chunk
    "test_regressions.py::test_regression_replays_clean_on_vllm"
    "[store-block-reused-inside-the-step-shortest]": ("max_num_new_tokens",),
    # D3's trace: r1 loads r0's whole block-aligned prompt, which only the bound on the hit
    # (0.30) keeps from diverging as D1 first
    "test_regressions.py::test_regression_replays_clean_on_vllm"
    "[loaded-request-aborted-before-its-schedule]": ("max_num_new_tokens",),
    # the eviction program's path: its Mamba hand-offs, its bounded hit and r0's finish; and
    # the store cursor it checks, which vLLM before 0.33 keeps past a restart, so that the
    # adapter does not compare it there (`unobserved_as_in`)
    "test_regressions.py::test_an_evicted_loaded_state_is_stored_while_waiting_and_the_reset_"
    "rewinds_the_cursor": ("block_state_handoffs", "max_num_new_tokens", "finished_signal",
                           "lookup_resets_cursor"),
    # the core's prefill chunks stop at the last block edge before the last token (0.32)
    "test_core_mamba.py::test_the_cores_prefill_chunks_end_where_the_spec_says": (
        "mamba_last_edge_stop",),
    # the junction's window tail is kept under vLLM's sparse retention (0.30)
    "test_hybrid_vllm.py::test_a_shared_prefix_junction_keeps_its_window_tail_in_vllm_and_"
    "the_reference": ("retention_interval",),
    # the manager call for call: every release with the request-access API (the module
    # skips 0.25 and before); field names by release in the test (`vllm_name`)
    "test_manager_vs_vllm.py::runTest": (),
    # vLLM's worker side: sync loads (0.33), and a worker's failure reports (0.34)
    "test_worker_vllm.py::test_a_completed_store_and_sync_load_are_reported_as_the_harness_"
    "builds_them": ("sync_loads",),
    "test_worker_vllm.py::test_a_failed_async_load_is_reported_as_the_harness_builds_it": (
        "failure_reports",),
    "test_worker_vllm.py::test_a_failed_sync_load_raises_in_vllm_where_the_spec_recomputes": (
        "failure_reports",),
    "test_worker_vllm.py::test_before_failure_reports_any_failed_transfer_trips_the_workers_"
    "assert": ("sync_loads",),
}
"""Tests (file::name, with or without parameters) -> the features (conformance/releases.py)
they need; each is skipped, naming what is missing, on a release without them. The
regression programs' needs follow from their bounds and events (`_regression_needs`)."""

RELEASES_MISREAD: dict[str, tuple[str, str]] = {
    "test_projection.py::test_projection_field_by_field": (
        "fix_48102_without_fence",
        "test_projection.py:79 takes a release without `_reset_fence` for one with the "
        "#48102 bug; 0.26.0-0.32.0 have neither (the requests' transfer_jobs are cleared)"),
}
"""Tests whose own release check misreads some releases: (condition, reason) skips them
where the condition holds (see `_condition`)."""


EXPECTED_FINDINGS: dict[str, tuple[str, str]] = {
    "test_regressions.py::test_regression_replays_clean_on_vllm"
    "[store-block-reused-inside-the-step]": (
        "preempted_load_flush",
        "PREEMPTED-LOAD: build_connector_meta asserts that a preempted request holds only "
        "stores (S@0.26.0:1138, S@0.32.0:1862); the program loads it again in the step that "
        "reports its preemption"),
    "test_manager_vs_vllm.py::test_arc_evicts_from_t1_when_t2_has_no_eligible_chunk": (
        "arc_eviction_fallback",
        "ARC-NO-FALLBACK: ARC's evict gives up when the list it prefers has no eligible chunk "
        "though the other has one (ARC@0.29.0:140-150): the store is refused"),
}
"""Tests that fail, by a documented finding, on releases without a feature: (feature, the
finding). There the test is a strict xfail: it must still fail with an AssertionError, and
passes the day the release's behaviour changes (then this entry goes)."""


def _condition(name: str) -> bool:
    from conformance import vllm_env

    if name == "fix_48102_without_fence":
        return vllm_env.has("fix_48102") and not vllm_env.has("reset_fence")
    raise ValueError(name)


def _regression_needs(item: pytest.Item) -> tuple[str, ...]:
    """A regression program or a row witness (tests/conformance/test_regressions.py,
    test_witnesses.py) needs what its bounds need, and the spec's finish lifecycle if it
    finishes or aborts a request."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    reg = params.get("reg", params.get("witness"))
    if reg is None:
        return ()
    from conformance.adapter import features_needed

    need = set(features_needed(reg.bounds))
    if any(e.kind in ("finish", "abort") for e in reg.events()):
        need.add("finished_signal")
    return tuple(sorted(need))


def pytest_report_header(config: pytest.Config) -> list[str]:
    profile = settings.get_profile(settings._current_profile or "default")
    seeds = (f"hypothesis profile {settings._current_profile}: "
             f"derandomize={profile.derandomize} (seed from each test's name), "
             f"database={profile.database}; PYTHONHASHSEED="
             f"{os.environ.get('PYTHONHASHSEED', 'random')}")
    if not HAVE_VLLM:
        return ["vllm: not importable (conformance tests skipped)", seeds]
    from conformance import releases, vllm_env
    from conformance.adapter import (
        HYBRID_VLLM_BOUNDS,
        RELEASE_RULES,
        VLLMHybridMachine,
        VLLMMachine,
        _vllm_bounds,
        dropped_for_release,
        machine_for,
    )

    def show(b: Any) -> str:
        groups = "+".join(b.groups)
        window = f" window {b.sliding_window}" if "sliding" in b.groups else ""
        settings = (", request settings " + "+".join(x.text() for x in b.request_settings)
                    if b.request_settings else "")
        if b.store_threshold > 1:
            settings += f", store threshold {b.store_threshold}"
        if b.rules != RELEASE_RULES:
            settings += f", rules {b.rules}"
        if b.partial_tails:
            settings += f", partial tails (boundary {b.tail_boundary(b.tokens)})"
        if b.retention_interval is not None:
            settings += f", retention interval {b.retention_interval}"
        if b.sync_loads:
            settings += ", sync loads"
        if b.decode_tokens:
            settings += f", decoding {b.decode_tokens} tokens"
        block = f"{b.tokens_per_block} tokens/block, " if b.tokens_per_block > 1 else ""
        return (f"{b.requests}x{b.tokens} tokens, {groups}{window}, {block}"
                f"{b.blocks_per_chunk} block(s)/chunk, {b.workers} worker(s){settings}")

    version = vllm_env.vllm_version()
    release = releases.text(version)
    lacks = sorted(set(releases.FEATURES) - releases.features(version))
    dropped = dropped_for_release((*_vllm_bounds(sync_loads=True), *HYBRID_VLLM_BOUNDS))
    machine = machine_for(version)
    lines = [f"vllm: {release} from {vllm_env.vllm_file()}",
             seeds,
             f"release features lacking: {', '.join(lacks) or 'none'}; "
             f"#48102 machine: {machine.__name__}; the spec's rules (spec.rules): "
             f"{RELEASE_RULES}"]
    if machine is VLLMMachine:
        lines += ["machine bounds: " + "; ".join(show(b) for b in VLLMMachine.bounds_choices),
                  "hybrid bounds (block size 16): "
                  + "; ".join(show(b) for b in VLLMHybridMachine.bounds_choices)]
    else:
        lines += ["machine bounds: " + "; ".join(show(b) for b in machine.bounds_choices)]
    if dropped and machine is VLLMMachine:
        lines.append("bounds left out (features lacking, or a rule that differs): " + "; ".join(
            f"{show(b)} [{', '.join(f)}]" for b, f in dropped))
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.fspath)).parents]
    if not HAVE_VLLM:
        skip = pytest.mark.skip(reason="vllm is not importable (make conformance builds a venv)")
        for item in mine:
            item.add_marker(skip)
        return
    from conformance import releases, vllm_env

    for item in mine:
        file = Path(str(item.fspath)).name
        plain = f"{file}::{getattr(item, 'originalname', item.name)}"
        needs = {*NEEDS.get(plain, ()), *NEEDS.get(f"{file}::{item.name}", ()),
                 *_regression_needs(item)}
        misread = RELEASES_MISREAD.get(plain)
        if misread is not None and _condition(misread[0]):
            item.add_marker(pytest.mark.skip(reason=f"{item.name}: {misread[1]}"))
            continue
        expected = EXPECTED_FINDINGS.get(f"{file}::{item.name}")
        if expected is not None and vllm_env.missing(expected[0]):
            item.add_marker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
                f"a finding of vLLM {releases.text(vllm_env.release_version())} (lacks "
                f"{expected[0]}, from {releases.FEATURES[expected[0]]}): {expected[1]}")))
        lacks = vllm_env.missing(*sorted(needs))
        if lacks:
            item.add_marker(pytest.mark.skip(reason=(
                f"{item.name}: vLLM {releases.text(vllm_env.release_version())} lacks "
                + ", ".join(f"{f} (from {releases.FEATURES[f]})" for f in lacks))))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the subprocesses of the tests that will run (`EARLY_JOBS`,
    tests/conformance/early.py), so they overlap the in-process tests."""
    from tests.conformance import early

    selected: dict[Any, set[str]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if (module is None or not hasattr(module, "EARLY_JOBS")
                or item.get_closest_marker("skip") is not None):
            continue
        selected.setdefault(module, set()).add(getattr(item, "originalname", item.name))
    for module, names in selected.items():
        try:
            early.start_selected(module.EARLY_JOBS, names)
        except Exception as e:  # the test starts it itself, and reports the error there
            print(f"\n{module.__name__}: early start: {type(e).__name__}: {e}")


@pytest.fixture(scope="session")
def vllm_ready() -> Any:
    """Import vLLM and build the cached ModelConfig once (about 20 s)."""
    from conformance import vllm_env

    vllm_env.make_setup(num_gpu_blocks=4, num_cpu_chunks=2)
    return vllm_env
