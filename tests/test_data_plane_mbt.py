"""The model-based machine over the whole stack (engine, scheduler, workers, kernels), with
the byte oracle after every step: hypothesis's programs over every data-plane machine the soak
runs (`statemachine.soak.DATA_PLANE_MACHINES`), one test case each (`TestDataPlane`,
`TestHybridDataPlane`, ... `TestTightDataPlane`)."""

from __future__ import annotations

from hypothesis import settings

from statemachine.soak import DATA_PLANE_MACHINES

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)

for _machine in DATA_PLANE_MACHINES:
    _machine.TestCase.settings = SETTINGS
    globals()["Test" + _machine.__name__.removesuffix("StateMachine")] = _machine.TestCase
