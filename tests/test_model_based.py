"""The model-based tests: the reference scheduler refines the abstract model."""

from __future__ import annotations

from hypothesis import settings

from statemachine.testing import OffloadingStateMachine


class ReferenceAgainstModel(OffloadingStateMachine):
    pass


ReferenceAgainstModel.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                                   deadline=None)
TestReferenceAgainstModel = ReferenceAgainstModel.TestCase
