"""The filesystem tier: one file per copy under a root directory (vLLM's FileSystemTierManager,
TF:86-353, with its I/O TIO:90-226).

Names. A key's file is ``<root>/<ff>/<hex>.bin``: ``<hex>`` is the key as signed big-endian
bytes in hex (so a name gives its key back), ``<ff>`` its last two hex digits, a fan-out
directory that keeps directories small (TF:13, TF:174-180).

Publishing. A copy is written to a temporary file next to its final name,
``<hex>.bin.<random>.tmp``, opened with O_EXCL, written in full, fsync'ed, then renamed over
the final name with `os.replace` (TIO:90-138). The rename is atomic, so a reader sees either
no file or the complete one, even when the writer is killed mid-write; only the temporary
file can be left behind. A copy that exists is never written again (TIO:98-100; names are
content addresses). On any error the temporary file is removed and nothing is published
(TIO:133-138).

Reading. A file shorter (or longer) than a slot is corrupt: it is removed and the read fails
(TIO:141-171); a missing file fails the read and removes nothing.

Opening. Temporary files left by a killed process are removed when a tier opens the
directory; they are never looked up, since no key's name ends in ``.tmp``.

Capacity (beyond vLLM, a full disk): see `statemachine.tiering.tiers`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from statemachine.policies import OffloadKey
from statemachine.tiering.io import PrimaryBuffer
from statemachine.tiering.tiers import SecondaryTier

SUFFIX = ".bin"
TEMP_SUFFIX = ".tmp"


def key_name(key: OffloadKey) -> str:
    """The hex name of a key (reversible, see `name_key`)."""
    return key.to_bytes((key.bit_length() + 8) // 8, "big", signed=True).hex()


def name_key(name: str) -> OffloadKey:
    return int.from_bytes(bytes.fromhex(name), "big", signed=True)


class FilesystemTier(SecondaryTier):
    """Copies as files under `root` (created if missing)."""

    kind = "fs"

    def __init__(self, root: str | os.PathLike[str], buffer: PrimaryBuffer, *,
                 capacity: int | None = None, threads: int = 0, async_lookup: bool = False,
                 marks_present: bool = False, fsync: bool = True, name: str = "") -> None:
        super().__init__(buffer, capacity=capacity, threads=threads,
                         async_lookup=async_lookup, marks_present=marks_present, name=name)
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self.temporaries_removed = self._remove_temporaries()
        self._count = len(self.stored_keys())

    def path(self, key: OffloadKey) -> Path:
        name = key_name(key)
        return self.root / name[-2:] / f"{name}{SUFFIX}"

    def _remove_temporaries(self) -> int:
        removed = 0
        for tmp in self.root.glob(f"*/*{TEMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed += 1
        return removed

    # ------------------------------------------------------------------ storage
    def has_copy(self, key: OffloadKey) -> bool:
        return self.path(key).is_file()

    def stored_keys(self) -> set[OffloadKey]:
        keys: set[OffloadKey] = set()
        for p in self.root.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(ValueError):   # not a name this tier gives
                keys.add(name_key(p.name[:-len(SUFFIX)]))
        return keys

    def _num_stored(self) -> int:
        return self._count

    def _publish(self, key: OffloadKey, data: bytes) -> None:
        final = self.path(key)
        if final.exists():
            return
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f"{final.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                self._write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if final.exists():      # another writer won the race: the same bytes
                tmp.unlink()
                return
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        with self._mu:
            self._count += 1

    def _write_all(self, fd: int, data: bytes) -> None:
        """Write every byte of `data` to the temporary file `fd`."""
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            if written <= 0:
                raise OSError(errno.EIO, "write made no progress")
            view = view[written:]

    def _fetch(self, key: OffloadKey) -> bytes:
        path = self.path(key)
        want = self.buffer.slot_bytes
        with open(path, "rb") as f:
            data = f.read(want + 1)
        if len(data) != want:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                with self._mu:
                    self._count -= 1
            self.stats["corrupt_removed"] += 1
            raise OSError(errno.EIO, f"{path}: {len(data)} bytes, a copy holds {want}")
        return data

    def temporaries(self) -> list[Path]:
        """Temporary files now in the directory (writes in progress, or left by a crash)."""
        return sorted(self.root.glob(f"*/*{TEMP_SUFFIX}"))


__all__ = ["FilesystemTier", "key_name", "name_key"]
