"""The connector's configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from statemachine.errors import ConfigError


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
    sync_load_budget_bytes: int = 0
    """Per-step budget for synchronous loads; 0 makes every load asynchronous."""
    kv_bytes_per_token: int = 0
    job_timeout_steps: int | None = None
    """Beyond vLLM: a job not reported by every worker this many steps after it was shipped
    times out. None: no timeout (vLLM 0.33.0)."""
    offload_prompt_only: bool = False
    check_invariants: bool = True
    """Check every invariant of `spec` after every hook (on in tests; off for speed)."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"OffloadingConfig: {what}")

        for name in ("block_size", "blocks_per_chunk", "num_workers", "num_cpu_chunks"):
            value = getattr(self, name)
            need(type(value) is int and value >= 1,
                 f"{name} must be an int >= 1, got {value!r}")
        need(self.eviction_policy in ("lru", "arc"),
             f"eviction_policy must be 'lru' or 'arc', got {self.eviction_policy!r}")
        for name in ("sync_load_budget_bytes", "kv_bytes_per_token"):
            value = getattr(self, name)
            need(type(value) is int and value >= 0, f"{name} must be an int >= 0, got {value!r}")
        need(self.sync_load_budget_bytes == 0 or self.kv_bytes_per_token > 0,
             "sync_load_budget_bytes needs kv_bytes_per_token > 0")
        need(self.job_timeout_steps is None
             or (type(self.job_timeout_steps) is int and self.job_timeout_steps >= 1),
             f"job_timeout_steps must be None or an int >= 1, got {self.job_timeout_steps!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk
