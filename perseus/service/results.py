"""The loop's side of the worker threads: it takes built schedules, calibrations and solved plans,
publishes plans, hands each job's models to calibrate and missing plans to the workers, and acts
on what verifying the plans in force finds. Each job's part runs under `Keeper.guard`, so a
fault stays with its job."""

from __future__ import annotations

import logging

from perseus.exceptions import PerseusError
from perseus.schedules import Schedule
from perseus.service.budget import Budget
from perseus.service.job import Job
from perseus.service.keeper import Keeper
from perseus.service.planning import PlanResult, plan_choices
from perseus.service.plans import PlanKey, document_name
from perseus.service.ranks import Models
from perseus.service.text import clip
from perseus.service.verification import HOLDS, REFERENCE, RESUME
from perseus.service.workers import Solved, Workers

log = logging.getLogger(__name__)


class Results:
    """Moves the work of `jobs` (the service's, by id) between the loop and `workers`."""

    def __init__(self, budget: Budget, workers: Workers, keeper: Keeper, jobs: dict[str, Job]) -> None:
        self.budget = budget
        self.workers = workers
        self.keeper = keeper
        self.jobs = jobs
        self._cache_saved: set[tuple[str, str]] = set()  # (job, GPU model) whose profile went to the signature cache
        self.plans_solved = 0  # for the metrics: plans solved, and the seconds their solving took
        self.planning_s = 0.0

    def plan(self, job: Job) -> None:
        """Publish what is solved, start solving what is missing, save the job."""
        self.keeper.guard(job, "publishing its plans", self._publish, job)
        self.keeper.guard(job, "starting its planning", self._start_planning, job)
        self.keeper.guard(job, "saving its state", self.keeper.save, job)

    def take_builds(self) -> None:
        """Take the schedules built since the last call (and plan their jobs)."""
        for spec, result, seconds in self.workers.built():
            job = self.jobs.get(spec.job_id())
            if job is None or job.spec != spec:
                continue  # evicted meanwhile
            self.keeper.guard(job, "building its schedule", self._take_schedule, job, result, seconds)

    def take_calibrations(self) -> None:
        """Take the models calibrated since the last call (and plan their jobs)."""
        for job_id, models, result, seconds, run in self.workers.calibrated():
            job = self.jobs.get(job_id)
            if job is None or job.run != run:
                continue  # evicted meanwhile, or fitted on an earlier run of the job
            log.debug("job %s: calibration fitted in %.2f s", job_id, seconds)
            self.keeper.guard(job, "taking its calibration", self._take_calibration, job, models, result)
            self.plan(job)

    def _take_calibration(self, job: Job, models: Models, result: object) -> None:
        if job.model.calibrations.get(models).refitting:
            self.workers.forget(job.job_id)  # its planners hold the profile of the model fitted before
        dropped = job.set_calibration(models, result)
        if dropped:
            # The profiles no longer fit the workload: neither the planners holding them nor the
            # signature cache (a later job of the signature would plan on them) keep them.
            self.workers.forget(job.job_id)
            for model in sorted(dropped):
                self._cache_saved.discard((job.job_id, model))
                self.keeper.state.remove_cached_profile(job.spec.profile_key(model))

    def verify(self, job: Job) -> None:
        """Act on what checking the job's plans against measured time found."""
        self.keeper.guard(job, "verifying its plans", self._verify, job)

    def _verify(self, job: Job) -> None:
        for k, verdict in job.model.take_verdicts():
            plan = job.plans.get(k)
            version = plan.version if plan else 0
            if verdict.action == HOLDS:
                log.info(
                    "job %s: pipeline %d plan v%d holds: %.4f s against its target %.4f s (%+.2f%%)",
                    job.job_id,
                    k,
                    version,
                    verdict.measured_s,
                    verdict.target_s,
                    100 * verdict.excess,
                )
                continue
            if verdict.action in (REFERENCE, RESUME):
                log.info("job %s: pipeline %d: %s", job.job_id, k, verdict.reason)
            else:
                log.warning("job %s: pipeline %d: %s", job.job_id, k, verdict.reason)
            if job.correct(k, verdict):
                self.workers.forget(job.job_id)  # its planners hold the old profile
            self.plan(job)

    def take_plans(self) -> None:
        """Take the plans solved since the last call (and publish them)."""
        for job_id, done, run in self.workers.solved():
            job = self.jobs.get(job_id)
            if job is None:
                continue  # evicted meanwhile
            if job.run != run:
                self.plan(job)  # solved for an earlier run of the job: solve this run's instead
                continue
            self.keeper.guard(job, "taking its solved plans", self._take_plans, job, done)
            self.plan(job)

    def _take_schedule(self, job: Job, result: Schedule | BaseException, seconds: float) -> None:
        if isinstance(result, PerseusError):
            job.fail(f"invalid job: {result}")
            log.error("job %s: %s; its ranks stay at maximum clocks", job.job_id, job.error)
        elif isinstance(result, BaseException):
            job.fail(f"invalid job: internal error ({type(result).__name__}: {result})")
            log.error("job %s: %s; its ranks stay at maximum clocks", job.job_id, job.error, exc_info=result)
        else:
            job.set_schedule(result)
            log.info(
                "job %s: schedule built in %.2f s (%d instructions)",
                job.job_id,
                seconds,
                sum(len(r) for r in result.stages),
            )
        self.plan(job)

    def _start_planning(self, job: Job) -> None:
        if job.error or job.schedule is None:
            return  # (no plan is missing while the schedule is being built: no profile is complete)
        for models, profile, timelines in job.calibration_tasks():
            log.info(
                "job %s: calibrating the model of %s on %d baseline iterations",
                job.job_id,
                _describe_key((models, None)).split(",")[0],
                len(timelines),
            )
            self.workers.calibrate(job.job_id, models, job.schedule, profile, timelines, job.run)
        if job.job_id in self.workers.planning:
            return
        tasks = []
        for key, profile in job.missing_plans():
            choices = plan_choices(job.schedule, profile)
            if choices > self.budget.max_plan_choices:
                job.add_result(
                    key,
                    f"the profile gives {choices} (instruction, frequency) choices, over the service's planning budget "
                    f"of {self.budget.max_plan_choices}; profile fewer frequencies (JobSpec.sweep_frequencies) or ask "
                    "the operator to raise --max-plan-choices",
                )
                log.error(
                    "job %s: %s (%s)",
                    job.job_id,
                    job.error or "a deadline is over the planning budget",
                    _describe_key(key),
                )
            else:
                tasks.append((key, profile))
        if tasks:
            log.info("job %s: planning %s", job.job_id, ", ".join(_describe_key(key) for key, _ in tasks))
            self.workers.solve(job.job_id, job.schedule, tasks, job.run)

    def _publish(self, job: Job) -> None:
        changed = job.publish()
        for k in changed if len(changed) <= 8 else changed[:1]:
            plan = job.plans[k]
            if plan.reference:
                log.info(
                    "job %s: pipeline %d plan v%d from iteration %d: maximum clocks for one window, verification's "
                    "reference (not a plan of Perseus: no saving); the plan resumes after it",
                    job.job_id,
                    k,
                    plan.version,
                    plan.start_iteration,
                )
                continue
            saving = 1.0 - plan.energy_j / plan.baseline_energy_j
            log.info(
                "job %s: pipeline %d plan v%d from iteration %d (%s): iteration %.4f s (max clocks %.4f s), "
                "energy %.1f J (max clocks %.1f J, saving %.1f%%, lower bound %.1f J)",
                job.job_id,
                k,
                plan.version,
                plan.start_iteration,
                _describe_key(plan.key),
                plan.iteration_time_s,
                plan.baseline_iteration_time_s,
                plan.energy_j,
                plan.baseline_energy_j,
                100 * saving,
                plan.lower_bound_j,
            )
        if len(changed) > 8:
            log.info(
                "job %s: plan v%d published for %d pipelines", job.job_id, job.plan_book.last_version, len(changed)
            )

    def _take_plans(self, job: Job, done: list[Solved]) -> None:
        job_id = job.job_id
        for key, result, seconds in done:
            if isinstance(result, BaseException):
                if isinstance(result, PerseusError):
                    message = f"planning failed: {result}"
                else:
                    log.error("job %s: planner crashed", job_id, exc_info=result)
                    message = f"planning failed with an internal error ({type(result).__name__}: {result})"
                job.add_result(key, message)
                log.error(
                    "job %s: %s (%s); %s",
                    job_id,
                    clip(message),
                    _describe_key(key),
                    "its ranks stay at maximum clocks"
                    if key[1] is None
                    else "those pipelines keep their no-slowdown plans",
                )
                continue
            plan, document = result
            self.plans_solved += 1
            self.planning_s += seconds
            job.add_result(key, plan)
            kept = job.kept(key, plan)
            job.model.clocks_kept(kept)
            log.info(
                "job %s: solved %s in %.2f s: %.4f s, %.1f J per pipeline%s",
                job_id,
                _describe_key(key),
                seconds,
                plan.iteration_time_s,
                plan.energy_j,
                f"; the clocks pipeline {', '.join(map(str, kept))} already runs: no new plan version" if kept else "",
            )
            _warn_switches(job_id, key, plan, document.get("switches"))
            # The plan is in force once published; its full document is a record for the operator,
            # so a write error here degrades the job (see _guard) and loses nothing the ranks need.
            self.keeper.state.save_plan_document(job_id, document, document_name(job.spec, key))
        for model in list(job.profiles):
            profile = job.model_profile(model)
            if profile is not None and model not in job.cached and (job_id, model) not in self._cache_saved:
                self.keeper.state.save_cached_profile(job.spec.profile_key(model), job.spec.signature(model), profile)
                self._cache_saved.add((job_id, model))


SWITCH_LOSS = 0.01  # warn where clock switches take this much of the baseline's energy from a plan's saving


def _warn_switches(job_id: str, key: PlanKey, plan: PlanResult, switches: dict | None) -> None:
    """Say so where the GPUs' clock switches eat a plan's saving: its instructions are too short
    for the clocks it would give them, which a user can change (more work per microbatch)."""
    if not switches or plan.baseline_energy_j <= 0:
        return
    saving = 1.0 - plan.energy_j / plan.baseline_energy_j
    instant = 1.0 - switches["instant_switch_energy_j"] / plan.baseline_energy_j
    if instant - saving < SWITCH_LOSS or saving > instant / 2:
        return
    log.warning(
        "job %s: %s: the GPUs can follow a plan saving %.1f%% where instant clock switches would save %.1f%%: "
        "a switch takes up to %.0f ms and the median instruction %.1f ms, so most lowered clocks would not come "
        "into force; more work per microbatch (fewer, larger microbatches) leaves Perseus more to save",
        job_id,
        _describe_key(key),
        100 * saving,
        100 * instant,
        1000 * switches["latency_s"],
        1000 * switches["median_instruction_s"],
    )


def _describe_key(key: PlanKey) -> str:
    models, deadline = key
    names = sorted(set(models))
    where = names[0] if len(names) == 1 else "/".join(models)
    return f"{where}, " + ("no slowdown" if deadline is None else f"deadline {deadline:.4f} s")
