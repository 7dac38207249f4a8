"""The tiering manager as the connector's manager: `ConnectorTieringManager`, the reference
`TieringManager` with what the scheduler side of the connector
(`statemachine.scheduler.OffloadingScheduler`) asks of its CPU manager, and `build`, which
stacks the secondary tiers of a `statemachine.config.TieringConfig` below the CPU tier.

vLLM's connector holds one manager; with tiering configured it is a
`TieringOffloadingManager` (TM:207-1305) in place of the CPU manager, with the same calls:
the connector looks up, prepares and completes loads and stores, ends the step with
`on_schedule_end` (S:2190-2195), resets with `reset_cache` (S:2402-2450) and says
`on_reset_flushed` once every job its reset fenced reported (S:2265-2276, S:2443-2448). A
lookup may answer HIT_PENDING (a promotion is on its way) or RETRY (a tier's existence probe
is not answered yet): the connector defers the request (LOOKUP_DEFERRED) and the core asks
again in a later step.

What the connector needs beyond vLLM's tiering API (its job timeout, its invariants):

* `quarantine_store` / `release_slots`: a GPU store that timed out leaves the CPU tier's
  index, its slots quarantined until its late reports (the CPU manager's own calls); the
  request's pending store is completed as failed, so the tiering manager may finalize it.
  The CPU tier's quarantine then holds these slots beside the ones tier jobs hold
  (`check_consistency` knows both). A reset frees the connector's slots (its reset fence
  keeps the late copies out) and keeps the tier jobs' (TM:1164-1169 waits for the tiers
  instead).
* `chunk_ref_counts` is the connector's view of the CPU tier: the pins cascades hold are
  left out, so the connector's invariant INV-12 (a key's ref_cnt is the connector's loads
  reading it) still holds; the full count (loads plus cascades) is the tiering manager's
  `_check_pins`, run by `check_consistency`.
* `finished_signals`, `stores_after_finish`, `quarantined_slots`: the CPU tier's.

Observation (for the byte oracle, `statemachine.tiering.copy_oracle`): the tiers `build`
makes report to a `CopyObserver` each cascade as it is submitted (the main thread: the slot
is pinned), each copy's bytes as a cascade publishes them and as a promotion reads them (the
tier's I/O thread, if any). The manager counts *tier evictions*: CPU evictions of a chunk
that some tier holds a copy of (the chunk can come back by a promotion).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from spec.tiering.invariants import check_tiering
from statemachine.errors import ConfigError, KVSpecError
from statemachine.manager import CPUOffloadingManager, PrepareStoreOutput, ReqContext
from statemachine.policies import OffloadKey, PolicyName
from statemachine.tiering.fs_tier import FilesystemTier
from statemachine.tiering.io import BytearrayBuffer, PrimaryBuffer
from statemachine.tiering.manager import TieringManager
from statemachine.tiering.tiers import MemoryTier, SecondaryTier, TransferJob

if TYPE_CHECKING:
    from statemachine.config import OffloadingConfig


class TieringInconsistency(KVSpecError):
    """The tiering manager's state broke one of its own invariants (`check_consistency`)
    or a tiering invariant of `spec.tiering.invariants` (TINV-1..6)."""

    def __init__(self, problems: Sequence[str], event: str) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(f"after {event}: the tiering manager is inconsistent:\n{lines}{more}")


class CopyObserver(Protocol):
    """Told what the tiers copy (the byte oracle). `copy_written` and `copy_read` run on a
    tier's I/O thread when it has threads: they must not raise, only record."""

    def cascade_submitted(self, tier: int, key: OffloadKey, slot: int, writes: bool) -> None:
        """A cascade will copy `slot` into the tier as `key`'s copy (`writes`: no copy of
        the key is there yet); the slot is pinned now."""

    def copy_written(self, tier: int, key: OffloadKey, data: bytes) -> None:
        """A cascade publishes `data` as `key`'s copy."""

    def copy_read(self, tier: int, key: OffloadKey, data: bytes) -> None:
        """A promotion read `data` from `key`'s copy; it writes it into a CPU slot next."""


class _ObservedTier(SecondaryTier):
    """A tier that tells its `observer` what it copies (see `CopyObserver`)."""

    observer: CopyObserver | None = None
    index: int = 0

    def submit_store(self, job: TransferJob) -> None:
        if self.observer is not None:
            for key, slot in zip(job.keys, job.slots, strict=True):
                self.observer.cascade_submitted(self.index, key, slot, not self.has_copy(key))
        super().submit_store(job)

    def _publish(self, key: OffloadKey, data: bytes) -> None:
        if self.observer is not None:
            self.observer.copy_written(self.index, key, data)
        super()._publish(key, data)  # type: ignore[safe-super]

    def _fetch(self, key: OffloadKey) -> bytes:
        data = super()._fetch(key)  # type: ignore[safe-super]
        if self.observer is not None:
            self.observer.copy_read(self.index, key, data)
        return data


class ObservedMemoryTier(_ObservedTier, MemoryTier):
    """`MemoryTier`, observed."""


class ObservedFilesystemTier(_ObservedTier, FilesystemTier):
    """`FilesystemTier`, observed."""


class _CountingPrimary(CPUOffloadingManager):
    """The CPU tier, reporting the keys each allocation evicts (a GPU store's or a
    promotion's) to `on_evicted`."""

    def __init__(self, num_chunks: int, eviction_policy: PolicyName,
                 on_evicted: ConnectorTieringManager) -> None:
        super().__init__(num_chunks, eviction_policy)
        self._owner = on_evicted

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext,
                      protect: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx, protect)
        if out is not None and out.evicted_keys:
            self._owner.note_evicted(out.evicted_keys)
        return out


class ConnectorTieringManager(TieringManager):
    """`TieringManager` with the connector's calls (see the module docstring). `owned_root`:
    a directory this manager created and removes at `shutdown` (unless `keep_root`)."""

    def __init__(self, num_slots: int, tiers: Sequence[SecondaryTier] = (), *,
                 eviction_policy: PolicyName = "lru",
                 tier_job_timeout_steps: int | None = None,
                 protect_scanned_keys: bool = True,
                 owned_root: Path | None = None, keep_root: bool = False) -> None:
        super().__init__(num_slots, tiers, eviction_policy=eviction_policy,
                         tier_job_timeout_steps=tier_job_timeout_steps,
                         protect_scanned_keys=protect_scanned_keys)
        self.primary = _CountingPrimary(num_slots, eviction_policy, self)
        self.owned_root = owned_root
        self.keep_root = keep_root
        self._store_owner: dict[OffloadKey, ReqContext] = {}
        """Write-pending keys of the connector's GPU stores -> their request."""
        self._connector_held: set[int] = set()
        """Slots the connector's timed-out GPU stores hold (quarantined in the CPU tier)."""
        self.stats.update(tier_evictions=0, evictions_without_copy=0,
                          connector_quarantined_stores=0)

    # ================================================================ the connector's view
    def chunk_ref_counts(self) -> dict[OffloadKey, int]:
        """The CPU tier's reference counts less the pins cascades hold: -1 write pending,
        else the connector's loads reading the key."""
        out = self.primary.chunk_ref_counts()
        for job in self.jobs():
            if not job.is_promotion and job.pins_held:
                for key in job.keys:
                    if out.get(key, 0) > 0:
                        out[key] -= 1
        return out

    @property
    def quarantined_slots(self) -> frozenset[int]:
        return self.primary.quarantined_slots

    @property
    def finished_signals(self) -> dict[str, int]:
        return self.primary.finished_signals

    @property
    def stores_after_finish(self) -> list[str]:
        return self.primary.stores_after_finish

    def tier_pins(self) -> int:
        """Pins the cascades (live or quarantined) hold on CPU chunks."""
        return sum(len(j.keys) for j in self.jobs() if not j.is_promotion and j.pins_held)

    # ================================================================ loads, stores
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext | None) -> None:
        """As the CPU manager's: ``ctx`` None for the late end of a timed-out load, whose
        request may be gone (the tiering manager only hands it to the CPU tier)."""
        super().complete_load(keys, ctx)  # type: ignore[arg-type]

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext
                      ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx)
        if out is not None:
            self._store_owner.update(dict.fromkeys(out.keys_to_store, ctx))
        return out

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext,
                       success: bool = True) -> None:
        super().complete_store(keys, ctx, success)
        for key in keys:
            if self._store_owner.get(key) is ctx:
                del self._store_owner[key]

    def quarantine_store(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """A GPU store timed out (beyond vLLM): its write-pending keys leave the index, their
        slots quarantined until `release_slots`; the request's store is completed as failed
        in the tiering manager (nothing cascades)."""
        owners = {self._store_owner[k] for k in keys if k in self._store_owner}
        slots = self.primary.quarantine_store(keys)
        self._connector_held.update(slots)
        for ctx in owners:
            mine = [k for k in keys if self._store_owner.get(k) is ctx]
            self.complete_store(mine, ctx, success=False)
        self.stats["connector_quarantined_stores"] += 1
        return slots

    def release_slots(self, chunk_ids: Sequence[int]) -> None:
        """The late reports of a timed-out GPU store came: its slots go back."""
        self.primary.release_slots(chunk_ids)
        self._connector_held.difference_update(chunk_ids)

    def note_evicted(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if any(tier.has_copy(key) for tier in self.tiers):
                self.stats["tier_evictions"] += 1
            else:
                self.stats["evictions_without_copy"] += 1

    # ================================================================ resets, checks
    def reset_cache(self) -> None:
        """The tiering manager's reset; the connector's quarantined slots are freed with the
        rest (its reset fence keeps their late copies out), the tier jobs' stay held."""
        super().reset_cache()
        self._connector_held.clear()
        self._store_owner.clear()

    def check_consistency(self) -> list[str]:
        """The tiering manager's checks, and TINV-1..6 on its projection; the CPU tier's
        quarantine is the tier jobs' holds plus the connector's."""
        from statemachine.tiering.projection import project

        problems: list[str] = []
        for p in super().check_consistency():
            if p.startswith("slot holds ") and " != the CPU tier's quarantined slots " in p:
                continue  # the connector's slots are in the CPU tier's quarantine too
            problems.append(p)
        held = set(self._slot_holds) | self._connector_held
        if held != set(self.primary.quarantined_slots):
            problems.append(f"the tier jobs' slot holds {sorted(self._slot_holds)} and the "
                            f"connector's {sorted(self._connector_held)} != the CPU tier's "
                            f"quarantined slots {sorted(self.primary.quarantined_slots)}")
        problems += [str(v) for v in check_tiering(project(self))]
        return problems

    def temporaries(self) -> list[Path]:
        """Temporary files in the filesystem tiers' directories (writes not yet published,
        or left behind)."""
        return [p for tier in self.tiers if isinstance(tier, FilesystemTier)
                for p in tier.temporaries()]

    def tier_leaks(self) -> dict[str, int]:
        """What the tiers still hold when nothing should be in flight: all zero after a
        full drain."""
        return {
            "tier_jobs": len(self.jobs()),
            "tier_pins": self.tier_pins(),
            "tier_quarantined_slots": len(self._slot_holds),
            "tier_open_requests": len(self.open_requests()),
            "tier_io_pending": sum(1 for t in self.tiers if t.has_pending_work()),
            "tier_temporary_files": len(self.temporaries()),
            "tier_inconsistencies": len(self.check_consistency()),
        }

    def shutdown(self) -> None:
        super().shutdown()
        if self.owned_root is not None and not self.keep_root:
            shutil.rmtree(self.owned_root, ignore_errors=True)


def build(config: OffloadingConfig, buffer: PrimaryBuffer | None = None, *,
          observer: CopyObserver | None = None,
          keep_root: bool = False) -> ConnectorTieringManager:
    """The connector's tiering manager for `config.tiering`: a CPU tier of
    `config.num_cpu_chunks` slots over `buffer` (the workers' CPU tensors; None: a scratch
    buffer of one byte per slot, for a connector whose bytes no worker copies), the tiers
    below it in order, observed by `observer`."""
    tc = config.tiering
    if tc is None:
        raise ConfigError("build: the OffloadingConfig has no tiering configured")
    if config.store_threshold != 1:
        raise ConfigError("store admission (store_threshold > 1) with tiers: the tiering "
                          "manager's CPU tier admits every store")
    buf: PrimaryBuffer = buffer if buffer is not None else BytearrayBuffer(
        config.num_cpu_chunks, 1)
    owned: Path | None = None
    root = Path(tc.root) if tc.root is not None else None
    if root is None and "fs" in tc.tiers:
        root = owned = Path(tempfile.mkdtemp(prefix="kvspec_tiers_"))
    tiers: list[SecondaryTier] = []
    for i, kind in enumerate(tc.tiers):
        tier: _ObservedTier
        if kind == "fs":
            assert root is not None
            tier = ObservedFilesystemTier(root / f"tier{i}", buf, capacity=tc.capacity,
                                          threads=tc.threads,
                                          async_lookup=tc.async_lookup_of(kind),
                                          name=f"fs{i}")
        else:
            tier = ObservedMemoryTier(buf, capacity=tc.capacity, threads=tc.threads,
                                      async_lookup=tc.async_lookup_of(kind),
                                      name=f"memory{i}")
        tier.observer, tier.index = observer, i
        tiers.append(tier)
    return ConnectorTieringManager(
        config.num_cpu_chunks, tiers,
        eviction_policy=config.eviction_policy,  # type: ignore[arg-type]
        tier_job_timeout_steps=tc.job_timeout_steps,
        protect_scanned_keys=tc.protect_scanned_keys, owned_root=owned, keep_root=keep_root)


__all__ = ["ConnectorTieringManager", "CopyObserver", "ObservedFilesystemTier",
           "ObservedMemoryTier", "TieringInconsistency", "build"]
