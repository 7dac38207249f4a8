"""`make conformance-soak`: the conformance machines against vLLM's own scheduler-side
connector for a budget of model steps, seeded and replayable (`statemachine.soak`), seeds
split over every core. Not in `make conformance` (whose runs are derandomized and fixed
in number, for CI): a reviewer's long campaign, on a release or on a pull request's tree
(`VLLM_SRC`), that draws programs no fixed run has drawn.

Each seed draws programs of the machine `conformance.adapter.machine_for` picks for the
release (`VLLMMachine` from 0.26, with refinement after every step, every invariant and the
drain; `VLLM025Machine` before, which finds the PR #48102 stuck request: there a failure is
that finding) and, from 0.26, of `VLLMHybridMachine` (full attention beside a sliding
window or a Mamba group, multi-block chunks). The first failure of a seed is shrunk and
printed with its program and the command that reruns the seed.

KVSPEC_SOAK_STEPS  model steps per machine, over its seeds (make: VLLM_STEPS, 200,000)
KVSPEC_SOAK_SEEDS  seeds per machine (make: SOAK_SEEDS, 2); KVSPEC_SOAK_SEED the first (SEED)
KVSPEC_SOAK_SHRINK_SECONDS  the time a failure's shrinking may take (default 120)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from statemachine import soak

pytestmark = pytest.mark.soak

STEPS = int(os.environ.get("KVSPEC_SOAK_STEPS", "200000"))
SEEDS = int(os.environ.get("KVSPEC_SOAK_SEEDS", "2"))
FIRST = int(os.environ.get("KVSPEC_SOAK_SEED", "0"))
SHRINK = float(os.environ.get("KVSPEC_SOAK_SHRINK_SECONDS", "120"))
PER_SEED = -(-STEPS // SEEDS)

MACHINES = ("vllm", "vllm-hybrid")
CASES = [(m, FIRST + i) for m in MACHINES for i in range(SEEDS)]


def machine_class(name: str, version: tuple[int, int, int]) -> Any:
    """The conformance machine a soak case runs on this release (None: none there)."""
    from conformance.adapter import VLLMHybridMachine, VLLMMachine, machine_for

    base = machine_for(version)
    if name == "vllm":
        return base
    return VLLMHybridMachine if base is VLLMMachine else None


def rerun_command(release: str, seed: int, per_seed: int) -> str:
    """`make conformance-soak` for this seed alone (and the source tree a `VLLM_SRC` run
    tested)."""
    src = os.environ.get("VLLM_SRC")
    return (f"make conformance-soak VLLM_VERSION={release}{f' VLLM_SRC={src}' if src else ''} "
            f"SEED={seed} SOAK_SEEDS=1 VLLM_STEPS={per_seed}")


@pytest.mark.parametrize(("machine", "seed"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_soak_vllm(machine: str, seed: int, vllm_ready: Any, record_property: Any) -> None:
    from conformance import releases

    version = vllm_ready.vllm_version()
    cls = machine_class(machine, version)
    if cls is None:
        pytest.skip(f"{machine}: no such machine on vLLM {releases.text(version)} (from 0.26)")
    release = os.environ.get("KVSPEC_VLLM_VERSION") or releases.text(version)
    # no witness-seeded programs: a witness may take events vLLM's machine keeps off
    # (a timeout, a failure report before 0.34.0); tests/conformance/test_witnesses.py
    # replays those vLLM takes
    result = soak.soak_model(seed, PER_SEED, cls=cls, shrink_seconds=SHRINK,
                             name=machine, rerun=rerun_command(release, seed, PER_SEED),
                             witness_every=0)
    record_property("soak", json.dumps(result.as_dict()))  # the totals: tests/conftest.py
    if result.failures:
        pytest.fail("\n".join(f.render() for f in result.failures), pytrace=False)
