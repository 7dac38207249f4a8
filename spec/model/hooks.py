"""The connector's hooks as the model runs them: what each vLLM hook decides and which
trigger it fires (the tables do the rest).

`lookup` is get_num_new_matched_tokens, `alloc` update_state_after_alloc, `build_meta`
build_connector_meta (with the stores it creates), `report` update_connector_output for one
job, `finish` request_finished, `reset` reset_cache.
"""

from __future__ import annotations

from collections.abc import Callable

from spec import job as J
from spec import request as R
from spec.groups import (
    HANDOFF_KINDS,
    NULL_BLOCK,
    WINDOW_KINDS,
    cdiv,
    handoff_positions,
    storable_chunks,
    window_positions,
)
from spec.model import truth
from spec.model.faults import Fault
from spec.model.interpreter import EFFECTS, fire
from spec.model.state import ModelError, World, put_job, put_req, tracked
from spec.rules import LastTokenCut, PartialTailSearch, StoreAdmission


def _open(w: World) -> None:
    w.step_open = True


def lookup(w: World, r: str, local: int = 0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens (S:1210-1277)."""
    req = tracked(w, r)
    if req.state in R.SCHEDULED:
        fire(w, "request", r, "preempt")
        w.preempted_early.add(r)
        req = tracked(w, r)
    _open(w)
    if req.state == R.PREEMPTED_FLUSHING and Fault.LOOKUP_IGNORES_TRANSFER_JOBS not in w.faults:
        fire(w, "request", r, "lookup_blocked")
        return None, False
    if req.state in R.MUST_RECOMPUTE:
        fire(w, "request", r, "lookup_resolved")
        return 0, False
    if req.load_failed:
        hit: int | None = 0  # a faulting load is not retried (S@0.34.0:1411)
    else:
        hit = _hit(w, r, local)
        if hit is not None and w.bounds.partial_tails:
            hit = _tail_hit(w, r, local, hit)
    if hit is None:
        fire(w, "request", r, "lookup_deferred")
        return None, False
    sync = w.bounds.sync_loads and hit > 0
    fire(w, "request", r, "lookup_resolved", hit_tokens=hit, sync=sync)
    return hit, bool(hit) and not sync


def _scan(w: World, keys: list[int], sliding: bool, first: int, window: int) -> int | None:
    """One group's lookup over `keys` (S:773-847): the prefix scan of a full-attention group
    (chunks hit from the start) or the suffix-window scan of a sliding-window group (the end
    of the last run of `window` hits, from the right); None: defer (a chunk still being
    written). A write-pending chunk counts as a hit but defers the answer. The first run,
    at the right edge, may need `first` chunks (a partial rightmost chunk), later runs
    `window`."""
    if not sliding:
        hits, defer = 0, False
        for k in keys:
            ref = w.chunks.get(k)
            if ref is None:
                break
            defer |= ref == -1
            hits += 1
        return None if defer else hits
    run, pending, need = 0, False, first
    for idx in range(len(keys) - 1, -1, -1):
        ref = w.chunks.get(keys[idx])
        if ref is None:
            run, pending, need = 0, False, window
            continue
        pending |= ref == -1
        run += 1
        if run == need:
            return None if pending else idx + need
    return None if pending else run


def _hit(w: World, r: str, local: int) -> int | None:
    """The tokens a lookup finds beyond `local` (`_lookup_complete_chunks`, S:849-1054):
    every group scans its own keys; a group's answer can shorten the hit, which sends the
    others round again until the hit converges; None: defer. The hit never reaches the last
    prompt token (LAST-TOKEN-BOUND)."""
    b = w.bounds
    tpc = b.tokens_per_chunk
    settings = w.template(r).settings
    w.short_hit = False
    w.full_attention_hit = None
    if settings.skip_reading_prefix_cache:
        return 0  # S:1258-1259
    order = tuple(g for g, kind in enumerate(b.groups) if kind not in WINDOW_KINDS) \
        + b.window_groups()
    # LAST-TOKEN-BOUND: the whole hash blocks before the last token (a restarted request's
    # output too), as `OffloadingConnector._max_loadable_tokens` bounds a hit (OC:164-181:
    # the longest prefix of `num_tokens - 1` tokens, in whole hash blocks)
    unit = b.tokens_per_hash
    max_hit = (w.num_tokens(r) - 1) // unit * unit
    cap = settings.max_load_tokens
    if cap is not None:
        max_hit = min(max_hit, local + cap)  # S:867-871
    # With a window group vLLM 0.33 stops the hit one token before the bound (the last
    # prompt token is recomputed for its logprobs, S:872-876): below a block, so here the
    # hit keeps the block but is "short" until a group's answer cuts it to a chunk edge. A
    # Mamba group cuts it at once: its state exists only at chunk edges (S:877-881). 0.34
    # takes that token off the request's length before the caps (S@0.34.0:921-941), which
    # this bound already leaves out: its hit is never short.
    short = bool(b.window_groups()) and b.rules.last_token_cut is LastTokenCut.AFTER_CAPS
    if b.handoff_groups():
        max_hit, short = (max_hit - short) // tpc * tpc, False
    num_hit, defer = 0, False
    todo = order
    while todo:
        looked_sliding, groups, todo = False, todo, ()
        for g in groups:
            sliding = b.groups[g] in WINDOW_KINDS
            keys = w.keys_of(r, g)
            if len(keys) * tpc < max_hit:
                max_hit, short = len(keys) * tpc, False
            if cap is not None:  # whole chunks under a cap (S:917-920)
                max_hit, short = (max_hit - short) // tpc * tpc, False
            if max_hit - local < tpc + short:
                return 0
            if sliding and w.full_attention_hit is None:  # S@0.34.0:992-1001
                w.full_attention_hit = max_hit if len(order) > len(b.window_groups()) \
                    and not defer else 0
            n_chunks = min(cdiv(max_hit, tpc), len(keys))
            start = local // tpc
            first = b.load_window_chunks(g, min(max_hit, n_chunks * tpc)) if sliding else 0
            found = _scan(w, keys[start:n_chunks], sliding, first,
                          b.window_chunks(g) if sliding else 0)
            if found == 0:
                return 0
            if found is None:
                defer = True
            elif tpc * (start + found) < max_hit:
                max_hit, short = tpc * (start + found), False
            new = max_hit - local
            if new < tpc + short:
                return 0
            if new < num_hit:
                if defer:
                    defer, todo = False, order
                elif looked_sliding and not todo:
                    todo = b.window_groups()
            looked_sliding |= sliding
            num_hit = new
    if defer:
        return None
    w.short_hit = short and num_hit > 0
    end = local + num_hit
    for g, kind in enumerate(b.groups):  # a hit chunk an async load still brings (S:1021-1045)
        keys = w.keys_of(r, g)[local // tpc:cdiv(end, tpc)]
        if kind in WINDOW_KINDS:
            keys = keys[-b.load_window_chunks(g, end):]
        if any(k in w.being_loaded for k in keys):
            return None
    return num_hit


def _tail_hit(w: World, r: str, local: int, complete: int) -> int | None:
    """The partial-tail refinement of a hit of `complete` tokens (`_lookup`, S:1068-1152):
    from the furthest hash boundary the hit may reach inside the next block down to the
    complete hit's end, the first boundary whose keys every group holds ready extends the
    hit to it. A write-pending key met before a miss defers the lookup, if the complete hit
    is empty (a hit of complete chunks is answered at once). The next block is the one after
    the complete hit, or, under `PartialTailSearch.FROM_FULL_ATTENTION_PREFIX` (0.34.0), the
    one after the full-attention groups' hit (`World.full_attention_hit`)."""
    t = w.template(r)
    if t.settings.skip_reading_prefix_cache:
        return complete
    b = w.bounds
    tpb = b.tokens_per_block
    edge = anchor = local + complete
    pending = False
    prefix = b.rules.partial_tail_search is PartialTailSearch.FROM_FULL_ATTENTION_PREFIX
    fa = w.full_attention_hit or 0
    if prefix and fa > edge:
        # a Mamba state missing at a chunk edge shortened the complete hit: search past the
        # full-attention prefix, unless a chunk of it between the two is being loaded (then
        # an empty hit defers, S@0.34.0:1176-1189)
        between = (k for g, kind in enumerate(b.groups) if kind not in WINDOW_KINDS
                   for k in w.keys_of(r, g)[edge // tpb:fa // tpb])
        pending = any(k in w.being_loaded for k in between)
        if not pending:
            anchor = fa
    furthest = min(t.tokens - 1, anchor + tpb - 1)
    if t.settings.max_load_tokens is not None:
        furthest = min(furthest, local + t.settings.max_load_tokens)
    if furthest <= edge:
        return complete  # no boundary to search (S@0.34.0:1210-1211)
    for boundary in range(furthest, edge, -1):
        if boundary <= anchor and boundary % tpb == 0:
            continue  # a complete chunk, which the complete-chunk lookup missed
        keys = [w.tail_key(r, boundary, g) for g in range(len(b.groups))]
        refs = [w.chunks.get(k) for k in keys]
        missing = next((i for i, ref in enumerate(refs) if ref is None), len(refs))
        here = any(ref == -1 for ref in refs[:missing])
        if prefix:  # a key another load still brings (S@0.34.0:1303-1309)
            here |= any(k in w.being_loaded for k in keys[:missing + 1])
        if missing == len(refs) and not here:
            return boundary - local
        pending |= here
    return None if pending and complete == 0 else complete


def alloc(w: World, r: str, blocks: tuple[int, ...], hit: int, local: int = 0) -> None:
    """update_state_after_alloc (S:1351-1500): per group, the load fills the non-null blocks
    from the first fresh one up to the hit's end (a sliding-window group only its window),
    from the chunks that cover them; the store cursor moves past the loaded chunks."""
    held = tuple(b for b in blocks if b != NULL_BLOCK)
    w.batch_alloc.update(held)
    if hit == 0:
        put_req(w, tracked(w, r)._replace(hit=None))
        return
    req = tracked(w, r)
    trigger = "load_sync" if req.sync_reserved else "load_async"
    b = w.bounds
    bpc, tpc = b.blocks_per_chunk, b.tokens_per_chunk
    end = local + hit
    tail = b.partial_tails and end % tpc != 0  # a partial-tail hit (S:1374-1377)
    last = b.blocks_of(end)
    end_chunk = cdiv(end, tpc)
    if Fault.TAIL_LOAD_ROUNDS_DOWN in w.faults and tail:
        last = end_chunk = end // tpc
    keys: list[int] = []
    dst: list[int] = []
    placements: list[tuple[int, int]] = []
    reads: list[tuple[int, frozenset[int]]] = []
    for g in range(len(b.groups)):
        table = w.group_blocks(blocks, g)
        first = next((i for i in range(b.blocks_of(local), last) if table[i] != NULL_BLOCK),
                     last)
        if first < last:
            group_keys = w.keys_of(r, g)[first // bpc:end_chunk - tail]
            if tail:  # the boundary's key, last (S:1428-1442)
                group_keys.append(w.tail_key(r, end, g))
            keys += group_keys
            dst += table[first:last]
            placements += ((k, min(last, (first // bpc + i + 1) * bpc) - 1)
                           for i, k in enumerate(group_keys))
            for i, k in enumerate(group_keys):  # the blocks of each chunk it reads
                c = first // bpc + i
                reads.append((k, frozenset(p - c * bpc for p in range(
                    max(first, c * bpc), min(last, (c + 1) * bpc)))))
    fire(w, "request", r, trigger, keys=tuple(keys), block_ids=tuple(dst),
         end_chunk=end_chunk, sync=req.sync_reserved)
    truth.placed(w, placements)
    truth.read(w, reads)


def build_meta(w: World, new: dict[str, tuple[int, ...]], cached: dict[str, tuple[int, ...]],
               sched: dict[str, int], finished: frozenset[str],
               preempted: frozenset[str],
               given: dict[str, tuple[tuple[int, int, int], ...]] | None = None) -> None:
    """build_connector_meta (S:2103-2196), same order as the implementation; `given`: the
    core's boundary-state hand-offs of the step (`handoffs`)."""
    _open(w)
    for r, blocks in [*new.items(), *cached.items()]:
        w.batch_alloc.update(blocks)
        cur = tracked(w, r)
        table = blocks if r in new else w.extend_table(cur.blocks, blocks)
        if cur.state in R.SCHEDULED:
            put_req(w, cur._replace(blocks=table))
        else:  # the table says from where a request may be scheduled
            fire(w, "request", r, "schedule", block_ids=table)
    if w.bounds.window_groups():
        for r, n in sched.items():
            put_req(w, tracked(w, r)._replace(window_end=w.core[r].computed + n))
    _forget_reallocated_window_blocks(w, set(new), {
        r: len(w.group_blocks(blocks, 0)) for r, blocks in cached.items()})
    for r in sorted(preempted - w.preempted_early):
        opt = w.reqs.get(r)
        if opt is not None and opt.state in R.PREEMPT_FLUSHED:
            fire(w, "request", r, "preempt")
    for b in sorted(w.batch_alloc):
        if Fault.REALLOC_SKIPS_FENCE in w.faults:
            break
        for jid in sorted(w.block_fence.get(b, frozenset())):
            if jid in w.jobs:
                fire(w, "job", jid, "flush")
    limit = w.bounds.timeout_steps  # after scheduling, preemption and fences, as the impl
    if limit is not None:
        for jid in sorted(w.jobs):
            aged = w.jobs.get(jid)
            if aged is not None and aged.age is not None and aged.age >= limit:
                truth.failed_copy(w, jid)  # its data never confirmed
                fire(w, "job", jid, "time_out")
    _store_boundaries(w, given or {})
    _store_tails(w, given or {})
    for r in [*sched, *sorted(finished)]:
        opt = w.reqs.get(r)
        if opt is not None and opt.state in R.STORE_CANDIDATES:
            _store(w, r, sched.get(r, 0))
    for jid in sorted(w.batch_jobs):
        shipped = w.jobs.get(jid)
        if shipped is not None and shipped.state in J.TO_SHIP:
            fire(w, "job", jid, "ship")
    for r in sorted(finished):
        opt = w.reqs.get(r)
        if opt is not None and opt.state == R.FINISHED_PENDING_FINAL:
            fire(w, "request", r, "finalize")
    _end_step(w)


def _every_group(end: int) -> Callable[[int], int]:
    """The same table end for every group (`window_positions`' `stop`)."""
    return lambda _g: end


def _forget_reallocated_window_blocks(w: World, full_tables: set[str],
                                      grown: dict[str, int]) -> None:
    """A sliding-window block the core freed (before the window) and handed out again in
    this step is stale in its old request's table: from the store cursor to the table's
    end before the step extended it (by `grown[r]` blocks a group) it is zeroed, so no
    store reads it (`_update_req_states`, S:1533-1552). A table the step replaced whole has
    nothing stale."""
    b = w.bounds
    if not b.window_groups() or not w.batch_alloc:
        return
    bpc = b.blocks_per_chunk
    for r, req in list(w.reqs.items()):
        if r in full_tables or not req.blocks:
            continue  # a table given whole in this step, or none yet (not scheduled)
        table = list(req.blocks)
        end = len(table) // len(b.groups) - grown.get(r, 0)
        for i in window_positions(b.groups, len(table), req.cursor * bpc, _every_group(end)):
            if table[i] in w.batch_alloc:
                table[i] = NULL_BLOCK
        if tuple(table) != req.blocks:
            put_req(w, req._replace(blocks=tuple(table)))


def _offloadable(w: World, r: str, tokens: int) -> int:
    """`tokens` under the request's `max_offload_tokens` and, with `offload_prompt_only`,
    its prompt's end (S:762-771)."""
    t = w.template(r)
    cap = t.settings.max_offload_tokens
    if cap is not None:
        tokens = min(tokens, cap)
    return min(tokens, t.tokens) if w.bounds.offload_prompt_only else tokens


def _store(w: World, r: str, scheduled: int) -> None:
    req = tracked(w, r)
    if req.load_invalid:
        return  # no store reads KV that a failed load invalidated
    core = w.core[r]
    t = w.template(r)
    if req.finished:  # a finished request's last sampled token is never computed
        tokens = core.computed if core.aborted else max(t.tokens, w.num_tokens(r) - 1)
    else:
        tokens = core.computed + scheduled
    tokens = _offloadable(w, r, tokens)
    b = w.bounds
    bpc = b.blocks_per_chunk
    start = req.cursor
    n = 0
    offered: list[int] = []
    source: dict[int, tuple[tuple[int, ...], bool]] = {}
    position: dict[int, int] = {}
    offsets: dict[int, frozenset[int]] = {}
    for g, kind in enumerate(b.groups):  # per group, S:1859-1982
        keys = w.keys_of(r, g)
        table = w.group_blocks(req.blocks, g)
        n = min(tokens // b.tokens_per_chunk, len(table) // bpc, len(keys))
        if kind in HANDOFF_KINDS:
            continue  # its table is not positional: stored from hand-offs (S:1904-1905)
        reach = b.reachable_blocks(g, t.tokens, start * bpc, n * bpc,
                                   Fault.STORE_MASK_IGNORES_SHORT_HITS not in w.faults)
        # skipped: a chunk with a needed block the core freed or handed out again, or none
        for c, chunk, copied in storable_chunks(table, start, n, bpc, reach):
            offered.append(keys[c])
            source[keys[c]] = (copied, kind in WINDOW_KINDS)
            position[keys[c]] = (c + 1) * bpc - 1
            offsets[keys[c]] = frozenset(i for i, x in enumerate(chunk) if x != NULL_BLOCK)
    if start >= n:
        return
    candidates = _prepare_store(w, r, offered)
    if candidates is None:
        return
    if not candidates:
        put_req(w, tracked(w, r)._replace(cursor=n))
        return
    blocks = tuple(x for c in candidates for x in source[c][0])
    fenced = tuple(x for c in candidates if source[c][1] for x in source[c][0])
    fire(w, "request", r, "store", keys=tuple(candidates), block_ids=blocks,
         fenced_block_ids=fenced, end_chunk=n)
    truth.placed(w, ((c, position[c]) for c in candidates))
    truth.written(w, ((c, offsets[c]) for c in candidates))


def _prepare_store(w: World, r: str, offered: list[int]) -> list[int] | None:
    """The manager's `prepare_store` of the chunks `offered` (M:254-336): those not yet
    stored and admitted, with room made by evicting unpinned chunks; None: no room
    (`store_alloc_failed` fired)."""
    b = w.bounds
    candidates = [c for c in offered if c not in w.chunks]
    if b.store_threshold > 1 and offered:  # store admission (M:129-148, M:282-291)
        counted: frozenset[int] = frozenset()
        if b.rules.store_admission is StoreAdmission.PER_REQUEST:
            # once per request and generation (M@0.34.0:133-159, M@0.34.0:290-298)
            req = tracked(w, r)
            counted = req.counted
            put_req(w, req._replace(counted=counted | frozenset(offered)))
        for k in offered:
            if k not in counted:
                w.offers[k] = min(w.offers.get(k, 0) + 1, b.store_threshold)
        candidates = [c for c in candidates if w.offers.get(c, 0) >= b.store_threshold]
    if not candidates:
        return candidates
    if tracked(w, r).signaled:
        w.stores_after_signal.append(r)
    free = (b.cpu_chunks - len(w.chunks) - sum(j.held_slots for j in w.held.values()))
    need = len(candidates) - free
    if need > 0:
        pinned_ok = Fault.EVICT_PINNED_CHUNKS in w.faults
        evictable = sorted(c for c, ref in w.chunks.items()
                           if (ref == 0 or (pinned_ok and ref > 0)) and c not in offered)
        if need > len(evictable):
            fire(w, "request", r, "store_alloc_failed")
            return None
        victims = w.choose_victims(evictable, need)
        for c in victims:
            del w.chunks[c]
    for c in candidates:
        w.chunks[c] = -1
    return candidates


def handoffs(w: World, sched: dict[str, int], resumed: frozenset[str] = frozenset()
             ) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """The boundary states the core hands to the connector in this step
    (`boundary_state_offloads`, vLLM `vllm/v1/core/sched/output.py`:214-228), as
    `(group, block, boundary)`: for each scheduled request whose step completes a block, each
    Mamba group's state block after the step's last token (`MambaManager.cache_blocks`
    commits a state at every block it completes); and for each request in `resumed` (an
    async load ended and the core's waiting loop reaches it in this step), the state the load
    ended on, which the core offers as it caches the loaded blocks (`_update_waiting_for_
    remote_kv`, CS:3467-3500, then `MambaManager.cache_blocks`, vLLM `vllm/v1/core/
    single_type_kv_cache_manager.py`:1978-2025), before the step's own. Both obey the
    retention (`spec.groups.handoff_positions`). The CPU cache holds a loaded state already, so its
    hand-off makes no store unless a reset (or an eviction) emptied the chunk since the load
    (CONFORMANCE.md, D4)."""
    b = w.bounds
    out: dict[str, tuple[tuple[int, int, int], ...]] = {}
    for r in sorted({*sched, *resumed}):
        core = w.core[r]
        entries = tuple(
            (g, block, boundary)
            for boundary, position in handoff_positions(
                core.computed, sched.get(r, 0), r in resumed, b.tokens_per_block,
                b.retention_interval, w.template(r).tokens)
            for g in b.handoff_groups()
            if (block := w.group_blocks(core.blocks, g)[position]) != NULL_BLOCK)
        if entries:
            out[r] = entries
    return out


def stores_handoffs(w: World, state: str) -> bool:
    """Whether the connector stores a hand-off of a request in `state`: the table has a
    `store` row from there (vLLM stores a hand-off of any request it tracks, S:1554-1624;
    the table says in which states that happens)."""
    return bool(w.tables.rows("request", state, "store"))


def _store_boundaries(w: World, given: dict[str, tuple[tuple[int, int, int], ...]]) -> None:
    """`_build_aligned_boundary_store_jobs` (S:1554-1624): a hand-off at a chunk boundary
    within the offloadable tokens becomes a store of its one block into the chunk that ends
    there, fenced from the job's creation; the store cursor stays."""
    tpc = w.bounds.tokens_per_chunk
    for r, entries in given.items():
        for g, block, boundary in entries:
            req = w.reqs.get(r)
            if req is None or not stores_handoffs(w, req.state) or req.load_invalid:
                continue
            if boundary % tpc or boundary > _offloadable(w, r, w.num_tokens(r)):
                continue
            key = w.keys_of(r, g)[boundary // tpc - 1]
            stored = _prepare_store(w, r, [key])
            if stored:
                fenced = () if Fault.HANDOFF_STORE_SKIPS_FENCE in w.faults else (block,)
                fire(w, "request", r, "store", keys=(key,), block_ids=(block,),
                     fenced_block_ids=fenced, end_chunk=req.cursor)
                truth.placed(w, ((key, boundary // w.bounds.tokens_per_block - 1),))
                # the state fills the last block of its chunk
                truth.written(w, ((key, frozenset({w.bounds.blocks_per_chunk - 1})),))


def tail_handoffs(w: World, new: dict[str, tuple[int, ...]], sched: dict[str, int]
                  ) -> tuple[dict[str, tuple[tuple[int, int, int], ...]],
                             tuple[tuple[int, int], ...]]:
    """The partial tails the core hands off in this step (vLLM's Mamba manager in align
    mode, `vllm/v1/core/single_type_kv_cache_manager.py`:1880-1910, 2085-2135): a request
    whose own steps reached its prompt's tail boundary (`Bounds.tail_boundary`) committed
    its Mamba states there; as it is scheduled on, the core copies each on write into a
    fresh block and hands that block off with the boundary, `(group, block, boundary)`.
    A request that loaded its tail (admitted in this step, or resumed after an async load)
    has it keyed already: nothing is handed off. The copy's block comes from the free pool
    and goes back to it once the step is built; with no free block, no hand-off (vLLM's
    core would not schedule the request). Returns the hand-offs and the copies, as
    `(source block, copy's block)` (vLLM's `kv_cache_block_copies`)."""
    b = w.bounds
    out: dict[str, tuple[tuple[int, int, int], ...]] = {}
    made: list[tuple[int, int]] = []
    for r in sorted(sched):
        core = w.core[r]
        boundary = b.tail_boundary(w.template(r).tokens)
        if r in new or boundary is None or core.computed != boundary:
            continue
        groups = b.handoff_groups()
        if len(w.free_blocks) < len(groups):
            continue
        copies = sorted(w.free_blocks)[:len(groups)]
        w.free_blocks.difference_update(copies)
        w.batch_alloc.update(copies)  # a copy's destination (S:1530-1531)
        out[r] = tuple((g, block, boundary) for g, block in zip(groups, copies, strict=True))
        made += ((w.group_blocks(core.blocks, g)[boundary // b.tokens_per_block], block)
                 for g, block in zip(groups, copies, strict=True))
    return out, tuple(made)


def _store_tails(w: World, given: dict[str, tuple[tuple[int, int, int], ...]]) -> None:
    """`_build_partial_tail_store_jobs` (S:1626-1760): a hand-off inside a block becomes one
    store of every group's block the boundary falls in (the Mamba group's copy, the others'
    table block), under the boundary's keys, all fenced from the job's creation; the store
    cursor stays. vLLM asserts the boundary is within the request's offloadable tokens
    (S:1662-1668); here a boundary past `max_offload_tokens` is not stored."""
    b = w.bounds
    tpb = b.tokens_per_block
    for r, entries in sorted(given.items()):
        tails = [(g, block, boundary) for g, block, boundary in entries if boundary % tpb]
        req = w.reqs.get(r)
        if not tails or req is None or not stores_handoffs(w, req.state) or req.load_invalid:
            continue
        boundary = tails[0][2]
        if boundary > _offloadable(w, r, w.template(r).tokens):
            continue
        position = boundary // tpb
        copy_of = {g: block for g, block, _ in tails}
        sources: dict[int, int] = {}
        for g in range(len(b.groups)):
            if g in copy_of:
                sources[w.tail_key(r, boundary, g)] = copy_of[g]
                continue
            table = w.group_blocks(req.blocks, g)
            if position >= len(table) or table[position] == NULL_BLOCK:
                break
            sources[w.tail_key(r, boundary, g)] = table[position]
        else:
            stored = _prepare_store(w, r, list(sources))
            if stored:
                blocks = tuple(sources[k] for k in stored)
                fire(w, "request", r, "store", keys=tuple(stored), block_ids=blocks,
                     fenced_block_ids=blocks, end_chunk=req.cursor)
                truth.placed(w, ((k, position) for k in stored))


def _end_step(w: World) -> None:
    for jid in w.to_flush:
        j = w.jobs.get(jid) or w.held.get(jid)
        if j is not None:
            put_job(w, j._replace(flush_shipped=True))
    w.to_flush.clear()
    limit = w.bounds.timeout_steps
    for jid, j in list(w.jobs.items()):
        if j.age is not None:  # steps since shipped, capped where it stops mattering
            w.jobs[jid] = j._replace(age=min(j.age + 1, limit) if limit else 1)
    for r, req in list(w.reqs.items()):
        if req.hit is not None or req.sync_reserved:
            w.reqs[r] = req._replace(hit=None, sync_reserved=False)
    w.batch_jobs.clear()
    w.batch_loads.clear()
    w.batch_alloc.clear()
    w.preempted_early.clear()
    w.reset_since_step = False
    w.step_open = False


def report(w: World, jid: int, done: int, failed: int) -> None:
    """update_connector_output for one job's reports (S:2218-2310)."""
    if Fault.AGGREGATE_COUNTS_ONCE in w.faults:  # a summed count {id: n} taken as one report
        done, failed = min(done, 1), min(failed, 1)
    if jid not in w.jobs and jid not in w.held:
        raise ModelError(f"job {jid} is due no report")
    stale = jid in w.held and w.held[jid].state == J.STALE
    if done:
        fire(w, "job", jid, "ack", count=done)
    if failed:
        fire(w, "job", jid, "fail", count=failed)
    if stale:
        fire(w, "fence", None, "stale_report")


def finish(w: World, r: str) -> None:
    if r not in w.reqs:
        fire(w, "request", r, "finish_untracked")
        return
    put_req(w, tracked(w, r)._replace(finished=True))
    fire(w, "request", r, "finish")
    if Fault.SIGNAL_BEFORE_FINAL_STORE in w.faults:
        EFFECTS["signal_request_finished"](w, r)


def reset(w: World) -> None:
    live = len(w.jobs) + sum(1 for j in w.held.values() if j.state == J.TIMED_OUT)
    for r in sorted(w.reqs):
        held = w.reqs[r].jobs
        if held and Fault.RESET_KEEPS_TRANSFER_JOBS in w.faults:
            # vLLM before PR #48102: the jobs leave the table, the request is left as it
            # was, its transfer_jobs naming them (it waits for ends no report can bring)
            for jid in sorted(held & w.jobs.keys()):
                fire(w, "job", jid, "reset")
            put_req(w, tracked(w, r)._replace(cursor=0, hit=None))  # S:2429-2433 did that
            continue
        fire(w, "request", r, "reset")
    for jid in sorted(j.id for j in w.held.values() if j.state == J.TIMED_OUT):
        fire(w, "job", jid, "reset")
    w.chunks.clear()
    for r, req in w.reqs.items():  # a new cache generation (M@0.34.0:161-172, 459-466)
        if req.counted:
            w.reqs[r] = req._replace(counted=frozenset())
    if Fault.RESET_KEEPS_STALE_THRESHOLD not in w.faults:
        w.threshold = w.counter
    fire(w, "fence", None, "reset", live_jobs=live)
    w.being_loaded.clear()
    w.block_fence.clear()
    w.reset_since_step = True

