"""The abstract model's state: bounds, the records of requests, jobs and the core, the
hashable `ModelState`, and `World`, its mutable working copy during one event.

Granularity: a GPU block holds `tokens_per_block` tokens (1 by default) and a chunk is
`blocks_per_chunk` blocks (1 by default); a step computes one token of each running request.
Each KV cache group (`Bounds.groups`: full attention, sliding window or Mamba) has its own
blocks and its own chunk keys: the key of request template `t`'s chunk in group `g` is
`key(t.family, p, g)`, `p` the chunk's last token (one block hash per token: the hash at a
block's last token is the block's). A request's block table is flat, group by group (as
vLLM's GPULoadStoreSpec orders it), `cdiv(tokens, tokens_per_block)` blocks per group;
`NULL_BLOCK` marks a position the core left unallocated or freed (a window group's block
before the window).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

from spec import fence as F
from spec import job as J
from spec import request as R
from spec.groups import (
    GROUP_KINDS,
    HANDOFF_KINDS,
    WINDOW_KINDS,
    GroupKind,
    cdiv,
    freed_positions,
    group_load_window_chunks,
    group_skipped_blocks,
    group_window_chunks,
    offload_key,
    reachable_boundaries,
    reachable_store_blocks,
    retention_interval_ok,
    split_groups,
)
from spec.model.faults import NO_FAULTS, Faults
from spec.rules import VLLM_0_33, Rules
from spec.state import AbstractState

if TYPE_CHECKING:
    from spec.model.environment import Call
    from spec.model.interpreter import Tables


@cache
def _spec_tables() -> Tables:
    from spec.model.interpreter import SPEC_TABLES

    return SPEC_TABLES

CoreStatus = Literal["waiting", "remote", "running", "finished"]


class RequestSettings(NamedTuple):
    """A request's own offloading settings (vLLM 0.33.0: `kv_transfer_params`'
    `max_load_tokens` and `max_offload_tokens`, parsed at S:378-410, and the request's
    `skip_reading_prefix_cache`, S:1258-1259), in the model's tokens (one per block)."""

    max_load_tokens: int | None = None
    """The hit never loads more than this many tokens beyond the local hit (S:867-871,
    rounded down to whole chunks, S:917-920)."""
    max_offload_tokens: int | None = None
    """No store reaches past this token (S:762-771)."""
    skip_reading_prefix_cache: bool = False
    """Its lookups find nothing (it still stores)."""

    def text(self) -> str:
        """`skip:load1:offload2` (`-` for none): the form `parse_bounds` reads."""
        parts = (["skip"] if self.skip_reading_prefix_cache else []) + \
            ([f"load{self.max_load_tokens}"] if self.max_load_tokens is not None else []) + \
            ([f"offload{self.max_offload_tokens}"] if self.max_offload_tokens is not None
             else [])
        return ":".join(parts) or "-"


NO_SETTINGS = RequestSettings()


OUTPUT_FAMILY = 100
"""Request i's generated tokens hash as family `OUTPUT_FAMILY + i`: its own keys, shared
with no other request (a block past the prompt hashes the whole prefix, sampled tokens
included)."""


@dataclass(frozen=True)
class Template:
    """A request the environment may send: its id, its prefix family, prompt length,
    settings, and the tokens it generates after its prompt (`Bounds.decode_tokens`), whose
    keys are of family `output_family`."""

    req_id: str
    family: int
    tokens: int
    settings: RequestSettings = NO_SETTINGS
    decode_tokens: int = 0
    output_family: int = OUTPUT_FAMILY

    def block_key(self, block: int, tokens_per_block: int, group: int = 0,
                  num_groups: int = 1) -> int:
        """The key of the request's block `block` (`block_key`): of its prefix family within
        the prompt, of its own output family once the block ends past the prompt."""
        last = (block + 1) * tokens_per_block - 1
        family = self.family if last < self.tokens else self.output_family
        return key(family, last, group, num_groups)


def key(family: int, position: int, group: int = 0, num_groups: int = 1) -> int:
    """The chunk key of group `group` whose last token is at `position` of a prompt of
    `family` (shared prefixes share keys): the hash there is `family * 1000 + position + 1`
    (vLLM: the hash at the chunk's last block plus the group index)."""
    return offload_key(family * 1000 + position + 1, group, num_groups)


def key_position(chunk_key: int, num_groups: int = 1) -> int:
    """The token a chunk key was made at (its chunk's last token, or a partial tail's
    boundary minus one): the inverse of `key` for the data's truth (`spec.model.truth`)."""
    return (chunk_key // num_groups) % 1000 - 1


def chunk_label(chunk_key: int, groups: tuple[str, ...]) -> str:
    """A chunk key in words, the inverse of `key`: `f<family> t<token> <group kind>` (the
    prompt family, the chunk's last token, the group's kind), e.g. `f0 t1 full`."""
    block_hash, group = divmod(chunk_key, len(groups))
    family, position = divmod(block_hash - 1, 1000)
    return f"f{family} t{position} {groups[group]}"


def block_key(family: int, block: int, tokens_per_block: int, group: int = 0,
              num_groups: int = 1) -> int:
    """The key of block `block` of a prompt of `family`: the hash at the block's last token
    (what an implementation's block hash `block` maps back to)."""
    return key(family, (block + 1) * tokens_per_block - 1, group, num_groups)


@dataclass(frozen=True)
class Bounds:
    """What the environment may do; the state space is finite under these bounds."""

    requests: int = 2
    tokens: int = 2
    shared_prefix: bool = True
    workers: int = 2
    cpu_chunks: int = 2
    gpu_blocks: int = 4
    resets: int = 1
    failures: int = 1
    preemptions: int = 1
    timeout_steps: int | None = None
    sync_loads: bool = False
    partial_reports: bool = True
    families: int | None = None
    """Distinct prompt prefixes (request i has family i % families); None: from
    shared_prefix (one family, or one per request)."""
    stray_reports: bool = False
    """Also send a report for a stale job that already drained (a confused worker)."""
    groups: tuple[GroupKind, ...] = ("full",)
    """The KV cache groups, in vLLM's group order: "full" attention (prefix lookup, blocks
    held until the request ends), "sliding" window (suffix-window lookup; the core frees its
    blocks before the window while the request runs) or "mamba" in align mode (one state
    per request, looked up as a one-chunk window, stored from the core's hand-offs)."""
    sliding_window: int = 2
    """Tokens a sliding-window group attends to (the window of its last token)."""
    blocks_per_chunk: int = 1
    tokens_per_block: int = 1
    """Tokens per GPU block (vLLM's block size, in the model's tokens): above 1, a step can
    end inside a block, and a hit, a store or a hand-off only ever covers whole blocks."""
    request_settings: tuple[RequestSettings, ...] = ()
    """Request i's settings (`max_load_tokens`, `max_offload_tokens`,
    `skip_reading_prefix_cache`); requests past the tuple's end have none."""
    store_threshold: int = 1
    """Store admission (vLLM's `store_threshold`, M:129-148, M:266-291): a chunk is stored
    only once offered this many times (1: every chunk); what counts as an offer is
    `rules.store_admission`."""
    partial_tails: bool = False
    """Partial-tail stores and lookups (vLLM's `supports_partial_tail`, S:274-292): a hash
    per token, finer than a block, so the core commits a Mamba state at the prompt's last
    hash boundary inside a block (token `tokens - 1`), copies it on write and hands it off;
    the connector stores it with the full-attention block the boundary falls in under the
    boundary's keys, and a lookup that finds them hits up to the boundary. vLLM allows it
    with one block per chunk, a Mamba group whose blocks are above one hash, and no sliding
    window."""

    decode_tokens: int = 0
    """Tokens each request generates after its prompt (vLLM's output tokens, in the model's
    tokens): once its prompt is computed, a running request is scheduled one token a step,
    each step's token sampled from the last, until it holds this many; a preempted request
    recomputes them with its prompt. Their keys are the request's own (`Template.block_key`).
    0: prompts only. Beside a Mamba group the core commits and hands off the state of each
    block the output completes, as in the prefill (SPEC.md, "Decoding")."""

    offload_prompt_only: bool = False
    """vLLM's `offload_prompt_only` (B:729-730, S:769-770): stores stop at the prompt's end,
    so no output token of a decoding request is ever offloaded. vLLM's default is on; the
    model's is off, the setting under which a decoding request also stores its output (the
    states a decoding request adds); conformance gives vLLM the bound's value. Without
    `decode_tokens` it changes nothing (a prompt-only request stores only its prompt)."""

    retention_interval: int | None = None
    """Which window blocks are kept for reuse (vLLM's `prefix_cache_retention_interval`, in
    the model's tokens): None, every chunk's window tail (dense); 0, only the tail at the
    replay boundary (vLLM's default); a multiple of the chunk, one tail per interval besides.
    It selects a sliding-window group's stored blocks (`spec.groups.reachable_store_blocks`)
    and the Mamba states the core hands off (`spec.groups.state_retained`)."""

    rules: Rules = VLLM_0_33
    """The rules on which vLLM releases differ (`spec.rules`): 0.33.0's, or a later
    release's."""

    def __post_init__(self) -> None:
        if not isinstance(self.rules, Rules):
            raise ValueError(f"rules must be a spec.rules.Rules, got {self.rules!r}")
        if not self.groups or any(g not in GROUP_KINDS for g in self.groups):
            raise ValueError(f"groups must be of {GROUP_KINDS}, got {self.groups!r}")
        if min(self.blocks_per_chunk, self.tokens_per_block, self.sliding_window,
               self.store_threshold) < 1:
            raise ValueError("blocks_per_chunk, tokens_per_block, sliding_window and "
                             "store_threshold must be >= 1")
        if self.partial_tails and (self.blocks_per_chunk != 1 or self.tokens_per_block < 2
                                   or "mamba" not in self.groups
                                   or "sliding" in self.groups):
            raise ValueError("partial_tails needs blocks_per_chunk 1, tokens_per_block >= 2, "
                             "a mamba group and no sliding group (vLLM's "
                             "supports_partial_tail, S:274-292)")
        if self.decode_tokens < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {self.decode_tokens!r}")
        r = self.retention_interval
        if not retention_interval_ok(r, self.tokens_per_chunk) or \
                (r is not None and not self.window_groups()):
            raise ValueError(f"retention_interval must be None, or 0 or a multiple of the "
                             f"chunk ({self.tokens_per_chunk} tokens) beside a sliding or "
                             f"mamba group (S:295-310), got {r!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.blocks_per_chunk * self.tokens_per_block

    @property
    def tokens_per_hash(self) -> int:
        """Tokens per block hash (vLLM's hash block size): a block's, or one token with
        partial tails (vLLM's `prefix_match_unit` finer than a block)."""
        return 1 if self.partial_tails else self.tokens_per_block

    @property
    def hybrid(self) -> bool:
        """Beyond the first model: several groups, chunks of several blocks or blocks of
        several tokens."""
        return len(self.groups) > 1 or self.groups != ("full",) or self.tokens_per_chunk > 1

    def blocks_of(self, tokens: int) -> int:
        """The blocks a group needs for `tokens` tokens (the last one may be partial)."""
        return cdiv(tokens, self.tokens_per_block)

    def gpu_blocks_floor(self) -> int:
        """The fewest GPU blocks under which a request can finish. The core admits a request
        with blocks for every token it holds: its whole prompt in each full-attention group,
        at least one block in each window group. A decoding request may stop after any
        token, so its output adds nothing unless a preemption restarts it: re-admitted, it
        holds its output too, all but the last of its `decode_tokens` (a request that
        sampled its last token finishes: `World.sampled_last`). With fewer blocks no
        request ever leaves the core and a check reports P-4: a bound too small, not a
        fault. Exact for full-attention groups alone; a lower bound beside a window
        group."""
        full = sum(1 for kind in self.groups if kind not in WINDOW_KINDS)
        held = self.tokens + (max(0, self.decode_tokens - 1) if self.preemptions else 0)
        return full * self.blocks_of(held) + len(self.window_groups())

    def window_groups(self) -> tuple[int, ...]:
        """The groups looked up by a suffix-window scan (sliding window and Mamba)."""
        return tuple(g for g, kind in enumerate(self.groups) if kind in WINDOW_KINDS)

    def rules_in_play(self) -> tuple[str, ...]:
        """The `spec.rules.Rules` fields whose value can change a run within these bounds;
        the others are moot here: store admission counts no offer under a threshold of 1,
        the last token is cut short only beside a window group, a partial tail is searched
        only with partial tails, and an async load fails after a reset made it stale only
        with a failure, a reset and async loads (under `sync_loads` every load is sync)."""
        moot = {"store_admission": self.store_threshold <= 1,
                "last_token_cut": not self.window_groups(),
                "partial_tail_search": not self.partial_tails,
                "stale_load_failure": (self.failures == 0 or self.resets == 0
                                       or self.sync_loads)}
        return tuple(f.name for f in fields(Rules) if not moot.get(f.name, False))

    def handoff_groups(self) -> tuple[int, ...]:
        """The groups stored only from the core's boundary-state hand-offs (Mamba)."""
        return tuple(g for g, kind in enumerate(self.groups) if kind in HANDOFF_KINDS)

    def _window(self, g: int) -> int | None:
        return self.sliding_window if self.groups[g] == "sliding" else None

    def window_chunks(self, g: int) -> int:
        return group_window_chunks(self.groups[g], self._window(g), self.tokens_per_chunk)

    def load_window_chunks(self, g: int, end_tokens: int) -> int:
        return group_load_window_chunks(self.groups[g], self._window(g),
                                        self.tokens_per_chunk, end_tokens)

    def reachable_blocks(self, g: int, prompt_tokens: int, start_block: int,
                         end_block: int, short_hits: bool = True
                         ) -> tuple[bool, ...] | None:
        """The blocks of group `g` a store may need among `start_block <= i < end_block`
        of a request of `prompt_tokens` tokens; None: all (every group but a sliding
        window keeps every block). `short_hits=False`: vLLM's mask (finding F4)."""
        if self.groups[g] != "sliding":
            return None
        return reachable_store_blocks(self.sliding_window, self.tokens_per_block,
                                      self.blocks_per_chunk, self.retention_interval,
                                      reachable_boundaries(prompt_tokens), start_block,
                                      end_block,
                                      self.rules.last_token_cut if short_hits else None)

    def skipped_blocks(self, g: int, computed: int) -> int:
        return group_skipped_blocks(self.groups[g], self._window(g), self.tokens_per_block,
                                    computed)

    def freed_positions(self, length: int, computed: int) -> Iterator[int]:
        """The positions of a flat table of `length` blocks the core frees once `computed`
        tokens are computed (the window groups' positions before their window)."""
        return freed_positions(self.groups, self.sliding_window, self.tokens_per_block, length,
                               computed)

    def tail_boundary(self, tokens: int) -> int | None:
        """The partial tail a prompt of `tokens` tokens makes: its last hash boundary before
        the last token (vLLM: `get_mamba_prefill_checkpoint_position`, at a hash per token),
        when it falls inside a block; None without partial tails or on a block edge."""
        boundary = tokens - 1
        if not self.partial_tails or boundary <= 0 or boundary % self.tokens_per_block == 0:
            return None
        return boundary

    def template(self, req_id: str) -> Template:
        """Request `req_id`'s template."""
        t = self._templates_by_id.get(req_id)
        if t is None:
            raise ModelError(f"no request template {req_id!r}")
        return t

    def templates(self) -> tuple[Template, ...]:
        return self._templates

    # -- built once per bounds: a frozen dataclass keeps a cached property in its instance
    # dict, outside eq; every state of a search hashes its bounds, and the model asks for a
    # template at every hook. A copy or a pickle leaves them behind (a string's hash differs
    # from one interpreter to the next).
    _CACHED: ClassVar[tuple[str, ...]] = ("_hash", "_templates", "_templates_by_id")

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._CACHED}

    @cached_property
    def _templates_by_id(self) -> dict[str, Template]:
        return {t.req_id: t for t in self._templates}

    @cached_property
    def _templates(self) -> tuple[Template, ...]:
        def family(i: int) -> int:
            if self.families is not None:
                return i % self.families
            return 0 if self.shared_prefix else i

        def settings(i: int) -> RequestSettings:
            return self.request_settings[i] if i < len(self.request_settings) else NO_SETTINGS

        return tuple(Template(f"r{i}", family(i), self.tokens, settings(i),
                              self.decode_tokens, OUTPUT_FAMILY + i)
                     for i in range(self.requests))


# ============================================================================ records
class MReq(NamedTuple):
    id: str
    state: str = R.ABSENT
    jobs: frozenset[int] = frozenset()
    finished: bool = False
    signaled: bool = False
    load_invalid: bool = False
    hit: int | None = None
    sync_reserved: bool = False
    blocks: tuple[int, ...] = ()
    cursor: int = 0
    local: int = 0
    kv_load: int | None = None
    """The sync load the request's KV depends on, until its next restart."""
    window_end: int = 0
    """With a sliding-window group: the tokens computed once its last scheduled step ran
    (the core frees the window group's blocks before that window); 0 otherwise."""
    load_failed: bool = False
    """`Rules.failed_load_lookup` FOR_LIFE: a load of this request failed or timed out, so
    no later lookup of it asks the manager (vLLM 0.34's `load_failed`)."""
    counted: frozenset[int] = frozenset()
    """Store admission per request (`Rules.store_admission` PER_REQUEST, with a store
    threshold): the keys this request's offers counted in the current cache generation
    (a reset empties it)."""


class MJob(NamedTuple):
    id: int
    kind: Literal["load", "store"]
    owner: str
    state: str = J.UNALLOCATED
    pending: int = 0
    sync: bool = False
    failed: bool = False
    keys: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    deferred: frozenset[int] = frozenset()
    fenced: frozenset[int] = frozenset()
    """Source blocks fenced from the job's creation on (sliding-window groups)."""
    age: int | None = None
    flush_requested: bool = False
    flush_shipped: bool = False
    held_slots: int = 0
    unreported: int = 0
    """The environment's truth: workers that have not reported this job yet (the scheduler's
    `pending` should equal it; a fault in the accounting makes them differ)."""
    bad: bool = False
    """The data's truth (`spec.model.truth`): what this job copies is invalid (a store of KV
    a failed load produced, a copy a worker failed; a load of a chunk holding such KV)."""


class MCore(NamedTuple):
    """The core scheduler's view of one request."""

    status: CoreStatus = "waiting"
    computed: int = 0
    blocks: tuple[int, ...] = ()
    aborted: bool = False
    loading: int = 0
    """Tokens an async load brings (WAITING_FOR_REMOTE_KVS)."""
    kv_bad: bool = False
    """The data's truth: the request's KV on the GPU holds data a failed, timed-out or
    invalid load produced (until the core restarts it from token zero)."""
    recv_failed: bool = False
    """`Rules.stale_load_failure` FENCE_ONLY: a worker named the request in
    `failed_recving` for the async load it waits for (WAITING_FOR_REMOTE_KVS), so the core
    recomputes it when that load's last report comes instead of promoting it. Under the
    spec's own rule the connector tells the core (RECOMPUTE) and this stays False."""
    load_job: int | None = None
    """The load that fills its blocks since the core last (re)started it."""
    generated: int = 0
    """Output tokens sampled so far (vLLM: `len(request.output_token_ids)`); a restart
    keeps them."""
    promoted: bool = False
    """Waiting after its async load ended, and the core's waiting loop already reached it:
    the loaded blocks are cached and their state handed off (`_update_waiting_for_remote_kv`,
    CS:3467-3535); its admission hands off nothing more."""

    def restarted(self) -> MCore:
        """The request back to waiting from token zero (a preemption, a failed or timed-out
        load): its blocks freed by the caller, its KV to recompute, its output tokens kept
        (vLLM restarts a request over prompt and output alike)."""
        return MCore("waiting", generated=self.generated)


@dataclass(frozen=True)
class ModelState:
    bounds: Bounds
    reqs: tuple[MReq, ...] = ()
    jobs: tuple[MJob, ...] = ()
    held: tuple[MJob, ...] = ()
    """Jobs out of the table still due reports: STALE (fence) or TIMED_OUT (quarantine)."""
    counter: int = 0
    threshold: int = 0
    fence_state: str = F.FENCE_IDLE
    chunks: tuple[tuple[int, int], ...] = ()
    being_loaded: frozenset[int] = frozenset()
    block_fence: tuple[tuple[int, frozenset[int]], ...] = ()
    to_flush: frozenset[int] = frozenset()
    reset_since_step: bool = False
    signals: tuple[tuple[str, int], ...] = ()
    quarantined_blocks: tuple[tuple[int, tuple[int, ...]], ...] = ()
    core: tuple[tuple[str, MCore], ...] = ()
    pending_finished: frozenset[str] = frozenset()
    pending_preempted: frozenset[str] = frozenset()
    free_blocks: frozenset[int] = frozenset()
    budget: tuple[int, int, int] = (0, 0, 0)
    """Environment events used so far: resets, failures, preemptions."""
    stores_after_signal: tuple[str, ...] = ()
    bad_chunks: frozenset[int] = frozenset()
    """The data's truth: chunk keys the manager holds whose content is invalid (INV-20)."""
    offers: tuple[tuple[int, int], ...] = ()
    """Store admission: how often each key was offered, counted up to the threshold (only
    with `store_threshold >= 2`; a reset keeps them)."""
    misplaced: frozenset[int] = frozenset()
    """The data's truth: the chunk keys some job copied from or to a block at another
    position than the chunk's own (INV-22)."""
    partial: tuple[tuple[int, frozenset[int]], ...] = ()
    """The data's truth: chunks the manager holds that a store wrote only in part, with the
    offsets (block within the chunk) it wrote."""
    unwritten: frozenset[int] = frozenset()
    """The data's truth: chunk keys some load read a block of that no store wrote
    (INV-23)."""

    def tier(self) -> tuple[str, ...]:
        """What the CPU tier holds: each chunk by its `chunk_label`, `writing` after one a
        store has not completed, sorted (what a directed program pins at its end)."""
        groups = self.bounds.groups
        return tuple(sorted(chunk_label(c, groups) + (" writing" if ref < 0 else "")
                            for c, ref in self.chunks))


# ============================================================================ the world
class ModelError(Exception):
    """The model hit something the spec forbids: a trigger with no row (or no guard
    combination) in the subject's state, a manager contract broken. A finding."""


class NotEnabled(ModelError):
    """The environment cannot send this event in this state (not a finding)."""


@dataclass
class World:
    """A mutable working copy of a ModelState for the duration of one event."""

    bounds: Bounds
    reqs: dict[str, MReq]
    jobs: dict[int, MJob]
    held: dict[int, MJob]
    counter: int
    threshold: int
    fence_state: str
    chunks: dict[int, int]
    being_loaded: set[int]
    block_fence: dict[int, frozenset[int]]
    to_flush: set[int]
    reset_since_step: bool
    signals: dict[str, int]
    quarantined_blocks: dict[int, tuple[int, ...]]
    core: dict[str, MCore]
    pending_finished: set[str]
    pending_preempted: set[str]
    free_blocks: set[int]
    budget: list[int]
    faults: Faults = NO_FAULTS
    """Faults switched on (the mutant catalogue); none for the spec itself."""
    tables: Tables = field(default_factory=_spec_tables)
    """The tables the interpreter runs on (the spec's, or a mutated copy)."""
    step_open: bool = False
    batch_jobs: set[int] = field(default_factory=set)
    batch_loads: set[int] = field(default_factory=set)
    batch_alloc: set[int] = field(default_factory=set)
    preempted_early: set[str] = field(default_factory=set)
    stores_after_signal: list[str] = field(default_factory=list)
    bad_chunks: set[int] = field(default_factory=set)
    offers: dict[int, int] = field(default_factory=dict)
    misplaced: set[int] = field(default_factory=set)
    partial: dict[int, frozenset[int]] = field(default_factory=dict)
    unwritten: set[int] = field(default_factory=set)
    short_hit: bool = False
    """The last lookup's hit ends one token short of a block (a window group's last-token
    rule): the core then allocates a window group as if one token less were computed."""
    full_attention_hit: int | None = None
    """The last lookup's hit boundary as the full-attention groups left it, before the
    first window group narrowed it (0 without a full-attention group or when one deferred;
    None when the lookup ended before a window group): where a partial tail is searched
    from under `PartialTailSearch.FROM_FULL_ATTENTION_PREFIX`."""
    fired: list[tuple[str, int]] = field(default_factory=list)
    """(machine, transition index) of every row fired: the coverage."""
    moves: list[tuple[str, Any, str, str, str]] = field(default_factory=list)
    """(machine, subject, source, destination, trigger) of every row fired, in order."""

    @classmethod
    def thaw(cls, s: ModelState) -> World:
        return cls(s.bounds, {r.id: r for r in s.reqs}, {j.id: j for j in s.jobs},
                   {j.id: j for j in s.held}, s.counter, s.threshold, s.fence_state,
                   dict(s.chunks), set(s.being_loaded), dict(s.block_fence), set(s.to_flush),
                   s.reset_since_step, dict(s.signals), dict(s.quarantined_blocks),
                   dict(s.core), set(s.pending_finished), set(s.pending_preempted),
                   set(s.free_blocks), list(s.budget),
                   stores_after_signal=list(s.stores_after_signal),
                   bad_chunks=set(s.bad_chunks), offers=dict(s.offers),
                   misplaced=set(s.misplaced), partial=dict(s.partial),
                   unwritten=set(s.unwritten))

    def freeze(self) -> ModelState:
        return ModelState(
            self.bounds, tuple(self.reqs[k] for k in sorted(self.reqs)),
            tuple(self.jobs[k] for k in sorted(self.jobs)),
            tuple(self.held[k] for k in sorted(self.held)), self.counter,
            self.threshold, self.fence_state, tuple(sorted(self.chunks.items())),
            frozenset(self.being_loaded),
            tuple(sorted((b, ids) for b, ids in self.block_fence.items() if ids)),
            frozenset(self.to_flush), self.reset_since_step, tuple(sorted(self.signals.items())),
            tuple(sorted(self.quarantined_blocks.items())), tuple(sorted(self.core.items())),
            frozenset(self.pending_finished), frozenset(self.pending_preempted),
            frozenset(self.free_blocks), (self.budget[0], self.budget[1], self.budget[2]),
            tuple(sorted(self.stores_after_signal)),
            frozenset(self.bad_chunks & self.chunks.keys()), tuple(sorted(self.offers.items())),
            frozenset(self.misplaced),
            tuple(sorted((k, v) for k, v in self.partial.items() if k in self.chunks)),
            frozenset(self.unwritten))

    # -- subjects by machine ------------------------------------------------------
    def get(self, machine: str, k: Any) -> Any:
        if machine == "request":
            return self.reqs.get(k, MReq(k))
        if machine == "job":
            found = self.jobs.get(k) or self.held.get(k)
            if found is None and self.pending_new is not None and self.pending_new.id == k:
                return self.pending_new
            return found
        return self.fence_state

    def put(self, machine: str, subject: Any) -> None:
        if machine == "request":
            if subject.state != R.ABSENT or subject.id in self.reqs:
                self.reqs[subject.id] = subject  # delete_request_status removes it
        elif machine == "job":
            put_job(self, subject)

    def template(self, req_id: str) -> Template:
        return self.bounds.template(req_id)

    def num_tokens(self, req_id: str) -> int:
        """The request's tokens, its prompt and the output sampled so far (vLLM:
        `request.num_tokens`)."""
        c = self.core.get(req_id)
        return self.template(req_id).tokens + (c.generated if c is not None else 0)

    def tokens_to_compute(self, req_id: str) -> int:
        """Where the core stops scheduling the request: every token it holds, but the last
        sampled one once it generated all its `decode_tokens` (vLLM would finish it there,
        and never computes a finished request's last token)."""
        return self.num_tokens(req_id) - self.sampled_last(req_id)

    def sampled_last(self, req_id: str) -> bool:
        """The request sampled its last output token (all its `decode_tokens`): vLLM
        finishes it as it samples (`update_from_output`), so until the model's `finish`
        the core neither computes that token nor preempts the request."""
        c, t = self.core[req_id], self.template(req_id)
        return t.decode_tokens > 0 and c.generated >= t.decode_tokens

    def may_finish(self, req_id: str) -> bool:
        """The request can stop (a stop token or its length): it runs, its prompt is
        computed, and so is every token but its last sampled one (vLLM stops a request only
        as it samples)."""
        c = self.core[req_id]
        return c.status == "running" and \
            c.computed >= max(self.template(req_id).tokens, self.num_tokens(req_id) - 1)

    def sample(self, req_id: str) -> None:
        """After a step: a request that computed every token it holds samples the next one,
        until it generated its `decode_tokens` (vLLM's `update_from_output`)."""
        c = self.core[req_id]
        if c.computed == self.num_tokens(req_id) and \
                c.generated < self.template(req_id).decode_tokens:
            self.core[req_id] = c._replace(generated=c.generated + 1)

    def keys_of(self, req_id: str, group: int = 0) -> list[int]:
        """The chunk keys of group `group` of the request: one per full chunk of its tokens
        (the prompt's, then the output's)."""
        t, b = self.template(req_id), self.bounds
        bpc = b.blocks_per_chunk
        return [t.block_key((c + 1) * bpc - 1, b.tokens_per_block, group, len(b.groups))
                for c in range(self.num_tokens(req_id) // b.tokens_per_chunk)]

    def extend_table(self, blocks: tuple[int, ...], new: tuple[int, ...]) -> tuple[int, ...]:
        """A flat table (group by group) with `new` (as many blocks per group) appended to
        each group's part."""
        if not new:
            return blocks
        n = len(self.bounds.groups)
        old = split_groups(blocks, n) if blocks else tuple(() for _ in range(n))
        return tuple(x for o, a in zip(old, split_groups(new, n), strict=True) for x in (*o, *a))

    def tail_key(self, req_id: str, boundary: int, group: int) -> int:
        """The key of group `group`'s partial tail at `boundary` (vLLM's
        `_make_boundary_key`, S:1056-1066: the hash at the boundary's last token)."""
        b = self.bounds
        return key(self.template(req_id).family, boundary - 1, group, len(b.groups))

    def group_blocks(self, blocks: tuple[int, ...], group: int) -> tuple[int, ...]:
        """Group `group`'s part of a flat block table (as many blocks per group)."""
        return split_groups(blocks, len(self.bounds.groups))[group] if blocks else ()

    keep_inside: bool = False
    inside: list[tuple[Call, AbstractState]] = field(default_factory=list)
    """With `apply(..., inside=True)`: (hook call, abstract state) at each hook that returns
    inside a step (lookup, allocation), before the step's build_connector_meta."""
    pending_new: MJob | None = None
    last_job: int = -1
    """The id of the job that entered the table last."""
    victim_choice: tuple[int, ...] | None = None
    """Eviction victims to take (an implementation's observed choice); default: lowest keys."""

    def choose_victims(self, evictable: list[int], need: int) -> list[int]:
        if self.victim_choice is None:
            return evictable[:need]
        chosen = [c for c in self.victim_choice if c in evictable][:need]
        if len(chosen) != need:
            raise ModelError(f"eviction of {self.victim_choice} is not allowed: evictable "
                             f"{evictable}, need {need}")
        return chosen


# ============================================================================ subjects
def tracked(w: World, k: str) -> MReq:
    r = w.reqs.get(k)
    if r is None:
        raise ModelError(f"request {k!r} is not tracked")
    return r


def put_req(w: World, r: MReq) -> None:
    w.reqs[r.id] = r


def job_of(w: World, k: int) -> MJob:
    j = w.jobs.get(k) or w.held.get(k) or (w.pending_new if w.pending_new
                                            and w.pending_new.id == k else None)
    if j is None:
        raise ModelError(f"job {k} unknown")
    return j


def put_job(w: World, j: MJob) -> None:
    if j.id in w.jobs:
        w.jobs[j.id] = j
    elif j.id in w.held:
        w.held[j.id] = j
    else:
        w.pending_new = j
