"""What a job tells about itself: its status (phase, predicted against measured figures, each
pipeline's plan and straggler) and the log line of a planned iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perseus.service.plans import PlanKey, PublishedPlan, Straggling
from perseus.service.tally import Measured
from perseus.service.verification import FALLBACK
from perseus.wire.messages import JobStatus, PipelineStatus

if TYPE_CHECKING:  # annotations only: job.py imports this module
    from perseus.service.job import Job

#: What the reason of a pipeline whose new plan is being solved says (`perseus straggler` waits for it).
SOLVING = "being solved"


def describe(job: Job, measured: Measured) -> str:
    """One planned iteration measured against the prediction of the plans it ran (a reference
    window's: maximum clocks). The time is step to step, the prediction the schedule's
    instructions alone: the script's own work between steps (an all-reduce, the optimizer) is the
    difference, which verification leaves out (it judges compute time), so the line says so."""
    time_p, energy_p, _ = job.plan_book.predicted(running=True)
    straggler = job.straggler()
    pace = job.plan_book.pace(straggler) if straggler is not None else None
    time_p = max(time_p, pace or 0.0)  # the job runs at its straggler's pace, whatever the plans'
    versions = sorted({p.version for p in job.plans.values()})
    references = sorted(k for k, p in job.plans.items() if p.reference)
    window = f", pipeline {','.join(map(str, references))} at maximum clocks for reference" if references else ""
    off_clock = job.measurements.off_clock_instructions
    return (
        f"job {job.job_id} iteration {measured.iteration} (plan v{','.join(map(str, versions))}{window}): "
        f"time {measured.time_s:.4f} s step to step (predicted {time_p:.4f} s for the instructions alone, "
        f"{100 * (measured.time_s / time_p - 1):+.1f}%), "
        f"energy {measured.energy_j:.1f} J (predicted {energy_p:.1f} J, "
        f"{100 * (measured.energy_j / energy_p - 1):+.1f}%)"
        + (
            ""
            if off_clock is None
            else f"; {off_clock:.1f} instructions per planned iteration off their planned clock (mean so far)"
        )
        + (
            ""
            if straggler is None
            else f"; pipeline {straggler[0]} straggles {straggler[1]:.3f}x, its energy predicted as profiled (its "
            "extra work or slower GPUs are not in the profile)"
        )
    )


def job_status(job: Job) -> JobStatus:
    time_p = energy_p = baseline_p = None
    if job.plans:
        time_p, energy_p, baseline_p = job.plan_book.predicted()
    measurements = job.measurements
    straggler = measurements.straggler()
    wanted = job.wanted()
    pipelines = []
    for k in range(job.spec.dp):
        plan = job.plans.get(k)
        slow = straggler if straggler is not None and straggler[0] == k else None
        check = job.model.checks[k]
        state, ended = check.shown(len(job.closed_ranks) >= job.spec.world_size)
        reasons = (
            check.reason,
            ended,
            check.pending(),
            measurements.declared_off.get(k, (0.0, ""))[1],
            _replan(job, k, wanted),
        )
        pipelines.append(
            PipelineStatus(
                pipeline=k,
                plan_version=plan.version if plan else 0,
                plan_since=plan.since if plan else 0,
                deadline_s=plan.deadline_s if plan else None,
                predicted_iteration_time_s=_predicted_time(job, plan, slow),
                measured_iteration_time_s=measurements.measured_time_s(k),
                straggler=slow[2] if slow is not None else "",
                straggler_factor=slow[1] if slow is not None else None,
                baseline_iteration_time_s=job.model.targets(job.models(k), k)[1],
                target_iteration_time_s=check.target_s,
                verification=state,
                verified_iteration_time_s=check.measured_s,
                replans=check.replans,
                reason="; ".join(r for r in reasons if r),
            )
        )
    return JobStatus(
        job_id=job.job_id,
        phase=job.phase.value,
        world_size=job.spec.world_size,
        ranks_registered=len(job.ranks),
        ranks_closed=len(job.closed_ranks),
        profiled_stages=job.profiled_stages,
        plan_version=max((p.version for p in job.plans.values()), default=0),
        # Before any report since the service restarted: the latest it had saved.
        last_iteration=job.last_iteration if job.last_iteration >= 0 else measurements.saved_iteration,
        error=job.error,
        warning=job.warning,
        predicted_iteration_time_s=time_p,
        predicted_energy_j=energy_p,
        predicted_baseline_energy_j=baseline_p,
        baseline_iterations=measurements.baseline.count,
        baseline_iteration_time_s=measurements.baseline.time_s,
        baseline_energy_j=measurements.baseline.energy_j,
        planned_iterations=measurements.planned.count,
        planned_iteration_time_s=measurements.planned.time_s,
        planned_energy_j=measurements.planned.energy_j,
        pipelines=tuple(pipelines),
        calibrations=job.model.status(list(dict.fromkeys(job.models(k) for k in range(job.spec.dp))), job.pipelines_of),
        tolerance=job.spec.tolerance,
        off_clock_instructions=measurements.off_clock_instructions,
        saving_withheld=saving_withheld(job),
        profile_dropped=job.profile_dropped,
    )


def _predicted_time(job: Job, plan: PublishedPlan | None, straggling: Straggling | None) -> float | None:
    """A pipeline's predicted iteration time: its plan's (in a reference window, the plan it
    checks); a straggler's, its pace (its plan would run faster on a GPU as fast as the profiled one)."""
    if plan is None:
        return None
    pace = job.plan_book.pace(straggling) if straggling is not None else None
    return max(job.plan_book.checked(plan).iteration_time_s, pace or 0.0)


def _replan(job: Job, pipeline: int, wanted: dict[int, PlanKey]) -> str:
    """The new plan the pipeline awaits (a straggler's pace changed, or there is none now), or why
    it runs its no-slowdown plan where it should run at a straggler's pace."""
    plan, key = job.plans.get(pipeline), wanted.get(pipeline)
    if plan is None or key is None or plan.key == key:
        return ""
    solved = job.results.get(key)
    if solved is None:
        return f"its plan for {_deadline(key)} is {SOLVING}; plan v{plan.version} runs meanwhile"
    if isinstance(solved, str):
        return f"no plan for {_deadline(key)} ({solved}): it runs its no-slowdown plan"
    return ""  # solved, with the clocks it runs (PlanBook.runs)


def _deadline(key: PlanKey) -> str:
    return "no slowdown" if key[1] is None else f"a deadline of {key[1]:.4f} s (a straggler's pace)"


STRAGGLER_CHANGE = 0.05  # a job paced this much faster or slower than in its baseline ran another workload
# The baseline and the planned iterations a saving is claimed on each span at least this long: a
# GPU's energy counter steps every 100 ms or so (NVML's), and a run of iterations reads to within a
# step at each end (perseus.runtime.rank), so a shorter run reads mostly its steps (an outsider's
# job claimed 20.1% after three 0.25 s iterations, 8.6% over 20). 20 steps, as
# perseus.measurement.monitor warns.
CLAIM_MIN_S = 2.0


def saving_withheld(job: Job) -> str:
    """Why no saving is claimed ("" where one is): every pipeline's plan fell back to maximum
    clocks, so whatever they measure against the baseline is noise or the baseline's own drift;
    no planned or no baseline iteration measured yet, or too few to read an energy counter that
    steps every 100 ms or so; or the job's straggler changed since the baseline, whose energy per
    iteration was then that of another pace (idle GPUs waiting for a slower pipeline, or none)."""
    return _fallen_back(job) or _unmeasured(job) or _too_short(job) or _straggler_changed(job)


def _unmeasured(job: Job) -> str:
    measurements = job.measurements
    if measurements.planned.count == 0:
        if measurements.baseline.count == 0:
            return "no planned iteration measured yet, nor a baseline one"
        # The baseline shown meanwhile (during profiling: the warm-up's) may read a counter step off.
        short = _too_short(job)
        return "no planned iteration measured yet" + (f"; {short}" if short else "")
    if measurements.baseline.count == 0:
        return "no baseline iteration measured (every rank at default clocks, past the first iteration)"
    return ""


def _too_short(job: Job) -> str:
    for name, mean in (("baseline", job.measurements.baseline), ("planned", job.measurements.planned)):
        if mean.time_s is not None and mean.count * mean.time_s < CLAIM_MIN_S:
            return (
                f"the {name} iterations measured so far ({mean.count}) span {mean.count * mean.time_s:.2f} s; a "
                f"saving is claimed once both the baseline and the planned ones span {CLAIM_MIN_S:g} s (an energy "
                "counter steps every 100 ms or so, and a shorter run reads mostly its steps)"
            )
    return ""


def _straggler_changed(job: Job) -> str:
    lag = job.measurements.baseline_lag()
    if lag is None or not job.plans:
        return ""
    straggler = job.straggler()
    factor = 1.0 if straggler is None else straggler[1]
    if abs(factor / lag[1] - 1) <= STRAGGLER_CHANGE:
        return ""
    then = "no straggler" if lag[1] <= 1 + STRAGGLER_CHANGE else f"pipeline {lag[0]} at {lag[1]:.3f}x the others' time"
    pace = (
        "a job runs at its slowest pipeline's pace, so its energy per iteration changes with its straggler, not with "
        "the plans alone (predicted_saving is the plans' own figure)"
    )
    measurements = job.measurements
    if straggler is None and not measurements.stragglers_measured():
        return (
            f"the baseline iterations ran with {then}, and whether the planned ones still do is not measured yet "
            f"(stragglers are decided on {measurements.detector.min_samples} iterations of every pipeline under its "
            f"plan): {pace}"
        )
    now = "no straggler" if straggler is None else f"pipeline {straggler[0]} straggling {factor:.3f}x ({straggler[2]})"
    return f"the baseline iterations ran with {then}, the planned ones with {now}: {pace}"


def _fallen_back(job: Job) -> str:
    planned = sorted(job.plans)
    checks = [job.model.checks[k] for k in planned]
    if not planned or any(check.state != FALLBACK for check in checks):
        return ""
    reasons = [
        check.reason or _last(job.model.calibrations.get(job.plans[k].models).history)
        for k, check in zip(planned, checks)
    ]
    why = next((r for r in reasons if r), "verification gave up on the plan")
    which = "the pipeline" if job.spec.dp == 1 else f"every pipeline ({len(planned)})"
    return (
        f"{which} fell back to maximum clocks ({why}): the planned iterations run no plan of Perseus, so what "
        "they measure against the baseline is no saving of it"
    )


def _last(history: list[str]) -> str:
    return history[-1] if history else ""
