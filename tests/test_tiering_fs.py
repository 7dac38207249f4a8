"""The filesystem tier (statemachine.tiering.fs_tier): atomic publication, content addressing,
corrupt and leftover files, a full disk, and a process killed mid-write."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spec.tiering import tier_copy as TC
from statemachine.manager import LookupResult
from statemachine.tiering.fs_tier import FilesystemTier, key_name, name_key
from statemachine.tiering.io import BytearrayBuffer
from statemachine.tiering.tiers import JobResult, TransferJob

SLOT = 64
REPO = Path(__file__).resolve().parents[1]


def data(key: int, size: int = SLOT) -> bytes:
    """A copy's bytes: a pure function of its key."""
    block = hashlib.sha256(str(key).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def _tier(root: Path, slots: int = 4, **kwargs: object) -> tuple[FilesystemTier,
                                                                     BytearrayBuffer]:
    buf = BytearrayBuffer(slots, SLOT)
    return FilesystemTier(root, buf, **kwargs), buf  # type: ignore[arg-type]


def _cascade(tier: FilesystemTier, buf: BytearrayBuffer, job_id: int,
             keys: list[int]) -> JobResult:
    """Copy `keys` (slots 0, 1, ...) into the tier; the job's result."""
    for slot, key in enumerate(keys):
        buf.write(slot, data(key))
    tier.submit_store(TransferJob(job_id, tuple(keys), tuple(range(len(keys))), False, "r"))
    tier.run_io()
    (result,) = tier.get_finished_jobs()
    return result


def _promote(tier: FilesystemTier, buf: BytearrayBuffer, job_id: int,
             keys: list[int]) -> JobResult:
    tier.submit_load(TransferJob(job_id, tuple(keys), tuple(range(len(keys))), True, "r"))
    tier.run_io()
    (result,) = tier.get_finished_jobs()
    return result


def test_names_are_reversible_and_fanned_out(tmp_path: Path) -> None:
    tier, _ = _tier(tmp_path)
    for key in (0, 1, -1, 255, 2**63 - 1, -(2**63)):
        assert name_key(key_name(key)) == key
        path = tier.path(key)
        assert path.parent.name == key_name(key)[-2:] and path.suffix == ".bin"


def test_a_copy_is_published_atomically(tmp_path: Path) -> None:
    seen: list[tuple[bool, list[Path]]] = []

    class Watched(FilesystemTier):
        def _write_all(self, fd: int, payload: bytes) -> None:
            super()._write_all(fd, payload[: len(payload) // 2])
            # half written: the final name does not exist, only a temporary file does
            seen.append((self.has_copy(7), self.temporaries()))
            assert self.lookup(7, "r") is LookupResult.MISS
            super()._write_all(fd, payload[len(payload) // 2:])

    buf = BytearrayBuffer(1, SLOT)
    tier = Watched(tmp_path, buf)
    assert _cascade(tier, buf, 0, [7]) == JobResult(0, True)
    ((published_mid_write, temps),) = seen
    assert not published_mid_write
    assert len(temps) == 1 and temps[0].name.startswith(tier.path(7).name)
    assert temps[0].parent == tier.path(7).parent and temps[0].suffix == ".tmp"
    assert tier.path(7).read_bytes() == data(7) and tier.temporaries() == []
    assert tier.lookup(7, "r") is LookupResult.HIT
    assert tier.copy_states() == {7: TC.STORED}


def test_a_copy_is_fsynced_before_the_rename(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    tier, buf = _tier(tmp_path)
    _cascade(tier, buf, 0, [1])
    assert calls == ["fsync", "replace"]


def test_an_existing_copy_is_not_written_again(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path)
    assert _cascade(tier, buf, 0, [1, 2]).success
    inode = tier.path(1).stat().st_ino
    buf.write(0, bytes(SLOT))                        # other bytes under the same key
    assert _cascade(tier, buf, 1, [1, 3]).success
    assert tier.path(1).stat().st_ino == inode and tier.path(1).read_bytes() == data(1)
    assert tier.stats["copies_written"] == 3


def test_a_promotion_reads_the_copies_back(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path)
    _cascade(tier, buf, 0, [1, 2])
    fresh, fresh_buf = _tier(tmp_path)               # another process, same directory
    assert _promote(fresh, fresh_buf, 5, [2, 1]) == JobResult(5, True)
    assert [fresh_buf.read(0), fresh_buf.read(1)] == [data(2), data(1)]


def test_a_short_file_fails_the_read_and_is_removed(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path)
    _cascade(tier, buf, 0, [1, 2, 3])
    tier.path(2).write_bytes(data(2)[:10])           # truncated
    result = _promote(tier, buf, 1, [1, 2, 3])
    assert result == JobResult(1, False, (1,))       # the copy before the bad one is kept
    assert not tier.path(2).exists() and tier.stats["corrupt_removed"] == 1
    assert tier.lookup(2, "r") is LookupResult.MISS
    assert tier.path(3).exists()                     # untouched: the batch stopped at 2


def test_a_missing_file_fails_the_read_and_removes_nothing(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path)
    _cascade(tier, buf, 0, [1])
    assert _promote(tier, buf, 1, [9, 1]) == JobResult(1, False, None)
    assert tier.path(1).exists()


def test_leftover_temporary_files_are_removed_and_never_served(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path)
    _cascade(tier, buf, 0, [1])
    # what a killed writer leaves: a complete-looking temporary file of key 4
    final = tier.path(4)
    final.parent.mkdir(exist_ok=True)
    tmp = final.with_name(final.name + ".0123456789abcdef.tmp")
    tmp.write_bytes(data(4))
    assert tier.lookup(4, "r") is LookupResult.MISS and 4 not in tier.stored_keys()
    reopened, _ = _tier(tmp_path)
    assert reopened.temporaries_removed == 1 and not tmp.exists()
    assert reopened.stored_keys() == {1}


def test_a_full_tier_refuses_the_copies_that_do_not_fit(tmp_path: Path) -> None:
    tier, buf = _tier(tmp_path, capacity=2)
    _cascade(tier, buf, 0, [1])
    for slot, key in enumerate([2, 3]):
        buf.write(slot, data(key))
    tier.submit_store(TransferJob(1, (2, 3), (0, 1), False, "r"))
    assert tier.copy_states() == {1: TC.STORED, 2: TC.WRITING}  # 3 refused: stays absent
    tier.run_io()
    assert tier.get_finished_jobs() == [JobResult(1, False)]    # ENOSPC at key 3
    assert tier.stored_keys() == {1, 2} and tier.stats["refused"] == 1
    assert tier.check_consistency() == [] and tier.temporaries() == []
    reopened, _ = _tier(tmp_path, capacity=2)
    assert reopened._num_stored() == 2                           # counted on open


def test_an_io_error_removes_the_temporary_file(tmp_path: Path) -> None:
    class Failing(FilesystemTier):
        def _write_all(self, fd: int, payload: bytes) -> None:
            super()._write_all(fd, payload[:5])
            raise OSError(28, "No space left on device")

    buf = BytearrayBuffer(1, SLOT)
    tier = Failing(tmp_path, buf)
    assert _cascade(tier, buf, 0, [1]) == JobResult(0, False)
    assert tier.temporaries() == [] and tier.stored_keys() == set()
    assert tier.copy_states() == {}


# ------------------------------------------------------------------ kill -9 mid-write
CHILD = r"""
import hashlib, sys, time
from statemachine.tiering.fs_tier import FilesystemTier
from statemachine.tiering.io import BytearrayBuffer
from statemachine.tiering.tiers import TransferJob

root, size, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def data(key):
    block = hashlib.sha256(str(key).encode()).digest()
    return (block * (size // len(block) + 1))[:size]

key_of = {data(k)[:32]: k for k in range(10 * pause_at)}

class Paused(FilesystemTier):
    def _write_all(self, fd, payload):
        super()._write_all(fd, payload[: len(payload) // 2])
        if key_of[bytes(payload[:32])] == pause_at:
            print(f"writing {pause_at}", flush=True)
            time.sleep(3600)                  # killed here, half written
        super()._write_all(fd, payload[len(payload) // 2:])

buf = BytearrayBuffer(4, size)
tier = Paused(root, buf, threads=2)
job = 0
for first in range(0, 10 * pause_at, 4):
    keys = list(range(first, first + 4))
    for slot, key in enumerate(keys):
        buf.write(slot, data(key))
    tier.submit_store(TransferJob(job, tuple(keys[:2]), (0, 1), False, "r"))
    tier.submit_store(TransferJob(job + 1, tuple(keys[2:]), (2, 3), False, "r"))
    job += 2
    tier.run_io()                             # both jobs done before the slots are reused
    print(f"wrote {first}..{first + 3}", flush=True)
"""


def test_a_process_killed_mid_write_leaves_only_complete_copies(tmp_path: Path) -> None:
    size, pause_at = 1 << 20, 9
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(size),
                             str(pause_at)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not (line := proc.stdout.readline()).startswith("writing"):
            assert line, f"the writer exited early: {lines}"
            lines.append(line)
        assert line == f"writing {pause_at}\n"
        assert lines == ["wrote 0..3\n", "wrote 4..7\n"]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    # Counted only once the writer is dead: its other thread may still be writing key 10 or
    # 11 while key 9 is paused, so a count taken before the kill can miss a temporary.
    in_flight = sorted(tmp_path.glob("*/*.tmp"))
    assert any(p.name.startswith(f"{key_name(pause_at)}.") for p in in_flight), \
        f"key {pause_at}'s half-written temporary file is there: {in_flight}"
    buf = BytearrayBuffer(1, size)
    tier = FilesystemTier(tmp_path, buf)
    assert tier.temporaries_removed == len(in_flight) and tier.temporaries() == []
    stored = tier.stored_keys()
    assert set(range(8)) <= stored                     # the finished rounds
    assert pause_at not in stored                      # the torn copy was never published
    assert tier.lookup(pause_at, "r") is LookupResult.MISS
    for n, key in enumerate(sorted(stored)):
        tier.submit_load(TransferJob(n, (key,), (0,), True, "r"))
        tier.run_io()
        assert tier.get_finished_jobs() == [JobResult(n, True)]
        assert buf.read(0) == data(key, size), f"key {key} read back other bytes"
