"""Model-based tests of an offloading scheduler against the abstract model of `spec`.

`OffloadingStateMachine` is a hypothesis `RuleBasedStateMachine`. Each rule is an
environment event of `spec.model` (a request arrives; an engine step admits one; workers
report a job in part, in full, twice, late after a reset, or fail it; a job times out; a
request is preempted, finishes or is aborted; the cache is reset). The model computes the
next state and the hook calls the event stands for; an adapter replays those calls on the
implementation under test. After every step the machine checks:
- the answers the hooks gave (lookup hits) are the model's;
- refinement: the implementation's `abstract_state()` equals the model's, field by field;
- every safety invariant of `spec` (on the implementation's state);
and at teardown it drains (every outstanding report delivered, every request finished) and
asserts nothing is left: no request, no job, no fence entry, no pinned chunk.

Plug in another implementation by writing an `Adapter` (see `ReferenceAdapter`, about 80
lines) and subclassing `OffloadingStateMachine` with `adapter_factory` set:

    class MyMachine(OffloadingStateMachine):
        adapter_factory = MyAdapter

    TestMine = MyMachine.TestCase

The adapter receives `Call`s (hook name and arguments in model terms: request ids, block
ids, chunk keys) and must return the hook's answer; `abstract_state()` projects the
implementation onto `spec.AbstractState` (each state of the tables names the vLLM predicate
that identifies it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, Protocol

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from spec import check as check_invariants
from spec import model as M
from spec.groups import split_groups, window_tokens
from spec.rules import VLLM_0_33, VLLM_0_34, Rules
from spec.state import AbstractState
from statemachine.config import KVCacheGroup, OffloadingConfig
from statemachine.messages import (
    CachedRequestData,
    KVConnectorOutput,
    NewRequestData,
    OffloadingWorkerMetadata,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from statemachine.scheduler import OffloadingScheduler


class Adapter(Protocol):
    """What the machine needs of an implementation of the scheduler side."""

    def __init__(self, bounds: M.Bounds) -> None: ...

    def call(self, call: M.Call) -> Any:
        """Perform one hook call; return its answer (lookups: (hits, is_async))."""

    def abstract_state(self) -> AbstractState: ...

    def evicted(self) -> tuple[int, ...]:
        """Chunk keys evicted since the last call (the model lets the policy choose)."""


BLOCK = 4
"""Tokens of the reference implementation per model token (its blocks hold
`tokens_per_block` model tokens): above one, so that a hit one token short of a block is a
real case."""


def transfer_params(settings: M.RequestSettings, block: int = BLOCK) -> dict[str, int]:
    """A request's `kv_transfer_params` for the model's settings (one model token is `block`
    tokens)."""
    out: dict[str, int] = {}
    if settings.max_load_tokens is not None:
        out["max_load_tokens"] = settings.max_load_tokens * block
    if settings.max_offload_tokens is not None:
        out["max_offload_tokens"] = settings.max_offload_tokens * block
    return out


def model_hit(tokens: int, sliding: bool, block: int = BLOCK) -> int:
    """A lookup's hit in tokens as the model's (one model token is `block` tokens). With a
    sliding-window group a hit may stop one token before a model token's end (the last
    prompt token is recomputed, S:872-876): that model token is loaded, so it counts."""
    if tokens % block and not (sliding and tokens % block == block - 1):
        raise AssertionError(f"a hit of {tokens} tokens is not whole model tokens of {block}"
                             + (" (or one token short of one)" if sliding else ""))
    return -(-tokens // block)


class ReferenceAdapter:
    """Drives `statemachine.OffloadingScheduler` (one model token is `BLOCK` tokens; the
    bounds give the KV cache groups, tokens per block and blocks per chunk)."""

    def __init__(self, bounds: M.Bounds) -> None:
        self.bounds = bounds
        sync = 10**9 if bounds.sync_loads else 0
        self.config = OffloadingConfig(
            block_size=BLOCK * bounds.tokens_per_block, blocks_per_chunk=bounds.blocks_per_chunk,
            num_workers=bounds.workers,
            num_cpu_chunks=bounds.cpu_chunks, sync_load_budget_bytes=sync,
            kv_bytes_per_token=1 if sync else 0, job_timeout_steps=bounds.timeout_steps,
            store_threshold=bounds.store_threshold, rules=bounds.rules,
            offload_prompt_only=bounds.offload_prompt_only,
            tokens_per_hash=BLOCK if bounds.partial_tails else None,
            retention_interval=None if bounds.retention_interval is None
            else bounds.retention_interval * BLOCK,
            groups=tuple(KVCacheGroup(kind, window_tokens(bounds.sliding_window, BLOCK)
                                      if kind == "sliding" else None)
                         for kind in bounds.groups))
        self.scheduler = self.make_scheduler(self.config)
        self.requests: dict[str, Request] = {}
        self._evicted: list[int] = []
        self._hit_tokens: dict[str, int] = {}
        """The implementation's last lookup answer per request, in tokens."""

    def make_scheduler(self, config: OffloadingConfig) -> OffloadingScheduler:
        return OffloadingScheduler(config)

    @property
    def checks_every_hook(self) -> bool:
        """The scheduler checks every invariant after each of its hooks itself."""
        return bool(self.scheduler.config.check_invariants)

    def _template(self, req_id: str) -> M.Template:
        return next(t for t in self.bounds.templates() if t.req_id == req_id)

    def _request(self, req_id: str) -> Request:
        if req_id not in self.requests:
            t = self._template(req_id)
            tokens = [M.key(t.family, p) * BLOCK + i for p in range(t.tokens)
                      for i in range(BLOCK)]
            self.requests[req_id] = Request(
                req_id, tokens, block_hashes=self._hashes(t, t.tokens),
                kv_transfer_params=transfer_params(t.settings) or None,
                skip_reading_prefix_cache=t.settings.skip_reading_prefix_cache)
        return self.requests[req_id]

    def _hashes(self, t: M.Template, tokens: int) -> list[int]:
        """The block hashes of the first `tokens` model tokens of request `t`: one per block,
        or with partial tails one per model token (BLOCK tokens), prompt and output alike."""
        unit = self.bounds.tokens_per_hash
        return [t.block_key(c, unit) for c in range(tokens // unit)]

    def _sampled(self, outputs: dict[str, int]) -> None:
        """Each request's output grown to the model's count after a step (the engine's
        `update_from_output` appends the sampled tokens), with its block hashes."""
        for r, n in outputs.items():
            req, t = self._request(r), self._template(r)
            have = len(req.output_token_ids) // BLOCK
            req.output_token_ids += [M.key(t.output_family, p) * BLOCK + i
                                     for p in range(t.tokens + have, t.tokens + n)
                                     for i in range(BLOCK)]
            req.block_hashes = self._hashes(t, t.tokens + n)

    def call(self, call: M.Call) -> Any:
        s = self.scheduler
        a = call.args
        if call.hook == "on_new_request":
            return s.on_new_request(self._request(a[0]))
        if call.hook == "get_num_new_matched_tokens":
            hits, is_async = s.get_num_new_matched_tokens(self._request(a[0]), a[1] * BLOCK)
            if hits is None:
                return None, is_async
            self._hit_tokens[a[0]] = hits
            return model_hit(hits, bool(self.scheduler.config.window_groups)), is_async
        if call.hook == "update_state_after_alloc":
            ext = self._hit_tokens.get(a[0], 0) if a[2] else 0
            return s.update_state_after_alloc(self._request(a[0]), self._tables(a[1]), ext)
        if call.hook == "build_connector_meta":
            new, cached, sched, fin, pre, computed, given, copies, outputs = a
            for r, (n, _aborted) in computed.items():
                self._request(r).num_computed_tokens = n * BLOCK
            sched = {r: n * BLOCK for r, n in sched.items()}
            out = SchedulerOutput(
                tuple(NewRequestData(r, self._tables(b)) for r, b in new.items()),
                tuple(CachedRequestData(r, self._tables(b)) for r, b in cached.items()),
                dict(sched), frozenset(fin), frozenset(pre),
                {r: tuple((g, b, end * BLOCK) for g, b, end in e) for r, e in given.items()},
                tuple(copies))
            shipped = s.build_connector_meta(out)
            self._note_evictions()
            self._sampled(outputs)
            return shipped
        if call.hook == "update_connector_output":
            job, done, failed, recving = a
            meta = OffloadingWorkerMetadata({job: done} if done else {},
                                            {job: failed} if failed else {})
            return s.update_connector_output(KVConnectorOutput(meta, set(recving)))
        if call.hook == "request_finished":
            req = self._request(a[0])
            req.status = (RequestStatus.FINISHED_ABORTED if a[1]
                          else RequestStatus.FINISHED_STOPPED)
            return s.request_finished(req)
        if call.hook == "reset_cache":
            return s.reset_cache()
        raise ValueError(f"unknown hook {call.hook!r}")

    def _tables(self, flat: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The model's flat table (group by group, `spec.groups.NULL_BLOCK` where the core
        gave no block) as one table per KV cache group."""
        return split_groups(flat, len(self.bounds.groups))

    def _note_evictions(self) -> None:
        for ev in self.scheduler.take_events():
            if ev.kind == "removed" and not ev.metadata_only:
                self._evicted.extend(ev.keys)

    def evicted(self) -> tuple[int, ...]:
        out, self._evicted = tuple(self._evicted), []
        return out

    def abstract_state(self) -> AbstractState:
        return self.scheduler.abstract_state()


def normalize(state: AbstractState, bounds: M.Bounds) -> AbstractState:
    """What refinement compares: ages capped where they stop mattering, no zero counters."""
    cap = bounds.timeout_steps or 1
    return replace(
        state.canonical(),
        jobs=tuple(replace(j, age=min(j.age, cap)) for j in sorted(state.jobs)),
        finished_signals=tuple(sorted((r, n) for r, n in state.finished_signals if n)),
        extra=(),
    )


def unobserved_as_in(impl: AbstractState, model: AbstractState) -> AbstractState:
    """`model` with what the implementation does not expose left out as it is there: a
    request's store cursor is None where a release keeps none (vLLM before 0.33)."""
    hidden = {r.id for r in impl.requests if r.store_cursor is None}
    if not hidden:
        return model
    return replace(model, requests=tuple(replace(r, store_cursor=None) if r.id in hidden else r
                                         for r in model.requests))


def refinement_diff(impl: AbstractState, model: AbstractState) -> list[str]:
    """The fields where the implementation's state differs from the model's."""
    out = []
    for name in AbstractState.__dataclass_fields__:
        a, b = getattr(impl, name), getattr(model, name)
        if a != b:
            out.append(f"{name}:\n    implementation: {a}\n    model:          {b}")
    return out


class RefinementError(AssertionError):
    pass


class InsideStepViolation(AssertionError):
    """An invariant broken at a hook that returned inside a step."""


ONE_GROUP_BOUNDS: tuple[M.Bounds, ...] = (
    M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=2,
             failures=2, preemptions=2),
    M.Bounds(requests=3, tokens=2, shared_prefix=False, workers=1, cpu_chunks=2,
             gpu_blocks=4, resets=1, failures=1, preemptions=1, timeout_steps=2),
    M.Bounds(requests=2, tokens=3, workers=3, cpu_chunks=4, gpu_blocks=6, resets=2,
             failures=2, preemptions=1, sync_loads=True),
    M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1,
             failures=1, preemptions=1, sync_loads=True, timeout_steps=2),
    M.Bounds(requests=3, tokens=3, workers=2, cpu_chunks=4, gpu_blocks=6, resets=1,
             failures=1, preemptions=1, timeout_steps=1),
)
"""One full-attention KV group, one block per chunk."""

HYBRID_BOUNDS: tuple[M.Bounds, ...] = (
    M.Bounds(requests=3, tokens=3, families=2, workers=2, cpu_chunks=6, gpu_blocks=12,
             resets=2, failures=2, preemptions=2, groups=("full", "sliding"),
             sliding_window=2),
    M.Bounds(requests=3, tokens=3, shared_prefix=False, workers=1, cpu_chunks=5,
             gpu_blocks=10, resets=2, failures=1, preemptions=1, groups=("sliding", "full"),
             sliding_window=1),
    M.Bounds(requests=3, tokens=4, workers=2, cpu_chunks=3, gpu_blocks=8, resets=1,
             failures=1, preemptions=1, blocks_per_chunk=2),
    M.Bounds(requests=2, tokens=5, workers=1, cpu_chunks=6, gpu_blocks=14, resets=1,
             failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=3,
             blocks_per_chunk=2, sync_loads=True),
    M.Bounds(requests=3, tokens=4, families=2, workers=2, cpu_chunks=5, gpu_blocks=12,
             resets=2, failures=1, preemptions=1, groups=("full", "mamba")),
    M.Bounds(requests=2, tokens=5, workers=1, cpu_chunks=6, gpu_blocks=16, resets=1,
             failures=1, preemptions=1, groups=("full", "sliding", "mamba"),
             sliding_window=2, blocks_per_chunk=2, sync_loads=True),
    M.Bounds(requests=3, tokens=5, families=2, workers=2, cpu_chunks=4, gpu_blocks=9,
             resets=1, failures=1, preemptions=1, tokens_per_block=2),
    M.Bounds(requests=2, tokens=7, workers=1, cpu_chunks=4, gpu_blocks=12, resets=1,
             failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=3,
             tokens_per_block=2, blocks_per_chunk=2, sync_loads=True),
    M.Bounds(requests=3, tokens=5, families=2, workers=1, cpu_chunks=5, gpu_blocks=12,
             resets=1, failures=1, preemptions=1, groups=("full", "mamba"),
             tokens_per_block=2),
    M.Bounds(requests=3, tokens=4, families=2, workers=2, cpu_chunks=6, gpu_blocks=12,
             resets=1, failures=1, preemptions=1, groups=("full", "mamba"),
             tokens_per_block=2, partial_tails=True),
    M.Bounds(requests=3, tokens=6, workers=1, cpu_chunks=5, gpu_blocks=12, resets=1,
             failures=1, preemptions=1, groups=("mamba", "full"), tokens_per_block=4,
             partial_tails=True, sync_loads=True, request_settings=(
                 M.RequestSettings(), M.RequestSettings(max_load_tokens=4),
                 M.RequestSettings(max_offload_tokens=4))),
    M.Bounds(requests=3, tokens=5, families=2, workers=2, cpu_chunks=5, gpu_blocks=14,
             resets=1, failures=1, preemptions=1, groups=("full", "sliding", "mamba"),
             sliding_window=2, blocks_per_chunk=2, retention_interval=0),
    M.Bounds(requests=3, tokens=4, families=2, workers=1, cpu_chunks=8, gpu_blocks=16,
             resets=1, failures=1, preemptions=2, groups=("full", "sliding"),
             sliding_window=3, tokens_per_block=2),
    M.Bounds(requests=3, tokens=5, families=2, workers=2, cpu_chunks=6, gpu_blocks=14,
             resets=1, failures=2, preemptions=1, groups=("full", "mamba"),
             tokens_per_block=2, partial_tails=True, rules=VLLM_0_34),
    M.Bounds(requests=3, tokens=3, families=2, workers=2, cpu_chunks=3, gpu_blocks=8,
             resets=2, failures=1, preemptions=1, groups=("mamba",)),
    M.Bounds(requests=3, tokens=4, families=2, workers=2, cpu_chunks=5, gpu_blocks=10,
             resets=2, failures=1, preemptions=1, groups=("sliding",), sliding_window=3,
             blocks_per_chunk=2),
    M.Bounds(requests=3, tokens=4, families=2, workers=1, cpu_chunks=4, gpu_blocks=8,
             resets=2, failures=1, preemptions=1, groups=("sliding",), sliding_window=2,
             retention_interval=0),
)
"""Several KV cache groups (full attention and a sliding window, in either order; beside a
Mamba group), chunks of several blocks, both (a hit that ends inside a chunk; a window of 3
tokens over chunks of 2 blocks; a window of 2 whose chunks may be stored without their
first block), blocks of several tokens (a step, a prompt, a cap that ends inside a block),
partial tails (a boundary inside a block of 2 and of 4 tokens; a load cap below it, an
offload cap that leaves it unstored), vLLM's default retention (only the replay boundary's
window tail and Mamba state), block-aligned prompts in blocks of 2 tokens beside a window
(the hit's bound at the hash block before the last token); partial tails under vLLM 0.34.0's
rules (a tail searched past the full-attention prefix when a failed store left no state at
a chunk edge), and a group alone over every layer: a pure Mamba model (the state a load
ended on is handed off and stored again, and the request waits for that store), and a
sliding window on every layer (2-block chunks, a window of 3; and at vLLM's default
retention, where a chunk no tail needs is passed over without a store)."""


SETTINGS_BOUNDS: tuple[M.Bounds, ...] = (
    M.Bounds(requests=3, tokens=4, workers=1, cpu_chunks=4, gpu_blocks=10, resets=1,
             failures=1, preemptions=1, request_settings=(
                 M.RequestSettings(skip_reading_prefix_cache=True),
                 M.RequestSettings(max_load_tokens=1),
                 M.RequestSettings(max_offload_tokens=2))),
    M.Bounds(requests=3, tokens=5, workers=2, cpu_chunks=6, gpu_blocks=14, resets=1,
             failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=2,
             blocks_per_chunk=2, request_settings=(
                 M.RequestSettings(max_load_tokens=3),
                 M.RequestSettings(max_offload_tokens=3),
                 M.RequestSettings(max_load_tokens=2, max_offload_tokens=4))),
    M.Bounds(requests=3, tokens=3, families=1, workers=1, cpu_chunks=3, gpu_blocks=8,
             resets=1, failures=1, preemptions=1, store_threshold=2),
    M.Bounds(requests=3, tokens=3, families=1, workers=1, cpu_chunks=3, gpu_blocks=8,
             resets=1, failures=1, preemptions=2, store_threshold=2, rules=VLLM_0_34),
    M.Bounds(requests=3, tokens=5, workers=2, cpu_chunks=6, gpu_blocks=14, resets=1,
             failures=1, preemptions=1, groups=("full", "sliding"), sliding_window=2,
             blocks_per_chunk=2, request_settings=(
                 M.RequestSettings(max_load_tokens=2),
                 M.RequestSettings(max_load_tokens=3, max_offload_tokens=4)),
             rules=VLLM_0_34),
)
"""Requests with their own settings: a request that skips reading the cache, caps on the
tokens loaded and stored (a cap inside a chunk; with a hybrid model and 2-block chunks);
and store admission: a chunk stored only at its second offer. The last two under vLLM
0.34.0's rules (`spec.rules.VLLM_0_34`): a key counts once per request, and beside a window
group a load cap on a chunk edge lets the hit reach it."""


DECODE_BOUNDS: tuple[M.Bounds, ...] = (
    M.Bounds(requests=3, tokens=2, workers=2, cpu_chunks=4, gpu_blocks=8, resets=1,
             failures=1, preemptions=2, decode_tokens=3),
    M.Bounds(requests=2, tokens=3, workers=1, cpu_chunks=4, gpu_blocks=8, resets=1,
             failures=1, preemptions=2, decode_tokens=2, sync_loads=True, request_settings=(
                 M.RequestSettings(max_offload_tokens=4),)),
    M.Bounds(requests=3, tokens=3, families=2, workers=2, cpu_chunks=5, gpu_blocks=10,
             resets=1, failures=1, preemptions=2, tokens_per_block=2, decode_tokens=3),
    M.Bounds(requests=2, tokens=3, workers=1, cpu_chunks=6, gpu_blocks=14, resets=1,
             failures=1, preemptions=2, groups=("full", "sliding"), sliding_window=2,
             blocks_per_chunk=2, decode_tokens=3),
    M.Bounds(requests=3, tokens=2, workers=2, cpu_chunks=4, gpu_blocks=8, resets=1,
             failures=1, preemptions=2, decode_tokens=3, offload_prompt_only=True),
    M.Bounds(requests=3, tokens=3, families=2, workers=2, cpu_chunks=6, gpu_blocks=12,
             resets=1, failures=1, preemptions=2, groups=("full", "mamba"), decode_tokens=3),
    M.Bounds(requests=3, tokens=3, families=2, workers=1, cpu_chunks=6, gpu_blocks=14,
             resets=1, failures=1, preemptions=2, groups=("full", "mamba"),
             tokens_per_block=2, decode_tokens=3),
    M.Bounds(requests=3, tokens=4, families=2, workers=2, cpu_chunks=6, gpu_blocks=14,
             resets=1, failures=1, preemptions=2, groups=("full", "mamba"),
             tokens_per_block=2, partial_tails=True, decode_tokens=3),
)
"""Requests that decode after their prompt: output tokens stored chunk by chunk and at the
finish, a preempted request's lookup and recompute over them, an offload cap inside the
output; blocks of two tokens; a sliding window over chunks of two blocks; vLLM's default
`offload_prompt_only`, under which no output is stored; and beside a Mamba group (the
output's states handed off and stored; in blocks of two tokens, where a block-aligned
request meets the hit's bound at the hash block; with partial tails)."""


class OffloadingStateMachine(RuleBasedStateMachine):
    """The model-based test. Subclass to change the adapter or the bounds."""

    adapter_factory: ClassVar[type] = ReferenceAdapter
    bounds_choices: ClassVar[tuple[M.Bounds, ...]] = \
        ONE_GROUP_BOUNDS + HYBRID_BOUNDS + SETTINGS_BOUNDS + DECODE_BOUNDS
    """Each example draws one. An adapter for an implementation of one full-attention group
    and one block per chunk sets `ONE_GROUP_BOUNDS`."""
    faults: ClassVar[M.Faults] = M.NO_FAULTS
    """Model faults to switch on too (only to test that the machine itself catches them)."""
    CHECK_REFINEMENT: ClassVar[bool] = True
    """Compare the implementation's state with the model's after every step. A machine that
    checks liveness alone (the drain) switches it off, with the invariants."""
    CHECK_INVARIANTS_FIRST: ClassVar[bool] = False
    """Check the implementation's invariants after each step before comparing its state with
    the model's, so that a broken invariant is reported as such rather than as the state
    difference it also causes (the conformance machine sets it)."""

    CHECK_EVERY_HOOK: ClassVar[bool] = True
    """Also check the invariants after each hook that returns inside an event (a step's
    lookup and allocation), where the implementation's state is mid-step, unless the adapter
    says its implementation checks them itself after every hook (`checks_every_hook`)."""

    def __init__(self) -> None:
        super().__init__()
        self.model: M.ModelState | None = None
        self.impl: Any = None
        self.trace: list[str] = []
        self.events: list[M.Event] = []
        """The program so far, as model events (`trace` is the same, as text)."""
        self.failure: BaseException | None = None
        """The run's first failure; teardown then leaves the broken implementation alone."""
        self.rows_fired: Counter[tuple[str, int]] = Counter()
        """(machine, row index) of each table row the model fired in the program's steps,
        and how often: what the program exercised of the spec."""
        self._possible_cache: list[M.Event] = []
        self._possible_for: M.ModelState | None = None
        self.swarm: frozenset[str] = frozenset(self.SWARM)

    SWARM: ClassVar[tuple[str, ...]] = ("abort", "finish", "preempt", "reset", "partial",
                                        "complete", "late", "failure")

    @initialize(which=st.integers(0, 100),
                swarm=st.sets(st.sampled_from(SWARM), min_size=2))
    def start(self, which: int, swarm: set[str]) -> None:
        """Swarm testing: each run switches on a random subset of the event kinds, so some
        runs are dense in resets, others in aborts or failures."""
        self.begin(self.bounds_choices[which % len(self.bounds_choices)], swarm)

    def begin(self, bounds: M.Bounds, swarm: Iterable[str] | None = None) -> None:
        """A fresh model and implementation under `bounds`, with the event kinds of `swarm`
        (default: all) switched on for the random draws (a fixed program takes its own)."""
        self.swarm = frozenset(self.SWARM if swarm is None else swarm)
        self.model = M.initial(bounds)
        self.impl = self.adapter_factory(bounds)

    def _step(self, ev: M.Event) -> None:
        try:
            self._step_checked(ev)
        except BaseException as exc:
            self._record_failure(exc)
            raise

    def _record_failure(self, exc: BaseException) -> None:
        """The run's first failure; it carries the program that led to it, in the events'
        own notation (a line `kvspec` and the regression programs read back)."""
        if self.failure is None:
            self.failure = exc
            exc.add_note(f"program: {' ; '.join(self.trace)}")

    def _step_checked(self, ev: M.Event) -> None:
        assert self.model is not None
        try:
            nxt, calls, _w = M.apply(self.model, ev, self.faults)
        except M.NotEnabled:
            return
        self.trace.append(str(ev))
        self.events.append(ev)
        check_inside = (self.CHECK_EVERY_HOOK and len(calls) > 1
                        and not getattr(self.impl, "checks_every_hook", False))
        answers = []
        for i, c in enumerate(calls):
            answers.append(self.impl.call(c))
            if check_inside and i < len(calls) - 1:
                violations = check_invariants(self.impl.abstract_state())
                if violations:
                    raise InsideStepViolation(
                        f"after {' ; '.join(self.trace)}, inside the step, after "
                        f"{c.hook}{c.args}:\n" + "\n".join(map(str, violations)))
        evicted = self.impl.evicted()
        if evicted:
            nxt, calls, _w = M.apply(self.model, ev, self.faults, victims=evicted)
        for c, got in zip(calls, answers, strict=True):
            if c.hook == "get_num_new_matched_tokens" and tuple(got) != tuple(c.answer):
                raise RefinementError(f"after {' ; '.join(self.trace)}: {c.hook}{c.args} "
                                      f"answered {got}, the model {c.answer}")
        self.model = nxt
        self.rows_fired.update(_w.fired)
        if self.CHECK_INVARIANTS_FIRST:
            self.invariants_hold()
        if not self.CHECK_REFINEMENT:
            return
        impl_state = normalize(self.impl.abstract_state(), nxt.bounds)
        model_state = unobserved_as_in(impl_state, normalize(M.abstract(nxt), nxt.bounds))
        if impl_state != model_state:
            raise RefinementError(
                f"after {' ; '.join(self.trace)}: the implementation left the model:\n"
                + "\n".join(refinement_diff(impl_state, model_state)))

    def _possible(self) -> list[M.Event]:
        """The events the model can take now (computed once per model state)."""
        if self.model is None:
            return []
        if self._possible_for is not self.model:
            out = []
            for e in M.events(self.model):
                try:
                    M.apply(self.model, e, self.faults)
                except M.NotEnabled:
                    continue
                except M.ModelError:
                    pass  # a finding: taking it makes the test fail, as it should
                out.append(e)
            self._possible_cache, self._possible_for = out, self.model
        return self._possible_cache

    # -- the event rules: (rule, swarm switch or None, which events it takes) ------------
    EVENT_RULES: ClassVar[tuple[tuple[str, str | None, str], ...]] = (
        ("new_request", None, "arrive"),
        ("step", None, "step"),
        ("promote", None, "promote"),
        ("partial_ack", "partial", "report"),
        ("complete_ack", None, "report"),
        ("late_ack", "late", "report"),
        ("worker_failure", "failure", "report"),
        ("finish", "finish", "finish"),
        ("abort", "abort", "abort"),
        ("preempt", "preempt", "preempt"),
        ("reset", "reset", "reset"),
    )
    """Each rule draws one event among those the model can take now that are of its kind,
    pass its `takes_*` filter and the machine's `allows`, while its swarm switch is on."""

    def candidates(self, rule: str) -> list[M.Event]:
        """The events rule `rule` may draw now (empty: its precondition fails)."""
        switch, kind = next((sw, k) for name, sw, k in self.EVENT_RULES if name == rule)
        if switch is not None and switch not in self.swarm:
            return []
        takes = getattr(self, f"takes_{rule}", None)
        return [e for e in self._possible() if e.kind == kind
                and (takes is None or takes(e)) and self.allows(rule, e)]

    def allows(self, rule: str, ev: M.Event) -> bool:
        """Whether the machine lets `rule` take `ev` (a subclass restricts)."""
        return True

    def rule_for(self, ev: M.Event) -> str | None:
        """The rule that would take `ev` now, whatever the swarm, or None: no rule takes it
        (a stray report, say) or the machine's restrictions (`allows`) keep it off. A
        directed program replayed on a restricted implementation asks this first."""
        for name, _switch, kind in self.EVENT_RULES:
            takes = getattr(self, f"takes_{name}", None)
            if kind == ev.kind and (takes is None or takes(ev)) and self.allows(name, ev):
                return name
        return None

    def takes_partial_ack(self, e: M.Event) -> bool:
        return not e.failed and not self._held(e) and e.count < self._unreported(e.job)

    def takes_complete_ack(self, e: M.Event) -> bool:
        return not e.failed and not self._held(e) and e.count == self._unreported(e.job)

    def takes_late_ack(self, e: M.Event) -> bool:
        """A report for a job that left the table (stale after a reset, or timed out)."""
        return not e.failed and self._held(e)

    def takes_worker_failure(self, e: M.Event) -> bool:
        return e.failed

    def _draw(self, data: st.DataObject, rule: str) -> None:
        evs = self.candidates(rule)
        if evs:
            self._step(data.draw(st.sampled_from(evs)))

    def _held(self, e: M.Event) -> bool:
        assert self.model is not None
        return any(j.id == e.job for j in self.model.held)

    @precondition(lambda self: bool(self.candidates("new_request")))
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        self._draw(data, "new_request")

    @precondition(lambda self: bool(self.candidates("step")))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """An engine step, admitting a waiting request or not (jobs age: timeouts)."""
        self._draw(data, "step")

    @precondition(lambda self: bool(self.candidates("promote")))
    @rule(data=st.data())
    def promote(self, data: st.DataObject) -> None:
        """An engine step whose waiting loop reaches a request whose async load ended, caches
        its loaded blocks (their Mamba state handed off) and does not schedule it."""
        self._draw(data, "promote")

    @precondition(lambda self: bool(self.candidates("partial_ack")))
    @rule(data=st.data())
    def partial_ack(self, data: st.DataObject) -> None:
        self._draw(data, "partial_ack")

    @precondition(lambda self: bool(self.candidates("complete_ack")))
    @rule(data=st.data())
    def complete_ack(self, data: st.DataObject) -> None:
        self._draw(data, "complete_ack")

    @precondition(lambda self: bool(self.candidates("late_ack")))
    @rule(data=st.data())
    def late_ack(self, data: st.DataObject) -> None:
        self._draw(data, "late_ack")

    @precondition(lambda self: bool(self.candidates("worker_failure")))
    @rule(data=st.data())
    def worker_failure(self, data: st.DataObject) -> None:
        self._draw(data, "worker_failure")

    @precondition(lambda self: bool(self.candidates("finish")))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._draw(data, "finish")

    @precondition(lambda self: bool(self.candidates("abort")))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._draw(data, "abort")

    @precondition(lambda self: bool(self.candidates("preempt")))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self._draw(data, "preempt")

    @precondition(lambda self: bool(self.candidates("reset")))
    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        self._draw(data, "reset")

    @rule()
    def duplicate_report_is_rejected(self) -> None:
        """A report for a job that already ended must be refused with nothing changed."""
        if self.model is None or self.impl is None:
            return
        ended = [j for j in range(self.model.counter) if all(
            j != x.id for x in (*self.model.jobs, *self.model.held))
            and j >= self.model.threshold]
        if not ended:
            return
        before = normalize(self.impl.abstract_state(), self.model.bounds)
        try:
            self.impl.call(M.Call("update_connector_output", (ended[-1], 1, 0, frozenset())))
        except Exception as exc:  # the typed error is the adapter's business
            assert "job" in str(exc).lower(), exc
        else:
            raise RefinementError(f"a duplicate report for ended job {ended[-1]} was accepted")
        after = normalize(self.impl.abstract_state(), self.model.bounds)
        assert before == after, "a rejected report changed the implementation"

    @invariant()
    def invariants_hold(self) -> None:
        if self.impl is not None:
            violations = check_invariants(self.impl.abstract_state())
            if violations:
                exc = AssertionError("\n".join(map(str, violations)))
                self._record_failure(exc)
                raise exc

    def teardown(self) -> None:
        """Drain: deliver every report, finish everything, step; then nothing may be left.
        Skipped after a failed step: the implementation stopped mid-hook, and what a drain
        would find next must not bury the first failure."""
        if self.model is None or self.failure is not None:
            return
        for _ in range(200):  # drain: deliver every report, finish everything, step
            # a report completes what a job still waits for; never a stray report (of a job
            # every worker already reported), which the model may send forever
            evs = [e for e in self._possible()
                   if (e.kind == "report" and not e.failed
                       and e.count == self._unreported(e.job) > 0)
                   or e.kind in ("abort",) or (e.kind == "step" and e.req is None)]
            evs.sort(key=lambda e: ("report", "abort", "step").index(e.kind))
            if not evs:
                break
            before = self.model
            self._step(evs[0])
            if self.model == before and evs[0].kind == "step" and self._quiet():
                break
        state = normalize(self.impl.abstract_state(), self.model.bounds)
        assert not state.requests, f"requests left after the drain: {state.requests}"
        assert not state.jobs and not state.reset_fence and not state.quarantine, state
        assert all(n == 0 for _, n in state.chunk_ref_cnt), state.chunk_ref_cnt

    def _unreported(self, job: int | None) -> int:
        assert self.model is not None
        for j in (*self.model.jobs, *self.model.held):
            if j.id == job:
                return int(j.unreported)
        return 0

    def _quiet(self) -> bool:
        assert self.model is not None
        return (not self.model.reqs and not self.model.jobs and not self.model.held)


def replay(events: list[M.Event], bounds: M.Bounds,
           machine: type[OffloadingStateMachine] = OffloadingStateMachine
           ) -> list[M.ModelState]:
    """Drive the machine through a fixed event sequence (a model checker's counterexample,
    say) with every check of the random runs, then its drain; raises what they raise. The
    model's state after each event it took (one the model cannot send where it stands is
    skipped, as in the random runs); the model follows the implementation's choices (its
    evictions), so this is the path the implementation took."""
    m = machine()
    m.begin(bounds)
    path: list[M.ModelState] = []
    for ev in events:
        taken = len(m.trace)
        m._step(ev)
        m.invariants_hold()
        if len(m.trace) > taken:
            assert m.model is not None
            path.append(m.model)
    m.teardown()
    return path


class DataPlaneStateMachine(RuleBasedStateMachine):
    """The same events over the whole stack: engine, scheduler side, workers and kernels.

    Where `OffloadingStateMachine` checks refinement at the scheduler's hooks, this machine
    runs real copies: every step the engine's byte oracle checks each load (and store)
    against the pattern the forward stand-in wrote, the scheduler checks every invariant
    after every hook, and teardown drains and asserts nothing is stuck, leaked or corrupt.
    Faults are injected on the next step's jobs: a worker fails a copy, or hangs on a job
    (the job times out; the late report arrives later).
    """

    kv_model: str = "full"
    """The KV cache groups: "full" (one full-attention group), "hybrid" (full attention
    beside a sliding window with pages of another size), "mamba" (full attention beside a
    Mamba group whose state pages are three times the size) or "window" (the sliding window
    on every layer: no prefix scan bounds a hit)."""
    sliding_window: int = 6
    """The sliding window's tokens ("hybrid" or "window"): 6 is 1.5 blocks."""
    retention_interval: int | None = None
    """vLLM's `prefix_cache_retention_interval` in tokens (`EngineConfig.retention_interval`):
    None stores every chunk's window tail (dense); 0, vLLM's default, only the tail at each
    request's replay boundary, and the core hands off only the Mamba states it keeps."""
    connector_rules: Rules = VLLM_0_33
    """The connector's rules (`EngineConfig.rules`; hypothesis's machine owns the name
    `rules`): 0.33.0's, or 0.34.0's, under which a failed load is never looked up again and
    a stale load's failure is left to the core."""
    sync_load_budget_bytes: int | None = None
    """The connector's sync-load budget (`OffloadingConfig.sync_load_budget_bytes`); None
    takes 64 bytes (96 beside a second group), which every small hit of these programs fits,
    so their loads are sync; 0 makes every load async (WAITING_FOR_REMOTE_KVS)."""
    num_gpu_blocks: int | None = None
    """The engine's GPU blocks; None takes 24 (40 beside a second group), where the core
    seldom preempts for room."""
    faults_target_loads: bool = False
    """Whether an armed fault takes the next step's load before its stores (by default the
    job of the lowest id, mostly a store)."""
    program_weights: ClassVar[Mapping[str, int]] = {}
    """How much likelier than 1 each rule is in a soak's random programs
    (`statemachine.soak`); hypothesis draws its own programs and ignores them."""

    def __init__(self) -> None:
        super().__init__()
        from statemachine.config import KVCacheGroup
        from statemachine.engine import Engine, EngineConfig

        window = KVCacheGroup("sliding", sliding_window=self.sliding_window)
        layers = {"full": ((KVCacheGroup(), 2),),
                  "hybrid": ((KVCacheGroup(), 2), (window, 3)),
                  "mamba": ((KVCacheGroup(), 2), (KVCacheGroup("mamba"), 6)),
                  "window": ((window, 2),)}[self.kv_model]  # each group, its layers' bytes a token
        groups = tuple(g for g, _ in layers)
        second = len(groups) > 1
        self.engine = Engine(EngineConfig(
            block_size=4, blocks_per_chunk=2,
            num_gpu_blocks=self.num_gpu_blocks or (40 if second else 24),
            num_cpu_chunks=12 if second else 6, num_workers=2, num_layers=1,
            bytes_per_token=2, max_num_batched_tokens=32, max_num_running=4,
            sync_load_budget_bytes=(self.sync_load_budget_bytes
                                    if self.sync_load_budget_bytes is not None
                                    else 96 if second else 64),
            job_timeout_steps=3, device="cpu",
            groups=groups, group_bytes_per_token=tuple(b for _, b in layers),
            retention_interval=self.retention_interval, rules=self.connector_rules))
        self.n = 0
        self.armed: list[tuple[str, int, int]] = []
        """Faults for the next step's jobs: (fail or hang, worker, polls a hang lasts)."""
        self.engine.fault_hooks.append(self._inject)

    def _inject(self, engine: Any, meta: Any) -> None:
        still = []
        for kind, worker, release_after in self.armed:
            jobs = sorted(meta.load_jobs) if self.faults_target_loads else []
            jobs = jobs or sorted({*meta.load_jobs, *meta.store_jobs})
            if not jobs:
                still.append((kind, worker, release_after))
            elif kind == "fail":
                engine.workers[worker].fail_job(jobs[0])
            else:
                engine.workers[worker].hang_job(jobs[0], release_after=release_after)
        self.armed = still

    @rule(family=st.integers(0, 2), tokens=st.integers(5, 20), max_tokens=st.integers(1, 6))
    def new_request(self, family: int, tokens: int, max_tokens: int) -> None:
        self.n += 1
        self.engine.add_request(f"q{self.n}", [family * 1000 + i for i in range(tokens)],
                                max_tokens)

    @rule()
    def step(self) -> None:
        self.engine.step()

    @rule(worker=st.integers(0, 1))
    def worker_failure(self, worker: int) -> None:
        self.armed.append(("fail", worker, 0))

    @rule(worker=st.integers(0, 1), release_after=st.integers(2, 8))
    def worker_hang(self, worker: int, release_after: int = 4) -> None:
        """`worker` withholds the next step's job for `release_after` polls after its copy:
        past the job timeout (3 steps) the late report comes after the request moved on,
        which may be to a newer load of the same request."""
        self.armed.append(("hang", worker, release_after))

    @rule(worker=st.integers(0, 1), polls=st.integers(1, 5))
    def worker_stall(self, worker: int, polls: int = 3) -> None:
        """No copy of `worker` completes for the next `polls` steps (a busy copy stream;
        past the 3-step job timeout its jobs time out with no hang)."""
        self.engine.workers[worker].stall(polls)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(self.engine.requests)
        if live:
            self.abort_request(data.draw(st.sampled_from(live)))

    def abort_request(self, req_id: str) -> None:
        """Abort `req_id` if it is still live (a replayed program may name a finished one)."""
        if req_id in self.engine.requests:
            self.engine.abort(req_id)

    @rule(running=st.booleans(), connector=st.booleans())
    def reset(self, running: bool, connector: bool = True) -> None:
        """vLLM's `reset_prefix_cache`: with `running`, the running requests are preempted;
        with `connector`, the connector's cache is reset too (vLLM's default is not to: the
        preempted requests then load their prefixes back from the CPU)."""
        self.engine.reset_prefix_cache(reset_running_requests=running,
                                       reset_connector=connector)

    def teardown(self) -> None:
        try:
            self.engine.run_until_idle(max_steps=400)
            assert not self.engine.has_pending_work(), "stuck after 400 drain steps"
            assert all(v == 0 for v in self.engine.leaks().values()), self.engine.leaks()
        finally:
            self.engine.shutdown()


class HybridDataPlaneStateMachine(DataPlaneStateMachine):
    """`DataPlaneStateMachine` over a hybrid model: full attention beside a sliding window
    whose loads start inside a chunk and whose blocks the core frees as the window moves."""

    kv_model = "hybrid"


class MambaDataPlaneStateMachine(DataPlaneStateMachine):
    """`DataPlaneStateMachine` over full attention beside a Mamba group in align mode: the
    core splits prefills at block edges and hands off the states it commits, each stored
    into the last block of its chunk and loaded back into one block."""

    kv_model = "mamba"


class WindowDataPlaneStateMachine(DataPlaneStateMachine):
    """`DataPlaneStateMachine` over a sliding window on every layer at vLLM's default
    retention (0): a store writes only the chunks the window tail of the request's replay
    boundary reads, no prefix scan bounds a hit, and a hit loads that tail alone (the
    positions before it null). The window is 10 tokens, 2.5 blocks, so a tail that ends on
    a chunk's edge begins at the second block of a chunk: the kernels skip into the chunk
    (the engine counts `loads_inside_a_chunk`). Its soak programs are weighted towards prompts and
    steps, so hits are common."""

    kv_model = "window"
    sliding_window = 10
    retention_interval = 0
    program_weights: ClassVar[Mapping[str, int]] = {"new_request": 3, "step": 4}


class NarrowWindowDataPlaneStateMachine(WindowDataPlaneStateMachine):
    """`WindowDataPlaneStateMachine` with a window of 3 tokens, under one block: a tail is
    one block, or two where the window straddles a block edge, so hits often load from
    inside a chunk, at other offsets than the 10-token window's."""

    sliding_window = 3


class DefaultRetentionHybridDataPlaneStateMachine(WindowDataPlaneStateMachine):
    """Full attention beside `WindowDataPlaneStateMachine`'s window, at vLLM's default
    retention (0): full attention stores every chunk, the window group only the tail at
    each request's replay boundary, so a chunk's groups are stored unevenly, and a hit
    loads the window group's tail from inside a chunk. Its soak programs are weighted as
    the window machine's."""

    kv_model = "hybrid"


class DefaultRetentionMambaDataPlaneStateMachine(WindowDataPlaneStateMachine):
    """`MambaDataPlaneStateMachine` at vLLM's default retention (0): the core hands off only
    the Mamba state at the request's replay boundary, rounded down to a block
    (`spec.groups.state_retained`), so only that state is stored and loaded. Its soak
    programs are weighted as the window machine's."""

    kv_model = "mamba"


class Release034DataPlaneStateMachine(DataPlaneStateMachine):
    """`DataPlaneStateMachine` under vLLM 0.34.0's rules (`spec.rules.VLLM_0_34`): a request
    whose load failed never loads again, and the failure of a load a reset made stale only
    drains the fence while the engine, as that release's core, recomputes the request on
    the ranks' failed_recving. One full-attention group (the rules of the lookup beside a
    window or Mamba group are the model's to check)."""

    connector_rules = VLLM_0_34


class AsyncLoadDataPlaneStateMachine(DataPlaneStateMachine):
    """`DataPlaneStateMachine` whose every hit loads asynchronously (no sync-load budget), its
    faults aimed at loads, and its soak programs weighted towards prompts that share a
    family's prefix and steps that store it: hits are common, so async loads are promoted,
    failed, timed out, and made stale by resets, their failures arriving after the reset
    (the engine counts `async_loads_orphaned_by_reset` and `stale_loads_failed`)."""

    sync_load_budget_bytes = 0
    faults_target_loads = True
    program_weights: ClassVar[Mapping[str, int]] = {"new_request": 3, "step": 4}


class TightDataPlaneStateMachine(AsyncLoadDataPlaneStateMachine):
    """`AsyncLoadDataPlaneStateMachine` over 10 GPU blocks (a prompt and its output take up
    to 7): the core preempts for room inside a step, while stores read the blocks it hands
    to another request and loaded requests hold theirs while they wait."""

    num_gpu_blocks = 10


class Release034AsyncLoadDataPlaneStateMachine(AsyncLoadDataPlaneStateMachine):
    """`AsyncLoadDataPlaneStateMachine` under vLLM 0.34.0's rules: a stale load's failure
    only drains the fence and the engine, as that release's core, recomputes the request on
    the ranks' failed_recving (`failed_recving_recomputes`)."""

    connector_rules = VLLM_0_34
