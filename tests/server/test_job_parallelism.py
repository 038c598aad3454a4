"""Data-parallel pipelines, stragglers and 3D parallelism in the job state machine (no sockets;
plans are given as PlanResults, so no solver runs here)."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from server_helpers import job_spec, rank_info, stage_profile

from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.service.job import Job
from perseus.service.planning import PlanResult
from perseus.service.tally import Measured
from perseus.wire.messages import ReportIteration
from perseus.wire.parallelism import merge_tensor_parallel, rank_coordinates, rank_of
from perseus.wire.phases import JobPhase
from perseus.wire.spans import ReportSpans

A100, A40 = "sim-a100", "sim-a40"


def _result(time_s: float, energy_j: float, freq: int = 1410) -> PlanResult:
    return PlanResult(((freq,) * 8, (freq,) * 8), time_s, energy_j, energy_j * 0.99, 1.0, 200.0)


def _dp_job(dp: int = 2, **overrides) -> Job:
    """`dp` pipelines of 2 stages, ranks (stage, pipeline) in torch order; stage profiles in."""
    job = Job(job_spec(world_size=2 * dp, dp=dp, rank_mapping="torch", **overrides))
    for r in range(2 * dp):
        job.add_rank(rank_info(r, stage=r % 2, dp_index=r // 2))
    for s in (0, 1):
        assert job.add_profile(s, s, stage_profile(s)) == f"stage-{s}"
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(1.0, 150.0))
    assert job.publish() == list(range(dp)) and job.phase == JobPhase.PLANNED
    return job


class _Ranks:
    """Reports each pipeline's iteration at a given time (with seeded noise), rank by rank."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.iteration = 0
        self.rng = random.Random(1)
        self.changes = 0

    def run(self, times: list[float], iterations: int) -> None:
        job = self.job
        for _ in range(iterations):
            for rank, info in sorted(job.ranks.items()):
                t = times[info.dp_index] * (1 + self.rng.gauss(0, 0.01))
                job.record(ReportIteration(job.job_id, rank, self.iteration, t, 50.0))
                if job.update_stragglers():
                    self.changes += 1
            self.iteration += 1


def test_a_detected_straggler_slows_the_others_to_its_pace_and_recovery_restores_them():
    job = _dp_job()
    models = (A100, A100)
    ranks = _Ranks(job)
    ranks.run([1.0, 1.0], 10)
    assert job.straggler() is None and ranks.changes == 0

    ranks.run([1.0, 1.2], 10)  # pipeline 1's GPUs got slower: it runs its plan 20% over time
    pipeline, factor, source = job.straggler()
    assert (pipeline, source) == (1, "detected") and factor == pytest.approx(1.2, abs=0.03)
    ((key, profile),) = job.missing_plans()
    assert key[0] == models and key[1] == pytest.approx(factor * 1.0, abs=1e-6) and profile.stages() == [0, 1]
    assert job.publish() == []  # not solved yet: every pipeline keeps its plan
    job.add_result(key, _result(key[1], 120.0, freq=1110))
    assert job.publish() == [0]  # only the fast pipeline changes
    slowed = job.plans[0]
    assert slowed.version == 2 and slowed.deadline_s == key[1] and job.plans[1].version == 1
    assert slowed.start_iteration == ranks.iteration - 1 + 2
    # Every rank of pipeline 0 gets the new plan (same version, same start); pipeline 1 keeps its own.
    assert (
        job.table(0, ranks.iteration, 1).frequencies == (1110,) * 8
        and job.table(1, ranks.iteration, 1).plan_version == 2
    )
    assert job.table(2, ranks.iteration, 1).frequencies is None and job.table(2, ranks.iteration, 1).plan_version == 1
    status = job.status()
    assert [p.deadline_s for p in status.pipelines] == [key[1], None]
    assert status.pipelines[1].straggler == "detected" and status.pipelines[0].straggler == ""

    # Pipeline 0 now takes the straggler's time, as its new plan predicts: no new straggler, no flapping.
    changes = ranks.changes
    ranks.run([key[1], 1.2], 30)
    assert ranks.changes == changes and job.straggler()[0] == 1 and job.missing_plans() == []

    ranks.run([key[1], 1.0], 12)  # pipeline 1 recovered
    assert job.straggler() is None and job.missing_plans() == []  # the no-slowdown plan is still known
    assert job.publish() == [0] and job.plans[0].deadline_s is None and job.plans[0].version == 3


def test_a_declared_straggler_sets_the_deadline_and_can_be_cleared():
    job = _dp_job(dp=3)
    job.declare_straggler(2, 1.5)
    assert job.straggler() == (2, 1.5, "declared")
    wanted = job.wanted()
    assert wanted[2] == ((A100, A100), None) and wanted[0] == wanted[1] == ((A100, A100), 1.5)
    ((key, _),) = job.missing_plans()
    job.add_result(key, "planning failed: no plan")  # a deadline the planner cannot meet
    assert job.error == "" and job.publish() == []  # the pipelines keep their no-slowdown plans
    assert job.status().pipelines[0].reason == (
        "no plan for a deadline of 1.5000 s (a straggler's pace) (planning failed: no plan): it runs its "
        "no-slowdown plan"
    )
    job.declare_straggler(2, 1.25)
    ((key, _),) = job.missing_plans()
    assert "its plan for a deadline of 1.2500 s (a straggler's pace) is being solved; plan v1 runs meanwhile" in (
        job.status().pipelines[0].reason
    )
    job.add_result(key, _result(1.25, 130.0, freq=1110))
    assert job.publish() == [0, 1] and job.plans[0].version == job.plans[1].version == 2
    assert job.status().pipelines[2].straggler == "declared" and job.status().pipelines[2].straggler_factor == 1.25
    with pytest.raises(ServiceError, match="dp=3"):
        job.declare_straggler(3, 1.2)
    job.declare_straggler(2, None)
    assert job.publish() == [0, 1] and job.plans[0].deadline_s is None


@pytest.mark.parametrize("mapping", ["megatron", "torch"])
def test_rank_mappings_are_bijective_and_checked_at_registration(mapping):
    pp, dp, tp = 3, 2, 4
    seen = set()
    for rank in range(pp * dp * tp):
        coords = rank_coordinates(mapping, rank, pp, dp, tp)
        assert rank_of(mapping, *coords, pp, dp, tp) == rank
        seen.add(coords)
    assert len(seen) == pp * dp * tp
    assert rank_coordinates("megatron", 5, pp, dp, tp) == (0, 1, 1)  # tensor-parallel fastest, then data-parallel
    assert rank_coordinates("torch", 5, pp, dp, tp) == (1, 0, 1)  # tensor-parallel fastest, then pipeline
    job = Job(job_spec(world_size=16, dp=2, tp=4, rank_mapping=mapping))
    stage, dp_index, tp_index = rank_coordinates(mapping, 13, 2, 2, 4)
    job.add_rank(rank_info(13, stage=stage, dp_index=dp_index, tp_index=tp_index))
    with pytest.raises(ServiceError, match=f"under the {mapping} rank mapping rank 14"):
        job.add_rank(rank_info(14, stage=stage, dp_index=dp_index, tp_index=tp_index))
    with pytest.raises(ConfigError, match="rank_mapping"):
        job_spec(rank_mapping="deepspeed")


def test_tensor_parallel_uploads_merge_to_slowest_time_and_summed_energy():
    job = Job(job_spec(world_size=8, dp=2, tp=2, rank_mapping="megatron"))
    for rank in range(8):
        stage, dp_index, tp_index = rank_coordinates("megatron", rank, 2, 2, 2)
        job.add_rank(rank_info(rank, stage=stage, dp_index=dp_index, tp_index=tp_index))
    slower = Profile(
        {
            key: [ProfilePoint(p.frequency, p.time * 1.1, p.energy * 0.9) for p in pts]
            for key, pts in stage_profile(0).points.items()
        },
        80.0,
    )
    # Megatron: ranks 0, 1 are stage 0's tensor-parallel pair of pipeline 0; 4, 5 stage 1's.
    assert job.add_profile(0, 0, stage_profile(0)) == "stage-0" and job.profiled_stages == ()
    assert job.add_profile(0, 0, stage_profile(0)) is None  # that share is in
    assert job.add_profile(1, 0, slower) == "stage-0-tp1" and job.profiled_stages == (0,)
    assert job.add_profile(2, 0, stage_profile(0)) is None  # pipeline 1's replica shares the profile
    merged = job.profiles[A100][0]
    for key, points in merged.points.items():
        for p, a, b in zip(points, stage_profile(0).points[key], slower.points[key]):
            assert p.time == pytest.approx(max(a.time, b.time)) and p.energy == pytest.approx(a.energy + b.energy)
    assert merged.blocking_power_w == pytest.approx(83.64 + 80.0)
    for rank in (4, 5):
        job.add_profile(rank, 1, stage_profile(1))
    ((key, profile),) = job.missing_plans()
    job.add_result(key, PlanResult(((1260,) * 8, (1410,) * 8), 1.0, 150.0, 140.0, 1.0, 200.0))
    assert job.publish() == [0, 1]
    # Every tensor-parallel rank of a stage, in every pipeline, runs the stage's frequencies.
    for rank in range(8):
        assert job.table(rank, 0, 0).frequencies == ((1260,) * 8 if job.ranks[rank].stage == 0 else (1410,) * 8)
    assert job.status().predicted_energy_j == pytest.approx(300.0)  # per pipeline (tp summed), two pipelines


def test_merge_refuses_tensor_parallel_shares_that_do_not_match():
    a = stage_profile(0)
    b = Profile({(0, "forward"): a.points[(0, "forward")]}, 80.0)
    with pytest.raises(ConfigError, match="different rows"):
        merge_tensor_parallel([a, b])
    c = Profile(
        {key: [ProfilePoint(p.frequency + 1, p.time, p.energy) for p in pts] for key, pts in a.points.items()}, 80.0
    )
    with pytest.raises(ConfigError, match="no profiled frequency"):
        merge_tensor_parallel([a, c])


def test_pipelines_on_another_gpu_model_are_profiled_and_planned_on_their_own():
    job = Job(job_spec(world_size=6, dp=3, rank_mapping="torch"))
    for r in range(6):
        job.add_rank(rank_info(r, stage=r % 2, dp_index=r // 2, gpu_model=A40 if r // 2 == 2 else A100))
    assert job.models(2) == (A40, A40) and job.models(1) == (A100, A100)
    for s in (0, 1):
        job.add_profile(s, s, stage_profile(s))
    assert job.phase == JobPhase.PROFILING  # the A40 pipeline's stages are not profiled yet
    ((key, _),) = job.missing_plans()
    assert key == ((A100, A100), None)
    assert job.table(4, 0, 0).profiled_stages == ()  # so its ranks keep sweeping
    slow = Profile(
        {
            key: [ProfilePoint(p.frequency, p.time * 1.3, p.energy) for p in pts]
            for key, pts in stage_profile(0).points.items()
        },
        70.0,
    )
    name = job.add_profile(4, 0, slow)
    assert name.startswith("stage-0-m") and job.table(4, 0, 0).profiled_stages == (0,)
    job.add_profile(5, 1, stage_profile(1))
    keys = [k for k, _ in job.missing_plans()]
    assert keys == [((A100, A100), None), ((A40, A40), None)]
    job.add_result(keys[0], _result(1.0, 150.0))
    job.add_result(keys[1], _result(1.3, 160.0, freq=1260))
    assert job.publish() == [0, 1, 2] and job.phase == JobPhase.PLANNED
    assert job.table(4, 0, 0).frequencies == (1260,) * 8 and job.table(0, 0, 0).frequencies == (1410,) * 8
    assert job.model_profile(A40) is not None and job.model_profile(A100) is not None


def test_record_round_trip_keeps_plans_uploads_and_declarations():
    job = _dp_job()
    job.declare_straggler(1, 1.2)
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(1.2, 120.0, freq=1110))
    job.publish()
    record = job.to_record()
    uploads = {"stage-0": stage_profile(0), "stage-1": stage_profile(1)}
    again = Job.from_record(record, uploads, {})
    assert again.to_record() == record and again.missing_plans() == [] and again.publish() == []
    assert again.straggler() == (1, 1.2, "declared")


def test_earlier_records_with_one_plan_still_load():
    job = _dp_job()
    record = job.to_record()
    plan = record.pop("plans")["0"]
    for name in ("plans", "declared", "uploads", "cached_models"):
        record.pop(name, None)
    record["plan"] = {k: v for k, v in plan.items() if k not in ("models", "deadline_s")}
    again = Job.from_record(record, {"stage-0": stage_profile(0), "stage-1": stage_profile(1)}, {})
    assert sorted(again.plans) == [0, 1] and again.phase == JobPhase.PLANNED and again.missing_plans() == []
    assert list(itertools.chain(*again.plans[1].stage_frequencies)) == [1410] * 16


def test_stragglers_are_seen_through_the_gradient_sync_by_compute_time():
    """With data-parallel gradient sync every rank's wall time is the straggler's; only the
    time before the sync (compute_time_s) shows which pipeline is slow."""
    job = _dp_job()
    for iteration in range(10):
        for rank, info in sorted(job.ranks.items()):
            compute = 1.2 if info.dp_index == 1 else 1.0
            job.record(ReportIteration(job.job_id, rank, iteration, 1.2, 50.0, compute_time_s=compute))
        job.update_stragglers()
    assert job.straggler() == (1, pytest.approx(1.2), "detected")
    synced = _dp_job()
    for iteration in range(10):
        for rank in sorted(synced.ranks):
            synced.record(ReportIteration(synced.job_id, rank, iteration, 1.2, 50.0))
        synced.update_stragglers()
    assert synced.straggler() is None
    assert "compute_time_s" not in ReportIteration(job.job_id, 0, 0, 1.0, 1.0).to_wire()  # earlier releases' wire


def test_a_gpu_model_profiled_before_is_taken_from_the_signature_cache(tmp_path):
    from perseus.service.planning import merge_profiles
    from perseus.service.service import PlannerService
    from perseus.wire.messages import RegisterJob, RegisterRank

    service = PlannerService("tcp://127.0.0.1:0", str(tmp_path))  # handlers only: no socket, no planning thread
    spec = job_spec(world_size=4, dp=2, rank_mapping="torch")
    a40 = merge_profiles({0: stage_profile(0), 1: stage_profile(1)}, None)
    service.state.save_cached_profile(spec.profile_key(A40), spec.signature(A40), a40)
    assert spec.profile_key(A40) != spec.profile_key() and job_spec(world_size=4, tp=2).signature()["tp"] == 2
    service.handlers.register_job(RegisterJob(spec))
    job = service.jobs[spec.job_id()]
    service.workers.planning.add(job.job_id)  # keep the planner thread out of this test
    for r in (2, 3):
        service.handlers.register_rank(RegisterRank(job.job_id, rank_info(r, stage=r % 2, dp_index=1, gpu_model=A40)))
    assert A40 in job.cached and job.profiled_stages_of(A40) == (0, 1) and job.profiled_stages == ()
    assert job.table(2, 0, 0).profiled_stages == (0, 1)  # the A40 ranks skip the sweep
    assert job.to_record()["cached_models"] == [A40]
    service.close()


def test_solved_deadlines_are_bounded_but_base_and_in_force_plans_kept():
    from perseus.service.plans import MAX_RESULTS

    job = _dp_job()
    base_key = job.plans[0].key
    for i in range(MAX_RESULTS + 20):
        job.declare_straggler(1, 1.1 + i / 1000)
        ((key, _),) = job.missing_plans()
        job.add_result(key, _result(key[1], 120.0))
        job.publish()
    assert len(job.results) == MAX_RESULTS and base_key in job.results and job.plans[0].key in job.results


def test_a_restart_keeps_the_detected_straggler_until_it_recovers():
    """The plans in force were made for the detected straggler: a restarted service keeps them
    (no re-plan to no slowdown and back), and goes back to no slowdown once it recovers."""
    job = _dp_job()
    ranks = _Ranks(job)
    ranks.run([1.0, 1.2], 10)
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(key[1], 120.0, freq=1110))
    assert job.publish() == [0]
    record = job.to_record()
    assert record["detected"][0] == 1 and record["detected"][1] == pytest.approx(1.2, abs=0.03)
    uploads = {"stage-0": stage_profile(0), "stage-1": stage_profile(1)}

    again = Job.from_record(record, uploads, {})
    assert again.straggler()[:3:2] == (1, "detected") and again.publish() == []
    assert again.plans[0].deadline_s == key[1] and again.to_record() == record
    resumed = _Ranks(again)
    resumed.iteration = ranks.iteration  # the ranks ran on while the service restarted
    resumed.run([key[1], 1.0], 12)  # recovered while the service was down
    assert again.straggler() is None and resumed.changes == 1
    assert again.publish() == [0] and again.plans[0].deadline_s is None

    for bad in ([1], [2, 1.2], [1, 0.9], [1, "1.2"], [True, 1.2], "x", [1, float("nan")]):
        damaged = Job.from_record({**record, "detected": bad}, uploads, {})
        assert damaged.straggler() is None  # detected again from the next iterations; the job resumes


def _baseline_then_plan(times: list[float]) -> tuple[Job, _Ranks]:
    """dp=2 x 2 stages whose warm-up (the baseline) runs at `times`, then their no-slowdown plans."""
    job = Job(job_spec(world_size=4, dp=2, rank_mapping="torch", warmup_iterations=4))
    for r in range(4):
        job.add_rank(rank_info(r, stage=r % 2, dp_index=r // 2))
    for s in (0, 1):
        job.add_profile(s, s, stage_profile(s))
    ranks = _Ranks(job)
    ranks.run(times, 4)
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(1.0, 150.0))
    assert job.publish() == [0, 1]
    return job, ranks


def _slow_to_pace(job: Job) -> float:
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(key[1], 120.0, freq=1110))
    assert job.publish() == [0]
    return key[1]


def test_the_saving_is_claimed_only_while_the_straggler_is_the_baselines():
    """The baseline ran with pipeline 1 1.3x slow. While it straggles, the planned iterations are
    measured against that baseline; once it recovers, the job's pace (and the energy its idle GPUs
    burnt waiting) changed under the plans, so no saving is claimed, and the status says why."""
    job, ranks = _baseline_then_plan([1.0, 1.3])
    assert job.measurements.baseline_lag() == (1, pytest.approx(1.3, rel=0.03))
    ranks.run([1.0, 1.3], 12)
    pace = _slow_to_pace(job)
    ranks.run([pace, 1.3], 12)
    status = job.status()
    assert status.saving_withheld == "" and status.measured_saving is not None

    ranks.run([pace, 1.0], 12)  # pipeline 1 recovered
    assert job.straggler() is None and job.publish() == [0]
    ranks.run([1.0, 1.0], 6)
    status = job.status()
    assert status.planned_iterations > 0 and status.measured_saving is None
    pattern = r"ran with pipeline 1 at 1\.\d+x the others. time, the planned ones with no straggler"
    assert re.search(pattern, status.saving_withheld)

    restarted = Job.from_record(json.loads(json.dumps(job.to_record())), {}, {})
    assert restarted.measurements.baseline_lag() == job.measurements.baseline_lag()


def test_before_the_planned_iterations_tell_their_straggler_the_saving_withheld_says_so():
    """The baseline ran with pipeline 1 1.3x slow; the plans' first iterations are too few for the
    detector to tell whether it still straggles: the saving is withheld, and not for "no
    straggler" (nothing measured that yet), until it is told."""
    job, ranks = _baseline_then_plan([1.0, 1.3])
    ranks.run([1.0, 1.3], 3)
    status = job.status()
    assert status.planned_iterations > 0 and status.measured_saving is None
    pattern = (
        r"^the baseline iterations ran with pipeline 1 at 1\.\d+x the others' time, and whether the planned ones "
        r"still do is not measured yet \(stragglers are decided on 5 iterations of every pipeline under its plan\)"
    )
    assert re.search(pattern, status.saving_withheld) and "no straggler" not in status.saving_withheld
    ranks.run([1.0, 1.3], 6)
    assert job.straggler()[:3:2] == (1, "detected") and job.status().saving_withheld == ""


def test_a_straggler_that_appears_after_the_baseline_withholds_the_saving():
    job, ranks = _baseline_then_plan([1.0, 1.0])
    ranks.run([1.0, 1.0], 8)
    assert job.status().saving_withheld == "" and job.status().measured_saving is not None
    ranks.run([1.0, 1.25], 12)
    pace = _slow_to_pace(job)
    ranks.run([pace, 1.25], 6)
    withheld = job.status().saving_withheld
    assert withheld.startswith("the baseline iterations ran with no straggler, the planned ones with pipeline 1")
    assert "(detected)" in withheld


def test_a_plan_with_the_clocks_in_force_is_no_change():
    """The straggler slows further: the plan solved for its new pace sets every instruction to the
    clock pipeline 0 runs already. No new version then: its planned mean goes on, and its plan's
    check (whose new plan would take a reference window) is not started over."""
    job, ranks = _baseline_then_plan([1.0, 1.0])
    ranks.run([1.0, 1.2], 12)
    pace = _slow_to_pace(job)
    ranks.run([pace, 1.2], 8)
    version, planned, check = job.plan_book.last_version, job.status().planned_iterations, job.model.checks[0]
    assert planned > 0 and check.version == version
    ranks.run([pace, 1.35], 12)  # now 1.35x: another pace
    ((key, _),) = job.missing_plans()
    assert key[1] > pace and "being solved; plan v2 runs meanwhile" in job.status().pipelines[0].reason
    same = _result(key[1], 120.0, freq=1110)
    job.add_result(key, same)
    assert job.kept(key, same) == [0] and job.publish() == []
    status = job.status()
    assert job.plan_book.last_version == version and job.plans[0].deadline_s == key[1]  # serving the new deadline
    assert status.planned_iterations == planned + 12 and status.pipelines[0].reason == ""
    assert job.model.checks[0] is check and check.version == version and check.start == job.plans[0].start_iteration
    ranks.run([pace, 1.35], 4)
    assert job.status().planned_iterations == planned + 16 and job.publish() == []
    uploads = {"stage-0": stage_profile(0), "stage-1": stage_profile(1)}
    again = Job.from_record(json.loads(json.dumps(job.to_record())), uploads, {})
    assert again.plans[0].deadline_s == key[1] and again.plans[0].version == version
    assert again.missing_plans() == [] and again.publish() == []  # solved, and in force: nothing to do again


def test_a_reference_window_neither_counts_as_planned_nor_restarts_the_planned_mean():
    job, ranks = _baseline_then_plan([1.0, 1.0])
    ranks.run([1.0, 1.0], 8)
    before = job.status().planned_iterations
    assert before > 0
    job.plan_book.references[0] = _result(0.9, 200.0)  # verification's window at maximum clocks
    assert job.publish() == [0] and job.plans[0].reference
    ranks.run([0.9, 1.0], 8)
    status = job.status()
    assert status.planned_iterations == before  # the window's iterations are not the plan's
    assert status.pipelines[0].predicted_iteration_time_s == pytest.approx(1.0)  # the plan it checks
    del job.plan_book.references[0]
    assert job.publish() == [0] and not job.plans[0].reference  # the plan resumes under a new version
    ranks.run([1.0, 1.0], 8)
    assert job.status().planned_iterations > before  # counted on from before the window


def test_a_restarted_service_tells_a_finished_jobs_last_iteration_and_planned_mean():
    """The ranks finished, then the service restarted: its status still tells how far the job got
    and what its plans measured (not "no iteration reported yet"); ranks that run on add to them."""
    job, ranks = _baseline_then_plan([1.0, 1.0])
    ranks.run([1.0, 1.0], 8)
    before = job.status()
    again = Job.from_record(json.loads(json.dumps(job.to_record())), {}, {})
    after = again.status()
    assert after.last_iteration == before.last_iteration == ranks.iteration - 1
    assert after.planned_iterations == before.planned_iterations > 0
    assert after.measured_saving == pytest.approx(before.measured_saving)
    resumed = _Ranks(again)
    resumed.iteration = ranks.iteration
    resumed.run([1.0, 1.0], 2)
    assert again.status().planned_iterations == before.planned_iterations + 2
    assert again.status().last_iteration == ranks.iteration + 1

    again.rerun()  # a new run of the job: its iterations start over
    assert again.status().last_iteration == -1 and again.status().planned_iterations == 0
    damaged = Job.from_record({**job.to_record(), "planned": [1, "x"]}, {}, {})
    assert damaged.status().planned_iterations == 0 and damaged.plans  # the job resumes all the same


def test_a_declared_factor_the_iterations_contradict_gives_way_to_the_measured_one(caplog):
    """Pipeline 2 was declared 1.5x slow, but runs as fast as the others: they would wait for a
    pace nobody keeps (an outsider's job ran 48.6% slower so). Its measured factor sets the pace
    instead; one WARNING and the pipeline's status say so, with the command to fix it. Once it
    runs near the declared factor, the declaration applies again."""
    job = _dp_job(dp=3)
    job.declare_straggler(2, 1.5)
    ((key, _),) = job.missing_plans()
    job.add_result(key, _result(1.5, 120.0, freq=1110))
    assert job.publish() == [0, 1]
    ranks = _Ranks(job)
    with caplog.at_level("WARNING", logger="perseus.service.measurements"):
        ranks.run([1.5, 1.5, 1.0], 12)
    assert len([r for r in caplog.records if "declared 1.500x" in r.getMessage()]) == 1
    assert ranks.changes == 1 and job.straggler() is None  # planned at the measured pace: none
    assert job.publish() == [0, 1] and job.plans[0].deadline_s is None  # back to no slowdown
    reason = job.status().pipelines[2].reason
    assert "its iterations measure 1.0" in reason and "--pipeline 2 --factor 1.0" in reason
    ranks.run([1.0, 1.0, 1.0], 12)
    assert ranks.changes == 1 and job.straggler() is None  # stable: no flapping

    ranks.run([1.0, 1.0, 1.45], 12)  # now it runs near its declared factor
    assert job.straggler() == (2, 1.5, "declared") and job.status().pipelines[2].reason == ""


def test_the_jobs_baseline_is_only_iterations_every_pipeline_ran_at_baseline():
    """Pipeline 0's stage 1 still sweeps (a lower clock) while pipeline 1 already runs at default
    clocks: those iterations are not the job's baseline, which every rank must run at default
    clocks (an outsider's job had its baseline 7.3% slow from such iterations)."""
    job = Job(job_spec(world_size=4, dp=2, rank_mapping="torch", warmup_iterations=2))
    for r in range(4):
        job.add_rank(rank_info(r, stage=r % 2, dp_index=r // 2, timeline=True))
    steps = len(job.schedule.stages[0])
    begins = tuple(range(0, 1000 * steps, 1000))
    ends = tuple(b + 900 for b in begins)

    def spans(rank: int, iteration: int, phase: str) -> ReportSpans:
        return ReportSpans(job.job_id, rank, iteration, phase, None, 1000 * steps, begins, ends)

    for iteration in (1, 2, 3):
        profiling = iteration < 3  # pipeline 0's stage 1 (rank 1) ends its sweep at iteration 3
        for rank in range(4):
            job.add_spans(spans(rank, iteration, "profiling" if rank == 1 and profiling else "planning"))
        for rank in range(4):
            job.record(ReportIteration(job.job_id, rank, iteration, 0.5 if rank == 1 and profiling else 0.4, 50.0))
    status = job.status()
    assert status.baseline_iterations == 1 and status.baseline_iteration_time_s == pytest.approx(0.4)


def test_measured_iterations_are_saved_every_10_s_and_once_after_the_last(tmp_path):
    """A job's measured figures are written at most every MEASURED_SAVE_S while iterations come,
    and once more that long after the last, so a finished job's final figures survive a restart."""
    from perseus.service.keeper import MEASURED_SAVE_S, Keeper
    from perseus.service.state import StateDir

    job, ranks = _baseline_then_plan([1.0, 1.0])
    now = [100.0]
    keeper = Keeper(StateDir(tmp_path / "state"), {job.job_id: job}, clock=lambda: now[0])
    saved = []
    keeper.state.save_job = saved.append  # type: ignore[method-assign]
    for _ in range(5):  # five iterations within a second: one save
        keeper.measured(job)
        if keeper.save_due():
            keeper.save_unsaved()
        now[0] += 0.2
    assert len(saved) == 1
    ranks.run([1.0, 1.0], 3)  # the job's last iterations; nothing comes after them
    keeper.measured(job)
    now[0] += MEASURED_SAVE_S / 2
    assert not keeper.save_due()
    now[0] += MEASURED_SAVE_S
    assert keeper.save_due()
    keeper.save_unsaved()
    assert len(saved) == 2 and saved[-1]["last_iteration"] == ranks.iteration - 1
    now[0] += 3 * MEASURED_SAVE_S
    assert not keeper.save_due()  # nothing new measured


def test_an_iterations_log_line_says_a_stragglers_energy_is_predicted_as_profiled():
    job, ranks = _baseline_then_plan([1.0, 1.3])
    ranks.run([1.0, 1.3], 12)
    line = job.describe(Measured(ranks.iteration, 1.3, 300.0))
    assert "pipeline 1 straggles 1.2" in line or "pipeline 1 straggles 1.3" in line
    assert "energy predicted as profiled" in line
    assert "straggles" not in _baseline_then_plan([1.0, 1.0])[0].describe(Measured(5, 1.0, 300.0))
