"""What a tiering system must offer to be driven by `statemachine.tiering.testing` (the
model-based tests and the vLLM conformance tests): vLLM's `OffloadingManager` calls in the
machine's terms (request ids and keys are strings; slots are CPU-tier chunk ids), plus the
controls a test needs over the tiers' background work and the bytes.

Determinism: a system runs its tier I/O only inside `run_tier_io` (the reference) or waits in
it until every submitted I/O finished and every pending lookup probe resolved (vLLM's thread
pools), so that after each rule the projected state is a function of the rules so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from spec.tiering.state import TieringState

Answer = Literal["HIT", "HIT_PENDING", "RETRY", "MISS"]


class TieringSystem(Protocol):
    name: str
    num_slots: int
    num_tiers: int
    slot_bytes: int

    # --- vLLM's manager calls ---------------------------------------------------------
    def new_request(self, req_id: str) -> None:
        """on_new_request."""

    def lookup(self, req_id: str, key: str) -> Answer:
        """lookup (polls finished tier jobs first, as vLLM does)."""

    def prepare_load(self, req_id: str, keys: Sequence[str]) -> tuple[int, ...]:
        """prepare_load: pins the keys; returns their slots."""

    def complete_load(self, req_id: str, keys: Sequence[str]) -> None:
        """complete_load."""

    def prepare_store(self, req_id: str, keys: Sequence[str]
                      ) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """prepare_store: (keys to store, their slots), or None when no room."""

    def complete_store(self, req_id: str, keys: Sequence[str], success: bool) -> None:
        """complete_store; on success cascades to every secondary tier."""

    def request_finished(self, req_id: str) -> None:
        """on_request_finished."""

    def end_step(self) -> None:
        """on_schedule_end: poll, submit the step's promotions, reset the poll gate."""

    def reset(self) -> None:
        """reset_cache: drain the tiers, then forget the CPU tier."""

    def reset_flushed(self) -> None:
        """on_reset_flushed."""

    # --- the test's controls ----------------------------------------------------------
    def run_tier_io(self) -> None:
        """Let every submitted tier I/O finish (results wait for the next poll)."""

    def fail_next_io(self, tier: int) -> bool:
        """Make the next I/O task of `tier` fail with an I/O error; False if unsupported."""

    def write_slot(self, slot: int, data: bytes) -> None:
        """The GPU -> CPU copy of a store (the test writes the bytes)."""

    def read_slot(self, slot: int) -> bytes:
        """The CPU -> GPU copy of a load (the test checks the bytes)."""

    def project(self) -> TieringState:
        """The system's state, projected onto the abstract tiering state."""

    def close(self) -> None:
        """Stop threads, remove temporary directories."""
