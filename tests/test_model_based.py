"""The model-based tests: the reference scheduler refines the abstract model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from statemachine.config import OffloadingConfig
from statemachine.messages import OffloadingConnectorMetadata, SchedulerOutput
from statemachine.scheduler import OffloadingScheduler
from statemachine.testing import OffloadingStateMachine, ReferenceAdapter


class ReferenceAgainstModel(OffloadingStateMachine):
    pass


ReferenceAgainstModel.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                                   deadline=None)
TestReferenceAgainstModel = ReferenceAgainstModel.TestCase


class CountingScheduler(OffloadingScheduler):
    """Another implementation, as a user would plug in (here: the reference, counting)."""

    hooks = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> (
            OffloadingConnectorMetadata):
        CountingScheduler.hooks += 1
        return super().build_connector_meta(scheduler_output)


class CountingAdapter(ReferenceAdapter):
    def make_scheduler(self, config: OffloadingConfig) -> OffloadingScheduler:
        return CountingScheduler(config)


class UserAgainstModel(OffloadingStateMachine):
    adapter_factory = CountingAdapter


def test_a_user_adapter_runs_the_same_machine() -> None:
    CountingScheduler.hooks = 0
    run_state_machine_as_test(UserAgainstModel, settings=settings(
        max_examples=20, stateful_step_count=20, deadline=None, database=None))
    assert CountingScheduler.hooks > 0
