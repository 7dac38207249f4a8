"""vLLM's real core Scheduler with a Mamba group in align mode (`conformance.core_scheduler`):
beside a full-attention group (`groups=("full", "mamba")`), alone (a pure Mamba model,
`groups=("mamba",)`, one Mamba group over every layer), and beside a full-attention and a
sliding-window group (`groups=("full", "sliding", "mamba")`, the three kinds). Its
`MambaManager` commits the states, splits the prefills at block edges and hands the
connector the states it caches (`boundary_state_offloads`), and vLLM's connector stores
them.

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

import functools
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import conformance.vllm_env  # (before vLLM: offline, quiet, temporary caches)

# isort: split
from conformance.core_scheduler import (
    SCENARIO_WINDOW,
    CoreDriver,
    CoreRun,
    RunSummary,
    StepRecord,
    make_core_scheduler,
    scenario,
    scenario_requests,
)
from conformance.vllm_env import VOCAB_SIZE
from spec import request as R
from spec.groups import (
    NULL_BLOCK,
    handoff_position,
    mamba_chunk_end,
)
from statemachine.monitor.replay import replay as monitor_replay

pytestmark = [
    pytest.mark.conformance,
    pytest.mark.skipif(bool(conformance.vllm_env.missing("block_state_handoffs",
                                                         "retention_interval",
                                                         "fix_48102")),
                       reason="a Mamba core hands its states to the connector from vLLM "
                              "0.30 (block_state_handoffs, retention_interval)"),
]

MODELS: dict[str, tuple[str, ...]] = {"hybrid": ("full", "mamba"), "pure": ("mamba",),
                                      "three": ("full", "sliding", "mamba")}
"""The models' KV cache groups: a full-attention group beside the Mamba group, a pure
Mamba model, and the three kinds at once (a sliding window of `SCENARIO_WINDOW` tokens)."""
SPEC_NAMES = {"full": "FullAttentionSpec", "sliding": "SlidingWindowSpec", "mamba": "MambaSpec"}
SCENARIO_GPU_BLOCKS = {"hybrid": 18, "pure": 6, "three": 24}
"""All groups' blocks together: tight enough that the scenario preempts, and (a pure Mamba
model needs a block a request) that it evicts states the requests then load."""
CPU_CHUNKS = {"hybrid": 64, "pure": 64, "three": 128}
"""Room for what the long evicting requests store (`_evict`) beside the prefix they share
with `b`: the window tails too, with the three kinds."""
RETENTION = {"dense": None, "sparse": 0}
"""Every state kept, or vLLM's default retention (0): only the states at the reachable
boundaries."""


def mamba_run(model: str, retention_interval: int | None, gpu_blocks: int,
              workers: int = 2, **kwargs: Any) -> CoreRun:
    groups = MODELS[model]
    window = SCENARIO_WINDOW if "sliding" in groups else None
    run = make_core_scheduler(num_gpu_blocks=gpu_blocks, num_cpu_chunks=CPU_CHUNKS[model],
                              num_workers=workers, groups=groups, sliding_window=window,
                              retention_interval=retention_interval, **kwargs)
    assert [type(g.kv_cache_spec).__name__ for g in run.kv_cache_config.kv_cache_groups] == \
        [SPEC_NAMES[g] for g in groups]
    assert run.scheduler.need_mamba_block_aligned_split
    return run


def mamba_group(model: str) -> int:
    return MODELS[model].index("mamba")


def one_state(model: str, block: int, index: int) -> tuple[tuple[int, ...], ...]:
    """The store source (`StepRecord.store_sources`) of one Mamba state: `block`, at the
    request's block `index`, and no block of another group."""
    n, g = len(MODELS[model]), mamba_group(model)
    return ((block,), tuple(int(i == g) for i in range(n)),
            tuple(index if i == g else 0 for i in range(n)))


@functools.cache
def scenario_run(model: str, retention: str) -> tuple[CoreRun, RunSummary]:
    run = mamba_run(model, RETENTION[retention], SCENARIO_GPU_BLOCKS[model])
    return run, scenario(run, seed=0, reset_latest=15)


RUNS = [(m, r) for m in MODELS for r in RETENTION]


def expected_handoffs(rec: StepRecord, prev: StepRecord | None, prompts: dict[str, int],
                      block_size: int, retention_interval: int | None, group: int
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
        if hit and r in noticed:  # the loaded state, under the same retention
            start = handoff_position(hit, block_size, retention_interval, prompts[r],
                                     rec.junctions.get(r, 0))
            if start is not None:
                positions.add(start)
        table = rec.tables[r][group]
        entries = [(group, table[p], (p + 1) * block_size) for p in sorted(positions)
                   if table[p] != NULL_BLOCK]
        if entries:
            out[r] = entries
    return out


@pytest.mark.parametrize("model", MODELS)
def test_the_scenario_runs_through_the_mamba_core(model: str) -> None:
    run, summary = scenario_run(model, "dense")
    assert summary.idle and summary.error is None and not summary.stuck
    assert summary.preemptions >= 1 and summary.loads
    assert summary.resets and any(r.in_flight for r in summary.resets)
    assert any(rec.handoffs for rec in summary.records)
    assert max(len(t) for t in summary.output_tokens.values()) >= 5
    assert not run.offloading._req_status and not run.offloading._jobs


@pytest.mark.parametrize(("model", "retention"), RUNS)
def test_the_cores_handoffs_are_the_specs(model: str, retention: str) -> None:
    """Step by step, every request: the core's hand-offs are what the spec's rule gives, and
    the scenario reaches both kinds (a step ending on a block edge, a loaded hit); beside
    full attention (with or without a window) at retention 0 it reaches junctions, and a
    state kept at one (a pure Mamba model has none: its lookup hits a stored state or
    nothing)."""
    run, summary = scenario_run(model, retention)
    prompts = {r.req_id: len(r.prompt) for r in scenario_requests(run.block_size, seed=0)}
    kinds = {"step": 0, "hit": 0, "junction": 0}
    prev: StepRecord | None = None
    for rec in summary.records:
        want = expected_handoffs(rec, prev, prompts, run.block_size, RETENTION[retention],
                                 mamba_group(model))
        assert rec.handoffs == want, (rec.step, rec.scheduled, rec.computed, rec.junctions)
        for r, entries in want.items():
            for _, _, boundary in entries:
                kinds["step" if boundary == rec.computed[r] and r in rec.scheduled
                      else "hit"] += 1
                kinds["junction"] += boundary == rec.junctions.get(r)
        prev = rec
    assert kinds["step"] >= 5 and kinds["hit"] >= (2 if model == "hybrid" else 1), kinds
    if "full" in MODELS[model]:
        assert RETENTION[retention] != 0 or kinds["junction"], kinds
    else:
        assert kinds["junction"] == 0, kinds


@pytest.mark.parametrize(("model", "retention"), RUNS)
def test_the_cores_prefill_chunks_end_where_the_spec_says(model: str, retention: str) -> None:
    """Every chunk the core schedules ends where `mamba_chunk_end` puts the end of the
    request's whole rest (the token budget never binds in the scenario): on a block edge,
    at the last block edge before the last token, at the request's shared-prefix junction,
    or at the prefill's end. Beside full attention junctions are found in both runs (a
    lookup hits the shared prefix's full-attention blocks, not its Mamba state), and some
    chunk stops at one; a pure Mamba model finds none."""
    run, summary = scenario_run(model, retention)
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
    assert clipped >= 3 and (at_junction >= 1) == ("full" in MODELS[model]), \
        (clipped, at_junction)


@pytest.mark.parametrize("model", MODELS)
def test_each_mamba_store_is_a_state_the_core_handed_off(model: str) -> None:
    """vLLM's connector stores a Mamba state alone, from the block the core handed off in
    that step, at the block index of its boundary; full-attention stores hold no Mamba
    block, and a pure Mamba model stores nothing else."""
    run, summary = scenario_run(model, "dense")
    group = mamba_group(model)
    mamba_stores = 0
    for rec in summary.records:
        offered = {(r, block, boundary // run.block_size - 1)
                   for r, entries in rec.handoffs.items() for _, block, boundary in entries}
        for job, (blocks, sizes, indices) in rec.store_sources.items():
            if sizes[group]:
                assert (blocks, sizes, indices) == one_state(model, blocks[0], indices[group]), \
                    (rec.step, job, sizes)
                assert (rec.store_jobs[job], blocks[0], indices[group]) in offered
                mamba_stores += 1
            else:
                assert len(MODELS[model]) > 1 and sum(sizes) == len(blocks), \
                    (rec.step, job, sizes)
    assert mamba_stores >= 3


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


LOAD_GPU_BLOCKS = {"hybrid": 24, "pure": 8, "three": 46}
"""GPU blocks of `_load_then_step`: few enough that the requests after `a` evict its."""


def _evict(driver: CoreDriver, model: str, rng: random.Random, long: int,
           steps: int) -> None:
    """Requests that evict what the GPU prefix cache holds, each done within `steps`: one of
    `long` tokens beside full attention; six short ones in a pure Mamba model, where a
    request holds a block or two and each leaves its own state cached."""
    bs = driver.run.block_size
    for x, n in ((("x", long),) if "full" in MODELS[model] else
                 ((f"x{i}", 3 * bs + 8) for i in range(6))):
        driver.add_request(x, _tokens(rng, n), 2)
        assert driver.run_until_idle(steps).idle


def _load_then_step(model: str, reset: bool, retention_interval: int | None = None,
                    b_tail: int = 8) -> tuple[CoreDriver, StepRecord, StepRecord]:
    """`a` (3 blocks and a half) stores its prefix; later requests evict it from the GPU
    (`_evict`); `b`, sharing the 3 blocks and then `b_tail` tokens of its
    own, loads them from the CPU (async). Once its load is reported, with `reset` the
    operator resets the caches; then one step."""
    run = mamba_run(model, retention_interval, LOAD_GPU_BLOCKS[model], workers=1)
    driver = CoreDriver(run)
    rng = random.Random("load-then-step")
    prefix = _tokens(rng, 3 * run.block_size)
    driver.add_request("a", prefix + _tokens(rng, 8), 2)
    assert driver.run_until_idle(40).idle
    _evict(driver, model, rng, 330, steps=40)
    driver.add_request("b", prefix + _tokens(rng, b_tail), 2)
    loaded = next(rec for rec in (driver.step() for _ in range(20))
                  if "b" in rec.finished_recving)
    if reset:
        driver.reset_prefix_cache()
    return driver, loaded, driver.step()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("reset", [False, True], ids=["no-reset", "reset"])
def test_a_loaded_state_is_handed_off_and_stored_again_after_a_reset(reset: bool,
                                                                     model: str) -> None:
    """The core hands off the state `b` loaded in the step after the load is reported.
    The CPU cache still holds it, so no store comes of it; after a reset between the two
    steps it holds nothing, and vLLM's connector stores the state again (and, beside full
    attention, the prefix's full-attention chunks)."""
    driver, loaded, rec = _load_then_step(model, reset)
    bs = driver.run.block_size
    group = mamba_group(model)
    (load,) = [j for step in driver.records for j, r in step.load_jobs.items() if r == "b"]
    assert load in loaded.acks and load not in driver.in_flight()
    table = rec.tables["b"][group]
    assert rec.handoffs == {"b": [(group, table[2], 3 * bs)]}
    stores = {j: rec.store_sources[j] for j, r in rec.store_jobs.items() if r == "b"}
    if not reset:
        assert stores == {}
    else:
        # the prefix's 3 chunks in every other group (full attention, every window tail
        # kept), at block index 0
        n = len(MODELS[model])
        others = [g for g in range(n) if g != group]
        prefix = [(tuple(x for g in others for x in rec.tables["b"][g][:3]),
                   tuple(0 if g == group else 3 for g in range(n)), (0,) * n)] if others else []
        assert sorted(stores.values()) == sorted([one_state(model, table[2], 2), *prefix])
    assert driver.run_until_idle(40).idle


@pytest.mark.parametrize("model", MODELS)
def test_at_retention_0_a_loaded_state_the_request_cannot_resume_at_is_not_handed_off(
        model: str) -> None:
    """The retention applies to a loaded state as to a computed one (`handoff_position`):
    at vLLM's default of 0, `b`'s prompt runs two blocks past the loaded 3, so the loaded
    state is not at its replay boundary (nor at a junction: the GPU no longer holds `a`), and
    the core neither keeps nor hands it off; `a`'s replay boundary was there, so it was
    stored and loaded. With the prompt of the same length as `a`'s it is handed off."""
    for b_tail, handed in ((8, True), (40, False)):
        driver, _loaded, rec = _load_then_step(model, False, retention_interval=0,
                                               b_tail=b_tail)
        bs = driver.run.block_size
        prompt = 3 * bs + b_tail
        position = handoff_position(3 * bs, bs, 0, prompt, rec.junctions.get("b", 0))
        assert (position is not None) == handed
        offered = [boundary for _, _, boundary in rec.handoffs.get("b", [])]
        assert (3 * bs in offered) == handed, (b_tail, rec.handoffs)
        assert driver.run_until_idle(40).idle


WAIT_GPU_BLOCKS = {"hybrid": 40, "pure": 8, "three": 46}
"""GPU blocks of the waiting test: few enough that `x` evicts `a`'s (a window group frees
the blocks behind its window as `x` prefills 64 tokens a step)."""


@pytest.mark.parametrize("model", MODELS)
def test_a_loaded_request_the_core_cannot_schedule_waits_with_the_store_of_its_state(
        tmp_path: Path, model: str) -> None:
    """D4's second case on vLLM's real core (beside full attention, in a pure Mamba model,
    and with the three kinds), under the live monitor. `b` loads `a`'s prefix (async), and
    a long `y` starts to prefill 64 tokens a step, leaving 4 of the 68-token budget; after
    `b`'s load is reported the operator resets the caches. In the next step the core's waiting loop
    reaches `b`, caches the loaded blocks and hands off their state, but no block-aligned
    chunk of `b` fits the 4 tokens left, so it does not schedule `b`. vLLM's connector
    stores the state for the waiting `b`: the spec's `WAITING_STORING`, which the monitor
    projects and finds legal; the store then ends while `b` waits (`IDLE`), or `b` runs
    with it in flight (`STORING`). Once drained, the monitor has found nothing, live or in
    replay."""
    log = tmp_path / "waiting-storing.jsonl"
    run = mamba_run(
        model, None, WAIT_GPU_BLOCKS[model], workers=1, max_num_batched_tokens=68,
        kv_connector="MonitoredOffloadingConnector",
        kv_connector_module_path="statemachine.monitor.connector",
        extra_config={"kvspec_mode": "warn", "kvspec_log": str(log),
                      "kvspec_whole_every": 1})
    bs = run.block_size
    driver = CoreDriver(run)
    rng = random.Random("waiting-storing")
    prefix = _tokens(rng, 3 * bs)
    driver.add_request("a", prefix + _tokens(rng, 8), 2)
    assert driver.run_until_idle(60).idle
    _evict(driver, model, rng, 550, steps=60)
    driver.add_request("b", prefix + _tokens(rng, 8), 2)
    first = driver.step()
    assert first.scheduled == {} and list(first.load_jobs.values()) == ["b"]
    driver.add_request("y", _tokens(rng, 400), 2)
    loaded = next(rec for rec in (driver.step() for _ in range(10))
                  if "b" in rec.finished_recving)
    assert loaded.scheduled == {"y": 64}
    # False (y holds GPU blocks: the GPU prefix cache stays); the connector's is reset
    assert not driver.reset_prefix_cache() and not run.offloading._jobs
    rec = driver.step()
    assert rec.scheduled == {"y": 64}  # b reached, not scheduled
    group = mamba_group(model)
    table = rec.tables["b"][group]
    assert rec.handoffs["b"] == [(group, table[2], 3 * bs)]
    (store,) = [j for j, r in rec.store_jobs.items() if r == "b"]
    assert rec.store_sources[store] == one_state(model, table[2], 2)
    st = run.offloading._req_status["b"]
    assert set(st.transfer_jobs) == {store}
    mon = run.connector.kvspec
    assert mon is not None
    assert mon.projector.requests["b"].state == R.WAITING_STORING
    states = [R.WAITING_STORING]
    while "b" in mon.projector.requests and len(states) < 60:
        driver.step()
        if "b" in mon.projector.requests:
            states.append(mon.projector.requests["b"].state)
    # the store ends while b waits (IDLE), or b runs with it in flight (STORING)
    after = next(x for x in states if x != R.WAITING_STORING)
    assert any(t.trigger in ("store_ended", "schedule") and R.WAITING_STORING in t.sources
               and t.dest == after for t in R.TRANSITIONS), states
    assert driver.run_until_idle(80).idle
    run.connector.kvspec.close()
    assert list(mon.findings) == []
    v = monitor_replay(log)
    assert v.clean, v.text()
