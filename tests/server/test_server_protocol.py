"""Wire messages: validation of every field, envelopes, and the job state machine (no sockets)."""

from __future__ import annotations

import math

import msgpack
import pytest
from server_helpers import FREQUENCIES, job_spec, rank_info, stage_profile

from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.service.job import Job
from perseus.service.planning import PlanResult, merge_profiles
from perseus.service.plans import PLAN_LEAD_ITERATIONS
from perseus.service.sweep import design_steps
from perseus.service.tally import Measured
from perseus.wire.envelope import (
    ErrorCode,
    RequestRejected,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
)
from perseus.wire.limits import MAX_MESSAGE_BYTES
from perseus.wire.messages import GetTable, JobStatus, RegisterJob, ReportIteration, Table, UploadProfile
from perseus.wire.phases import JobPhase
from perseus.wire.profiles import profile_from_wire, profile_to_wire
from perseus.wire.spec import JobSpec, RankInfo


def test_job_spec_round_trips_and_its_id_is_deterministic():
    spec = job_spec(
        stage_orders=[[("forward", 0, 0), ("backward", 0, 0)], [("forward", 0, 0), ("backward", 0, 0)]],
        num_microbatches=1,
    )
    again = JobSpec.from_wire(msgpack.unpackb(msgpack.packb(spec.to_wire())))
    assert again == spec and again.job_id() == spec.job_id()
    assert job_spec(warmup_iterations=3).job_id() != job_spec().job_id()
    # The profile cache key ignores data parallelism and sweep settings, not the GPU or tag.
    assert job_spec(world_size=4, dp=2, warmup_iterations=5).profile_key() == job_spec().profile_key()
    assert job_spec(tag="other").profile_key() != job_spec().profile_key()
    assert job_spec(gpu_model="h100").profile_key() != job_spec().profile_key()


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"world_size": 3}, "pp * dp * tp"),
        ({"num_microbatches": 0}, "num_microbatches"),
        ({"num_microbatches": True}, "num_microbatches"),
        ({"schedule_name": ""}, "schedule_name"),
        ({"gpu_model": 5}, "gpu_model"),
        ({"sweep_frequencies": [1410, 1410]}, "twice"),
        ({"sweep_frequencies": [-5]}, "sweep_frequencies[0]"),
        ({"sweep_frequencies": list(range(2000, 976, -1)), "iterations_per_frequency": 20}, "over 16384"),
        ({"blocking_power_w": math.nan}, "blocking_power_w"),
        ({"schedule_style": "zigzag"}, "schedule_style"),
        ({"stage_orders": [[("forward", 0, 0)]]}, "stage_orders"),
        ({"stage_orders": [[("sideways", 0, 0)], [("forward", 0, 0)]]}, "stage_orders[0][0].kind"),
        ({"stage_orders": [[("forward", 9, 0)], [("forward", 0, 0)]]}, "microbatch"),
        ({"instruction_overhead_s": -0.001}, "instruction_overhead_s"),
        ({"instruction_overhead_s": math.inf}, "instruction_overhead_s"),
        ({"hop_latency_s": math.nan}, "hop_latency_s"),
        ({"hop_latency_s": 1.0}, "hop_latency_s must be under 1 s"),
    ],
)
def test_job_spec_rejects_bad_fields_naming_them(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        job_spec(**overrides)


def test_job_spec_overheads_travel_only_when_set_and_leave_the_profile_key():
    plain, spec = job_spec(), job_spec(instruction_overhead_s=0.0007, hop_latency_s=0.001)
    assert "instruction_overhead_s" not in plain.to_wire() and "hop_latency_s" not in plain.to_wire()
    assert (
        job_spec(instruction_overhead_s=0, hop_latency_s=0.0).job_id() == plain.job_id()
    )  # older peers' ids unchanged
    again = JobSpec.from_wire(msgpack.unpackb(msgpack.packb(spec.to_wire())))
    assert again == spec and (again.instruction_overhead_s, again.hop_latency_s) == (0.0007, 0.001)
    assert spec.job_id() != plain.job_id() and spec.profile_key() == plain.profile_key()  # the cached profile stays raw


def test_pipeline_profile_adds_the_spec_overheads_and_the_cache_keeps_measured_rows():
    job = _job(instruction_overhead_s=0.001, hop_latency_s=0.002)
    job.add_profile(0, 0, stage_profile(0))
    job.add_profile(1, 1, stage_profile(1))
    raw = merge_profiles({0: stage_profile(0), 1: stage_profile(1)}, None)
    assert job.model_profile("sim-a100").points == raw.points
    planned = job.pipeline_profile(("sim-a100", "sim-a100"))
    assert planned.points == raw.with_overheads(0.001, 0.002).points
    assert planned.points[(1, "forward")][0].time == pytest.approx(raw.points[(1, "forward")][0].time + 0.003)
    assert planned.points[(0, "forward")][0].time == pytest.approx(raw.points[(0, "forward")][0].time + 0.001)


def test_rank_info_sorts_frequencies_and_rejects_bad_ones():
    assert rank_info(0, frequencies=[810, 1410, 1110]).frequencies == (1410, 1110, 810)
    with pytest.raises(ConfigError, match="frequencies"):
        rank_info(0, frequencies=[])
    with pytest.raises(ConfigError, match="rank"):
        rank_info(-1, stage=0)


def test_profile_wire_round_trip_and_rejects_bad_rows():
    profile = stage_profile(1)
    again = profile_from_wire(msgpack.unpackb(msgpack.packb(profile_to_wire(profile))), "p")
    assert again.points == profile.points and again.blocking_power_w == profile.blocking_power_w
    doc = profile_to_wire(profile)
    for bad_row, words in (
        ([1, "forward", 1410, -1.0, 2.0], "time"),
        ([1, "sideways", 1410, 1.0, 2.0], "kind"),
        ([1, "forward", 1410, 1.0], "rows"),
    ):
        with pytest.raises(ConfigError, match=words):
            profile_from_wire({**doc, "rows": [bad_row]}, "p")
    with pytest.raises(ConfigError, match="twice"):
        profile_from_wire({**doc, "rows": [[1, "forward", 1410, 1.0, 2.0], [1, "forward", 1410, 1.0, 2.0]]}, "p")


@pytest.mark.parametrize(
    "payload, code",
    [
        (b"\xc1\xc1\xc1 not msgpack", "bad_frame"),
        (msgpack.packb([1, 2, 3]), "bad_frame"),
        (msgpack.packb({"v": 1, "id": 1, "type": "ping"})[:-3], "bad_frame"),
        (msgpack.packb({"v": 1, "id": "one", "type": "ping"}), "bad_field"),
        (msgpack.packb({"id": 1, "type": "ping"}), "bad_version"),
        (msgpack.packb({"v": 99, "id": 1, "type": "ping"}), "bad_version"),
        (msgpack.packb({"v": 1, "id": 1, "type": "explode"}), "unknown_type"),
        (msgpack.packb({"v": 1, "id": 1, "type": "ping", "extra": 1}), "bad_field"),
        (msgpack.packb({"v": 1, "id": 1, "type": "get_table", "job_id": "job-00", "rank": "0"}), "bad_field"),
        (msgpack.packb({"v": 1, "id": 1, "type": "get_table", "job_id": "../../etc", "rank": 0}), "bad_field"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "id": 1,
                    "type": "report_iteration",
                    "job_id": "job-00",
                    "rank": 0,
                    "iteration": 1,
                    "time_s": float("inf"),
                    "energy_j": 1.0,
                }
            ),
            "bad_field",
        ),
        (msgpack.packb({"v": 1, "id": 1, "type": "ping", 5: 1}), "bad_frame"),
        (msgpack.packb({"v": 1, "id": 1, "type": "ping", "pad": "x" * MAX_MESSAGE_BYTES}), "too_large"),
    ],
)
def test_decode_request_rejects_malformed_frames(payload, code):
    with pytest.raises(RequestRejected) as info:
        decode_request(payload)
    assert info.value.code == code and info.value.message


def test_envelopes_round_trip():
    spec = job_spec()
    request_id, message = decode_request(encode_request(42, RegisterJob(spec)))
    assert request_id == 42 and message == RegisterJob(spec)
    assert decode_reply(encode_reply(42, GetTable(spec.job_id(), 1))) == (
        42,
        {"job_id": spec.job_id(), "rank": 1, "iteration": -1, "plan_version": 0},
    )
    request_id, error = decode_reply(encode_error(3, ErrorCode.UNKNOWN_JOB, "no such job"))
    assert request_id == 3 and isinstance(error, ServiceError) and error.code == "unknown_job"


def _job(**overrides) -> Job:
    job = Job(job_spec(**overrides))
    job.add_rank(rank_info(0))
    job.add_rank(rank_info(1))
    return job


def _solve_all(job: Job, result: PlanResult) -> None:
    for key, _ in job.missing_plans():
        job.add_result(key, result)


def test_job_table_sweeps_then_plans_with_a_lead():
    job = _job()
    table = job.table(0, iteration=-1, known_version=0)
    assert table.sweep_frequencies == FREQUENCIES and table.warmup_iterations == 2 and table.frequencies is None
    assert job.add_profile(0, 0, stage_profile(0)) == "stage-0" and job.phase == JobPhase.PROFILING
    assert job.add_profile(0, 0, stage_profile(0)) is None  # a stage keeps its first profile
    job.table(1, iteration=7, known_version=0)
    assert job.add_profile(1, 1, stage_profile(1)) == "stage-1" and job.phase == JobPhase.PLANNING
    ((key, merged),) = job.missing_plans()
    assert key == (("sim-a100", "sim-a100"), None)
    assert merged.stages() == [0, 1] and merged.blocking_power_w == pytest.approx(83.64)
    result = PlanResult(((1410, 1260, 1410, 1410, 1410, 1410, 1410, 1410), (1410,) * 8), 1.0, 100.0, 99.0, 1.0, 110.0)
    job.add_result(key, result)
    assert job.publish() == [0] and job.phase == JobPhase.PLANNED
    plan = job.plans[0]
    assert plan.version == 1 and plan.start_iteration == 7 + PLAN_LEAD_ITERATIONS
    assert job.table(0, 8, known_version=0).frequencies == result.stage_frequencies[0]
    assert job.table(0, 8, known_version=1).frequencies is None  # already held: not resent
    assert job.publish() == []  # nothing changed: no new version
    job.rerun()
    assert job.plans[0].start_iteration == 0 and job.last_iteration == -1


def test_the_service_designs_the_sweep_and_sends_it_while_a_stage_is_unprofiled():
    job = _job()
    steps = job.table(0, iteration=-1, known_version=0).sweep_steps
    assert steps == design_steps(FREQUENCIES, 2) and len(steps) == 2 * len(FREQUENCIES)
    assert GetTable("job-00ab", 0).to_wire().get("sweep_version") is None  # an earlier release's request
    wire = job.table(0, -1, 0).to_wire()
    assert Table.from_wire(wire).sweep_steps == steps
    job.add_profile(0, 0, stage_profile(0))
    assert job.table(0, -1, 0).sweep_steps == () and "sweep_steps" not in job.table(0, -1, 0).to_wire()
    assert job.table(1, -1, 0).sweep_steps == steps  # stage 1 still profiles
    long_sweep = Job(job_spec(iterations_per_frequency=20))
    with pytest.raises(ServiceError, match="rank 0's clocks would be the sweep.*over 16384"):
        long_sweep.add_rank(rank_info(0, frequencies=tuple(range(2000, 976, -1))))


def test_job_rejects_inconsistent_ranks_and_profiles():
    job = _job()
    tp = Job(job_spec(world_size=4, tp=2))
    tp.add_rank(rank_info(0, stage=0))
    with pytest.raises(ServiceError, match="GPU") as info:
        tp.add_rank(rank_info(1, stage=0, tp_index=1, gpu_model="h100"))
    assert info.value.code == "bad_field"
    twice = Job(job_spec(world_size=4, dp=2))
    twice.add_rank(rank_info(0, stage=0, dp_index=0))
    with pytest.raises(ServiceError, match="both claim"):
        twice.add_rank(rank_info(1, stage=0, dp_index=0))
    with pytest.raises(ServiceError, match="pp=2"):
        job.add_rank(rank_info(1, stage=2))
    with pytest.raises(ServiceError, match="sweep frequencies"):
        job.add_rank(rank_info(1, frequencies=(1410, 1260)))
    with pytest.raises(ServiceError, match="stage 0"):
        job.add_profile(1, 0, stage_profile(0))
    with pytest.raises(ServiceError, match="lacks backward"):
        only_forward = Profile({(1, "forward"): stage_profile(1).points[(1, "forward")]}, 80.0)
        job.add_profile(1, 1, only_forward)
    with pytest.raises(ServiceError) as info:
        job.table(5, 0, 0)
    assert info.value.code == "unknown_rank"


def test_job_tallies_measured_iterations_and_predicts_per_replica():
    job = _job(world_size=4, dp=2)
    for r, (stage, dp) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        job.add_rank(rank_info(r, stage=stage, dp_index=dp))
    for r in range(4):
        done = job.record(ReportIteration(job.job_id, r, 1, 1.0 + r / 10, 100.0))
    assert done is not None and done[0].time_s == pytest.approx(1.3) and done[0].energy_j == pytest.approx(400.0)
    status = job.status()
    assert status.baseline_iterations == 1 and status.baseline_energy_j == pytest.approx(400.0)
    for s in (0, 1):
        job.add_profile(s, s, stage_profile(s))
    _solve_all(job, PlanResult(((1410,) * 8, (1410,) * 8), 1.0, 150.0, 140.0, 1.0, 200.0))
    assert job.publish() == [0, 1]
    status = job.status()
    assert status.predicted_energy_j == pytest.approx(300.0)  # two pipelines
    assert status.predicted_saving == pytest.approx(0.25)
    # A 1F1B pipeline's iteration ends on its stage 0 (rank 2 here): its time, not stage 1's.
    assert [p.plan_version for p in status.pipelines] == [1, 1] and status.pipelines[
        1
    ].measured_iteration_time_s == pytest.approx(1.2)


@pytest.mark.parametrize(
    "time_s, energy_j, compute_time_s, words",
    [
        (1.5, 450_000.0, None, "300,000 W, over the 10,000 W"),  # millijoules sent as joules
        (1.5, 300.0, 2.0, "compute_time_s 2 s is longer than time_s 1.5 s"),
    ],
)
def test_an_iteration_report_no_gpu_could_measure_is_refused(time_s, energy_j, compute_time_s, words):
    with pytest.raises(ConfigError, match=words):
        ReportIteration("job-0123456789abcdef", 0, 3, time_s, energy_j, compute_time_s)
    # Two timers a hair apart: the compute part is capped at the iteration's time.
    report = ReportIteration("job-0123456789abcdef", 0, 3, 1.5, 300.0, 1.5 * 1.005)
    assert report.compute_time_s == 1.5


def test_one_ranks_wild_iteration_moves_neither_the_job_nor_its_plans():
    job = _job()
    for it in range(5):
        for r in (0, 1):
            job.record(ReportIteration(job.job_id, r, it, 1.0, 100.0))
    with pytest.raises(ServiceError, match="reports iteration 9007199254740991, but the median rank .* is at 4"):
        job.record(ReportIteration(job.job_id, 1, 2**53 - 1, 1.0, 100.0))
    job.table(1, 2**53 - 1, 0)  # a table asked for at a wild iteration: answered, not noted
    assert job.last_iteration == 4
    # Before any other rank reports there is nothing to compare with: the first wild number counts
    # only until the others report.
    job.rerun()
    job.record(ReportIteration(job.job_id, 0, 2**53 - 1, 1.0, 100.0))
    assert job.last_iteration == 2**53 - 1
    job.record(ReportIteration(job.job_id, 1, 0, 1.0, 100.0))
    assert job.last_iteration == 0
    # Every rank far on at once (the service heard only old iterations): the first is refused, but
    # noted, so the next moves the median and is taken; nothing stays refused for good.
    job.rerun()
    for r in (0, 1):
        job.table(r, 0, 0)
    with pytest.raises(ServiceError, match="median rank"):
        job.record(ReportIteration(job.job_id, 0, 300, 1.0, 100.0))
    job.record(ReportIteration(job.job_id, 1, 300, 1.0, 100.0))
    job.record(ReportIteration(job.job_id, 0, 301, 1.0, 100.0))
    assert job.last_iteration == 301


def test_an_iteration_one_rank_reports_far_longer_than_the_others_is_left_out_of_the_means():
    job = _job(warmup_iterations=3)
    job.record(ReportIteration(job.job_id, 0, 1, 1.0, 100.0))
    job.record(ReportIteration(job.job_id, 1, 1, 1.0, 100.0))
    job.record(ReportIteration(job.job_id, 0, 2, 1.0, 100.0))
    done = job.record(ReportIteration(job.job_id, 1, 2, 86_400.0, 1e7))
    assert done is not None and done[0].odd_rank == 1
    status = job.status()
    assert status.baseline_iterations == 1 and status.baseline_energy_j == pytest.approx(200.0)
    assert job.measurements.odd == 1


def test_the_first_iteration_sets_up_and_is_no_part_of_the_baseline():
    """Ranks that send no spans: the job's baseline is its warm-up iterations after the first, as
    with spans (iteration 0 sets up: allocations, caches, compilation)."""
    job = _job(warmup_iterations=3)
    for iteration, time_s, energy_j in ((0, 4.0, 900.0), (1, 1.0, 100.0), (2, 1.1, 120.0), (3, 0.9, 80.0)):
        for r in (0, 1):
            job.record(ReportIteration(job.job_id, r, iteration, time_s, energy_j))
    status = job.status()
    assert status.baseline_iterations == 2 and status.baseline_iteration_time_s == pytest.approx(1.05)
    assert status.baseline_energy_j == pytest.approx(220.0)


def test_a_closing_report_counts_no_iteration_and_a_new_run_reopens():
    job = _job(warmup_iterations=3)
    job.record(ReportIteration(job.job_id, 0, 1, 1.0, 100.0))
    job.close_rank(1)
    status = job.status()
    assert status.ranks_closed == 1 and status.baseline_iterations == 0
    with pytest.raises(ServiceError, match="rank"):
        job.close_rank(7)  # no rank of the job
    job.add_rank(rank_info(1))  # it runs again
    assert job.status().ranks_closed == 0
    job.close_rank(0)
    job.rerun()
    assert job.status().ranks_closed == 0


def test_a_long_first_iteration_is_no_odd_report():
    """One rank's set-up far longer than the other's is set-up, not a client that misreports."""
    job = _job(warmup_iterations=3)
    job.record(ReportIteration(job.job_id, 0, 0, 0.2, 50.0))
    done = job.record(ReportIteration(job.job_id, 1, 0, 1.2, 300.0))
    assert done is not None and done[0].odd_rank is None and not done[1]
    assert job.measurements.odd == 0 and job.status().baseline_iterations == 0


def test_a_job_of_one_pipeline_refuses_a_straggler_declaration():
    job = _job()
    with pytest.raises(ServiceError, match="one pipeline"):
        job.declare_straggler(0, 1.2)
    job.declare_straggler(0, None)  # clearing is harmless


def test_status_counts_instructions_off_their_planned_clock():
    job = _job()
    for s in (0, 1):
        job.add_profile(s, s, stage_profile(s))
    _solve_all(job, PlanResult(((1410,) * 8, (1410,) * 8), 1.0, 150.0, 140.0, 1.0, 200.0))
    job.note_iteration(0, 5)  # the ranks run on meanwhile: the plan starts a lead after
    job.publish()
    assert job.status().off_clock_instructions is None  # no rank told yet
    start = job.plans[0].start_iteration
    job.record(ReportIteration(job.job_id, 0, start - 1, 1.0, 100.0, off_clock=5))  # before the plan: not counted
    for it in (start, start + 1):
        job.record(ReportIteration(job.job_id, 0, it, 1.0, 100.0, off_clock=it - start))
        job.record(ReportIteration(job.job_id, 1, it, 1.0, 100.0, off_clock=2))
    status = job.status()
    assert status.off_clock_instructions == pytest.approx(2.5)  # (0 + 2 + 1 + 2) over 2 iterations
    assert JobStatus.from_wire(status.to_wire()).off_clock_instructions == pytest.approx(2.5)
    line = job.describe(Measured(start + 1, 1.1, 200.0))  # the log line says what it compares, and over what
    assert "time 1.1000 s step to step (predicted 1.0000 s for the instructions alone, +10.0%)" in line
    assert line.endswith("2.5 instructions per planned iteration off their planned clock (mean so far)")
    assert "off_clock" not in ReportIteration(job.job_id, 0, 1, 1.0, 1.0).to_wire()  # as earlier releases send


def test_job_record_round_trip():
    job = _job()
    job.add_profile(0, 0, stage_profile(0))
    record = job.to_record()
    again = Job.from_record(record, {"stage-0": stage_profile(0)}, {})
    assert again.to_record() == record and again.phase == JobPhase.PROFILING and again.profiled_stages == (0,)


def test_merge_profiles_prefers_the_spec_blocking_power():
    merged = merge_profiles({0: stage_profile(0), 1: stage_profile(1)}, 70.0)
    assert merged.blocking_power_w == 70.0 and sorted(merged.points) == [
        (0, "backward"),
        (0, "forward"),
        (1, "backward"),
        (1, "forward"),
    ]


def test_upload_profile_validates_the_profile():
    bad = Profile({(0, "forward"): [ProfilePoint(1410, 0.0, 1.0)]}, 80.0)
    with pytest.raises(Exception, match="time"):
        UploadProfile(job_spec().job_id(), 0, 0, bad)
    with pytest.raises(ConfigError):
        RankInfo(0, 0, gpu_model="x", frequencies=[1410.5])
