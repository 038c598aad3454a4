"""A job run again under the same spec, through a real `perseus serve`: each run of its ranks
(fresh clients, rank 0 registering the job again) measures its own baseline before any plan
applies, a profile that no longer fits the workload is dropped and measured again, a job that
failed on what an earlier run measured gets a fresh chance, and a plan that fell back to maximum
clocks claims no saving in `perseus status`."""

from __future__ import annotations

import json

import pytest
from server_helpers import BLOCKING_W, first_planned, rank_info, wait_until
from test_server_calibration import status_cli
from timeline_helpers import STAGES, profile, spans, timelines

from perseus.client.planner_client import PlannerClient
from perseus.profiler.profile import Profile
from perseus.schedules import build_schedule
from perseus.service.timelines import MIN_ITERATIONS
from perseus.service.verification import MAX_REFERENCES, MAX_REPLANS, PERSISTS, SKIP, WINDOW
from perseus.wire.messages import JobStatus
from perseus.wire.phases import Phase
from perseus.wire.spec import JobSpec

SPEC = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100", tag="same-tag")
SCHEDULE = build_schedule("1f1b", STAGES, 8)
LIGHT = profile(STAGES)  # 6 ms forward at the top clock
HEAVY = profile(STAGES, work_s=0.018)  # the same spec, three times the GPU work
NO_WORK = profile(STAGES, work_s=0.0001)  # a script that emulates (almost) no GPU work


class Run:
    """One run of the job: four fresh rank clients (new processes), rank 0 registering the job."""

    def __init__(self, endpoint: str) -> None:
        self.clients = [PlannerClient(endpoint, timeout_s=3.0, poll_interval_s=0.05) for _ in range(STAGES)]
        self.job_id = self.clients[0].register_job(SPEC)
        for r, client in enumerate(self.clients):
            client.register_rank(self.job_id, rank_info(r, timeline=True))

    def status(self) -> JobStatus:
        return self.clients[0].status(self.job_id).jobs[0]

    def upload(self, prof: Profile) -> None:
        for r, client in enumerate(self.clients):
            share = Profile({k: v for k, v in prof.points.items() if k[0] == r}, BLOCKING_W)
            client.upload_profile(self.job_id, r, share)

    def baseline(self, prof: Profile) -> float:
        """MIN_ITERATIONS baseline iterations of a workload whose GPU work `prof` holds; their
        median compute time (what the plans are held to)."""
        measured = timelines(SCHEDULE, prof, count=MIN_ITERATIONS)
        for it, timeline in enumerate(measured, start=1):
            for r, client in enumerate(self.clients):
                client.report_spans(spans(self.job_id, r, it, timeline))
                client.report_iteration(self.job_id, r, it, timeline.steps[r], 100.0, compute_time_s=timeline.compute_s)
        return sorted(t.compute_s for t in measured)[MIN_ITERATIONS // 2]

    def close(self) -> None:
        for client in self.clients:
            client.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "then", "first_phase"),
    [(LIGHT, HEAVY, "planned"), (NO_WORK, LIGHT, "failed")],
    ids=["heavier-model", "script-fixed"],
)
def test_a_new_run_of_the_same_spec_is_planned_on_its_own_baseline_and_workload(serve, first, then, first_phase):
    served = serve()
    one = Run(served.endpoint)
    try:
        wait_until(lambda: all(c.assignment(0).spans for c in one.clients))
        one.upload(first)
        wait_until(lambda: one.status().profiled_stages == tuple(range(STAGES)), timeout_s=30)
        one.baseline(first)
        first_status = wait_until(lambda: (s := one.status()).phase == first_phase and s, timeout_s=60)
    finally:
        one.close()
    old_target = first_status.pipelines[0].target_iteration_time_s

    two = Run(served.endpoint)  # the same spec, job id and tag; another workload
    try:
        assert two.job_id == one.job_id
        # No plan of the earlier run applies: this run's baseline is measured (spans asked for) first.
        wait_until(lambda: all(c.assignment(0).spans for c in two.clients))
        assert all(c.assignment(100).phase == Phase.PLANNING for c in two.clients)
        assert two.status().phase == "planning" and not two.status().error  # a failed job gets a fresh chance
        target = two.baseline(then)
        # The inherited profile does not fit this run's spans: dropped with its plans, profiled again.
        wait_until(lambda: two.status().phase == "profiling", timeout_s=60)
        log = served.log()
        assert "WARNING" in log and "no longer matches the job's profile" in log
        (calibration,) = two.status().calibrations
        assert "no longer matches" in calibration.reason and "profiled again" in calibration.reason
        assert "profiled again: sim-a100: the measured timeline no longer matches" in status_cli(served.endpoint)
        wait_until(lambda: all(c.assignment(100).phase == Phase.PROFILING for c in two.clients))
        two.upload(then)
        wait_until(lambda: two.status().phase == "planned", timeout_s=60)
        status = two.status()
        (calibration,) = status.calibrations
        assert calibration.state == "fitted" and abs(calibration.error) <= 0.01, calibration
        (pipeline,) = status.pipelines
        # Verified against this run's baseline, not the earlier run's.
        assert pipeline.baseline_iteration_time_s == pytest.approx(target, rel=0.01)
        assert pipeline.target_iteration_time_s == pytest.approx(target, rel=0.01)
        if old_target is not None:  # the earlier run was planned: its model was three times lighter
            assert pipeline.target_iteration_time_s > 2 * old_target
    finally:
        two.close()


@pytest.mark.slow
def test_a_plan_that_fell_back_to_maximum_clocks_claims_no_saving(serve):
    served = serve()
    run = Run(served.endpoint)
    try:
        wait_until(lambda: all(c.assignment(0).spans for c in run.clients))
        run.upload(LIGHT)
        target = run.baseline(LIGHT)
        wait_until(lambda: run.status().phase == "planned", timeout_s=60)
        iteration, version = 100, 1
        # Every plan runs 8% over its target; maximum clocks (the reference windows) on target. Each
        # plan's iterations are reported a window at a time until verification decides on it.
        while (pipeline := run.status().pipelines[0]).verification != "fallback":
            assert version <= 1 + MAX_REPLANS + 2 * MAX_REFERENCES, pipeline
            iteration = first_planned(served.endpoint, run.job_id, version, iteration)
            compute = target if pipeline.verification == "reference" else target * 1.08
            for n in range(1, SKIP + WINDOW * PERSISTS + 1):
                for r, client in enumerate(run.clients):
                    client.report_iteration(run.job_id, r, iteration, compute * 1.02, 90.0, compute_time_s=compute)
                iteration += 1
                if n > SKIP and (n - SKIP) % WINDOW == 0:
                    assert all(client.flush() for client in run.clients)
                    now = run.status().pipelines[0]
                    if now.plan_version != version or now.verification in ("replanning", "fallback"):
                        break
            version = wait_until(lambda old=version: (v := run.status().plan_version) > old and v, timeout_s=60)
        start = first_planned(served.endpoint, run.job_id, version, iteration)
        for it in range(start, start + 3):  # at maximum clocks, 5% cheaper than the baseline by chance
            for r, client in enumerate(run.clients):
                client.report_iteration(run.job_id, r, it, target, 95.0, compute_time_s=target)
        status = wait_until(lambda: (s := run.status()).planned_iterations == 3 and s)
        assert status.measured_saving is None and "fell back to maximum clocks" in status.saving_withheld
        text = status_cli(served.endpoint, "--job", run.job_id)
        assert "no saving claimed: the pipeline fell back to maximum clocks" in text, text
        assert "saving 5.0% measured" not in text
        doc = json.loads(status_cli(served.endpoint, "--job", run.job_id, "--json"))["jobs"][0]
        assert doc["measured_saving"] is None and "falling back to maximum clocks" in doc["saving_withheld"]
    finally:
        run.close()
