"""The long random campaign (`make campaign`): the model-based machine, many seeds in
parallel with pytest-xdist, each seed an independent, replayable run (hypothesis seeded
with it: `KVSPEC_CAMPAIGN_SEED` is the first, default 0). Not in `make test`."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import get_state_machine_test

from spec import model as M
from statemachine.testing import OffloadingStateMachine

EXAMPLES = int(os.environ.get("KVSPEC_CAMPAIGN_EXAMPLES", "1000"))
FIRST = int(os.environ.get("KVSPEC_CAMPAIGN_SEED", "0"))
SEEDS = range(FIRST, FIRST + int(os.environ.get("KVSPEC_CAMPAIGN_SEEDS", "8")))


class Counted(OffloadingStateMachine):
    steps = 0

    def _step(self, ev: M.Event) -> None:
        before = self.model
        super()._step(ev)
        if self.model is not before:
            Counted.steps += 1


@pytest.mark.campaign
@pytest.mark.parametrize("seed", SEEDS)
def test_campaign(seed: int) -> None:
    Counted.steps = 0
    test = get_state_machine_test(Counted, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=100, deadline=None, database=None,
        derandomize=False, suppress_health_check=list(HealthCheck)))
    hypothesis_seed(seed)(test)()
    print(f"\ncampaign seed {seed}: {EXAMPLES} examples, {Counted.steps} model steps")
