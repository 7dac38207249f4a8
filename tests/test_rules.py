"""The rules on which vLLM releases differ (`spec.rules`): each rule's two values give the
answers their release gives, in the model and in the reference implementation, and the
rules are named, parsed and refused where they are not (CONFORMANCE.md D5, D6)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spec import model as M
from spec.checker import check_model
from spec.model.state import World
from spec.regressions import by_name
from spec.rules import (
    VLLM_0_33,
    VLLM_0_34,
    FailedLoadLookup,
    LastTokenCut,
    PartialTailSearch,
    Rules,
    StaleLoadFailure,
    StoreAdmission,
    by_release,
)
from spec.scenarios import by_name as by_scenario
from spec.scenarios import parse_bounds
from statemachine.checker import compiled
from statemachine.errors import ConfigError
from statemachine.manager import CPUOffloadingManager, ReqContext
from tests.test_model_settings import _serve as serve

S = M.RequestSettings


def test_rules_name_their_release_and_refuse_what_is_not_a_rule() -> None:
    assert Rules() == VLLM_0_33 and str(VLLM_0_33) == "0.33"
    assert VLLM_0_34.changed() == ("store_admission=per-request", "last_token_cut=before-caps",
                                   "failed_load_lookup=for-life",
                                   "partial_tail_search=from-full-attention-prefix",
                                   "stale_load_failure=fence-only")
    assert by_release("0.34.0") is VLLM_0_34 and by_release("0.33") is VLLM_0_33
    with pytest.raises(ValueError, match=r"no rules for release '0\.35'"):
        by_release("0.35")
    with pytest.raises(ValueError, match="store_admission must be a StoreAdmission"):
        Rules(store_admission="per-request")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rules must be a spec\.rules\.Rules"):
        M.Bounds(rules="0.34")  # type: ignore[arg-type]
    assert parse_bounds("store_threshold=2,rules=0.34", M.Bounds()).rules is VLLM_0_34
    one = replace(VLLM_0_34, stale_load_failure=StaleLoadFailure.INVALIDATES_REQUEST)
    assert parse_bounds("rules=0.34,stale_load_failure=invalidates-request",
                        M.Bounds()).rules == one
    assert parse_bounds("stale_load_failure=invalidates-request,rules=0.34",
                        M.Bounds()).rules == one  # whatever the order
    assert parse_bounds("failed_load_lookup=for-life", M.Bounds()).rules == Rules(
        failed_load_lookup=FailedLoadLookup.FOR_LIFE)
    with pytest.raises(ValueError, match="rule stale_load_failure: 'maybe' is not one of"):
        parse_bounds("stale_load_failure=maybe", M.Bounds())
    assert Rules.of({"store_admission": "per-request", "last_token_cut": "before-caps",
                     "failed_load_lookup": "for-life",
                     "partial_tail_search": "from-full-attention-prefix",
                     "stale_load_failure": "fence-only"}) == VLLM_0_34
    with pytest.raises(ValueError, match="no rule 'eviction'"):
        Rules.of({"eviction": "lru"})
    with pytest.raises(ValueError, match="rule store_admission: 'once' is not one of"):
        Rules.of({"store_admission": "once"})
    with pytest.raises(ValueError, match=r"bad bound 'rules=0\.2'"):
        parse_bounds("rules=0.2", M.Bounds())
    with pytest.raises(ConfigError, match="store_admission must be"):
        CPUOffloadingManager(4, store_threshold=2, store_admission="per-request")  # type: ignore[arg-type]


def _space(b: M.Bounds) -> tuple[int, int]:
    r = check_model(b, liveness=False)
    assert r.ok and r.complete, r.describe()
    return r.states, r.edges


MOOT = {
    "store_admission": (M.Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4,
                                resets=0, failures=0, preemptions=1),),
    "last_token_cut": (M.Bounds(requests=2, tokens=5, workers=1, cpu_chunks=3, gpu_blocks=6,
                               resets=0, failures=0, preemptions=0, tokens_per_block=2,
                               request_settings=(S(), S(max_load_tokens=2))),),
    "partial_tail_search": (M.Bounds(requests=1, tokens=4, workers=1, cpu_chunks=4,
                                    gpu_blocks=4, resets=0, failures=1, preemptions=1,
                                    groups=("full", "mamba"), tokens_per_block=2),),
    "stale_load_failure": (
        M.Bounds(requests=2, tokens=2, workers=2, cpu_chunks=2, gpu_blocks=3, resets=0,
                 failures=1, preemptions=0),
        M.Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=3, resets=1,
                 failures=1, preemptions=0, sync_loads=True)),
}
"""Bounds where a rule is moot, each near the rule's own ground: a preempted request's
offers under a threshold of 1, a load cap inside a block without a window group, a failed
Mamba store without partial tails, `orphaned-load-fails-0.34` less its reset, or with its
reset but every load sync (a sync load a reset made stale, which a worker fails, is the
request's KV invalidated, not a load it waits for)."""


@pytest.mark.parametrize(("rule", "i"), [(r, i) for r in sorted(MOOT)
                                         for i in range(len(MOOT[r]))])
def test_a_rule_not_in_play_changes_nothing(rule: str, i: int) -> None:
    """`Bounds.rules_in_play` leaves a rule out only where its value is moot: the state
    space under 0.34.0's value of it has as many states and edges as under 0.33.0's."""
    b = MOOT[rule][i]
    assert rule not in b.rules_in_play() and "failed_load_lookup" in b.rules_in_play()
    flipped = replace(b, rules=replace(VLLM_0_33, **{rule: getattr(VLLM_0_34, rule)}))
    assert _space(flipped) == _space(b)


@pytest.mark.parametrize(("scenario", "rule"), [
    ("failed-load-not-retried", "failed_load_lookup"),
    ("store-admission-per-request", "store_admission"),
    ("orphaned-load-fails-0.34", "stale_load_failure"),
    ("hybrid-load-cap-0.34", "last_token_cut"),
    ("partial-tails-0.34", "partial_tail_search")])
def test_the_compiled_twin_states_both_values_of_its_rules(scenario: str, rule: str) -> None:
    """The compiled model takes 0.34.0's rules where only the rules it states are in play,
    and each value of a rule gives its own state space (each equal to the Python model's:
    test_checker_compiled); a rule not in play there is taken whatever its value."""
    pinned = by_scenario(scenario)
    b = pinned.bounds
    assert b.rules is VLLM_0_34 and rule in b.rules_in_play()
    assert set(b.rules_in_play()) <= set(compiled.RULES) and compiled.fits(b) is None
    later = compiled.search(b)
    earlier = compiled.search(replace(b, rules=replace(VLLM_0_34, **{
        rule: getattr(VLLM_0_33, rule)})))
    assert later.verdict == earlier.verdict == "ok"
    assert (later.states, later.depth) == (pinned.expect.states, pinned.expect.depth)
    assert (later.states, later.edges) != (earlier.states, earlier.edges)


def test_the_compiled_twin_refuses_a_rule_it_does_not_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = by_scenario("store-admission-per-request").bounds
    monkeypatch.setattr(compiled, "RULES", ("failed_load_lookup",))
    assert "rules of a later release (store_admission;" in (compiled.fits(b) or "")
    assert compiled.fits(replace(b, rules=replace(VLLM_0_34, **{
        "store_admission": StoreAdmission.PER_OFFER}))) is None
    assert compiled.fits(replace(b, store_threshold=1)) is None  # not in play


def _events(s: M.ModelState, *events: M.Event) -> M.ModelState:
    for ev in events:
        s = M.apply(s, ev)[0]
    return s


@pytest.mark.parametrize("admission", list(StoreAdmission))
def test_a_request_s_own_re_offer_counts_only_per_offer(admission: StoreAdmission) -> None:
    """D6: under a store threshold of 2, r0 offers its chunk, is preempted and offers it
    again. Per offer (0.33) the second offer admits it and a store starts; per request
    (0.34) it does not count. After a reset (a new cache generation) r0's offer counts
    again, in both."""
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                 failures=0, preemptions=2, store_threshold=2,
                 rules=Rules(store_admission=admission))
    s = _events(M.initial(b), M.Event("arrive", "r0"), M.Event("step", "r0"))
    key = M.key(0, 0)
    assert dict(s.offers) == {key: 1} and not s.jobs
    s = _events(s, M.Event("preempt", "r0"), M.Event("step"), M.Event("step", "r0"))
    stores = [j for j in s.jobs if j.kind == "store"]
    if admission is StoreAdmission.PER_OFFER:
        assert dict(s.offers) == {key: 2} and [j.keys for j in stores] == [(key,)]
        return
    assert dict(s.offers) == {key: 1} and stores == []
    assert dict((r.id, r.counted) for r in s.reqs) == {"r0": frozenset({key})}
    s = _events(s, M.Event("reset"))
    assert all(not r.counted for r in s.reqs)
    s = _events(s, M.Event("preempt", "r0"), M.Event("step"), M.Event("step", "r0"))
    assert dict(s.offers) == {key: 2}
    assert [j.keys for j in s.jobs if j.kind == "store"] == [(key,)]


@pytest.mark.parametrize("admission", list(StoreAdmission))
def test_the_reference_manager_counts_as_its_rule_says(admission: StoreAdmission) -> None:
    """The same in the reference manager: r0 offers twice, then r1 once; per offer the
    second offer admits, per request only r1's; a reset starts a new record for r0."""
    m = CPUOffloadingManager(4, store_threshold=2, store_admission=admission)
    r0, r1 = ReqContext("r0", 0), ReqContext("r1", 0)
    first = m.prepare_store(["a"], r0)
    assert first is not None and first.keys_to_store == ()
    again = m.prepare_store(["a"], r0)
    assert again is not None
    if admission is StoreAdmission.PER_OFFER:
        assert again.keys_to_store == ("a",) and m.stats["stores_skipped"] == 1
        return
    assert again.keys_to_store == () and m.offers == {"a": 1}
    assert m.stats["stores_skipped"] == 1  # held back at r0's first offer only
    other = m.prepare_store(["a"], r1)
    assert other is not None and other.keys_to_store == ("a",)
    m.reset_cache()
    assert m.offers == {"a": 2}  # a reset keeps the counts
    m2 = CPUOffloadingManager(4, store_threshold=3, store_admission=admission)
    m2.prepare_store(["b"], r0)
    m2.reset_cache()
    m2.prepare_store(["b"], r0)  # a new generation: r0's offer counts again
    assert m2.offers == {"b": 2}


def _hybrid_hit(rules: Rules, cap: int) -> int:
    """r1's first lookup answer, in model tokens, after r0 stored the shared 5-token prompt
    (a full-attention and a sliding-window group, 2-block chunks; r1's loads capped)."""
    b = M.Bounds(requests=2, tokens=5, workers=1, cpu_chunks=6, gpu_blocks=14, resets=0,
                 failures=0, preemptions=0, groups=("full", "sliding"), sliding_window=2,
                 blocks_per_chunk=2, request_settings=(S(), S(max_load_tokens=cap)),
                 rules=rules)
    s, _ = serve(M.initial(b), "r0")
    assert len(s.chunks) == 4 and not s.jobs
    _, calls = serve(s, "r1")
    answers = [c.answer[0] for c in calls
               if c.hook == "get_num_new_matched_tokens" and c.args[0] == "r1"]
    assert isinstance(answers[0], int)
    return answers[0]


def test_a_window_group_s_hit_under_a_load_cap_follows_the_release_s_cut() -> None:
    """D5: beside a sliding window, 2-block chunks, a 5-token prompt (the hit's own bound,
    the hash block before the last token, is 4). 0.33 takes the recomputed token off after
    the caps, so a capped hit ends a token short of its cap and rounds down to the chunk
    before: a cap of 2 (a chunk edge) gives none, a cap of 4 one chunk. 0.34 takes it off
    the prompt first, which the bound already leaves out: the hit reaches the cap."""
    after = Rules(last_token_cut=LastTokenCut.AFTER_CAPS)
    before = Rules(last_token_cut=LastTokenCut.BEFORE_CAPS)
    assert (_hybrid_hit(after, 2), _hybrid_hit(before, 2)) == (0, 2)
    assert (_hybrid_hit(after, 4), _hybrid_hit(before, 4)) == (2, 4)


@pytest.mark.parametrize("rule", list(FailedLoadLookup))
def test_a_request_whose_load_failed_loads_again_only_once(rule: FailedLoadLookup) -> None:
    """FailedLoadLookup: after the program `failed-store-and-async-load`, r1 (whose async
    load failed, then recomputed and stored its chunks) is preempted and admitted again.
    ONCE (the spec's rule before 0.34.0) asks the manager, which holds the two chunks; FOR_LIFE
    (0.34.0) answers 0 without it. The reference implementation answers the same."""
    from statemachine.testing import replay

    reg = by_name("failed-store-and-async-load")
    bounds = replace(reg.bounds, rules=Rules(failed_load_lookup=rule))
    events = reg.events() + M.parse_events(
        "preempt(r1) ; step() ; ack(job 4, count 2) ; step(admit=r1)")
    s = M.initial(bounds)
    for ev in events[:-1]:
        s = M.apply(s, ev)[0]
    assert dict((r.id, r.load_failed) for r in s.reqs)["r1"] is (rule is FailedLoadLookup.FOR_LIFE)
    _, calls, _ = M.apply(s, events[-1])
    answers = [c.answer for c in calls
               if c.hook == "get_num_new_matched_tokens" and c.args[0] == "r1"]
    assert answers == [(2, True) if rule is FailedLoadLookup.ONCE else (0, False)]
    path = replay(events, bounds)  # the reference: refinement, every invariant, the drain
    assert len(path) == len(events)


@pytest.mark.parametrize("search", list(PartialTailSearch))
def test_a_tail_past_a_missing_mamba_state_is_found_from_the_full_attention_prefix(
        search: PartialTailSearch) -> None:
    """D7: r0's Mamba state at its first chunk edge fails to store (job 0); its
    full-attention chunk 0 (job 1) and its partial tail at 3 tokens (job 3: the tail block
    and the Mamba state) are stored. r2, the same prompt: the complete-chunk hit is 0 (no
    state at the chunk edge), the full-attention prefix is one chunk. Searched from the
    complete hit (0.33) only boundary 1 is tried and r2 misses; from the full-attention
    prefix (0.34) boundary 3 hits, and the load brings chunk 0 and the tail's keys. The
    reference implementation answers and loads the same."""
    from statemachine.testing import replay

    bounds = M.Bounds(requests=3, tokens=4, cpu_chunks=6, gpu_blocks=14, failures=2,
                      preemptions=2, families=2, groups=("full", "mamba"), tokens_per_block=2,
                      partial_tails=True, decode_tokens=3,
                      rules=Rules(partial_tail_search=search))
    events = M.parse_events(
        "arrive(r0) ; arrive(r2) ; step(admit=r0) ; step() ; ack(job 0, count 1) ; "
        "ack(job 1, count 1) ; step() ; ack(job 1, count 1) ; fail(job 0, count 1) ; step() ; "
        "ack(job 3, count 1) ; ack(job 3, count 1) ; step(admit=r2)")
    s = M.initial(bounds)
    for ev in events[:-1]:
        s = M.apply(s, ev)[0]
    s, calls, _ = M.apply(s, events[-1])
    answers = [c.answer for c in calls
               if c.hook == "get_num_new_matched_tokens" and c.args[0] == "r2"]
    loads = [j for j in s.jobs if j.kind == "load" and j.owner == "r2"]
    if search is PartialTailSearch.FROM_COMPLETE_HIT:
        assert answers == [(0, False)] and loads == []
    else:
        assert answers == [(3, True)]
        w = World.thaw(s)  # chunk 0 of the full-attention group, then each group's tail
        want = {w.keys_of("r2", 0)[0], w.tail_key("r2", 3, 0), w.tail_key("r2", 3, 1)}
        assert [set(j.keys) for j in loads] == [want]
    assert len(replay(events, bounds)) == len(events)


@pytest.mark.parametrize("rule", list(StaleLoadFailure))
@pytest.mark.parametrize("program", ["orphaned-load-fails-then-hits",
                                     "failing-load-orphaned-then-hits"])
def test_a_stale_load_s_failure_marks_the_request_or_only_the_fence(
        program: str, rule: StaleLoadFailure) -> None:
    """StaleLoadFailure, on the programs where a worker fails r1's async load after the
    reset that orphans it, or before (FAILING at the reset): INVALIDATES_REQUEST (the
    spec's own rule) sends r1 to RECOMPUTE at its load's last report and answers its next
    lookup 0 without the manager; FENCE_ONLY (0.34.0) leaves r1 IDLE, the core recomputes
    it on the worker's failed_recving, and its next lookup hits the chunk r0 stored again.
    Either way the core never promotes the failed load. The reference implementation
    answers the same."""
    from statemachine.testing import replay

    reg = by_name(program)
    bounds = replace(reg.bounds, rules=Rules(stale_load_failure=rule))
    events = reg.events()
    s = M.initial(bounds)
    for ev in events[:8]:
        s = M.apply(s, ev)[0]
    r1 = {r.id: r for r in s.reqs}["r1"]
    core = dict(s.core)["r1"]
    fence_only = rule is StaleLoadFailure.FENCE_ONLY
    assert (r1.state, r1.load_invalid) == (("IDLE", False) if fence_only else ("RECOMPUTE", True))
    assert (core.status, core.computed, core.blocks) == ("waiting", 0, ())  # not promoted
    for ev in events[8:-1]:
        s = M.apply(s, ev)[0]
    _, calls, _ = M.apply(s, events[-1])
    answers = [c.answer for c in calls
               if c.hook == "get_num_new_matched_tokens" and c.args[0] == "r1"]
    assert answers == [(1, True) if fence_only else (0, False)]
    path = replay(events, bounds)  # the reference: refinement, every invariant, the drain
    assert len(path) == len(events)


def test_under_0_34_the_core_s_failed_recving_is_what_keeps_invalid_kv_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the core's reaction to failed_recving, 0.34.0's rule would promote a stale
    load a worker failed: the checker finds the request storing that KV (INV-20)."""
    from spec.model import environment

    b = by_scenario("orphaned-load-fails-0.34").bounds
    monkeypatch.setattr(environment, "_name_in_failed_recving", lambda *a, **k: None)
    r = check_model(b, liveness=False)
    assert not r.ok and r.counterexample is not None
    assert r.counterexample.summary.startswith("INV-20")
