"""Seeded tiering faults: each switches one rule of the tiering model off, and names the vLLM
change whose absence it reproduces. The checker must find each (`spec.tiering.scenarios`)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TierFaults:
    promotions_not_held: bool = False
    """A reset does not hold promotions until on_reset_flushed (TM:1155-1162, TM:1198-1202):
    a promotion fills a slot that a GPU store alive at the reset still writes."""
    finalize_before_final_store: bool = False
    """on_request_finished tells the tiers at once, though a GPU store of the request is
    pending (before pending_primary_stores, TM:1056-1080): the late complete_store finds no
    request (vLLM's tiering KeyError)."""
    cascade_without_pin: bool = False
    """A cascade reads its CPU slot without pinning it (TM:991-1000): the slot is evicted and
    reused while the tier copies it, so the tier publishes another key's bytes."""
    reset_without_drain: bool = False
    """reset_cache forgets the CPU tier without draining the tiers (TM:1164-1169): tier I/O
    in flight writes slots that were freed and reused."""
    promotion_evicts_own_prefix: bool = False
    """vLLM 0.33.0 (finding T1): a promotion's slot may come from evicting a chunk the same
    lookup scan just hit (only the promoted key is protected, TM:713): a prefix longer than
    the CPU tier is promoted round after round, each round evicting an earlier chunk of it,
    and its request is deferred forever."""
    no_tier_timeout: bool = False
    """vLLM 0.33.0: no tier job timeout and a drain without deadline; a hung tier defers its
    promotions' requests forever and blocks reset_cache forever (TM:1146-1148)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name))


NO_TIER_FAULTS = TierFaults()

TIER_FAULT_NAMES: tuple[str, ...] = tuple(f.name.replace("_", "-") for f in fields(TierFaults))


def tier_fault(name: str) -> TierFaults:
    """The fault named `name` (dashes or underscores) switched on."""
    attr = name.replace("-", "_")
    if attr not in {f.name for f in fields(TierFaults)}:
        raise KeyError(f"no tiering fault {name!r}; known: {', '.join(TIER_FAULT_NAMES)}")
    return TierFaults(**{attr: True})
