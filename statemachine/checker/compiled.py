"""The compiled twin of `spec.model`: built on first use, called through ctypes.

`Library` builds the C sources of `statemachine/checker/c` with the headers `gen` makes from
the tables (kernels.toolchain: the system compiler, a per-user cache), and exposes the
search and, for the differential tests, single steps on encoded states. `encode` is the
Python side of the C state encoding: a `spec.model.ModelState` encoded here equals the C
encoding of the same state, byte for byte, which is how the two models are compared.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kernels import toolchain
from spec import fence as F
from spec import job as J
from spec import model as M
from spec import request as R
from spec.groups import NULL_BLOCK
from spec.rules import (
    VLLM_0_33,
    FailedLoadLookup,
    LastTokenCut,
    PartialTailSearch,
    StaleLoadFailure,
    StoreAdmission,
)
from spec.schema import MachineSpec
from statemachine.checker import gen

SOURCES = Path(__file__).with_name("c")
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-std=gnu11", "-Wall",
         "-Wno-unused-function", "-Wl,--no-undefined")
MAXR, MAXG, MAXT, MAXJ, MAXB, MAXK, MAXID = 4, 3, 12, 24, 16, 32, 32
NONE8 = 0xFF
CH_ABSENT = -128
TRACE_CAP = 4096

# request and job flags of model.h
RF_TRACKED, RF_FINISHED, RF_SIGNALED, RF_LOAD_INVALID = 1, 2, 4, 8
RF_SYNC_RES, RF_HIT, RF_KVLOAD, RF_SIGENTRY = 16, 32, 64, 128
JF_SYNC, JF_FAILED, JF_FLUSH_REQ, JF_FLUSH_SHIPPED, JF_HELD, JF_QUAR, JF_TABLE, JF_BAD = (
    1, 2, 4, 8, 16, 32, 64, 128)
CORE_STATUS = {None: 0, "waiting": 1, "remote": 2, "running": 3, "finished": 4}

# events: kind | req << 3 | job << 6 | count << 11 | failed << 14 | admit << 15 |
# promote << 16 (a step that only promotes request req)
EV_ARRIVE, EV_ABORT, EV_STEP, EV_FINISH, EV_PREEMPT, EV_REPORT, EV_RESET, EV_STRAY = range(8)
EV_PROMOTE = 1 << 16

RULES = ("store_admission", "failed_load_lookup", "stale_load_failure", "last_token_cut",
         "partial_tail_search")
"""The `spec.rules.Rules` fields the compiled model states both ways (its bounds'
`per_request_admission`, `failed_load_for_life`, `stale_fence_only`,
`last_token_before_caps` and `partial_tail_from_prefix`). On any other it states 0.33.0's
rule, and takes a later release's rules where `Bounds.rules_in_play` says that rule is
moot."""

VERDICTS = ("ok", "invariant", "illegal", "liveness", "stuck", "limit", "memory")


class CompiledUnavailable(RuntimeError):
    """No C compiler, a failed build, or bounds beyond the compiled model's limits."""


class CBounds(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "requests", "tokens", "workers", "cpu_chunks", "gpu_blocks", "resets", "failures",
        "preemptions", "timeout_steps", "sync_loads", "partial_reports", "stray_reports",
        "failed_load_for_life", "store_threshold", "per_request_admission",
        "stale_fence_only", "decode_tokens", "offload_prompt_only", "blocks_per_chunk",
        "tokens_per_block", "groups", "sliding", "sliding_window",
        "last_token_before_caps", "retention", "mamba", "partial_tails",
        "partial_tail_from_prefix")] + [
        ("family", ctypes.c_int32 * MAXR), ("max_load", ctypes.c_int32 * MAXR),
        ("max_offload", ctypes.c_int32 * MAXR), ("skip_reading", ctypes.c_int32 * MAXR)]


class CResult(ctypes.Structure):
    _fields_ = [("states", ctypes.c_int64), ("edges", ctypes.c_int64),  # type: ignore[assignment]
                ("stuck_states", ctypes.c_int64)] + [
        (name, ctypes.c_int32) for name in (
            "depth", "complete", "verdict", "invariant", "inside_hook", "request", "nprefix",
            "ncycle", "nlive", "threads")] + [
        ("memory", ctypes.c_int64), ("seconds", ctypes.c_double), ("msg", ctypes.c_char * 200)]


ENC_MAX = 2048
"""The most bytes a state's encoding takes (search.c's ENC_MAX)."""
MAX_EVENTS = 64
"""The most events a state has (search.c's MAX_EVENTS)."""

PROGRESS = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32)


def fits(b: M.Bounds) -> str | None:
    """Why the compiled model cannot take these bounds (None: it can)."""
    if b.blocks_per_chunk > 8:
        return "more than 8 blocks a chunk (a chunk's blocks written are a byte)"
    ng = len(b.groups)
    if b.requests > MAXR or b.gpu_blocks > MAXB \
            or ng > MAXG or ng * b.blocks_of(b.tokens + b.decode_tokens) > MAXT \
            or kv_nkeys(b) > MAXK:
        return (f"bounds beyond the compiled model ({MAXR} requests, {MAXG} groups, {MAXT} "
                f"blocks in a request's table, {MAXK} chunk keys (a key per token of prompt "
                f"and output, per request and group), {MAXB} GPU blocks)")
    if b.workers > 7:
        return "more than 7 workers (a report's count has 3 bits)"
    if b.store_threshold > 255:
        return "a store threshold above 255 (a key's offers are counted in a byte)"
    unstated = [name for name in b.rules_in_play()
                if name not in RULES and getattr(b.rules, name) != getattr(VLLM_0_33, name)]
    if unstated:
        return (f"rules of a later release ({', '.join(unstated)}; the compiled model states "
                f"vLLM 0.33.0's, and a later release's {' and '.join(RULES)})")
    return None


def c_bounds(b: M.Bounds) -> CBounds:
    cb = CBounds()
    for name in ("requests", "tokens", "workers", "cpu_chunks", "gpu_blocks", "resets",
                 "failures", "preemptions"):
        setattr(cb, name, getattr(b, name))
    cb.timeout_steps = -1 if b.timeout_steps is None else b.timeout_steps
    cb.sync_loads, cb.partial_reports = int(b.sync_loads), int(b.partial_reports)
    cb.stray_reports = int(b.stray_reports)
    cb.failed_load_for_life = int(b.rules.failed_load_lookup is FailedLoadLookup.FOR_LIFE)
    cb.store_threshold = b.store_threshold
    cb.per_request_admission = int(b.rules.store_admission is StoreAdmission.PER_REQUEST)
    cb.stale_fence_only = int(b.rules.stale_load_failure is StaleLoadFailure.FENCE_ONLY)
    cb.decode_tokens = b.decode_tokens
    cb.offload_prompt_only = int(b.offload_prompt_only)
    cb.blocks_per_chunk = b.blocks_per_chunk
    cb.tokens_per_block = b.tokens_per_block
    cb.groups = len(b.groups)
    cb.sliding = sum(1 << g for g, kind in enumerate(b.groups) if kind == "sliding")
    cb.sliding_window = b.sliding_window
    cb.last_token_before_caps = int(b.rules.last_token_cut is LastTokenCut.BEFORE_CAPS)
    cb.retention = -1 if b.retention_interval is None else b.retention_interval
    cb.mamba = sum(1 << g for g in b.handoff_groups())
    cb.partial_tails = int(b.partial_tails)
    cb.partial_tail_from_prefix = int(
        b.rules.partial_tail_search is PartialTailSearch.FROM_FULL_ATTENTION_PREFIX)
    for i, t in enumerate(b.templates()):
        cb.family[i] = t.family
        cap = t.settings.max_load_tokens
        cb.max_load[i] = -1 if cap is None else cap
        cap = t.settings.max_offload_tokens
        cb.max_offload[i] = -1 if cap is None else cap
        cb.skip_reading[i] = int(t.settings.skip_reading_prefix_cache)
    return cb


def fault_mask(faults: M.Faults) -> int:
    order = list(M.Fault)
    return sum(1 << order.index(f) for f in faults)


def without_mask(invariants: frozenset[str]) -> int:
    return sum(1 << (int(i.split("-")[1]) - 1) for i in invariants)


class Library:
    """The compiled model, built once per process (and cached on disk across them)."""

    def __init__(self) -> None:
        sources = {p.name: p.read_text() for p in sorted(SOURCES.iterdir())
                   if p.suffix in (".c", ".h")}
        sources["tables.h"] = gen.header()
        sources["dispatch.h"] = gen.dispatch()
        sources["progress.h"] = gen.progress()
        try:
            path = toolchain.build("kvspec_checker", sources, FLAGS)
        except toolchain.ToolchainError as exc:
            raise CompiledUnavailable(str(exc)) from exc
        lib = ctypes.CDLL(str(path))
        lib.kv_search_new.restype = ctypes.c_void_p
        lib.kv_search_new.argtypes = [ctypes.POINTER(CBounds), ctypes.POINTER(ctypes.c_int32),
                                      ctypes.c_int, ctypes.c_int]
        lib.kv_search_free.argtypes = [ctypes.c_void_p]
        lib.kv_search_run.argtypes = [
            ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(CResult)]
        lib.kv_search_trace.restype = ctypes.POINTER(ctypes.c_uint32)
        lib.kv_search_trace.argtypes = [ctypes.c_void_p]
        lib.kv_search_state.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p]
        lib.kv_step.argtypes = [ctypes.POINTER(CBounds), ctypes.POINTER(ctypes.c_int32),
                                ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p,
                                ctypes.c_uint32, ctypes.c_char_p]
        lib.kv_events_of.argtypes = [ctypes.POINTER(CBounds), ctypes.c_char_p,
                                     ctypes.POINTER(ctypes.c_uint32)]
        lib.kv_encode_initial.argtypes = [ctypes.POINTER(CBounds), ctypes.c_char_p]
        lib.kv_waiting.argtypes = [ctypes.POINTER(CBounds), ctypes.c_char_p, ctypes.c_int,
                                   ctypes.c_int]
        lib.kv_fair_class.restype = ctypes.c_uint64
        lib.kv_fair_class.argtypes = [ctypes.c_uint32]
        lib.kv_pack.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
        lib.kv_unpack.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
        lib.kv_parts.argtypes = [ctypes.POINTER(CBounds), ctypes.c_char_p, ctypes.c_int,
                                 ctypes.POINTER(ctypes.c_int32)]
        self.lib = lib
        self.path = path


@functools.cache
def library() -> Library:
    return Library()


def available() -> str | None:
    """None when the compiled model can be used; else why not (one line)."""
    try:
        library()
    except CompiledUnavailable as exc:
        return str(exc).splitlines()[0]
    return None


def rows_of(tables: M.Tables) -> tuple[ctypes.Array[ctypes.c_int32], int]:
    machines: Mapping[str, MachineSpec] = tables.machines
    flat = gen.encode_rows(machines)
    arr = (ctypes.c_int32 * len(flat))(*flat)
    return arr, len(flat) // gen.ROW_WIDTH


# ==================================================================== events
def label_event(label: int, b: M.Bounds, ids: list[int] | None = None) -> M.Event:
    """The model event of a C label; `ids` maps canonical job ids to the state's own."""
    kind, req = label & 7, (label >> 3) & 7
    job, count, failed, admit = (label >> 6) & 31, (label >> 11) & 7, (label >> 14) & 1, \
        (label >> 15) & 1
    rid = f"r{req}"
    if ids is not None and kind in (EV_REPORT, EV_STRAY) and job < len(ids):
        job = ids[job]
    if kind == EV_ARRIVE:
        return M.Event("arrive", rid)
    if kind == EV_ABORT:
        return M.Event("abort", rid)
    if kind == EV_STEP and label & EV_PROMOTE:
        return M.Event("promote", rid)
    if kind == EV_STEP:
        return M.Event("step", rid if admit else None)
    if kind == EV_FINISH:
        return M.Event("finish", rid)
    if kind == EV_PREEMPT:
        return M.Event("preempt", rid)
    if kind in (EV_REPORT, EV_STRAY):
        return M.Event("report", job=job, count=count, failed=bool(failed))
    return M.Event("reset")


def event_label(ev: M.Event) -> int:
    """The C label of a model event (job ids as they are: canonical in canonical states)."""
    req = int(ev.req[1:]) if ev.req else 0
    kind = {"arrive": EV_ARRIVE, "abort": EV_ABORT, "step": EV_STEP, "promote": EV_STEP,
            "finish": EV_FINISH, "preempt": EV_PREEMPT, "report": EV_REPORT,
            "reset": EV_RESET}[ev.kind]
    return (kind | req << 3 | (ev.job or 0) << 6 | ev.count << 11 | int(ev.failed) << 14
            | int(ev.kind == "step" and ev.req is not None) << 15
            | (EV_PROMOTE if ev.kind == "promote" else 0))


# ==================================================================== the encoding
def _key_index(b: M.Bounds, key: int) -> int:
    """kv_key of model.c: a prompt key's index by its family and position, then each
    request's output keys (family `OUTPUT_FAMILY + i`) after every prompt key; a key per
    group at each (the group index last, as `spec.groups.offload_key` appends it)."""
    ng = len(b.groups)
    block_hash, group = divmod(key, ng)
    family, pos = divmod(block_hash - 1, 1000)
    if family >= M.OUTPUT_FAMILY:
        at = (b.requests * b.tokens + (family - M.OUTPUT_FAMILY) * b.decode_tokens
              + pos - b.tokens)
    else:
        at = family * b.tokens + pos
    return at * ng + group


def _mask(width: int, mask: int) -> list[int]:
    """A set of keys as kv_encode writes it, in `width` bytes (`_mask_width`)."""
    return list(mask.to_bytes(width, "little"))


def _mask_width(b: M.Bounds) -> int:
    """The bytes of a set of keys (mask_bytes of search.c): 2, or 4 beyond 16 keys."""
    return 4 if kv_nkeys(b) > 16 else 2


def kv_nkeys(b: M.Bounds) -> int:
    """The chunk keys of the compiled model (kv_nkeys of model.c)."""
    return b.requests * (b.tokens + b.decode_tokens) * len(b.groups)


def _pad(blocks: tuple[int, ...], n: int) -> list[int]:
    """A block table as kv_encode writes it: the null block as NONE8, then zeros."""
    return [NONE8 if x == NULL_BLOCK else x for x in blocks] + [0] * (n - len(blocks))


def encode(s: M.ModelState) -> bytes:
    """The C encoding of model state `s` (kv_encode in search.c)."""
    b = s.bounds
    T = len(b.groups) * b.blocks_of(b.tokens + b.decode_tokens)  # a request's table
    K, width = kv_nkeys(b), _mask_width(b)
    out: list[int] = []
    reqs = {r.id: r for r in s.reqs}
    core = dict(s.core)
    signals = dict(s.signals)
    after = {r: s.stores_after_signal.count(r) for r in set(s.stores_after_signal)}
    rstate = {n: i for i, n in enumerate(R.REQUEST_MACHINE.state_names)}
    jstate = {n: i for i, n in enumerate(J.JOB_MACHINE.state_names)}
    cb = c_bounds(b)  # the rules' fields are encoded where the C's bounds say so
    counts_per_request = cb.store_threshold > 1 and cb.per_request_admission
    if s.misplaced and not b.partial_tails:  # the truth of INV-22: only partial tails misplace
        raise CompiledUnavailable("a chunk copied to another position without partial tails: "
                                  "beyond the compiled model's bounds")
    if (s.partial or s.unwritten) and not writes_in_part(b):
        raise CompiledUnavailable("a chunk written in part beyond a window group in chunks "
                                  "of several blocks: beyond the compiled model's bounds")
    windows = bool(b.window_groups())
    for t in b.templates():
        q = reqs.get(t.req_id)
        flags = RF_SIGENTRY if t.req_id in signals else 0
        if q is not None:
            flags |= RF_TRACKED
            flags |= ((RF_FINISHED if q.finished else 0) | (RF_SIGNALED if q.signaled else 0)
                      | (RF_LOAD_INVALID if q.load_invalid else 0)
                      | (RF_SYNC_RES if q.sync_reserved else 0)
                      | (RF_HIT if q.hit is not None else 0)
                      | (RF_KVLOAD if q.kv_load is not None else 0))
            head = [rstate[q.state], flags, q.hit or 0, q.cursor, q.kv_load or 0,
                    len(q.blocks)]
            jobs = sum(1 << i for i in q.jobs)
            blocks = _pad(q.blocks, T)
        else:
            head, jobs, blocks = [0, flags, 0, 0, 0, 0], 0, [0] * T
        out += [*head, signals.get(t.req_id, 0), after.get(t.req_id, 0)]
        if cb.failed_load_for_life:
            out.append(int(q is not None and q.load_failed))
        if counts_per_request:
            counted = 0 if q is None else sum(1 << _key_index(b, k) for k in q.counted)
            out += _mask(width, counted)
        out += list(jobs.to_bytes(4, "little")) + blocks
        c = core.get(t.req_id)
        if c is None:
            out += [0, 0, 0, 0, 0, 0, NONE8] + [0] * cb.stale_fence_only + \
                [0] * bool(b.decode_tokens) + [0] * T
        else:
            out += [CORE_STATUS[c.status], c.computed, c.loading, int(c.aborted),
                    len(c.blocks), int(c.kv_bad), NONE8 if c.load_job is None else c.load_job]
            if cb.stale_fence_only:
                out.append(int(c.recv_failed))
            if b.decode_tokens:
                out.append(c.generated)
            out += _pad(c.blocks, T)
        if windows:
            out.append(0 if q is None else q.window_end)
        if cb.mamba:
            out.append(int(c is not None and c.promoted))
    quarantined = {i for i, _ in s.quarantined_blocks}
    records = sorted([(j, False) for j in s.jobs] + [(j, True) for j in s.held],
                     key=lambda x: x[0].id)
    out.append(len(records))
    for j, held in records:
        flags = ((JF_SYNC if j.sync else 0) | (JF_FAILED if j.failed else 0)
                 | (JF_FLUSH_REQ if j.flush_requested else 0)
                 | (JF_FLUSH_SHIPPED if j.flush_shipped else 0) | (JF_HELD if held else JF_TABLE)
                 | (JF_QUAR if j.id in quarantined else 0) | (JF_BAD if j.bad else 0))
        keys = sum(1 << _key_index(b, k) for k in j.keys)
        deferred = sum(1 << blk for blk in j.deferred)
        owner = int(j.owner[1:])
        out += [j.id, 0 if j.kind == "load" else 1, owner, jstate[j.state], j.pending,
                j.unreported, NONE8 if j.age is None else j.age, j.held_slots, flags,
                len(j.blocks)]
        out += _mask(width, keys) + list(deferred.to_bytes(2, "little"))
        if windows:
            out += list(sum(1 << blk for blk in j.fenced).to_bytes(2, "little"))
        out += _pad(j.blocks, T)
    fence = {n: i for i, n in enumerate(F.FENCE_MACHINE.state_names)}
    out += [s.counter, s.threshold, fence[s.fence_state], int(s.reset_since_step),
            sum(1 << int(r[1:]) for r in s.pending_finished),
            sum(1 << int(r[1:]) for r in s.pending_preempted), *s.budget]
    chunks = {_key_index(b, k): v for k, v in s.chunks}
    out += [chunks.get(k, CH_ABSENT) & 0xFF for k in range(K)]
    if cb.store_threshold > 1:
        offers = {_key_index(b, k): n for k, n in s.offers}
        out += [offers.get(k, 0) for k in range(K)]
    out += _mask(width, sum(1 << _key_index(b, k) for k in s.being_loaded))
    out += list(sum(1 << blk for blk in s.free_blocks).to_bytes(2, "little"))
    out += _mask(width, sum(1 << _key_index(b, k) for k in s.bad_chunks))
    out += list(sum(1 << i for i in s.to_flush).to_bytes(4, "little"))
    fences = dict(s.block_fence)
    for blk in range(b.gpu_blocks):
        out += list(sum(1 << i for i in fences.get(blk, ())).to_bytes(4, "little"))
    if writes_in_part(b):  # the truth of INV-23
        partial = {_key_index(b, k): sum(1 << i for i in offsets) for k, offsets in s.partial}
        out += [partial.get(k, 0) for k in range(K)]
        out += _mask(width, sum(1 << _key_index(b, k) for k in s.unwritten))
    if b.partial_tails:  # the truth of INV-22
        out += _mask(width, sum(1 << _key_index(b, k) for k in s.misplaced))
    return bytes(out)


def writes_in_part(b: M.Bounds) -> bool:
    """A store may write a chunk in part (a window group in chunks of several blocks: a
    sliding window's freed leading blocks, a Mamba state's one block), so the encoding holds
    the truth of partial chunks and unwritten reads (writes_in_part of search.c)."""
    return bool(b.window_groups()) and b.blocks_per_chunk > 1


def part_splitter(b: M.Bounds) -> Callable[[bytes], list[bytes]]:
    """The split of an encoding of bounds `b` into the parts the compiled search's visited
    set holds it as (parts_of of search.c): each request's, the job records', the rest. The
    C bounds are built once, for every encoding split."""
    lib, cb = library().lib, c_bounds(b)
    start = (ctypes.c_int32 * (MAXR + 3))()

    def split(enc: bytes) -> list[bytes]:
        n = lib.kv_parts(ctypes.byref(cb), enc, len(enc), start)
        return [enc[start[p]:start[p + 1]] for p in range(n)]

    return split


# ==================================================================== the search
@dataclass
class Run:
    """What one compiled search found (the checker turns it into a `CheckResult`)."""

    states: int
    edges: int
    depth: int
    complete: bool
    seconds: float
    verdict: str
    invariant: int
    """The invariant broken (its number: 1 is INV-1), or the progress property violated
    (its index in `spec.progress.PROGRESS`)."""
    inside_hook: int
    request: int
    prefix: list[int]
    cycle: list[int]
    stuck_states: int
    message: str
    covered: set[tuple[str, int]]
    """(machine, row index) of every table row fired."""
    live_checked: int
    """How many progress properties (in `spec.progress.PROGRESS` order) were found to hold."""
    threads: int
    """The threads that searched (every other field is the same for any number)."""
    memory: int
    """The bytes of the search's data at its peak: the explored graph (the packed parts of
    the encodings, each state's row of parts and its records, the hash slots, the edges and
    each state's first edge where the search keeps them) and
    the scratch of the liveness or stuck pass after it. The same on any number of threads
    but for the liveness scratch (one per instance searched side by side)."""


def search(b: M.Bounds, faults: M.Faults = M.NO_FAULTS, tables: M.Tables = M.SPEC_TABLES,
           max_states: int | None = None, liveness: bool = True, stuck: bool = False,
           without: frozenset[str] = frozenset(), progress: object = None,
           threads: int = 1) -> Run:
    """The compiled search of `b`. `threads` > 1 expands the states on that many threads
    (at most 64; fewer if the system starts fewer: `Run.threads` says how many) and checks
    the progress properties' instances side by side; the result is the same, state for
    state, as on one (search.c, the search)."""
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    reason = fits(b)
    if reason:
        raise CompiledUnavailable(reason)
    lib = library().lib
    rows, nrows = rows_of(tables)
    cb = c_bounds(b)
    handle = lib.kv_search_new(ctypes.byref(cb), rows, nrows, TRACE_CAP)
    if not handle:
        raise MemoryError("kv_search_new")
    try:
        coverage = (ctypes.c_uint8 * nrows)()
        res = CResult()
        callback = PROGRESS(progress) if progress is not None else None  # type: ignore[call-overload]
        lib.kv_search_run(handle, fault_mask(faults), without_mask(without), max_states or 0,
                          int(liveness), int(stuck), threads, coverage,
                          ctypes.cast(callback, ctypes.c_void_p) if callback else None,
                          ctypes.byref(res))
        trace = lib.kv_search_trace(handle)
        labels = [trace[i] for i in range(res.nprefix + res.ncycle)]
        origins = gen.row_origins(tables.machines)
        return Run(res.states, res.edges, res.depth, bool(res.complete), res.seconds,
                   VERDICTS[res.verdict], res.invariant, res.inside_hook, res.request,
                   labels[:res.nprefix], labels[res.nprefix:], res.stuck_states,
                   res.msg.decode(errors="replace"),
                   {origins[i] for i in range(nrows) if coverage[i]}, res.nlive, res.threads,
                   res.memory)
    finally:
        lib.kv_search_free(handle)


def all_states(b: M.Bounds, faults: M.Faults = M.NO_FAULTS,
               tables: M.Tables = M.SPEC_TABLES) -> Iterator[bytes]:
    """Every state the compiled search visits (encoded), for the differential tests."""
    lib = library().lib
    rows, nrows = rows_of(tables)
    cb = c_bounds(b)
    handle = lib.kv_search_new(ctypes.byref(cb), rows, nrows, TRACE_CAP)
    try:
        res = CResult()
        lib.kv_search_run(handle, fault_mask(faults), 0, 0, 0, 0, 1, None, None,
                          ctypes.byref(res))
        buf = ctypes.create_string_buffer(ENC_MAX)
        for i in range(res.states):
            n = lib.kv_search_state(handle, i, buf)
            yield buf.raw[:n]
    finally:
        lib.kv_search_free(handle)
