"""The planner service as a real process on loopback: error replies, planning, restarts.

Each test starts `perseus serve` (about 0.3 s) and talks to it through raw DEALER sockets or
the PlannerClient.
"""

from __future__ import annotations

import os
import signal

import msgpack
import pytest
from server_helpers import FREQUENCIES, Served, job_spec, rank_info, raw_request, request, stage_profile, wait_until

from perseus.client.planner_client import PlannerClient
from perseus.planner import Planner
from perseus.profiler.profile import Profile
from perseus.schedules import build_schedule
from perseus.service.planning import merge_profiles
from perseus.wire.limits import HARD_MESSAGE_BYTES, MAX_MESSAGE_BYTES
from perseus.wire.phases import Phase
from perseus.wire.profiles import profile_to_wire


def _ping_ok(endpoint: str) -> None:
    reply = request(endpoint, "ping", request_id=99)
    assert reply is not None and reply["ok"] and reply["id"] == 99 and reply["protocol"] == 1


def _error(reply: dict | None) -> str:
    assert reply is not None, "no reply"
    assert reply["ok"] is False and reply["v"] == 1 and reply["error"]["message"], reply
    return reply["error"]["code"]


def test_every_bad_request_gets_an_error_reply_and_the_service_keeps_serving(serve):
    served = serve()
    ep = served.endpoint
    spec = job_spec()
    cases = [
        ((os.urandom(64),), "bad_frame"),
        ((b"\xc1",), "bad_frame"),  # a byte msgpack never uses
        ((msgpack.packb({"v": 1, "id": 5, "type": "ping"})[:-2],), "bad_frame"),  # truncated
        ((msgpack.packb("just a string"),), "bad_frame"),
        ((msgpack.packb({"v": 1, "id": 1, "type": "ping"}), b"second frame"), "bad_frame"),
        ((b"", msgpack.packb({"v": 1, "id": 1, "type": "ping"})), "bad_frame"),  # REQ-style delimiter
        ((msgpack.packb({"v": 2, "id": 1, "type": "ping"}),), "bad_version"),
        ((msgpack.packb({"id": 1, "type": "ping"}),), "bad_version"),
        ((msgpack.packb({"v": 1, "id": 1, "type": "shutdown"}),), "unknown_type"),
        (
            (msgpack.packb({"v": 1, "id": 1, "type": "register_job", "spec": {**spec.to_wire(), "pp": "two"}}),),
            "bad_field",
        ),
        (
            (msgpack.packb({"v": 1, "id": 1, "type": "register_job", "spec": {**spec.to_wire(), "world_size": 3}}),),
            "bad_field",
        ),
        ((msgpack.packb({"v": 1, "id": 1, "type": "get_table", "job_id": "job-00ff", "rank": 0}),), "unknown_job"),
        ((msgpack.packb({"v": 1, "id": 1, "type": "status", "job_id": "job-00ff"}),), "unknown_job"),
    ]
    for frames, code in cases:
        assert _error(raw_request(ep, *frames)) == code, frames
        _ping_ok(ep)
    # Known job, unknown rank; a well-formed request for a schedule that does not exist.
    assert request(ep, "register_job", spec=spec.to_wire())["ok"]
    assert _error(request(ep, "get_table", job_id=spec.job_id(), rank=1)) == "unknown_rank"
    assert _error(request(ep, "register_job", spec={**spec.to_wire(), "schedule_name": "zigzag"})) == "bad_field"
    assert (
        _error(request(ep, "register_rank", job_id=spec.job_id(), info=rank_info(1, stage=5).to_wire())) == "bad_field"
    )
    reply = request(ep, "register_rank", request_id=123, job_id=spec.job_id(), info=rank_info(1).to_wire())
    assert reply["ok"] and reply["id"] == 123 and reply["phase"] == "profiling"
    assert served.proc.poll() is None


def test_oversized_messages_are_refused(serve):
    served = serve()
    big = msgpack.packb({"v": 1, "id": 3, "type": "ping", "pad": b"x" * (MAX_MESSAGE_BYTES + 10)})
    reply = raw_request(served.endpoint, big)
    assert _error(reply) == "too_large" and str(MAX_MESSAGE_BYTES) in reply["error"]["message"]
    # Past the hard limit zmq drops the connection before the service sees the message.
    assert raw_request(served.endpoint, b"x" * (HARD_MESSAGE_BYTES + 1), timeout_s=0.5) is None
    _ping_ok(served.endpoint)


def test_job_profiles_plans_and_logs_predicted_against_measured(serve, tmp_path):
    served = serve()
    spec = job_spec()
    clients = [PlannerClient(served.endpoint, timeout_s=2.0, poll_interval_s=0.05) for _ in range(2)]
    try:
        job_id = clients[0].register_job(spec)
        for r, client in enumerate(clients):
            client.register_rank(job_id, rank_info(r))
        wait_until(lambda: all(c.assignment(0).phase == Phase.WARMUP for c in clients))
        for r, client in enumerate(clients):
            client.report_iteration(job_id, r, 0, 0.9, 80.0)  # the first iteration sets up: no baseline
            client.report_iteration(job_id, r, 1, 2.1, 30.0)  # warm-up: the baseline (2 s or more: claimed)
        # Warm-up, then the sweep the service designed (the rank walks its steps), 2 steps per frequency.
        a = clients[1].assignment(2 + 2 * 3 + 1)
        assert a.phase == Phase.PROFILING and a.sweep.frequencies == FREQUENCIES and a.frequencies is None
        assert [set(step.values()) for step in a.sweep.steps[6:8]] == [{FREQUENCIES[3]}, set(FREQUENCIES[2:4])]
        clients[0].upload_profile(job_id, 0, stage_profile(0))
        assert clients[0].assignment(4).phase == Phase.PLANNING  # uploaded: max clocks until the plan
        clients[1].assignment(5)  # the furthest iteration any rank reached: the plan starts after it
        clients[1].upload_profile(job_id, 1, stage_profile(1))
        assert all(c.wait_for_plan(20.0) for c in clients)

        expected = Planner(
            build_schedule("1f1b", 2, 4), merge_profiles({0: stage_profile(0), 1: stage_profile(1)}, None)
        ).plan()
        assert expected.stage_frequencies(0) != expected.stage_frequencies(1)  # the plan is not trivial
        start = min(i for i in range(100) if clients[0].assignment(i).phase == Phase.PLANNED)
        assert start > 5
        for r, client in enumerate(clients):
            a = client.assignment(start)
            assert a.phase == Phase.PLANNED and a.plan_version == 1 and a.frequencies == expected.stage_frequencies(r)
            assert client.assignment(start - 1).phase == Phase.PLANNING
            for it in range(start, start + 3):
                client.report_iteration(job_id, r, it, 0.23, 26.0 + r)
        assert all(c.flush(5.0) for c in clients)
        early = clients[0].status(job_id).jobs[0]
        assert early.planned_iterations == 3 and early.measured_saving is None and early.quiet_s is not None
        assert early.saving_withheld.startswith("the planned iterations measured so far (3) span 0.69 s; a saving")
        for r, client in enumerate(clients):
            for it in range(start + 3, start + 9):
                client.report_iteration(job_id, r, it, 0.23, 26.0 + r)
        assert all(c.flush(5.0) for c in clients)

        status = clients[0].status(job_id).jobs[0]
        assert status.phase == "planned" and status.plan_version == 1
        assert status.predicted_energy_j == pytest.approx(expected.energy_j)
        assert status.predicted_iteration_time_s == pytest.approx(expected.iteration_time_s)
        assert 0 < status.predicted_saving < 0.5
        assert status.baseline_iterations == 1 and status.baseline_energy_j == pytest.approx(60.0)
        assert status.planned_iterations == 9 and status.planned_energy_j == pytest.approx(53.0)
        assert status.planned_iteration_time_s == pytest.approx(0.23) and status.measured_saving == pytest.approx(
            1 - 53 / 60
        )
        assert f"job {job_id} iteration {start} (plan v1)" in served.log()
        # Each rank's close() reports its last iteration, a long one (the script's own work after
        # its last step): the ranks closed, and no mean counts it.
        for r, client in enumerate(clients):
            client.report_iteration(job_id, r, start + 9, 3.0, 90.0, closing=True)
        assert all(c.flush(5.0) for c in clients)
        closed = clients[0].status(job_id).jobs[0]
        assert closed.ranks_closed == 2 and closed.planned_iterations == 9 and closed.last_iteration == start + 8
        assert f"job {job_id}: rank 1 closed (2 of 2)" in served.log() or "rank 0 closed (2 of 2)" in served.log()
        state = tmp_path / "state"
        assert (state / "jobs" / job_id / "plan.json").exists() and (
            state / "profiles" / f"{spec.profile_key()}.json"
        ).exists()

        # A job whose instruction order deadlocks (B0 before F0 on stage 0): planning fails, the
        # job says why, its ranks stay at max clocks, and the service keeps serving (same
        # service, so the planner import is paid once).
        order = [[("backward", 0, 0), ("forward", 0, 0)], [("forward", 0, 0), ("backward", 0, 0)]]
        bad = job_spec(num_microbatches=1, stage_orders=order, tag="deadlock")
        with (
            PlannerClient(served.endpoint, poll_interval_s=0.05) as c0,
            PlannerClient(served.endpoint, poll_interval_s=0.05) as c1,
        ):
            c0.register_rank(c0.register_job(bad), rank_info(0))
            c1.register_rank(bad.job_id(), rank_info(1))
            c0.upload_profile(bad.job_id(), 0, stage_profile(0))
            c1.upload_profile(bad.job_id(), 1, stage_profile(1))
            failed = wait_until(lambda: [j for j in c0.status(bad.job_id()).jobs if j.phase == "failed"])[0]
            assert "deadlock" in failed.error
            wait_until(lambda: c0.assignment(100).phase == Phase.UNPLANNED)
        assert clients[0].status(job_id).jobs[0].phase == "planned"
    finally:
        for c in clients:
            c.close()


@pytest.mark.slow
def test_restarted_service_resumes_without_profiling_again(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    endpoint = served.endpoint
    spec = job_spec()
    c0 = PlannerClient(endpoint, timeout_s=3.0, poll_interval_s=0.05)
    c1 = PlannerClient(endpoint, timeout_s=3.0, poll_interval_s=0.05)
    try:
        job_id = c0.register_job(spec)
        c0.register_rank(job_id, rank_info(0))
        c1.register_rank(job_id, rank_info(1))
        c0.upload_profile(job_id, 0, stage_profile(0))
        assert c0.flush(5.0)
        # Acknowledged (not not_ready while the schedule still builds, which the client retries):
        wait_until(lambda: (st := c0.status(job_id)) is not None and st.jobs[0].profiled_stages == (0,), timeout_s=30)
        served.stop(signal.SIGKILL)  # mid-profiling: stage 0 is in, stage 1 is not

        served = serve(state, bind=endpoint)
        c1.upload_profile(job_id, 1, stage_profile(1))  # the client reconnects on its own
        assert c0.wait_for_plan(20.0) and c1.wait_for_plan(20.0)
        plan0, plan1 = c0.assignment(10_000), c1.assignment(10_000)
        assert "stage 0 profiled" not in served.log()  # stage 0 came from the state directory

        # A new job with the same signature (more warm-up, data parallel) skips profiling.
        other = job_spec(world_size=4, dp=2, warmup_iterations=5)
        with PlannerClient(endpoint, poll_interval_s=0.05) as c:
            assert c.register_job(other) != job_id
            reply = request(endpoint, "register_job", spec=other.to_wire())
            assert reply["ok"] and reply["cached"] is True
            c.register_rank(other.job_id(), rank_info(3, stage=1, dp_index=1))
            assert c.wait_for_plan(20.0)
            assignment = c.assignment(0)
            assert assignment.phase == Phase.PLANNED and assignment.frequencies == plan1.frequencies
        served.stop(signal.SIGKILL)  # planned: the plans are on disk

        assert c0.assignment(10_001) is plan0  # the service is gone: the rank keeps its plan
        served = serve(state, bind=endpoint)
        job = wait_until(lambda: c0.status(job_id), timeout_s=30).jobs[0]
        assert job.phase == "planned" and job.plan_version == 1 and job.profiled_stages == (0, 1)
        assert "planning" not in served.log()  # resumed, neither profiled nor planned again
        c1.report_iteration(job_id, 1, 10_002, 0.2, 20.0)
        assert c1.flush(5.0) and c1.assignment(10_002) is plan1
    finally:
        c0.close()
        c1.close()


def test_sigterm_stops_the_service_cleanly(serve):
    # The real entry point, once: it imports every command (the demo pulls in torch), a few seconds.
    served = serve(full_cli=True)
    _ping_ok(served.endpoint)
    assert served.stop(signal.SIGTERM) == 0
    assert "planner service stopped" in served.log()


def test_binding_beyond_loopback_needs_insecure_or_curve(serve):
    with pytest.raises(RuntimeError, match="--insecure"):
        serve(bind="tcp://0.0.0.0:0")
    served = serve(bind="tcp://0.0.0.0:0", extra=("--insecure",))
    assert "WITHOUT authentication" in served.log()
    assert served.stop() == 0


def test_profile_upload_of_another_stage_is_refused(serve):
    served = serve()
    spec = job_spec()
    assert request(served.endpoint, "register_job", spec=spec.to_wire())["ok"]
    assert request(served.endpoint, "register_rank", job_id=spec.job_id(), info=rank_info(0).to_wire())["ok"]
    wrong = Profile({(1, k): v for (_, k), v in stage_profile(0).points.items()}, 80.0)

    def upload():  # not_ready while the service still builds the job's schedule
        reply = request(
            served.endpoint, "upload_profile", job_id=spec.job_id(), rank=0, stage=0, profile=profile_to_wire(wrong)
        )
        return None if _error(reply) == "not_ready" else reply

    reply = wait_until(upload)
    assert _error(reply) == "bad_field" and "stages [1]" in reply["error"]["message"]


def test_bind_errors_say_what_to_change(serve, tmp_path):
    from perseus.exceptions import ConfigError
    from perseus.service.service import PlannerService

    busy = serve()
    for address, hint in (
        (busy.endpoint, "another perseus serve"),
        ("tcp://127.0.0.1:notaport", "--bind takes a ZeroMQ endpoint"),
    ):
        service = PlannerService(address, str(tmp_path / "other"))
        try:
            with pytest.raises(ConfigError, match=hint):
                service.bind()
        finally:
            service.close()


def test_a_second_service_on_the_same_state_directory_is_refused(tmp_path):
    """Two services resuming the same jobs would plan them twice and overwrite each other's records."""
    first = Served(tmp_path / "state")
    try:
        with pytest.raises(RuntimeError) as refused:
            Served(tmp_path / "state")
        assert f"another perseus serve (pid {first.proc.pid}) uses the state directory" in str(refused.value)
        assert "its own --state-dir" in str(refused.value)
    finally:
        assert first.stop() == 0
    second = Served(tmp_path / "state")  # free again once the first stopped
    assert second.stop() == 0
