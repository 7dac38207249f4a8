"""The compiled twin against `spec.model`: the same reachable states, the same successors,
the same progress predicates and fairness classes, the same verdicts. The compiled checker is
what CI runs; these tests are why its answers are the model's."""

from __future__ import annotations

import ctypes
import dataclasses
import random
from collections import Counter, deque

import pytest

from spec import model as M
from spec.checker import CheckResult, canonical_event, check_model
from spec.groups import GroupKind
from spec.model.hooks import lookup
from spec.progress import PROGRESS
from spec.rules import VLLM_0_34
from spec.scenarios import SCENARIOS, by_name, hunt_bounds, parse_bounds
from statemachine.checker import check, compiled, gen
from statemachine.checker.compiled import CompiledUnavailable

pytestmark = pytest.mark.exhaustive

DEEP_SCENARIOS = ("orphaned-load-fails-0.34", "sync-load-fails-after-reset",
                  "loaded-states-of-two-groups", "partial-tails-0.34")
"""The four largest of these (20 s and more each), left to `make check-groups` with the
other larger comparisons (`DEEP_BOUNDS`)."""

SMALL = ("late-reports", "two-resets", "failures", "sync-load-fails-after-reset",
         "failed-load-not-retried", "store-admission", "store-admission-per-request",
         "orphaned-load-fails-0.34", "window-partial-chunk", "window-retention",
         "window-aligned-prompt", "window-only", "hybrid-mamba", "loaded-state-handoff",
         "loaded-states-of-two-groups", "partial-tails", "partial-tails-0.34")


def _python_states(b: M.Bounds) -> tuple[set[M.ModelState], int]:
    """Every canonical state of `spec.model` within `b`, and the transitions between them."""
    s0 = M.canonical(M.initial(b))
    seen = {s0}
    queue = deque([s0])
    edges = 0
    while queue:
        s = queue.popleft()
        for _ev, nxt, _calls, _w in M.successors(s):
            assert not isinstance(nxt, M.ModelError), nxt
            edges += 1
            k = M.canonical(nxt)
            if k not in seen:
                seen.add(k)
                queue.append(k)
    return seen, edges


def _same_state_spaces(b: M.Bounds) -> None:
    """The compiled twin takes `b`, and both models reach the same states (byte for byte in
    the C encoding) over the same number of transitions."""
    assert compiled.fits(b) is None
    states, edges = _python_states(b)
    assert {compiled.encode(s) for s in states} == set(compiled.all_states(b))
    run = compiled.search(b, liveness=False)
    assert (run.states, run.edges) == (len(states), edges)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.deep) if n in DEEP_SCENARIOS else n for n in SMALL])
def test_the_same_reachable_states_and_transitions(name: str) -> None:
    _same_state_spaces(by_name(name).bounds)


DECODING = {
    "one-request-reset-failure": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=1, failures=1,
        preemptions=1, decode_tokens=2),
    "prompt-only": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=1, failures=1,
        preemptions=1, decode_tokens=2, offload_prompt_only=True),
    "two-requests-settings": M.Bounds(
        requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=4, resets=0, failures=0,
        preemptions=1, decode_tokens=1, request_settings=(
            M.RequestSettings(max_load_tokens=1, max_offload_tokens=2),
            M.RequestSettings(skip_reading_prefix_cache=True))),
    "timeouts-without-room": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=3, resets=1, failures=1,
        preemptions=1, decode_tokens=3, timeout_steps=2),
}
"""Decoding bounds small enough for the Python model's whole state space: output keys beside
the prompt's, request settings, a finished request's commit point, timeouts, and a request
whose output outgrows the GPU (a liveness verdict both models reach)."""

MULTI_BLOCK = {
    "chunks-of-3": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1, failures=1,
        preemptions=1, blocks_per_chunk=3),
    "chunks-of-2-decoding": M.Bounds(
        requests=1, tokens=4, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, blocks_per_chunk=2, decode_tokens=2),
    "caps-inside-a-chunk": M.Bounds(
        requests=2, tokens=4, workers=1, cpu_chunks=2, gpu_blocks=5, resets=0, failures=0,
        preemptions=1, blocks_per_chunk=2, request_settings=(
            M.RequestSettings(max_load_tokens=3, max_offload_tokens=3),)),
}
"""Chunks of several blocks: a hit that ends inside its last chunk, a chunk no prompt fills,
whole chunks under a cap, an output that completes a chunk."""

MULTI_TOKEN_BLOCKS = {
    "partial-last-block": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1, failures=1,
        preemptions=1, tokens_per_block=2),
    "blocks-of-2-decoding": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, decode_tokens=2),
    "blocks-of-3-caps": M.Bounds(
        requests=2, tokens=4, workers=1, cpu_chunks=2, gpu_blocks=4, resets=0, failures=0,
        preemptions=1, tokens_per_block=3, decode_tokens=2, request_settings=(
            M.RequestSettings(max_load_tokens=4, max_offload_tokens=3),)),
    "eight-tokens": M.Bounds(
        requests=1, tokens=6, workers=1, cpu_chunks=3, gpu_blocks=5, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, decode_tokens=2),
    "chunks-of-2-blocks-of-2": M.Bounds(
        requests=1, tokens=5, workers=1, cpu_chunks=2, gpu_blocks=3, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, blocks_per_chunk=2, decode_tokens=1),
}
"""Blocks of several tokens: a prompt whose last block is partial (never stored, never hit),
a hit in whole blocks below the last token, an output token that starts a block or fills
one, caps that end inside a block, chunks of several multi-token blocks."""


BEYOND_ONE_BLOCK_PROMPTS = {**DECODING, **MULTI_BLOCK, **MULTI_TOKEN_BLOCKS}


DEEP_BOUNDS = frozenset({
    "eight-tokens", "two-groups-eviction", "two-groups-decoding", "two-groups-settings",
    "two-groups-0.34", "three-groups-18-keys", "two-groups-admission-20-keys",
    "window-two-prompts-reset", "window-eviction", "window-first", "window-seven-tokens",
    "window-caps", "window-chunks-of-2-retention-2", "window-3-chunks-of-2",
    "mamba-decoding", "mamba-chunks-of-2", "mamba-retention-0", "mamba-caps", "mamba-0.34",
    "mamba-alone", "mamba-blocks-of-2", "tails-decoding", "tails-mamba-alone"})
"""Whole-space comparisons of a second or more each, left to `make check-groups` (marker
`deep`) so that `make test` stays under ten minutes; `make test` keeps the smaller bounds
of each kind and compares successors on sampled states of every compiled scenario."""


def _bounds(names: dict[str, M.Bounds]) -> list[object]:
    return [pytest.param(n, marks=pytest.mark.deep) if n in DEEP_BOUNDS else n for n in names]


FULL: tuple[GroupKind, ...] = ("full", "full")
FULL_GROUPS = {
    "two-groups-reset-failure": M.Bounds(
        requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=0, groups=FULL),
    "two-groups-eviction": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=0, failures=1,
        preemptions=0, groups=FULL),
    "two-groups-decoding": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, decode_tokens=2, groups=FULL),
    "two-groups-chunks-of-2": M.Bounds(
        requests=1, tokens=4, workers=1, cpu_chunks=3, gpu_blocks=8, resets=1, failures=1,
        preemptions=1, blocks_per_chunk=2, groups=FULL),
    "two-groups-blocks-of-2": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=0, failures=1,
        preemptions=1, tokens_per_block=2, groups=FULL),
    "two-groups-sync-timeouts": M.Bounds(
        requests=1, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=4, resets=1, failures=1,
        preemptions=0, sync_loads=True, timeout_steps=2, groups=FULL),
    "two-groups-settings": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=1, failures=0,
        preemptions=0, groups=FULL, request_settings=(
            M.RequestSettings(max_load_tokens=1, max_offload_tokens=2),
            M.RequestSettings(skip_reading_prefix_cache=True))),
    "two-groups-0.34": M.Bounds(
        requests=2, tokens=2, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=0, groups=FULL, rules=VLLM_0_34),
    "three-groups": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, groups=("full", "full", "full")),
    "three-groups-18-keys": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=9, resets=0, failures=1,
        preemptions=0, groups=("full", "full", "full")),
    "two-groups-admission-20-keys": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=8, resets=1, failures=0,
        preemptions=0, decode_tokens=2, store_threshold=2, groups=FULL, rules=VLLM_0_34),
}
"""Several full-attention groups: a key per group at each chunk, each group's part of a flat
table, a table that grows by a block per group, the lookup's scans per group, eviction that
takes one group's key of a chunk and not the other's, caps, 0.34.0's rules; and more than 16
keys (the last two), whose key sets the encoding writes in 4 bytes, per-request admission
counts among them."""


FS: tuple[GroupKind, ...] = ("full", "sliding")
WINDOWS = {
    "window-failure-preemption": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, groups=FS, sliding_window=2),
    "window-two-prompts-reset": M.Bounds(
        requests=2, tokens=2, shared_prefix=False, workers=1, cpu_chunks=4, gpu_blocks=7,
        resets=1, failures=0, preemptions=0, groups=FS, sliding_window=1),
    "window-eviction": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=8, resets=0, failures=1,
        preemptions=0, groups=FS, sliding_window=1),
    "window-first": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=0, failures=1,
        preemptions=0, groups=("sliding", "full"), sliding_window=1),
    "two-windows": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=9, resets=1, failures=1,
        preemptions=1, groups=("full", "sliding", "sliding"), sliding_window=2),
    "window-decoding": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, decode_tokens=2, groups=FS, sliding_window=2),
    "window-blocks-of-2": M.Bounds(
        requests=1, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, groups=FS, sliding_window=3),
    "window-sync-timeouts": M.Bounds(
        requests=1, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=0, sync_loads=True, timeout_steps=2, groups=FS, sliding_window=2),
    "window-seven-tokens": M.Bounds(
        requests=1, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, decode_tokens=2, groups=FS, sliding_window=3),
    "window-caps": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=0, failures=0,
        preemptions=1, groups=FS, sliding_window=2, request_settings=(
            M.RequestSettings(max_load_tokens=2, max_offload_tokens=2),
            M.RequestSettings(skip_reading_prefix_cache=True))),
    "window-caps-0.34": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=0, failures=0,
        preemptions=1, groups=FS, sliding_window=2, rules=VLLM_0_34, request_settings=(
            M.RequestSettings(max_load_tokens=2), M.RequestSettings())),
    "window-blocks-of-2-caps-0.34": M.Bounds(
        requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=8, resets=1, failures=0,
        preemptions=0, tokens_per_block=2, groups=FS, sliding_window=3, rules=VLLM_0_34,
        request_settings=(M.RequestSettings(), M.RequestSettings(max_load_tokens=4))),
    "window-chunks-of-2-retention-2": M.Bounds(
        requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1, failures=1,
        preemptions=0, groups=FS, sliding_window=2, blocks_per_chunk=2, retention_interval=2),
    "window-chunks-of-2-retention-4": M.Bounds(
        requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=0, failures=1,
        preemptions=1, groups=FS, sliding_window=2, blocks_per_chunk=2, retention_interval=4),
    "window-chunks-of-2-decoding": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=1, failures=1,
        preemptions=1, decode_tokens=2, groups=FS, sliding_window=2, blocks_per_chunk=2),
    "window-chunks-of-2-blocks-of-2": M.Bounds(
        requests=1, tokens=7, workers=1, cpu_chunks=3, gpu_blocks=8, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, groups=FS, sliding_window=3, blocks_per_chunk=2),
    "window-3-chunks-of-2": M.Bounds(
        requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1, failures=0,
        preemptions=1, groups=FS, sliding_window=3, blocks_per_chunk=2),
}
"""Sliding-window groups: null positions before the window at admission (one token further
back after a short hit), loads of the window's blocks only, the core's frees as the window
moves, stores that skip a chunk whose block the window left and fence their window sources
at once, a freed block handed to another request and forgotten by the old table, a reset
that forgets the freed positions; a window group alone, first, or two of them; output
tokens, blocks of 2 tokens, 7 tokens of prompt and output, sync loads and timeouts, caps;
0.34.0's rules, whose last-token cut comes before the caps (no hit is short), with a cap on
blocks of one token and of 2 tokens; windows in chunks of 2 and 3 blocks, whose stores write
a chunk the window left in part (the data's truth of INV-23), under retention intervals of a
chunk and of two, with output tokens, blocks of 2 tokens and a window of 3 (chunks of 3
blocks: scenario `window-aligned-prompt`)."""


FM: tuple[GroupKind, ...] = ("full", "mamba")
MAMBA = {
    "mamba-failure-preemption": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=0, failures=1,
        preemptions=1, groups=FM),
    "mamba-reset-failure": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=0, groups=FM),
    "mamba-sync-timeouts": M.Bounds(
        requests=1, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=0, failures=1,
        preemptions=0, sync_loads=True, timeout_steps=2, groups=FM),
    "mamba-retention-2": M.Bounds(
        requests=1, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1, failures=0,
        preemptions=0, retention_interval=2, groups=FM),
    "three-kinds": M.Bounds(
        requests=1, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=9, resets=1, failures=0,
        preemptions=1, groups=("full", "sliding", "mamba"), sliding_window=2),
    "mamba-admission-0.34": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=0,
        preemptions=0, store_threshold=2, groups=FM, rules=VLLM_0_34),
    "mamba-decoding": M.Bounds(
        requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=6, resets=1, failures=0,
        preemptions=1, decode_tokens=2, groups=FM),
    "mamba-chunks-of-2": M.Bounds(
        requests=2, tokens=4, workers=1, cpu_chunks=4, gpu_blocks=8, resets=1, failures=0,
        preemptions=0, blocks_per_chunk=2, groups=FM),
    "mamba-retention-0": M.Bounds(
        requests=2, tokens=4, workers=1, cpu_chunks=4, gpu_blocks=8, resets=0, failures=0,
        preemptions=0, retention_interval=0, groups=FM),
    "mamba-caps": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=0, failures=0,
        preemptions=0, groups=FM, request_settings=(
            M.RequestSettings(max_load_tokens=2, max_offload_tokens=2),
            M.RequestSettings(skip_reading_prefix_cache=True))),
    "mamba-0.34": M.Bounds(
        requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=0,
        preemptions=0, groups=FM, rules=VLLM_0_34),
    "mamba-alone": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=2, gpu_blocks=4, resets=0, failures=1,
        preemptions=1, groups=("mamba",)),
    "mamba-blocks-of-2": M.Bounds(
        requests=1, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, groups=FM),
}
"""Mamba groups in align mode (without partial tails): a table of null positions but the
state's at admission, a state block freed a step after the next is committed, a lookup that
wants the state at the hit's end and cuts the hit to a chunk at once, stores of the core's
hand-offs only (one block each, fenced at once), promotions and WAITING_STORING; beside a
failure, a preemption, a reset, sync loads and timeouts, a sliding window, store admission,
caps, output tokens, 0.34.0's rules, blocks of 2 tokens, a Mamba group alone, chunks of 2
blocks (a hand-off writes only its chunk's last block: the data's truth of INV-23), and
retention intervals of 0 (the replay boundary's state only) and of 2 tokens."""


TAILS = M.Bounds(requests=2, tokens=4, workers=1, cpu_chunks=6, gpu_blocks=8, resets=0,
                 failures=0, preemptions=0, groups=FM, tokens_per_block=2, partial_tails=True)
PARTIAL_TAILS = {
    "tails-failure-preemption": dataclasses.replace(
        TAILS, requests=1, tokens=5, cpu_chunks=4, resets=1, failures=1, preemptions=1),
    "tails-caps": dataclasses.replace(TAILS, request_settings=(
        M.RequestSettings(max_load_tokens=2, max_offload_tokens=2),
        M.RequestSettings(max_load_tokens=3))),
    "tails-blocks-of-3": dataclasses.replace(TAILS, tokens=5, tokens_per_block=3),
    "tails-mamba-first": dataclasses.replace(TAILS, groups=("mamba", "full")),
    "tails-sync": dataclasses.replace(TAILS, sync_loads=True),
    "tails-no-room": dataclasses.replace(TAILS, gpu_blocks=5, preemptions=1),
    "tails-decoding": dataclasses.replace(
        TAILS, requests=1, resets=1, preemptions=1, decode_tokens=2),
    "tails-mamba-alone": dataclasses.replace(
        TAILS, cpu_chunks=3, gpu_blocks=6, resets=1, groups=("mamba",)),
}
"""Partial tails (a hash per token): a hit bounded at the last token rather than its block,
the search of the boundaries inside the next block for every group's tail key, a load that
reads the boundary's key into the block it falls in (the truth of INV-22), the core's
copy-on-write hand-off of the state at the prompt's tail boundary (a block from the free
pool, back after the step; none when no block is free) and its store under the tail keys
beside the full-attention block; with a failure, a preemption and a reset, caps that stop a
tail's search and its store, blocks of 3 tokens, the Mamba group first or alone, sync loads
and output tokens."""


BOUNDS = {**BEYOND_ONE_BLOCK_PROMPTS, **FULL_GROUPS, **WINDOWS, **MAMBA, **PARTIAL_TAILS}


@pytest.mark.parametrize("name", _bounds(BOUNDS))
def test_the_same_reachable_states_and_transitions_beyond_the_scenarios(name: str) -> None:
    """Decoding, chunks of several blocks, blocks of several tokens, several full-attention
    groups, sliding windows, Mamba groups and partial tails, each on bounds of its own."""
    _same_state_spaces(BOUNDS[name])


def test_eviction_splits_a_chunk_between_its_groups() -> None:
    """With three CPU slots for six keys a store evicts one group's key of a chunk and keeps
    the other's, so the groups' prefix scans can answer differently (what the lookup's
    convergence is for)."""
    b = FULL_GROUPS["two-groups-eviction"]
    states, _edges = _python_states(b)
    split = [s for s in states
             if any((M.key(0, pos, 0, 2) in dict(s.chunks)) != (M.key(0, pos, 1, 2)
                                                                 in dict(s.chunks))
                    for pos in range(b.tokens))]
    assert split


def _lookup_state(chunks: dict[tuple[int, int], int], groups: tuple[GroupKind, ...] = FULL,
                  tokens: int = 3, being_loaded: frozenset[tuple[int, int]] = frozenset()
                  ) -> tuple[M.Bounds, M.ModelState]:
    """A request waiting for its first lookup beside CPU chunks `chunks` ((position, group):
    reference count, -1 being written) and chunks an async load brings (`being_loaded`), of
    a `tokens`-token prompt in `groups` (a window of 2 tokens). The chunks are set directly:
    a store that leaves one group's chunk being written and another group's evicted needs
    a long eviction history the bounded search does not reach."""
    b = M.Bounds(requests=1, tokens=tokens, workers=1, cpu_chunks=8, gpu_blocks=12, resets=0,
                 failures=0, preemptions=0, groups=groups, sliding_window=2)
    s, _calls, _w = M.apply(M.initial(b), M.Event("arrive", "r0"))
    n = len(groups)
    return b, dataclasses.replace(
        s, chunks=tuple(sorted((M.key(0, pos, g, n), ref) for (pos, g), ref in chunks.items())),
        being_loaded=frozenset(M.key(0, pos, g, n) for pos, g in being_loaded))


@pytest.mark.parametrize(("chunks", "hit"), [
    ({(0, 0): 0, (0, 1): 0, (1, 0): -1}, 1),
    ({(0, 0): 0, (0, 1): 0, (1, 0): 0, (1, 1): -1}, None),
    ({(0, 0): -1, (0, 1): 0}, None),
    ({(0, 0): 0, (1, 0): 0, (0, 1): 0}, 1),
    ({(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0}, 2),
], ids=["deferral-dropped-by-a-shorter-group", "second-group-writing", "first-chunk-writing",
        "second-group-shorter", "both-whole"])
def test_the_lookup_converges_over_the_groups(chunks: dict[tuple[int, int], int],
                                              hit: int | None) -> None:
    """The first group's scan meets a chunk still being written (defer) and the second
    group's stops before it: the shorter hit drops the deferral and both groups scan again,
    so the lookup answers the shorter hit at once (S:849-1054); both twins agree on every
    successor."""
    b, s = _lookup_state(chunks)
    assert compiled.fits(b) is None
    w = M.World.thaw(s)
    assert lookup(w, "r0")[0] == hit
    s = M.canonical(s)
    assert _successors_c(b, compiled.encode(s)) == _successors_py(s)


ALL_OF_4 = {(pos, g): 0 for pos in range(3) for g in range(3)}


FSS: tuple[GroupKind, ...] = ("full", "sliding", "sliding")


@pytest.mark.parametrize(("groups", "tokens", "chunks", "being_loaded", "hit"), [
    (("sliding", "sliding"), 5, {(2, 0): 0, (3, 0): 0, (0, 1): 0, (1, 1): 0}, (), 0),
    (FSS, 4, {**ALL_OF_4, (2, 1): None, (1, 2): None}, (), 1),
    (FSS, 4, {**ALL_OF_4, (2, 0): -1, (2, 1): None, (2, 2): None}, (), 2),
    (FSS, 4, {**ALL_OF_4, (2, 1): None}, ((0, 2),), None),
    (FSS, 4, {**ALL_OF_4, (2, 1): None}, ((0, 0),), None),
    (FSS, 4, {**ALL_OF_4, (0, 2): None}, ((0, 2),), 3),
], ids=["a-rescanned-window-finds-no-run", "second-window-shorter-rescans-the-windows",
        "deferral-dropped-by-a-window",
        "window-chunk-being-loaded", "full-chunk-being-loaded", "window-needs-no-first-chunk"])
def test_the_lookup_converges_over_full_and_window_groups(
        groups: tuple[GroupKind, ...], tokens: int, chunks: dict[tuple[int, int], int | None],
        being_loaded: tuple[tuple[int, int], ...], hit: int | None) -> None:
    """Sliding windows of 2 tokens: a second window that hits less sends the windows round
    again (two windows over a 5-token prompt: the first, rescanned up to the shorter hit,
    finds no run of a window's hits); beside a full-attention group (4 tokens) a shorter
    window hit drops
    a full-attention group's deferral, a hit chunk an async load brings defers the lookup
    (a window group's only within its window); both twins agree on every successor."""
    b, s = _lookup_state({k: v for k, v in chunks.items() if v is not None},
                         groups, tokens, frozenset(being_loaded))
    assert compiled.fits(b) is None
    assert lookup(M.World.thaw(s), "r0")[0] == hit
    s = M.canonical(s)
    assert _successors_c(b, compiled.encode(s)) == _successors_py(s)


def _events_c(b: M.Bounds, enc: bytes) -> list[int]:
    """The compiled twin's events in `enc`, in the order it tries them."""
    evs = (ctypes.c_uint32 * compiled.MAX_EVENTS)()
    n = compiled.library().lib.kv_events_of(ctypes.byref(compiled.c_bounds(b)), enc, evs)
    return list(evs[:n])


def _successors_c(b: M.Bounds, enc: bytes) -> Counter[tuple[int, bytes | int]]:
    lib = compiled.library().lib
    cb = compiled.c_bounds(b)
    rows, nrows = compiled.rows_of(M.SPEC_TABLES)
    buf = ctypes.create_string_buffer(compiled.ENC_MAX)
    out: Counter[tuple[int, bytes | int]] = Counter()
    for ev in _events_c(b, enc):
        n = lib.kv_step(ctypes.byref(cb), rows, nrows, 0, enc, ev, buf)
        if n == -2:  # not enabled
            continue
        label = ev
        if label & 7 == compiled.EV_STRAY:  # a stray report is a report to the model
            label = (label & ~7) | compiled.EV_REPORT
        out[label, buf.raw[:n] if n >= 0 else n] += 1
    return out


def _successors_py(s: M.ModelState) -> Counter[tuple[int, bytes | int]]:
    out: Counter[tuple[int, bytes | int]] = Counter()
    for ev, nxt, _calls, _w in M.successors(s):
        target: bytes | int = -3 if isinstance(nxt, M.ModelError) else compiled.encode(
            M.canonical(nxt))
        out[compiled.event_label(canonical_event(ev, s)), target] += 1
    return out


def _sample(b: M.Bounds, n: int, seed: int) -> list[M.ModelState]:
    """`n` canonical states reached by random walks (every scenario, cheaply)."""
    rng = random.Random(seed)
    out: list[M.ModelState] = []
    while len(out) < n:
        s = M.canonical(M.initial(b))
        for _ in range(rng.randrange(1, 30)):
            nexts = [x for _e, x, _c, _w in M.successors(s) if not isinstance(x, M.ModelError)]
            if not nexts:
                break
            s = M.canonical(rng.choice(nexts))
        out.append(s)
    return out


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_the_same_successors_of_sampled_states(scenario: object) -> None:
    from spec.scenarios import Scenario

    assert isinstance(scenario, Scenario)
    if compiled.fits(scenario.bounds) is not None:
        pytest.skip(f"the compiled model does not take {scenario.name}: "
                    f"{compiled.fits(scenario.bounds)}")
    for s in _sample(scenario.bounds, 40, seed=len(scenario.name)):
        enc = compiled.encode(s)
        assert _successors_c(scenario.bounds, enc) == _successors_py(s), s
        # the same events offered, in the same order (none that needs a spent budget): a
        # breadth-first search meets states, and so counterexamples, in the same order
        assert [compiled.label_event(ev, scenario.bounds)
                for ev in _events_c(scenario.bounds, enc)] == [
            canonical_event(ev, s) for ev in M.events(s)], s


DECODING_SAMPLED = {
    "timeouts-two-workers": M.Bounds(
        requests=2, tokens=2, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, decode_tokens=2, timeout_steps=1),
    "sync-loads": M.Bounds(
        requests=2, tokens=2, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, decode_tokens=2, sync_loads=True),
    "three-requests-stray-reports": M.Bounds(
        requests=3, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=6, resets=2, failures=1,
        preemptions=2, decode_tokens=2, stray_reports=True),
    "store-admission-0.34": M.Bounds(
        requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=2, decode_tokens=2, store_threshold=2, rules=VLLM_0_34),
    "chunks-of-2-timeouts-sync-loads": M.Bounds(
        requests=2, tokens=4, workers=2, cpu_chunks=3, gpu_blocks=8, resets=1, failures=1,
        preemptions=1, blocks_per_chunk=2, decode_tokens=2, sync_loads=True, timeout_steps=1),
    "blocks-of-2-timeouts-sync-loads": M.Bounds(
        requests=2, tokens=4, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=1, tokens_per_block=2, decode_tokens=2, sync_loads=True, timeout_steps=1),
    "blocks-of-2-store-admission-0.34": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=5, resets=1, failures=1,
        preemptions=2, tokens_per_block=2, decode_tokens=2, store_threshold=2,
        rules=VLLM_0_34),
    "caps-inside-the-output": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=7, resets=1, failures=1,
        preemptions=1, decode_tokens=3, request_settings=(
            M.RequestSettings(max_offload_tokens=4), M.RequestSettings(max_load_tokens=3))),
}
"""Decoding beside every other feature of the compiled model (chunks of several blocks
too), too large for a whole state space in Python: compared state by state on random
walks."""

MAMBA_SAMPLED = {
    "mamba-0.34-failures": M.Bounds(
        requests=2, tokens=2, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1, failures=1,
        preemptions=0, groups=FM, rules=VLLM_0_34),
    "mamba-alone-resets-failures": M.Bounds(
        requests=2, tokens=3, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1, failures=1,
        preemptions=1, groups=("mamba",)),
    "mamba-chunks-of-2-failures-decoding": M.Bounds(
        requests=2, tokens=4, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1, failures=1,
        preemptions=1, blocks_per_chunk=2, decode_tokens=2, groups=FM),
    "mamba-retention-2-two-requests": M.Bounds(
        requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=12, resets=1, failures=1,
        preemptions=0, retention_interval=2, groups=FM),
    "tails-0.34-reset": dataclasses.replace(TAILS, resets=1, rules=VLLM_0_34),
    "tails-sync-failure": dataclasses.replace(
        TAILS, workers=2, resets=1, failures=1, sync_loads=True),
    "three-kinds-decoding-timeouts": M.Bounds(
        requests=2, tokens=3, workers=2, cpu_chunks=4, gpu_blocks=12, resets=1, failures=1,
        preemptions=1, decode_tokens=1, timeout_steps=1, groups=("full", "sliding", "mamba"),
        sliding_window=2),
}
"""Mamba groups and partial tails beside failures, resets and decoding, too large for a
whole state space in Python: compared state by state on random walks."""


@pytest.mark.parametrize("name", [*DECODING_SAMPLED, *MAMBA_SAMPLED])
def test_the_same_successors_of_sampled_decoding_states(name: str) -> None:
    b = {**DECODING_SAMPLED, **MAMBA_SAMPLED}[name]
    assert compiled.fits(b) is None
    for s in _sample(b, 40, seed=len(name)):
        assert _successors_c(b, compiled.encode(s)) == _successors_py(s), s


def test_neither_model_preempts_a_request_that_sampled_its_last_token() -> None:
    """vLLM finishes a request as it samples its last output token: from that sample to
    the model's `finish`, neither twin draws a preemption (one token earlier both do)."""
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=0,
                 failures=0, preemptions=1, decode_tokens=2)
    s = M.initial(b)
    preempt = compiled.event_label(M.Event("preempt", "r0"))
    program = "arrive(r0) ; step(admit=r0) ; step() ; step()"  # a token a step
    for n, ev in enumerate(M.parse_events(program)):
        s, _calls, _w = M.apply(s, ev)
        labels = {label for label, _nxt in _successors_c(b, compiled.encode(s))}
        assert labels == {label for label, _nxt in _successors_py(s)}
        assert (preempt in labels) == (n in (1, 2)), (n, dict(s.core)["r0"])
    assert dict(s.core)["r0"].generated == 2


@pytest.mark.parametrize("name", ["sync-timeouts", "reset-during-transfers", "decoding",
                                  "hybrid", "two-full-groups", "hybrid-mamba",
                                  "loaded-state-handoff"])
def test_the_same_progress_predicates_and_fairness(name: str) -> None:
    b = by_name(name).bounds
    lib = compiled.library().lib
    cb = compiled.c_bounds(b)
    for s in _sample(b, 150, seed=7):
        enc = compiled.encode(s)
        for k, p in enumerate(PROGRESS):
            for r in range(b.requests if p.scope == "request" else 1):
                py = p.waiting(s, f"r{r}") if p.scope == "request" else p.waiting(s)
                assert bool(lib.kv_waiting(ctypes.byref(cb), enc, k, r)) == py, (p.id, r, s)
        for ev in M.events(s):
            klass = M.fair_class(ev, s)
            bits = lib.kv_fair_class(compiled.event_label(canonical_event(ev, s)))
            if ev.kind == "report" and klass is None:  # a stray report: the C label differs
                continue
            assert (bits != 0) == (klass is not None), ev


def _same_finding(py: CheckResult, c: CheckResult) -> None:
    assert py.verdict == c.verdict
    assert py.counterexample is not None and c.counterexample is not None
    assert len(py.counterexample.steps) == len(c.counterexample.steps)
    assert py.counterexample.cycle_start == c.counterexample.cycle_start


@pytest.mark.parametrize("fault", list(M.Fault), ids=lambda f: f.value)
def test_the_same_verdict_for_every_fault(fault: M.Fault) -> None:
    b = hunt_bounds(fault)
    _same_finding(check_model(b, frozenset([fault])), check(b, frozenset([fault])))


@pytest.mark.deep  # about 45 s: `make check-groups`
def test_the_same_lasso_with_an_invariant_switched_off() -> None:
    fault = M.Fault.RESET_KEEPS_TRANSFER_JOBS
    b, off = hunt_bounds(fault), frozenset({"INV-1"})
    _same_finding(check_model(b, frozenset([fault]), without=off),
                  check(b, frozenset([fault]), without=off))


def test_mutated_rows_run_without_a_rebuild() -> None:
    from statemachine.checker.mutation import SpecMutant

    mutant = next(m for m in (SpecMutant("request", i, "drop", e)
                              for i, t in enumerate(M.MACHINES["request"].transitions)
                              for e in t.effects)
                  if m.target == "drop_request_jobs")
    b = by_name("preemption-and-fences").bounds
    _same_finding(check_model(b, tables=mutant.tables()), check(b, tables=mutant.tables()))


def test_bounds_beyond_the_compiled_model_fall_back_to_the_reference() -> None:
    b = parse_bounds("requests=5,tokens=1,resets=0,preemptions=0,failures=0",
                     by_name("late-reports").bounds)
    assert compiled.fits(b) is not None
    with pytest.raises(CompiledUnavailable):
        check(b, engine="compiled", max_states=10)
    r = check(b, max_states=200)
    assert r.engine.startswith("python (") and not r.complete


def test_a_promotion_is_the_environments_choice_in_both_twins() -> None:
    """The core's waiting loop promoting a loaded request without scheduling it is no
    fairness class (spec.progress.UNFAIR), in C as in Python; its label is its own."""
    b = by_name("loaded-state-handoff").bounds
    s = M.canonical(M.initial(b))
    queue, seen = deque([s]), {s}
    while not any(ev.kind == "promote" for ev in M.events(s)):  # the first loaded request
        s = queue.popleft()
        for _ev, nxt, _calls, _w in M.successors(s):
            if not isinstance(nxt, M.ModelError) and M.canonical(nxt) not in seen:
                seen.add(M.canonical(nxt))
                queue.append(M.canonical(nxt))
    r = next(ev.req for ev in M.events(s) if ev.kind == "promote")
    promote = M.Event("promote", r)
    assert M.fair_class(promote, s) is None
    label = compiled.event_label(promote)
    assert compiled.label_event(label, b) == promote
    assert compiled.library().lib.kv_fair_class(label) == 0
    assert label in {lab for lab, _nxt in _successors_c(b, compiled.encode(M.canonical(s)))}


def test_a_name_the_c_model_lacks_fails_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table that names an effect the compiled twin does not implement cannot be checked
    by it: the build fails, naming the effect."""
    names = gen.effect_names()
    monkeypatch.setattr(gen, "effect_names", lambda: (*names, "new_effect"))
    with pytest.raises(CompiledUnavailable, match="eff_new_effect"):
        compiled.Library()
