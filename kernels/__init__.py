"""Batched KV-cache block copies between GPU blocks and CPU chunks (vLLM's offloading layout).

A standalone layer: it knows tensors, layouts and transfer jobs, nothing of the spec or the
state machine. ``layout`` describes tensors and jobs, ``copy`` issues a job's batched copies,
``engine`` runs jobs asynchronously (CUDA streams, or a CPU stand-in with the same API).
``descriptors`` turns a job into (destination, source, bytes) triples, which ``cudriver``
hands to the CUDA driver's ``cuMemcpyBatchAsync`` in one call (vLLM's own op) and ``native``
copies on the host.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.copy import (
        CopyPolicy,
        RowMapping,
        Strategy,
        choose_strategy,
        copy_blocks_to_chunks,
        copy_chunks_to_blocks,
    )
    from kernels.engine import CopyEngine, CopyResult, Direction, KernelStateError
    from kernels.layout import (
        KernelSpecError,
        KVLayout,
        Segment,
        TransferSpec,
        allocate_cpu_kv,
        allocate_gpu_kv,
        block_rows,
    )

_HOME = {
    "kernels.copy": ("CopyPolicy", "RowMapping", "Strategy", "choose_strategy",
                     "copy_blocks_to_chunks", "copy_chunks_to_blocks"),
    "kernels.engine": ("CopyEngine", "CopyResult", "Direction", "KernelStateError"),
    "kernels.layout": ("KernelSpecError", "KVLayout", "Segment", "TransferSpec", "allocate_cpu_kv",
                       "allocate_gpu_kv", "block_rows"),
}
_WHERE = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str) -> Any:
    """The package's names, imported on first use: `import kernels.toolchain` (the C build
    helper) costs no torch import."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CopyEngine",
    "CopyPolicy",
    "CopyResult",
    "Direction",
    "KVLayout",
    "KernelSpecError",
    "KernelStateError",
    "RowMapping",
    "Segment",
    "Strategy",
    "TransferSpec",
    "allocate_cpu_kv",
    "allocate_gpu_kv",
    "block_rows",
    "choose_strategy",
    "copy_blocks_to_chunks",
    "copy_chunks_to_blocks",
]
