"""vLLM's real core Scheduler with a full-attention and a Mamba group in align mode
(`conformance.core_scheduler`, `groups=("full", "mamba")`): its `MambaManager` commits the
states, splits the prefills at block edges and hands the connector the states it caches
(`boundary_state_offloads`), and vLLM's connector stores them.

What the core hands off is checked step by step against the spec's rule (spec/groups.py,
`handoff_position`): the state after every scheduled step that ends on a block edge and
that the retention keeps, and the state a load brought when the core caches the loaded
blocks (an asynchronous load: in the step after its completion is reported). A hit in the
GPU prefix cache is not handed off (its blocks are cached already). Each hand-off names the
request's own Mamba block at that position. The check runs under dense retention (every
state kept) and at vLLM's default of 0, where the core keeps only the states at each
request's `reachable_boundaries`: the replay boundary and the shared-prefix junction its
lookup found (`Request.shared_prefix_boundary`: the scenario's requests that share a prefix
find one, since the Mamba group did not keep the state where the prefix ends). A hand-off
of a state the CPU cache holds already becomes no store; after a reset it does: the state
a request has just loaded is stored again.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

import conformance.vllm_env  # (before vLLM: offline, quiet, temporary caches)

# isort: split
from conformance.core_scheduler import (
    CoreDriver,
    CoreRun,
    RunSummary,
    StepRecord,
    make_core_scheduler,
    scenario,
    scenario_requests,
)
from conformance.vllm_env import VOCAB_SIZE
from spec.groups import (
    NULL_BLOCK,
    committed_state_position,
    handoff_position,
    mamba_chunk_end,
)

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(bool(conformance.vllm_env.missing("block_state_handoffs",
                                                         "retention_interval",
                                                         "fix_48102")),
                       reason="a Mamba core hands its states to the connector from vLLM "
                              "0.30 (block_state_handoffs, retention_interval)"),
]

MAMBA = ("full", "mamba")
MAMBA_GROUP = 1
GPU_BLOCKS = 18
"""Both groups' blocks together: tight enough that the scenario preempts."""
CPU_CHUNKS = 64


def mamba_run(retention_interval: int | None, gpu_blocks: int = GPU_BLOCKS,
              workers: int = 2) -> CoreRun:
    run = make_core_scheduler(num_gpu_blocks=gpu_blocks, num_cpu_chunks=CPU_CHUNKS,
                              num_workers=workers, groups=MAMBA,
                              retention_interval=retention_interval)
    assert [type(g.kv_cache_spec).__name__ for g in run.kv_cache_config.kv_cache_groups] == \
        ["FullAttentionSpec", "MambaSpec"]
    assert run.scheduler.need_mamba_block_aligned_split
    return run


@pytest.fixture(scope="module")
def dense() -> tuple[CoreRun, RunSummary]:
    run = mamba_run(retention_interval=None)
    return run, scenario(run, seed=0, reset_latest=15)


@pytest.fixture(scope="module")
def sparse() -> tuple[CoreRun, RunSummary]:
    """vLLM's default retention (0): only the states at the reachable boundaries kept."""
    run = mamba_run(retention_interval=0)
    return run, scenario(run, seed=0, reset_latest=15)


RUNS = ["dense", "sparse"]
RETENTION = {"dense": None, "sparse": 0}


def expected_handoffs(rec: StepRecord, prev: StepRecord | None, prompts: dict[str, int],
                      block_size: int, retention_interval: int | None
                      ) -> dict[str, list[tuple[int, int, int]]]:
    """What the spec says the core hands off in step `rec`: per request, the Mamba block at
    each position whose state enters its cached prefix and is kept, if not null."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    noticed = set(prev.finished_recving) if prev is not None else set()
    for r, computed in rec.computed.items():
        n = rec.scheduled.get(r, 0)
        positions: set[int] = set()
        end = handoff_position(computed, block_size, retention_interval, prompts[r],
                               rec.junctions.get(r, 0)) if n else None
        if end is not None:
            positions.add(end)
        hit = computed - n  # what it held before the step's tokens
        if hit and r in noticed:
            start = committed_state_position(hit, block_size)
            if start is not None:
                positions.add(start)
        table = rec.tables[r][MAMBA_GROUP]
        entries = [(MAMBA_GROUP, table[p], (p + 1) * block_size) for p in sorted(positions)
                   if table[p] != NULL_BLOCK]
        if entries:
            out[r] = entries
    return out


def test_the_scenario_runs_through_the_mamba_core(dense: tuple[CoreRun, RunSummary]) -> None:
    run, summary = dense
    assert summary.idle and summary.error is None and not summary.stuck
    assert summary.preemptions >= 1 and summary.loads
    assert summary.resets and any(r.in_flight for r in summary.resets)
    assert any(rec.handoffs for rec in summary.records)
    assert max(len(t) for t in summary.output_tokens.values()) >= 5
    assert not run.offloading._req_status and not run.offloading._jobs


@pytest.mark.parametrize("retention", RUNS)
def test_the_cores_handoffs_are_the_specs(retention: str,
                                          request: pytest.FixtureRequest) -> None:
    """Step by step, every request: the core's hand-offs are what the spec's rule gives, and
    the scenario reaches both kinds (a step ending on a block edge, a loaded hit); at
    retention 0 it reaches junctions, and a state kept at one."""
    run, summary = request.getfixturevalue(retention)
    prompts = {r.req_id: len(r.prompt) for r in scenario_requests(run.block_size, seed=0)}
    kinds = {"step": 0, "hit": 0, "junction": 0}
    prev: StepRecord | None = None
    for rec in summary.records:
        want = expected_handoffs(rec, prev, prompts, run.block_size, RETENTION[retention])
        assert rec.handoffs == want, (rec.step, rec.scheduled, rec.computed, rec.junctions)
        for r, entries in want.items():
            for _, _, boundary in entries:
                kinds["step" if boundary == rec.computed[r] and r in rec.scheduled
                      else "hit"] += 1
                kinds["junction"] += boundary == rec.junctions.get(r)
        prev = rec
    assert kinds["step"] >= 5 and kinds["hit"] >= 2, kinds
    if RETENTION[retention] == 0:
        assert kinds["junction"] >= 1, kinds


@pytest.mark.parametrize("retention", RUNS)
def test_the_cores_prefill_chunks_end_where_the_spec_says(
        retention: str, request: pytest.FixtureRequest) -> None:
    """Every chunk the core schedules ends where `mamba_chunk_end` puts the end of the
    request's whole rest (the token budget never binds in the scenario): on a block edge,
    at the last block edge before the last token, at the request's shared-prefix junction,
    or at the prefill's end. Junctions are found in both runs (a lookup hits the shared
    prefix's full-attention blocks, not its Mamba state); some chunk stops at one."""
    run, summary = request.getfixturevalue(retention)
    bs = run.block_size
    budget = run.vllm_config.scheduler_config.max_num_batched_tokens
    requests = {r.req_id: r for r in scenario_requests(bs, seed=0)}
    generated: dict[str, int] = dict.fromkeys(requests, 0)
    clipped = at_junction = 0
    for rec in summary.records:
        for r, n in rec.scheduled.items():
            prompt = len(requests[r].prompt)
            total = prompt + generated[r]
            junction = rec.junctions.get(r, 0)
            start, end = rec.computed[r] - n, rec.computed[r]
            assert end == mamba_chunk_end(start, total, bs, prompt, total, budget, junction), \
                (rec.step, r, start, end, total, junction)
            clipped += end < total and start < prompt
            at_junction += end == junction and end < total
        for r in rec.sampled:
            generated[r] += 1
    assert clipped >= 3 and at_junction >= 1, (clipped, at_junction)


def test_each_mamba_store_is_a_state_the_core_handed_off(
        dense: tuple[CoreRun, RunSummary]) -> None:
    """vLLM's connector stores a Mamba state alone, from the block the core handed off in
    that step, at the block index of its boundary; full-attention stores hold no Mamba
    block."""
    run, summary = dense
    mamba_stores = 0
    for rec in summary.records:
        offered = {(r, block, boundary // run.block_size - 1)
                   for r, entries in rec.handoffs.items() for _, block, boundary in entries}
        for job, (blocks, sizes, indices) in rec.store_sources.items():
            if sizes[MAMBA_GROUP]:
                assert sizes == (0, 1), (rec.step, job, sizes)
                assert (rec.store_jobs[job], blocks[0], indices[MAMBA_GROUP]) in offered
                mamba_stores += 1
            else:
                assert sizes[0] == len(blocks)
    assert mamba_stores >= 3


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def _load_then_step(reset: bool) -> tuple[CoreDriver, StepRecord, StepRecord]:
    """`a` (3 blocks and a half) stores its prefix; a long `x` evicts it from the GPU;
    `b`, sharing the 3 blocks, loads them from the CPU (async). Once its load is reported,
    with `reset` the operator resets the caches; then one step."""
    run = mamba_run(retention_interval=None, gpu_blocks=24, workers=1)
    driver = CoreDriver(run)
    rng = random.Random("load-then-step")
    prefix = _tokens(rng, 3 * run.block_size)
    driver.add_request("a", prefix + _tokens(rng, 8), 2)
    assert driver.run_until_idle(40).idle
    driver.add_request("x", _tokens(rng, 330), 2)
    assert driver.run_until_idle(40).idle
    driver.add_request("b", prefix + _tokens(rng, 8), 2)
    loaded = next(rec for rec in (driver.step() for _ in range(20))
                  if "b" in rec.finished_recving)
    if reset:
        driver.reset_prefix_cache()
    return driver, loaded, driver.step()


@pytest.mark.parametrize("reset", [False, True], ids=["no-reset", "reset"])
def test_a_loaded_state_is_handed_off_and_stored_again_after_a_reset(reset: bool) -> None:
    """The core hands off the state `b` loaded in the step after the load is reported.
    The CPU cache still holds it, so no store comes of it; after a reset between the two
    steps it holds nothing, and vLLM's connector stores the state again (and the prefix's
    full-attention chunks)."""
    driver, loaded, rec = _load_then_step(reset)
    bs = driver.run.block_size
    (load,) = [j for step in driver.records for j, r in step.load_jobs.items() if r == "b"]
    assert load in loaded.acks and load not in driver.in_flight()
    table = rec.tables["b"][MAMBA_GROUP]
    assert rec.handoffs == {"b": [(MAMBA_GROUP, table[2], 3 * bs)]}
    stores = {j: rec.store_sources[j] for j, r in rec.store_jobs.items() if r == "b"}
    if not reset:
        assert stores == {}
    else:
        assert sorted(stores.values()) == sorted([
            ((table[2],), (0, 1), (0, 2)),
            (tuple(rec.tables["b"][0][:3]), (3, 0), (0, 0))])
    assert driver.run_until_idle(40).idle
