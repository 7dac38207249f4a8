"""Every citation of vLLM in the repository (tables, code, documents) names a file of the
installed vLLM and lines within it: on 0.33.0 the plain citations (``S:1247``, the files of
tag v0.33.0), on another release those that name it (``S@0.26.0:1345``). `make
conformance-all` runs it on every release, so each citation is checked by its own release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spec import vllm

pytestmark = pytest.mark.conformance
ROOT = Path(__file__).resolve().parents[2]


def _files() -> list[Path]:
    return sorted(p for top in ("spec", "statemachine", "kernels", "conformance", "bench",
                                "tests", "scripts")
                  for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md", ".sh")) + \
        sorted(ROOT.glob("*.md"))


def test_every_citation_names_lines_of_a_file_of_the_installed_vllm(vllm_ready: Any) -> None:
    release = ".".join(str(n) for n in vllm_ready.vllm_version()[:3])
    base = Path(vllm_ready.vllm_file()).parent.parent
    lengths: dict[str, int] = {}
    checked, bad = 0, []
    for path in _files():
        for c in vllm.citations(path.read_text()):
            if c.release != release:
                continue
            if c.path not in lengths:
                f = base / c.path
                lengths[c.path] = len(f.read_text().splitlines()) if f.exists() else -1
            n = lengths[c.path]
            checked += 1
            if n < 0:
                bad.append(f"{path.relative_to(ROOT)}: {c.text}: no file {c.path}")
            elif not 1 <= c.first <= c.last <= n:
                bad.append(f"{path.relative_to(ROOT)}: {c.text}: {c.path} has {n} lines")
    print(f"{checked} citations of {release} in {len(_files())} files checked against {base}")
    if release == vllm.RELEASE:
        assert checked > 300
    elif checked == 0:
        pytest.skip(f"nothing cites vLLM {release}")
    assert bad == []

