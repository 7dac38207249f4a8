"""The connector's configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.groups import (
    GROUP_KINDS,
    HANDOFF_KINDS,
    WINDOW_KINDS,
    GroupKind,
    group_load_window_chunks,
    group_skipped_blocks,
    group_window_chunks,
    reachable_boundaries,
    reachable_store_blocks,
    retention_interval_ok,
)
from spec.rules import VLLM_0_33, Rules
from statemachine.errors import ConfigError
from statemachine.policies import POLICY_NAMES


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group of the model (vLLM: a `KVCacheGroupSpec` the connector offloads):
    full attention, a sliding window, or Mamba in align mode."""

    kind: GroupKind = "full"
    sliding_window: int | None = None
    """Tokens a sliding-window group attends to; None for full attention."""


@dataclass(frozen=True)
class KVCacheModel:
    """A model's KV cache as the data plane sees it: its groups, and each group's KV bytes
    per token and layer (so each group has pages of its own size)."""

    groups: tuple[KVCacheGroup, ...]
    bytes_per_token: tuple[int, ...]


KV_CACHE_MODELS: dict[str, KVCacheModel] = {
    "full": KVCacheModel((KVCacheGroup(),), (4,)),
    "hybrid": KVCacheModel((KVCacheGroup(), KVCacheGroup("sliding", sliding_window=40)),
                           (4, 2)),
    "mamba": KVCacheModel((KVCacheGroup(), KVCacheGroup("mamba")), (4, 12)),
}
"""The models `kvspec simulate --model` runs. `hybrid`: full attention beside a 40-token
sliding window (2.5 blocks of 16 tokens, so its loads start inside a chunk) with pages half
the size, in the order vLLM lists such groups. `mamba`: full attention beside a Mamba group
in align mode, whose state page is three times an attention page (a Mamba group's
`bytes_per_token` only sizes its page: block size times it); its one-block states fill the
last block of their chunk."""


TIER_KINDS = ("memory", "fs")
"""The secondary tiers a `TieringConfig` may stack below the CPU tier."""


@dataclass(frozen=True)
class TieringConfig:
    """Secondary tiers below the CPU tier (vLLM's `TieringOffloadingManager`, TM:207-1305):
    with one, the connector's manager is a `statemachine.tiering.connector`
    `ConnectorTieringManager` in place of the CPU manager. GPU stores cascade from the CPU
    tier to every tier; a lookup that misses the CPU tier promotes from the first tier
    that holds the chunk."""

    tiers: tuple[str, ...] = ("fs",)
    """The tiers, in lookup order: "memory" (vLLM's example tier, TEX:51-205) or "fs" (its
    filesystem tier, TF:86-353)."""
    root: str | None = None
    """The directory the "fs" tiers write under (tier i in ``<root>/tier<i>``); None: a
    temporary directory the manager removes when it shuts down."""
    capacity: int | None = None
    """Copies each tier holds at most (beyond vLLM: a full disk); None: unbounded."""
    job_timeout_steps: int | None = None
    """Beyond vLLM: a tier job still running this many steps after it was submitted times
    out (`TieringManager.tier_job_timeout_steps`); None: no timeout."""
    threads: int = 0
    """I/O threads per tier; 0: the deterministic executor (a tier's I/O runs when the
    engine lets it, once per step)."""
    async_lookup: bool | None = None
    """Tier lookups as existence probes answered a step later (RETRY until then), as vLLM's
    filesystem tier does (TF:215-220); None: on for "fs" tiers, off for "memory" ones."""
    protect_scanned_keys: bool = True
    """A promotion does not evict the chunks its request's lookup hit in the same step
    (`TieringManager.protect_scanned_keys`); False: vLLM's promotions, which protect only
    the promoted chunk (TM:713) and can defer a request forever (finding T1)."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"TieringConfig: {what}")

        need(type(self.tiers) is tuple and len(self.tiers) >= 1
             and all(k in TIER_KINDS for k in self.tiers),
             f"tiers must be a non-empty tuple of {TIER_KINDS}, got {self.tiers!r}")
        need(self.root is None or isinstance(self.root, str),
             f"root must be None or a path string, got {self.root!r}")
        need(self.capacity is None or (type(self.capacity) is int and self.capacity >= 0),
             f"capacity must be None or an int >= 0, got {self.capacity!r}")
        need(self.job_timeout_steps is None
             or (type(self.job_timeout_steps) is int and self.job_timeout_steps >= 1),
             f"job_timeout_steps must be None or an int >= 1, got {self.job_timeout_steps!r}")
        need(type(self.threads) is int and self.threads >= 0,
             f"threads must be an int >= 0, got {self.threads!r}")
        need(self.async_lookup is None or type(self.async_lookup) is bool,
             f"async_lookup must be None or a bool, got {self.async_lookup!r}")
        need(type(self.protect_scanned_keys) is bool,
             f"protect_scanned_keys must be a bool, got {self.protect_scanned_keys!r}")

    def async_lookup_of(self, kind: str) -> bool:
        return self.async_lookup if self.async_lookup is not None else kind == "fs"


@dataclass(frozen=True)
class OffloadingConfig:
    block_size: int = 16
    """Tokens per GPU block."""
    blocks_per_chunk: int = 1
    """GPU blocks per CPU chunk (vLLM: offloaded block size / GPU block size)."""
    num_workers: int = 1
    """Workers (tensor-parallel ranks) that must each report every job."""
    num_cpu_chunks: int = 64
    eviction_policy: str = "lru"
    """The CPU tier's eviction policy, one of `statemachine.policies.POLICY_NAMES`."""
    sync_load_budget_bytes: int = 0
    """Per-step budget for synchronous loads; 0 makes every load asynchronous."""
    kv_bytes_per_token: int = 0
    job_timeout_steps: int | None = None
    """Beyond vLLM: a job not reported by every worker this many steps after it was shipped
    times out. None: no timeout (vLLM 0.33.0)."""
    offload_prompt_only: bool = False
    """Stores stop at the prompt's end: a decoding request's output is never offloaded
    (vLLM's `offload_prompt_only`, S:769-770). vLLM's default is True (B:729-730); ours is
    False, as the model's (`spec.model.Bounds.offload_prompt_only`): set it to match vLLM."""
    store_threshold: int = 1
    """Store admission (vLLM's `store_threshold` extra config): a chunk is stored only once
    it was offered this many times; 1 (or 0 in vLLM's config) stores every chunk."""
    groups: tuple[KVCacheGroup, ...] = field(default=(KVCacheGroup(),))
    """The KV cache groups, in vLLM's group order (all of `block_size` tokens per block)."""
    tokens_per_hash: int | None = None
    """Tokens per block hash (vLLM's hash block size, `prefix_match_unit`): the request's
    `block_hashes` hold one hash per this many tokens; it divides `block_size`. None: one
    hash per block. Below the block size with a Mamba group, partial tails are on
    (`supports_partial_tail`)."""
    retention_interval: int | None = None
    """Which window blocks are kept for reuse (vLLM's `prefix_cache_retention_interval`,
    tokens): None, every chunk's window tail (dense); 0, only the tail at the replay
    boundary (vLLM's default); a multiple of the chunk, one tail per interval besides
    (`spec.groups.reachable_store_blocks`). The core reads it too: it hands off only the
    Mamba states it keeps (`spec.groups.state_retained`)."""
    rules: Rules = VLLM_0_33
    """The rules on which vLLM releases differ (`spec.rules`): 0.33.0's, or a later
    release's (`spec.rules.VLLM_0_34`)."""
    check_invariants: bool = True
    """Check every invariant of `spec` after every hook (on in tests; off for speed)."""
    tiering: TieringConfig | None = None
    """Secondary tiers below the CPU tier; None: the CPU tier alone (the CPU manager)."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"OffloadingConfig: {what}")

        for name in ("block_size", "blocks_per_chunk", "num_workers", "num_cpu_chunks",
                     "store_threshold"):
            value = getattr(self, name)
            need(type(value) is int and value >= 1,
                 f"{name} must be an int >= 1, got {value!r}")
        need(self.eviction_policy in POLICY_NAMES,
             f"eviction_policy must be one of {', '.join(map(repr, POLICY_NAMES))}, got "
             f"{self.eviction_policy!r}")
        for name in ("sync_load_budget_bytes", "kv_bytes_per_token"):
            value = getattr(self, name)
            need(type(value) is int and value >= 0, f"{name} must be an int >= 0, got {value!r}")
        need(self.sync_load_budget_bytes == 0 or self.kv_bytes_per_token > 0,
             "sync_load_budget_bytes needs kv_bytes_per_token > 0")
        need(type(self.groups) is tuple and len(self.groups) >= 1
             and all(isinstance(g, KVCacheGroup) for g in self.groups),
             f"groups must be a non-empty tuple of KVCacheGroup, got {self.groups!r}")
        for i, g in enumerate(self.groups):
            need(g.kind in GROUP_KINDS, f"group {i}: kind must be one of {GROUP_KINDS}, "
                 f"got {g.kind!r}")
            if g.kind == "sliding":
                need(type(g.sliding_window) is int and g.sliding_window >= 1,
                     f"group {i}: a sliding-window group needs sliding_window >= 1 tokens, "
                     f"got {g.sliding_window!r}")
            else:
                need(g.sliding_window is None,
                     f"group {i}: a {g.kind} group has no sliding_window")
        need(self.tokens_per_hash is None
             or (type(self.tokens_per_hash) is int and self.tokens_per_hash >= 1
                 and self.block_size % self.tokens_per_hash == 0),
             f"tokens_per_hash must be None or an int >= 1 dividing block_size "
             f"{self.block_size}, got {self.tokens_per_hash!r}")
        need(retention_interval_ok(self.retention_interval, self.tokens_per_chunk),
             f"retention_interval must be None, or 0 or a multiple of tokens_per_chunk "
             f"({self.tokens_per_chunk}) (S:295-310), got {self.retention_interval!r}")
        need(self.job_timeout_steps is None
             or (type(self.job_timeout_steps) is int and self.job_timeout_steps >= 1),
             f"job_timeout_steps must be None or an int >= 1, got {self.job_timeout_steps!r}")
        need(isinstance(self.rules, Rules),
             f"rules must be a spec.rules.Rules, got {self.rules!r}")
        need(self.tiering is None or isinstance(self.tiering, TieringConfig),
             f"tiering must be None or a TieringConfig, got {self.tiering!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def hash_unit(self) -> int:
        """Tokens per block hash."""
        return self.tokens_per_hash or self.block_size

    @property
    def hashes_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.hash_unit

    @property
    def supports_partial_tail(self) -> bool:
        """Partial tails are on (vLLM's `supports_partial_tail`, S:274-292): one block per
        chunk, a Mamba group whose blocks span more than one hash, no sliding window."""
        return (self.blocks_per_chunk == 1 and bool(self.handoff_groups)
                and self.block_size > self.hash_unit
                and all(g.kind != "sliding" for g in self.groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def window_groups(self) -> tuple[int, ...]:
        """The groups looked up by a suffix-window scan: sliding windows and Mamba."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind in WINDOW_KINDS)

    @property
    def handoff_groups(self) -> tuple[int, ...]:
        """The groups stored only from the core's boundary-state hand-offs: Mamba."""
        return tuple(i for i, g in enumerate(self.groups) if g.kind in HANDOFF_KINDS)

    def window_chunks(self, group: int) -> int:
        """The run of hit chunks a window group's lookup needs."""
        g = self.groups[group]
        return group_window_chunks(g.kind, g.sliding_window, self.tokens_per_chunk)

    def load_window_chunks(self, group: int, end_tokens: int) -> int:
        """The chunks a hit of a window group ending at `end_tokens` needs."""
        g = self.groups[group]
        return group_load_window_chunks(g.kind, g.sliding_window, self.tokens_per_chunk,
                                        end_tokens)

    def reachable_blocks(self, group: int, prompt_tokens: int, start_block: int,
                         end_block: int, short_hits: bool = True,
                         shared_prefix_boundary: int = 0) -> tuple[bool, ...] | None:
        """The blocks of `group` a store may need among `start_block <= i < end_block` of a
        request of `prompt_tokens` prompt tokens and the shared-prefix junction
        `shared_prefix_boundary` (0: none); None: all (every group but a sliding window
        keeps every block). `short_hits=False`: vLLM's mask (finding F4)."""
        g = self.groups[group]
        if g.kind != "sliding":
            return None
        assert g.sliding_window is not None
        return reachable_store_blocks(g.sliding_window, self.block_size,
                                      self.blocks_per_chunk, self.retention_interval,
                                      reachable_boundaries(prompt_tokens,
                                                           shared_prefix_boundary),
                                      start_block, end_block,
                                      self.rules.last_token_cut if short_hits else None)

    def skipped_blocks(self, group: int, computed: int) -> int:
        """Blocks of `group` before the window once `computed` tokens are computed (the core
        frees them); 0 for a full-attention group."""
        g = self.groups[group]
        return group_skipped_blocks(g.kind, g.sliding_window, self.block_size, computed)
