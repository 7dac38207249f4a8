"""The rules on which vLLM releases differ: one field per rule, each value a release's rule.

The spec states vLLM 0.33.0's lifecycle, and `Rules()` is 0.33.0's rules (and the spec's
own, where 0.33.0 has no such path). Where a later release changed a rule of the lookup or
the manager and both the old and the new rule are safe (no invariant or progress property
tells them apart), the spec states both, and the bounds (`spec.model.Bounds.rules`) and the
reference implementation's configuration (`statemachine.config.OffloadingConfig.rules`)
choose one. The conformance suite gives the spec the rules of the release under test
(`conformance.releases.RULE_FEATURES`), so a release's new rule is checked, not left out.

Each rule names the divergence of CONFORMANCE.md it came from. vLLM lines are cited as
`S@0.34.0:...` (`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py` at
tag v0.34.0), `M@0.34.0:...` (`vllm/v1/kv_offload/cpu/manager.py`), `W@0.34.0:...`
(`.../offloading/worker.py`), `KU@0.34.0:...` (`vllm/distributed/kv_transfer/kv_connector/
utils.py`), `CS@0.34.0:...` (`vllm/v1/core/sched/scheduler.py`); unmarked ones are v0.33.0's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["BY_RELEASE", "VLLM_0_33", "VLLM_0_34", "FailedLoadLookup", "LastTokenCut",
           "PartialTailSearch", "Rules", "StaleLoadFailure", "StoreAdmission", "by_release"]


class StoreAdmission(enum.Enum):
    """What a store threshold counts (D6)."""

    PER_OFFER = "per-offer"
    """Every offer of a key counts, a request's own re-offers too (M:129-148, M:266-291)."""
    PER_REQUEST = "per-request"
    """A key counts once per request and cache generation: a request's re-offer after a
    preemption or a failed allocation is not another use of the content (M@0.34.0:46-49,
    M@0.34.0:133-159, M@0.34.0:290-298). A reset starts a new generation, so a request's
    next offer after it counts again (M@0.34.0:161-172)."""


class LastTokenCut(enum.Enum):
    """Where a lookup beside a sliding-window or Mamba group takes off the last token, which
    the core recomputes for its logprobs (D5)."""

    AFTER_CAPS = "after-caps"
    """After the caps (the connector's `max_num_new_tokens`, which the spec's hit bound
    LAST-TOKEN-BOUND is, and a request's `max_load_tokens`): a hit ends one token short of
    its bound or cap, in the block it would end on (S:862-881)."""
    BEFORE_CAPS = "before-caps"
    """Off the request's length, before the caps (S@0.34.0:921-941). The hit's bound, the
    hash blocks before the last token, already leaves that token out, so a hit is never
    short: it ends on its bound or its cap."""


class FailedLoadLookup(enum.Enum):
    """What a request's lookups answer after a load of it failed or timed out (the restriction
    FAILED-LOAD-STICKY of CONFORMANCE.md before the spec stated 0.34.0's rule)."""

    ONCE = "once"
    """The next lookup answers 0 without the manager (RECOMPUTE: the core recomputes the
    request); a later one, after a preemption, asks the manager again. The spec's own rule:
    vLLM 0.33.0 has no failure report (a failed copy asserts in the worker, W:299-301)."""
    FOR_LIFE = "for-life"
    """Every later lookup of the request answers 0: a faulting load is not retried
    (`load_failed`, S@0.34.0:375-378, set at S@0.34.0:2480-2487, read at
    S@0.34.0:1411)."""


class StaleLoadFailure(enum.Enum):
    """What a worker's failure of an async load that a reset made stale does (the
    restriction STALE-LOAD-FAILURE of CONFORMANCE.md before the spec stated 0.34.0's rule).
    Either way the core never promotes the failed load's tokens: the data is invalid."""

    INVALIDATES_REQUEST = "invalidates-request"
    """The connector marks the orphaned request's loaded tokens invalid
    (`invalidate_orphaned_load`, on a failure reported after the reset and on a reset of a
    load already FAILING): at its load's last report the request goes to RECOMPUTE, the core
    recomputes it, and its next lookup answers 0 without the manager. The spec's own rule:
    vLLM 0.33.0 has no failure report (a failed copy asserts in the worker, W:299-301)."""
    FENCE_ONLY = "fence-only"
    """The connector only counts the failure against the reset fence (S@0.34.0:2440-2456;
    a reset forgets a FAILING job's failure with the job) and keeps no mark of it: the
    request leaves ORPHANED_LOAD for IDLE as after a good load. The worker still names the
    request in `failed_recving` (W@0.34.0:306-316), which reaches the core with the load's
    last `finished_recving` (KU@0.34.0:181-184), and the core recomputes it from token 0
    instead of promoting the load (CS@0.34.0:3839-3852, CS@0.34.0:3625-3646); its next
    lookup asks the manager."""


class PartialTailSearch(enum.Enum):
    """Where a lookup with partial tails searches for a boundary inside a block (D7)."""

    FROM_COMPLETE_HIT = "from-complete-hit"
    """In the block after the complete-chunk hit; a tail key another request's load still
    brings does not defer the lookup (S:1068-1195)."""
    FROM_FULL_ATTENTION_PREFIX = "from-full-attention-prefix"
    """In the block after the full-attention groups' hit, when it lies past the complete
    hit (a Mamba state missing at a chunk edge shortened it) and none of the full-attention
    chunks between them is being loaded; a block-aligned boundary below it is a complete
    chunk and not searched again; a tail key being loaded defers the lookup, as a complete
    chunk being loaded does (S@0.34.0:1159-1263, S@0.34.0:1283-1322)."""


@dataclass(frozen=True)
class Rules:
    """A release's choice for each rule on which releases differ (default: vLLM 0.33.0)."""

    store_admission: StoreAdmission = StoreAdmission.PER_OFFER
    last_token_cut: LastTokenCut = LastTokenCut.AFTER_CAPS
    failed_load_lookup: FailedLoadLookup = FailedLoadLookup.ONCE
    partial_tail_search: PartialTailSearch = PartialTailSearch.FROM_COMPLETE_HIT
    stale_load_failure: StaleLoadFailure = StaleLoadFailure.INVALIDATES_REQUEST

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = type(getattr(Rules, f.name))
            if not isinstance(value, kind):
                raise ValueError(f"Rules.{f.name} must be a {kind.__name__}, got {value!r}")

    @classmethod
    def of(cls, values: Mapping[str, str]) -> Rules:
        """0.33.0's rules with the named ones changed, each given by its value's text
        (`{"store_admission": "per-request"}`); ValueError for a name or value unknown."""
        changes: dict[str, enum.Enum] = {}
        for name, text in values.items():
            if name not in {f.name for f in fields(cls)}:
                raise ValueError(f"no rule {name!r}; known: "
                                 f"{', '.join(f.name for f in fields(cls))}")
            kind = type(getattr(cls, name))
            try:
                changes[name] = kind(text)
            except ValueError:
                raise ValueError(f"rule {name}: {text!r} is not one of "
                                 f"{', '.join(v.value for v in kind)}") from None
        return cls(**changes)  # type: ignore[arg-type]

    def changed(self) -> tuple[str, ...]:
        """The rules that differ from 0.33.0's, as `name=value` (empty for `Rules()`)."""
        base = Rules()
        return tuple(f"{f.name}={getattr(self, f.name).value}" for f in fields(self)
                     if getattr(self, f.name) != getattr(base, f.name))

    def __str__(self) -> str:
        return ",".join(self.changed()) or "0.33"

    def __repr__(self) -> str:
        for release, rules in BY_RELEASE.items():
            if rules == self:
                return "VLLM_" + release.replace(".", "_")
        return "Rules(" + ", ".join(f"{f.name}={type(getattr(self, f.name)).__name__}."
                                    f"{getattr(self, f.name).name}" for f in fields(self)) + ")"


VLLM_0_33 = Rules()
"""vLLM 0.33.0's rules (the spec's default), and every release's before it."""

VLLM_0_34 = Rules(store_admission=StoreAdmission.PER_REQUEST,
                  last_token_cut=LastTokenCut.BEFORE_CAPS,
                  failed_load_lookup=FailedLoadLookup.FOR_LIFE,
                  partial_tail_search=PartialTailSearch.FROM_FULL_ATTENTION_PREFIX,
                  stale_load_failure=StaleLoadFailure.FENCE_ONLY)
"""vLLM 0.34.0's rules."""

BY_RELEASE: dict[str, Rules] = {"0.33": VLLM_0_33, "0.34": VLLM_0_34}
"""The rules by release (major.minor), as `kvspec check --bounds rules=0.34` names them."""


def by_release(name: str) -> Rules:
    """The rules of release `name` (`0.34` or `0.34.0`); ValueError for one not listed."""
    key = ".".join(name.strip().split(".")[:2])
    if key not in BY_RELEASE:
        raise ValueError(f"no rules for release {name!r}; known: {', '.join(BY_RELEASE)}")
    return BY_RELEASE[key]
