"""The model-based machine over the whole stack (engine, scheduler, workers, kernels), with
the byte oracle after every step."""

from __future__ import annotations

from hypothesis import settings

from statemachine.testing import (
    DataPlaneStateMachine,
    HybridDataPlaneStateMachine,
    MambaDataPlaneStateMachine,
    Release034DataPlaneStateMachine,
)

DataPlaneStateMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                   deadline=None)
TestDataPlane = DataPlaneStateMachine.TestCase

HybridDataPlaneStateMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None)
TestHybridDataPlane = HybridDataPlaneStateMachine.TestCase

MambaDataPlaneStateMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None)
TestMambaDataPlane = MambaDataPlaneStateMachine.TestCase

Release034DataPlaneStateMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None)
TestRelease034DataPlane = Release034DataPlaneStateMachine.TestCase
