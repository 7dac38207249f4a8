"""`make soak`: the model-based machines for a budget of model steps, seeds split over every
core with pytest-xdist (`statemachine.soak`). Not in `make test`.

KVSPEC_SOAK_STEPS      model steps of the reference-against-model machine (default 1,000,000)
KVSPEC_SOAK_DATA_STEPS steps of the data-plane machine (default a fifth of the above)
KVSPEC_SOAK_TIER_STEPS rule calls of the tiering machine (default a fifth of the above)
KVSPEC_SOAK_SEEDS      seeds per machine (default 16); KVSPEC_SOAK_SEED the first (default 0)
KVSPEC_SOAK_MUTANT     a fault of statemachine.mutants to switch on (the soak must find it)
KVSPEC_SOAK_SHRINK_SECONDS  the time a failure's shrinking may take (default 60)
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from spec.tiering.faults import TIER_FAULT_NAMES as TIER_MUTANT_NAMES
from statemachine import soak

STEPS = int(os.environ.get("KVSPEC_SOAK_STEPS", "1000000"))
DATA_STEPS = int(os.environ.get("KVSPEC_SOAK_DATA_STEPS", str(STEPS // 5)))
TIER_STEPS = int(os.environ.get("KVSPEC_SOAK_TIER_STEPS", str(STEPS // 5)))
SEEDS = int(os.environ.get("KVSPEC_SOAK_SEEDS", "16"))
FIRST = int(os.environ.get("KVSPEC_SOAK_SEED", "0"))
MUTANT = os.environ.get("KVSPEC_SOAK_MUTANT") or None
SHRINK = float(os.environ.get("KVSPEC_SOAK_SHRINK_SECONDS", "60"))

CASES = [("model", FIRST + i) for i in range(SEEDS)] + \
        [("data-plane", FIRST + i) for i in range(SEEDS)] + \
        [("tiering", FIRST + i) for i in range(SEEDS)]


@pytest.mark.soak
@pytest.mark.parametrize(("machine", "seed"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_soak(machine: str, seed: int, record_property: Any) -> None:
    if machine == "model":
        result = soak.soak_model(seed, -(-STEPS // SEEDS), shrink_seconds=SHRINK,
                                 mutant=MUTANT)
    elif machine == "tiering":
        tier_mutant = MUTANT if MUTANT in TIER_MUTANT_NAMES else None
        if MUTANT and tier_mutant is None:
            pytest.skip(f"{MUTANT} is not a tiering mutant")
        result = soak.soak_tiering(seed, -(-TIER_STEPS // SEEDS), shrink_seconds=SHRINK,
                                   mutant=tier_mutant)
    else:
        result = soak.soak_data_plane(seed, -(-DATA_STEPS // SEEDS), shrink_seconds=SHRINK,
                                      mutant=MUTANT)
    record_property("soak", json.dumps(result.as_dict()))
    if result.failures:
        pytest.fail("\n".join(f.render() for f in result.failures), pytrace=False)
