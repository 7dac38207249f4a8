"""The directed programs of `spec.regressions` against the reference implementation, with
every check of the random runs, and proof that each still reaches what it was found for."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import pytest

from spec import model as M
from spec.checker import check_program, tier_difference
from spec.invariants import check
from spec.model.projection import abstract
from spec.regressions import REGRESSIONS, by_name
from spec.state import AbstractState
from statemachine.errors import InvariantViolation
from statemachine.testing import BLOCK, OffloadingStateMachine, ReferenceAdapter, replay
from tests.test_spec_mutation import _named


class Recording(ReferenceAdapter):
    """The reference, keeping the projection after every hook call."""

    seen: ClassVar[list[tuple[str, AbstractState]]] = []

    def call(self, call: M.Call) -> Any:
        out = super().call(call)
        Recording.seen.append((call.hook, self.abstract_state()))
        return out


class RecordingMachine(OffloadingStateMachine):
    adapter_factory = Recording


def _store_block_with_another(s: AbstractState) -> list[tuple[int, int, str]]:
    """(store job, source block, holder): an unflushed live store whose source block another
    request holds."""
    out = []
    for j in s.jobs:
        if j.kind != "store" or j.flush_requested or j.failed:
            continue
        for r in s.requests:
            if r.id != j.owner:
                out.extend((j.id, b, r.id) for b in sorted(j.blocks & set(r.gpu_blocks)))
    return out


@pytest.mark.parametrize("reg", REGRESSIONS, ids=[r.name for r in REGRESSIONS])
def test_regression_replays_clean_on_the_reference(reg: Any) -> None:
    """Every event taken, refinement after every hook (the reference's chunks are the
    model's), so the reference's tier ends as the program pins it."""
    path = replay(reg.events(), reg.bounds)
    assert len(path) == len(reg.events()) and path[-1].tier() == reg.tier


@pytest.mark.parametrize("reg", REGRESSIONS, ids=[r.name for r in REGRESSIONS])
def test_regression_is_a_clean_path_of_the_spec(reg: Any) -> None:
    """Every event of the program is one the model can send where it stands (the replays
    skip an event that is not: a stale program would shrink unseen), and every invariant
    holds after each, inside its step too: the path the kill matrix runs mutants along."""
    assert reg.check() is None


def test_a_program_kills_a_mutant_past_the_scenarios_bounds() -> None:
    """The reset of a request waiting with a store must put its store cursor back to 0:
    without it, the program leaves r2's cursor past its loaded chunk after the reset
    (INV-21). The scenarios reach WAITING_STORING only through a reset, which had put the
    cursor at 0 already; the kill matrix runs this program on the mutants they leave."""
    reg = by_name("evicted-loaded-state-stored-while-waiting-then-reset")
    mutant = _named("request: reset(WAITING_STORING)->IDLE drop reset_store_cursor")
    broken = reg.check(mutant.tables())
    assert broken is not None and broken.verdict == "invariant INV-21"
    assert str(broken.steps[-1].event) == "reset()"
    assert broken.violations[0].request == "r2"


@pytest.mark.parametrize("name", ["store-block-reused-inside-the-step",
                                  "store-block-reused-inside-the-step-shortest"])
def test_inside_the_step_a_store_block_is_with_another_request(name: str) -> None:
    """The program reaches the state INV-15 once refused: inside the last step, after the
    allocation, a request admitted in that step holds a block a live, unflushed store of
    the preempted request still reads; every invariant holds there, and the step's
    build_connector_meta flushes the store."""
    reg = by_name(name)
    Recording.seen = []
    replay(reg.events(), reg.bounds, RecordingMachine)
    inside = [(hook, s) for hook, s in Recording.seen if s.step_open
              and _store_block_with_another(s)]
    assert inside, "the program no longer reaches a reused store block inside a step"
    hook, state = inside[0]
    assert hook == "update_state_after_alloc"
    assert check(state) == []
    [(job, _block, _holder)] = _store_block_with_another(state)[:1]
    after = next(s for h, s in Recording.seen if h == "build_connector_meta"
                 and Recording.seen.index((h, s)) > Recording.seen.index((hook, state)))
    flushed = after.job(job)
    assert flushed is not None and flushed.flush_requested


def test_the_old_inv15_statement_fails_on_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stated for every hook (the statement before the fix), INV-15 is broken there: the
    reference scheduler raises at the allocation, as the campaign saw."""
    import spec.invariants as inv

    monkeypatch.setattr(inv, "_inv15", _old_inv15)
    monkeypatch.setattr(inv, "SAFETY", tuple(
        i if i.id != "INV-15" else type(i)(i.id, i.name, i.statement, i.vllm_ref, _old_inv15)
        for i in inv.SAFETY))
    reg = by_name("store-block-reused-inside-the-step")
    with pytest.raises(InvariantViolation, match=r"(?s)update_state_after_alloc\('r1'.*"
                       r"INV-15: store source block 2 left its owner"):
        replay(reg.events(), reg.bounds)


def _old_inv15(s: AbstractState) -> Any:
    from spec.invariants import Violation

    owner_of = {b: r.id for r in s.requests for b in r.gpu_blocks}
    fence = dict(s.block_fence)
    for j in s.jobs:
        if j.kind != "store" or j.flush_requested or j.failed:
            continue
        for b in sorted(j.blocks):
            if owner_of.get(b) != j.owner and j.id not in fence.get(b, frozenset()):
                yield Violation("INV-15", f"store source block {b} left its owner without a "
                                "fence entry or a flush", j.owner, (j.id,))


def test_the_checker_finds_the_old_statement_inside_a_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker evaluates the invariants after each hook inside a step too, where the
    implementation does: with INV-15 stated for every hook, it finds the shortest program
    of `spec.regressions` at the bounds it was found with (those of the scenario with
    preemption and fences then)."""
    import spec.invariants as inv
    from spec.checker import check_model

    monkeypatch.setattr(inv, "SAFETY", tuple(
        i if i.id != "INV-15" else type(i)(i.id, i.name, i.statement, i.vllm_ref, _old_inv15)
        for i in inv.SAFETY))
    reg = by_name("store-block-reused-inside-the-step-shortest")
    r = check_model(reg.bounds)
    ce = r.counterexample
    assert ce is not None and ce.inside is not None
    assert " ; ".join(str(s.event) for s in ce.steps) == reg.program
    assert ce.inside[0].startswith("update_state_after_alloc('r1'")
    assert "inside the step, after update_state_after_alloc" in ce.render()


def _last_lookup(reg: Any) -> tuple[M.World, M.Call]:
    """The model's world and lookup call at the program's last event (a step admitting)."""
    *head, last = reg.events()
    s = M.initial(reg.bounds)
    for ev in head:
        s, _calls, _w = M.apply(s, ev)
    _s, calls, _w = M.apply(s, last)
    return M.World.thaw(s), next(c for c in calls if c.hook == "get_num_new_matched_tokens")


def test_a_hit_stops_at_the_last_hash_block_before_the_last_token() -> None:
    """`hit-bound-at-the-hash-block`: r1's prompt fills two blocks of 2 tokens and both
    groups hold its first chunk ready, yet the lookup answers 0: the bound is the hash block
    before the last token (tokens 0-1), and beside a window group vLLM stops the hit one
    token before that, inside the first chunk. A bound at the last token would give 2."""
    reg = by_name("hit-bound-at-the-hash-block")
    w, call = _last_lookup(reg)
    b = reg.bounds
    assert w.num_tokens("r1") == 2 * b.tokens_per_block == 2 * b.tokens_per_chunk
    first_chunk = [w.keys_of("r1", g)[0] for g in range(len(b.groups))]
    assert all(w.chunks.get(k) == 0 for k in first_chunk)  # ready, no reader
    assert call.answer == (0, False)
    replay(reg.events(), b)  # and the reference answers the same


def test_a_decoding_request_with_partial_tails_keeps_a_hash_per_token() -> None:
    """`partial-tail-output-hashes`: the program samples output tokens of a request whose
    hashes are one per token (partial tails); the reference's request then holds one hash
    per model token of prompt and output, and its last step stores without reading past
    them."""
    reg = by_name("partial-tail-output-hashes")
    m = OffloadingStateMachine()
    m.begin(reg.bounds)
    for ev in reg.events():
        m._step(ev)
    req = m.impl.requests["r1"]
    assert req.output_token_ids  # it decoded
    assert len(req.block_hashes) == req.num_tokens // BLOCK


def test_a_loaded_state_is_stored_again_after_a_reset() -> None:
    """CONFORMANCE.md D4 in the model: resuming r1 after its async load, the core hands off
    the state the load ended on (boundary 1) before the step's own (boundary 2). Without
    the reset the CPU cache holds both states and the prefix's chunk, so no store comes of
    them; after it, all three are stored again, the loaded state's store first."""
    reg = by_name("loaded-state-stored-again-after-a-reset")
    events = reg.events()
    for with_reset in (False, True):
        program = [ev for ev in events if with_reset or ev.kind != "reset"]
        s = M.initial(reg.bounds)
        for ev in program:
            s, calls, _ = M.apply(s, ev)
        meta = next(c for c in calls if c.hook == "build_connector_meta")
        given = meta.args[6]
        (r1,) = [r for r in s.reqs if r.id == "r1"]
        mamba_blocks = dict(given)["r1"]
        assert [(g, boundary) for g, _block, boundary in mamba_blocks] == [(1, 1), (1, 2)]
        stores = sorted((j for j in s.jobs if j.owner == "r1" and j.kind == "store"),
                        key=lambda j: j.id)
        if not with_reset:
            assert r1.state == "RUNNING" and stores == []
        else:
            assert r1.state == "STORING"
            assert [j.blocks for j in stores][:2] == [(mamba_blocks[0][1],),
                                                    (mamba_blocks[1][1],)]
            assert len(stores) == 3


def test_a_promoted_request_waits_with_the_store_of_its_loaded_state() -> None:
    """The same after a promote(r1) step: the core caches r1's loaded blocks and hands off
    their state without scheduling r1, so r1 waits with that store (WAITING_STORING); its
    end leaves r1 IDLE, and r1's admission then hands off only the step's own state."""
    reg = by_name("loaded-state-stored-while-waiting")
    s = M.initial(reg.bounds)
    seen: list[tuple[str, str]] = []
    for ev in reg.events():
        s, calls, _ = M.apply(s, ev)
        (r1,) = [r.state for r in s.reqs if r.id == "r1"] or ["-"]
        seen.append((str(ev), r1))
    assert seen[-3:] == [("promote(r1)", "WAITING_STORING"), ("ack(job 7, count 1)", "IDLE"),
                         ("step(admit=r1)", "STORING")]
    meta = next(c for c in calls if c.hook == "build_connector_meta")
    assert [boundary for _g, _b, boundary in dict(meta.args[6])["r1"]] == [2]


def test_a_loaded_request_aborted_before_its_schedule_stores_nothing() -> None:
    """D3 in the model: r1's async load ended and a reset put its store cursor back to 0;
    aborted before the core ever scheduled it, r1 has no block table (the schedule records
    it, as in vLLM), so its final step creates no job, while the blocks it held as it
    loaded were the core's allocation."""
    reg = by_name("loaded-request-aborted-before-its-schedule")
    s = M.initial(reg.bounds)
    held: tuple[int, ...] = ()
    for ev in reg.events():
        s, _calls, _ = M.apply(s, ev)
        r1 = next((r for r in abstract(s).requests if r.id == "r1"), None)
        if r1 is not None and r1.state == "LOADING_ASYNC":
            held = r1.gpu_blocks
            assert next(q for q in s.reqs if q.id == "r1").blocks == ()
            assert held == dict(s.core)["r1"].blocks
    assert held, "r1 never loaded"
    assert s.counter == 4 and not s.jobs
    assert [r.id for r in s.reqs] == ["r0"]  # r1 dropped; r0 still runs


def test_an_abort_while_waiting_with_a_store_drains_it_and_stores_nothing_else() -> None:
    reg = by_name("aborted-while-waiting-with-a-store")
    s = M.initial(reg.bounds)
    seen: list[str] = []
    for ev in reg.events():
        s, _calls, _ = M.apply(s, ev)
        seen.append(next((r.state for r in s.reqs if r.id == "r1"), "-"))
    assert seen[-5:] == ["WAITING_STORING", "FINISHED_PENDING_FINAL", "FINISHED_DRAINING",
                         "-", "-"]
    assert s.counter == 8  # the hand-off's store (job 7) only


def test_a_request_preempted_then_aborted_has_its_store_flushed() -> None:
    """D2 in the model and the reference: the step after preempt(r0) ; abort(r0) flushes
    r0's store (vLLM's flush reads only the status entry); r0 drains it and is dropped."""
    reg = by_name("preempted-then-aborted-before-the-next-step")
    s = M.initial(reg.bounds)
    events = reg.events()
    for ev in events[:-1]:
        s, _calls, _ = M.apply(s, ev)
    assert [(j.id, j.state) for j in s.jobs] == [(0, "FLUSH_REQUESTED")]
    assert [(r.id, r.state) for r in s.reqs] == [("r0", "FINISHED_DRAINING")]
    m = OffloadingStateMachine()
    m.begin(reg.bounds)
    for ev in events[:-1]:
        m._step(ev)
        m.invariants_hold()
    (job,) = m.impl.scheduler.jobs
    assert job.state == "FLUSH_REQUESTED" and job.flush_requested


def test_a_late_recving_of_a_timed_out_load_is_taken_out_of_the_set() -> None:
    """The reference's side of `spec.request.recving_is_stale`: the timed-out load's late
    completion names r0 while its newer load (orphaned by the reset) is due; the scheduler
    takes r0 out of finished_recving, so that the core does not promote it, counts it, and
    keeps r0 in ORPHANED_LOAD. The newer load's own last report then names r0 for real."""
    from statemachine.messages import KVConnectorOutput, OffloadingWorkerMetadata
    from statemachine.testing import OffloadingStateMachine

    [reg] = [r for r in REGRESSIONS if r.name == "late-recving-of-a-timed-out-load"]
    events = reg.events()
    late = next(i for i, ev in enumerate(events) if str(ev) == "ack(job 1, count 1)")
    m = OffloadingStateMachine()
    m.begin(reg.bounds)
    for ev in events[:late]:
        m._step(ev)
    sched = m.impl.scheduler
    assert sched.request_state("r0") == "ORPHANED_LOAD"
    stale = KVConnectorOutput(OffloadingWorkerMetadata({1: 1}, {}), {"r0"})
    sched.update_connector_output(stale)
    assert stale.finished_recving == set()
    assert sched.get_stats()["stale_recving_ignored"] == 1
    assert sched.request_state("r0") == "ORPHANED_LOAD"
    own = KVConnectorOutput(OffloadingWorkerMetadata({}, {2: 1}), {"r0"})
    sched.update_connector_output(own)
    assert own.finished_recving == {"r0"}
    assert sched.get_stats()["stale_recving_ignored"] == 1
    assert sched.request_state("r0") == "RECOMPUTE"


TIER_KILLS = {
    "waiting-store-records-the-table-at-the-schedule":
        ("request: schedule(WAITING_STORING)->STORING drop record_block_ids",
         ["f0 t0 full writing", "f0 t1 full writing"], []),
    "recompute-after-a-failed-load-stores-again":
        ("request: lookup_resolved(RECOMPUTE,TIMED_OUT)->= drop bypass_offload_lookup",
         ["f0 t1 full writing"], []),
    "timed-out-load-restarts-its-stores-from-token-0":
        ("request: lookup_resolved(RECOMPUTE,TIMED_OUT)->= drop restart_from_token_zero",
         ["f0 t0 full writing"], ["f0 t1 full"]),
    "reset-frees-the-slot-of-a-timed-out-store":
        ("job: reset(SHIPPED,PARTIALLY_ACKED,FLUSH_REQUESTED,TIMED_OUT)->STALE "
         "drop enter_reset_fence",
         ["f0 t0 full writing", "f0 t1 full writing", "f0 t2 full writing"], []),
}
"""Program -> the mutant (once a `cache-only` survivor) whose tier it tells from the spec's,
the chunks the mutant's tier lacks at its end, and those it holds beside them."""


@pytest.mark.parametrize("name", sorted(TIER_KILLS))
def test_a_program_pins_the_tier_a_cache_only_mutant_changes(name: str) -> None:
    """The mutant breaks no invariant along the program (it changes only what the tier
    holds); the program's pin of the tier kills it, naming the chunks that differ."""
    reg = by_name(name)
    mutant_name, missing, extra = TIER_KILLS[name]
    mutant = _named(mutant_name)
    assert M.parse_events(reg.program) and reg.check() is None
    assert check_program(reg.bounds, reg.events(), tables=mutant.tables()) is None, \
        "an invariant breaks along it: not a kill by the tier"
    broken = reg.check(mutant.tables())
    assert broken is not None and broken.verdict == "tier"
    held = [c for c in reg.tier if c not in missing] + extra
    assert broken.summary == tier_difference(tuple(sorted(held)), reg.tier)
    for chunk in missing + extra:
        assert chunk in broken.summary


def test_a_program_whose_tier_differs_from_its_pin_fails_naming_the_chunks() -> None:
    reg = by_name("preempted-then-aborted-before-the-next-step")
    assert reg.tier == ("f0 t0 full",)
    broken = replace(reg, tier=("f0 t0 full", "f0 t1 full")).check()
    assert broken is not None and broken.kind == "tier" and broken.steps
    assert broken.summary == "the CPU tier ends without f0 t1 full (it holds: f0 t0 full)"
    broken = replace(reg, tier=()).check()
    assert broken is not None
    assert broken.summary == "the CPU tier ends with f0 t0 full (it holds: f0 t0 full)"


def test_a_chunk_label_names_the_family_the_token_and_the_group() -> None:
    groups = ("full", "mamba")
    assert M.chunk_label(M.key(0, 1, 1, 2), groups) == "f0 t1 mamba"
    assert M.chunk_label(M.key(3, 17, 0, 2), groups) == "f3 t17 full"
    assert M.chunk_label(M.key(M.OUTPUT_FAMILY, 4), ("full",)) == f"f{M.OUTPUT_FAMILY} t4 full"
