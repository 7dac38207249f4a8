"""KV cache groups: the facts every layer needs about several groups, sliding windows and
chunks of several blocks, stated once (the model, the reference implementation and the
projections read them from here).

A model has one or more KV cache groups, each of a kind: full attention (every block of the
request is attended, so kept until the request ends, and its chunks are looked up as a
prefix) or a sliding window (only the last `sliding_window` tokens are attended: the core
frees the blocks before the window while the request runs, and a lookup needs the window's
chunks before the hit's end). vLLM 0.33.0: `GroupOffloadConfig` (S:240-270),
`get_sliding_window_size_in_chunks` (connector `config.py`:61-73),
`SlidingWindowManager.get_num_skipped_tokens` (`vllm/v1/core/single_type_kv_cache_manager.py`).

A Mamba group in vLLM's "align" cache mode (the mode prefix caching turns on) keeps one
recurrent state per request: the core holds only the block of the state after the last
computed token (and, for one more step, the one before it, the source of that step's copy),
all other positions of its table are the null block, and it frees every block before the
block of token `computed - 1` (`MambaManager.get_num_skipped_tokens`,
`single_type_kv_cache_manager.py`:1971-1976). The connector treats it as a window group of a
one-chunk window (`get_sliding_window_size_in_chunks`, connector `config.py`:79-81): a lookup
needs only the state at the hit's end, rounded down to a chunk (S:872-881), a load fills the
one state block. Its table is not positional, so the connector never stores it from the
table (S:1904-1905): the core hands the state blocks it commits to the connector
(`boundary_state_offloads`), and each hand-off at a chunk boundary becomes a store of that
one block, fenced from the job's creation (`_build_aligned_boundary_store_jobs`,
S:1554-1624).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from spec.rules import LastTokenCut

GroupKind = Literal["full", "sliding", "mamba"]
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding", "mamba")

WINDOW_KINDS: frozenset[str] = frozenset({"sliding", "mamba"})
"""The kinds vLLM's connector treats as window groups (`sliding_window_size_in_chunks` not
None): looked up by a suffix-window scan after the full-attention groups, their blocks before
the window freed by the core while the request runs, their store sources fenced from the
job's creation (S:574-593, S:2002-2051)."""

HANDOFF_KINDS: frozenset[str] = frozenset({"mamba"})
"""The kinds stored only from the core's boundary-state hand-offs, never from the block
table (`requires_cow_source`, S:109-111, S:1904-1905)."""

NULL_BLOCK = -1
"""A block-table position with no block: the core allocated none there (a sliding-window
position before the window) or freed it. vLLM's null block has id 0; here ids start at 0,
so the null block is -1."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def offload_key(block_hash: int, group: int, num_groups: int) -> int:
    """The chunk key of a group: vLLM appends the group index to the block hash
    (`make_offload_key`, B:27-42); here an injective int (one group: the hash itself)."""
    return block_hash * num_groups + group


def group_window_chunks(kind: str, sliding_window: int | None, tokens_per_chunk: int) -> int:
    """The run of hit chunks a window group's scan needs: a Mamba group one (its state)."""
    if kind == "mamba":
        return 1
    assert sliding_window is not None, kind
    return window_chunks(sliding_window, tokens_per_chunk)


def group_load_window_chunks(kind: str, sliding_window: int | None, tokens_per_chunk: int,
                             end_tokens: int) -> int:
    """The chunks a hit of a window group ending at `end_tokens` needs (S:117-134: only a
    sliding window pads for an end inside a chunk)."""
    if kind == "mamba":
        return 1
    assert sliding_window is not None, kind
    return load_window_chunks(sliding_window, tokens_per_chunk, end_tokens)


def group_skipped_blocks(kind: str, sliding_window: int | None, tokens_per_block: int,
                         computed: int) -> int:
    """Leading blocks of a group the core no longer holds once `computed` tokens are
    computed: none for full attention, those before the window for a sliding window, those
    before the block of token `computed - 1` for a Mamba group."""
    if kind == "full":
        return 0
    if kind == "mamba":
        return max(0, computed - 1) // tokens_per_block
    assert sliding_window is not None, kind
    return skipped_blocks(sliding_window, tokens_per_block, computed)


def committed_state_position(boundary: int, tokens_per_block: int) -> int | None:
    """The block position of the Mamba state a step ending at `boundary` computed tokens
    commits, which the core hands to the connector with that boundary; None when the step
    ends inside a block (no state committed: `MambaManager.cache_blocks` caches full blocks
    only, vLLM 0.33.0 `vllm/v1/core/single_type_kv_cache_manager.py`)."""
    if boundary <= 0 or boundary % tokens_per_block:
        return None
    return (boundary - 1) // tokens_per_block


def retention_interval_ok(retention_interval: object, tokens_per_chunk: int) -> bool:
    """vLLM's check of `prefix_cache_retention_interval` beside a window group (S:295-310):
    None, 0 or a positive multiple of the chunk."""
    r = retention_interval
    return r is None or (type(r) is int and r >= 0 and r % tokens_per_chunk == 0)


def contiguous_blocks_for_hit(sliding_window: int, tokens_per_block: int) -> int:
    """The blocks before its end that a hit of a sliding-window group needs
    (`SlidingWindowManager._contiguous_blocks_for_hit`, without EAGLE)."""
    return cdiv(sliding_window - 1, tokens_per_block)


def hit_tail_blocks(sliding_window: int, tokens_per_block: int,
                    last_token_cut: LastTokenCut) -> int:
    """The blocks before a chunk's end that a sliding-window group's hit ending in that
    chunk can read: the window of the first token computed after the hit, for the hit that
    ends furthest before the chunk's edge. That is the hit of a request whose prompt ends on
    the edge: it is bounded to the whole hash blocks before its last token (LAST-TOKEN-BOUND,
    a block before the edge), and under 0.33.0's cut (`LastTokenCut.AFTER_CAPS`, S:872-876)
    it ends one token short of that bound again; 0.34.0 takes the token off before the bound
    (`BEFORE_CAPS`), which already leaves it out. A hit `cut` tokens before the edge computes
    that token first, whose window needs the `window - 1` tokens before it:
    `cdiv(window - 1 + cut, block)` blocks, with `cut = block + 1` under 0.33.0's cut and
    `cut = block` under 0.34.0's. vLLM's mask counts a hit on the edge (cut 0,
    `contiguous_blocks_for_hit`: finding F4)."""
    cut = tokens_per_block + (last_token_cut is LastTokenCut.AFTER_CAPS)
    return cdiv(sliding_window - 1 + cut, tokens_per_block)


def reachable_store_blocks(sliding_window: int, tokens_per_block: int,
                           blocks_per_chunk: int, retention_interval: int | None,
                           boundaries: Sequence[int], start_block: int, end_block: int,
                           last_token_cut: LastTokenCut | None
                           ) -> tuple[bool, ...] | None:
    """Which of a sliding-window group's blocks `start_block <= i < end_block` the store may
    need, because some hit at a chunk-aligned length reads them; None: every block
    (`SlidingWindowManager.reachable_block_mask`, vLLM 0.33.0
    `vllm/v1/core/single_type_kv_cache_manager.py`:1067-1150, as the connector calls it,
    S:1770-1796: alignment at the full-attention chunk, no EAGLE, no decode context
    parallelism). `retention_interval` (vLLM's `prefix_cache_retention_interval`, in tokens):
    None keeps the window's tail of every chunk; 0 keeps only the tails that end at the
    request's `reachable_boundaries` (the replay boundary and the shared-prefix junction),
    each rounded down to a chunk; a multiple of the chunk keeps a tail per interval and
    those.

    The store's final segment (`final_segment_end_block`) changes nothing here: it matters
    only with the dense policy, whose segment is a chunk, and the store's horizon is a
    whole number of chunks.

    Different from vLLM (finding F4): vLLM sizes every tail for a hit that ends on a block
    edge (`contiguous_blocks_for_hit`), but the connector's hits with a window group end
    short of one, and such a hit reads further back (`hit_tail_blocks`, by the release's
    `last_token_cut`). A chunk stored without those blocks (the core had freed them) then
    serves a load of bytes no store wrote. Here the tails count them; `last_token_cut` None
    is vLLM's mask (the fault `Fault.STORE_MASK_IGNORES_SHORT_HITS`)."""
    need = contiguous_blocks_for_hit(sliding_window, tokens_per_block) \
        if last_token_cut is None \
        else hit_tail_blocks(sliding_window, tokens_per_block, last_token_cut)
    tokens_per_chunk = tokens_per_block * blocks_per_chunk
    mask = [False] * (end_block - start_block)
    segment = tokens_per_chunk if retention_interval is None else retention_interval
    if segment:
        per_segment = segment // tokens_per_block
        if need >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i % per_segment >= per_segment - need:
                mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in boundaries:
            end = boundary // tokens_per_chunk * tokens_per_chunk // tokens_per_block
            for i in range(max(start_block, end - need), min(end_block, end)):
                mask[i - start_block] = True
    return tuple(mask)


def chunk_store_blocks(blocks: Sequence[int], reachable: Sequence[bool] | None
                       ) -> tuple[int, ...] | None:
    """The blocks a store copies of a chunk whose table blocks are `blocks` and whose
    reachable blocks are `reachable` (None: all of them), or None when the chunk is not
    stored: its last block is null, none of its blocks is reachable, or a reachable one is
    null (it would leave a needed part unwritten). A stored chunk copies every block it
    holds, reachable or not; so a chunk whose leading blocks the core already freed is
    stored without them (S:1904-1980, S:2024-2045). A window's null blocks lead its table,
    so the blocks copied are the chunk's last ones."""
    if not blocks or blocks[-1] == NULL_BLOCK:
        return None
    if reachable is None:
        return None if NULL_BLOCK in blocks else tuple(blocks)
    needed_null = any(r and b == NULL_BLOCK for b, r in zip(blocks, reachable, strict=True))
    if needed_null or not any(reachable):
        return None
    return tuple(b for b in blocks if b != NULL_BLOCK)


def storable_chunks(table: Sequence[int], start: int, end: int, blocks_per_chunk: int,
                    reachable: Sequence[bool] | None
                    ) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """For each chunk `start <= c < end` of a group's `table` that a store takes, given the
    reachable blocks from chunk `start` on (`reachable_store_blocks`; None: all): `c`, the
    chunk's table blocks and the blocks the store copies (`chunk_store_blocks`)."""
    bpc = blocks_per_chunk
    for c in range(start, end):
        chunk = tuple(table[c * bpc:(c + 1) * bpc])
        mask = None if reachable is None else reachable[(c - start) * bpc:(c - start + 1) * bpc]
        copied = chunk_store_blocks(chunk, mask)
        if copied is not None:
            yield c, chunk, copied


def reachable_boundaries(prompt_tokens: int, shared_prefix_boundary: int = 0
                         ) -> tuple[int, ...]:
    """The token positions a later request resumes at, whose window tail (a sliding-window
    group) or state (a Mamba group) a sparse retention keeps: the replay boundary, the
    prompt's tokens minus one (`replay_boundaries`, `vllm/v1/core/kv_cache_coordinator.py`:
    65-86, without EAGLE), and the request's shared-prefix junction, if its lookup found one
    (`Request.shared_prefix_boundary`, 0: none). The core sets the junction at each lookup
    (`vllm/v1/core/sched/scheduler.py`:1122-1127): the longest hit of a single group when a
    sparse-retention group's is shorter, a prefix other requests share that the lagging
    group has not kept (`vllm/v1/core/kv_cache_manager.py`:318-328). The core keeps the
    states there (`single_type_kv_cache_manager.py`:510-513) and the connector the window
    tails (S:1853-1857). Only a GPU prefix cache finds junctions: the model's and the
    engine's cores have none, so their requests never have one."""
    if shared_prefix_boundary:
        return prompt_tokens - 1, shared_prefix_boundary
    return (prompt_tokens - 1,)


def state_retained(position: int, tokens_per_block: int, retention_interval: int | None,
                   boundaries: Sequence[int]) -> bool:
    """Whether the core keeps (and so hands off) the Mamba state of block `position`
    (`MambaManager.reachable_block_mask`, `single_type_kv_cache_manager.py`:1549-1606, at
    the core's alignment of a block): every state with dense retention (None) or an
    interval of a block; else the one ending each interval and each one ending at one of
    the request's `reachable_boundaries`, rounded down to a block."""
    if retention_interval is None:
        return True
    per_segment = retention_interval // tokens_per_block
    if retention_interval and per_segment <= 1:
        return True
    if retention_interval and (position + 1) % per_segment == 0:
        return True
    return any(position == b // tokens_per_block - 1 for b in boundaries)


def mamba_chunk_end(start: int, end: int, tokens_per_block: int, prompt_tokens: int,
                    num_tokens: int, max_prefill_tokens: int,
                    shared_prefix_boundary: int = 0) -> int:
    """Where the core ends a chunk it would schedule from `start` to `end` tokens, beside a
    Mamba group in align mode, for a request of `prompt_tokens` prompt and `num_tokens`
    tokens in all: during a prefill (up to the prompt, or all but the last token of a
    restarted request) a chunk ends on a block edge, unless it is the prefill's last chunk
    (or a block is wider than `max_prefill_tokens` and the chunk has not reached the
    block's edge); a chunk starting inside a block stops at that block's edge; no chunk runs
    past the last block edge before the last token, nor past the request's shared-prefix
    junction (`reachable_boundaries`), in whole blocks from `start`, so that the core
    commits and keeps the state there (vLLM 0.33.0 `_mamba_block_aligned_split`,
    `vllm/v1/core/sched/scheduler.py`:546-662, without EAGLE, hash-granular hits, prefill
    checkpoints, or the opt-in `enable_mamba_shared_prefix_checkpoint`, which stops at a
    junction inside a block). At most `start`: no aligned chunk fits."""
    prefill_end = max(prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return end
    bs = tokens_per_block
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= max_prefill_tokens:
            end = aligned
    junction = shared_prefix_boundary
    stops = ((start // bs + 1) * bs if start % bs else 0,
             (num_tokens - 1) // bs * bs,  # the last cacheable block edge
             start + (junction - start) // bs * bs if start < junction < end else 0)
    return min((s for s in stops if start < s < end), default=end)


def handoff_position(boundary: int, tokens_per_block: int, retention_interval: int | None,
                     prompt_tokens: int, shared_prefix_boundary: int = 0) -> int | None:
    """The block position of the Mamba state the core hands off after a step that ends at
    `boundary` computed tokens, in a request of `prompt_tokens` prompt tokens and the
    junction `shared_prefix_boundary` (0: none): the state it commits there
    (`committed_state_position`), if it keeps it (`state_retained` at the request's
    `reachable_boundaries`); None: no hand-off."""
    position = committed_state_position(boundary, tokens_per_block)
    if position is None or not state_retained(
            position, tokens_per_block, retention_interval,
            reachable_boundaries(prompt_tokens, shared_prefix_boundary)):
        return None
    return position


def handoff_positions(computed: int, scheduled: int, resumed: bool, tokens_per_block: int,
                      retention_interval: int | None, prompt_tokens: int,
                      shared_prefix_boundary: int = 0) -> tuple[tuple[int, int], ...]:
    """`(boundary, block position)` of each Mamba state the core hands off for one request in
    one step, in the core's order: if `resumed` (its waiting loop reached the request after
    an async load ended), the state the load ended on, at its `computed` tokens, which it
    offers as it caches the loaded blocks (`_update_waiting_for_remote_kv`, vLLM 0.33.0
    `vllm/v1/core/sched/scheduler.py`:3467-3500); then, if the step schedules `scheduled` > 0
    tokens, the state after them. Each under the retention (`handoff_position`)."""
    ends = ((computed,) if resumed else ()) + ((computed + scheduled,) if scheduled else ())
    out: list[tuple[int, int]] = []
    for boundary in ends:
        position = handoff_position(boundary, tokens_per_block, retention_interval,
                                    prompt_tokens, shared_prefix_boundary)
        if position is not None:  # else the block is not complete, or its state not kept
            out.append((boundary, position))
    return tuple(out)


def window_chunks(sliding_window: int, tokens_per_chunk: int) -> int:
    """A sliding-window group's window in chunks (no extra retained tokens)."""
    return cdiv(sliding_window, tokens_per_chunk)


def load_window_chunks(sliding_window: int, tokens_per_chunk: int, end_tokens: int) -> int:
    """The chunks a hit of a sliding-window group ending at `end_tokens` needs: the window,
    one more when the end falls inside a chunk (`load_window_size_in_chunks`, S:117-134)."""
    pad = -end_tokens % tokens_per_chunk
    return max(window_chunks(sliding_window, tokens_per_chunk),
               cdiv(sliding_window - 1 + pad, tokens_per_chunk))


def skipped_blocks(sliding_window: int, tokens_per_block: int, computed: int) -> int:
    """Leading blocks of a sliding-window group the core no longer needs once `computed`
    tokens are computed: it frees them (computed - window + 1 tokens are skipped)."""
    return max(0, computed - sliding_window + 1) // tokens_per_block


def window_tokens(window_blocks: int, block_size: int) -> int:
    """The sliding window, in tokens of `block_size`-token blocks, that acts as a window of
    `window_blocks` tokens does at one token per block (the model's): a block leaves it
    exactly when the model's does (`skipped_blocks`), it spans as many chunks
    (`window_chunks`), and a hit needs `window_blocks - 1` blocks before its end."""
    return block_size * (window_blocks - 1) + 1


def split_groups(flat: Sequence[int], num_groups: int) -> tuple[tuple[int, ...], ...]:
    """A flat block table (group by group, as `GPULoadStoreSpec` orders blocks, every group
    as long) as one table per group."""
    n = len(flat) // num_groups
    return tuple(tuple(flat[g * n:(g + 1) * n]) for g in range(num_groups))


def window_positions(groups: Sequence[str], length: int, start: int = 0,
                     stop: Callable[[int], int] | None = None) -> Iterator[int]:
    """The indices, in a flat table of `length` blocks over `groups`, of the window groups'
    positions `start <= p < stop(g)` (to the group's end when `stop` is None)."""
    n = length // len(groups)
    for g, kind in enumerate(groups):
        if kind in WINDOW_KINDS:
            end = n if stop is None else min(stop(g), n)
            yield from range(g * n + start, g * n + end)


def freed_positions(groups: Sequence[str], sliding_window: int | None, tokens_per_block: int,
                    length: int, computed: int) -> Iterator[int]:
    """The positions of a flat table of `length` blocks over `groups` that the core frees
    once `computed` tokens are computed: the window groups' positions before their window
    (`sliding_window` is the sliding-window groups' window)."""
    def stop(g: int) -> int:
        window = sliding_window if groups[g] == "sliding" else None
        return group_skipped_blocks(groups[g], window, tokens_per_block, computed)

    return window_positions(groups, length, 0, stop)
