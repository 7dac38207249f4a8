"""Conformance tests: the project's machine against vLLM's own scheduler-side connector.

They need vLLM (make conformance builds `.venv-vllm`); without it every test here is
skipped. The report header names the vLLM under test and where it was imported from, so a
`VLLM_SRC=path make conformance` run shows which source tree it tested.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not HAVE_VLLM:
        return ["vllm: not importable (conformance tests skipped)"]
    from conformance import vllm_env
    from conformance.adapter import HYBRID_VLLM_BOUNDS, VLLMMachine

    def show(b: Any) -> str:
        groups = "+".join(b.groups)
        window = f" window {b.sliding_window}" if "sliding" in b.groups else ""
        settings = (", request settings " + "+".join(x.text() for x in b.request_settings)
                    if b.request_settings else "")
        if b.store_threshold > 1:
            settings += f", store threshold {b.store_threshold}"
        if b.partial_tails:
            settings += f", partial tails (boundary {b.tail_boundary(b.tokens)})"
        if b.retention_interval is not None:
            settings += f", retention interval {b.retention_interval}"
        block = f"{b.tokens_per_block} tokens/block, " if b.tokens_per_block > 1 else ""
        return (f"{b.requests}x{b.tokens} tokens, {groups}{window}, {block}"
                f"{b.blocks_per_chunk} block(s)/chunk, {b.workers} worker(s){settings}")

    return [f"vllm: {'.'.join(map(str, vllm_env.vllm_version()))} "
            f"from {vllm_env.vllm_file()}",
            "machine bounds: " + "; ".join(show(b) for b in VLLMMachine.bounds_choices),
            "hybrid bounds (block size 16): "
            + "; ".join(show(b) for b in HYBRID_VLLM_BOUNDS)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vllm is not importable (make conformance builds a venv)")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_ready() -> Any:
    """Import vLLM and build the cached ModelConfig once (about 20 s)."""
    from conformance import vllm_env

    vllm_env.make_setup(num_gpu_blocks=4, num_cpu_chunks=2)
    return vllm_env
