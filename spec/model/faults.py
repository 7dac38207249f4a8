"""The faults the abstract model can switch on: one name each, for the model and for the
mutant catalogue (`statemachine.mutants`), which ties each to the vLLM change it stands for.

A fault is an enum member, so a misspelt name fails where it is written, at import."""

from __future__ import annotations

from enum import StrEnum


class Fault(StrEnum):
    RESET_KEEPS_TRANSFER_JOBS = "reset-keeps-transfer-jobs"
    RESET_SKIPS_FLUSH = "reset-skips-flush"
    RESET_KEEPS_STALE_THRESHOLD = "reset-keeps-stale-threshold"
    RESET_SIGNALS_TWICE = "reset-signals-twice"
    AGGREGATE_COUNTS_ONCE = "aggregate-counts-once"
    STORE_READY_ON_FIRST_ACK = "store-ready-on-first-ack"
    PREEMPT_SKIPS_FLUSH = "preempt-skips-flush"
    REALLOC_SKIPS_FENCE = "realloc-skips-fence"
    LOOKUP_IGNORES_TRANSFER_JOBS = "lookup-ignores-transfer-jobs"
    FINISH_SKIPS_DEFERRED_FENCE = "finish-skips-deferred-fence"
    SIGNAL_BEFORE_FINAL_STORE = "signal-before-final-store"
    COMPLETE_LOAD_KEEPS_PIN = "complete-load-keeps-pin"
    LOAD_KEEPS_CHUNKS_BEING_LOADED = "load-keeps-chunks-being-loaded"
    EVICT_PINNED_CHUNKS = "evict-pinned-chunks"
    SLIDING_WINDOW_SKIPS_FENCE = "sliding-window-skips-fence"
    RESET_KEEPS_STALE_WINDOW_BLOCKS = "reset-keeps-stale-window-blocks"
    HANDOFF_STORE_SKIPS_FENCE = "handoff-store-skips-fence"
    TAIL_LOAD_ROUNDS_DOWN = "tail-load-rounds-down"
    STORE_MASK_IGNORES_SHORT_HITS = "store-mask-ignores-short-hits"
    STALE_LOAD_FAILURE_IGNORED = "stale-load-failure-ignored"
    STALE_RECVING_PROMOTES = "stale-recving-promotes"


Faults = frozenset[Fault]
NO_FAULTS: Faults = frozenset()
