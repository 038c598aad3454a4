"""`perseus serve --metrics-port`: a real service process, a job driven through it by real
clients, and its /metrics scraped over HTTP and parsed with prometheus_client.parser."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Served, job_spec, rank_info, request, stage_profile, wait_until

from perseus.client.planner_client import PlannerClient
from perseus.metrics.collectors import FAMILIES, exported_metrics
from perseus.wire.phases import Phase


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def at(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def metrics_url(served: Served) -> str:
    line = served.proc.stdout.readline()  # printed right after "listening on" (often already buffered)
    assert "metrics on http://127.0.0.1:" in line, line
    return line.split()[-1]


def run_job(endpoint: str) -> tuple[str, list]:
    """A 2-stage job through warm-up, profiles, planning and 3 planned iterations (as in
    tests/server): rank r reports 30 J per warm-up iteration (the first sets up: no baseline) and
    26 + r J per planned iteration."""
    spec = job_spec()
    clients = [PlannerClient(endpoint, timeout_s=2.0, poll_interval_s=0.05) for _ in range(2)]
    job_id = clients[0].register_job(spec)
    for r, client in enumerate(clients):
        client.register_rank(job_id, rank_info(r))
    wait_until(lambda: all(c.assignment(0).phase == Phase.WARMUP for c in clients))
    for r, client in enumerate(clients):
        for it in (0, 1):  # the baseline spans 2 s or more: a saving is claimed on it (perseus.service.status)
            client.report_iteration(job_id, r, it, 2.1, 30.0)
    clients[1].assignment(9)
    clients[0].upload_profile(job_id, 0, stage_profile(0))
    clients[1].upload_profile(job_id, 1, stage_profile(1))
    assert all(c.wait_for_plan(20.0) for c in clients)
    start = min(i for i in range(100) if clients[0].assignment(i).phase == Phase.PLANNED)
    for r, client in enumerate(clients):
        for it in range(start, start + 9):  # 2.07 s: a saving is claimed (perseus.service.status)
            client.report_iteration(job_id, r, it, 0.23, 26.0 + r)
    assert all(c.flush(5.0) for c in clients)
    return job_id, clients


def test_a_scrape_shows_the_service_its_job_its_pipelines_and_stages(serve):
    served = serve(extra=("--metrics-port", "0"))
    url = metrics_url(served)
    before = scrape(url)  # no job yet: the service's own families
    assert at(before, "perseus_service_max_jobs") == 1024
    assert not any(name.startswith("perseus_job_") for name, _ in before)

    job_id, clients = run_job(served.endpoint)
    try:
        status = clients[0].status(job_id).jobs[0]
        assert request(served.endpoint, "status", job_id="job-00ff")["error"]["code"] == "unknown_job"
        samples = wait_until(lambda: (s := scrape(url)).get(("perseus_job_last_iteration", (("job", job_id),))) and s)
    finally:
        for c in clients:
            c.close()

    job = {"job": job_id}
    pipeline = {**job, "pipeline": "0"}
    expected = [
        ("perseus_job_info", {**job, "phase": "planned"}, 1),
        ("perseus_job_plan_version", job, 1),
        ("perseus_job_plan_changes_total", job, 0),
        ("perseus_job_saving_withheld", job, 0),
        ("perseus_pipeline_replans", pipeline, 0),
        ("perseus_job_world_size", job, 2),
        ("perseus_job_predicted_saving_ratio", job, status.predicted_saving),
        ("perseus_job_measured_saving_ratio", job, 1 - 53 / 60),
        ("perseus_job_iteration_seconds", {**job, "kind": "planned"}, 0.23),
        ("perseus_job_iteration_energy_joules", {**job, "kind": "baseline"}, 60.0),
        ("perseus_job_iteration_energy_joules", {**job, "kind": "predicted"}, status.predicted_energy_j),
        ("perseus_pipeline_plan_version", pipeline, 1),
        ("perseus_pipeline_straggler_factor", pipeline, 1.0),
        ("perseus_pipeline_iteration_seconds", {**pipeline, "kind": "predicted"}, status.predicted_iteration_time_s),
        # Energy counters: every report of each stage's rank, warm-up and planned.
        ("perseus_stage_energy_joules_total", {**pipeline, "stage": "0"}, 2 * 30 + 9 * 26),
        ("perseus_stage_energy_joules_total", {**pipeline, "stage": "1"}, 2 * 30 + 9 * 27),
        ("perseus_stage_iteration_reports_total", {**pipeline, "stage": "1"}, 11),
        ("perseus_service_jobs", {"phase": "planned"}, 1),
        ("perseus_service_requests_total", {"type": "status", "code": "unknown_job"}, 1),
    ]
    for name, labels, value in expected:
        assert at(samples, name, **labels) == pytest.approx(value), (name, labels)
    # 8 reports and a job; a client retrying a request under load sends it again (energy counts it once).
    assert at(samples, "perseus_service_requests_total", type="report_iteration", code="ok") >= 8
    assert at(samples, "perseus_service_requests_total", type="register_job", code="ok") >= 1
    requests = sum(v for (name, _), v in samples.items() if name == "perseus_service_requests_total")
    assert at(samples, "perseus_service_request_duration_seconds_count") == requests
    assert at(samples, "perseus_service_request_duration_seconds_bucket", le="+Inf") == requests
    assert at(samples, "perseus_service_planning_duration_seconds_count") >= 1
    assert at(samples, "perseus_service_planning_duration_seconds_sum") > 0
    assert at(samples, "perseus_service_loop_tick_duration_seconds_count") > 0

    # What FAMILIES declares is what a service scrape holds (the GPU families: perseus monitor).
    names = {name for name, _ in samples}
    assert names <= exported_metrics()
    # Not here: the GPU families (perseus monitor's), deadlines (plans solved for a straggler's pace) and
    # model fits (this job sends no timelines; test_model_fit_metrics calibrates one).
    served_families = {n for n in FAMILIES if not n.startswith(("perseus_gpu_", "perseus_model_"))} - {
        "perseus_pipeline_deadline_seconds"
    }
    assert {n for n in served_families if any(s.startswith(n) for s in names)} == served_families


def test_a_busy_port_is_a_clear_error(serve, tmp_path):
    first = serve(extra=("--metrics-port", "0"))
    port = metrics_url(first).rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
        serve(tmp_path / "other", extra=("--metrics-port", port))


def test_no_saving_is_claimed_before_a_plan_ran(serve):
    """Before any planned iteration no saving is measured, so none is claimed: the gauge says 1,
    as its help says (while no reason is withheld: there is no measurement to withhold)."""
    served = serve(extra=("--metrics-port", "0"))
    url = metrics_url(served)
    clients = [PlannerClient(served.endpoint, timeout_s=2.0) for _ in range(2)]
    try:
        job_id = clients[0].register_job(job_spec(warmup_iterations=3))
        for r, client in enumerate(clients):
            client.register_rank(job_id, rank_info(r))
            for it in (0, 1, 2):  # warm-up: the measured baseline (the first sets up)
                client.report_iteration(job_id, r, it, 0.25, 30.0)
        assert all(c.flush(5.0) for c in clients)
        status = clients[0].status(job_id).jobs[0]
        samples = wait_until(lambda: (s := scrape(url)).get(("perseus_job_last_iteration", (("job", job_id),))) and s)
    finally:
        for c in clients:
            c.close()
    assert status.baseline_iterations == 2 and status.plan_version == 0 and status.measured_saving is None
    withheld = status.saving_withheld  # the baseline shown is short of a steady reading too:
    assert withheld.startswith("no planned iteration measured yet; the baseline iterations measured so far")
    assert "(2) span 0.50 s" in withheld
    assert at(samples, "perseus_job_saving_withheld", job=job_id) == 1
    assert ("perseus_job_measured_saving_ratio", (("job", job_id),)) not in samples
