"""PlannerClient without a service, then with one: never blocks training, connects when it can."""

from __future__ import annotations

import logging
import signal
import time

import pytest
from server_helpers import FREQUENCIES, free_port, job_spec, rank_info, request

from perseus.client.planner_client import UNPLANNED, PlannerClient
from perseus.exceptions import ConfigError, ServiceError
from perseus.wire.phases import Phase


def test_client_without_service_runs_unplanned_then_connects_when_it_starts(serve, tmp_path, caplog):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spec = job_spec()
    caplog.set_level(logging.INFO, logger="perseus.client")
    with (
        PlannerClient(endpoint, timeout_s=0.3, poll_interval_s=0.05) as c0,
        PlannerClient(endpoint, timeout_s=0.3, poll_interval_s=0.05) as c1,
    ):
        start = time.monotonic()
        job_id = c0.register_job(spec)  # nobody answers: returns after the timeout, retried later
        c0.register_rank(job_id, rank_info(0))
        c1.register_rank(job_id, rank_info(1))
        assert time.monotonic() - start < 3 * 0.3 + 10  # each call waits its timeout once, not until the service comes
        assert job_id == spec.job_id()
        slowest = 0.0
        for it in range(200):
            t = time.perf_counter()
            assert c0.assignment(it) is UNPLANNED
            slowest = max(slowest, time.perf_counter() - t)
        assert slowest < 0.3  # a dict lookup, never a network wait (which lasts the 0.3 s timeout)
        time.sleep(0.7)  # a few timeouts pass: still one warning per client
        warnings = [r for r in caplog.records if "did not answer" in r.getMessage()]
        assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)  # one per client

        served = serve(bind=endpoint)
        deadline = time.monotonic() + 10
        while not (c0.assignment(0).phase == Phase.WARMUP and c1.assignment(0).phase == Phase.WARMUP):
            assert time.monotonic() < deadline, "clients did not connect"
            time.sleep(0.02)
        assert c1.assignment(2).sweep.frequencies == FREQUENCIES
        assert "reachable again" in caplog.text and "rank 1 registered" in served.log()
        assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) == len(warnings)


def test_client_raises_only_for_what_the_user_must_fix(serve):
    served = serve()
    with PlannerClient(served.endpoint, timeout_s=2.0) as client:
        with pytest.raises(ConfigError, match="zigzag"):
            job_spec(schedule_name="zigzag")  # the spec the service would refuse cannot be built
        reply = request(served.endpoint, "register_job", spec={**job_spec().to_wire(), "schedule_name": "zigzag"})
        assert reply["error"]["code"] == "bad_field" and "zigzag" in reply["error"]["message"]
        job_id = client.register_job(job_spec(world_size=4, tp=2))
        client.register_rank(job_id, rank_info(0, stage=0))
        with PlannerClient(served.endpoint, timeout_s=2.0) as peer, pytest.raises(ServiceError, match="GPU"):
            peer.register_rank(
                job_id, rank_info(1, stage=0, tp_index=1, gpu_model="h100")
            )  # tensor-parallel peers share a model
        client.report_iteration(job_id, 0, 1, float("nan"), 1.0)  # dropped with a warning, never raised
    with pytest.raises(ConfigError, match="endpoint"):
        PlannerClient("localhost:7787")
    with PlannerClient(served.endpoint) as client:
        with pytest.raises(ConfigError, match="register_rank"):
            client.upload_profile("job-00", 0, None)  # type: ignore[arg-type]


def test_rank_registered_before_its_job_waits_for_rank_0(serve):
    served = serve()
    spec = job_spec()
    with PlannerClient(served.endpoint, timeout_s=0.3, poll_interval_s=0.05) as c1:
        c1.register_rank(spec.job_id(), rank_info(1))  # the job is unknown yet: retried in the background
        assert c1.assignment(0) is UNPLANNED
        with PlannerClient(served.endpoint, timeout_s=2.0) as c0:
            c0.register_job(spec)
            deadline = time.monotonic() + 10
            while c1.assignment(0).phase != Phase.WARMUP:
                assert time.monotonic() < deadline, "rank 1 never registered"
                time.sleep(0.02)


def test_client_close_is_bounded_when_the_service_is_gone(serve):
    served = serve()
    client = PlannerClient(served.endpoint, timeout_s=3.0, poll_interval_s=0.05)
    job_id = client.register_job(job_spec())
    client.register_rank(job_id, rank_info(0))
    served.stop(signal.SIGKILL)
    for it in range(5):
        client.report_iteration(job_id, 0, it, 0.1, 10.0)
    start = time.monotonic()
    client.close()
    assert time.monotonic() - start < 3.0 + 6.0  # one timeout and a margin, not one per queued report (15 s)
