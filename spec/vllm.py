"""The vLLM source the spec cites: which file each abbreviation names, and how a citation is
written, resolved and linked.

A citation is ``ABBR:first-last`` (or ``ABBR:line``): lines of one file of the vLLM repository
at tag v0.33.0 (the tag's files are the files of the 0.33.0 wheel). ``S:1247-1252`` is
`vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`, lines 1247 to 1252.
Tables, docstrings and comments write the short form; SPEC.md and CONFORMANCE.md render each
as a link to the tagged file, and `make conformance` checks that every citation in the
repository names a file of the installed vLLM and lines within it.

A citation of another release names it: ``S@0.26.0:1345`` is line 1345 of the same file at
tag v0.26.0 (the release tables of CONFORMANCE.md and `conformance/releases.py` cite so). It
links to that tag, and `make conformance VLLM_VERSION=0.26.0` is the run that checks it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

TAG = "v0.33.0"
REPOSITORY = "https://github.com/vllm-project/vllm"

_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector"
_OFFLOAD = "vllm/v1/kv_offload"

FILES: dict[str, str] = {
    "S": f"{_CONNECTOR}/v1/offloading/scheduler.py",
    "C": f"{_CONNECTOR}/v1/offloading/common.py",
    "W": f"{_CONNECTOR}/v1/offloading/worker.py",
    "OCF": f"{_CONNECTOR}/v1/offloading/config.py",
    "OC": f"{_CONNECTOR}/v1/offloading_connector.py",
    "KB": f"{_CONNECTOR}/v1/base.py",
    "KU": f"{_CONNECTOR}/utils.py",
    "B": f"{_OFFLOAD}/base.py",
    "M": f"{_OFFLOAD}/cpu/manager.py",
    "PB": f"{_OFFLOAD}/cpu/policies/base.py",
    "LRU": f"{_OFFLOAD}/cpu/policies/lru.py",
    "ARC": f"{_OFFLOAD}/cpu/policies/arc.py",
    "GW": f"{_OFFLOAD}/cpu/gpu_worker.py",
    "TK": f"{_OFFLOAD}/cpu/swap_blocks_triton.py",
    "SP": f"{_OFFLOAD}/cpu/spec.py",
    "CC": f"{_OFFLOAD}/cpu/common.py",
    "SR": f"{_OFFLOAD}/cpu/shared_offload_region.py",
    "TM": f"{_OFFLOAD}/tiering/manager.py",
    "TB": f"{_OFFLOAD}/tiering/base.py",
    "TF": f"{_OFFLOAD}/tiering/fs/manager.py",
    "TIO": f"{_OFFLOAD}/tiering/fs/io.py",
    "TP": f"{_OFFLOAD}/tiering/fs/thread_pool.py",
    "TAL": f"{_OFFLOAD}/tiering/async_lookup.py",
    "TEX": f"{_OFFLOAD}/tiering/example/manager.py",
    "TS": f"{_OFFLOAD}/tiering/spec.py",
    "CO": "vllm/_custom_ops.py",
    "CS": "vllm/v1/core/sched/scheduler.py",
    "MX": "vllm/v1/worker/kv_connector_model_runner_mixin.py",
    "GMR": "vllm/v1/worker/gpu_model_runner.py",
    "SO": "vllm/v1/core/sched/output.py",
    "KCI": "vllm/v1/kv_cache_interface.py",
    "CFG": "vllm/config/cache.py",
}
"""Abbreviation -> path in the vLLM repository (at `TAG`)."""

RELEASE = TAG.removeprefix("v")
"""The release the unqualified citations are of."""

CITATION = re.compile(r"(?<![\w/.\-])(" + "|".join(sorted(FILES, key=len, reverse=True))
                      + r")(?:@(\d+\.\d+\.\d+))?:(\d+)(?:-(\d+))?(?![\w])")
"""A citation in text: ``S:1247-1252``, ``CS:3177``, ``S@0.25.1:1231``."""


@dataclass(frozen=True)
class Citation:
    abbr: str
    first: int
    last: int
    release: str = RELEASE

    @property
    def path(self) -> str:
        return FILES[self.abbr]

    @property
    def text(self) -> str:
        lines = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        at = "" if self.release == RELEASE else f"@{self.release}"
        return f"{self.abbr}{at}:{lines}"

    @property
    def url(self) -> str:
        anchor = f"L{self.first}" if self.first == self.last else f"L{self.first}-L{self.last}"
        return f"{REPOSITORY}/blob/v{self.release}/{self.path}#{anchor}"

    def link(self) -> str:
        """Markdown: the short form, linked to the lines at the tag."""
        return f"[{self.text}]({self.url})"


def _citation(m: re.Match[str]) -> Citation:
    first = int(m.group(3))
    return Citation(m.group(1), first, int(m.group(4) or first), m.group(2) or RELEASE)


def citations(text: str) -> Iterator[Citation]:
    for m in CITATION.finditer(text):
        yield _citation(m)


def linkify(markdown: str) -> str:
    """Every bare citation of `markdown` as a link (citations already linked are kept)."""
    out, pos = [], 0
    for m in CITATION.finditer(markdown):
        before = markdown[max(0, m.start() - 1):m.start()]
        after = markdown[m.end():m.end() + 2]
        if before == "[" and after.startswith("]("):
            continue  # already the text of a link
        out += [markdown[pos:m.start()], _citation(m).link()]
        pos = m.end()
    out.append(markdown[pos:])
    return "".join(out)


def legend() -> str:
    """A markdown table of the abbreviations and the files they name."""
    rows = ["| abbreviation | file at vLLM " + TAG + " |", "|---|---|"]
    rows += [f"| `{a}` | [`{p}`]({REPOSITORY}/blob/{TAG}/{p}) |" for a, p in FILES.items()]
    return "\n".join(rows)
