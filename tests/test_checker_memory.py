"""The compiled search's memory: how its visited set holds the states, and the bytes it
reports (`Run.memory`, the `memory_mb` column of `kvspec check`).

The visited set is collapsed (search.c, the visited set): each state's encoding is cut into
parts (each request's, the job records', the rest), each distinct part is kept once, packed
(each run of 8 bytes becomes a mask byte, bit k: byte k is not zero, and the bytes that are
not zero), and a state is the row of its parts' indices. The search reads a state back by
unpacking its parts; `kv_search_state` hands Python the state decoded and encoded again, so
the differential tests of `test_checker_compiled.py` compare every reachable state through
the collapse with the Python model's encoding."""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.scenarios import by_name
from statemachine.checker import compiled

STATE_BYTES = 4 + 1
"""The arrays of each state the graph holds besides its row (search.c, Graph): the parent,
the event from it (its index among the parent's events)."""

FIRST_EDGE_BYTES = 8
"""Each state's first edge (search.c, Graph's efirst), held only by a search that keeps the
edges (liveness or the stuck pass)."""

SLOT_BYTES = 4
"""A hash slot (search.c, Table): the entry's index + 1 and, in the bits it leaves free, the
top bits of the entry's hash."""

PART_BYTES = 4
"""A part's entry in a state's row: the index of its leaf (search.c, the visited set)."""

LEAF_BYTES = 8
"""Each leaf's offset and length in the leaves' arena, besides its packing."""

EDGE_BYTES = 4 + 1 + 1
"""An edge's arrays (search.c, Graph): its target, its event's index among its source's
events, its fairness class."""


def _slots(entries: int, first: int) -> int:
    """The hash slots of a table of `entries` that started at `first` and doubles when it is
    half full (search.c, intern)."""
    slots = first
    while 2 * entries > slots:
        slots *= 2
    return slots


@pytest.fixture(autouse=True)
def _compiled() -> None:
    why = compiled.available()
    if why:
        pytest.skip(why)


def _pack(enc: bytes) -> bytes:
    out = ctypes.create_string_buffer(len(enc) + len(enc) // 8 + 2)
    n = compiled.library().lib.kv_pack(enc, len(enc), out)
    return out.raw[:n]


def _unpack(packed: bytes) -> bytes:
    out = ctypes.create_string_buffer(compiled.ENC_MAX + 8)
    compiled.library().lib.kv_unpack(packed, len(packed), out)
    return out.raw


def test_the_bounds_python_sizes_its_buffers_by_are_search_cs() -> None:
    source = (compiled.SOURCES / "search.c").read_text()
    for name in ("ENC_MAX", "MAX_EVENTS"):
        assert f"#define {name} {getattr(compiled, name)}\n" in source, name


_ENCODINGS = st.lists(st.one_of(st.just(0), st.integers(0, 255)), max_size=300).map(bytes)
"""Byte strings, half their bytes zeros or more (the encodings are mostly zeros)."""


@given(_ENCODINGS)
def test_a_packing_unpacks_to_its_bytes_and_zeros_after(enc: bytes) -> None:
    packed = _pack(enc)
    groups = -(-len(enc) // 8)
    assert len(packed) == groups + sum(1 for b in enc if b)
    assert _unpack(packed)[:8 * groups] == enc + bytes(8 * groups - len(enc))


@given(_ENCODINGS, _ENCODINGS)
def test_two_encodings_of_a_length_pack_alike_only_if_equal(a: bytes, b: bytes) -> None:
    b = (b + bytes(len(a)))[:len(a)]
    assert (_pack(a) == _pack(b)) == (a == b)


@pytest.mark.parametrize("name", ["reset-during-transfers", "hybrid", "partial-tails",
                                  "decoding"])
def test_the_parts_of_an_encoding_are_its_requests_its_jobs_and_the_rest(name: str) -> None:
    """Every part is a function of the encoding: they join to it, each request's part has one
    length for the bounds, and the job records' part is its count byte and the records."""
    b = by_name(name).bounds
    split = compiled.part_splitter(b)
    request_lengths, job_lengths = set(), set()
    for enc in compiled.all_states(b):
        parts = split(enc)
        assert len(parts) == b.requests + 2
        assert b"".join(parts) == enc
        request_lengths.update(len(p) for p in parts[:b.requests])
        jobs = parts[b.requests]
        if jobs[0]:
            assert (len(jobs) - 1) % jobs[0] == 0
            job_lengths.add((len(jobs) - 1) // jobs[0])
        else:
            assert jobs == b"\0"
    assert len(request_lengths) == 1 and len(job_lengths) == 1


@pytest.mark.parametrize("name", ["reset-during-transfers", "hybrid", "partial-tails"])
def test_the_memory_counts_the_distinct_parts_the_rows_and_the_records(name: str) -> None:
    """Without liveness the search stores no edges: its memory is each distinct part packed
    once (computed here from the states it visited), a row and the records for each state,
    and the two tables' hash slots. Few parts recur in many states."""
    b = by_name(name).bounds
    run = compiled.search(b, liveness=False)
    encodings = list(compiled.all_states(b))
    assert len(encodings) == run.states == len(set(encodings))
    split = compiled.part_splitter(b)
    leaves = {_pack(p) for e in encodings for p in split(e)}
    assert len(leaves) < run.states / 4
    nparts = b.requests + 2
    assert run.memory == (
        sum(len(leaf) for leaf in leaves) + LEAF_BYTES * len(leaves)
        + SLOT_BYTES * _slots(len(leaves), 1 << 13)
        + (PART_BYTES * nparts + STATE_BYTES) * run.states
        + SLOT_BYTES * _slots(run.states, 1 << 17))


def test_the_edges_and_each_pass_add_to_the_memory() -> None:
    b = by_name("hybrid").bounds
    bare = compiled.search(b, liveness=False)
    live = compiled.search(b)
    stuck = compiled.search(b, liveness=False, stuck=True)
    edges = EDGE_BYTES * live.edges + FIRST_EDGE_BYTES * live.states
    assert live.memory > bare.memory + edges
    assert stuck.memory > bare.memory + edges
    assert compiled.search(b, liveness=False, threads=3).memory == bare.memory


LIVENESS_BYTES = 4 + 13
"""The liveness pass's bytes a state on one thread (search.c, liveness): the `waiting` bits of
every instance, and one scratch of Pearce's components: the state's number, the component
stack, the depth-first path, the edge cursor."""


@pytest.mark.parametrize("name", ["hybrid", "reset-during-transfers"])
def test_on_one_thread_liveness_adds_its_edges_and_one_scratch(name: str) -> None:
    """A search that finds no fair cycle keeps an edge for each transition, each state's first
    edge and, on one thread, one scratch: its memory is the bare search's plus those, to the
    byte."""
    b = by_name(name).bounds
    bare = compiled.search(b, liveness=False)
    live = compiled.search(b, threads=1)
    assert live.verdict == "ok" and live.edges == bare.edges
    assert live.memory == (bare.memory + EDGE_BYTES * live.edges
                           + (FIRST_EDGE_BYTES + LIVENESS_BYTES) * live.states)


def test_the_check_table_shows_the_memory(capsys: pytest.CaptureFixture[str]) -> None:
    from statemachine import cli

    assert cli.main(["check", "--scenario", "hybrid", "--threads", "1"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    cols = header.split()
    mb = int(row.split()[cols.index("memory_mb")])
    assert mb == round(compiled.search(by_name("hybrid").bounds).memory / 1e6)
