"""The tiering invariants: predicates over `TieringState`, checked on the model's states, on
the reference tiering manager and on vLLM's after every step (so they see only what every
implementation projects), plus the data invariants the model states over its byte truth
(`spec.tiering.model`: which key's bytes each CPU slot and each tier copy holds).

A violation names the invariant, the subject (key, slot, job or request) and what is wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from spec.tiering import cpu_chunk as CC
from spec.tiering import tier_copy as TC
from spec.tiering import tier_job as TJ
from spec.tiering import tier_request as TR
from spec.tiering.state import TieringState


@dataclass(frozen=True)
class TierViolation:
    invariant: str
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant} ({self.subject}): {self.detail}"


@dataclass(frozen=True)
class TierInvariant:
    id: str
    name: str
    meaning: str
    check: Callable[[TieringState], list[TierViolation]]


def _slots_accounted(s: TieringState) -> list[TierViolation]:
    out = []
    owners: dict[int, list[str]] = {}
    for c in s.cpu:
        owners.setdefault(c.slot, []).append(c.key)
        if not 0 <= c.slot < s.num_slots:
            out.append(TierViolation("TINV-1", c.key, f"slot {c.slot} out of range"))
    for slot, keys in owners.items():
        if len(keys) > 1:
            out.append(TierViolation("TINV-1", f"slot {slot}", f"held by {', '.join(keys)}"))
        if slot in s.quarantined_slots:
            out.append(TierViolation("TINV-1", f"slot {slot}",
                                     f"quarantined but indexed for {', '.join(keys)}"))
    used = len(owners) + len(s.quarantined_slots - set(owners))
    if s.free_slots + used != s.num_slots:
        out.append(TierViolation("TINV-1", "CPU tier", f"{s.free_slots} free + {used} used "
                                  f"!= {s.num_slots} slots"))
    return out


def _io_slots_protected(s: TieringState) -> list[TierViolation]:
    """A slot a live promotion writes holds that key, write-pending; a key a live cascade
    reads is pinned at least once per cascade; a quarantined job's slots are quarantined or
    (a cascade's) still pinned by it."""
    out = []
    cascades: Counter[str] = Counter()
    for j in s.jobs:
        ident = j.job_id if j.job_id is not None else "queued"
        name = f"{j.kind} {ident} (t{j.tier}, {j.req_id})"
        for key, slot in zip(j.keys, j.slots, strict=True):
            c = s.chunk(key)
            if j.kind == "promotion" and j.state in (TJ.QUEUED, *TJ.IN_TABLE):
                want = CC.PROMOTION_QUEUED if j.state == TJ.QUEUED else CC.PROMOTING
                if c is None or c.state != want or c.slot != slot:
                    got = "absent" if c is None else f"{c.state} in slot {c.slot}"
                    out.append(TierViolation("TINV-2", key, f"{name} writes slot {slot} but "
                                             f"the key is {got}, not {want}"))
            elif j.kind == "promotion" and j.state in TJ.QUARANTINED:
                if slot not in s.quarantined_slots:
                    out.append(TierViolation("TINV-2", f"slot {slot}", f"{name} may still "
                                             "write it but it is not quarantined"))
            elif j.kind == "cascade" and j.state in (*TJ.IN_TABLE, *TJ.QUARANTINED):
                if c is not None and c.slot == slot:
                    cascades[key] += 1
                elif slot not in s.quarantined_slots:
                    out.append(TierViolation("TINV-2", key, f"{name} reads slot {slot}, "
                                             "which is neither the key's nor quarantined"))
    for key, n in cascades.items():
        c = s.chunk(key)
        assert c is not None
        if c.state != CC.PINNED or c.readers < n:
            out.append(TierViolation("TINV-2", key, f"{n} cascade(s) read it but it is "
                                     f"{c.state} with {c.readers} reader(s)"))
    return out


def _jobs_in_table(s: TieringState) -> list[TierViolation]:
    """Every job listed has not ended; a job in the table has an id, a queued one none; ids
    are unique; a promotion is queued only while promotions are not held."""
    out = []
    ids = Counter(j.job_id for j in s.jobs if j.job_id is not None)
    for jid, n in ids.items():
        if n > 1:
            out.append(TierViolation("TINV-3", f"job {jid}", f"listed {n} times"))
    for j in s.jobs:
        subj = f"{j.kind} {j.job_id}"
        if j.state not in TJ.UNFINISHED:
            out.append(TierViolation("TINV-3", subj, f"listed in state {j.state}"))
        if (j.state == TJ.QUEUED) != (j.job_id is None):
            out.append(TierViolation("TINV-3", subj, f"{j.state} with id {j.job_id}"))
        if j.state == TJ.QUEUED and j.kind != "promotion":
            out.append(TierViolation("TINV-3", subj, "only a promotion is queued"))
        if len(j.keys) != len(j.slots) or not j.keys:
            out.append(TierViolation("TINV-3", subj, f"keys {j.keys} vs slots {j.slots}"))
    return out


def _promotions_held(s: TieringState) -> list[TierViolation]:
    """While a reset's promotions are held, no promotion is queued or running."""
    if not s.promotions_held:
        return []
    return [TierViolation("TINV-4", f"promotion of {', '.join(j.keys)}", f"{j.state} while "
                          "promotions are held after a reset")
            for j in s.jobs if j.kind == "promotion" and j.state in (TJ.QUEUED, *TJ.IN_TABLE)]


def _copies_match_jobs(s: TieringState) -> list[TierViolation]:
    """A copy is WRITING only while a cascade of that tier writes it, READING only while a
    promotion from that tier runs; a promotion reads only a visible copy."""
    out = []
    writing = {(j.tier, k) for j in s.jobs if j.kind == "cascade"
               and j.state in (TJ.SUBMITTED, *TJ.QUARANTINED) for k in j.keys}
    reading = {(j.tier, k) for j in s.jobs if j.kind == "promotion"
               and j.state in (TJ.SUBMITTED, *TJ.QUARANTINED) for k in j.keys}
    for c in s.copies:
        if c.state == TC.WRITING and (c.tier, c.key) not in writing:
            out.append(TierViolation("TINV-5", f"t{c.tier}/{c.key}", "WRITING with no "
                                     "cascade of that tier writing it"))
        if c.state == TC.READING and (c.tier, c.key) not in reading:
            out.append(TierViolation("TINV-5", f"t{c.tier}/{c.key}", "READING with no "
                                     "promotion reading it"))
    running = {(j.tier, k) for j in s.jobs if j.kind == "promotion"
               and j.state == TJ.SUBMITTED for k in j.keys}
    for tier, key in sorted(running):
        if s.copy_state(tier, key) not in TC.VISIBLE:
            out.append(TierViolation("TINV-5", f"t{tier}/{key}", "a promotion reads a copy "
                                     f"that is {s.copy_state(tier, key)}"))
    return out


def _requests_wait_for_stores(s: TieringState) -> list[TierViolation]:
    """A finished request stays open exactly while a GPU store of it is pending."""
    out = []
    for r in s.requests:
        if r.state not in TR.OPEN:
            out.append(TierViolation("TINV-6", r.req_id, f"listed in state {r.state}"))
        if r.pending_stores < 0:
            out.append(TierViolation("TINV-6", r.req_id, f"{r.pending_stores} stores pending"))
        if r.state == TR.FINISH_PENDING and r.pending_stores == 0:
            out.append(TierViolation("TINV-6", r.req_id, "finished with no store pending, "
                                     "yet not finalized"))
    return out


TIER_INVARIANTS: tuple[TierInvariant, ...] = (
    TierInvariant("TINV-1", "slots-accounted", "every CPU slot is free, held by one indexed "
                  "key, or quarantined", _slots_accounted),
    TierInvariant("TINV-2", "tier-io-slots-protected", "a slot a promotion writes or a "
                  "cascade reads is neither evicted nor reused: write-pending, pinned or "
                  "quarantined", _io_slots_protected),
    TierInvariant("TINV-3", "tier-jobs-in-table", "every unfinished tier job is in the job "
                  "table (or queued, or quarantined) exactly once", _jobs_in_table),
    TierInvariant("TINV-4", "promotions-held-after-reset", "no promotion is queued or runs "
                  "while a reset's late GPU copies may still land", _promotions_held),
    TierInvariant("TINV-5", "copies-follow-jobs", "a copy is written or read only by a job "
                  "of its tier; a promotion reads only a complete copy", _copies_match_jobs),
    TierInvariant("TINV-6", "finish-waits-for-stores", "a finished request is finalized in "
                  "the tiers only after its last GPU store completed",
                  _requests_wait_for_stores),
)

DATA_INVARIANTS: tuple[tuple[str, str, str], ...] = (
    ("TINV-7", "loadable-after-write", "a key the CPU tier answers HIT for holds the bytes a "
     "completed store or a landed promotion wrote for it (checked at every load too)"),
    ("TINV-8", "copies-complete", "a copy a tier answers HIT for holds the key's complete "
     "bytes: a torn or another key's write is never published"),
)
"""Stated over the model's byte truth (`spec.tiering.model.data_violations`), and over real
bytes by the model-based tests and the data plane."""


def check_tiering(s: TieringState) -> list[TierViolation]:
    """Every structural tiering invariant on `s` (empty: all hold)."""
    return [v for inv in TIER_INVARIANTS for v in inv.check(s)]
