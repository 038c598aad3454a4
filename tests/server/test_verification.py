"""Calibration and verification inside one job (no sockets): the job asks for spans, fits its model
on them before any plan, plans on the calibrated profile, checks the plan on the measured
iterations against a fresh reference window at maximum clocks, re-plans with a growing margin
when it runs over, falls back to maximum clocks after the cap, and says all of it in its status.
`PlanCheck` and the profile margins on their own too."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import statistics

import pytest
from server_helpers import FREQUENCIES, job_spec, rank_info, stage_profile
from timeline_helpers import BLOCKING_W, GAP_S, profile, timelines

from perseus.planner import Planner
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.schedules import build_schedule
from perseus.service.calibration import fit
from perseus.service.job import Job
from perseus.service.model import REMEASURED, max_clock_result, with_margin
from perseus.service.planning import PlanResult, plan_pipeline
from perseus.service.timelines import FITTED, MAX_ATTEMPTS, MAX_REFITS, MAX_TIMELINES, MIN_ITERATIONS, Calibrations
from perseus.service.verification import (
    FALLBACK,
    FRESH,
    HOLDS,
    MAX_REFERENCES,
    MAX_REPLANS,
    PERSISTS,
    REFERENCE,
    REPLANNING,
    RESUME,
    SKIP,
    VERIFYING,
    WINDOW,
    PlanCheck,
    Verdict,
    grown_margin,
    noise_floor,
)
from perseus.wire.messages import ReportIteration
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec

STAGES = 4


def feed(check: PlanCheck, start: int, values: list[float]):
    verdicts = []
    for i, value in enumerate(values):
        verdict = check.add(start + i, value)
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


def referenced(check: PlanCheck, at: int, values: list[float]) -> int:
    """The reference window the check asked for, switched to at iteration `at`, its iterations
    taking `values` (WINDOW of them); the plan resumes after it. The first iteration counted then."""
    resume, verdict = reference_window(check, at, values)
    assert verdict.action == RESUME and verdict.measured_s == pytest.approx(statistics.median(values))
    return resume


def reference_window(check: PlanCheck, at: int, values: list[float]) -> tuple[int, Verdict]:
    """`referenced`, with the verdict that ends the window: RESUME, or (after a suspect window) a
    correction; the next plan, resumed or corrected, starts after it."""
    assert check.state != REFERENCE and check.awaiting
    version = check.version
    check.plan_started(version + 1, at, check.baseline_target_s, False, check.noise, check.scale, reference=True)
    assert check.state == REFERENCE and not feed(check, at, [99.0] * SKIP)  # the switch: not counted
    (verdict,) = feed(check, at + SKIP, values)
    resume = at + SKIP + WINDOW
    fallback = verdict.action == FALLBACK
    check.plan_started(version + 2, resume, check.baseline_target_s, fallback, check.noise, check.scale)
    return resume + SKIP, verdict


def drive(check: PlanCheck, at: int, plan_s: float, reference_s: float, windows: int) -> list[str]:
    """`windows` windows of the plan from iteration `at`, each iteration taking `plan_s`, and every
    reference window the check asks for meanwhile at `reference_s`: the verdicts' actions (a
    reference window's own only when it corrects the plan)."""
    return drive_on(check, at, plan_s, reference_s, windows)[0]


def drive_on(check: PlanCheck, at: int, plan_s: float, reference_s: float, windows: int) -> tuple[list[str], int]:
    """`drive`, and the iteration after its last window."""
    actions = []
    for _ in range(windows):
        verdicts = feed(check, at, [plan_s] * WINDOW)
        at += WINDOW
        actions += [v.action for v in verdicts]
        if verdicts and verdicts[-1].action == REFERENCE:
            at, verdict = reference_window(check, at, [reference_s] * WINDOW)
            if verdict.action != RESUME:
                actions.append(verdict.action)
    return actions, at


def test_a_plan_is_checked_in_windows_after_its_switch_against_a_fresh_reference():
    check = PlanCheck(tolerance=0.01)
    check.plan_started(version=1, start_iteration=10, target_s=1.0, fallback=False)
    assert check.state == "verifying"
    assert not feed(check, 0, [9.0] * (10 + SKIP))  # before the plan and its switch: not counted
    (verdict,) = feed(check, 10 + SKIP, [1.005] * WINDOW)
    assert verdict.action == REFERENCE and verdict.excess == pytest.approx(0.005) and "fresh" in verdict.reason
    assert not feed(check, 10 + SKIP + WINDOW, [9.0] * 5)  # still the plan, until the switch to maximum clocks
    at = referenced(check, 100, [0.995] * WINDOW)
    assert check.target_s == pytest.approx(0.995)
    (verdict,) = feed(check, at, [1.0] * WINDOW)
    assert verdict.action == HOLDS and verdict.excess == pytest.approx(1.0 / 0.995 - 1) and check.state == HOLDS
    assert not feed(check, at + WINDOW, [1.0] * WINDOW)  # holds: said once
    check.plan_started(version=4, start_iteration=200, target_s=1.0, fallback=False)
    assert check.measured_s is None and check.excess is None  # plan v3's window says nothing of v4
    assert check.target_s == pytest.approx(0.995)  # the reference still is the target


def test_a_job_slower_than_its_baseline_is_not_the_plans_doing():
    """The host got 5% slower after the baseline: against a fresh reference the plan holds."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.055, 1.05, 2) == [REFERENCE, HOLDS]
    assert check.replans == 0 and check.target_s == pytest.approx(1.05)


def test_a_plan_held_to_a_baseline_measured_on_a_busier_host_is_corrected():
    """The baseline ran 10% slow (the host was busy then): the plan's 5% excess over maximum clocks
    passes against it, not against the fresh reference."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.10, fallback=False)
    assert drive(check, SKIP, 1.05, 1.0, 4) == [REFERENCE, REFERENCE, REFERENCE, REPLANNING]
    assert check.replans == 1 and "+5.0%" in check.reason and "references before and after" in check.reason


def test_a_burst_of_host_load_over_two_windows_is_not_the_plans_doing():
    """Right after a reference the host slows for two windows: before re-planning, a reference
    taken after them shows maximum clocks back at speed, and the plan holds again."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.0, 1.0, 2) == [REFERENCE, HOLDS]
    at = check.start + SKIP + WINDOW
    assert check.pending() == ""
    assert not feed(check, at, [1.4] * WINDOW)
    assert check.state == HOLDS and check.pending().startswith("its last window ran +40.0% over its target (1 in a row")
    (verdict,) = feed(check, at + WINDOW, [1.4] * WINDOW)
    assert verdict.action == REFERENCE and "did not slow meanwhile" in verdict.reason
    assert drive(check, referenced(check, at + 2 * WINDOW, [1.0] * WINDOW), 1.0, 1.0, 2) == [HOLDS]
    assert check.replans == 0 and check.state == HOLDS


def test_a_plan_over_its_target_is_replanned_then_falls_back():
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    actions = drive(check, SKIP, 1.05, 1.0, 1 + 2 * PERSISTS * (MAX_REPLANS + 1))
    judged = [a for a in actions if a != REFERENCE]
    assert judged[: MAX_REPLANS + 1] == [REPLANNING] * MAX_REPLANS + [FALLBACK]
    assert 1 <= actions.count(REFERENCE) <= MAX_REFERENCES  # the first window, then once stale (FRESH)
    assert check.state == FALLBACK
    assert "falling back to maximum clocks" in check.reason and "+5.0%" in check.reason
    assert check.replans == MAX_REPLANS


def test_a_replan_that_keeps_the_clocks_goes_on_verifying_them():
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    at = SKIP
    for k in range(MAX_REFERENCES):  # references used up on a host that keeps slowing
        at = drive_on(check, at, 1.03**k, 1.03**k, FRESH // WINDOW + 2)[1]
    assert drive_on(check, at, 1.03**MAX_REFERENCES, 9.0, PERSISTS)[0] == [REPLANNING]
    assert check.state == REPLANNING
    check.clocks_kept()
    assert check.state == VERIFYING and check.reason.endswith("keeps the clocks in force: verifying them on")
    check.clocks_kept()  # said once
    assert check.reason.count("verifying them on") == 1


def test_references_are_taken_once_stale_and_at_most_max_references_times():
    """A host that keeps slowing: each time a window runs over a reference older than FRESH, a
    fresh one is taken (the plan holds against it), until MAX_REFERENCES; then the plan is judged."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    at, segment = SKIP, FRESH // WINDOW + 2
    for k in range(MAX_REFERENCES):
        pace = 1.03**k
        actions, at = drive_on(check, at, pace, pace, segment)
        assert actions == [REFERENCE, HOLDS], k
    assert check.references == MAX_REFERENCES and check.replans == 0
    actions, at = drive_on(check, at, 1.03**MAX_REFERENCES, 9.0, PERSISTS)
    assert actions == [REPLANNING]


def test_a_replans_margin_is_sized_on_the_least_excess_of_the_windows_that_ran_over():
    """A plan 4% over, and a spike of other work in the window right after the confirming
    reference (+30%): the plan is re-planned, with a margin for its 4%, not for the spike."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.04, 1.0, 1) == [REFERENCE]
    at = check.start + SKIP
    assert not feed(check, at, [1.04] * WINDOW)
    (verdict,) = feed(check, at + WINDOW, [1.05] * WINDOW)
    assert verdict.action == REFERENCE and "did not slow meanwhile" in verdict.reason
    at = referenced(check, at + 2 * WINDOW, [1.0] * WINDOW)
    (verdict,) = feed(check, at, [1.3] * WINDOW)  # the suspect window: a spike
    assert verdict.action == REFERENCE
    _, verdict = reference_window(check, at + WINDOW, [1.0] * WINDOW)
    assert verdict.action == REPLANNING and verdict.excess == pytest.approx(0.3)
    assert verdict.sustained == pytest.approx(0.04) and verdict.margin_excess == pytest.approx(0.04)
    assert "margin for +4.0%" in verdict.reason
    # Without a spike, the decisive window's own excess: the least of them all the same.
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.05, 1.0, 5) == [REFERENCE, REFERENCE, REFERENCE, REPLANNING]
    assert check.replans == 1


def test_a_passing_stall_is_not_the_plans_doing():
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.0, 1.0, 1) == [REFERENCE]
    at = check.start + SKIP
    assert not feed(check, at, [1.2] * WINDOW)  # one window over: wait for the next
    (verdict,) = feed(check, at + WINDOW, [1.0] * WINDOW)
    assert verdict.action == HOLDS and check.replans == 0


def test_margins_grow_and_slow_only_what_the_plan_slows():
    assert grown_margin(0.0, 0.05, 0.01) == pytest.approx(0.10)
    assert grown_margin(0.10, 0.001, 0.01) == pytest.approx(0.12)  # at least the tolerance
    points = [ProfilePoint(1410, 0.010, 3.0), ProfilePoint(1110, 0.012, 2.5)]
    margined = with_margin(Profile({(0, "forward"): points}, 80.0), 0.1).points[(0, "forward")]
    assert margined[0] == points[0]
    assert margined[1].time == pytest.approx(0.0132) and margined[1].energy == pytest.approx(2.5 + 80.0 * 0.0012)


def test_the_fallback_plan_runs_every_instruction_at_its_highest_clock():
    schedule = build_schedule("1f1b", STAGES, 4)
    prof = profile(STAGES)
    solved, _ = plan_pipeline(Planner(schedule, prof))
    fallback = max_clock_result(schedule, prof, solved)
    assert {f for row in fallback.stage_frequencies for f in row} == {FREQUENCIES[0]}
    assert fallback.iteration_time_s == solved.baseline_iteration_time_s
    assert fallback.energy_j == solved.baseline_energy_j


def spans_of(job: Job, iteration: int, timeline, phase: str = "planning") -> list[ReportSpans]:
    return [
        ReportSpans(
            job.job_id,
            s,
            iteration,
            phase,
            None,
            round(timeline.steps[s] * 1e6),
            tuple(round(t * 1e6) for t in timeline.begins[s]),
            tuple(round(t * 1e6) for t in timeline.ends[s]),
        )
        for s in range(STAGES)
    ]


def calibrated_job(work_s: float = 0.006, gap_s: float = GAP_S) -> Job:
    """A 4-stage job whose ranks sent enough baseline spans (`gap_s` of host work between a
    stage's instructions), fitted and planned (as the service's workers would)."""
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    job = Job(spec)
    for r in range(STAGES):
        job.add_rank(rank_info(r, timeline=True))
    assert job.table(0, 0, 0).spans
    prof = profile(STAGES, work_s)
    for s in range(STAGES):
        job.add_profile(s, s, Profile({k: v for k, v in prof.points.items() if k[0] == s}, 83.64))
    assert job.missing_plans() == [] and job.calibration_tasks() == []  # no spans yet: no plan
    for i, timeline in enumerate(timelines(job.schedule, prof, count=MIN_ITERATIONS, gap_s=gap_s), start=1):
        for spans in spans_of(job, i, timeline):
            job.add_spans(spans)
    (task,) = job.calibration_tasks()
    models, measured, fitted_on = task
    job.set_calibration(models, fit(job.schedule, measured, fitted_on))
    return job


def solve(job: Job) -> None:
    for key, prof in job.missing_plans():
        job.add_result(key, plan_pipeline(Planner(job.schedule, prof), key[1])[0])
    job.publish()


def report(job: Job, iteration: int, compute_s: float) -> None:
    for r in range(STAGES):
        job.record(ReportIteration(job.job_id, r, iteration, compute_s + 0.001, 100.0, compute_time_s=compute_s))


def test_a_job_plans_on_its_calibrated_model_and_corrects_a_plan_that_runs_over():
    job = calibrated_job()
    ((key, prof),) = job.missing_plans()
    assert prof.points[(3, "forward")][0].time > profile(STAGES).points[(3, "forward")][0].time  # the overheads
    solve(job)
    plan = job.plans[0]
    assert plan.version == 1 and not job.table(0, plan.start_iteration, 0).spans  # a plan runs: no more spans
    status = job.status()
    (calibration,) = status.calibrations
    assert calibration.state == "fitted" and abs(calibration.error) <= 0.01 and len(calibration.stages) == STAGES
    pipeline = status.pipelines[0]
    assert (
        pipeline.verification == "verifying" and pipeline.target_iteration_time_s == pipeline.baseline_iteration_time_s
    )

    target = pipeline.target_iteration_time_s
    it = plan.start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, target * 1.06)
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == REFERENCE and job.correct(k, verdict) == []  # no re-plan before a fresh reference
    job.publish()
    reference = job.plans[0]
    assert reference.reference and reference.version == 2 and reference.start_iteration >= it
    assert {f for row in reference.stage_frequencies for f in row} == {FREQUENCIES[0]}
    assert job.table(0, reference.start_iteration, 1).frequencies == reference.stage_frequencies[0]
    assert job.status().pipelines[0].verification == "reference"
    assert job.status().pipelines[0].plan_since == 1  # a reference window is the plan it checks
    fresh = target * 1.02  # the host slowed a little since the baseline
    it = reference.start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, fresh)
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == RESUME and verdict.measured_s == pytest.approx(fresh)
    assert job.correct(k, verdict) == []
    assert job.calibration_tasks() == []  # 2% from the baseline the model was fitted on: no fit again
    job.publish()
    resumed = job.plans[0]
    assert not resumed.reference and resumed.version == 3 and resumed.stage_frequencies == plan.stage_frequencies
    assert job.status().pipelines[0].plan_since == 1  # resumed: still plan 1's clocks
    assert job.status().pipelines[0].target_iteration_time_s == pytest.approx(fresh)
    it = resumed.start_iteration + SKIP
    for _ in range(WINDOW * PERSISTS):
        report(job, it, fresh * 1.06)
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == REFERENCE and job.correct(k, verdict) == []  # once more, after those windows
    job.publish()
    assert run_windows(job, fresh * 1.06, fresh, 1) == [RESUME] and job.plans[0].version == 5
    it = job.plans[0].start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, fresh * 1.06)
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == REFERENCE and "host that slowed" in verdict.reason and job.correct(k, verdict) == []
    job.publish()
    assert job.plans[0].reference and job.plans[0].version == 6 and job.plans[0].since == 1
    it = job.plans[0].start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, fresh)  # maximum clocks as fast as before the suspect window: the plan's excess
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == REPLANNING and verdict.excess == pytest.approx(0.06)
    assert job.correct(k, verdict) == [key]  # its plan is solved again, with a margin
    assert not job.plan_book.references  # the reference window ends with it
    state = job.model.calibrations.get(key[0])
    assert state.margin == pytest.approx(0.12)
    ((_, margined),) = job.missing_plans()
    assert margined.points[(0, "forward")][1].time == pytest.approx(prof.points[(0, "forward")][1].time * 1.12)
    solve(job)
    assert job.plans[0].version == 7 and not job.plans[0].reference
    status = job.status()
    assert status.pipelines[0].replans == 1 and "re-planning (1 of 3)" in status.pipelines[0].reason
    assert status.pipelines[0].plan_since == 7  # the re-plan runs other clocks: a plan of its own
    record = json.loads(json.dumps(job.to_record()))
    profiles = {f"stage-{s}": job.profiles[job.spec.gpu_model][s] for s in range(STAGES)}
    assert Job.from_record(record, profiles, {}).status().pipelines[0].plan_since == 7  # kept across restarts
    assert status.calibrations[0].margin == pytest.approx(0.12)


def run_windows(job: Job, plan_s: float, reference_s: float, windows: int) -> list[str]:
    """`windows` windows of the pipeline's newest plan, each iteration taking `plan_s` (a reference
    window `reference_s`), acting on each verdict as the service does: the verdicts' actions."""
    actions = []
    for _ in range(windows):
        plan = job.plans[0]
        it = max(plan.start_iteration + SKIP, job.last_iteration + 1)
        for _ in range(WINDOW):
            report(job, it, reference_s if plan.reference else plan_s)
            it += 1
        for k, verdict in job.model.take_verdicts():
            actions.append(verdict.action)
            job.correct(k, verdict)
        solve(job)
    return actions


def test_after_the_cap_the_pipeline_falls_back_to_maximum_clocks():
    job = calibrated_job()
    solve(job)
    target = job.status().pipelines[0].target_iteration_time_s
    actions = run_windows(job, target * 1.1, target, 2 + 2 * PERSISTS * (MAX_REPLANS + 1))
    assert [a for a in actions if a not in (REFERENCE, RESUME)][: MAX_REPLANS + 1] == [REPLANNING] * MAX_REPLANS + [
        FALLBACK
    ]
    status = job.status()
    pipeline = status.pipelines[0]
    assert pipeline.verification == "fallback" and "falling back to maximum clocks" in pipeline.reason
    assert set(job.plans[0].stage_frequencies[0]) == {FREQUENCIES[0]} and not job.plan_book.references
    assert "fell back to maximum clocks" in status.saving_withheld and status.measured_saving is None


def baseline_of(job: Job, prof: Profile, seed: int = 0) -> None:
    """A run's MIN_ITERATIONS baseline iterations of a workload whose GPU work `prof` holds, fitted."""
    for i, timeline in enumerate(timelines(job.schedule, prof, count=MIN_ITERATIONS, seed=seed), start=1):
        for spans in spans_of(job, i, timeline):
            job.add_spans(spans)


def fit_due(job: Job) -> set[str]:
    """Fit what is due, as the service's calibration worker would; the GPU models dropped."""
    ((models, measured, fitted_on),) = job.calibration_tasks()
    return job.set_calibration(models, fit(job.schedule, measured, fitted_on))


@pytest.mark.parametrize("work_s", [0.006, 0.018])
def test_a_new_run_is_fitted_on_its_own_baseline_and_a_profile_it_outgrew_is_measured_again(work_s):
    job = calibrated_job()
    solve(job)
    old_target = job.status().pipelines[0].target_iteration_time_s
    job.rerun()  # the same spec registered again: a new run of the ranks
    assert not job.plans and job.table(0, 0, 0).spans and job.table(0, 0, 0).frequencies is None
    assert job.status().pipelines[0].baseline_iteration_time_s is None  # the earlier run's is not this run's
    workload = profile(STAGES, work_s)
    baseline_of(job, workload, seed=1)
    record = json.loads(json.dumps(job.to_record()))
    assert record["inherited"] == ["sim-a100"] and Job.from_record(record, {}, {}).profiling.inherited == {"sim-a100"}
    if work_s == 0.006:  # the same workload: its profile still fits, planned again on this run's fit
        assert fit_due(job) == set() and not job.profiling.inherited
    else:  # three times the GPU work: dropped with its plans, profiled again
        assert fit_due(job) == {"sim-a100"} and job.phase.value == "profiling" and not job.profiled_stages
        (calibration,) = job.status().calibrations
        assert calibration.state == "collecting" and "no longer matches" in calibration.reason
        assert job.table(0, 0, 0).sweep_steps  # its ranks sweep again
        for s in range(STAGES):
            job.add_profile(s, s, Profile({k: v for k, v in workload.points.items() if k[0] == s}, 83.64))
        assert fit_due(job) == set()  # measured in this run: not checked against itself
    solve(job)
    status = job.status()
    assert status.phase == "planned" and status.calibrations[0].state == "fitted"
    target = status.pipelines[0].target_iteration_time_s
    assert target == pytest.approx(old_target, rel=0.02) if work_s == 0.006 else target > 2.5 * old_target


@pytest.mark.parametrize("again_s", [0.006, 0.0072])
def test_a_profile_its_own_baseline_contradicts_is_measured_again_once(again_s):
    # The sweep ran 20% slow (host load, a throttled GPU while it swept): the spans of the
    # baseline take 0.83x the profile's times at the top clock, and no fit can mend that.
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    job = Job(spec)
    for r in range(STAGES):
        job.add_rank(rank_info(r, timeline=True))
    slow = profile(STAGES, 0.0072)
    for s in range(STAGES):
        job.add_profile(s, s, Profile({k: v for k, v in slow.points.items() if k[0] == s}, 83.64))
    workload = profile(STAGES, 0.006)
    baseline_of(job, workload)
    assert fit_due(job) == {"sim-a100"} and job.phase.value == "profiling" and not job.profiled_stages
    (calibration,) = job.status().calibrations
    assert calibration.state == "collecting" and REMEASURED in calibration.reason
    assert re.search(r"0\.8\dx the profile's time", calibration.reason) and job.table(0, 0, 0).sweep_steps
    again = profile(STAGES, again_s)
    for s in range(STAGES):
        job.add_profile(s, s, Profile({k: v for k, v in again.points.items() if k[0] == s}, 83.64))
    assert fit_due(job) == set()  # once: a second such profile is not dropped again
    (calibration,) = job.status().calibrations
    if again_s == 0.006:  # measured right this time: planned
        solve(job)
        assert job.status().phase == "planned" and calibration.state == "fitted"
    else:  # the fit misses as any fit does: more baseline iterations, then no plan
        assert calibration.state == "collecting" and calibration.reason.startswith("calibration attempt 1 missed")
        assert job.profiled_stages


def test_a_baseline_the_model_misses_throughout_is_fitted_again_on_fresh_windows(caplog):
    # Host load that spoils the whole baseline: the last rank's steps run 6% past the first
    # rank's (the iteration), after its instructions, which no model of them reproduces. Three
    # fits miss (8, 16, then 24 iterations), the job stays at maximum clocks with a WARNING, and
    # a fresh window of quiet iterations (none of the spoiled ones) is fitted and planned on.
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    job = Job(spec)
    for r in range(STAGES):
        job.add_rank(rank_info(r, timeline=True))
    prof = profile(STAGES)
    for s in range(STAGES):
        job.add_profile(s, s, Profile({k: v for k, v in prof.points.items() if k[0] == s}, 83.64))
    quiet = timelines(job.schedule, prof, count=3 * MAX_TIMELINES)
    spoiled = [dataclasses.replace(tl, steps=(*tl.steps[:-1], 1.06 * tl.steps[0])) for tl in quiet[:MAX_TIMELINES]]
    iteration = 0

    def send(lines) -> None:
        nonlocal iteration
        for timeline in lines:
            iteration += 1
            for spans in spans_of(job, iteration, timeline):
                job.add_spans(spans)

    with caplog.at_level(logging.INFO, logger="perseus.service.timelines"):
        for attempt in range(1, MAX_ATTEMPTS + 1):
            send(spoiled[(attempt - 1) * MIN_ITERATIONS : attempt * MIN_ITERATIONS])
            assert fit_due(job) == set() and not job.missing_plans()
            (calibration,) = job.status().calibrations
            assert calibration.state == "collecting" and f"calibration attempt {attempt} missed" in calibration.reason
    assert "does not reproduce the measured baseline" in calibration.reason
    assert f"no plan yet: fitting again on the next {MAX_TIMELINES} baseline iterations" in calibration.reason
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "attempt 3 missed" in r.getMessage()]
    assert len(warned) == 1 and "model " in warned[0].getMessage()  # the fit's figures, for whoever reads the log
    send(quiet[MAX_TIMELINES : 2 * MAX_TIMELINES - 1])
    assert job.calibration_tasks() == []  # a window that still holds a spoiled iteration is not fitted
    send(quiet[2 * MAX_TIMELINES - 1 : 2 * MAX_TIMELINES])
    assert fit_due(job) == set()
    solve(job)
    status = job.status()
    assert status.phase == "planned" and status.calibrations[0].state == "fitted"


def test_a_job_that_failed_on_what_a_run_measured_gets_a_fresh_chance_but_not_an_invalid_spec():
    job = calibrated_job(work_s=0.0)
    assert job.phase.value == "failed" and job.error_retryable
    job.rerun()
    assert job.phase.value == "planning" and not job.error and job.table(0, 0, 0).spans
    baseline_of(job, profile(STAGES))  # the script fixed: GPU work emulated
    assert fit_due(job) == {"sim-a100"} and job.phase.value == "profiling"
    invalid = Job(job_spec())
    invalid.fail("invalid job: a deadlock")
    invalid.rerun()
    assert invalid.phase.value == "failed"


def test_no_gpu_work_no_plan_and_the_reason_in_status():
    job = calibrated_job(work_s=0.0)
    assert job.phase.value == "failed" and job.missing_plans() == []
    assert "explains only" in job.error and "emulate" in job.error
    (calibration,) = job.status().calibrations
    assert calibration.state == "failed" and calibration.explained < 0.5


def test_ranks_that_send_no_spans_are_planned_on_the_profile_alone():
    job = Job(job_spec())
    for r in range(2):
        job.add_rank(rank_info(r))  # an earlier release: no timeline
    assert not job.table(0, 0, 0).spans
    for s in range(2):
        job.add_profile(s, s, stage_profile(s))
    ((key, prof),) = job.missing_plans()
    assert prof.points == job.pipeline_profile(key[0]).points
    (calibration,) = job.status().calibrations
    assert calibration.state == "uncalibrated" and "send no instruction spans" in calibration.reason
    assert isinstance(plan_pipeline(Planner(job.schedule, prof))[0], PlanResult)


def test_a_reference_window_past_its_switch_is_baseline_too():
    """Every pipeline at default clocks beside the plans: the job's baseline grows by the window, not
    by its switch, whose iterations still ran the plan's clocks."""
    job = calibrated_job()
    for it in range(1, MIN_ITERATIONS + 1):
        report(job, it, 0.2)
    solve(job)
    target = job.status().pipelines[0].target_iteration_time_s
    assert run_windows(job, target, target, 1) == [REFERENCE]
    reference = job.plans[0]
    assert reference.reference and job.status().baseline_iterations == MIN_ITERATIONS
    for it in range(reference.start_iteration, reference.start_iteration + SKIP):
        report(job, it, 9.0)  # the switch
    for it in range(reference.start_iteration + SKIP, reference.start_iteration + SKIP + WINDOW):
        report(job, it, 0.2)
    status = job.status()
    assert status.baseline_iterations == MIN_ITERATIONS + WINDOW
    assert status.baseline_iteration_time_s == pytest.approx(0.201) and status.planned_iterations == WINDOW


def test_a_restarted_service_keeps_the_calibration_margin_and_baseline():
    job = calibrated_job()
    for it in range(1, MIN_ITERATIONS + 1):
        report(job, it, 0.2)  # the baseline iterations whose spans the model was fitted on
    solve(job)
    job.correct(0, _over(job))
    solve(job)
    record = json.loads(json.dumps(job.to_record()))  # as job.json holds it
    profiles = {f"stage-{s}": job.profiles[job.spec.gpu_model][s] for s in range(STAGES)}
    again = Job.from_record(record, profiles, {})
    status = again.status()  # the saving is measured against the baseline measured before the restart
    before = job.status()  # the pre-plan iterations and the reference windows' (3, past their switch)
    assert status.baseline_iterations == before.baseline_iterations == MIN_ITERATIONS + 3 * WINDOW
    assert status.baseline_iteration_time_s == pytest.approx(before.baseline_iteration_time_s)
    models = job.models(0)
    assert again.model.calibrations.get(models).calibration == job.model.calibrations.get(models).calibration
    assert again.model.calibrations.get(models).margin == pytest.approx(0.12)
    assert again.planning_profile(models).points == job.planning_profile(models).points
    pipeline = again.status().pipelines[0]
    assert pipeline.verification == "verifying" and pipeline.target_iteration_time_s == pytest.approx(
        job.status().pipelines[0].target_iteration_time_s
    )
    assert pipeline.replans == job.status().pipelines[0].replans == 1  # the cap on re-plans holds across restarts
    assert Job.from_record({**record, "replans": ["x"]}, profiles, {}).status().pipelines[0].replans == 0


def test_a_restarted_service_shows_the_latest_references_target_and_measures_a_fresh_one(caplog):
    """The host slowed 5% since the baseline: the reference window's median is the target. A
    restarted service shows that target (not the baseline's, stale), and still takes a fresh
    reference before it judges the plan again."""
    job = calibrated_job()
    solve(job)
    baseline = job.status().pipelines[0].target_iteration_time_s
    assert run_windows(job, baseline * 1.05, baseline * 1.05, 3) == [REFERENCE, RESUME, HOLDS]
    target = job.status().pipelines[0].target_iteration_time_s
    assert target == pytest.approx(baseline * 1.05)
    record = json.loads(json.dumps(job.to_record()))
    profiles = {f"stage-{s}": job.profiles[job.spec.gpu_model][s] for s in range(STAGES)}
    again = Job.from_record(record, profiles, {})
    pipeline = again.status().pipelines[0]
    assert pipeline.target_iteration_time_s == pytest.approx(target) and pipeline.verification == "verifying"
    assert run_windows(again, target, target, 1) == [REFERENCE]  # judged only against a fresh one
    midway = Job.from_record(json.loads(json.dumps(again.to_record())), profiles, {})  # restarted in the reference
    assert midway.plans[0].reference and run_windows(midway, target, target, 1) == [RESUME]
    assert midway.status().pipelines[0].plan_since == 1 and midway.plans[0].version == 5  # plan 1's clocks again

    with caplog.at_level(logging.WARNING, logger="perseus.service.persistence"):
        damaged = Job.from_record({**record, "references": [[0.0, 0.01]]}, profiles, {})
    assert damaged.status().pipelines[0].target_iteration_time_s == pytest.approx(baseline)
    assert "verification's reference windows not resumed" in caplog.text


def _over(job: Job):
    """The pipeline's plan 6% over its target, against a fresh reference: the verdict."""
    target = job.status().pipelines[0].target_iteration_time_s
    actions = [REFERENCE, RESUME, REFERENCE, RESUME, REFERENCE]
    assert run_windows(job, target * 1.06, target, 2 + PERSISTS + 2) == actions
    it = job.plans[0].start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, target)  # the reference after the suspect window
        it += 1
    ((_, verdict),) = job.model.take_verdicts()
    return verdict


def test_a_straggler_aware_plan_is_held_to_the_stragglers_pace_at_the_baseline_scale():
    job = calibrated_job()
    solve(job)
    base = job.plans[0]
    baseline = job.status().pipelines[0].baseline_iteration_time_s
    slowed = dataclasses.replace(base, version=2, deadline_s=base.baseline_iteration_time_s * 1.2)
    job.model.plans_published({0: slowed}, [0], job.pipelines_of)
    assert job.model.checks[0].target_s == pytest.approx(baseline * 1.2)


def test_a_straggler_aware_plan_faster_than_the_stragglers_pace_holds_without_more_references():
    """A pipeline slowed to a straggler's pace (1.25x its maximum clocks) whose plan runs 4% under
    that pace (its model a little off) is no faster than maximum clocks: it holds, and takes no
    reference window until its last one is stale. Only a window under maximum clocks means the
    reference ran in a spike."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.25, fallback=False, scale=1.25)
    assert drive(check, SKIP, 1.2, 1.0, 1) == [REFERENCE]
    assert check.target_s == pytest.approx(1.25)
    assert drive(check, check.start + SKIP, 1.2, 1.0, FRESH // WINDOW + 4) == [HOLDS]
    assert check.references == 1
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.25, fallback=False, scale=1.25)
    assert drive(check, SKIP, 0.95, 1.0, 2) == [REFERENCE, REFERENCE]  # under maximum clocks' 1.0 s


def test_on_a_noisy_host_only_an_excess_beyond_the_references_noise_is_the_plans():
    assert noise_floor(0.0, 16) == 0.0 and noise_floor(0.04, 0) == 0.0
    noise = noise_floor(0.04, 16)  # iterations varying by 4%: two medians differ by ~4% by chance
    assert 0.03 < noise < 0.05
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False, noise=noise)
    (verdict,) = feed(check, SKIP, [1.03] * WINDOW)
    assert verdict.action == REFERENCE
    at = referenced(check, 100, [0.97, 1.03] * (WINDOW // 2))  # its iterations vary by 4.4%
    assert 0.04 < check.reference_noise < 0.06
    (verdict,) = feed(check, at, [1.03] * WINDOW * PERSISTS)
    assert verdict.action == HOLDS  # within the noise: not the plan's doing
    (verdict,) = feed(check, at + WINDOW * PERSISTS, [1.08] * WINDOW * PERSISTS)
    assert verdict.action == REFERENCE
    at = referenced(check, 500, [0.97, 1.03] * (WINDOW // 2))
    (verdict,) = feed(check, at, [1.08] * WINDOW)
    assert verdict.action == REFERENCE and "host that slowed" in verdict.reason
    # The host slowed steadily over the three windows: the plan's 1.08 s lies between maximum
    # clocks' 1.0 s before and 1.14 s after it, within the tolerance of their mean.
    at, verdict = reference_window(check, at + WINDOW, [1.13, 1.15] * (WINDOW // 2))
    assert verdict.action == RESUME and "the host slowed" in verdict.reason and check.replans == 0
    (verdict,) = feed(check, at, [1.16] * WINDOW * PERSISTS)
    assert verdict.action == REFERENCE
    at = referenced(check, 900, [0.97, 1.03] * (WINDOW // 2))
    (verdict,) = feed(check, at, [1.08] * WINDOW)
    assert verdict.action == REFERENCE
    at, verdict = reference_window(check, at + WINDOW, [0.97, 1.03] * (WINDOW // 2))
    assert verdict.action == REPLANNING and verdict.excess == pytest.approx(0.08)


def test_a_straggler_pace_is_planned_padded_against_a_baseline_padded_to_it():
    schedule = build_schedule("1f1b", STAGES, 4)
    planner = Planner(schedule, profile(STAGES))
    pace = 1.3 * planner.max_frequency_time_s
    solved, doc = plan_pipeline(planner, pace)
    assert doc["padded"] is True
    wait_j = BLOCKING_W * STAGES * (pace - planner.max_frequency_time_s)
    assert solved.baseline_energy_j == pytest.approx(planner.max_frequency_energy_j + wait_j)
    unpadded = planner.plan(deadline=pace)
    padded_unpadded_plan = unpadded.energy_j + BLOCKING_W * STAGES * (pace - unpadded.iteration_time_s)
    assert solved.energy_j <= padded_unpadded_plan + 1e-9
    assert solved.iteration_time_s <= pace + 1e-9
    no_slowdown, doc = plan_pipeline(planner)
    assert doc["padded"] is False and no_slowdown.baseline_energy_j == planner.max_frequency_energy_j


def test_a_reference_taken_in_a_spike_is_taken_again():
    """The reference window fell in a spike of other work: the plan then seems 20% faster than
    maximum clocks, which no plan is, so another reference is taken and the plan judged on it."""
    check = PlanCheck(tolerance=0.01)
    check.plan_started(1, 0, 1.0, fallback=False)
    assert drive(check, SKIP, 1.05, 1.3, 1) == [REFERENCE]
    (verdict,) = feed(check, check.start + SKIP, [1.05] * WINDOW)
    assert verdict.action == REFERENCE and "slower host" in verdict.reason and verdict.excess < -0.15
    at = referenced(check, 500, [1.0] * WINDOW)
    assert drive(check, at, 1.05, 1.0, 4) == [REFERENCE, REFERENCE, REPLANNING]


def test_a_reference_window_on_a_host_that_sped_up_fits_the_model_again(caplog):
    """The baseline ran on a busy host (3 ms of host work between instructions, 5x the usual):
    the first reference window, on the quiet host, takes over 10% less, so the model is fitted
    again on that window's spans, and the plan solved again on it."""
    caplog.set_level(logging.INFO, logger="perseus.service")
    job = calibrated_job(gap_s=0.003)
    solve(job)
    plan = job.plans[0]
    (before,) = job.status().calibrations
    target = job.status().pipelines[0].target_iteration_time_s
    it = plan.start_iteration + SKIP
    for _ in range(WINDOW):
        report(job, it, target)
        it += 1
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == REFERENCE and job.correct(k, verdict) == []
    job.publish()
    reference = job.plans[0]
    assert reference.reference and job.table(0, reference.start_iteration, 1).spans  # its spans are asked for
    quiet = timelines(job.schedule, profile(STAGES), count=SKIP + WINDOW, seed=1)
    for n, timeline in enumerate(quiet):
        for spans in spans_of(job, reference.start_iteration + n, timeline, phase="reference"):
            job.add_spans(spans)
        report(job, reference.start_iteration + n, timeline.compute_s)
    ((k, verdict),) = job.model.take_verdicts()
    assert verdict.action == RESUME and verdict.measured_s < 0.9 * target
    assert job.correct(k, verdict) == []
    assert "fitted again on that window (1 of 2)" in caplog.text
    job.publish()
    assert not job.plans[0].reference and job.plans[0].version == 3  # the plan runs while the model is fitted
    assert job.missing_plans() == []
    ((models, measured, window),) = job.calibration_tasks()
    assert len(window) == WINDOW and job.missing_plans() == []  # nothing solved on the old fit meanwhile
    job.set_calibration(models, fit(job.schedule, measured, window))
    (after,) = job.status().calibrations
    assert after.measured_s < 0.9 * before.measured_s and abs(after.error) <= 0.01
    ((key, margined),) = job.missing_plans()  # solved again on the new fit
    solve(job)
    assert job.plans[0].version == 4 and job.plans[0].iteration_time_s < 0.9 * plan.iteration_time_s
    assert job.calibration_tasks() == []


def test_only_a_reference_window_faster_than_the_fit_fits_the_model_again():
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    calibrations = Calibrations(spec)
    models = ("sim-a100",) * STAGES
    state = calibrations.get(models)
    state.state, state.fitted_compute_s = FITTED, 1.0
    window = timelines(build_schedule("1f1b", STAGES, 8), profile(STAGES), count=WINDOW)
    assert calibrations.refit(models, 1.2, window) == ""  # slower: maybe a passing spike
    assert calibrations.refit(models, 0.92, window) == ""  # within REFIT_DRIFT
    assert calibrations.refit(models, 0.8, window[: MIN_ITERATIONS - 1]) == ""  # too few spans
    for n in range(1, MAX_REFITS + 1):
        assert "sped up" in calibrations.refit(models, 0.8, window) and not calibrations.ready(models)
        assert calibrations.due(models, 0) and calibrations.fitting(models, 0) == tuple(window)
        assert state.refitting and not calibrations.ready(models)  # nothing solved on the old fit meanwhile
        missed = dataclasses.replace(state.calibration or _some_fit(), model_s=2.0)  # far off: the fit misses
        assert calibrations.fitted("job", models, missed if n == 1 else _some_fit())
        assert calibrations.ready(models) and state.state == FITTED
        assert (state.calibration is None) == (n == 1)  # a missed fit keeps the model it would replace
    assert calibrations.refit(models, 0.5, window) == ""  # MAX_REFITS made


def _some_fit():
    """A fit that reproduces its baseline."""
    job = calibrated_job()
    (calibration,) = job.model.calibrations.states.values()
    assert calibration.calibration is not None and not calibration.calibration.reason()
    return calibration.calibration


def test_a_job_that_ends_in_a_reference_window_shows_the_verdict_before_it():
    job = calibrated_job()
    solve(job)
    target = job.status().pipelines[0].target_iteration_time_s
    assert run_windows(job, target, target, 3) == [REFERENCE, RESUME, HOLDS]
    assert run_windows(job, target * 1.06, target, PERSISTS) == [REFERENCE]  # over its target: checked again
    assert job.plans[0].reference and job.status().pipelines[0].verification == "reference"
    for rank in range(job.spec.world_size - 1):
        job.close_rank(rank)
    assert job.status().pipelines[0].verification == "reference"  # a rank still runs the window
    job.close_rank(job.spec.world_size - 1)
    pipeline = job.status().pipelines[0]
    assert pipeline.verification == "holds" and "the job ended in a reference window" in pipeline.reason
