"""vLLM 0.33.0's connector with a hybrid KV cache (a full-attention group and a
sliding-window group): the finding of the `hybrid-reset-window` scenario, reproduced on vLLM.

F2 in CONFORMANCE.md. The core frees a running request's sliding-window blocks that fell out
of the window and hands them to other requests. vLLM's connector keeps the old ids in the
request's group table; it zeroes one only when the block is re-allocated at or after the
store cursor, in the step it is re-allocated (`_update_req_states`, S:1533-1552). A
`reset_cache` puts the cursor back to 0 (S:2429-2433) without touching the table, so the
request's next store (here its final store) reads a block that belongs to another request
and publishes it under the request's own chunk key: the CPU tier then serves another
request's KV for that prefix.

The checker's counterexample (`kvspec check --scenario hybrid-reset-window --mutant
reset-keeps-stale-window-blocks`, 8 events) is replayed here through vLLM's hooks, with the
core played by the test: one vLLM block per model token, block 0 is vLLM's null block.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.conformance

BLOCK = 16
WINDOW = BLOCK
"""Sliding window in tokens: a block leaves the window once the next block is computed
(`get_num_skipped_tokens`: computed - window + 1 tokens are skipped)."""


def _setup(vllm_env: Any) -> Any:
    if vllm_env.vllm_version() < (0, 26, 0):
        pytest.skip("hybrid KV cache configurations need vLLM 0.33")
    return vllm_env.make_setup(num_gpu_blocks=16, block_size=BLOCK,
                               sliding_window=WINDOW)


def _prompt(first: int) -> list[int]:
    return [3 + first * 3 * BLOCK + i for i in range(3 * BLOCK)]  # three blocks


def _store_sources(meta: Any, req_id: str) -> list[tuple[list[int], list[int]]]:
    """(source block ids per group, group sizes) of each store job of `req_id`."""
    out = []
    for job in meta.store_jobs.values():
        if job.req_id == req_id:
            spec = job.src_spec
            ids = [int(b) for b in spec.block_ids]
            sizes = [int(n) for n in spec.group_sizes]
            out.append((ids, sizes))
    return out


def _sliding_sources(meta: Any, req_id: str) -> set[int]:
    """The sliding-window group's (group 1) source blocks of `req_id`'s stores."""
    found: set[int] = set()
    for ids, sizes in _store_sources(meta, req_id):
        found.update(ids[sizes[0]:sizes[0] + sizes[1]])
    return found


def test_f2_reset_then_store_reads_a_reallocated_sliding_window_block(
        vllm_ready: Any) -> None:
    E = vllm_ready
    setup = _setup(E)
    conn = setup.connector
    status = E.request_status()
    r0 = E.make_request(setup, "r0", _prompt(0))
    r1 = E.make_request(setup, "r1", _prompt(1))
    conn.on_new_request(r0)
    conn.on_new_request(r1)

    # step 1: r0 admitted with no hit (full-attention blocks 1-3, window blocks 4-6) and
    # computes its first block, stored from blocks 1 and 4
    assert conn.get_num_new_matched_tokens(r0, 0) == (0, False)
    conn.update_state_after_alloc(r0, E.kv_blocks(([1, 2, 3], [4, 5, 6])), 0)
    r0.status = status.RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r0": (r0, ([1, 2, 3], [4, 5, 6]))}, num_scheduled_tokens={"r0": BLOCK}))
    assert _sliding_sources(meta, "r0") == {4}
    r0.num_computed_tokens = BLOCK

    # step 2: r0 computes its second block (stored from 2 and 5); block 4 leaves the window
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, cached={"r0": (r0, ([], []))}, num_scheduled_tokens={"r0": BLOCK}))
    assert _sliding_sources(meta, "r0") == {5}
    r0.num_computed_tokens = 2 * BLOCK

    # step 3: the core frees block 4 and hands it to r1 (blocks 7-9 and 4, 10, 11); r0
    # computes its last block. The store that read block 4 was fenced at its creation:
    # vLLM flushes it (it is still in flight: no worker reported it)
    assert conn.get_num_new_matched_tokens(r1, 0) == (0, False)
    conn.update_state_after_alloc(r1, E.kv_blocks(([7, 8, 9], [4, 10, 11])), 0)
    r1.status = status.RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r1": (r1, ([7, 8, 9], [4, 10, 11]))}, cached={"r0": (r0, ([], []))},
        num_scheduled_tokens={"r1": BLOCK, "r0": BLOCK}))
    assert meta.jobs_to_flush, "the store reading block 4 is flushed: it was fenced"
    r0.num_computed_tokens = 3 * BLOCK
    r1.num_computed_tokens = BLOCK

    # a cache reset while both run, then r0 finishes
    conn.reset_cache()
    r0.status = status.FINISHED_LENGTH_CAPPED
    conn.request_finished(r0, [1, 2, 3])
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, cached={"r1": (r1, ([], []))}, num_scheduled_tokens={"r1": BLOCK},
        finished_req_ids={"r0"}))

    # vLLM 0.33.0: r0's final store copies block 4, which r1 holds, into r0's chunk 0 of
    # the sliding-window group. The spec zeroes the window positions the core freed when
    # the reset puts the cursor back, and stores nothing from them.
    sliding = _sliding_sources(meta, "r0")
    assert 4 in sliding, (
        f"vLLM no longer stores from the re-allocated block 4 (sources {sliding}): F2 is "
        "fixed; move it to the fixed findings in CONFORMANCE.md")


# ============================================================================ a Mamba group
def _jobs_by_groups(meta: Any) -> dict[tuple[int, ...], tuple[list[int], list[int]]]:
    """Each store job as {group sizes: (source block ids, block indices)}."""
    out = {}
    for job in meta.store_jobs.values():
        spec = job.src_spec
        out[tuple(int(n) for n in spec.group_sizes)] = (
            [int(b) for b in spec.block_ids], [int(i) for i in spec.block_indices])
    return out


def test_a_mamba_state_handed_off_is_stored_alone_and_fenced_as_the_reference_does(
        vllm_ready: Any) -> None:
    """vLLM 0.33.0 with a full-attention and a Mamba group (align mode): the positional
    store skips the Mamba group (S:1904-1905); the state the core hands off at a block
    boundary is a store of that one block, fenced at creation (S:1554-1624). The reference
    scheduler, given the same step, makes the same two jobs."""
    E = vllm_ready
    if E.vllm_version() < (0, 26, 0):
        pytest.skip("hybrid KV cache configurations need vLLM 0.33")
    from spec.groups import NULL_BLOCK

    setup = E.make_setup(num_gpu_blocks=16, block_size=BLOCK, groups=("full", "mamba"))
    # the state after two blocks lies in block 5
    vllm_jobs = _vllm_store_jobs(E, setup, ([1, 2, 3], [0, 5, 0]), [(1, 5, 2 * BLOCK)])
    assert vllm_jobs == {(2, 0): ([1, 2], [0, 0]), (0, 1): ([5], [0, 1])}
    assert _vllm_fences(setup) == [[5]]

    mine = ((0, 1, 2), (NULL_BLOCK, 4, NULL_BLOCK))  # vLLM's ids less one, -1 for null
    assert _reference_store_jobs(("full", "mamba"), mine, ((1, 4, 2 * BLOCK),)) == \
        (vllm_jobs, [[5]])


def test_the_three_kinds_store_by_position_and_the_state_alone_as_the_reference_does(
        vllm_ready: Any) -> None:
    """The three kinds in one model, one layer each: full attention, a sliding window of
    `WINDOW` tokens, Mamba in align mode. In r0's first step of two blocks vLLM's
    positional store takes both blocks of the full-attention and of the window group, the
    window's fenced at creation (the core may free them); the state handed off after two
    blocks is a store of its block alone, fenced. The reference makes the same two jobs,
    with the same fences."""
    E = vllm_ready
    if not E.has("block_state_handoffs"):
        pytest.skip("the core's Mamba hand-offs need vLLM 0.29.0")
    from spec.groups import NULL_BLOCK

    kinds = ("full", "sliding", "mamba")
    setup = E.make_setup(num_gpu_blocks=16, block_size=BLOCK, sliding_window=WINDOW,
                         groups=kinds)
    assert [type(g.kv_cache_spec).__name__ for g in setup.kv_cache_config.kv_cache_groups] \
        == ["FullAttentionSpec", "SlidingWindowSpec", "MambaSpec"]
    assert [list(g.layer_names) for g in setup.kv_cache_config.kv_cache_groups] == [
        [f"model.layers.{i}.self_attn.attn"] for i in range(3)]
    vllm_jobs = _vllm_store_jobs(E, setup, ([1, 2, 3], [4, 6, 7], [0, 5, 0]),
                                 [(2, 5, 2 * BLOCK)])
    assert vllm_jobs == {(2, 2, 0): ([1, 2, 4, 6], [0, 0, 0]), (0, 0, 1): ([5], [0, 0, 1])}
    assert _vllm_fences(setup) == [[4, 6], [5]]

    mine = ((0, 1, 2), (3, 5, 6), (NULL_BLOCK, 4, NULL_BLOCK))  # vLLM's ids less one
    assert _reference_store_jobs(kinds, mine, ((2, 4, 2 * BLOCK),), window=WINDOW) == \
        (vllm_jobs, [[4, 6], [5]])


def test_a_pure_mamba_model_stores_each_state_handed_off_as_the_reference_does(
        vllm_ready: Any) -> None:
    """A Mamba group alone (a pure Mamba model, as the witnesses of `loaded-state-handoff`
    run on vLLM): one `MambaSpec` group over both layers, so a CPU chunk holds both layers'
    states and vLLM makes as many chunks of the CPU bytes as the setup asked for. Nothing is
    stored by position; the state handed off after two blocks is one store of its block,
    fenced at creation, and the reference makes the same job."""
    E = vllm_ready
    if not E.has("block_state_handoffs"):
        pytest.skip("the core's Mamba hand-offs need vLLM 0.29.0")
    from spec.groups import NULL_BLOCK

    setup = E.make_setup(num_gpu_blocks=16, block_size=BLOCK, num_cpu_chunks=3,
                         groups=("mamba",))
    [group] = setup.kv_cache_config.kv_cache_groups
    assert type(group.kv_cache_spec).__name__ == "MambaSpec"
    assert list(group.layer_names) == [f"model.layers.{i}.self_attn.attn"
                                       for i in range(E.NUM_LAYERS)]
    assert setup.num_cpu_chunks == 3
    # the state after two blocks lies in block 5
    vllm_jobs = _vllm_store_jobs(E, setup, ([0, 5, 0],), [(0, 5, 2 * BLOCK)])
    assert vllm_jobs == {(1,): ([5], [1])}
    assert len(setup.scheduler._jobs) == 1 and _vllm_fences(setup) == [[5]]
    mine = ((NULL_BLOCK, 4, NULL_BLOCK),)  # vLLM's ids less one, -1 for null
    assert _reference_store_jobs(("mamba",), mine, ((0, 4, 2 * BLOCK),)) == (vllm_jobs, [[5]])


def _vllm_store_jobs(E: Any, setup: Any, table: tuple[list[int], ...],
                     offloads: list[tuple[int, int, int]]) -> dict[Any, Any]:
    """The store jobs vLLM's connector makes for r0 (three blocks, no hit, `table` per
    group, the core's hand-offs `offloads`) in its first step of two blocks
    (`_jobs_by_groups`)."""
    conn = setup.connector
    r0 = E.make_request(setup, "r0", _prompt(0))
    conn.on_new_request(r0)
    assert conn.get_num_new_matched_tokens(r0, 0) == (0, False)
    conn.update_state_after_alloc(r0, E.kv_blocks(table), 0)
    r0.status = E.request_status().RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r0": (r0, table)}, num_scheduled_tokens={"r0": 2 * BLOCK},
        boundary_state_offloads={"r0": offloads}))
    return _jobs_by_groups(meta)


def _vllm_fences(setup: Any) -> list[list[int]]:
    """The blocks each of vLLM's jobs fenced at its creation, of those that fenced any."""
    return sorted([int(b) for b in s.fenced_block_ids]
                  for s in setup.scheduler._jobs.values() if s.fenced_block_ids)


def _reference_store_jobs(kinds: tuple[str, ...], table: tuple[tuple[int, ...], ...],
                          offloads: tuple[tuple[int, int, int], ...],
                          window: int | None = None
                          ) -> tuple[dict[Any, Any], list[list[int]]]:
    """The store jobs the reference scheduler makes for r0 (three blocks, `table` per
    group, the core's hand-offs `offloads`, a sliding window of `window` tokens) in its
    first step of two blocks, keyed and numbered as `_jobs_by_groups` reads vLLM's, and
    their fences as `_vllm_fences` reads vLLM's."""
    from statemachine import KVCacheGroup, OffloadingConfig, OffloadingScheduler
    from statemachine.messages import (
        GPULoadStoreSpec,
        NewRequestData,
        Request,
        SchedulerOutput,
    )

    ours = OffloadingScheduler(OffloadingConfig(
        block_size=BLOCK, groups=tuple(
            KVCacheGroup(k, sliding_window=window if k == "sliding" else None)
            for k in kinds)))
    req = Request("r0", _prompt(0), block_hashes=[b + 1 for b in range(3)])
    ours.on_new_request(req)
    ours.get_num_new_matched_tokens(req, 0)
    ours.update_state_after_alloc(req, table, 0)
    out = ours.build_connector_meta(SchedulerOutput(
        (NewRequestData("r0", table),), (), {"r0": 2 * BLOCK},
        boundary_state_offloads={"r0": offloads}))
    jobs = {}
    for j in out.store_jobs.values():
        src = j.src
        assert isinstance(src, GPULoadStoreSpec)
        # one group: the reference names the first block by `first_block_index` alone,
        # where vLLM's spec always carries the sizes and the first indices
        jobs[src.sizes_per_group] = ([b + 1 for b in src.block_ids],
                                     list(src.first_index_per_group))
    fences = sorted(sorted(b + 1 for b in job.fenced_block_ids)
                    for job in ours.jobs if job.fenced_block_ids)
    return jobs, fences


# ============================================================================ finding F4
def _window_chunk_stored_in_part(E: Any, sliding_window: int, max_num_new_tokens: int | None
                                 ) -> tuple[int, list[int], list[int], int]:
    """F4's steps on vLLM with 2-block chunks and a window of `sliding_window` tokens that
    vLLM's reachable-block mask keeps one block of per chunk: r0 computes four blocks, a
    reset puts its store cursor back, r1 takes r0's freed window blocks (vLLM zeroes them in
    r0's table), r0's next store writes window chunk 1 from its second block alone, and r2
    (r0's first four blocks, its hit bounded by `max_num_new_tokens` if given) looks up and
    is allocated. Returns r2's hit, its load's group sizes and block indices (the first
    block each group loads), and whether that load's source is the chunk r0 stored in part
    (1 if so)."""
    if E.vllm_version() < (0, 26, 0):
        pytest.skip("hybrid KV cache configurations need vLLM 0.33")
    setup = E.make_setup(num_gpu_blocks=32, block_size=BLOCK, blocks_per_chunk=2,
                         sliding_window=sliding_window)
    conn = setup.connector
    status = E.request_status()
    prompt = [7 + i for i in range(5 * BLOCK)]  # five blocks
    r0 = E.make_request(setup, "r0", prompt)
    r1 = E.make_request(setup, "r1", [9000 + i for i in range(2 * BLOCK)])
    r2 = E.make_request(setup, "r2", prompt[:4 * BLOCK])  # r0's first four blocks
    for r in (r0, r1, r2):
        conn.on_new_request(r)

    # step 1: r0 computes four blocks; its chunks 0 and 1 are stored (both groups)
    table0 = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert conn.get_num_new_matched_tokens(r0, 0) == (0, False)
    conn.update_state_after_alloc(r0, E.kv_blocks(table0), 0)
    r0.status = status.RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r0": (r0, table0)}, num_scheduled_tokens={"r0": 4 * BLOCK}))
    assert len(meta.store_jobs) == 1
    r0.num_computed_tokens = 4 * BLOCK
    # the window of token 64 starts in block 3: the core frees blocks 6, 7 and 8
    conn.reset_cache()

    # step 2: the core hands blocks 8 and 7 to r1, and vLLM zeroes them in r0's table
    # (S:1533-1552); r0 computes its last block and stores from its cursor, now 0
    table1 = ([11, 12], [8, 7])
    assert conn.get_num_new_matched_tokens(r1, 0) == (0, False)
    conn.update_state_after_alloc(r1, E.kv_blocks(table1), 0)
    r1.status = status.RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r1": (r1, table1)}, cached={"r0": (r0, ([], []))},
        num_scheduled_tokens={"r1": 2 * BLOCK, "r0": BLOCK}))
    r0.num_computed_tokens = 5 * BLOCK
    r1.num_computed_tokens = 2 * BLOCK
    window_stores = {}
    window_chunk = -1
    for job_id, job in meta.store_jobs.items():
        spec = job.src_spec
        sizes = [int(n) for n in spec.group_sizes]
        if job.req_id == "r0" and sizes[1]:
            window_stores[job_id] = ([int(b) for b in spec.block_ids][sizes[0]:],
                                     int(spec.block_indices[1]))
            window_chunk = int(job.dst_spec.block_ids[-1])  # chunks in group order
    # vLLM stores r0's window chunk 1 from block 9 alone, into the chunk's second sub-block;
    # from 0.34.0 (feature null_pages_in_chunk) the null block 0 is copied into the first
    # sub-block in place of the freed block 8: zeros, not the tokens' KV
    expected = ([0, 9], 2) if E.has("null_pages_in_chunk") else ([9], 3)
    assert list(window_stores.values()) == [expected], (
        f"vLLM no longer stores window chunk 1 from block 9 and nothing of block 8 "
        f"({window_stores}, expected {expected}): F4 may be fixed; see CONFORMANCE.md")
    conn.update_connector_output(E.connector_output({j: 1 for j in meta.store_jobs}))

    # step 3: r2 looks up; the core skips the tokens before the window of the first token
    # it computes (63 for F4's hit, 47 or 48 for a bounded one): blocks 0 and 1 of the window
    hit, _ = conn.connector_scheduler.get_num_new_matched_tokens(
        r2, 0, max_num_new_tokens=max_num_new_tokens)
    table2 = ([13, 14, 15, 16], [0, 0, 18, 19])
    conn.update_state_after_alloc(r2, E.kv_blocks(table2), hit)
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r2": (r2, table2)}, num_scheduled_tokens={}))
    [(_, load)] = list(meta.load_jobs.items())
    dst = load.dst_spec
    return (hit, [int(n) for n in dst.group_sizes], [int(i) for i in dst.block_indices],
            int(int(load.src_spec.block_ids[-1]) == window_chunk))


def test_f4_a_window_chunk_stored_without_a_block_serves_a_short_hit(vllm_ready: Any) -> None:
    """F4 in CONFORMANCE.md. A 17-token window (one block and a token) with 2-block chunks:
    vLLM's reachable-block mask keeps each chunk's last block only, the tail a hit ending
    on a chunk edge reads. A chunk whose first block the core freed and handed out again is
    then stored with its last block alone. But with a window group the connector's hits end
    one token before a block edge (S:872-876), and such a hit's window reaches one block
    further back: the load reads the chunk's first sub-block, which no store wrote.

    The checker's counterexample (`kvspec check --scenario window-partial-chunk --mutant
    store-mask-ignores-short-hits`, INV-23) replayed on vLLM (`_window_chunk_stored_in_part`):
    r2 (r0's first four blocks) hits 63 tokens and loads both sub-blocks of that chunk."""
    hit, sizes, first, from_the_chunk = _window_chunk_stored_in_part(
        vllm_ready, BLOCK + 1, None)
    # 63 tokens, one short of a block edge: the last token is recomputed, with a window
    # group from below the block edge (S:872-876)
    assert hit == 4 * BLOCK - 1
    # the window group loads blocks 2 and 3 from the CPU chunk r0's store wrote from block 9
    # alone: sub-block 0 was never written (from 0.34.0: it holds the null block's zeros)
    assert sizes[1] == 2 and first[1] == 2 and from_the_chunk, (sizes, first)


@pytest.mark.parametrize("junction", [0, 3 * BLOCK], ids=["no-junction", "junction"])
def test_a_shared_prefix_junction_keeps_its_window_tail_in_vllm_and_the_reference(
        vllm_ready: Any, junction: int) -> None:
    """Under sparse retention (vLLM's default `prefix_cache_retention_interval` of 0) the
    store keeps a window tail only where a later request resumes: the replay boundary and
    the shared-prefix junction the core's lookup found (`Request.shared_prefix_boundary`,
    S:1853-1857; `spec.groups.reachable_boundaries`). A prompt of six blocks and a part
    with a junction after block 3, computed in one step: vLLM's connector and the reference
    scheduler store every full-attention chunk, and vLLM the window group's blocks 5 (the
    replay boundary) and, with the junction, 2. The reference keeps the block before each
    of those too: a hit bounded a block before a tail's edge reads it under 0.33.0's cut
    (the second form of finding F4, `spec.groups.hit_tail_blocks`)."""
    E = vllm_ready
    if E.vllm_version() < (0, 26, 0):
        pytest.skip("hybrid KV cache configurations need vLLM 0.33")
    from statemachine import KVCacheGroup, OffloadingConfig, OffloadingScheduler
    from statemachine.messages import NewRequestData, Request, SchedulerOutput

    prompt = [5 + i for i in range(6 * BLOCK + 5)]
    table = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14])

    setup = E.make_setup(num_gpu_blocks=32, block_size=BLOCK, sliding_window=WINDOW,
                         retention_interval=0)
    conn = setup.connector
    req = E.make_request(setup, "r0", prompt)
    req.shared_prefix_boundary = junction
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, E.kv_blocks(table), 0)
    req.status = E.request_status().RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r0": (req, table)}, num_scheduled_tokens={"r0": len(prompt)}))
    vllm_full: set[int] = set()
    for ids, sizes in _store_sources(meta, "r0"):
        vllm_full.update(ids[:sizes[0]])
    vllm_window = _sliding_sources(meta, "r0")

    ours = OffloadingScheduler(OffloadingConfig(
        block_size=BLOCK, retention_interval=0,
        groups=(KVCacheGroup("full"), KVCacheGroup("sliding", sliding_window=WINDOW))))
    mine = Request("r0", prompt, block_hashes=list(range(1, 7)),
                   shared_prefix_boundary=junction)
    ours.on_new_request(mine)
    assert ours.get_num_new_matched_tokens(mine, 0) == (0, False)
    ours_table = tuple(tuple(b - 1 for b in g) for g in table)  # ids from 0, no null block
    ours.update_state_after_alloc(mine, ours_table, 0)
    out = ours.build_connector_meta(SchedulerOutput(
        (NewRequestData("r0", ours_table),), (), {"r0": len(prompt)}))
    ours_full: set[int] = set()
    ours_window: set[int] = set()
    for job in out.store_jobs.values():
        first = job.src.group_sizes[0]
        ours_full.update(b + 1 for b in job.src.block_ids[:first])
        ours_window.update(b + 1 for b in job.src.block_ids[first:])

    want_window = {table[1][5]} | ({table[1][2]} if junction else set())
    assert vllm_window == want_window, (vllm_window, want_window)
    assert ours_window == vllm_window | {table[1][4]} | ({table[1][1]} if junction else set())
    assert vllm_full == ours_full == set(table[0][:6])


def test_d5_a_hybrid_hit_under_max_load_tokens_reaches_the_cap_from_0_34(
        vllm_ready: Any) -> None:
    """D5 (CONFORMANCE.md): beside a sliding-window group the lookup keeps the token it
    recomputes out of the hit. 0.33 takes it off after the request's `max_load_tokens`
    caps the hit, so a hit capped at 2 blocks stops one token short, which the
    full-attention group rounds down to 1 block; 0.34 takes it off the request's length
    before the cap (feature hybrid_hit_at_the_cap), so the hit is the whole 2 blocks. The
    spec states both (`spec.rules.LastTokenCut`, tests/test_rules.py) and the machine
    checks the release's. This test fails once either release's rule changes."""
    E = vllm_ready
    if not E.has("max_load_tokens"):
        pytest.skip("this vLLM has no per-request max_load_tokens")
    setup = E.make_setup(num_gpu_blocks=32, block_size=BLOCK, sliding_window=BLOCK + 1)
    conn = setup.connector
    prompt = [11 + i for i in range(5 * BLOCK)]
    r0 = E.make_request(setup, "r0", prompt)
    r1 = E.make_request(setup, "r1", prompt, kv_transfer_params={"max_load_tokens": 2 * BLOCK})
    for r in (r0, r1):
        conn.on_new_request(r)
    table0 = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert conn.get_num_new_matched_tokens(r0, 0) == (0, False)
    conn.update_state_after_alloc(r0, E.kv_blocks(table0), 0)
    r0.status = E.request_status().RUNNING
    meta = conn.build_connector_meta(E.scheduler_output(
        setup, new={"r0": (r0, table0)}, num_scheduled_tokens={"r0": 5 * BLOCK}))
    r0.num_computed_tokens = 5 * BLOCK
    conn.update_connector_output(E.connector_output({j: 1 for j in meta.store_jobs}))
    hit, _ = conn.get_num_new_matched_tokens(r1, 0)
    expected = 2 * BLOCK if E.has("hybrid_hit_at_the_cap") else BLOCK
    assert hit == expected, (hit, expected)


def test_f4_a_bounded_hit_of_a_prompt_on_a_chunk_edge_reads_an_unwritten_block(
        vllm_ready: Any) -> None:
    """F4 in CONFORMANCE.md, its second form: a window of one block (16 tokens), so vLLM's
    reachable-block mask and a hit one token short of a block edge agree on one block. But
    a hit bounded by `max_num_new_tokens` (what vLLM's `OffloadingConnector` passes when a
    prefix-cacheable group is not offloaded, the whole hash blocks before the last token,
    OC:164-181) ends a block before the edge of a prompt that ends on a chunk's edge, and
    under 0.33.0's cut a token short of that again (S:862-876): its window reaches the
    block before, which the mask does not keep. So does 0.34.0's hit, which ends on the
    bound's edge, a block before the prompt's: its first computed token's window needs the
    block before. The spec's count (`hit_tail_blocks`) keeps it; `window-aligned-prompt` is
    the checker's scenario.

    The steps of the F4 reproducer with this window: r0 computes four blocks, a reset puts
    its store cursor back, r1 takes r0's freed window blocks, r0's next store writes window
    chunk 1 from its second block alone, and r2 (r0's first four blocks), its hit bounded
    at three blocks, hits 47 tokens (48 from 0.34.0) and loads the chunk's first
    sub-block."""
    E = vllm_ready
    hit, sizes, first, from_the_chunk = _window_chunk_stored_in_part(E, BLOCK, 3 * BLOCK)
    # r2's hit is bounded at its whole blocks before the last token (48 tokens); 0.33.0's
    # window cut takes a token more (47), 0.34.0's came before the bound (48)
    assert hit == 3 * BLOCK - (0 if E.has("hybrid_hit_at_the_cap") else 1)
    # the window group loads block 2 alone (into block 18) from the CPU chunk r0's store
    # wrote from block 9 alone, into its second sub-block: its first was never written
    # (from 0.34.0 it holds the null block's zeros)
    assert sizes[1] == 1 and first[1] == 2 and from_the_chunk, (sizes, first)
