"""3D parallelism through a real `perseus serve`: a dp=2 x pp=2 x tp=2 job in Megatron's rank
order. Both tensor-parallel ranks of a stage upload (the service merges them: slowest time,
summed energy), pipeline 1 reuses pipeline 0's profiles, every rank of a stage gets the stage's
frequencies, and a restarted service keeps all of it. About 3 s (one real plan)."""

from __future__ import annotations

import signal

import pytest
from server_helpers import job_spec, rank_info, stage_profile, wait_until

from perseus.client.planner_client import PlannerClient
from perseus.planner import Planner
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.schedules import build_schedule
from perseus.service.planning import merge_profiles
from perseus.wire.parallelism import merge_tensor_parallel, rank_coordinates


def _slower(profile: Profile) -> Profile:
    """A tensor-parallel shard that takes 20% longer and draws less energy than its peer."""
    return Profile(
        {
            k: [ProfilePoint(p.frequency, p.time * 1.2, p.energy * 0.8) for p in pts]
            for k, pts in profile.points.items()
        },
        80.0,
    )


def test_tensor_parallel_stages_profile_once_and_share_their_plan(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    spec = job_spec(world_size=8, dp=2, tp=2, rank_mapping="megatron")
    coords = [rank_coordinates("megatron", r, 2, 2, 2) for r in range(8)]
    clients = [PlannerClient(served.endpoint, timeout_s=2.0, poll_interval_s=0.05) for _ in range(8)]
    try:
        job_id = clients[0].register_job(spec)
        for r, (stage, dp_index, tp_index) in enumerate(coords):
            clients[r].register_rank(job_id, rank_info(r, stage=stage, dp_index=dp_index, tp_index=tp_index))
        uploads = {}
        for r, (stage, dp_index, tp_index) in enumerate(coords):
            if dp_index == 0:  # the first replica profiles; the other one shares its profiles
                uploads[(stage, tp_index)] = stage_profile(stage) if tp_index == 0 else _slower(stage_profile(stage))
                clients[r].upload_profile(job_id, stage, uploads[(stage, tp_index)])
        assert all(c.wait_for_plan(20.0) for c in clients)

        merged = {s: merge_tensor_parallel([uploads[(s, 0)], uploads[(s, 1)]]) for s in (0, 1)}
        expected = Planner(build_schedule("1f1b", 2, 4), merge_profiles(merged, None)).plan()
        for r, (stage, _, _) in enumerate(coords):
            assert clients[r].assignment(0).frequencies == expected.stage_frequencies(stage)
        status = clients[0].status(job_id).jobs[0]
        assert status.predicted_energy_j == pytest.approx(2 * expected.energy_j)  # two pipelines, tp energies summed
        assert "tensor-parallel share 1 of 2" in served.log()

        served.stop(signal.SIGKILL)
        served = serve(state, bind=served.endpoint)
        job = wait_until(lambda: clients[0].status(job_id)).jobs[0]
        assert job.phase == "planned" and job.profiled_stages == (0, 1) and "planning" not in served.log()
    finally:
        for c in clients:
            c.close()
