"""The lifecycle of one chunk key in the CPU (primary) tier under tiering (TM:114-173, the CPU
manager M:214-465, promotions TM:686-763, cascades TM:937-1011, the reset TM:1140-1202).

vLLM keeps one number per indexed key, ``ref_cnt``: -1 while a write into its slot is pending,
0 when ready and idle, n > 0 while n readers hold it. Tiering adds a second writer (a
promotion from a secondary tier) and a second reader (a cascade to a secondary tier) to the
GPU store and the GPU load; the table tells them apart, because they end differently.

A slot that tier I/O may still touch after its key left the index (a promotion or a cascade
that timed out, or was in flight when a reset found its tier hung) is *quarantined*: neither
indexed nor reused until the late result arrives (beyond vLLM, which has no tier timeout and
waits for the tier forever in `reset_cache`, TM:1164-1169).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from spec.schema import (
    BEYOND_VLLM,
    SAME,
    Effect,
    Guard,
    MachineSpec,
    Path,
    State,
    StateGroup,
    Transition,
)

K = TypeVar("K")

ABSENT = "ABSENT"
WRITE_PENDING = "WRITE_PENDING"
PROMOTION_QUEUED = "PROMOTION_QUEUED"
PROMOTING = "PROMOTING"
READY = "READY"
PINNED = "PINNED"

STATES = (
    State(ABSENT, "not in the CPU tier's index (never stored, evicted, dropped, or reset)",
          "primary_tier._policy.get(key) is None"),
    State(WRITE_PENDING, "a GPU store allocated its slot; the copy is not confirmed",
          "ref_cnt == -1 and key not in a promotion (pending or in _jobs)"),
    State(PROMOTION_QUEUED, "a lookup hit it in a secondary tier and reserved a CPU slot; the "
          "promotion job is submitted at the end of the step",
          "ref_cnt == -1 and key in _pending_load_submissions[tier][req_id].keys"),
    State(PROMOTING, "a promotion job copies it from a secondary tier into its slot",
          "ref_cnt == -1 and key in the keys of an is_promotion job of _jobs"),
    State(READY, "loadable and evictable", "ref_cnt == 0"),
    State(PINNED, "read by GPU loads (prepare_load) and/or cascades (prepare_read); never "
          "evicted", "ref_cnt > 0"),
)

HIT_PENDING_STATES = StateGroup(
    "hit_pending", "a lookup answers HIT_PENDING: the request defers (TM:636-639)",
    (WRITE_PENDING, PROMOTION_QUEUED, PROMOTING))
LOADABLE = StateGroup(
    "loadable", "a lookup answers HIT; prepare_load may pin it (TM:636-637)", (READY, PINNED))
INDEXED = StateGroup(
    "indexed", "in the CPU tier's index, holding a slot",
    (WRITE_PENDING, PROMOTION_QUEUED, PROMOTING, READY, PINNED))
TIER_WRITTEN = StateGroup(
    "tier_written", "a secondary tier writes (or will write) its slot", (PROMOTION_QUEUED,
                                                                         PROMOTING))
GROUPS = (HIT_PENDING_STATES, LOADABLE, INDEXED, TIER_WRITTEN)

LOOKUP_ANSWER: dict[str, str | None] = {
    ABSENT: None,
    WRITE_PENDING: "HIT_PENDING",
    PROMOTION_QUEUED: "HIT_PENDING",
    PROMOTING: "HIT_PENDING",
    READY: "HIT",
    PINNED: "HIT",
}
"""What the CPU tier answers a lookup in each state; None: ask the secondary tiers
(TM:626-675)."""


def prefix_scan(lookup: Callable[[K], str], keys: Sequence[K]) -> list[str]:
    """The scheduler's prefix lookup of `keys` in order (S:773-803): on through HIT,
    HIT_PENDING and RETRY, stopping after the first MISS; the answers. The request defers
    when any is HIT_PENDING or RETRY (S:1014-1019); else the keys before a MISS load."""
    answers: list[str] = []
    for key in keys:
        answers.append(lookup(key))
        if answers[-1] == "MISS":
            break
    return answers

GUARDS = (
    Guard("last_reader", "this release drops ref_cnt to 0"),
    Guard("tier_io_in_flight", "a tier job that reads or writes the slot has not reported "
          "(hung past the drain deadline, or timed out)"),
)

EFFECTS = (
    Effect("allocate_slot", "take a free slot, or evict READY keys (never a key of the offer, "
           "never a pinned or pending one) to free one (M:320-360)"),
    Effect("free_slot", "return the slot to the free list (M:119-120)"),
    Effect("quarantine_slot", "keep the slot out of the free list until the late tier "
           "result arrives (beyond vLLM)"),
    Effect("pin", "ref_cnt += 1 (M:221-242)"),
    Effect("unpin", "ref_cnt -= 1 (M:248-258)"),
    Effect("publish", "ref_cnt = 0: readable and evictable (M:384-392)"),
    Effect("cascade_to_tiers", "one store job per secondary tier, each pinning the key "
           "(TM:965-975)"),
    Effect("record_hit_source", "remember the tier a promoted key came from (TM:723-726)"),
)

_LOOKUP = "get_num_new_matched_tokens"
_META = "build_connector_meta"
_OUT = "update_connector_output"

TRANSITIONS = (
    Transition("store_prepared", (ABSENT,), WRITE_PENDING, _META, "TM:814-864",
               effects=("allocate_slot",), note="prepare_store: a GPU store offers the key"),
    Transition("store_completed", (WRITE_PENDING,), READY, _OUT, "TM:937-975",
               effects=("publish", "cascade_to_tiers"),
               note="complete_store(success=True); the cascades then pin it"),
    Transition("store_failed", (WRITE_PENDING,), ABSENT, _OUT, BEYOND_VLLM,
               effects=("free_slot",), path=Path.FAILURE,
               note="complete_store(success=False): the 0.33.0 connector never fails a store"),
    Transition("promotion_reserved", (ABSENT,), PROMOTION_QUEUED, _LOOKUP, "TM:686-738",
               effects=("allocate_slot", "record_hit_source"),
               note="a CPU miss that a secondary tier hits, while promotions are not held"),
    Transition("promotion_submitted", (PROMOTION_QUEUED,), PROMOTING, _META, "TM:740-763"),
    Transition("promotion_landed", (PROMOTING,), READY, _LOOKUP, "TM:460-499",
               effects=("publish",), note="the poll applies a successful promotion"),
    Transition("promotion_failed", (PROMOTING,), ABSENT, _LOOKUP, "TM:460-499",
               effects=("free_slot",), path=Path.FAILURE,
               note="complete_write(success=False) for the job's failed keys"),
    Transition("promotion_timed_out", (PROMOTING,), ABSENT, _META, BEYOND_VLLM,
               effects=("quarantine_slot",), path=Path.TIMEOUT,
               note="the tier did not report within the tier job timeout"),
    Transition("load_pinned", (READY, PINNED), PINNED, "update_state_after_alloc",
               "TM:765-785", effects=("pin",)),
    Transition("cascade_pinned", (READY, PINNED), PINNED, _OUT, "TM:985-1011",
               effects=("pin",), note="create_store_job: prepare_read pins the key"),
    Transition("reader_released", (PINNED,), READY, _OUT, "TM:544-548, M:248-258",
               requires=("last_reader",), effects=("unpin",),
               note="complete_load, or the poll's complete_read of a finished cascade"),
    Transition("reader_released", (PINNED,), SAME, _OUT, "TM:544-548, M:248-258",
               unless=("last_reader",), effects=("unpin",)),
    Transition("evicted", (READY,), ABSENT, _META, "M:320-345",
               effects=("free_slot",), note="another key's allocation needs the slot"),
    Transition("reset", (WRITE_PENDING, PROMOTION_QUEUED, READY, PINNED), ABSENT, "reset_cache",
               "TM:1171-1189, M:451-464", unless=("tier_io_in_flight",),
               effects=("free_slot",), path=Path.RESET,
               note="after every tier drained: the CPU tier forgets every key"),
    Transition("reset", (PROMOTING, PINNED), ABSENT, "reset_cache", BEYOND_VLLM,
               requires=("tier_io_in_flight",), effects=("quarantine_slot",), path=Path.RESET,
               note="a hung tier past the drain deadline: its slots are quarantined (vLLM "
               "blocks in drain_jobs instead)"),
)

CPU_CHUNK_MACHINE = MachineSpec(
    name="cpu_chunk",
    title="A chunk key in the CPU tier (tiering)",
    subject="chunk key",
    states=STATES,
    transitions=TRANSITIONS,
    initial=ABSENT,
    finals=(),
    guards=GUARDS,
    effects=EFFECTS,
    groups=GROUPS,
    ignored=(
        ("complete_store for a key that is not write-pending",
         "vLLM skips it (M:384-386); counted"),
    ),
)
