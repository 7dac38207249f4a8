"""The adapter's identity and the projection's faithfulness, checked by hand."""

from __future__ import annotations

from typing import Any

import pytest

from spec import model as M
from spec import request as R
from spec.state import HeldJob

pytestmark = pytest.mark.conformance

BOUNDS = M.Bounds(requests=2, tokens=3, workers=2, cpu_chunks=3, gpu_blocks=6, resets=1,
                  failures=0, preemptions=1)


def test_adapter_names_the_vllm_under_test(vllm_ready: Any) -> None:
    import vllm

    from conformance.adapter import VLLMAdapter

    adapter = VLLMAdapter(BOUNDS)
    assert adapter.vllm_file == vllm.__file__
    assert adapter.vllm_version == vllm_ready.vllm_version()
    assert ".".join(map(str, adapter.vllm_version)) in vllm.__version__
    print(f"vllm {vllm.__version__} from {adapter.vllm_file}")


def test_real_objects_are_built(vllm_ready: Any) -> None:
    setup = vllm_ready.make_setup(num_gpu_blocks=7, num_cpu_chunks=3, num_workers=2)
    assert type(setup.manager).__name__ == "CPUOffloadingManager"
    assert type(setup.scheduler).__name__ == "OffloadingConnectorScheduler"
    assert vllm_ready.manager_num_chunks(setup.manager) == 3
    assert setup.vllm_config.device_config.device.type == "cpu"
    assert setup.vllm_config.parallel_config.world_size == 2


def test_projection_field_by_field(vllm_ready: Any) -> None:
    """A hand-driven short run; each projected field checked against vLLM's own fields."""
    from conformance.adapter import VLLMAdapter

    a = VLLMAdapter(BOUNDS)
    sched, policy = a.scheduler, a.setup.manager._policy
    table = policy.chunks if hasattr(policy, "chunks") else policy.blocks
    k0, k1 = M.key(0, 0), M.key(0, 1)

    a.call(M.Call("on_new_request", ("r0",)))
    assert a.call(M.Call("get_num_new_matched_tokens", ("r0", 0))) == (0, False)
    a.call(M.Call("update_state_after_alloc", ("r0", (0, 1, 2), 0)))
    a.call(M.Call("build_connector_meta", ({"r0": (0, 1, 2)}, {}, {"r0": 1}, frozenset(),
                                           frozenset(), {"r0": (0, False)}, {}, ())))
    s = a.abstract_state()
    (req,) = s.requests
    assert (req.id, req.state, req.transfer_jobs) == ("r0", R.STORING, frozenset({0}))
    assert req.transfer_jobs == frozenset(sched._req_status["r0"].transfer_jobs)
    assert req.gpu_blocks == (0, 1, 2) and not req.finished and not req.finished_signaled
    (job,) = s.jobs
    assert (job.id, job.kind, job.owner, job.state) == (0, "store", "r0", "SHIPPED")
    assert job.pending_count == sched._jobs[0].pending_count == 2
    assert job.keys == frozenset({k0}) and job.blocks == frozenset({0})
    assert job.deferred_fence_blocks == frozenset({0})  # vLLM block 1 is model block 0
    assert s.chunk_ref_cnt == ((k0, -1),)
    assert [c.ref_cnt for c in table.values()] == [-1]
    assert (s.job_counter, s.stale_threshold) == (sched._job_counter, 0) == (1, 0)
    assert not s.step_open and not s.jobs_to_flush and not s.reset_fence

    a.call(M.Call("update_connector_output", (0, 1, 0, frozenset())))
    s = a.abstract_state()
    assert s.jobs[0].state == "PARTIALLY_ACKED" and s.jobs[0].pending_count == 1

    a.call(M.Call("reset_cache", ()))
    s = a.abstract_state()
    assert not s.jobs and not sched._jobs and s.chunk_ref_cnt == () and not table
    assert s.stale_threshold == sched._stale_job_threshold == 1
    assert s.jobs_to_flush == frozenset({0}) and s.reset_since_last_step
    assert s.reset_fence == (HeldJob(0, "store", 1, frozenset({k0}), frozenset({0})),)
    if not hasattr(sched, "_reset_fence"):  # 0.22-0.25: the #48102 bug, as projected
        assert s.requests[0].transfer_jobs == frozenset({0})
        return
    assert dict(sched._reset_fence) == {0: 1}
    assert s.requests[0].state == R.RUNNING and not s.requests[0].transfer_jobs

    a.call(M.Call("build_connector_meta", ({}, {"r0": ()}, {"r0": 1}, frozenset(),
                                           frozenset(), {"r0": (1, False)}, {}, ())))
    s = a.abstract_state()
    assert s.reset_fence[0].flushed and not s.jobs_to_flush and not s.reset_since_last_step
    (job,) = s.jobs  # the store cursor went back to 0: both computed chunks again
    assert (job.id, job.keys, job.blocks) == (1, frozenset({k0, k1}), frozenset({0, 1}))
    a.call(M.Call("update_connector_output", (0, 1, 0, frozenset())))
    assert a.abstract_state().reset_fence == () and not sched._reset_fence
