"""The model-based machine over the whole stack (engine, scheduler, workers, kernels), with
the byte oracle after every step."""

from __future__ import annotations

from hypothesis import settings

from statemachine.testing import (
    AsyncLoadDataPlaneStateMachine,
    DataPlaneStateMachine,
    HybridDataPlaneStateMachine,
    MambaDataPlaneStateMachine,
    Release034AsyncLoadDataPlaneStateMachine,
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

AsyncLoadDataPlaneStateMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None)
TestAsyncLoadDataPlane = AsyncLoadDataPlaneStateMachine.TestCase

Release034AsyncLoadDataPlaneStateMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None)
TestRelease034AsyncLoadDataPlane = Release034AsyncLoadDataPlaneStateMachine.TestCase
