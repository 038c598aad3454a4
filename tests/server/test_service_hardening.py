"""Regression tests of the adversarial review of the planner service: sequences of valid messages,
disk errors, damaged state and resource budgets. Each test names the finding it covers.

Most run a real `perseus serve` process; budget and eviction tests drive a `PlannerService` in
this process with a simulated clock, so idle times are exact and nothing waits on the wall clock.
"""

from __future__ import annotations

import errno
import json
import logging
import resource
import socket
import time

import msgpack
import pytest
from server_helpers import FREQUENCIES, job_spec, rank_info, request, stage_profile, wait_until

from perseus.service.budget import Budget, job_cost_bytes
from perseus.service.service import PlannerService
from perseus.service.state import StateDir
from perseus.wire.limits import MAX_RANK_ITERATION, SWEEP_VERSION
from perseus.wire.profiles import profile_to_wire
from perseus.wire.spec import JobSpec


def _ok(reply: dict | None) -> dict:
    assert reply is not None, "no reply"
    assert reply["ok"], reply
    return reply


def _code(reply: dict | None) -> str:
    assert reply is not None, "no reply"
    assert not reply["ok"], reply
    return reply["error"]["code"]


def _register(endpoint: str, spec: JobSpec | None = None) -> str:
    spec = spec or job_spec()
    job_id = _ok(request(endpoint, "register_job", spec=spec.to_wire()))["job_id"]
    for rank in range(spec.world_size):
        _ok(request(endpoint, "register_rank", job_id=job_id, info=rank_info(rank).to_wire()))
    return job_id


def _upload(endpoint: str, job_id: str, stage: int, profile=None) -> dict | None:
    """Upload a stage's profile, retrying while the schedule is still being built."""
    wire = profile_to_wire(profile or stage_profile(stage))

    def attempt():
        reply = request(endpoint, "upload_profile", job_id=job_id, rank=stage, stage=stage, profile=wire)
        return None if reply and not reply["ok"] and reply["error"]["code"] == "not_ready" else reply

    return wait_until(attempt)


def _job_status(endpoint: str, job_id: str) -> dict:
    return _ok(request(endpoint, "status", job_id=job_id))["jobs"][0]


def _planned(endpoint: str, job_id: str) -> dict:
    return wait_until(lambda: (s := _job_status(endpoint, job_id))["phase"] == "planned" and s, timeout_s=60)


# ---- 1. a remote crash from tiny iteration times ------------------------------------------------


def test_finding_1_tiny_iteration_times_are_refused_and_planning_still_publishes(serve):
    served = serve()
    job_id = _register(served.endpoint)
    for rank in (0, 1):
        reply = request(
            served.endpoint, "report_iteration", job_id=job_id, rank=rank, iteration=0, time_s=5e-324, energy_j=1.0
        )
        assert _code(reply) == "bad_field" and "time_s" in reply["error"]["message"]
        _ok(
            request(
                served.endpoint, "report_iteration", job_id=job_id, rank=rank, iteration=1, time_s=1e-6, energy_j=1e-4
            )
        )
    for stage in (0, 1):
        _ok(_upload(served.endpoint, job_id, stage))
    assert _planned(served.endpoint, job_id)["plan_version"] == 1
    table = _ok(request(served.endpoint, "get_table", job_id=job_id, rank=0, iteration=2))
    assert table["plan_start_iteration"] > 2 and table["frequencies"]
    assert served.proc.poll() is None


# ---- 2. one message that costs gigabytes; jobs without end ---------------------------------------


def test_finding_2_a_job_over_the_per_job_budget_is_refused_at_once(serve):
    served = serve()
    spec = JobSpec(1 << 20, 1, dp=1 << 20, schedule_name="1f1b", num_microbatches=1, gpu_model="sim-a100")
    reply = request(served.endpoint, "register_job", spec=spec.to_wire())
    assert _code(reply) == "over_budget"
    assert "at most 65536" in reply["error"]["message"] and "--max-job-ranks" in reply["error"]["message"]
    assert _ok(request(served.endpoint, "status"))["jobs"] == []


def test_a_rank_computing_its_own_sweep_is_told_to_upgrade(tmp_path):
    local = Local(tmp_path)
    job_id = local.register(4)
    _ok(local.call("register_rank", job_id=job_id, info=rank_info(0).to_wire()))
    old = local.call("get_table", job_id=job_id, rank=0)  # an earlier release: no sweep_version
    assert _code(old) == "bad_version" and "upgrade perseus on the ranks" in old["error"]["message"]
    table = _ok(local.call("get_table", job_id=job_id, rank=0, sweep_version=2))
    assert len(table["sweep_steps"]) == 2 * len(FREQUENCIES)
    local.settle()  # the schedule is built: profiles are taken
    wire = profile_to_wire(stage_profile(0))
    _ok(local.call("upload_profile", job_id=job_id, rank=0, stage=0, profile=wire))
    assert "sweep_steps" not in _ok(local.call("get_table", job_id=job_id, rank=0))  # profiled: no sweep to follow


class Local:
    """A PlannerService in this process with a simulated clock: requests go straight to `handle`."""

    def __init__(self, tmp_path, **budget) -> None:
        self.now = 1000.0
        self.service = PlannerService(
            "tcp://127.0.0.1:0", str(tmp_path / "state"), budget=Budget(**budget), clock=lambda: self.now
        )

    def call(self, type_: str, **fields) -> dict:
        _, reply = self.service.handle([b"peer", msgpack.packb({"v": 1, "id": 1, "type": type_, **fields})])
        return msgpack.unpackb(reply, raw=False)

    def register(self, microbatches: int) -> str:
        return _ok(self.call("register_job", spec=job_spec(num_microbatches=microbatches).to_wire()))["job_id"]

    def profile(self, job_id: str) -> None:
        """Both ranks of a 2-stage job register and upload their stage's profile."""
        for rank in (0, 1):
            _ok(self.call("register_rank", job_id=job_id, info=rank_info(rank).to_wire()))
        for stage in (0, 1):
            wire = profile_to_wire(stage_profile(stage))
            _ok(self.call("upload_profile", job_id=job_id, rank=stage, stage=stage, profile=wire))

    def settle(self) -> None:
        """Tend the service until its schedule builder and planners are idle."""
        self.service.tend()
        deadline = time.monotonic() + 120
        while self.service.busy:
            assert time.monotonic() < deadline, "the service's workers did not finish"
            time.sleep(0.01)
            self.service.tend()


def test_finding_2_the_job_cap_evicts_the_least_recently_active_idle_job_else_refuses(tmp_path):
    local = Local(tmp_path, max_jobs=2, evict_idle_s=60.0)
    first = local.register(4)
    local.now += 30
    second = local.register(5)
    local.settle()
    reply = local.call("register_job", spec=job_spec(num_microbatches=6).to_wire())
    assert _code(reply) == "over_budget" and "none has been idle 60 s" in reply["error"]["message"]
    local.now += 45  # first idle 75 s, second 45 s
    third = local.register(6)
    local.settle()
    assert set(local.service.jobs) == {second, third}
    assert not (tmp_path / "state" / "jobs" / first).exists()
    assert _code(local.call("get_table", job_id=first, rank=0)) == "unknown_job"


def test_finding_2_jobs_idle_past_their_time_to_live_are_evicted_and_their_profile_stays_cached(tmp_path):
    local = Local(tmp_path, job_ttl_s=3600.0)
    job_id = local.register(4)
    local.settle()
    local.profile(job_id)
    local.settle()
    assert local.service.jobs[job_id].plans
    local.now += 3599
    _ok(local.call("get_table", job_id=job_id, rank=0))  # activity restarts the idle time
    local.now += 3599
    local.service.tend()
    assert job_id in local.service.jobs
    local.now += 11
    local.service.tend()
    assert job_id not in local.service.jobs
    again = _ok(local.call("register_job", spec=job_spec(num_microbatches=4).to_wire()))
    assert again["job_id"] == job_id and again["cached"]  # back: no profiling


def test_finding_2_the_memory_budget_counts_every_job(tmp_path):
    first, second = (job_cost_bytes(job_spec(num_microbatches=microbatches)) for microbatches in (4, 8))
    local = Local(tmp_path, memory_bytes=first + second - 1, evict_idle_s=60.0)
    local.register(4)
    reply = local.call("register_job", spec=job_spec(num_microbatches=8).to_wire())
    assert _code(reply) == "over_budget" and "MiB of jobs" in reply["error"]["message"]
    big = JobSpec(64, 2, dp=32, schedule_name="1f1b", num_microbatches=4, gpu_model="sim-a100")
    assert "MiB of service memory" in local.call("register_job", spec=big.to_wire())["error"]["message"]


# ---- 3. a write error kills the service ---------------------------------------------------------


class FlakyState(StateDir):
    """A state directory whose writes fail with `error` while it is set (a full or read-only disk)."""

    error: OSError | None = None

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def save_job(self, record):
        self._check()
        super().save_job(record)

    def save_stage_profile(self, job_id, name, profile):
        self._check()
        super().save_stage_profile(job_id, name, profile)

    def save_plan_document(self, job_id, document, name="plan"):
        self._check()
        super().save_plan_document(job_id, document, name)

    def save_cached_profile(self, key, signature, profile):
        self._check()
        super().save_cached_profile(key, signature, profile)


def test_finding_3_write_errors_degrade_the_job_refuse_unsaved_profiles_and_recover(tmp_path):
    local = Local(tmp_path)
    state = local.service.keeper.state = FlakyState(tmp_path / "state")
    job_id = local.register(4)
    local.settle()
    for rank in (0, 1):
        _ok(local.call("register_rank", job_id=job_id, info=rank_info(rank).to_wire()))
    wire = {stage: profile_to_wire(stage_profile(stage)) for stage in (0, 1)}
    _ok(local.call("upload_profile", job_id=job_id, rank=0, stage=0, profile=wire[0]))
    state.error = OSError(errno.ENOSPC, "No space left on device")
    reply = local.call("upload_profile", job_id=job_id, rank=1, stage=1, profile=wire[1])
    assert _code(reply) == "not_ready" and "No space left on device" in reply["error"]["message"]
    assert local.service.jobs[job_id].profiled_stages == (0,)  # not acknowledged, not kept
    state.error = None
    _ok(local.call("upload_profile", job_id=job_id, rank=1, stage=1, profile=wire[1]))
    state.error = OSError(errno.EROFS, "Read-only file system")
    local.settle()  # the plan is solved while the disk refuses its document
    status = local.call("status", job_id=job_id)["jobs"][0]
    assert status["phase"] == "planned" and "Read-only file system" in status["warning"]
    assert _ok(local.call("get_table", job_id=job_id, rank=0, iteration=0))["frequencies"]
    state.error = None
    local.service.keeper.saved_at = 0.0
    local.service.tend()
    assert "warning" not in local.call("status", job_id=job_id)["jobs"][0]
    assert json.loads((tmp_path / "state" / "jobs" / job_id / "job.json").read_text())["plans"]


def test_finding_3_a_bug_in_one_jobs_planning_fails_that_job_only(tmp_path):
    local = Local(tmp_path)
    broken, healthy = local.register(4), local.register(5)
    local.settle()

    def publish():
        raise RuntimeError("a bug")

    local.service.jobs[broken].publish = publish
    for job_id in (broken, healthy):
        for rank in (0, 1):
            _ok(local.call("register_rank", job_id=job_id, info=rank_info(rank).to_wire()))
        for stage in (0, 1):
            local.call(
                "upload_profile", job_id=job_id, rank=stage, stage=stage, profile=profile_to_wire(stage_profile(stage))
            )
    local.settle()
    statuses = {s["job_id"]: s for s in local.call("status")["jobs"]}
    assert statuses[broken]["phase"] == "failed" and "RuntimeError: a bug" in statuses[broken]["error"]
    assert statuses[healthy]["phase"] == "planned"


# ---- 4. one bad file stops the service from starting ----------------------------------------


def test_finding_4_damaged_state_files_are_quarantined_and_the_rest_resumes(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    good = _register(served.endpoint)
    for stage in (0, 1):
        _ok(_upload(served.endpoint, good, stage))
    _planned(served.endpoint, good)
    profiled = _register(served.endpoint, job_spec(num_microbatches=5))
    _ok(_upload(served.endpoint, profiled, 0))
    served.stop()

    jobs = state / "jobs"
    record = json.loads((jobs / good / "job.json").read_text())
    for name, doc in (
        ("null", None),
        ("list", []),
        ("plans", {**record, "plans": "x"}),
        ("declared", {**record, "declared": [1]}),
    ):
        folder = jobs / f"job-{name.encode().hex():0<16}"[:20]
        folder.mkdir()
        (folder / "job.json").write_text(json.dumps(doc))
    (jobs / "junk").write_text("not a job")
    stage_file = jobs / profiled / "stage-0.json"
    doc = json.loads(stage_file.read_text())
    stage_file.write_text(json.dumps({**doc, "meta": [1]}))

    served = serve(state)
    statuses = {s["job_id"]: s for s in _ok(request(served.endpoint, "status"))["jobs"]}
    assert set(statuses) == {good, profiled}
    assert statuses[good]["phase"] == "planned"
    assert statuses[profiled]["profiled_stages"] == []  # its damaged profile is taken again
    quarantined = sorted(p.name.split(".")[0] for p in (state / "quarantine").iterdir())
    assert len(quarantined) == 6 and "junk" in quarantined and "stage-0" in quarantined
    assert served.log().count("quarantined") == 6


# ---- 5. poisoned jobs --------------------------------------------------------------------------


def test_finding_5_huge_iterations_are_refused_and_do_not_poison_later_plans(serve):
    served = serve()
    job_id = _register(served.endpoint)
    assert _code(request(served.endpoint, "get_table", job_id=job_id, rank=0, iteration=2**62)) == "bad_field"
    _ok(_upload(served.endpoint, job_id, 1))  # the schedule is built: stage 0's profile can be overdue
    # Far past the sweep without its profile: the stage is asked to sweep again (which a v2 rank cannot).
    huge = dict(job_id=job_id, rank=0, iteration=MAX_RANK_ITERATION)
    assert _ok(request(served.endpoint, "get_table", **huge, sweep_version=SWEEP_VERSION))["sweep_round"] == 1
    assert _code(request(served.endpoint, "get_table", **huge, sweep_version=2)) == "bad_version"
    _ok(_upload(served.endpoint, job_id, 0))
    _planned(served.endpoint, job_id)
    table = _ok(request(served.endpoint, "get_table", job_id=job_id, rank=1, iteration=MAX_RANK_ITERATION))
    assert table["plan_start_iteration"] > MAX_RANK_ITERATION


def test_forged_reports_from_a_client_of_its_own_neither_stall_the_job_nor_skew_its_saving(serve):
    served = serve()
    job_id = _register(served.endpoint)
    for stage in (0, 1):
        _ok(_upload(served.endpoint, job_id, stage))
    _planned(served.endpoint, job_id)

    def report(rank, iteration, time_s=1.5, energy_j=300.0):
        return request(
            served.endpoint,
            "report_iteration",
            job_id=job_id,
            rank=rank,
            iteration=iteration,
            time_s=time_s,
            energy_j=energy_j,
        )

    for iteration in range(2):
        for rank in (0, 1):
            _ok(report(rank, iteration))
    wild = report(1, MAX_RANK_ITERATION - 1)
    assert _code(wild) == "bad_field" and "the median rank" in wild["error"]["message"]
    # A day-long iteration of 10 MJ from one rank (inside the wire's limits): left out of the means.
    _ok(report(0, 2))
    _ok(report(1, 2, time_s=86_400.0, energy_j=1e7))
    status = _job_status(served.endpoint, job_id)
    assert status["last_iteration"] == 2
    # Planned from 0, but iteration 0 sets up: never averaged.
    assert status["planned_iterations"] == 1 and status["planned_energy_j"] == pytest.approx(600.0)
    table = _ok(request(served.endpoint, "get_table", job_id=job_id, rank=0, iteration=3, plan_version=0))
    assert table["plan_version"] >= 1 and table["plan_start_iteration"] < 1000
    assert served.proc.poll() is None


def test_finding_5_a_job_with_enormous_energy_does_not_break_the_status_of_all_jobs(serve):
    served = serve()
    other = _register(served.endpoint, job_spec(num_microbatches=5))
    huge = _register(served.endpoint)
    for stage in (0, 1):
        profile = stage_profile(stage)
        for points in profile.points.values():
            # 5 MJ over 1,000 s per instruction at the top clock: 5 kW, within what one GPU may draw.
            points[:] = [
                type(p)(p.frequency, 1e3 * p.time / points[0].time, 5e6 * p.time / points[0].time) for p in points
            ]
        _ok(_upload(served.endpoint, huge, stage, profile))
    _planned(served.endpoint, huge)
    for iteration in range(3):
        for rank in (0, 1):
            _ok(
                request(
                    served.endpoint,
                    "report_iteration",
                    job_id=huge,
                    rank=rank,
                    iteration=iteration,
                    time_s=86_400.0,
                    energy_j=1e7,
                )
            )
    jobs = {s["job_id"]: s for s in _ok(request(served.endpoint, "status"))["jobs"]}
    assert jobs[huge]["predicted_energy_j"] > 5e7 and other in jobs


def test_finding_5_a_job_whose_status_cannot_be_told_does_not_hide_the_others(tmp_path):
    local = Local(tmp_path)
    broken, healthy = local.register(4), local.register(5)

    def status():
        raise OverflowError("a bug")

    local.service.jobs[broken].status = status
    jobs = {s["job_id"]: s for s in _ok(local.call("status"))["jobs"]}
    assert "OverflowError: a bug" in jobs[broken]["error"] and jobs[healthy]["phase"] == "profiling"


def test_finding_5_a_damaged_cached_profile_is_quarantined_and_the_job_profiles_again(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    job_id = _register(served.endpoint)
    for stage in (0, 1):
        _ok(_upload(served.endpoint, job_id, stage))
    _planned(served.endpoint, job_id)
    served.stop()
    (cached,) = (state / "profiles").iterdir()
    cached.write_bytes(b"\xff\xfe\x00binary\x80" * 10)
    for folder in (state / "jobs").iterdir():
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    served = serve(state)
    reply = _ok(request(served.endpoint, "register_job", spec=job_spec().to_wire()))
    assert reply["phase"] == "profiling" and not reply["cached"]
    assert "quarantined" in served.log()


# ---- 6. unbounded work -------------------------------------------------------------------------


def test_finding_6_a_profile_over_the_planning_budget_fails_its_job_with_a_clear_error(tmp_path):
    local = Local(tmp_path, max_plan_choices=20)
    job_id = local.register(4)
    local.settle()
    local.profile(job_id)
    local.settle()
    status = local.call("status", job_id=job_id)["jobs"][0]
    assert status["phase"] == "failed"
    assert "80 (instruction, frequency) choices, over the service's planning budget of 20" in status["error"]


def test_finding_6_replies_to_messages_with_many_unknown_keys_stay_small(serve):
    served = serve()
    fields = {f"k{i}": 0 for i in range(350_000)}
    reply = request(served.endpoint, "ping", **fields)
    assert _code(reply) == "bad_field"
    assert len(reply["error"]["message"]) < 500 and "and 349992 more" in reply["error"]["message"]
    assert len(served.log()) < 10_000


# ---- 7. smaller holes --------------------------------------------------------------------------


def test_finding_7_profiles_at_frequencies_the_rank_does_not_support_are_refused(serve):
    served = serve()
    job_id = _register(served.endpoint)
    profile = stage_profile(0)
    for points in profile.points.values():
        points.append(type(points[0])(600, points[-1].time * 1.5, points[-1].energy))
    reply = _upload(served.endpoint, job_id, 0, profile)
    assert _code(reply) == "bad_field" and "[600] MHz" in reply["error"]["message"]


@pytest.mark.parametrize("name", ["sim\nINFO forged line", "sim\x1b[31mred"])
def test_finding_7_names_with_control_characters_are_refused(serve, name):
    served = serve()
    reply = request(served.endpoint, "register_job", spec={**job_spec().to_wire(), "gpu_model": name})
    assert _code(reply) == "bad_field" and "printable" in reply["error"]["message"]
    log = served.log()
    assert "\x1b" not in log and not any(line.startswith("INFO forged") for line in log.splitlines())


@pytest.mark.slow
def test_finding_7_idle_connections_do_not_lock_out_new_peers(serve):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit here is {hard}: too low to hold 2,000 connections in this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what the service inherits: the usual default
    try:
        served = serve()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    host, port = served.endpoint.removeprefix("tcp://").rsplit(":", 1)
    idle = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection((host, int(port))))
        _ok(request(served.endpoint, "ping"))
    finally:
        for s in idle:
            s.close()


# ---- found by the stateful fuzzer ----------------------------------------------------------------


def test_a_job_resumes_when_its_first_rank_supports_fewer_frequencies_than_a_lower_one(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    job_id = _ok(request(served.endpoint, "register_job", spec=job_spec().to_wire()))["job_id"]
    _ok(
        request(
            served.endpoint, "register_rank", job_id=job_id, info=rank_info(1, frequencies=FREQUENCIES[1:]).to_wire()
        )
    )
    _ok(request(served.endpoint, "register_rank", job_id=job_id, info=rank_info(0).to_wire()))
    served.stop()
    served = serve(state)
    status = _job_status(served.endpoint, job_id)
    assert status["ranks_registered"] == 2 and status["phase"] == "profiling"


def test_a_failed_job_stays_failed_across_a_restart(serve, tmp_path):
    state = tmp_path / "state"
    served = serve(state)
    spec = JobSpec(
        1, 1, schedule_name="custom", num_microbatches=1, gpu_model="sim-a100", stage_orders=(((("forward", 0, 0),),))
    )
    job_id = _ok(request(served.endpoint, "register_job", spec=spec.to_wire()))["job_id"]
    wait_until(lambda: _job_status(served.endpoint, job_id)["phase"] == "failed")
    served.stop()
    served = serve(state)
    status = _job_status(served.endpoint, job_id)
    assert status["phase"] == "failed" and "invalid job" in status["error"]


def test_a_rank_back_on_another_gpu_model_gets_no_plan_made_for_the_old_one(tmp_path):
    local = Local(tmp_path)
    job_id = local.register(4)
    local.settle()
    local.profile(job_id)
    local.settle()
    assert _ok(local.call("get_table", job_id=job_id, rank=1, sweep_version=2))["frequencies"]
    other = rank_info(1, gpu_model="sim-a40", frequencies=(1740, *FREQUENCIES))
    _ok(local.call("register_rank", job_id=job_id, info=other.to_wire()))
    table = _ok(local.call("get_table", job_id=job_id, rank=1, sweep_version=2))
    assert table["plan_version"] == 0 and table["frequencies"] is None


def test_a_rank_going_back_far_in_its_iterations_is_warned_about_once(tmp_path, caplog):
    local = Local(tmp_path)
    job_id = local.register(4)
    local.settle()
    local.profile(job_id)

    def report(rank, iteration):
        return local.call("report_iteration", job_id=job_id, rank=rank, iteration=iteration, time_s=1.0, energy_j=100.0)

    for iteration in range(0, 400, 50):
        for rank in (0, 1):
            _ok(report(rank, iteration))
    with caplog.at_level(logging.WARNING, logger="perseus.service.handlers"):
        _ok(report(0, 3))  # a second training of the same spec, from its start
        _ok(report(0, 4))
    warnings = [r.getMessage() for r in caplog.records if "reports iteration 3 after 350" in r.getMessage()]
    assert len(warnings) == 1 and "its own tag" in warnings[0]
    assert _ok(local.call("status", job_id=job_id))["jobs"][0]["last_iteration"] == 350


def test_a_job_whose_ranks_go_quiet_before_closing_is_logged_once_per_quiet_spell(tmp_path, caplog):
    # A rank killed (SIGKILL, or torchrun's SIGTERM after another rank failed) reports nothing: the
    # service says so in its log once the job is quiet as long as `perseus status` calls it quiet.
    local = Local(tmp_path)
    job_id = local.register(4)
    local.settle()
    local.profile(job_id)

    def report(rank, iteration, closing=False):
        _ok(
            local.call(
                "report_iteration",
                job_id=job_id,
                rank=rank,
                iteration=iteration,
                time_s=1.0,
                energy_j=100.0,
                closing=closing,
            )
        )

    def quiet_warnings():
        local.now += 11  # past the service's check interval
        with caplog.at_level(logging.WARNING, logger="perseus.service.service"):
            local.service.tend()
        return [r.getMessage() for r in caplog.records if "no iteration reported for" in r.getMessage()]

    for iteration in range(5):
        for rank in (0, 1):
            report(rank, iteration)
    local.now += 8  # 19 s quiet at the check: under the 30 s (and ten 1 s iterations) of a quiet job
    assert quiet_warnings() == []
    told = quiet_warnings()  # 30 s
    assert len(told) == 1 and f"job {job_id}: no iteration reported for 30 s (the last: 4)" in told[0]
    assert "2 of 2 ranks never closed" in told[0]
    assert quiet_warnings() == told  # once per quiet spell
    report(0, 5)  # the job goes on: a later spell is told again
    report(1, 5, closing=True)
    local.now += 30
    again = quiet_warnings()[1:]
    assert len(again) == 1 and "(the last: 5) and 1 of 2 ranks never closed" in again[0]
    report(0, 6, closing=True)  # every rank closed: the job ended, nothing to tell
    local.now += 60
    assert quiet_warnings()[2:] == []
