"""Tiering: the reference tiering manager (vLLM's `vllm/v1/kv_offload/tiering/`), its
secondary tiers, its projection onto `spec.tiering.TieringState`, and the `TieringSystem`
protocol the model-based and conformance tests drive."""
