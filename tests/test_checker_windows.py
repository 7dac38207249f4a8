"""The model checker on the sliding-window paths: the faults only a window group has are
found (the fence of a window source, vLLM's stale window ids after a reset: F2, vLLM's store
mask: F4). The window scenarios run on the compiled twin with the others
(`test_checker.py`), and on the Python model in `make check-groups`
(`test_deep_groups.py`).

A file of its own beside `test_checker_groups.py`, so that `make test` (one file per worker)
runs the two halves of the Python model's searches side by side."""

from __future__ import annotations

import pytest

from spec import groups
from spec import model as M
from spec.checker import check_program, replay
from spec.groups import cdiv
from spec.rules import LastTokenCut
from spec.scenarios import by_name, hunt_bounds
from statemachine.checker import check
from statemachine.testing import replay as replay_on_reference

pytestmark = pytest.mark.exhaustive


@pytest.mark.parametrize("fault", [M.Fault.SLIDING_WINDOW_SKIPS_FENCE,
                                   M.Fault.RESET_KEEPS_STALE_WINDOW_BLOCKS],
                         ids=lambda f: f.value)
def test_the_checker_finds_each_fault_of_the_sliding_window_paths(fault: M.Fault) -> None:
    """The faults only a sliding-window group has: found under their hunting bounds (the
    hybrid scenarios') with a short counterexample through the window's blocks."""
    r = check(hunt_bounds(fault), frozenset({fault}))
    assert r.counterexample is not None, r
    text = r.counterexample.render()
    if fault == M.Fault.SLIDING_WINDOW_SKIPS_FENCE:  # the job's window source, unfenced
        assert r.verdict == "invariant INV-7" and len(r.counterexample.steps) <= 3, text
    else:  # F2: the final store after a reset reads a block the other request holds
        assert r.verdict == "invariant INV-15" and len(r.counterexample.steps) <= 8, text
        assert "reset()" in text and "re-allocated to 'r1'" in text, text


def test_vllms_store_mask_is_found_by_inv23_alone() -> None:
    """vLLM's reachable-block mask (finding F4) stores a window chunk without its leading
    block, which a hit one token short of a block edge reads: INV-23 finds the load of
    that unwritten block at its creation; with INV-23 off, nothing else does under the
    same bounds (the tables see nothing wrong: the spec's mask is the fix)."""
    fault = M.Fault.STORE_MASK_IGNORES_SHORT_HITS
    bounds = hunt_bounds(fault)
    r = check(bounds, frozenset({fault}))
    assert r.counterexample is not None and r.verdict == "invariant INV-23", r
    text = r.counterexample.render()
    assert "reset()" in text and "update_state_after_alloc('r1'" in text, text
    assert len(r.counterexample.steps) <= 11, text
    blind = check(bounds, frozenset({fault}), without=frozenset({"INV-23"}))
    assert blind.counterexample is None and blind.states > r.states


def test_a_mask_for_hits_one_token_short_misses_the_prompt_that_ends_on_the_edge(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose prompt ends on a chunk's edge has its hit bounded a block before the
    edge (LAST-TOKEN-BOUND) and, under 0.33.0's cut, a token short of that again: its
    window reads one block further back than a hit one token short of the edge. A mask
    that counts only the latter (`cdiv(window, block)`, the spec's count until this
    scenario) stores the chunk after a reset without that block, and the second prompt's
    load reads it: INV-23 on the Python model. The spec's count (`hit_tail_blocks`) passes
    (`window-aligned-prompt`, pinned on both engines)."""
    b = by_name("window-aligned-prompt").bounds
    assert groups.hit_tail_blocks(b.sliding_window, b.tokens_per_block,
                                  LastTokenCut.AFTER_CAPS) == 3
    assert groups.hit_tail_blocks(b.sliding_window, b.tokens_per_block,
                                  LastTokenCut.BEFORE_CAPS) == 2
    monkeypatch.setattr(groups, "hit_tail_blocks",
                        lambda window, block, _cut: cdiv(window, block))
    r = check(b, engine="python")
    assert r.counterexample is not None and r.verdict == "invariant INV-23", r
    text = r.counterexample.render()
    assert "reset()" in text and "update_state_after_alloc('r1'" in text, text
    assert len(r.counterexample.steps) == 12, text


WINDOW_ONLY_TAIL_LOAD = (
    "arrive(r0) ; arrive(r1) ; step(admit=r0) ; step() ; reset() ; step() ; step() ; "
    "ack(job 2, count 1) ; step(admit=r1)")
"""`window-only`: r0 stores its first two chunks (jobs 0 and 1), a reset empties the CPU
cache, r0's next step stores what its window still holds (job 2), job 2 completes, and r1
(the same prompt) is admitted."""


def test_a_window_alone_loads_its_tail_without_the_chunks_before_it() -> None:
    """With a sliding window on every layer, no prefix scan bounds a hit: after the reset
    the core has freed the block of r0's first chunk, so the store that follows writes
    chunks 1 and 2 without chunk 0, and r1's lookup still hits three tokens, on those two
    chunks alone. The load reads them into table positions 1 and 2; position 0 is null
    (the window never reads it). On the way, r0's last prompt step completes chunk 3, which
    no tail needs at retention 0: it stores nothing and moves the store cursor past it.
    Every invariant holds after every hook on the model, and the reference takes the same
    path (it did not while its adapter left the retention interval out: under dense
    retention it offered chunk 3, the full CPU cache refused it, and its cursor stayed)."""
    b = by_name("window-only").bounds
    events = M.parse_events(WINDOW_ONLY_TAIL_LOAD)
    assert check_program(b, events) is None
    path = [step.state for step in replay(b, events, canonical_ids=False)]
    before, after = path[5], path[6]  # around r0's last prompt step
    assert [[r.cursor for r in t.reqs if r.id == "r0"] for t in (before, after)] == [[3], [4]]
    assert after.jobs == before.jobs and len(after.jobs) == 1
    w = M.World.thaw(path[-2])
    first, *window = w.keys_of("r1")[:3]
    assert w.keys_of("r0")[:3] == [first, *window]  # the prompts share every chunk
    assert first not in w.chunks and all(w.chunks.get(k) == 0 for k in window)
    s, calls, _w = M.apply(path[-2], events[-1])
    lookup = next(c for c in calls if c.hook == "get_num_new_matched_tokens")
    assert lookup.answer == (3, True)
    load = next(j for j in s.jobs if j.kind == "load")
    core = dict(s.core)["r1"]
    assert load.owner == "r1" and load.keys == tuple(window)
    assert core.blocks[0] == groups.NULL_BLOCK and load.blocks == core.blocks[1:3]
    replay_on_reference(events, b)
