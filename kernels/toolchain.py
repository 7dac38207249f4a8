"""Building a small C library on first use: the system compiler, a per-user cache, atomic
installs. Standard library only (no torch), so any layer may use it.

A library is built from C sources held in memory, named by a hash of the sources, the
compiler and the flags, and cached under ``~/.cache/kvoffload-spec`` (``XDG_CACHE_HOME``, or
``KVSPEC_NATIVE_CACHE``). Concurrent builders never see half a file: each builds in a private
directory and renames the result into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path


class ToolchainError(RuntimeError):
    """The build failed (the message carries the compiler's own)."""


class NoCompiler(ToolchainError):
    """No C compiler on PATH."""


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc, gcc or clang on PATH; None without one."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    explicit = os.environ.get("KVSPEC_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvoffload-spec"


def library_path(stem: str, sources: Mapping[str, str], flags: Sequence[str]) -> Path | None:
    """Where the library of these sources lives (or would), None without a compiler."""
    cc = compiler()
    if cc is None:
        return None
    h = hashlib.sha256(cc.encode() + " ".join(flags).encode())
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return cache_dir() / f"{stem}_{h.hexdigest()[:16]}.so"


def build(stem: str, sources: Mapping[str, str], flags: Sequence[str],
          timeout: float = 300.0) -> Path:
    """The path of the shared library of `sources` (file name -> text; the `.c` files are
    compiled together, the others are headers beside them), building it if needed."""
    cc = compiler()
    path = library_path(stem, sources, flags)
    if cc is None or path is None:
        raise NoCompiler("no C compiler (cc, gcc or clang) on PATH")
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        units = []
        for name, text in sources.items():
            (Path(tmp) / name).write_text(text)
            if name.endswith(".c"):
                units.append(str(Path(tmp) / name))
        out = Path(tmp) / path.name
        try:
            subprocess.run([cc, *flags, "-o", str(out), *units], check=True,
                           capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise ToolchainError(detail.strip()[:2000]) from exc
        os.replace(out, path)
    return path
