"""Decoding in the abstract model (`Bounds.decode_tokens`): after its prompt a running request
is scheduled one token a step and samples the next, its output tokens have keys of their
own, it stores them as it runs and at its finish up to `max(prompt, num_tokens - 1)`
(vLLM 0.33.0, S:1830-1846), and a preempted request looks up and recomputes them with its
prompt. The checker explores decoding bounds: the compiled twin one full-attention group's
(scenarios `decoding` and `decoding-prompt-only`), the Python model every group's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import spec
from spec import model as M
from spec.checker import check_model
from spec.groups import NULL_BLOCK
from spec.progress import PROGRESS
from spec.regressions import REGRESSIONS
from statemachine.checker import check

DECODING = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=8, gpu_blocks=8, resets=0,
                    failures=0, preemptions=1, decode_tokens=3)
OUT = M.OUTPUT_FAMILY  # request r0's output family


def _run(b: M.Bounds, program: str) -> M.ModelState:
    s = M.initial(b)
    for ev in M.parse_events(program):
        s, _calls, _w = M.apply(s, ev)
    return s


def _ack_all(s: M.ModelState) -> M.ModelState:
    """Every shipped job reported by every worker."""
    for j in [j for j in s.jobs if j.age is not None]:
        s, _c, _w = M.apply(s, M.Event("report", job=j.id, count=j.unreported))
    return s


def _core(s: M.ModelState, r: str = "r0") -> M.MCore:
    return dict(s.core)[r]


def test_a_request_decodes_one_token_a_step_until_its_output_is_generated() -> None:
    s = _run(DECODING, "arrive(r0) ; step(admit=r0) ; step()")
    assert (_core(s).computed, _core(s).generated) == (2, 1)  # the prompt, one sampled
    s = _run(DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step() ; step() ; step()")
    assert (_core(s).computed, _core(s).generated) == (4, 3)  # never its last sampled token
    with pytest.raises(M.NotEnabled):  # no prompt yet: no finish
        _run(DECODING, "arrive(r0) ; step(admit=r0) ; finish(r0)")
    assert dict(_run(DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step() ; "
                               "finish(r0)").core)["r0"].status == "finished"  # mid-decode


def test_a_decoding_request_stores_its_output_under_keys_of_its_own() -> None:
    s = _run(DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step() ; step()")
    stored = {k for k, _ in s.chunks}
    assert {M.key(0, 0), M.key(0, 1)} <= stored  # the prompt, in its family
    assert {M.key(OUT, 2), M.key(OUT, 3)} <= stored  # the output, in the request's own
    assert M.key(0, 2) not in stored


def test_offload_prompt_only_stores_the_prompt_and_no_output() -> None:
    """vLLM's `offload_prompt_only` (its default, S:769-770): the running stores and the
    finished request's last store stop at the prompt's end; a preempted request's lookup
    then hits the prompt only."""
    b = replace(DECODING, offload_prompt_only=True)
    program = "arrive(r0) ; step(admit=r0) ; step() ; step() ; step()"
    assert {k for k, _ in _run(DECODING, program).chunks} >= {M.key(OUT, 2)}  # off: stored
    s = _ack_all(_run(b, program))
    assert {k for k, _ in s.chunks} == {M.key(0, 0), M.key(0, 1)}
    s = _run_from(s, "finish(r0) ; step()")
    assert {k for k, _ in s.chunks} == {M.key(0, 0), M.key(0, 1)}
    s = _ack_all(_run(b, "arrive(r0) ; step(admit=r0) ; step() ; step()"))
    s = _run_from(s, "preempt(r0) ; step()")
    _s, calls, _w = M.apply(s, M.Event("step", "r0"))
    lookup = next(c for c in calls if c.hook == "get_num_new_matched_tokens")
    assert lookup.answer == (2, True)  # the prompt; the output is recomputed


def test_the_checker_verifies_decoding_under_offload_prompt_only() -> None:
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=1,
                 failures=1, preemptions=1, decode_tokens=2, offload_prompt_only=True)
    r = check(b)
    assert r.ok and r.complete, r.counterexample.render() if r.counterexample else ""
    assert set(r.liveness) == {p.id for p in PROGRESS}
    assert 0 < r.states < 6281  # fewer states than with the output stored (below)


def test_a_finished_request_stores_up_to_its_last_sampled_token_not_it() -> None:
    """Finished, not aborted: `max(prompt, num_tokens - 1)` tokens are offloadable; the
    last sampled token's slot is never computed."""
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=8, gpu_blocks=8, resets=0,
                 failures=0, preemptions=0, decode_tokens=2)
    s = _ack_all(_run(b, "arrive(r0) ; step(admit=r0) ; step() ; step()"))
    s = _run_from(s, "finish(r0) ; step()")
    stored = {k for k, _ in s.chunks}
    assert stored == {M.key(0, 0), M.key(0, 1), M.key(OUT, 2)}  # num_tokens 4: 3 stored


def _run_from(s: M.ModelState, program: str) -> M.ModelState:
    for ev in M.parse_events(program):
        s, _calls, _w = M.apply(s, ev)
    return s


def test_a_preempted_decoding_request_looks_up_and_recomputes_its_output() -> None:
    s = _ack_all(_run(DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step()"))
    assert (_core(s).computed, _core(s).generated) == (3, 2)  # num_tokens 4
    s = _run_from(s, "preempt(r0) ; step()")
    s, calls, _w = M.apply(s, M.Event("step", "r0"))
    lookup = next(c for c in calls if c.hook == "get_num_new_matched_tokens")
    assert lookup.answer == (3, True)  # max hit num_tokens - 1: the prompt and one output
    s = _run_from(_ack_all(s), "step(admit=r0)")  # loaded: it computes its 4th token
    assert (_core(s).computed, _core(s).generated) == (4, 3)


def test_decoding_keeps_the_token_count_in_one_place() -> None:
    s = _run(DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step()")
    w = M.World.thaw(s)
    assert w.num_tokens("r0") == 2 + 2
    assert len(w.keys_of("r0")) == 4
    assert w.may_finish("r0")


def test_without_decoding_nothing_is_sampled() -> None:
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=0,
                 failures=0, preemptions=0)
    s = _run(b, "arrive(r0) ; step(admit=r0) ; step() ; step()")
    assert (_core(s).computed, _core(s).generated) == (2, 0)


@pytest.mark.parametrize(("b", "states"), [
    (M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=1,
              failures=1, preemptions=1, decode_tokens=2), 3229),
    (M.Bounds(requests=2, tokens=2, workers=1, cpu_chunks=3, gpu_blocks=5, resets=0,
              failures=1, preemptions=1, decode_tokens=1), 4350),
    (M.Bounds(requests=1, tokens=3, workers=1, cpu_chunks=6, gpu_blocks=12, resets=1,
              failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=2,
              blocks_per_chunk=2, decode_tokens=3), 5377),
], ids=["one-request-decode-2", "two-requests-decode-1", "window-decode-3"])
def test_the_checker_finds_no_violation_and_liveness_holds_under_decoding(
        b: M.Bounds, states: int) -> None:
    """Decoding runs on the compiled twin, beside a sliding window in chunks of 2 blocks
    too; the Python model explores the same states."""
    r = check(b)
    assert r.engine == "compiled", r.engine
    assert r.ok and r.complete, r.counterexample.render() if r.counterexample else ""
    assert set(r.liveness) == {p.id for p in PROGRESS}  # every progress property held
    assert r.states == states
    ref = check_model(b)
    assert (ref.verdict, ref.states, ref.depth) == (r.verdict, r.states, r.depth)


def test_decode_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        M.Bounds(decode_tokens=-1)
    assert M.Bounds(groups=("full", "mamba"), decode_tokens=1).decode_tokens == 1


MAMBA_DECODING = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=12, gpu_blocks=12,
                          resets=0, failures=0, preemptions=1, groups=("full", "mamba"),
                          decode_tokens=3)


def _handoffs(b: M.Bounds, program: str) -> tuple[M.ModelState, list[dict[str, Any]]]:
    """The state after `program` and each step's hand-offs (build_connector_meta's)."""
    s, given = M.initial(b), []
    for ev in M.parse_events(program):
        s, calls, _w = M.apply(s, ev)
        given += [c.args[6] for c in calls if c.hook == "build_connector_meta"]
    return s, given


def test_beside_a_mamba_group_each_output_block_hands_off_its_state_which_is_stored() -> None:
    """A decoding request beside a Mamba group: every step completes a block (one token a
    block), so every step hands off the state there, the output's as the prompt's; the
    connector stores each under the output's own key, alone and fenced at creation, and
    the core frees each state block once the next state is computed."""
    s, given = _handoffs(MAMBA_DECODING, "arrive(r0) ; step(admit=r0) ; step() ; step() ; "
                                         "step()")
    assert [g["r0"][0][2] for g in given] == [1, 2, 3, 4]  # boundaries, past the prompt (2)
    assert all(g["r0"][0][0] == 1 for g in given)  # the Mamba group's
    stores = {j.keys: j for j in s.jobs if j.kind == "store"}
    for p in (2, 3):  # output states, in the request's own family
        job = stores[(M.key(OUT, p, 1, 2),)]
        assert job.fenced == frozenset(job.blocks) and len(job.blocks) == 1
    mamba = dict(s.core)["r0"].blocks[4:]
    assert mamba[:3] == (NULL_BLOCK,) * 3 and mamba[3] != NULL_BLOCK  # one state held


def test_offload_prompt_only_stores_no_output_state_beside_a_mamba_group() -> None:
    """The core hands off the output's states all the same; vLLM's connector stores none
    past the prompt (S:1566-1578 with S:762-771)."""
    b = replace(MAMBA_DECODING, offload_prompt_only=True)
    s, given = _handoffs(b, "arrive(r0) ; step(admit=r0) ; step() ; step() ; step()")
    assert [g["r0"][0][2] for g in given] == [1, 2, 3, 4]
    stored = {k for j in s.jobs if j.kind == "store" for k in j.keys}
    assert stored == {M.key(0, p, g, 2) for p in (0, 1) for g in (0, 1)}


def test_a_restarted_request_beside_a_mamba_group_hits_into_its_output() -> None:
    """Preempted with 4 of its 5 tokens computed (and a sixth, its last, still to sample),
    the request's lookup reaches token 3 of its own output: the bound is its 4 tokens
    before the last, and the Mamba group cuts a token more, to the state stored at
    boundary 3."""
    b = replace(MAMBA_DECODING, decode_tokens=4)
    s, _given = _handoffs(b, "arrive(r0) ; step(admit=r0) ; step() ; step() ; step()")
    s = _run_from(_ack_all(s), "preempt(r0) ; step()")
    _s, calls, _w = M.apply(s, M.Event("step", "r0"))
    lookup = next(c for c in calls if c.hook == "get_num_new_matched_tokens")
    assert lookup.answer == (3, True)


def test_a_block_appended_while_a_finished_requests_load_is_due_keeps_inv15() -> None:
    """Regression `finished-sync-load-frees-its-blocks` (spec.regressions): the block a
    finished request's sync load wrote goes to a decoding request, which stores it."""
    from statemachine.testing import replay

    reg = next(r for r in REGRESSIONS if r.name == "finished-sync-load-frees-its-blocks")
    replay(reg.events(), reg.bounds)  # the reference against the model, every hook checked
    a = M.abstract(_run(reg.bounds, reg.program))
    r1 = next(r for r in a.requests if r.id == "r1")
    sync_load = next(j for j in a.jobs if j.owner == "r1" and j.kind == "load")
    assert sync_load.sync and r1.finished and r1.gpu_blocks == ()
    store = next(j for j in a.jobs if j.owner == "r0" and j.kind == "store"
                 and sync_load.blocks & j.blocks)  # r0 stores the block r1's load wrote
    r0 = next(r for r in a.requests if r.id == "r0")
    assert store.blocks <= set(r0.gpu_blocks)
    assert spec.check(a) == []


def test_a_request_that_sampled_its_last_token_finishes_and_is_not_preempted() -> None:
    """vLLM finishes a request as it samples its last output token (`update_from_output`),
    so nothing can preempt it in between: the model's `preempt` is not enabled from that
    sample to the request's `finish`; one token before, it is (the compiled twin:
    `tests/test_checker_compiled.py`)."""
    b = M.Bounds(requests=1, tokens=2, workers=1, cpu_chunks=4, gpu_blocks=4, resets=0,
                 failures=0, preemptions=1, decode_tokens=2)
    s = _run(b, "arrive(r0) ; step(admit=r0) ; step()")  # a token a step
    assert dict(s.core)["r0"].generated == 1
    M.apply(s, M.Event("preempt", "r0"))  # one output token to go: enabled
    s = _run_from(s, "step()")
    assert dict(s.core)["r0"].generated == 2
    with pytest.raises(M.NotEnabled, match="sampled its last token"):
        M.apply(s, M.Event("preempt", "r0"))
    M.apply(s, M.Event("finish", "r0"))
