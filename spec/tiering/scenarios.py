"""The tiering scenarios: one bounded model per concern, with its expected outcome pinned
(verdict, distinct states, depth), as in tlaplus/Examples; and, for each seeded fault, the
bounds the checker hunts it in and what it must find. Together the passing scenarios fire
every row of the four tiering tables (checked by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.tiering.faults import NO_TIER_FAULTS, TierFaults, tier_fault
from spec.tiering.model import TierBounds


@dataclass(frozen=True)
class TierExpect:
    verdict: str
    """`pass`, `invariant`, `illegal` or `liveness TP-n`."""
    states: int
    depth: int


@dataclass(frozen=True)
class TierScenario:
    name: str
    purpose: str
    bounds: TierBounds
    expect: TierExpect
    faults: TierFaults = NO_TIER_FAULTS
    finding: str = ""
    """For an expected counterexample of the spec itself: what it shows and why it stands."""


TIER_SCENARIOS: tuple[TierScenario, ...] = (
    TierScenario(
        "tier-promotion-eviction-pressure",
        "one CPU slot, two keys: a promotion evicts the other key, a landed promotion is "
        "loaded before the next lookup can evict it (vLLM's lookup order)",
        TierBounds(requests=((0,), (1,), (0,)), cpu_slots=1, tiers=1),
        TierExpect("pass", 1_208, 17)),
    TierScenario(
        "tier-promotion-thrash-any-order",
        "the same, with lookups in any order (a peer tier's lookups through ParentManager, "
        "another scheduling policy)",
        TierBounds(requests=((0,), (1,), (0,), (1,)), cpu_slots=1, tiers=1,
                   lookup_order="any"),
        TierExpect("liveness TP-1", 10_736, 22),
        finding="two deferred requests whose promotions compete for one CPU slot evict each "
        "other's landed promotion before its requester looks it up, forever. A landed "
        "promotion is READY (ref_cnt 0, TM:488-499) and nothing reserves it for its "
        "requester; vLLM's scheduler avoids the cycle only because one poll per step "
        "precedes every lookup and the waiting queue is looked up in a fixed order"),
    TierScenario(
        "tier-prefix-longer-than-cpu-tier",
        "a three-chunk prefix in the tier, two CPU slots: the spec's lookup does not evict "
        "a chunk its own scan hit, so the prefix loads two chunks and computes the third "
        "(vLLM 0.33.0 livelocks: finding T1, fault promotion-evicts-own-prefix)",
        TierBounds(requests=((0, 1, 2), (0, 1, 2)), cpu_slots=2, tiers=1),
        TierExpect("pass", 4_317, 26)),
    TierScenario(
        "tier-reset-during-cascade-and-promotion",
        "a reset while a GPU store, a cascade and a promotion are in flight; the reset "
        "fence's late copy; promotions held until on_reset_flushed",
        TierBounds(requests=((1,), (0,), (1,)), cpu_slots=1, tiers=1, resets=1),
        TierExpect("pass", 6_328, 19)),
    TierScenario(
        "tier-finish-before-final-store",
        "a request finishes while its GPU stores are pending (vLLM's tiering KeyError); a "
        "store fails",
        TierBounds(requests=((0, 1), (1,)), cpu_slots=2, tiers=1, store_failures=1),
        TierExpect("pass", 857, 14)),
    TierScenario(
        "tier-hung",
        "a tier hangs with a promotion and a cascade in flight: the tier job timeout, the "
        "quarantine, the late results, a reset whose drain meets the hung tier, a key "
        "stored again while its stale cascade or promotion still runs (after a crash)",
        TierBounds(requests=((0,), (0,)), cpu_slots=2, tiers=1, hangs=1, resets=1,
                   crashes=1),
        TierExpect("pass", 10_620, 27)),
    TierScenario(
        "tier-failures-and-full-disk",
        "two tiers of one copy each: a cascade refused by a full tier, an I/O error in a "
        "cascade and in a promotion, a failed GPU store",
        TierBounds(requests=((0,), (1,), (0,)), cpu_slots=1, tiers=2, tier_capacity=1,
                   io_failures=1, store_failures=1),
        TierExpect("pass", 12_846, 22)),
    TierScenario(
        "tier-crash-mid-write",
        "the process is killed while a cascade writes: the new process serves only "
        "published copies",
        TierBounds(requests=((0,), (1,), (0,)), cpu_slots=1, tiers=1, crashes=1),
        TierExpect("pass", 3_893, 26)),
)

TIER_FAULT_HUNTS: tuple[TierScenario, ...] = (
    TierScenario("promotions-not-held", "a promotion fills a slot a GPU store alive at the "
                 "reset still writes", TierBounds(requests=((1,), (0,), (1,)), cpu_slots=1,
                                                  tiers=1, resets=1),
                 TierExpect("invariant", 4_532, 16), tier_fault("promotions-not-held")),
    TierScenario("finalize-before-final-store", "the tiers are told a request finished "
                 "before its last GPU store completed",
                 TierBounds(requests=((0,),), cpu_slots=1, tiers=1),
                 TierExpect("illegal", 9, 5), tier_fault("finalize-before-final-store")),
    TierScenario("cascade-without-pin", "a cascade reads an unpinned CPU slot",
                 TierBounds(requests=((0,), (1,)), cpu_slots=1, tiers=1),
                 TierExpect("invariant", 18, 4), tier_fault("cascade-without-pin")),
    TierScenario("reset-without-drain", "reset_cache forgets the CPU tier with tier I/O in "
                 "flight", TierBounds(requests=((0,), (0,)), cpu_slots=1, tiers=1, resets=1),
                 TierExpect("invariant", 65, 5), tier_fault("reset-without-drain")),
    TierScenario("promotion-evicts-own-prefix", "vLLM 0.33.0 (T1): a promotion evicts a "
                 "chunk its request's scan just hit; a prefix longer than the CPU tier is "
                 "deferred forever",
                 TierBounds(requests=((0, 1, 2), (0, 1, 2)), cpu_slots=2, tiers=1),
                 TierExpect("liveness TP-1", 9_501, 33),
                 tier_fault("promotion-evicts-own-prefix")),
    TierScenario("no-tier-timeout", "vLLM 0.33.0: a hung tier keeps its promotion, and its "
                 "requester deferred, forever",
                 TierBounds(requests=((0,), (1,), (0,)), cpu_slots=1, tiers=1, hangs=1),
                 TierExpect("liveness TP-1", 3_624, 19), tier_fault("no-tier-timeout")),
)


def tier_scenario(name: str) -> TierScenario:
    for sc in (*TIER_SCENARIOS, *TIER_FAULT_HUNTS):
        if sc.name == name:
            return sc
    raise KeyError(f"no tiering scenario {name!r}")
