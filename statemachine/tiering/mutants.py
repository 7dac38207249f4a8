"""The tiering mutants: each seeded tiering fault of `spec.tiering.faults` as a patch of the
reference tiering manager (`statemachine.tiering`), so that the model checker (on the
model) and the model-based tests (on the reference, `statemachine.tiering.testing`) can each
be shown to find it. Each names the vLLM change whose absence it reproduces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from statemachine.manager import ReqContext
from statemachine.mutants import Patch, _patch
from statemachine.policies import OffloadKey
from statemachine.tiering.manager import TieringManager
from statemachine.tiering.models import TierJob, TierRequest
from statemachine.tiering.tiers import SecondaryTier


@dataclass(frozen=True)
class TierMutant:
    name: str
    """The name of the matching fault of the tiering model (`spec.tiering.faults`)."""
    stands_for: str
    description: str
    patch: Patch
    caught_by_tests: bool = True
    """False where the model-based tests cannot reach the fault (a hang is not one of
    their rules): the checker and a direct test of the reference catch it."""


def _promotions_not_held(orig: Any) -> Any:
    def reset_cache(self: TieringManager) -> None:
        orig(self)
        self._promotions_held = False
    return reset_cache


def _finalize_at_once(orig: Any) -> Any:
    def stores_pending(self: TierRequest, event: Any) -> bool:
        return False
    return stores_pending


def _cascade_without_pin(orig: Any) -> Any:
    def create_store_job(self: TieringManager, keys: Sequence[OffloadKey], ctx: ReqContext,
                         tier: int) -> TierJob:
        job: TierJob = orig(self, keys, ctx, tier)
        self.primary.complete_read(keys, ctx)  # the pin taken for the cascade, dropped
        job.pins_held = False
        return job
    return create_store_job


def _drain_returns_at_once(orig: Any) -> Any:
    def drain(self: SecondaryTier, timeout_s: float = 0.0) -> bool:
        return True  # claims the tier is idle without waiting for its I/O
    return drain


def _protect_nothing(orig: Any) -> Any:
    def promotion_protects(self: TieringManager, ctx: ReqContext) -> set[OffloadKey]:
        return set()
    return promotion_protects


def _no_timeout(orig: Any) -> Any:
    def check_timeouts(self: TieringManager) -> None:
        return None
    return check_timeouts


TIER_MUTANTS: tuple[TierMutant, ...] = (
    TierMutant("promotions-not-held", "TM:1155-1162, TM:1198-1202 (on_reset_flushed)",
               "reset_cache does not hold promotions until on_reset_flushed",
               _patch(TieringManager, "reset_cache", _promotions_not_held)),
    TierMutant("finalize-before-final-store", "vLLM's tiering KeyError (TM:1056-1080)",
               "on_request_finished finalizes the request in the tiers at once, with a GPU "
               "store of it pending", _patch(TierRequest, "stores_pending", _finalize_at_once)),
    TierMutant("cascade-without-pin", "TM:991-1000 (prepare_read)",
               "a cascade reads its CPU slot without pinning it",
               _patch(TieringManager, "_create_store_job", _cascade_without_pin)),
    TierMutant("reset-without-drain", "vLLM PR #44541 (drain_jobs, TM:1164-1169)",
               "reset_cache does not wait for the tiers' I/O before forgetting the CPU tier",
               _patch(SecondaryTier, "drain", _drain_returns_at_once)),
    TierMutant("promotion-evicts-own-prefix", "vLLM 0.33.0, finding T1 (TM:713)",
               "a promotion's CPU slot may come from evicting a chunk its request's lookup "
               "just hit: a prefix longer than the CPU tier is deferred forever",
               _patch(TieringManager, "_promotion_protects", _protect_nothing),
               caught_by_tests=False),
    TierMutant("no-tier-timeout", "vLLM 0.33.0 (no tier timeout, TM:1146-1148)",
               "no tier job times out: a hung tier keeps its promotion forever",
               _patch(TieringManager, "_check_timeouts", _no_timeout),
               caught_by_tests=False),
)


def tier_mutant(name: str) -> TierMutant:
    for m in TIER_MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no tiering mutant {name!r}; known: "
                   f"{', '.join(m.name for m in TIER_MUTANTS)}")
