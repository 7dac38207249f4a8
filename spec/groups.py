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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

GroupKind = Literal["full", "sliding"]
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding")

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
                     stop: int | None = None) -> Iterator[int]:
    """The indices, in a flat table of `length` blocks over `groups`, of the sliding-window
    groups' positions `start <= p < stop` (to the group's end when `stop` is None)."""
    n = length // len(groups)
    end = n if stop is None else min(stop, n)
    for g, kind in enumerate(groups):
        if kind == "sliding":
            yield from range(g * n + start, g * n + end)
