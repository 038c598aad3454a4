"""`perseus status --png DIR` against a real `perseus serve`: a job driven to its plan by real
clients (as in tests/metrics/test_service_metrics.py), and one frontier PNG per job written
from what the service's status holds."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_helpers import job_spec, rank_info, stage_profile, wait_until

from perseus.client.planner_client import PlannerClient
from perseus.wire.phases import Phase

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_status_writes_a_frontier_png_per_job(serve, tmp_path):
    served = serve()
    clients = [PlannerClient(served.endpoint, timeout_s=2.0, poll_interval_s=0.05) for _ in range(2)]
    try:
        job_id = clients[0].register_job(job_spec())
        for r, client in enumerate(clients):
            client.register_rank(job_id, rank_info(r))
        wait_until(lambda: all(c.assignment(0).phase == Phase.WARMUP for c in clients))
        for r, client in enumerate(clients):
            client.report_iteration(job_id, r, 0, 0.25, 30.0)
        for r, client in enumerate(clients):
            client.upload_profile(job_id, r, stage_profile(r))
        assert all(c.wait_for_plan(20.0) for c in clients)
        start = min(i for i in range(100) if clients[0].assignment(i).phase == Phase.PLANNED)
        for r, client in enumerate(clients):
            for it in range(start, start + 3):
                client.report_iteration(job_id, r, it, 0.23, 26.0 + r)
        assert all(c.flush(5.0) for c in clients)
        wait_until(lambda: clients[0].status(job_id).jobs[0].planned_iterations == 3)
    finally:
        for c in clients:
            c.close()

    out_dir = tmp_path / "plots"
    done = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "status", "--address", served.endpoint, "--png", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert f"job {job_id}: planned" in done.stdout
    png = out_dir / f"{job_id}-frontier.png"
    assert f"wrote {png}" in done.stderr
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in out_dir.iterdir()] == [png.name]  # atomic: no temp file left
