"""Who uploads a stage's profile, and registering jobs without stalling the service: schedules
built on a worker, invalid ones failing the job, the spec saved once. A few seconds: two real
`perseus serve` processes."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from server_helpers import job_spec, rank_info, stage_profile, wait_until

from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ServiceError
from perseus.profiler.profile import Profile, ProfilePoint, load_profile
from perseus.schedules import build_schedule
from perseus.service.job import Job
from perseus.service.service import PlannerService
from perseus.service.state import StateDir
from perseus.wire.limits import MAX_INSTRUCTIONS
from perseus.wire.messages import RegisterJob, RegisterRank, Table, UploadProfile
from perseus.wire.phases import Phase

A100, A40 = "sim-a100", "sim-a40"


def _orders(schedule) -> tuple:
    return tuple(tuple((i.kind.value, i.microbatch, i.chunk) for i in row) for row in schedule.stages)


def test_the_lowest_data_parallel_index_on_each_gpu_model_uploads():
    job = Job(job_spec(world_size=8, dp=2, tp=2))  # explicit mapping: ranks state their coordinates
    job.add_rank(rank_info(4, stage=0, dp_index=1, tp_index=0))
    assert job.table(4, 0, 0).upload  # the only replica so far
    job.add_rank(rank_info(0, stage=0, dp_index=0, tp_index=0))
    job.add_rank(rank_info(1, stage=0, dp_index=0, tp_index=1))
    job.add_rank(rank_info(5, stage=0, dp_index=1, tp_index=1))
    assert [job.table(r, 0, 0).upload for r in (0, 1, 4, 5)] == [True, True, False, False]  # every tp share uploads
    for r, tp_index in ((6, 0), (7, 1)):  # pipeline 1's stage 1 runs on another GPU model: it profiles that model
        job.add_rank(rank_info(r, stage=1, dp_index=1, tp_index=tp_index, gpu_model=A40))
    job.add_rank(rank_info(2, stage=1, dp_index=0, tp_index=0))
    assert job.table(6, 0, 0).upload and job.table(7, 0, 0).upload and job.table(2, 0, 0).upload
    job.add_rank(rank_info(0, stage=1, dp_index=0, tp_index=1))  # rank 0 moves: uploaders recounted
    assert job.table(4, 0, 0).upload and job.table(0, 0, 0).upload and job.table(6, 0, 0).upload
    # On the wire "upload" is omitted when true, as earlier releases (every rank uploads) read it.
    table = job.table(4, 0, 0)
    assert "upload" not in table.to_wire() and job.table(5, 0, 0).to_wire()["upload"] is False
    assert Table.from_wire(table.to_wire()).upload is True


def _scaled(profile: Profile, factor: float) -> Profile:
    points = {
        key: [ProfilePoint(p.frequency, p.time * factor, p.energy * factor) for p in pts]
        for key, pts in profile.points.items()
    }
    return Profile(points, profile.blocking_power_w)


def test_only_the_designated_replica_sends_its_profile(serve, tmp_path):
    served = serve()
    spec = job_spec(world_size=4, dp=2, rank_mapping="torch")
    clients = [PlannerClient(served.endpoint, poll_interval_s=0.05) for _ in range(4)]
    try:
        job_id = clients[0].register_job(spec)
        for r, c in enumerate(clients):
            c.register_rank(job_id, rank_info(r, stage=r % 2, dp_index=r // 2))
        wait_until(lambda: all(c.assignment(0).phase == Phase.WARMUP for c in clients))
        for r in (2, 3):  # pipeline 1 finishes its sweep first, with other (slower) figures
            clients[r].upload_profile(job_id, r % 2, _scaled(stage_profile(r % 2), 1.5))
        time.sleep(0.3)
        assert clients[0].status(job_id).jobs[0].profiled_stages == ()  # held: not the uploader
        for r in (0, 1):
            clients[r].upload_profile(job_id, r, stage_profile(r))
        wait_until(lambda: clients[0].status(job_id).jobs[0].profiled_stages == (0, 1))
    finally:
        for c in clients:
            c.close()
    for s in (0, 1):  # the service holds pipeline 0's figures, though pipeline 1 offered its own first
        saved = load_profile(tmp_path / "state" / "jobs" / job_id / f"stage-{s}.json")
        assert saved.points == stage_profile(s).points


def test_a_job_at_the_instruction_cap_registers_at_once_and_the_service_keeps_answering(serve):
    served = serve()
    microbatches = MAX_INSTRUCTIONS // 4
    spec = job_spec(num_microbatches=microbatches, stage_orders=_orders(build_schedule("1f1b", 2, microbatches)))
    with (
        PlannerClient(served.endpoint, timeout_s=30.0, poll_interval_s=0.05) as rank0,
        PlannerClient(served.endpoint, timeout_s=30.0) as other,
    ):
        t0 = time.perf_counter()
        job_id = rank0.register_job(spec)  # raises if refused
        # The loop answers while the schedule builds (how fast is a speed figure, printed beside the
        # build time by benchmarks/service_register.py).
        while "schedule built" not in served.log():
            assert other.status() is not None
            assert time.perf_counter() - t0 < 120, served.log()
        rank0.register_rank(job_id, rank_info(0))
        wait_until(lambda: rank0.assignment(0).phase == Phase.WARMUP)
    assert f"{2 * 2 * microbatches} instructions" in served.log()


def test_an_invalid_order_fails_the_job_and_every_rank_hears_why(serve, caplog):
    served = serve()
    order = [[("forward", 0, 0), ("forward", 0, 0)], [("forward", 0, 0), ("backward", 0, 0)]]
    spec = job_spec(num_microbatches=1, stage_orders=order)  # well-formed, but stage 0 repeats F0 and lacks B0
    with (
        caplog.at_level(logging.WARNING, logger="perseus.client"),
        PlannerClient(served.endpoint, poll_interval_s=0.05) as client,
    ):
        job_id = client.register_job(spec)  # accepted at once: the schedule is checked off the loop
        client.register_rank(job_id, rank_info(0))
        failed = wait_until(lambda: [j for j in client.status(job_id).jobs if j.phase == "failed"])[0]
        wait_until(
            lambda: all(client.assignment(i).phase == Phase.UNPLANNED for i in (0, 3, 50))
        )  # no warm-up, no sweep
    assert failed.error.startswith("invalid job:") and "appears more than once" in failed.error
    assert any(
        "appears more than once" in r.getMessage() and "maximum clocks" in r.getMessage() for r in caplog.records
    )


def test_profiles_uploaded_before_the_schedule_is_built_are_refused_until_it_is(tmp_path):
    # An acknowledged profile must be a saved one: before the schedule exists nothing can be
    # checked or saved, so the upload gets `not_ready` (the client retries), never an ack.
    service = PlannerService("tcp://127.0.0.1:0", str(tmp_path))  # handlers only: this test runs the loop's steps
    service.workers._builder = threading.Thread(
        target=service.workers._build_worker, daemon=True
    )  # started below, after the uploads
    spec = job_spec()
    service.handlers.register_job(RegisterJob(spec))
    job = service.jobs[spec.job_id()]
    service.workers.planning.add(job.job_id)  # keep the planner thread out of this test
    for r in (0, 1):
        service.handlers.register_rank(RegisterRank(job.job_id, rank_info(r)))
    with pytest.raises(ServiceError) as refused:
        service.handlers.upload_profile(UploadProfile(job.job_id, 0, 0, stage_profile(0)))
    assert refused.value.code == "not_ready"
    assert job.schedule is None and job.profiled_stages == ()
    service.workers._builder.start()
    wait_until(lambda: service.results.take_builds() or job.schedule is not None)
    assert service.handlers.upload_profile(UploadProfile(job.job_id, 0, 0, stage_profile(0))).phase == "profiling"
    assert job.profiled_stages == (0,) and not job.error
    assert list((tmp_path / "jobs" / job.job_id).glob("stage-*.json"))  # saved before the ack
    service.close()


def test_the_spec_is_saved_once_beside_the_job_and_earlier_records_load(tmp_path):
    state = StateDir(tmp_path)
    job = Job(job_spec(tag="saved"))
    job.add_rank(rank_info(0))
    state.save_job(job.to_record())
    folder = tmp_path / "jobs" / job.job_id
    spec_stat = (folder / "spec.json").stat()
    job.add_rank(rank_info(1))
    state.save_job(job.to_record())
    assert (folder / "spec.json").stat().st_mtime_ns == spec_stat.st_mtime_ns  # written once
    assert "spec" not in json.loads((folder / "job.json").read_text())
    ((_, record),) = state.load_jobs()
    again = Job.from_record(record, {}, {})
    assert again.spec == job.spec and again.to_record() == job.to_record()
    # An earlier release kept the spec inside job.json.
    legacy = {"format": "perseus.service.job", "version": 1, **job.to_record()}
    (folder / "spec.json").unlink()
    (folder / "job.json").write_text(json.dumps(legacy))
    ((_, record),) = state.load_jobs()
    assert Job.from_record(record, {}, {}).spec == job.spec
