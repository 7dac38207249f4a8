"""`kvspec simulate --tiers cpu,fs`: the data plane through the tiers (GPU -> CPU -> tier on
every store, tier -> CPU -> GPU by promotions), with tier faults, drains clean and checks
every copy's bytes; a data-plane mutant of the tiering is caught by the byte oracle."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from statemachine import cli, simulate
from statemachine.config import TieringConfig
from statemachine.engine import Engine, EngineConfig
from statemachine.manager import CPUOffloadingManager, ReqContext
from statemachine.simulate import SimConfig
from statemachine.tiering.connector import ConnectorTieringManager
from statemachine.tiering.fs_tier import FilesystemTier
from statemachine.tiering.torch_buffer import WorkerCPUBuffer


def _tiering(result: simulate.SimResult) -> dict[str, Any]:
    t: dict[str, Any] = result.metrics["tiering"]
    return t


@pytest.fixture(scope="module")
def fs_run() -> simulate.SimResult:
    return simulate.run(SimConfig(seed=1, tiers=("fs",)))


def test_cpu_fs_seed_1_promotes_cascades_survives_tier_faults_and_drains_clean(
        fs_run: simulate.SimResult) -> None:
    result, t = fs_run, _tiering(fs_run)
    assert result.ok, (result.error, result.stuck, result.leaks)
    assert (len(result.stuck), result.leaked, result.corrupted) == (0, 0, 0)
    # the tiers' leaks are measured, and zero
    assert {"tier_jobs", "tier_pins", "tier_quarantined_slots", "tier_open_requests",
            "tier_io_pending", "tier_temporary_files",
            "tier_inconsistencies"} <= result.leaks.keys()
    assert t["tiers"] == "cpu,fs" and t["cpu_tier_chunks"] == simulate.TIER_CPU_CHUNKS
    # GPU -> CPU -> files, evicted from the CPU tier, and back through promotions
    assert t["cascades"] > 0 and t["copies_written_verified"] > 0
    assert t["tier_evictions"] > 0 and t["tier_lookup_hits"] > 0
    assert t["promotions"] > 0 and t["promoted_keys"] > 0 and t["lookups_deferred"] > 0
    assert t["promoted_copies_verified"] > 0  # every fs copy checked as it is promoted
    assert t["promoted_loads"] > 0 and t["promoted_blocks_verified"] > 0
    # every kind of tier trouble struck
    assert t["injected_cascade_failures"] > 0 and t["injected_promotion_failures"] > 0
    assert t["cascade_failures"] > 0 and t["promotion_failures"] > 0
    assert t["copies_refused_by_a_full_tier"] > 0 and t["full_tier_windows"] == 1
    assert t["tier_hangs"] == 2 and t["tier_timeouts"] > 0 and t["late_tier_results"] > 0
    assert t["tier_resets"] == result.metrics["resets"] == 3
    assert t["resets_with_a_hung_tier"] == 1 and t["stale_tier_jobs"] > 0
    # the temporary directory is gone
    assert t["tier_dir"] is not None and not Path(t["tier_dir"]).exists()
    text = simulate.render(result)
    assert "--tiers cpu,fs" in text and "PASS" in text
    for row in ("promotions", "cascades", "tier evictions", "tier resets", "tier failures",
                "tier timeouts", "copies checked"):
        assert f"\n{row} " in text


def test_cpu_memory_drains_clean_and_is_a_function_of_the_seed() -> None:
    def numbers() -> dict[str, Any]:
        result = simulate.run(SimConfig(seed=2, tiers=("memory",), steps=120))
        assert result.ok, (result.error, result.stuck, result.leaks)
        out = result.as_dict()
        for timing in ("seconds", "load_gbps", "store_gbps", "steps_per_second"):
            out.pop(timing)
        return out

    first = numbers()
    t = first["tiering"]
    assert t["tiers"] == "cpu,memory" and t["tier_dir"] is None
    assert t["promotions"] > 0 and t["promoted_blocks_verified"] > 0
    assert t["cascades"] > 0 and t["tier_evictions"] > 0
    assert t["injected_tier_failures"] > 0 and t["tier_timeouts"] > 0
    assert t["stale_tier_jobs"] > 0 and t["late_tier_results"] > 0
    assert numbers() == first


def test_two_fs_tiers_with_io_threads_drain_clean() -> None:
    """Real threads run the tiers' I/O as soon as a job is submitted (the engine waits for
    them once per step): the same protocol, concurrently."""
    result = simulate.run(SimConfig(seed=3, tiers=("fs", "fs"), steps=100, tier_threads=2))
    assert result.ok, (result.error, result.stuck, result.leaks)
    t = _tiering(result)
    assert t["tiers"] == "cpu,fs,fs" and t["tier_threads"] == 2
    assert t["cascades"] > 0 and t["promotions"] > 0


# ---------------------------------------------------------------------- data-plane mutants

def _promotion_writes_the_next_slot(mp: pytest.MonkeyPatch) -> None:
    write = WorkerCPUBuffer.write
    mp.setattr(WorkerCPUBuffer, "write", lambda self, slot, data:
               write(self, (slot + 1) % self.num_slots, data))


def _promotion_flips_a_byte(mp: pytest.MonkeyPatch) -> None:
    write = WorkerCPUBuffer.write
    mp.setattr(WorkerCPUBuffer, "write", lambda self, slot, data:
               write(self, slot, bytes([data[0] ^ 0xFF]) + data[1:]))


def _cascade_skips_its_pin(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(CPUOffloadingManager, "prepare_read",
               lambda self, keys, ctx: tuple(self.chunk_id(k) for k in keys))
    mp.setattr(CPUOffloadingManager, "complete_read", lambda self, keys, ctx: None)


def _file_rots(mp: pytest.MonkeyPatch) -> None:
    publish = FilesystemTier._publish
    mp.setattr(FilesystemTier, "_publish", lambda self, key, data:
               publish(self, key, data[:-1] + bytes([data[-1] ^ 1])))


MUTANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    # the promoted bytes land in another slot: the key's slot holds stale bytes
    "promotion-writes-the-next-slot": (_promotion_writes_the_next_slot, "wrong bytes"),
    # the promoted bytes are damaged on their way into the slot: the load of the promoted
    # chunk is checked like every load
    "promotion-flips-a-byte": (_promotion_flips_a_byte, "loaded block of request"),
    # a cascade does not pin its chunk: while the tier hangs the chunk is evicted and its
    # slot reused, and the cascade publishes another chunk's bytes under the key
    "cascade-skips-its-pin": (_cascade_skips_its_pin, "publishes wrong bytes"),
    # a file's last byte rots: the promotion reading it finds it out
    "fs-copy-rots": (_file_rots, "reads key"),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_data_plane_mutant_of_the_tiering_is_caught_by_the_byte_oracle(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every invariant check off, the bytes alone catch each fault."""
    patch, message = MUTANTS[name]
    patch(monkeypatch)
    result = simulate.run(SimConfig(seed=1, tiers=("fs",), check_invariants=False))
    assert not result.ok and result.corrupted >= 1, (result.error, result.leaks)
    assert result.error is not None and message in result.error
    assert "corrupted bytes" in simulate.render(result) and "FAIL" in simulate.render(result)


# ---------------------------------------------------------------------- the CLI

def test_cli_tiers_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--tiers", "cpu,memory", "--steps", "60", "--no-progress",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and (data["stuck_requests"], data["leaked"], data["corrupted_bytes"]) \
        == (0, 0, 0)
    assert data["tiering"]["tiers"] == "cpu,memory" and data["tiering"]["cascades"] > 0


def test_cli_keeps_the_tier_dir_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--tiers", "cpu,fs", "--steps", "40", "--no-progress",
                     "--keep-tier-dir"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("tiers "))
    assert "(kept)" in line
    where = Path(line.split("files in ")[1].split(" (kept)")[0])
    try:
        copies = list(where.glob("tier0/*/*.bin"))
        assert copies and not list(where.glob("tier0/*/*.tmp"))
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("argv", [["--tiers", "gpu"], ["--tiers", "cpu,tape"],
                                  ["--tiers", "fs"], ["--tiers", "cpu,"],
                                  ["--tier-threads", "2"], ["--keep-tier-dir"],
                                  ["--tiers", "cpu,fs", "--tier-threads", "-1"]])
def test_cli_bad_tier_values_exit_2(argv: list[str],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvspec simulate: ") and err.count("\n") == 1
    if argv[:2] == ["--tiers", "gpu"]:
        assert "--tiers 'gpu'" in err and "cpu,fs" in err


# ---------------------------------------------------------------------- the pieces

@pytest.fixture
def tiered_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(num_cpu_chunks=4, num_workers=2, device="cpu",
                                 tiering=TieringConfig(("fs",), root=str(tmp_path))))
    yield engine
    engine.shutdown()


def test_the_buffer_is_every_rank_s_rows_of_a_slot(tiered_engine: Engine) -> None:
    buf = WorkerCPUBuffer.of_workers(tiered_engine.workers)
    per_rank = sum(t.shape[1] for t in tiered_engine.workers[0].cpu)
    assert (buf.num_slots, buf.num_ranks, buf.slot_bytes) == (4, 2, 2 * per_rank)
    data = bytes(range(256)) * (buf.slot_bytes // 256) + bytes(buf.slot_bytes % 256)
    buf.write(2, data)
    assert buf.read(2) == data and buf.read(1) == bytes(buf.slot_bytes)
    row = tiered_engine.workers[1].cpu[1][2]
    assert torch.equal(buf.part(data, 1, 1), row)
    with pytest.raises(ValueError):
        buf.write(0, data[:-1])
    with pytest.raises(IndexError):
        buf.read(4)


def test_the_connector_sees_the_cpu_tier_without_the_cascades_pins(
        tiered_engine: Engine) -> None:
    m = tiered_engine.tiering
    assert isinstance(m, ConnectorTieringManager)
    assert tiered_engine.scheduler.manager is m
    ctx: ReqContext = m.on_new_request("r")
    out = m.prepare_store([11, 12], ctx)
    assert out is not None and out.keys_to_store == (11, 12)
    m.complete_store([11, 12], ctx)            # cascades pin both keys
    assert m.primary.chunk_ref_counts() == {11: 1, 12: 1}
    assert m.chunk_ref_counts() == {11: 0, 12: 0} and m.tier_pins() == 2
    m.run_tier_io()
    m.on_schedule_end()  # this step polled already (prepare_store): the next one applies
    m.on_schedule_end()  # the results, releasing the pins
    assert m.primary.chunk_ref_counts() == {11: 0, 12: 0} and m.tier_pins() == 0
    # a GPU store that timed out: its slot quarantined, its request's store completed
    out = m.prepare_store([13], ctx)
    assert out is not None
    slots = m.quarantine_store([13])
    assert m.quarantined_slots == frozenset(slots) and m.check_consistency() == []
    m.release_slots(slots)
    assert not m.quarantined_slots and m.check_consistency() == []
    m.on_request_finished(ctx)
    assert m.tier_leaks()["tier_open_requests"] == 0


def test_promotions_wait_until_the_connector_s_reset_fence_empties(
        tiered_engine: Engine) -> None:
    """The connector tells the tiering manager `on_reset_flushed` when the last job its
    reset fenced reported (S:2265-2276), not before: until then promotions are held."""
    e, m = tiered_engine, tiered_engine.tiering
    assert m is not None
    e.add_request("a", list(range(1, 101)), 8)
    e.step()  # the fs tier's existence probes: the lookup is deferred (RETRY)
    assert e.scheduler.request_state("a") == "LOOKUP_DEFERRED"
    e.step()  # the prefill: its stores are shipped, copied in the next step
    assert len(e.scheduler.jobs) == 1 and not m.promotions_held
    e.reset_prefix_cache()
    assert e.scheduler.fence.entries and m.promotions_held
    e.step()
    assert not e.scheduler.fence.entries and not m.promotions_held
    assert e.run_until_idle() < 50 and not e.requests


def test_finding_t1_in_the_data_plane() -> None:
    """Finding T1 (CONFORMANCE.md), through engine, connector and bytes: with vLLM's
    promotions (each protects only the chunk it promotes, TM:713) a request whose chunks
    must all come back from a tier evicts, round after round, the chunks its own lookup
    just hit (ready and unpinned until prepare_load, and of its old LRU rank): it stays
    LOOKUP_DEFERRED forever. The reference's fix (`protect_scanned_keys`) drains."""
    cfg = SimConfig(seed=1, model="hybrid", tiers=("memory",), steps=60,
                    max_drain_steps=150)
    fixed = simulate.run(cfg)
    assert fixed.ok, (fixed.error, fixed.stuck, fixed.leaks)
    vllm = simulate.run(dataclasses.replace(cfg, tier_protect_scanned_keys=False))
    assert vllm.error is None and vllm.corrupted == 0 and vllm.stuck == ["req-0018"]


def test_two_deferred_requests_over_a_small_cpu_tier_drain() -> None:
    """Finding beyond T1 (the data plane found it): with only the promoting request's own
    hits protected, two deferred requests whose chunks come back from a tier evicted each
    other's promoted chunks every step (a promoted chunk keeps its request's old LRU rank),
    and both stayed LOOKUP_DEFERRED forever. The spec protects every key a lookup of the
    step hit (`TieringManager._promotion_protects`), and the run drains."""
    result = simulate.run(SimConfig(seed=10, model="hybrid", tiers=("memory",), steps=60,
                                    max_drain_steps=150))
    assert result.ok, result.stuck
