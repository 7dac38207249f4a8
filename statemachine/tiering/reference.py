"""`ReferenceTieringSystem`: the reference tiering manager behind the `TieringSystem` protocol
(`statemachine.tiering.system`), as the model-based tests and the conformance tests drive it.

It owns a bytearray CPU buffer (`BytearrayBuffer`), a `TieringManager` over it and N
secondary tiers, each "memory" (`MemoryTier`) or "fs" (`FilesystemTier` under a temporary
directory, removed by `close`). Keys are strings; each maps to an `OffloadKey` (an int) by a
stable hash, so a filesystem tier's file names do not depend on the order keys appear in.

Tier I/O runs only inside `run_tier_io` (the inline executor), as the protocol's
determinism asks. ``threads > 0`` gives each tier real I/O threads instead, which start a
task as soon as it is submitted, `run_tier_io` only waiting for them: the same code, run
concurrently, but the state between two calls then depends on the threads' timing, so the
model-based tests use the default.

``async_lookup`` makes the tiers answer lookups as vLLM's filesystem tier does (RETRY until
the key's existence probe, sent at the end of the step and run with the tier's I/O, resolved);
the default answers HIT or MISS at once, as the tiering model (`spec.tiering.model`) does.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from spec.tiering.state import TieringState
from statemachine.errors import ConfigError, UnknownRequest
from statemachine.manager import LookupResult, ReqContext
from statemachine.policies import OffloadKey, PolicyName
from statemachine.tiering.fs_tier import FilesystemTier
from statemachine.tiering.io import BytearrayBuffer
from statemachine.tiering.manager import TieringManager
from statemachine.tiering.projection import project
from statemachine.tiering.system import Answer
from statemachine.tiering.tiers import MemoryTier, SecondaryTier

TierKind = Literal["memory", "fs"]

_ANSWERS: dict[LookupResult, Answer] = {LookupResult.HIT: "HIT",
                                        LookupResult.HIT_PENDING: "HIT_PENDING",
                                        LookupResult.RETRY: "RETRY", LookupResult.MISS: "MISS"}


def offload_key(name: str) -> OffloadKey:
    """The stable OffloadKey of a key name (64 bits of its BLAKE2b hash, signed)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class ReferenceTieringSystem:
    """The reference tiering manager as a `TieringSystem`."""

    name = "reference"

    def __init__(self, num_slots: int = 4, tiers: Sequence[TierKind] = ("memory",), *,
                 slot_bytes: int = 16, tier_capacity: int | None = None,
                 tier_job_timeout_steps: int | None = None, async_lookup: bool = False,
                 marks_present: bool = False, protect_scanned_keys: bool = True,
                 threads: int = 0, root: str | Path | None = None,
                 eviction_policy: PolicyName = "lru") -> None:
        bad = [k for k in tiers if k not in ("memory", "fs")]
        if bad:
            raise ConfigError(f"tier kinds must be 'memory' or 'fs', got {bad}")
        self.num_slots = num_slots
        self.num_tiers = len(tiers)
        self.slot_bytes = slot_bytes
        self.buffer = BytearrayBuffer(num_slots, slot_bytes)
        self._tmp: Path | None = None
        if "fs" in tiers and root is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvtier_"))
        base = Path(root) if root is not None else self._tmp
        built: list[SecondaryTier] = []
        for i, kind in enumerate(tiers):
            if kind == "fs":
                assert base is not None
                built.append(FilesystemTier(base / f"tier{i}", self.buffer,
                                            capacity=tier_capacity, threads=threads,
                                            async_lookup=async_lookup,
                                            marks_present=marks_present, name=f"fs{i}"))
            else:
                built.append(MemoryTier(self.buffer, capacity=tier_capacity, threads=threads,
                                        async_lookup=async_lookup,
                                        marks_present=marks_present, name=f"memory{i}"))
        self.tiers = built
        self.manager = TieringManager(num_slots, built, eviction_policy=eviction_policy,
                                      tier_job_timeout_steps=tier_job_timeout_steps,
                                      protect_scanned_keys=protect_scanned_keys)
        self._ctx: dict[str, ReqContext] = {}
        self._names: dict[OffloadKey, str] = {}

    # ------------------------------------------------------------------ keys, requests
    def key(self, name: str) -> OffloadKey:
        k = offload_key(name)
        seen = self._names.setdefault(k, name)
        if seen != name:
            raise ConfigError(f"keys {seen!r} and {name!r} hash alike; rename one")
        return k

    def key_name(self, key: OffloadKey) -> str:
        return self._names.get(key, f"#{key}")

    def _keys(self, names: Sequence[str]) -> list[OffloadKey]:
        return [self.key(n) for n in names]

    def ctx(self, req_id: str) -> ReqContext:
        try:
            return self._ctx[req_id]
        except KeyError:
            raise UnknownRequest(req_id, "reference tiering system") from None

    # ------------------------------------------------------------------ vLLM's calls
    def new_request(self, req_id: str) -> None:
        self._ctx[req_id] = self.manager.on_new_request(req_id)

    def lookup(self, req_id: str, key: str) -> Answer:
        return _ANSWERS[self.manager.lookup(self.key(key), self.ctx(req_id))]

    def prepare_load(self, req_id: str, keys: Sequence[str]) -> tuple[int, ...]:
        return self.manager.prepare_load(self._keys(keys), self.ctx(req_id))

    def complete_load(self, req_id: str, keys: Sequence[str]) -> None:
        self.manager.complete_load(self._keys(keys), self.ctx(req_id))

    def prepare_store(self, req_id: str, keys: Sequence[str]
                      ) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        out = self.manager.prepare_store(self._keys(keys), self.ctx(req_id))
        if out is None:
            return None
        return tuple(self.key_name(k) for k in out.keys_to_store), out.chunk_ids

    def complete_store(self, req_id: str, keys: Sequence[str], success: bool) -> None:
        self.manager.complete_store(self._keys(keys), self.ctx(req_id), success)

    def request_finished(self, req_id: str) -> None:
        self.manager.on_request_finished(self.ctx(req_id))

    def end_step(self) -> None:
        self.manager.on_schedule_end()

    def reset(self) -> None:
        self.manager.reset_cache()

    def reset_flushed(self) -> None:
        self.manager.on_reset_flushed()

    # ------------------------------------------------------------------ the test's controls
    def run_tier_io(self) -> None:
        self.manager.run_tier_io()

    def fail_next_io(self, tier: int) -> bool:
        self.tiers[tier].fail_next(1)
        return True

    def hang(self, tier: int) -> None:
        self.tiers[tier].hang()

    def unhang(self, tier: int) -> None:
        self.tiers[tier].unhang()

    def write_slot(self, slot: int, data: bytes) -> None:
        self.buffer.write(slot, data)

    def read_slot(self, slot: int) -> bytes:
        return self.buffer.read(slot)

    def project(self) -> TieringState:
        return project(self.manager, self.key_name)

    def check_consistency(self) -> list[str]:
        return self.manager.check_consistency()

    def close(self) -> None:
        self.manager.shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


__all__ = ["ReferenceTieringSystem", "TierKind", "offload_key"]
