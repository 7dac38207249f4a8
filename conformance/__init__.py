"""Conformance: the project's model-based tests driving vLLM's own scheduler-side connector.

`conformance.vllm_env` builds vLLM's real `OffloadingConnector` (scheduler role, the CPU
offloading spec and `CPUOffloadingManager`) from real config objects on a CPU-only machine;
`conformance.adapter` plugs it into `statemachine.testing.OffloadingStateMachine`;
`conformance.projection` reads its live fields as a `spec.AbstractState`.

Nothing here imports vLLM when the package is imported: the submodules import it on first
use, so the package can be imported (and skipped) where vLLM is not installed.
"""

from __future__ import annotations

__all__ = ["adapter", "projection", "vllm_env"]
