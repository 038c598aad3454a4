"""A job calibrated through a real `perseus serve --metrics-port` (ranks' spans over the socket,
as tests/server/test_server_calibration.py sends them): its model's fit is scraped per model and
per stage, with the figures `perseus status` reports."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from server_helpers import wait_until
from test_service_metrics import at, metrics_url, scrape
from timeline_helpers import STAGES, register_profiled, send_baseline

from perseus.client.planner_client import PlannerClient
from perseus.schedules import build_schedule
from perseus.service.timelines import MIN_ITERATIONS
from perseus.wire.spec import JobSpec


def test_a_calibrated_job_exports_its_model_fit_per_model_and_stage(serve):
    served = serve(extra=("--metrics-port", "0"))
    url = metrics_url(served)
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    clients = [PlannerClient(served.endpoint, timeout_s=3.0, poll_interval_s=0.05) for _ in range(STAGES)]
    try:
        job_id, prof = register_profiled(served, clients, spec)
        before = scrape(url)  # profiled, nothing measured: no fit yet
        assert not any(name.startswith("perseus_model_") for name, _ in before)
        schedule = build_schedule("1f1b", STAGES, 8)
        send_baseline(clients, job_id, schedule, prof, MIN_ITERATIONS)
        assert all(c.wait_for_plan(30.0) for c in clients)
        (calibration,) = clients[0].status(job_id).jobs[0].calibrations
        samples = wait_until(
            lambda: (
                (s := scrape(url)).get(("perseus_model_fit_ratio", (("job", job_id), ("model", "sim-a100"))))
                is not None
                and s
            )
        )
    finally:
        for c in clients:
            c.close()

    assert calibration.state == "fitted" and calibration.error is not None
    labels = {"job": job_id, "model": "sim-a100"}
    assert at(samples, "perseus_model_fit_ratio", **labels) == pytest.approx(calibration.error)
    assert abs(at(samples, "perseus_model_fit_ratio", **labels)) <= 0.01  # the test's timelines fit the profile
    assert at(samples, "perseus_model_iteration_seconds", **labels, kind="measured") == pytest.approx(
        calibration.measured_s
    )
    assert at(samples, "perseus_model_iteration_seconds", **labels, kind="model") == pytest.approx(calibration.model_s)
    assert len(calibration.stages) == STAGES
    for s in calibration.stages:
        assert s.error is not None
        assert at(samples, "perseus_model_stage_fit_ratio", **labels, stage=str(s.stage)) == pytest.approx(s.error)
