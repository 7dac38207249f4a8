"""The data's truth: which KV is invalid, which the spec does not see but must never publish.

The connector knows a load failed only when a worker says so, and reacts through its rows
(the request's `load_invalid`, poisoned stores, RECOMPUTE). The model also keeps what is
really true of the bytes, as the engine's byte oracle does on the real tensors:

- a request's KV on the GPU is invalid (`MCore.kv_bad`) once the load that filled its blocks
  fails, times out, or read an invalid chunk, until the core restarts it from token zero;
- a job's copy is invalid (`MJob.bad`): a store of invalid KV, a store or load a worker
  failed, a load of an invalid chunk;
- a chunk was copied from or to the wrong place (`ModelState.misplaced`) when a job moved it
  from or to a block at another table position than the one its key stands for (INV-22);
- a chunk the manager holds is invalid (`ModelState.bad_chunks`) when a store whose copy was
  invalid published it;
- a chunk was written only in part (`ModelState.partial`) when its store copied only some of
  its blocks (a sliding window's leading blocks the core had freed), and a load read a block
  no store wrote (`ModelState.unwritten`, INV-23).

INV-20 (`valid-kv-published`) is stated over it: no chunk the manager holds ready is invalid.
The tables cannot change these facts except through the data they move, so a table edit
that lets invalid KV through (a dropped `mark_load_invalid` or `poison_request_stores`, a
failed store completed as a good one) is caught by the checker, not only by the byte oracle.
"""

from __future__ import annotations

from collections.abc import Iterable

from spec.model.state import MJob, World, key_position


def _taint_owner(w: World, j: MJob) -> None:
    """Load `j` produced invalid data: its request's KV is invalid if it still depends on
    it, and so is every store of that request in flight (they copy KV computed on it)."""
    c = w.core.get(j.owner)
    if c is None or c.load_job != j.id:
        return  # the core restarted the request since: nothing of it depends on `j`
    w.core[j.owner] = c._replace(kv_bad=True)
    for jid, s in list(w.jobs.items()):
        if s.owner == j.owner and s.kind == "store":
            w.jobs[jid] = s._replace(bad=True)


def failed_copy(w: World, jid: int) -> None:
    """A worker reported a failure for job `jid`, or it timed out (its data never
    confirmed): what it copied is invalid."""
    j = w.jobs.get(jid) or w.held.get(jid)
    if j is None:
        return
    for table in (w.jobs, w.held):
        if jid in table:
            table[jid] = table[jid]._replace(bad=True)
    if j.kind == "load":
        _taint_owner(w, j)


def new_job(w: World, j: MJob) -> MJob:
    """A job entering the table copies invalid data if its source is: a store of a request
    whose KV is invalid, a load of an invalid chunk."""
    if j.kind == "store":
        c = w.core.get(j.owner)
        return j._replace(bad=bool(c is not None and c.kv_bad))
    return j._replace(bad=any(k in w.bad_chunks for k in j.keys))


def published(w: World, j: MJob, keys: list[int]) -> None:
    """Store `j` made `keys` ready in the manager: they hold what it copied."""
    for k in keys:
        if j.bad:
            w.bad_chunks.add(k)
        else:
            w.bad_chunks.discard(k)


def loaded(w: World, j: MJob) -> None:
    """Load `j` ended: an invalid copy leaves its request's KV invalid."""
    if j.bad:
        _taint_owner(w, j)


def placed(w: World, placements: Iterable[tuple[int, int]]) -> None:
    """A job copies each chunk `key` of `placements` from or to the block at table position
    `position` of the chunk's group (the position of the chunk's last block it copies): the
    chunk's own position is that of the block its key's token falls in (a chunk key: its
    last block; a partial tail's key: the block its boundary falls in). Any other is
    misplaced (INV-22)."""
    b = w.bounds
    for chunk_key, position in placements:
        token = key_position(chunk_key, len(b.groups))
        if position // b.blocks_per_chunk != token // b.tokens_per_chunk:
            w.misplaced.add(chunk_key)


def written(w: World, blocks: Iterable[tuple[int, frozenset[int]]]) -> None:
    """A store copies into each chunk `key` the blocks at `offsets` within it: all of them,
    or (a partial chunk) only those."""
    full = frozenset(range(w.bounds.blocks_per_chunk))
    for key, offsets in blocks:
        if offsets == full:
            w.partial.pop(key, None)
        else:
            w.partial[key] = offsets


def read(w: World, blocks: Iterable[tuple[int, frozenset[int]]]) -> None:
    """A load copies from each chunk `key` the blocks at `offsets` within it: reading one
    its store did not write is reading bytes nobody put there (INV-23)."""
    for key, offsets in blocks:
        if not offsets <= w.partial.get(key, offsets):
            w.unwritten.add(key)
