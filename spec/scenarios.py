"""The checked scenarios: one bounded model per concern, with its expected outcome.

As in tlaplus/Examples, each scenario records what the checker must conclude (`Expect`: the
verdict, the number of distinct states, the depth), and CI checks that it does: a model
silently weakened (a row that no longer fires, a branch cut off) changes the count and
fails. Together the scenarios fire every row of every table (`kvspec check` reports coverage
over their union). Every reachable state is visited: the bounds are what the compiled
checker explores in seconds, the largest (`three-requests`) in about a minute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, get_type_hints

from spec.groups import GROUP_KINDS
from spec.model import Bounds, Fault, RequestSettings
from spec.rules import VLLM_0_33, VLLM_0_34, Rules, by_release


@dataclass(frozen=True)
class Expect:
    """What the checker must conclude: the verdict (`pass`, `invariant INV-n`,
    `liveness P-n`, `illegal`), the distinct states (job ids renumbered) and the depth of
    the breadth-first search (the longest shortest path to a state)."""

    verdict: str
    states: int
    depth: int


@dataclass(frozen=True)
class Scenario:
    name: str
    purpose: str
    bounds: Bounds
    expect: Expect | None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("reset-during-transfers",
             "two requests sharing a prefix, 2 workers reporting in parts; a reset while "
             "stores and loads are in flight; a preemption; GPU blocks reused behind the "
             "fence",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=4, resets=1,
                    failures=0, preemptions=1),
             Expect("pass", 287_440, 22)),
    Scenario("two-resets",
             "two resets, the second with the first's fence still held; a stale report "
             "after the fence drained",
             Bounds(requests=1, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=3, resets=2,
                    failures=1, preemptions=0, stray_reports=True),
             Expect("pass", 14_093, 13)),
    Scenario("preemption-and-fences",
             "preemption with stores in flight, re-admission while flushing, re-allocation "
             "of fenced blocks, finish and abort everywhere",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=1,
                    failures=0, preemptions=1),
             Expect("pass", 45_662, 20)),
    Scenario("failures",
             "workers fail stores and loads (async), twice, 2 workers reporting in parts",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=5, resets=0,
                    failures=2, preemptions=0, sync_loads=False, partial_reports=True),
             Expect("pass", 19_005, 17)),
    Scenario("sync-loads",
             "synchronous loads beside stores, their failure poisoning the stores at the "
             "first failure report; a reset after one worker failed the load (recompute)",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=3, resets=1,
                    failures=1, preemptions=0, sync_loads=True),
             Expect("pass", 278_242, 19)),
    Scenario("sync-preemption",
             "a request preempted while its synchronous load is unreported; that load fails, "
             "before or after a reset made it stale",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=1,
                    failures=1, preemptions=1, sync_loads=True),
             Expect("pass", 221_376, 22)),
    Scenario("sync-load-fails-after-reset",
             "a reset makes a sync load stale while its request keeps running and storing on "
             "its KV; the stale failure report invalidates the request and poisons its stores",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=1,
                    failures=1, preemptions=0, sync_loads=True),
             Expect("pass", 32_240, 18)),
    Scenario("timeouts",
             "lost reports: jobs time out, late reports (from either of 2 workers) drain the "
             "quarantine, a reset moves it to the fence",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=5, resets=1,
                    failures=0, preemptions=0, timeout_steps=1),
             Expect("pass", 632_200, 23)),
    Scenario("orphaned-load-fails",
             "a reset orphans an async load, a worker then fails it: the request is "
             "recomputed, not promoted",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=5, resets=1,
                    failures=1, preemptions=0),
             Expect("pass", 265_498, 19)),
    Scenario("late-reports",
             "2 workers: a job times out after one worker reported; the other's late report "
             "(an ack or a failure) drains the quarantine",
             Bounds(requests=1, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=3, resets=0,
                    failures=1, preemptions=0, timeout_steps=1),
             Expect("pass", 1_219, 9)),
    Scenario("sync-timeouts",
             "synchronous loads whose reports are lost: timeout beside stores, in a "
             "preempted or finished request; a timed-out request that cannot get its "
             "blocks back yet keeps its obligation to recompute",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=3, resets=0,
                    failures=0, preemptions=1, sync_loads=True, timeout_steps=2),
             Expect("pass", 396_010, 30)),
    Scenario("aborted-load-timeout",
             "an aborted request's async load outlives finalisation and times out",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=5, resets=0,
                    failures=0, preemptions=0, timeout_steps=2),
             Expect("pass", 83_386, 23)),
    Scenario("timed-out-load-blocks",
             "an aborted request's async load times out and is dropped; a preempted request "
             "is re-admitted meanwhile: the load's destination blocks stay quarantined until "
             "its late report",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=3, resets=0,
                    failures=0, preemptions=1, timeout_steps=2),
             Expect("pass", 41_870, 26)),
    Scenario("eviction",
             "three prefixes competing for two CPU chunks: eviction never takes a pinned or "
             "write-pending chunk; allocation failure retried",
             Bounds(requests=3, tokens=2, families=3, workers=1, cpu_chunks=2, gpu_blocks=6,
                    resets=0, failures=0, preemptions=0),
             Expect("pass", 239_161, 19)),
    Scenario("three-requests",
             "three requests of three tokens sharing a prefix, 2 workers, 2 resets and a "
             "preemption: a third request, a third token and a second reset, everywhere "
             "the smaller scenarios cannot reach (one request on the GPU at a time)",
             Bounds(requests=3, tokens=3, workers=2, cpu_chunks=2, gpu_blocks=3, resets=2,
                    failures=0, preemptions=1, partial_reports=False),
             Expect("pass", 12_924_973, 30)),
    Scenario("decoding",
             "two requests of two prompt tokens sharing a prefix, each generating two more: "
             "one token a step after the prompt, the output stored under the request's own "
             "keys; five GPU blocks for their eight, so a request waits for a block before "
             "its next token; a preemption recomputes prompt and output (its lookup reaches "
             "into its output), a reset and a worker failure",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=5, resets=1,
                    failures=1, preemptions=1, decode_tokens=2),
             Expect("pass", 620_162, 22)),
    Scenario("decoding-prompt-only",
             "the same under vLLM's default `offload_prompt_only`: stores stop at the "
             "prompt's end, so no output chunk is ever offloaded and a restarted request's "
             "lookup hits its prompt only",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=5, resets=1,
                    failures=1, preemptions=1, decode_tokens=2, offload_prompt_only=True),
             Expect("pass", 249_935, 19)),
    Scenario("multi-block",
             "chunks of 2 blocks over 3-token prompts: a hit ends inside a chunk (the last "
             "prompt token is never loaded), loads and stores of whole chunks, 2 workers, "
             "a reset, a failure and a preemption",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=1, preemptions=1, blocks_per_chunk=2),
             Expect("pass", 36_018, 18)),
    Scenario("late-recving-after-timeout",
             "one request, an async load that times out; admitted again it recomputes, is "
             "preempted and loads anew, a reset orphans that load, then the timed-out load's "
             "late completion names the request in finished_recving: stale "
             "(`spec.request.recving_is_stale`), so the request waits in ORPHANED_LOAD for "
             "its newer load, which fails and makes it recompute (mutant "
             "`stale-recving-promotes` takes it for that load's: INV-20)",
             Bounds(requests=1, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=3, resets=1,
                    failures=1, preemptions=2, timeout_steps=2),
             Expect("pass", 45_376, 28)),
    Scenario("multi-block-decoding",
             "chunks of 2 blocks over 3-token prompts that each generate 2 tokens: the "
             "second chunk straddles prompt and output (its key is the request's own, at its "
             "last token), a chunk is stored only once the output completes it, a restarted "
             "request's hit ends inside it; 2 workers, a reset, a failure and a preemption",
             Bounds(requests=2, tokens=3, workers=2, cpu_chunks=2, gpu_blocks=5, resets=1,
                    failures=1, preemptions=1, blocks_per_chunk=2, decode_tokens=2),
             Expect("pass", 239_506, 23)),
    Scenario("partial-blocks",
             "blocks of 2 tokens over 3-token prompts sharing a prefix that each generate 2 "
             "tokens: a prompt's last block is partial (never stored, never hit), the first "
             "output token completes it and the second starts a block; a hit stops at the "
             "whole blocks before the last token; 4 GPU blocks for the two, a request "
             "restarted after its output needing 3; a reset, a failure and a preemption",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=4, resets=1,
                    failures=1, preemptions=1, tokens_per_block=2, decode_tokens=2),
             Expect("pass", 220_695, 22)),
    Scenario("two-full-groups",
             "two full-attention KV cache groups (vLLM splits each attention type's layers "
             "into groups of one size, `_get_kv_cache_groups_uniform_page_size`, so a model "
             "with twice as many full-attention layers as window layers has two "
             "full-attention groups; the model leaves the window group out): each chunk has a "
             "key per group, "
             "a lookup converges over both prefix scans, loads and stores read each group's "
             "part of the table, and three CPU slots for a prompt's six keys evict one "
             "group's key of a chunk without the other's; 3-token prompts sharing a prefix "
             "that each generate a token (a block per group), a reset, a failure and a "
             "preemption",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=10, resets=1,
                    failures=1, preemptions=1, decode_tokens=1, groups=("full", "full")),
             Expect("pass", 119_125, 22)),
    # -- window and Mamba groups, partial tails ---------------------------------------------
    Scenario("hybrid",
             "a full-attention and a sliding-window group (window 2): the suffix-window "
             "lookup beside the prefix scan, converging; the core frees blocks before the "
             "window while stores read them (fenced at creation); eviction pressure, a "
             "failure and a preemption",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=7, resets=0,
                    failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=2),
             Expect("pass", 47_817, 23)),
    Scenario("hybrid-reset-window",
             "a full-attention and a sliding-window group (window 1), two prompts: a "
             "sliding-window block freed and handed to the other request, then a reset puts "
             "the store cursor back before it (vLLM 0.33.0 then stores from the stale id)",
             Bounds(requests=2, tokens=2, shared_prefix=False, workers=1, cpu_chunks=4,
                    gpu_blocks=7, resets=1, failures=0, preemptions=0,
                    groups=("full", "sliding"), sliding_window=1),
             Expect("pass", 24_515, 15)),
    Scenario("window-partial-chunk",
             "a full-attention and a sliding-window group (window 2) with 2-block chunks, two "
             "5-token prompts sharing a prefix, a reset: the store after the reset finds a "
             "chunk without the block the window left behind; the reachable-block mask keeps "
             "it out, since the other prompt's hit ends a token short of a block and reads "
             "that block (INV-23; vLLM 0.33.0's mask stores it: finding F4)",
             Bounds(requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1,
                    failures=0, preemptions=0, groups=("full", "sliding"), sliding_window=2,
                    blocks_per_chunk=2),
             Expect("pass", 11_778, 20)),
    Scenario("window-retention",
             "the same with vLLM's default retention (`prefix_cache_retention_interval` 0): "
             "a window group stores only the chunk whose tail a replay of the prompt reads",
             Bounds(requests=2, tokens=5, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1,
                    failures=0, preemptions=0, groups=("full", "sliding"), sliding_window=2,
                    blocks_per_chunk=2, retention_interval=0),
             Expect("pass", 11_825, 20)),
    Scenario("window-aligned-prompt",
             "a full-attention and a sliding-window group (window 2) with 3-block chunks, two "
             "6-token prompts sharing a prefix (each ends on a chunk's edge), a reset: the "
             "second prompt's hit is bounded a block before the edge and, under 0.33.0's "
             "cut, ends a token short of that again, so its window reads the chunk's first "
             "block; the reachable-block mask counts that block, so the store after the reset "
             "does not write the chunk without it (INV-23; a mask that counts a hit one token "
             "short does)",
             Bounds(requests=2, tokens=6, workers=1, cpu_chunks=4, gpu_blocks=12, resets=1,
                    failures=0, preemptions=0, groups=("full", "sliding"), sliding_window=2,
                    blocks_per_chunk=3),
             Expect("pass", 12_049, 23)),
    Scenario("hybrid-mamba",
             "a full-attention and a Mamba group (align mode), two requests of three tokens "
             "sharing a prefix, sync loads: every state the core hands off at a chunk edge "
             "is stored alone and fenced at once (beside a running request and beside a sync "
             "load), the core frees it a step later, a lookup wants the state at the hit's "
             "end only",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=6, gpu_blocks=6, resets=0,
                    failures=0, preemptions=0, sync_loads=True, groups=("full", "mamba")),
             Expect("pass", 5_263, 17)),
    Scenario("partial-tails",
             "a full-attention and a Mamba group, blocks of 2 tokens, prompts of 4 tokens "
             "sharing a prefix: the core commits the Mamba state at token 3, inside the last "
             "block, copies it on write and hands it off; the connector stores it with the "
             "full-attention block under the boundary's keys (fenced), and a later lookup "
             "hits up to the boundary and loads both into the boundary's block (the "
             "model-based tests add resets, failures and preemptions)",
             Bounds(requests=2, tokens=4, workers=1, cpu_chunks=6, gpu_blocks=8, resets=0,
                    failures=0, preemptions=0, groups=("full", "mamba"), tokens_per_block=2,
                    partial_tails=True),
             Expect("pass", 10_077, 17)),
    Scenario("loaded-state-handoff",
             "a Mamba group alone, two requests of three tokens sharing a prefix, async "
             "loads and two resets: as the core resumes a request after its load it hands "
             "off the state the load ended on; after a reset emptied the CPU cache it is "
             "stored again, by a request the core schedules in that step or by one it only "
             "promotes, which then waits with the store in flight (WAITING_STORING) until "
             "the store ends, the core schedules it, a reset or an abort",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=1, gpu_blocks=4, resets=2,
                    failures=0, preemptions=0, partial_reports=False, groups=("mamba",)),
             Expect("pass", 36_418, 16)),
    Scenario("window-only",
             "a sliding window on every layer (one window group, window 2) at vLLM's "
             "default retention (0), two 4-token prompts sharing a prefix: no prefix scan "
             "bounds a hit, the suffix-window scan alone finds it; once the core has freed "
             "the blocks before the window, a store (after a reset) writes the window's "
             "chunks without the first one, and the other request's hit loads those chunks "
             "alone into a table whose leading position is null",
             Bounds(requests=2, tokens=4, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=0, preemptions=0, groups=("sliding",), sliding_window=2,
                    retention_interval=0),
             Expect("pass", 22_976, 19)),
    Scenario("loaded-states-of-two-groups",
             "two Mamba groups: the state a load ended on is handed off in both, so a "
             "promoted request waits with two stores (one per group) in flight; a reset "
             "empties the CPU cache of two chunks",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=2, gpu_blocks=6, resets=1,
                    failures=0, preemptions=0, partial_reports=False,
                    groups=("mamba", "mamba")),
             Expect("pass", 74_223, 18)),
    Scenario("multi-token-blocks",
             "blocks of 2 tokens, a full-attention and a sliding-window group (window 3), "
             "prompts of 5 tokens: a step ends inside a block, the last block is partial and "
             "never stored, hits, loads and the window's frees whole blocks; a failure and "
             "a preemption",
             Bounds(requests=2, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=8, resets=0,
                    failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=3,
                    tokens_per_block=2),
             Expect("pass", 31_637, 25)),
    Scenario("request-settings",
             "requests with their own settings (vLLM's kv_transfer_params and "
             "skip_reading_prefix_cache): a request whose stores stop at a cap and whose "
             "loads are capped, beside one that never reads the cache; a reset and a "
             "preemption",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=6, resets=1,
                    failures=0, preemptions=1, request_settings=(
                        RequestSettings(max_load_tokens=1, max_offload_tokens=2),
                        RequestSettings(skip_reading_prefix_cache=True))),
             Expect("pass", 124_987, 22)),
    Scenario("store-admission",
             "store admission (vLLM's store_threshold 2): a chunk is stored only at its "
             "second offer, by the same request after a preemption or by another one "
             "sharing the prefix; the offer counts outlive a reset",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=0, preemptions=1, store_threshold=2),
             Expect("pass", 24_698, 15)),
    Scenario("store-admission-per-request",
             "the same under vLLM 0.34.0's rule (`spec.rules.StoreAdmission.PER_REQUEST`): "
             "a key counts once per request and cache generation, so a request's re-offer "
             "after its preemption does not admit its chunk, another request's offer does, "
             "and after a reset the request's next offer counts again",
             Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                    failures=0, preemptions=1, store_threshold=2, rules=VLLM_0_34),
             Expect("pass", 28_117, 16)),
    Scenario("store-admission-three-requests",
             "three requests sharing a prefix under vLLM 0.34.0's rules, store threshold 3: "
             "a chunk is stored only once three offers counted, each request's once per "
             "cache generation, so a preempted request's re-offer never completes the "
             "count and a reset opens a new generation; a worker failure and two CPU chunks "
             "for three requests' stores (the compiled twin, above the mutation matrix)",
             Bounds(requests=3, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=6, resets=1,
                    failures=1, preemptions=1, store_threshold=3, rules=VLLM_0_34),
             Expect("pass", 2_422_727, 21)),
    Scenario("failed-load-not-retried",
             "an async load that a worker fails, under vLLM 0.34.0's rule "
             "(`spec.rules.FailedLoadLookup.FOR_LIFE`): the request recomputes and stores "
             "its chunks, and once preempted every later lookup of it answers 0 without the "
             "manager, while the other request sharing the prefix still hits",
             Bounds(requests=2, tokens=3, workers=1, cpu_chunks=3, gpu_blocks=5, resets=0,
                    failures=1, preemptions=1, rules=VLLM_0_34),
             Expect("pass", 12_799, 18)),
    Scenario("orphaned-load-fails-0.34",
             "a reset orphans an async load that a worker fails, after the reset or already "
             "at it (FAILING), under vLLM 0.34.0's rule "
             "(`spec.rules.StaleLoadFailure.FENCE_ONLY`): the failure only drains the fence, "
             "the request leaves ORPHANED_LOAD for IDLE as after a good load, and the core, "
             "told by the worker's failed_recving, recomputes it instead of promoting the "
             "load; its next lookup asks the manager, which the other request stored to "
             "again",
             Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=3, resets=1,
                    failures=1, preemptions=0, rules=VLLM_0_34),
             Expect("pass", 36_502, 16)),
    Scenario("partial-tails-0.34",
             "the partial-tails model with one worker failure, under vLLM 0.34.0's rules "
             "(`spec.rules.PartialTailSearch.FROM_FULL_ATTENTION_PREFIX`): when a failed "
             "store leaves no Mamba state at a chunk edge, the lookup searches a tail past "
             "the full-attention prefix and loads the chunks before it with the tail; a tail "
             "key another load still brings defers the lookup",
             Bounds(requests=2, tokens=4, workers=1, cpu_chunks=6, gpu_blocks=8, resets=0,
                    failures=1, preemptions=0, groups=("full", "mamba"), tokens_per_block=2,
                    partial_tails=True, rules=VLLM_0_34),
             Expect("pass", 60_911, 18)),
    Scenario("hybrid-load-cap-0.34",
             "a full-attention and a sliding-window group (window 3), blocks of 2 tokens, "
             "a request whose loads are capped at one block, under vLLM 0.34.0's rule "
             "(`spec.rules.LastTokenCut.BEFORE_CAPS`): the recomputed last token comes off "
             "the prompt before the cap, so a hit the cap bounds ends on the cap, not a "
             "token short of it; a preemption",
             Bounds(requests=2, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=8, resets=0,
                    failures=0, preemptions=1, groups=("full", "sliding"), sliding_window=3,
                    tokens_per_block=2, request_settings=(
                        RequestSettings(), RequestSettings(max_load_tokens=2)),
                    rules=VLLM_0_34),
             Expect("pass", 10_582, 25)),
)


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    raise KeyError(f"no scenario {name!r}; known: {', '.join(s.name for s in SCENARIOS)}")


# The bounds under which each fault of the mutant catalogue is looked for: small, since the
# search stops at the first counterexample, breadth first, so it is a shortest one.
HUNT_BOUNDS = Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=3, resets=1,
                     failures=0, preemptions=1)
_HUNT_OVERRIDE: dict[Fault, Bounds] = {
    Fault.EVICT_PINNED_CHUNKS: Bounds(requests=3, tokens=2, families=2, workers=1,
                                      cpu_chunks=2, gpu_blocks=6, resets=0, failures=0,
                                      preemptions=0),
    Fault.AGGREGATE_COUNTS_ONCE: Bounds(requests=1, tokens=2, workers=2, cpu_chunks=2,
                                        gpu_blocks=2, resets=0, failures=0, preemptions=0),
    Fault.SLIDING_WINDOW_SKIPS_FENCE: by_name("hybrid").bounds,
    Fault.RESET_KEEPS_STALE_WINDOW_BLOCKS: by_name("hybrid-reset-window").bounds,
    Fault.HANDOFF_STORE_SKIPS_FENCE: by_name("hybrid-mamba").bounds,
    Fault.TAIL_LOAD_ROUNDS_DOWN: by_name("partial-tails").bounds,
    Fault.STORE_MASK_IGNORES_SHORT_HITS: by_name("window-partial-chunk").bounds,
    Fault.STALE_LOAD_FAILURE_IGNORED: replace(by_name("orphaned-load-fails-0.34").bounds,
                                              rules=VLLM_0_33),
    Fault.STALE_RECVING_PROMOTES: by_name("late-recving-after-timeout").bounds,
}


def hunt_bounds(fault: Fault) -> Bounds:
    """The bounds under which the checker looks for `fault`."""
    return _HUNT_OVERRIDE.get(fault, HUNT_BOUNDS)


def _settings(item: str, part: str) -> RequestSettings:
    """One request's settings, `skip:load1:offload2` or `-` (`RequestSettings.text`)."""
    fields: dict[str, Any] = {}
    for word in filter(None, item.split(":")):
        if word == "-":
            continue
        if word == "skip":
            fields["skip_reading_prefix_cache"] = True
            continue
        for prefix, name in (("offload", "max_offload_tokens"), ("load", "max_load_tokens")):
            if word.startswith(prefix) and word[len(prefix):].isdigit():
                fields[name] = int(word[len(prefix):])
                break
        else:
            raise ValueError(f"bad bound {part!r}: request settings are skip, loadN and "
                             "offloadN joined by ':', '-' for none, one per request joined "
                             "by '+' (request_settings=skip+load1:offload2)")
    return RequestSettings(**fields)


_BOUND_TYPES: dict[str, Any] = get_type_hints(Bounds)
_SWITCHES = {"true": True, "on": True, "false": False, "off": False}


def _scalar(part: str, name: str, value: str) -> bool | int | None:
    """A switch (`true`/`on`, `false`/`off`), an integer, or for a bound that may be None
    `none`/`off`, by the type `Bounds` gives the field; ValueError naming the bound if the
    value is not of it (a `none` count, a `true` timeout)."""
    hint = _BOUND_TYPES[name]
    word = value.lower()
    if hint is bool:
        if word not in _SWITCHES:
            raise ValueError(f"bad bound {part!r}: {name} is a switch (true or false)")
        return _SWITCHES[word]
    if hint == int | None and word in ("none", "off"):
        return None
    try:
        return int(value)
    except ValueError:
        maybe = " or none" if hint == int | None else ""
        raise ValueError(f"bad bound {part!r}: {name} takes an integer{maybe}") from None


def parse_bounds(text: str, base: Bounds) -> Bounds:
    """`requests=2,workers=1,timeout_steps=none` on top of `base`; ValueError if bad. A
    rule of `spec.rules.Rules` is a bound too (`stale_load_failure=fence-only`), set on the
    release's rules that `rules=` names (or on `base`'s), whatever the order."""
    changes: dict[str, Any] = {}
    rule_values: dict[str, str] = {}
    fields = Bounds.__dataclass_fields__
    rule_names = Rules.__dataclass_fields__
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name in rule_names and value:
            rule_values[name] = value
            continue
        if name not in fields or not value:
            raise ValueError(f"bad bound {part!r}; known: {', '.join(fields)}, and the "
                             f"rules {', '.join(rule_names)}")
        if name == "request_settings":
            changes[name] = tuple(_settings(item, part) for item in value.split("+"))
        elif name == "groups":
            kinds = tuple(value.split("+"))
            if any(k not in GROUP_KINDS for k in kinds):
                raise ValueError(f"bad bound {part!r}: groups are {', '.join(GROUP_KINDS)}, "
                                 "joined by '+' (groups=full+sliding)")
            changes[name] = kinds
        elif name == "rules":
            try:
                changes[name] = by_release(value)
            except ValueError as e:
                raise ValueError(f"bad bound {part!r}: {e}") from None
        else:
            changes[name] = _scalar(part, name, value)
    if rule_values:
        rules = changes.get("rules", base.rules)
        try:
            changed = Rules.of(rule_values)
        except ValueError as e:
            raise ValueError(f"bad bound: {e}") from None
        changes["rules"] = replace(rules, **{n: getattr(changed, n) for n in rule_values})
    return replace(base, **changes)
