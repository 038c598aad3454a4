"""Calibration and verification through a real `perseus serve`: ranks' spans over the socket,
the model fitted on the calibration thread before any plan, `perseus status` showing the fit,
and a plan that runs over corrected (a new version) with a warning in the service's log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_helpers import FREQUENCIES, first_planned, request, wait_until
from timeline_helpers import STAGES, register_profiled, send_baseline, timelines

from perseus.client.planner_client import PlannerClient
from perseus.schedules import build_schedule
from perseus.service.timelines import MIN_ITERATIONS
from perseus.service.verification import PERSISTS, SKIP, WINDOW
from perseus.wire.phases import Phase
from perseus.wire.spec import JobSpec


def status_cli(endpoint: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "status", "--address", endpoint, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_spans_calibrate_the_model_and_an_overrunning_plan_is_replanned(serve):
    served = serve()
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    clients = [PlannerClient(served.endpoint, timeout_s=3.0, poll_interval_s=0.05) for _ in range(STAGES)]
    try:
        job_id, prof = register_profiled(served, clients, spec)
        assert not clients[0].wait_for_plan(0.5)  # profiled, not calibrated: no plan yet
        schedule = build_schedule("1f1b", STAGES, 8)
        send_baseline(clients, job_id, schedule, prof, MIN_ITERATIONS)
        assert all(c.wait_for_plan(30.0) for c in clients)
        assert "model calibrated" in served.log()

        text = status_cli(served.endpoint)
        assert f"job {job_id}: planned" in text and "model of sim-a100: fitted on 8 baseline iterations" in text
        doc = json.loads(status_cli(served.endpoint, "--job", job_id, "--json"))["jobs"][0]
        (calibration,) = doc["calibrations"]
        assert abs(calibration["model_s"] / calibration["measured_s"] - 1) <= 0.01 and len(calibration["stages"]) == 4
        (pipeline,) = doc["pipelines"]
        target = pipeline["target_iteration_time_s"]
        assert pipeline["verification"] == "verifying" and target == pytest.approx(
            sorted(t.compute_s for t in timelines(schedule, prof, count=MIN_ITERATIONS))[MIN_ITERATIONS // 2], rel=0.01
        )

        reached = [100]  # the next iteration to report

        def run(version: int, compute_s: float, iterations: int) -> None:
            """`iterations` of plan `version` from its start (or the next iteration), each taking `compute_s`."""
            start = first_planned(served.endpoint, job_id, version, reached[0])
            for it in range(start, start + iterations):
                for r, client in enumerate(clients):
                    client.report_iteration(job_id, r, it, compute_s * 1.02, 90.0, compute_time_s=compute_s)
            reached[0] = start + iterations

        run(1, target * 1.08, SKIP + WINDOW)  # the plan runs over its target: first a fresh one
        wait_until(lambda: clients[0].status(job_id).jobs[0].pipelines[0].verification == "reference", timeout_s=30)
        start = first_planned(served.endpoint, job_id, 2, reached[0])
        window = wait_until(lambda: (a := clients[0].assignment(start)).plan_version == 2 and a)
        assert set(window.frequencies or ()) == {max(FREQUENCIES)}
        assert window.phase == Phase.REFERENCE  # ranks record its iterations as such, not as the plan's
        assert window.spans  # and send their spans: the model is fitted again if the host's speed changed
        job = clients[0].status(job_id).jobs[0]
        assert job.predicted_energy_j < job.predicted_baseline_energy_j  # the plan's saving, not the window's
        old = request(served.endpoint, "get_table", job_id=job_id, rank=0, iteration=reached[0], sweep_version=3)
        assert old is not None and old["ok"] and old["plan_version"] == 2
        assert "reference" not in old  # a rank of an earlier release would not know the field
        new = request(served.endpoint, "get_table", job_id=job_id, rank=0, iteration=reached[0], sweep_version=4)
        assert new is not None and new["reference"] is True
        run(2, target * 1.01, SKIP + WINDOW)  # the host slowed by 1%: maximum clocks take that long now
        start = first_planned(served.endpoint, job_id, 3, reached[0])
        assert wait_until(lambda: (a := clients[0].assignment(start)).plan_version == 3 and a).phase == Phase.PLANNED
        run(3, target * 1.01 * 1.08, SKIP + WINDOW * PERSISTS)  # over: once more after another reference
        run(4, target * 1.01, SKIP + WINDOW)
        run(5, target * 1.01 * 1.08, SKIP + WINDOW)  # over again: a reference after it tells plan from host
        run(6, target * 1.01, SKIP + WINDOW)
        wait_until(lambda: clients[0].status(job_id).jobs[0].plan_version == 7, timeout_s=30)
        log = served.log()
        assert "one window at maximum clocks measures a fresh one" in log and "did not slow meanwhile" in log
        assert "tells the plan's excess from a host that slowed" in log and "references before and after" in log
        assert "WARNING" in log and "re-planning (1 of 3)" in log and "+8.0% over its target" in log
        text = status_cli(served.endpoint, "--job", job_id)
        assert "plan v7" in text and "re-planning (1 of 3)" in text
    finally:
        for c in clients:
            c.close()
