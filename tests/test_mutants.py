"""Every catalogued mutant is killed by the model-based tests, and the catalogue is sound.

Abstract mutants: the checker's shortest counterexample is replayed through the
model-based machine (its refinement, invariant and answer checks) with the implementation
fault on. Implementation-only mutants: the machine's random search must find them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from spec.scenarios import hunt_bounds
from statemachine.checker import check
from statemachine.mutants import MUTANTS, Mutant, by_name
from statemachine.testing import OffloadingStateMachine, replay


def test_catalogue_is_large_and_named_after_its_sources() -> None:
    assert len(MUTANTS) >= 16
    assert MUTANTS[0].name == "reset-keeps-transfer-jobs"
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    areas = {m.area for m in MUTANTS}
    assert {"reset", "accounting", "fences", "manager"} <= areas
    for m in MUTANTS:
        assert m.stands_for and m.description


def test_patches_are_undone() -> None:
    from statemachine.effects import SchedulerEffects

    before = SchedulerEffects.__dict__["drop_request_jobs"]
    with by_name("reset-keeps-transfer-jobs").patch():
        assert SchedulerEffects.__dict__["drop_request_jobs"] is not before
    assert SchedulerEffects.__dict__["drop_request_jobs"] is before


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.abstract], ids=lambda m: m.name)
def test_model_based_replay_kills_abstract_mutant(mutant: Mutant) -> None:
    assert mutant.model_fault is not None
    bounds = hunt_bounds(mutant.model_fault)
    ce = check(bounds, frozenset([mutant.model_fault])).counterexample
    assert ce is not None
    events = [s.event for s in ce.steps]
    replay(events, bounds)  # the same events pass on the correct implementation
    with mutant.patch(), pytest.raises(BaseException):  # noqa: B017 - any check may fire
        replay(events, bounds)


SCHEDULER_ONLY = [m for m in MUTANTS if not m.abstract and m.area != "kernels"]


@pytest.mark.parametrize("mutant", SCHEDULER_ONLY, ids=lambda m: m.name)
def test_model_based_search_kills_implementation_mutant(mutant: Mutant) -> None:
    class Hunt(OffloadingStateMachine):
        pass

    with mutant.patch(), pytest.raises(BaseException):  # noqa: B017
        run_state_machine_as_test(Hunt, settings=settings(
            max_examples=1000, stateful_step_count=50, deadline=None, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))


def _round_trip_offsets() -> bool:
    """Store blocks of two KV cache groups, each starting mid-chunk, and check where their
    bytes land: in the group's own tensor, at the group's own sub-blocks."""
    import torch

    from kernels import CopyEngine, KVLayout, TransferSpec, allocate_cpu_kv, allocate_gpu_kv

    layout = KVLayout((64, 32), blocks_per_chunk=4, groups=((0,), (1,)))
    gpu = allocate_gpu_kv(layout, 8, torch.device("cpu"))
    cpu = allocate_cpu_kv(layout, 3, pin=False)
    for t, page in enumerate(layout.page_bytes):
        gpu[t].copy_(torch.arange(8 * page, dtype=torch.int64).add(t * 7).remainder(251)
                     .to(torch.int8).view(8, page))
    engine = CopyEngine(gpu, cpu, 4, torch.device("cpu"), groups=layout.groups)
    # group 0: blocks 5, 6 of the request (skip 1) in chunk 1; group 1: block 6 (skip 2),
    # chunk 2
    engine.submit_store(1, TransferSpec([2, 3, 4], [1, 2], group_sizes=(2, 1),
                                        block_indices=(5, 6)))
    engine.wait([1])
    full, window = cpu[0][1].view(4, 64), cpu[1][2].view(4, 32)
    return bool(torch.equal(full[1], gpu[0][2]) and torch.equal(full[2], gpu[0][3])
                and torch.equal(window[2], gpu[1][4])
                and not cpu[1][1].any() and not cpu[0][2].any())


@pytest.mark.parametrize("mutant", [m for m in MUTANTS if m.area == "kernels"],
                         ids=lambda m: m.name)
def test_byte_oracle_kills_kernel_mutant(mutant: Mutant) -> None:
    """The kernels are below the scheduler-level machine: their mutants are killed by the
    byte oracle (the sub-block a byte lands in is checked)."""
    assert _round_trip_offsets()
    with mutant.patch():
        assert not _round_trip_offsets()


def test_the_48102_lasso_replays_on_the_implementation() -> None:
    """With INV-1 off, PR #48102's fault is a liveness counterexample (a lasso); its prefix
    and a few turns of its cycle pass on the implementation and fail with the fault on."""
    mutant = by_name("reset-keeps-transfer-jobs")
    assert mutant.model_fault is not None
    bounds = hunt_bounds(mutant.model_fault)
    r = check(bounds, frozenset([mutant.model_fault]), without=frozenset({"INV-1"}))
    ce = r.counterexample
    assert ce is not None and r.verdict.startswith("liveness") and ce.cycle
    events = [s.event for s in ce.prefix] + [s.event for s in ce.cycle] * 3
    replay(events, bounds)
    with mutant.patch(), pytest.raises(BaseException):  # noqa: B017 - any check may fire
        replay(events, bounds)
