"""From a registered job to a plan: its schedule, its merged profile, and the planner call.

`make_planner` and `plan_pipeline` are what the service's worker thread runs; everything here is
deterministic.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from perseus.exceptions import ConfigError, PlanError, ScheduleError
from perseus.profiler.profile import Profile
from perseus.schedules import Instruction, Kind, Schedule, build_schedule
from perseus.wire.spec import JobSpec


def job_schedule(spec: JobSpec) -> Schedule:
    """The job's schedule: its stage_orders when given, else the named builder's. ConfigError if invalid."""
    try:
        if spec.stage_orders is None:
            schedule = build_schedule(spec.schedule_name, spec.pp, spec.num_microbatches, spec.num_chunks)
        else:
            stages = tuple(
                tuple(Instruction(s, Kind(kind), mb, chunk) for kind, mb, chunk in order)
                for s, order in enumerate(spec.stage_orders)
            )
            schedule = Schedule(
                spec.schedule_name,
                spec.num_microbatches,
                stages,
                spec.num_chunks,
                spec.schedule_style,
                spec.overlapped or (),
            )
        schedule.validate()
    except ScheduleError as e:
        raise ConfigError(f"JobSpec describes an invalid schedule: {e}") from None
    return schedule


def rank_profile_stages(schedule: Schedule, stage: int) -> set[int]:
    """Profile stages a rank may upload rows for: its own, and with chunks its virtual stages."""
    return {stage} | {schedule.virtual_stage(ins) for ins in schedule.stages[stage]}


def check_stage_profile(schedule: Schedule, stage: int, profile: Profile) -> None:
    """ConfigError unless `profile` only has rows of `stage` and covers every kind the stage runs."""
    allowed = rank_profile_stages(schedule, stage)
    foreign = sorted({s for s, _ in profile.points} - allowed)
    if foreign:
        raise ConfigError(
            f"profile of stage {stage} has rows for stages {foreign}; upload each stage's rows from its own rank"
        )
    for ins in schedule.stages[stage]:
        kind = ins.kind.value
        if (schedule.virtual_stage(ins), kind) not in profile.points and (stage, kind) not in profile.points:
            raise ConfigError(
                f"profile of stage {stage} lacks {kind} rows, which {ins} needs; profile every instruction kind the "
                "stage runs"
            )


def merge_profiles(stage_profiles: dict[int, Profile], blocking_power_w: float | None) -> Profile:
    """One Profile from per-stage uploads; the blocking power is `blocking_power_w` or the uploads' mean."""
    points = {key: list(pts) for profile in stage_profiles.values() for key, pts in profile.points.items()}
    if blocking_power_w is None:
        blocking_power_w = sum(p.blocking_power_w for p in stage_profiles.values()) / len(stage_profiles)
    return Profile(points, blocking_power_w, {})


def stage_rows(schedule: Schedule, stage: int, profile: Profile) -> Profile | None:
    """Stage `stage`'s rows of a whole-pipeline profile (a cached one), or None if it has none."""
    allowed = rank_profile_stages(schedule, stage)
    points = {key: pts for key, pts in profile.points.items() if key[0] in allowed}
    return Profile(points, profile.blocking_power_w, {}) if points else None


@dataclass(frozen=True)
class PlanResult:
    """What the service publishes and records: per-stage frequency lists and the predicted figures
    of one pipeline (`baseline_*`: every instruction at its highest profiled frequency)."""

    stage_frequencies: tuple[tuple[int, ...], ...]
    iteration_time_s: float
    energy_j: float
    lower_bound_j: float
    baseline_iteration_time_s: float
    baseline_energy_j: float


def make_planner(schedule: Schedule, profile: Profile) -> Any:
    """A `perseus.planner.Planner` for one pipeline; kept per job, it answers later deadlines
    (stragglers) without rebuilding the problem. PlanError if the profile does not fit."""
    # Imported here: the planner pulls in scipy and HiGHS, which would make the service (and
    # every test that starts it) slow to start; only the worker thread pays the import.
    from perseus.planner import Planner

    try:
        profile.validate(schedule)
        return Planner(schedule, profile)
    except (ConfigError, ScheduleError) as e:
        raise PlanError(str(e)) from None


def plan_pipeline(planner: Any, deadline_s: float | None = None) -> tuple[PlanResult, dict[str, Any]]:
    """Plan one pipeline: no slowdown (`deadline_s` None), else the least energy of an iteration
    that lasts `deadline_s`, a straggler's pace every GPU waits out (the padded objective: past
    the minimum-energy time the plan uses the slack). The baseline is padded to the same pace, so
    the predicted saving compares iterations of one length. The result and the planner's plan
    document (`Plan.to_json()`); PlanError with the planner's reason if it cannot. No stage holds
    a clock for less time than its GPU takes to change clocks (perseus.planner.switches, the
    latencies from the profile's meta): the figures are those of the plan the GPUs can follow."""
    from perseus.planner.switches import followable, profile_latency  # the planner's imports: see make_planner

    schedule = planner.schedule
    try:
        plan = planner.plan() if deadline_s is None else planner.plan(deadline=deadline_s, padded=True)
    except (ConfigError, ScheduleError) as e:
        raise PlanError(str(e)) from None
    latencies = [profile_latency(planner.profile, s) for s in range(schedule.num_stages)]
    free_energy_j = float(plan.energy_j)
    plan = followable(planner, plan, latencies)
    stage_frequencies = []
    for s, row in enumerate(schedule.stages):
        freqs = tuple(int(f) for f in plan.stage_frequencies(s))
        if len(freqs) != len(row):
            raise PlanError(
                f"planner returned {len(freqs)} frequencies for stage {s}, which runs {len(row)} instructions"
            )
        stage_frequencies.append(freqs)
    result = PlanResult(
        stage_frequencies=tuple(stage_frequencies),
        iteration_time_s=float(plan.iteration_time_s),
        energy_j=float(plan.energy_j),
        lower_bound_j=float(plan.lower_bound_j),
        baseline_iteration_time_s=float(planner.max_frequency_time_s),
        baseline_energy_j=float(planner.max_frequency_energy_j) + _wait_energy(planner, deadline_s),
    )
    document = plan.to_json()
    document["switches"] = _switches(planner, latencies, free_energy_j)
    return result, document


def _switches(planner: Any, latencies: list, free_energy_j: float) -> dict[str, float]:
    """What clock switches cost the plan: its energy were every switch instant, the longest switch
    latency and the median instruction's time at maximum clocks (a plan document's "switches")."""
    profile, schedule = planner.profile, planner.schedule
    clocks = {p.frequency for pts in profile.points.values() for p in pts}
    top: dict[tuple, float] = {}  # (stage, chunk, kind) -> its time at the highest clock: one lookup each
    times = []
    for row in schedule.stages:
        for ins in row:
            key = (ins.stage, ins.chunk, ins.kind)
            if key not in top:
                top[key] = profile.points_for(ins, schedule)[0].time
            times.append(top[key])
    return {
        "instant_switch_energy_j": free_energy_j,
        "latency_s": max((latency(f) for latency in latencies for f in clocks), default=0.0),
        "median_instruction_s": float(statistics.median(times)) if times else 0.0,
    }


def _wait_energy(planner: Any, deadline_s: float | None) -> float:
    """What every GPU of the pipeline at maximum clocks spends blocking until `deadline_s`."""
    if deadline_s is None:
        return 0.0
    wait_s = max(0.0, deadline_s - planner.max_frequency_time_s)
    return planner.problem.blocking_power_w * planner.problem.num_stages * wait_s


def plan_choices(schedule: Schedule, profile: Profile) -> int:
    """(instruction, frequency) pairs of a pipeline's planning problem: what its planning time and
    memory grow with, and what the service's planning budget counts."""
    counts = {key: len(points) for key, points in profile.points.items()}
    virtual = schedule.num_chunks > 1 and set(range(schedule.num_virtual_stages)) <= {
        s for s, _ in counts
    }  # as Profile.stage_for
    return sum(
        counts.get((schedule.virtual_stage(ins) if virtual else ins.stage, ins.kind.value), 0)
        for row in schedule.stages
        for ins in row
    )
