"""What a job's plans are made on and held to: each pipeline's model, calibrated on its measured
timeline, and each plan checked against measured time while it runs.

`PipelineModels` puts together the job's timelines and calibrations (perseus.service.timelines)
and its plan checks (perseus.service.verification). Plans are solved on the profile
`planning_profile` gives: the measured profile, plus each row's calibrated overhead, plus the
verification margin on every instruction slowed below its highest clock. The job asks it what
to do (`take_verdicts`) and acts: re-plan with a grown margin, or fall back to maximum clocks.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

from perseus.profiler.profile import Profile, ProfilePoint
from perseus.schedules import Schedule
from perseus.service.planning import PlanResult
from perseus.service.plans import PublishedPlan
from perseus.service.ranks import Models
from perseus.service.tally import Measured
from perseus.service.timelines import (
    COLLECTING,
    FAILED,
    FITTED,
    FITTING,
    STALE_TOLERANCE,
    UNCALIBRATED,
    Calibration,
    Calibrations,
    ModelState,
    SpanBook,
    Timeline,
    model_names,
    profile_mismatch,
)
from perseus.service.verification import FALLBACK, REPLANNING, PlanCheck, Verdict, grown_margin, noise_floor
from perseus.wire.calibration import CalibrationStatus, StageFitStatus
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo

log = logging.getLogger(__name__)

# How a profile of this run measured again ends its reason (and tells it was, in the history).
REMEASURED = (
    "the profile was measured under other conditions than the job's baseline (the host or GPUs slowed while it "
    "swept, or the workload changed since)"
)


class PipelineModels:
    """The models and plan checks of one job's pipelines (`dp` of them)."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.spans = SpanBook(spec)
        self.calibrations = Calibrations(spec)
        self.checks = [PlanCheck(spec.tolerance) for _ in range(spec.dp)]
        self.without_timeline: set[int] = set()  # ranks that send no spans (earlier releases)
        # Iteration -> the pipelines that measured it at baseline (every stage at default clocks).
        self.baseline_iterations: dict[int, set[int]] = {}
        self.verdicts: list[tuple[int, Verdict]] = []

    # ---- ranks and spans ----------------------------------------------------------------------

    def rank_added(self, info: RankInfo) -> None:
        if info.timeline:
            self.without_timeline.discard(info.rank)
        else:
            self.without_timeline.add(info.rank)

    @property
    def calibrates(self) -> bool:
        """Whether the ranks send spans to calibrate on (every rank registered says so)."""
        return not self.calibrations.overridden and not self.without_timeline

    def restart(self) -> None:
        """The ranks run again from iteration 0."""
        self.spans.restart()
        self.baseline_iterations.clear()

    def new_run(self) -> None:
        """A new run of the job's ranks (see Job.rerun): its baseline is measured anew, every model
        fitted again on it and every plan checked against it, never an earlier run's."""
        self.restart()
        self.spans.new_run()
        self.calibrations.new_run()
        self.checks = [PlanCheck(self.spec.tolerance) for _ in range(self.spec.dp)]
        self.verdicts = []

    def wants_spans(self, models: Models) -> bool:
        return self.calibrates and self.calibrations.wants_spans(models)

    def add_spans(self, info: RankInfo, spans: ReportSpans, instructions: int) -> bool:
        """Take one rank's spans; True if its pipeline gained a baseline iteration."""
        pipeline = self.spans.add(info, spans, instructions)
        if pipeline is None:
            return False
        if len(self.baseline_iterations) < 4096 or spans.iteration in self.baseline_iterations:
            self.baseline_iterations.setdefault(spans.iteration, set()).add(pipeline)
        return True

    def is_baseline(self, iteration: int) -> bool:
        """Whether every pipeline ran `iteration` at baseline: the job's baseline is no iteration
        where a rank still profiled at a lower clock (its sweep ends after the others')."""
        return len(self.baseline_iterations.get(iteration, ())) == self.spec.dp

    def timelines(self, pipelines: list[int]) -> list[Timeline]:
        return [tl for k in pipelines for tl in self.spans.timelines[k]]

    # ---- calibration --------------------------------------------------------------------------

    def ready(self, models: Models) -> bool:
        """Whether plans for these models may be solved."""
        if not self.calibrates and not self.calibrations.overridden:
            state = self.calibrations.get(models)
            if state.state not in (UNCALIBRATED, FAILED):
                state.state = UNCALIBRATED
                ranks = sorted(self.without_timeline)
                state.reason = (
                    f"rank(s) {', '.join(map(str, ranks[:8]))} send no instruction spans (an earlier Perseus?): the "
                    "model is the GPU profile alone, without the host work and transfers between instructions"
                )
                log.warning("job %s: %s", self.job_id, state.reason)
        return self.calibrations.ready(models)

    def due(self, models: Models, pipelines: list[int]) -> bool:
        """Whether these models have enough new baseline iterations to be fitted."""
        return self.calibrates and self.calibrations.due(models, self.added(pipelines))

    def start_fit(self, models: Models, pipelines: list[int]) -> list[Timeline]:
        """A fit of these models starts (they are `due`): the timelines it fits, the baseline
        iterations of `pipelines` or the reference window it fits again on."""
        window = self.calibrations.fitting(models, self.added(pipelines))
        timelines = list(window) or self.timelines(pipelines)
        self.calibrations.get(models).fitting_compute_s = statistics.median(tl.compute_s for tl in timelines)
        return timelines

    def refit(self, models: Models, pipeline: int, reference_s: float) -> bool:
        """Verification's reference window on `pipeline` ended at `reference_s`: whether the models
        are fitted again on it (see Calibrations.refit), said in the log."""
        if not self.calibrates:
            return False
        why = self.calibrations.refit(models, reference_s, list(self.spans.references[pipeline]))
        if why:
            log.info("job %s: pipeline %d: %s", self.job_id, pipeline, why)
        return bool(why)

    def added(self, pipelines: list[int]) -> int:
        """Baseline timelines these pipelines ever completed."""
        return sum(self.spans.added[k] for k in pipelines)

    def take_fit(self, models: Models, result: Calibration | BaseException, inherited: bool) -> str:
        """Take a fit from the worker (or what it raised). A fit on a profile an earlier run (or
        the signature cache) measured, `inherited`, is first checked against this run's spans:
        if the profile no longer fits the workload, the models collect again (to be fitted once
        profiled anew) and the reason is returned; "" otherwise. So is, once, a profile this run
        measured whose fit misses the baseline while its spans moved from the profile's times
        (see `_remeasure`)."""
        state = self.calibrations.get(models)
        if isinstance(result, Calibration):
            if inherited:
                mismatch = profile_mismatch(result, state.reference)
            else:
                mismatch = _remeasure(result, state)
            if mismatch:
                reason = f"{mismatch}; its profile and plans are dropped and the job is profiled again"
                log.warning("job %s: %s: %s", self.job_id, model_names(models), reason)
                self.calibrations.states[models] = ModelState(
                    COLLECTING, reason=reason, history=(state.history + [reason])[-8:]
                )
                return mismatch
            state.reference = tuple((fit.span_ratio, fit.span_spread) for fit in result.stages)
        self.calibrations.fitted(self.job_id, models, result)
        return ""

    def profiles_dropped(self, gpu_models: set[str]) -> None:
        """The profiles of these GPU models were dropped: every model set on them is fitted again
        once they are profiled anew, with no verification margin or fallback of the old profile."""
        for models, state in list(self.calibrations.states.items()):
            if gpu_models & set(models) and state.state in (FITTED, FITTING, FAILED):
                self.calibrations.states[models] = ModelState(COLLECTING, reason=state.reason, history=state.history)

    def planning_profile(self, models: Models, measured: Profile | None) -> Profile | None:
        """The profile plans for `models` are solved on; None until they may be."""
        if measured is None or not self.ready(models):
            return None
        state = self.calibrations.get(models)
        profile = measured
        reserve: dict[tuple[int, str], float] = {}
        if state.state == FITTED and state.calibration is not None:
            profile = with_overheads(profile, state.calibration.overheads)
            reserve = state.calibration.reserve
        return with_margin(profile, state.margin, reserve) if state.margin or reserve else profile

    # ---- verification -------------------------------------------------------------------------

    def targets(self, models: Models, pipeline: int) -> tuple[float | None, float | None]:
        """(baseline iteration, baseline compute time) measured for pipeline `pipeline` of `models`
        (kept with their model once a plan was checked against it: a restarted service has no spans)."""
        measured = self.spans.baseline_s([pipeline])
        if measured[0] is not None:
            return measured
        kept = self.calibrations.get(models).baselines.get(pipeline)
        return (None, None) if kept is None else kept[:2]

    def plans_published(
        self, plans: dict[int, PublishedPlan], changed: list[int], pipelines_of: Callable[[Models], list[int]]
    ) -> None:
        """Check the pipelines' new plans against their targets from their start."""
        for k in changed:
            plan = plans[k]
            state = self.calibrations.get(plan.models)
            measured_time, measured_compute = self.spans.baseline_s([k])
            if measured_time is not None and measured_compute is not None:  # kept for a restarted service
                state.baselines[k] = (measured_time, measured_compute, noise_floor(*self.spans.spread([k])))
            time_s, baseline = self.targets(plan.models, k)
            noise = state.baselines[k][2] if k in state.baselines else 0.0
            scale = 1.0 if plan.deadline_s is None else max(1.0, plan.deadline_s / plan.baseline_iteration_time_s)
            target = baseline * scale if time_s is not None and baseline is not None else None
            self.checks[k].plan_started(
                plan.version, plan.start_iteration, target, state.fallback, noise, scale, plan.reference
            )

    def clocks_kept(self, pipelines: list[int]) -> None:
        """These pipelines' new plans set the clocks they run already (see PlanBook.runs)."""
        for k in pipelines:
            self.checks[k].clocks_kept()

    def measured(self, completed: list[tuple[int, Measured]]) -> None:
        """Pipelines' measured iterations (compute time, slowest rank): verdicts for `take_verdicts`."""
        for k, m in completed:
            verdict = self.checks[k].add(m.iteration, m.time_s)
            if verdict is not None:
                self.verdicts.append((k, verdict))

    def take_verdicts(self) -> list[tuple[int, Verdict]]:
        verdicts, self.verdicts = self.verdicts, []
        return verdicts

    def correct(self, models: Models, verdict: Verdict) -> None:
        """Act on a verdict against a plan for `models`: a larger margin, or maximum clocks."""
        state = self.calibrations.get(models)
        if verdict.action == REPLANNING:
            state.margin = grown_margin(state.margin, verdict.margin_excess, self.spec.tolerance)
            state.history.append(f"re-plan with a {100 * state.margin:.0f}% margin: {verdict.reason}")
        elif verdict.action == FALLBACK and not state.fallback:
            state.fallback = True
            state.history.append(verdict.reason)
        del state.history[:-8]

    # ---- status -------------------------------------------------------------------------------

    def status(
        self, models: list[Models], pipelines_of: Callable[[Models], list[int]]
    ) -> tuple[CalibrationStatus, ...]:
        out = []
        for m in models:
            if m not in self.calibrations.states:
                continue
            state = self.calibrations.get(m)
            out.append(_calibration_status(m, state, self.targets(m, pipelines_of(m)[0])[0]))
        return tuple(out)


def _calibration_status(models: Models, state: ModelState, measured_s: float | None) -> CalibrationStatus:
    c = state.calibration
    reason = state.reason or ("; ".join(state.history[-2:]) if state.history else "")
    if c is None:
        return CalibrationStatus(
            model_names(models), state.state, measured_s=measured_s, margin=state.margin, reason=reason
        )
    return CalibrationStatus(
        models=model_names(models),
        state=state.state,
        iterations=c.iterations,
        measured_s=c.measured_s,
        model_s=c.model_s,
        gpu_only_s=c.gpu_only_s,
        explained=c.explained,
        host_gap_s=c.host_gap_s,
        hop_s=c.hop_s,
        margin=state.margin,
        reason=reason,
        stages=tuple(StageFitStatus(s.stage, s.measured_s, s.model_s, s.busy_s, s.host_gap_s) for s in c.stages),
        tolerance=c.tolerance,
    )


def with_overheads(profile: Profile, overheads: dict[tuple[int, str], float]) -> Profile:
    """`profile` with each row's calibrated overhead added to every clock's time; the GPU idles
    meanwhile, so energy grows by the blocking power over it."""
    power = profile.blocking_power_w
    points = {}
    for key, pts in profile.points.items():
        extra = overheads.get(key, 0.0)
        points[key] = [ProfilePoint(p.frequency, p.time + extra, p.energy + power * extra) for p in pts]
    return Profile(points, power, dict(profile.meta))


def with_margin(profile: Profile, margin: float, reserve: dict[tuple[int, str], float] | None = None) -> Profile:
    """`profile` with every point below a row's highest clock `margin` slower, plus the row's
    `reserve` (s; the GPU idling over the difference): the planner then slows an instruction
    only where the slack exceeds what slowing it takes by that much."""
    power = profile.blocking_power_w
    reserve = reserve or {}
    points = {}
    for key, pts in profile.points.items():
        extra = reserve.get(key, 0.0)
        points[key] = pts[:1] + [
            ProfilePoint(p.frequency, p.time * (1 + margin) + extra, p.energy + power * (p.time * margin + extra))
            for p in pts[1:]
        ]
    return Profile(points, power, dict(profile.meta))


def max_clock_result(schedule: Schedule, profile: Profile, solved: PlanResult) -> PlanResult:
    """The plan of maximum clocks (what a pipeline falls back to), with `solved`'s baseline figures."""
    frequencies = tuple(tuple(profile.points_for(ins, schedule)[0].frequency for ins in row) for row in schedule.stages)
    return PlanResult(
        stage_frequencies=frequencies,
        iteration_time_s=solved.baseline_iteration_time_s,
        energy_j=solved.baseline_energy_j,
        lower_bound_j=solved.lower_bound_j,
        baseline_iteration_time_s=solved.baseline_iteration_time_s,
        baseline_energy_j=solved.baseline_energy_j,
    )


def _remeasure(result: Calibration, state: ModelState) -> str:
    """Why this run's own profile should be measured again ("" if not): the model fitted on it
    misses the baseline (a model that could be planned on), and some stage's spans at the top
    clock moved more than STALE_TOLERANCE from the profile's times there. Spans and profile are
    the same work on the same GPUs, so the sweep ran under other conditions (host load, a
    throttled GPU while it swept) and a fit cannot mend it. Once per model set: a second such
    profile fails the fit as any miss does."""
    again = any(REMEASURED in h for h in state.history)
    if not result.plannable or not result.reason() or state.refitting or again:
        return ""
    return profile_mismatch(result, (), STALE_TOLERANCE, REMEASURED)
