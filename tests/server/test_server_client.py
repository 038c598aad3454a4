"""PlannerClient without a service, then with one: never blocks training, connects when it can."""

from __future__ import annotations

import logging
import signal
import time

import pytest
from server_helpers import FREQUENCIES, free_port, job_spec, rank_info, request

from perseus.client import connection
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


def test_rank_registered_before_its_job_waits_for_rank_0(serve, caplog):
    served = serve()
    spec = job_spec()
    caplog.set_level(logging.INFO, logger="perseus.client.connection")
    with PlannerClient(served.endpoint, timeout_s=0.3, poll_interval_s=0.05) as c1:
        c1.register_rank(spec.job_id(), rank_info(1))  # the job is unknown yet: retried in the background
        assert c1.assignment(0) is UNPLANNED
        with PlannerClient(served.endpoint, timeout_s=2.0) as c0:
            c0.register_job(spec)
            deadline = time.monotonic() + 10
            while c1.assignment(0).phase != Phase.WARMUP:
                assert time.monotonic() < deadline, "rank 1 never registered"
                time.sleep(0.02)
    # Normal while the ranks start: said at INFO, not as a WARNING.
    waiting = [r for r in caplog.records if "waiting for rank 0 to register it" in r.getMessage()]
    assert [r.levelno for r in waiting] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "rank 0" in r.getMessage()]


def test_a_job_rank_0_never_registers_is_warned_of_once(serve, caplog, monkeypatch):
    monkeypatch.setattr(connection, "NO_JOB_WARNING_S", 0.0)
    served = serve()
    caplog.set_level(logging.INFO, logger="perseus.client.connection")

    def warned():
        return [r for r in caplog.records if r.levelno == logging.WARNING and "still not registered" in r.getMessage()]

    with PlannerClient(served.endpoint, timeout_s=0.3, poll_interval_s=0.05) as c1:
        c1.register_rank(job_spec().job_id(), rank_info(1))
        deadline = time.monotonic() + 10
        while not warned():
            assert time.monotonic() < deadline, "no warning while the job stayed unregistered"
            time.sleep(0.02)
        time.sleep(0.3)  # several more retries (every 0.05 s), each unanswered: the warning stays one
        assert c1.assignment(0) is UNPLANNED
    (warning,) = warned()
    assert "PERSEUS_PLANNER" in warning.getMessage() and "default clocks" in warning.getMessage()


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
