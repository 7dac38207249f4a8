"""Request-level settings in the abstract model (vLLM 0.33.0: `max_load_tokens` and
`max_offload_tokens` from `kv_transfer_params`, S:378-410, and `skip_reading_prefix_cache`,
S:1258-1259), and store admission (`store_threshold`): the model's answers, its agreement
with the compiled twin, and the text form `kvspec check --bounds` reads. The pinned
scenarios `request-settings` and `store-admission` run with the others
(tests/test_checker.py, tests/test_checker_groups.py)."""

from __future__ import annotations

import pytest

from spec import model as M
from spec.scenarios import parse_bounds
from statemachine.checker import check, compiled

S = M.RequestSettings


def _serve(s: M.ModelState, req: str) -> tuple[M.ModelState, list[M.Call]]:
    """`req` arrives and runs to its end, every job reported at once; the hook calls."""
    calls: list[M.Call] = []
    s, c, _ = M.apply(s, M.Event("arrive", req))
    calls += c
    s, c, _ = M.apply(s, M.Event("step", req))
    calls += c
    for _ in range(20):
        for j in s.jobs:
            if j.age is not None:
                s, c, _ = M.apply(s, M.Event("report", job=j.id, count=j.pending))
                calls += c
                break
        else:
            if not s.reqs and not s.jobs:
                return s, calls
            core = dict(s.core).get(req)
            done = core is not None and core.status == "running" and \
                core.computed == s.bounds.tokens
            admit = req if core is not None and core.status == "waiting" else None
            s, c, _ = M.apply(s, M.Event("finish", req) if done else M.Event("step", admit))
            calls += c
    raise AssertionError(f"{req} did not drain: {s.reqs} {s.jobs}")


def _answers(calls: list[M.Call], req: str) -> list[object]:
    return [c.answer[0] for c in calls
            if c.hook == "get_num_new_matched_tokens" and c.args[0] == req]


def test_the_caps_bound_what_is_stored_and_loaded_and_skip_reads_nothing() -> None:
    b = M.Bounds(requests=4, tokens=4, families=1, workers=1, cpu_chunks=4, gpu_blocks=8,
                 resets=0, failures=0, preemptions=0, request_settings=(
                     S(max_offload_tokens=2), S(max_load_tokens=1),
                     S(skip_reading_prefix_cache=True)))
    s, calls = _serve(M.initial(b), "r0")
    assert sorted(k for k, _ in s.chunks) == [M.key(0, 0), M.key(0, 1)]  # 2 of 4 chunks
    s, calls = _serve(s, "r1")
    assert _answers(calls, "r1") == [1]  # 2 chunks stored, the cap loads 1
    s, calls = _serve(s, "r2")
    assert _answers(calls, "r2") == [0]  # skips reading; it still stores the rest
    assert len(s.chunks) == 4
    s, calls = _serve(s, "r3")
    assert _answers(calls, "r3") == [3]  # no settings: the whole hit below the last token


def test_a_cap_inside_a_chunk_rounds_the_hit_down_to_whole_chunks() -> None:
    b = M.Bounds(requests=2, tokens=5, families=1, workers=1, cpu_chunks=4, gpu_blocks=10,
                 resets=0, failures=0, preemptions=0, blocks_per_chunk=2,
                 request_settings=(S(), S(max_load_tokens=3)))
    s, _ = _serve(M.initial(b), "r0")
    s, calls = _serve(s, "r1")
    assert _answers(calls, "r1") == [2]  # 3 tokens capped to one 2-block chunk


def test_the_compiled_twin_reaches_the_same_states_with_settings() -> None:
    b = M.Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4, resets=1,
                 failures=0, preemptions=0, request_settings=(
                     S(max_load_tokens=1, max_offload_tokens=1),
                     S(skip_reading_prefix_cache=True)))
    assert compiled.fits(b) is None
    py = check(b, engine="python", liveness=False)
    c = check(b, engine="compiled", liveness=False)
    assert (py.verdict, py.states, py.depth) == (c.verdict, c.states, c.depth)
    plain = check(M.Bounds(requests=2, tokens=2, workers=1, cpu_chunks=2, gpu_blocks=4,
                           resets=1, failures=0, preemptions=0), engine="compiled",
                  liveness=False)
    assert plain.states != c.states  # the settings change what is reachable


def test_settings_in_the_bounds_text() -> None:
    b = parse_bounds("requests=3,request_settings=skip+load1:offload2+-", M.Bounds())
    assert b.request_settings == (S(skip_reading_prefix_cache=True),
                                  S(max_load_tokens=1, max_offload_tokens=2), S())
    assert "+".join(x.text() for x in b.request_settings) == "skip+load1:offload2+-"
    assert [t.settings for t in b.templates()] == list(b.request_settings)
    with pytest.raises(ValueError, match="request settings are skip, loadN and offloadN"):
        parse_bounds("request_settings=loadx", M.Bounds())


def test_a_chunk_is_stored_at_its_second_offer() -> None:
    """Store admission (vLLM's store_threshold, M:129-148, M:282-291): r0 offers its chunks
    once and stores none; r1, sharing the prefix, offers them again and stores them; a
    reset between them keeps the counts."""
    b = M.Bounds(requests=2, tokens=3, families=1, workers=1, cpu_chunks=3, gpu_blocks=6,
                 resets=1, failures=0, preemptions=0, store_threshold=2)
    s, _ = _serve(M.initial(b), "r0")
    assert not s.chunks and dict(s.offers) == {M.key(0, c): 1 for c in range(3)}
    s = M.apply(s, M.Event("reset"))[0]
    assert dict(s.offers) == {M.key(0, c): 1 for c in range(3)}
    s, _ = _serve(s, "r1")
    assert sorted(k for k, _ in s.chunks) == [M.key(0, c) for c in range(3)]
    assert dict(s.offers) == {M.key(0, c): 2 for c in range(3)}  # counted up to the threshold
    assert compiled.encode(M.canonical(s)) in set(compiled.all_states(b))  # and the twin's
