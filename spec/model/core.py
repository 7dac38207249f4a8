"""The model's core scheduler: the little of vLLM's core the connector's hooks depend on
(`MCore` per request: waiting, running, waiting for a remote load, finished; its GPU blocks;
the free block pool), and how it follows the connector's decisions."""

from __future__ import annotations

from spec import request as R
from spec.groups import NULL_BLOCK
from spec.model.state import World


def free(w: World, blocks: tuple[int, ...]) -> None:
    quarantined = {b for bs in w.quarantined_blocks.values() for b in bs}
    w.free_blocks.update(b for b in blocks if b not in quarantined and b != NULL_BLOCK)


def unquarantine(w: World, job_id: int) -> None:
    """A timed-out load's quarantine ends (its late reports came, or its reset fence
    drained): its destination blocks go back to the pool, except those the core still holds
    (it frees them itself, now unquarantined)."""
    blocks = w.quarantined_blocks.pop(job_id, ())
    held = {b for c in w.core.values() for b in c.blocks}
    w.free_blocks.update(b for b in blocks if b not in held and b != NULL_BLOCK)


def follow_connector(w: World) -> None:
    """The core's reaction to what the connector decided: an async load ended (the request
    waits with its loaded tokens, unless a worker named it in `failed_recving`:
    `MCore.recv_failed`), failed or timed out (recompute from scratch), a sync load
    failed under a running request (preempt it), an aborted load ended (free its blocks)."""
    for r, c in list(w.core.items()):
        req = w.reqs.get(r)
        state = req.state if req is not None else R.ABSENT
        if c.status == "remote":
            if state == R.IDLE and not c.recv_failed:
                w.core[r] = c._replace(status="waiting", computed=c.loading, loading=0)
            elif state in R.MUST_RECOMPUTE or state == R.IDLE:  # or the worker said it failed
                free(w, c.blocks)
                w.core[r] = c.restarted()
        elif c.status == "running":
            if state in R.PREEMPTED_IF_RUNNING:
                free(w, c.blocks)
                w.core[r] = c.restarted()
        elif c.status == "finished" and c.blocks:
            loading = req is not None and any(
                w.jobs[j].kind == "load" for j in req.jobs if j in w.jobs)
            if not loading:
                free(w, c.blocks)
                w.core[r] = c._replace(blocks=())
