"""Directed programs: event sequences that once exposed a bug, replayed on every change.

Each is a program of model events (`spec.model.parse_events` reads the text) under its bounds,
with where it was found and what went wrong then, and what the CPU tier holds when it ends
(`tier`). The reference implementation replays each (`tests/test_regressions.py`), and so
does vLLM's own scheduler side in `make conformance` (`tests/conformance/test_regressions.py`);
both must pass every check the random runs make: refinement (which holds the tier's chunks to
the model's after every hook), every invariant after every hook (inside steps too), and the
drain. The kill matrix runs every mutant of the tables that the scenarios leave along each
program (`Regression.check`): a broken invariant, an event with no row, or another tier at
the end kills it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spec import model as M
from spec.checker import Counterexample, check_program
from spec.model import Bounds, Event, RequestSettings, parse_events
from spec.scenarios import by_name as scenario


@dataclass(frozen=True)
class Regression:
    name: str
    found: str
    """How it was found."""
    cause: str
    """What was wrong, and where it was fixed."""
    bounds: Bounds
    program: str
    tier: tuple[str, ...]
    """What the CPU tier holds when the program ends (`ModelState.tier`: each chunk as
    `f<family> t<token> <group>`, `writing` while its store is in flight). A mutant that
    changes what is stored, when, or whether a store finds room (none of which an invariant
    or a progress property is about: vLLM may skip a store at any time) changes it."""

    def events(self) -> list[Event]:
        return parse_events(self.program)

    def check(self, tables: M.Tables = M.SPEC_TABLES) -> Counterexample | None:
        """The program checked as the search checks a path (`check_program`), and then its
        tier against `tier`. None: it holds. An event the model cannot send on the way
        raises its NotEnabled."""
        return check_program(self.bounds, self.events(), tables=tables, tier=self.tier)


_THREE = Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=2,
                failures=2, preemptions=2)
_THREE_NO_FAILURES = replace(_THREE, failures=0)
"""The same without worker failures (vLLM before 0.34.0 has no failure report)."""

_MAMBA_LOAD = Bounds(requests=2, tokens=3, workers=1, cpu_chunks=6, gpu_blocks=6, resets=1,
                     failures=0, preemptions=0, groups=("full", "mamba"))
_LOADED_THEN_RESET = (
    "arrive(r0) ; step(admit=r0) ; step() ; step() ; ack(job 0, count 1) ; "
    "ack(job 1, count 1) ; ack(job 2, count 1) ; finish(r0) ; step() ; arrive(r1) ; "
    "step(admit=r1) ; ack(job 6, count 1) ; reset() ; ")
"""r0 stores its prompt and Mamba states; r1 (the same prefix) loads one token of them
asynchronously, its load is reported, and a reset empties the CPU cache."""
_MAMBA_EVICTION = replace(_MAMBA_LOAD, requests=3, families=2, gpu_blocks=12)
"""Beside it, r1 of another prefix, whose stores evict r0's chunks from the CPU cache."""

_STALE_LOAD = Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=4, resets=1,
                     failures=1, preemptions=0)
_STALE_LOAD_PROGRAM = (
    "arrive(r0) ; arrive(r1) ; step(admit=r0) ; ack(job 0, count 2) ; step(admit=r1) ; "
    "{} ; ack(job 2, count 2) ; finish(r0) ; step() ; ack(job 3, count 2) ; step(admit=r1)")
"""r0 stores its chunk; r1 loads it asynchronously (job 1) beside r0's next store (job 2);
`{}`: a reset orphans the load, which one worker fails (before or after the reset) and the
other acks; r0 finishes and stores its prefix again (job 3); r1 is admitted again."""

_TIER_FOUND = (
    "make mutate: `{}` survived every scenario and every program before this one (listed "
    "cache-only: no invariant or progress property is about what the tier holds). The "
    "shortest program after which the mutant's tier differs from the spec's (`kvspec check "
    "--mutate --only TEXT --tier-program`, under a scenario's bounds)")
"""How the programs that pin a tier a mutant changes were found."""

REGRESSIONS: tuple[Regression, ...] = (
    Regression(
        "store-block-reused-inside-the-step",
        "a 15,000-example random campaign (13 events, two preemptions)",
        "INV-15 demanded at every hook that a live store's source block stay with its owner "
        "or be fenced. Inside a step the core may already have preempted the owner and given "
        "its blocks to a request admitted in the same step; the connector hears of the "
        "preemption in build_connector_meta, which flushes the store before the workers run "
        "the step. The invariant now judges store sources between steps, as it did loads.",
        _THREE,
        "arrive(r0) ; arrive(r1) ; arrive(r2) ; step(admit=r0) ; step() ; preempt(r0) ; "
        "ack(job 0, count 2) ; ack(job 1, count 2) ; step(admit=r0) ; ack(job 2, count 2) ; "
        "step(admit=r0) ; preempt(r0) ; step(admit=r1)",
        tier=("f0 t0 full", "f0 t1 full", "f0 t2 full writing")),
    Regression(
        "store-block-reused-inside-the-step-shortest",
        "the model checker, once it checked the invariants inside steps "
        "(scenario preemption-and-fences)",
        "the same statement of INV-15, reached with one preemption and two requests",
        Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=2, resets=1,
               failures=0, preemptions=1),
        "arrive(r0) ; arrive(r1) ; step(admit=r0) ; step() ; preempt(r0) ; "
        "ack(job 0, count 1) ; step(admit=r1)",
        tier=("f0 t0 full", "f0 t1 full writing")),
    Regression(
        "preempted-sync-load",
        "make conformance with the sync-load bounds, on vLLM 0.33.0",
        "the conformance projection called a request with a live sync load LOADING_SYNC "
        "whatever the core's status; once the core preempted it, its jobs (the sync load "
        "among them) are flushed and it is PREEMPTED_FLUSHING, as the model says.",
        Bounds(requests=2, tokens=3, workers=2, cpu_chunks=4, gpu_blocks=6, resets=2,
               failures=0, preemptions=1, sync_loads=True),
        "arrive(r0) ; arrive(r1) ; step(admit=r1) ; ack(job 0, count 2) ; step(admit=r0) ; "
        "preempt(r0) ; step()",
        tier=("f0 t0 full", "f0 t1 full writing", "f0 t2 full writing")),
    Regression(
        "reset-holds-a-sync-load",
        "make soak, once the reset fence's projection carried a job's sync flag",
        "the model's projection of the reset fence dropped a stale sync load's sync flag, "
        "which the implementation keeps: a refinement failure after any reset with a sync "
        "load in flight.",
        Bounds(requests=2, tokens=3, workers=2, cpu_chunks=4, gpu_blocks=6, resets=2,
               failures=2, sync_loads=True),
        "arrive(r0) ; arrive(r1) ; step(admit=r1) ; ack(job 0, count 2) ; step(admit=r0) ; "
        "reset()",
        tier=()),
    Regression(
        "loaded-request-left-in-the-drain",
        "make conformance-all on vLLM 0.27.0 (the drain left r1 behind)",
        "the conformance machine's restrictions on admissions (CURSOR-KEPT, WHOLE-PROMPT-HIT, "
        "releases before 0.33.0 and 0.30.0) are about the lookup, but they also refused the "
        "admission that ends an async load, which makes no lookup; the drain could then "
        "neither run the loaded r1 nor finish it (D3) and left it. Fixed in "
        "conformance/adapter.py (`VLLMMachine.admits_with_a_lookup`).",
        _THREE_NO_FAILURES,
        "step() ; arrive(r0) ; arrive(r1) ; arrive(r2) ; step(admit=r0) ; ack(job 0, count 2) ; "
        "step() ; ack(job 1, count 2) ; step(admit=r1) ; ack(job 2, count 2) ; "
        "ack(job 3, count 2) ; abort(r0) ; abort(r2)",
        tier=("f0 t0 full", "f0 t1 full", "f0 t2 full")),
    Regression(
        "failed-load-keeps-the-output",
        "make soak (model machine, seed 2, 46,567 steps), the first soak with decoding",
        "the model restarted a request whose sync load failed (or whose async load failed "
        "or timed out) as a fresh one, dropping the output tokens it had sampled; the "
        "reference, as vLLM, restarts it over prompt and output, so its next lookup may "
        "reach one token further. The model now restarts through `MCore.restarted` (output "
        "kept), as a preemption did.",
        Bounds(tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, preemptions=2,
               sync_loads=True, request_settings=(
                   RequestSettings(max_offload_tokens=4),), decode_tokens=2),
        "arrive(r0) ; arrive(r1) ; step(admit=r1) ; step() ; ack(job 0, count 1) ; "
        "ack(job 1, count 1) ; step() ; preempt(r1) ; ack(job 2, count 1) ; step(admit=r0) ; "
        "step() ; step(admit=r1) ; fail(job 5, count 1) ; step(admit=r1) ; step(admit=r1)",
        tier=("f0 t0 full", "f0 t1 full", "f0 t2 full", "f100 t3 full writing")),
    Regression(
        "failed-store-and-async-load",
        "vLLM 0.34.0, the first release whose workers report a failed transfer",
        "none: the failure paths vLLM 0.34 shares with the spec. A worker fails r0's store "
        "of chunk 1 (the job is FAILING until the other worker reports, then rolled back); "
        "a worker fails r1's async load of chunk 0 (RECOMPUTE: the next lookup answers 0 "
        "without asking the manager and the core recomputes r1 from token 0), and r1 runs "
        "and stores again.",
        _THREE,
        "arrive(r0) ; arrive(r1) ; step(admit=r0) ; step() ; ack(job 0, count 2) ; "
        "fail(job 1, count 1) ; ack(job 1, count 1) ; step() ; finish(r0) ; step() ; "
        "step(admit=r1) ; ack(job 2, count 2) ; fail(job 3, count 1) ; ack(job 3, count 1) "
        "; step(admit=r1) ; step()",
        tier=("f0 t0 full", "f0 t1 full writing", "f0 t2 full")),
    Regression(
        "orphaned-load-fails-then-hits",
        "vLLM 0.34.0's rule for a stale load's failure (the restriction STALE-LOAD-FAILURE "
        "before the spec stated it: `spec.rules.StaleLoadFailure`)",
        "none: the path of either rule. A reset orphans r1's async load of r0's chunk "
        "(job 1); one worker fails it, the other acks it. Under the spec's own rule "
        "(INVALIDATES_REQUEST) r1 goes to RECOMPUTE and its next lookup answers 0 without "
        "the manager; under 0.34.0's (FENCE_ONLY) the failure only drains the fence, r1 is "
        "IDLE, the core recomputes it on the worker's failed_recving, and its next lookup "
        "hits the chunk r0 stored again after the reset. Neither promotes the failed load.",
        _STALE_LOAD,
        _STALE_LOAD_PROGRAM.format(
            "reset() ; fail(job 1, count 1) ; ack(job 1, count 1)"),
        tier=("f0 t0 full", "f0 t1 full")),
    Regression(
        "failing-load-orphaned-then-hits",
        "vLLM 0.34.0's rule for a stale load's failure, the other way in (the reset row "
        "`reset(FAILING)->STALE`)",
        "none: the path of either rule. As `orphaned-load-fails-then-hits`, but one worker "
        "fails r1's load before the reset (FAILING) and the other acks it after. Under the "
        "spec's own rule the reset marks the orphaned r1 (`invalidate_orphaned_load`); "
        "under 0.34.0's it forgets the failure with the job, and the core recomputes r1 on "
        "the worker's failed_recving.",
        _STALE_LOAD,
        _STALE_LOAD_PROGRAM.format(
            "fail(job 1, count 1) ; reset() ; ack(job 1, count 1)"),
        tier=("f0 t0 full", "f0 t1 full")),
    Regression(
        "finished-sync-load-frees-its-blocks",
        "make soak (model machine, seeds 8 and 12), the first soak with decoding",
        "a request finished while its sync load's reports were still due; the core freed "
        "its blocks (the sync copy ended with its step) and gave one to a decoding request, "
        "which stored it. Both projections still counted a finished request's sync-load "
        "destinations as its blocks, so INV-15 saw the new store's source block held by "
        "the finished request. A finished request now holds only its async loads' "
        "destinations (`spec.request.finished_keeps_destinations`).",
        Bounds(tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, preemptions=2,
               sync_loads=True, decode_tokens=2, request_settings=(
                   RequestSettings(max_offload_tokens=4),)),
        "arrive(r1) ; arrive(r0) ; step(admit=r0) ; ack(job 0, count 1) ; step(admit=r1) ; "
        "step() ; finish(r1) ; step()",
        tier=("f0 t0 full", "f0 t1 full writing", "f0 t2 full writing", "f100 t3 full writing")),
    Regression(
        "hit-bound-at-the-hash-block",
        "a soak of block-aligned prompts in blocks of 2 tokens beside a sliding window, "
        "bounds no test had (the first soak with decoding beside a Mamba group found the "
        "same through a decoding request's output)",
        "the model bounded a hit at the last token (LAST-TOKEN-BOUND), the reference at the "
        "last whole hash block before it, as vLLM's `_max_loadable_tokens` does (OC:164-181). "
        "With a window group vLLM then stops the hit one token earlier, so on a "
        "block-aligned prompt of 4 tokens the model answered 2 and the reference 0. The "
        "model (`Bounds.tokens_per_hash`) and the conformance adapter now bound the hit at "
        "the hash block, as vLLM does.",
        Bounds(requests=3, tokens=4, workers=1, cpu_chunks=8, gpu_blocks=16, preemptions=2,
               families=2, failures=0, groups=("full", "sliding"), sliding_window=3,
               tokens_per_block=2),
        "arrive(r1) ; arrive(r0) ; step(admit=r0) ; step(admit=r1) ; step() ; preempt(r1) ; "
        "ack(job 1, count 1) ; step(admit=r1)",
        tier=("f0 t1 full writing", "f0 t1 sliding writing", "f0 t3 full writing",
              "f0 t3 sliding writing", "f1 t1 full", "f1 t1 sliding")),
    Regression(
        "partial-tail-output-hashes",
        "the first soak with decoding beside a Mamba group (partial tails, seed 1)",
        "the reference's adapter rebuilt a decoding request's block hashes after each "
        "sampled token one per block, where partial tails hash every token; the store that "
        "followed read more chunk keys than the hashes gave (IndexError in the scheduler's "
        "store builder). The adapter builds prompt and output hashes at one unit "
        "(`ReferenceAdapter._hashes`).",
        Bounds(requests=3, tokens=4, cpu_chunks=6, gpu_blocks=14, preemptions=2, families=2,
               failures=0, groups=("full", "mamba"), tokens_per_block=2, partial_tails=True,
               decode_tokens=3),
        "arrive(r0) ; arrive(r1) ; step(admit=r1) ; step(admit=r0) ; step() ; "
        "ack(job 2, count 2) ; step()",
        tier=("f0 t1 full writing", "f1 t1 full writing", "f1 t1 mamba writing",
              "f1 t2 full writing", "f1 t2 mamba writing", "f1 t3 mamba writing")),
    Regression(
        "loaded-state-stored-again-after-a-reset",
        "make conformance on vLLM 0.33.0's real core with a Mamba group (test_core_mamba, "
        "CONFORMANCE.md D4)",
        "vLLM's core hands off the Mamba state an async load ended on when it caches the "
        "loaded blocks, as it resumes the request; the CPU cache holds that state, unless a "
        "reset emptied it between the load's report and that step, and then vLLM's "
        "connector stores it again. The model's core left that hand-off out, so after such "
        "a reset its CPU cache lacked a state vLLM's holds. The model's core "
        "(`spec.model.hooks.handoffs`, its `resumed` requests) and the engine's now hand "
        "it off.",
        _MAMBA_LOAD,
        _LOADED_THEN_RESET + "step(admit=r1)",
        tier=("f0 t0 full writing", "f0 t0 mamba writing", "f0 t1 full writing",
              "f0 t1 mamba writing")),
    Regression(
        "loaded-state-stored-while-waiting",
        "the same, where vLLM's core reaches the loaded request but cannot schedule it in "
        "that step (vLLM 0.33.0's real core: test_core_mamba)",
        "vLLM's connector stores the handed-off state for a request that waits in the "
        "core's queue; the request table had no store row for a waiting request, and the "
        "projection called it PREEMPTED_FLUSHING. The table now has WAITING_STORING, and "
        "the model the event promote(r): the request waits with the store in flight, the "
        "store ends, and the request runs.",
        _MAMBA_LOAD,
        _LOADED_THEN_RESET + "promote(r1) ; ack(job 7, count 1) ; step(admit=r1)",
        tier=("f0 t0 full writing", "f0 t0 mamba", "f0 t1 full writing", "f0 t1 mamba writing")),
    Regression(
        "loaded-request-aborted-before-its-schedule",
        "divergence D3 (CONFORMANCE.md), a restriction of the conformance machine until it "
        "was fixed",
        "vLLM's connector learns a request's block table when the core schedules it; the "
        "model recorded it when the request's load was created, so a loaded request aborted "
        "before its first schedule, after a reset put its store cursor back to 0, had its "
        "loaded chunks stored again (job 4) where vLLM stores nothing. The load's row no "
        "longer records a table (model, reference, compiled checker); the blocks a loading "
        "request holds are the core's allocation.",
        _THREE_NO_FAILURES,
        "arrive(r0) ; step(admit=r0) ; step() ; step() ; ack(job 0, count 2) ; "
        "ack(job 1, count 2) ; ack(job 2, count 2) ; arrive(r1) ; step(admit=r1) ; "
        "ack(job 3, count 2) ; reset() ; abort(r1) ; step()",
        tier=()),
    Regression(
        "aborted-while-waiting-with-a-store",
        "the same fix: the abort the conformance machine avoided, of a request waiting with "
        "the store of its loaded state in flight",
        "r1 waits in WAITING_STORING with the store of the state its load ended on (the "
        "reset emptied the CPU cache); aborted, it drains that store (FINISHED_DRAINING) "
        "and, never scheduled, has no table for a final store.",
        _MAMBA_LOAD,
        _LOADED_THEN_RESET + "promote(r1) ; abort(r1) ; step() ; ack(job 7, count 1) ; step()",
        tier=("f0 t0 mamba",)),
    Regression(
        "preempted-then-aborted-before-the-next-step",
        "divergence D2 (CONFORMANCE.md), a restriction of the conformance machine until it "
        "was fixed",
        "a request the core preempted outside schedule() and that is aborted before the next "
        "step is in both preempted_req_ids and finished_req_ids; vLLM's preemption flush "
        "reads only its status entry and flushes its store, where the spec flushed only "
        "scheduled requests. The request table now has a preempt row from "
        "FINISHED_PENDING_FINAL (group preempt_flushed).",
        _THREE_NO_FAILURES,
        "arrive(r0) ; step(admit=r0) ; preempt(r0) ; abort(r0) ; step() ; ack(job 0, count 2)",
        tier=("f0 t0 full",)),
    Regression(
        "evicted-loaded-state-stored-while-waiting-then-reset",
        "make mutate: `reset(WAITING_STORING)->IDLE drop reset_store_cursor` survived every "
        "scenario (listed cache-only), whose only way to WAITING_STORING is a reset, which "
        "had already put the store cursor at 0",
        "vLLM's other way to a second store of a loaded state: an eviction, not a reset, "
        "between the load's report and the core reaching the request. r2 loads r0's first "
        "token (its cursor moves past the loaded chunk), r1's stores evict the loaded Mamba "
        "state, the core reaches r2 without scheduling it and hands the state off again "
        "(WAITING_STORING, cursor 1), and a reset must put the cursor back to 0 (INV-21): "
        "without reset_store_cursor on that row r2 would never store its first chunk "
        "again. The kill matrix now runs every survivor of its search through these "
        "programs, and this one kills that mutant.",
        _MAMBA_EVICTION,
        "arrive(r0) ; step(admit=r0) ; step() ; step() ; ack(job 0, count 1) ; "
        "ack(job 1, count 1) ; ack(job 2, count 1) ; finish(r0) ; step() ; arrive(r2) ; "
        "step(admit=r2) ; ack(job 3, count 1) ; ack(job 4, count 1) ; ack(job 5, count 1) ; "
        "ack(job 6, count 1) ; arrive(r1) ; step(admit=r1) ; step() ; step() ; "
        "ack(job 7, count 1) ; ack(job 8, count 1) ; ack(job 9, count 1) ; "
        "ack(job 10, count 1) ; ack(job 11, count 1) ; ack(job 12, count 1) ; promote(r2) ; "
        "reset() ; step(admit=r2)",
        tier=("f0 t0 full writing", "f0 t1 full writing", "f0 t1 mamba writing")),
    Regression(
        "late-recving-of-a-timed-out-load",
        "the compiled checker's first bounds with timeouts, a failure, a reset and a "
        "preemption together (checking decoding and chunks of several blocks; 15 events)",
        "past a timeout the spec admits a request again while its timed-out async load "
        "still copies; when that load's late completion named the request in "
        "finished_recving, the connector took it for the request's newer load, which a "
        "reset had orphaned: the request left ORPHANED_LOAD for IDLE, the core promoted it "
        "onto blocks that load had not filled, and when that load failed its stores "
        "published invalid KV (INV-20). The connector now takes such a finished_recving as "
        "stale (`spec.request.recving_is_stale`): it waits for the newer load, out of the "
        "set the core reads (`stale_recving_ignored`). Mutant `stale-recving-promotes`.",
        scenario("late-recving-after-timeout").bounds,
        "arrive(r0) ; step(admit=r0) ; preempt(r0) ; ack(job 0, count 1) ; step(admit=r0) ; "
        "step() ; step() ; step(admit=r0) ; preempt(r0) ; step(admit=r0) ; reset() ; "
        "ack(job 1, count 1) ; fail(job 2, count 1) ; step(admit=r0) ; step()",
        tier=("f0 t0 full writing", "f0 t1 full writing")),
    Regression(
        "waiting-store-records-the-table-at-the-schedule",
        _TIER_FOUND.format("request: schedule(WAITING_STORING)->STORING drop record_block_ids"),
        "r0 stores its first chunk and its state there, and is aborted; its stores end. r1 "
        "(the same prefix) loads them asynchronously; a reset empties the tier after the "
        "load's report; r1 is promoted and waits with the store of its loaded state in "
        "flight (WAITING_STORING). When the core schedules it, the connector records its "
        "block table (CONFORMANCE.md D3), so r1 stores its full-attention chunks beside its "
        "states. Without the record it runs on an empty table: the tier gets the states "
        "alone. The scenarios reach WAITING_STORING with Mamba groups only, where the states "
        "carry their own blocks.",
        _MAMBA_LOAD,
        "arrive(r0) ; arrive(r1) ; step(admit=r0) ; abort(r0) ; ack(job 0, count 1) ; "
        "ack(job 1, count 1) ; step(admit=r1) ; ack(job 2, count 1) ; reset() ; promote(r1) ; "
        "step(admit=r1)",
        tier=("f0 t0 full writing", "f0 t0 mamba writing", "f0 t1 full writing",
              "f0 t1 mamba writing")),
    Regression(
        "recompute-after-a-failed-load-stores-again",
        _TIER_FOUND.format(
            "request: lookup_resolved(RECOMPUTE,TIMED_OUT)->= drop bypass_offload_lookup"),
        "r0 stores its first chunk, is preempted, and is admitted again with an async load "
        "of it, which fails: RECOMPUTE, its loaded tokens invalid. Its next lookup bypasses "
        "the tier and clears that mark, so the recomputed r0 stores its second chunk. "
        "Without the clear the mark outlives the recompute and poisons the store: the tier "
        "never gets the chunk.",
        scenario("failed-load-not-retried").bounds,
        "arrive(r0) ; step(admit=r0) ; preempt(r0) ; ack(job 0, count 1) ; step(admit=r0) ; "
        "fail(job 1, count 1) ; step(admit=r0) ; step()",
        tier=("f0 t0 full", "f0 t1 full writing")),
    Regression(
        "timed-out-load-restarts-its-stores-from-token-0",
        _TIER_FOUND.format(
            "request: lookup_resolved(RECOMPUTE,TIMED_OUT)->= drop restart_from_token_zero"),
        "r0 stores its two chunks and is preempted; the store of the first is acked. r1, of "
        "the same prefix, loads that chunk asynchronously. The flushed store of r0's second "
        "chunk times out, and its slot, one of the tier's two, stays quarantined: its report "
        "never comes. r1's load times out too (TIMED_OUT). r0 is admitted again, loads its "
        "first chunk back and stores its second, which must evict the first (the tier's "
        "other slot is the quarantined one); r0 finishes. When r1 is admitted again its lookup "
        "finds no hit and restarts it from token 0, so it stores the first chunk again "
        "(evicting the second). Without the restart r1's store cursor stays past that chunk, "
        "where its load had put it, and r1 stores nothing.",
        scenario("timed-out-load-blocks").bounds,
        "arrive(r0) ; arrive(r1) ; step(admit=r0) ; step() ; preempt(r0) ; "
        "ack(job 0, count 1) ; step(admit=r1) ; step() ; step() ; step(admit=r0) ; "
        "ack(job 3, count 1) ; ack(job 2, count 1) ; step(admit=r0) ; finish(r0) ; "
        "ack(job 4, count 1) ; step(admit=r1)",
        tier=("f0 t0 full writing",)),
    Regression(
        "reset-frees-the-slot-of-a-timed-out-store",
        _TIER_FOUND.format("job: reset(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,TIMED_OUT)->STALE "
                           "drop enter_reset_fence"),
        "r0's first store times out and keeps its CPU slot quarantined until its report "
        "comes; a reset makes it stale, and the reset fence, which waits for that report, "
        "frees the slot. In the next step r0 (its store cursor back at 0) stores its three "
        "chunks into the tier's three slots. Without the freeing the quarantined slot stays "
        "counted, the store finds two free slots for three chunks, and the tier gets none.",
        scenario("timeouts").bounds,
        "arrive(r0) ; step(admit=r0) ; step() ; reset() ; step()",
        tier=("f0 t0 full writing", "f0 t1 full writing", "f0 t2 full writing")),
)


def by_name(name: str) -> Regression:
    for r in REGRESSIONS:
        if r.name == name:
            return r
    raise KeyError(f"no regression {name!r}; known: {', '.join(r.name for r in REGRESSIONS)}")
