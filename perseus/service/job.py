"""One job's state machine: its ranks, profiles, plans and measurements, and the phase they make.

No sockets and no threads: the service calls these methods from its loop thread only.

A job runs `dp` data-parallel pipelines of `pp` stages, each stage split over `tp`
tensor-parallel ranks. Each concern is a part of its own: the ranks (`Roster`, ranks.py), the
profiles (`Profiling`, profiles.py), the plans (`PlanBook`, plans.py) and the measurements and
stragglers (`Measurements`, measurements.py); what the job tells is in status.py, and its record
on disk in persistence.py. `Job` holds the parts and makes the changes that touch more than one
(a rank registering, a plan published), and every change that can move the job's phase.
"""

from __future__ import annotations

from typing import Any

from perseus.planner.dag import ending_stages
from perseus.profiler.profile import Profile
from perseus.schedules import Schedule
from perseus.service import persistence, status
from perseus.service.iterations import RankIterations
from perseus.service.measurements import Measurements, PlansInForce
from perseus.service.model import PipelineModels, max_clock_result
from perseus.service.overdue import Overdue, SweepWatch
from perseus.service.planning import PlanResult, job_schedule
from perseus.service.plans import PlanBook, PlanKey, PublishedPlan, Straggling, plan_lead
from perseus.service.profiles import Profiling
from perseus.service.ranks import Models, Roster, bad_field
from perseus.service.tally import Measured
from perseus.service.text import clip
from perseus.service.verification import REFERENCE, RESUME, Verdict
from perseus.wire.messages import JobStatus, ReportIteration, Table
from perseus.wire.phases import JobPhase
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo


class Job:
    """`build_schedule`: build (and validate) the schedule now; the service passes False and
    builds it on a worker (large schedules take seconds), then calls `set_schedule` or `fail`.
    Until then the job profiles (ranks warm up and sweep) and holds no plan."""

    def __init__(self, spec: JobSpec, *, cached_profile: Profile | None = None, build_schedule: bool = True) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.schedule: Schedule | None = job_schedule(spec) if build_schedule else None
        self.spec_record = spec.to_wire()  # job.json's "spec", encoded once
        self.roster = Roster(spec)
        self.profiling = Profiling(spec, cached_profile)
        self.sweeps = SweepWatch(spec.warmup_iterations)  # stage profiles overdue: asked again, then failed
        self.plan_book = PlanBook(spec.dp, self.roster.models)
        self.measurements = Measurements(spec)
        if self.schedule is not None:
            self.measurements.ending_stages = ending_stages(self.schedule)
        self.model = PipelineModels(spec)  # calibration on measured timelines, verification of plans
        self.error = ""
        self.error_retryable = False  # the error came from what a run measured: a new run tries again
        self.run = 0  # runs of the job's ranks this service saw start (see `rerun`)
        self.closed_ranks: set[int] = set()  # ranks whose close() reported (this run)
        self.profile_dropped = ""  # why its profile was last dropped and measured again ("": never)
        self.warning = ""  # the job runs, but something is degraded (its state could not be saved)
        self.iterations = RankIterations()  # how far each rank got in this run
        self._phase: JobPhase | None = None  # cached: tables are asked for many times a second

    @property
    def ranks(self) -> dict[int, RankInfo]:
        return self.roster.ranks

    @property
    def cached(self) -> dict[str, Profile]:
        """GPU model -> its whole-pipeline profile from the signature cache."""
        return self.profiling.cached

    @property
    def profiles(self) -> dict[str, dict[int, Profile]]:
        """GPU model -> stage -> its profile, merged over tensor parallelism."""
        return self.profiling.merged

    @property
    def plans(self) -> dict[int, PublishedPlan]:
        """Pipeline -> the plan its ranks run."""
        return self.plan_book.plans

    @property
    def results(self) -> dict[PlanKey, PlanResult | str]:
        """Solved plans; str: why the planner could not."""
        return self.plan_book.results

    def _changed(self) -> None:
        self._phase = None

    def set_schedule(self, schedule: Schedule) -> None:
        """The schedule a worker built from the spec (see `build_schedule`)."""
        self.schedule = schedule
        self.measurements.ending_stages = ending_stages(schedule)
        self._changed()

    def fail(self, message: str, *, retryable: bool = False) -> None:
        """The job gets no plan, and its ranks run at maximum clocks; `retryable`: the failure came
        from what its ranks measured (calibration, planning on the profile), so that a new run of
        them tries again (see `rerun`). A failure of the spec itself (its schedule) is final."""
        self.error = clip(message)
        self.error_retryable = retryable
        self._changed()

    def degrade(self, message: str) -> None:
        """Something went wrong that leaves the job running (its state not saved); "" when mended."""
        self.warning = clip(message)

    # ---- ranks --------------------------------------------------------------------------------

    def add_rank(self, info: RankInfo) -> None:
        self.roster.check(info)
        self.profiling.check_sweep(info)
        self.model.rank_added(info)
        self.closed_ranks.discard(info.rank)
        if self.roster.add(info):
            self._changed()

    def rank(self, rank: int) -> RankInfo:
        return self.roster.get(rank)

    def close_rank(self, rank: int) -> None:
        """The rank's close() reported its last iteration (kept out of every mean: it runs on
        through the script's own work); it registers again if it runs again."""
        self.rank(rank)  # a rank of the job
        self.closed_ranks.add(rank)

    def models(self, pipeline: int) -> Models:
        return self.roster.models(pipeline)

    @property
    def last_iteration(self) -> int:
        """The latest iteration a rank reached in this run (-1: none yet), one rank's wild number aside."""
        return self.iterations.latest

    def note_iteration(self, rank: int, iteration: int) -> None:
        """`rank` reached `iteration`; ServiceError (bad_field) if that is far past the median rank's.
        Noted either way, so that ranks which all moved far on at once (past reports of old
        iterations) move the median with them rather than being refused for good."""
        self.iterations.note(rank, iteration)
        if self.iterations.ahead(iteration):
            raise bad_field(
                f"rank {rank} reports iteration {iteration}, but the median rank of job {self.job_id} is at "
                f"{self.iterations.median}: ranks move in lockstep, so count iterations as the ranks run them, "
                "one per training step from 0 in each run (not a global step, a sample count or a time)"
            )

    def rerun(self) -> None:
        """The job registered again: a new run of its ranks, from iteration 0.

        A job calibrated on its ranks' timelines measures the new run's baseline before any plan
        applies: its plans, calibrations and verification were made on an earlier run, whose
        workload the same spec may no longer describe (a heavier model, a fixed script), so the
        model is fitted again on this run's baseline, its profile checked against it (see
        `set_calibration`), and every plan held to it. A job that failed on what a run measured
        gets a fresh chance. A job whose ranks send no spans has nothing to measure its baseline
        with: it applies its plans at once."""
        self.run += 1
        self.closed_ranks.clear()
        self.iterations.reset()
        if self.error and self.error_retryable:
            self.error, self.error_retryable = "", False
        self.plan_book.drop_failures()
        self.sweeps.new_run()
        if self.model.calibrates:
            self.plan_book.withdraw()
            self.profiling.inherit()
            self.model.new_run()
        else:
            self.plan_book.restart()
            self.model.restart()
        self.measurements.restart(self.plans)
        self._changed()

    # ---- what a rank runs --------------------------------------------------------------------------

    def profiled_stages_of(self, model: str) -> tuple[int, ...]:
        return self.profiling.stages_of(model)

    @property
    def profiled_stages(self) -> tuple[int, ...]:
        return self.profiling.stages_of(self.spec.gpu_model)

    def table(self, rank: int, iteration: int, known_version: int) -> Table:
        info = self.rank(rank)
        if iteration >= 0:
            self.iterations.note(rank, iteration)
        plan = self.plans.get(info.dp_index)
        if plan is not None and plan.models and plan.models[info.stage] != info.gpu_model:
            plan = (
                None  # planned for another GPU (the rank came back on a new one): max clocks until its plan is solved
            )
        frequencies = plan.stage_frequencies[info.stage] if plan is not None and plan.version != known_version else None
        # Baseline spans until the pipeline runs a plan (its model calibrates, its plans are checked
        # on them), and a reference window's (the model is fitted again if the host's speed changed).
        current = self.plans.get(info.dp_index)
        spans = (
            not self.error
            and (current is None or current.reference)
            and self.model.wants_spans(self.models(info.dp_index))
        )
        profiled = self.profiling.stages_of(info.gpu_model)
        return Table(
            phase=self.phase.value,
            warmup_iterations=self.spec.warmup_iterations,
            iterations_per_frequency=self.spec.iterations_per_frequency,
            sweep_frequencies=self.profiling.sweep or (),
            profiled_stages=profiled,
            plan_version=plan.version if plan else 0,
            plan_start_iteration=plan.start_iteration if plan else 0,
            frequencies=frequencies,
            error=self.error,
            upload=self.roster.uploads_profile(info),
            spans=spans,
            reference=plan is not None and plan.reference,
            sweep_steps=() if info.stage in profiled or self.error else self.profiling.steps(),
            sweep_round=self.sweeps.round(info.gpu_model, info.stage),
        )

    def watch_sweep(self, rank: int, iteration: int) -> Overdue | None:
        """`rank` reached `iteration`: if it uploads a stage profile that is overdue, the stage is
        asked for a fresh sweep (said in `profile_dropped`) or, after the last, the job fails
        (retryable); the Overdue, for the service's log. None while nothing is overdue."""
        info = self.rank(rank)
        steps = len(self.profiling.steps())
        if (
            self.error
            or self.schedule is None  # no profile can be taken yet: the rank's upload waits for it
            or not steps
            or info.stage in self.profiling.stages_of(info.gpu_model)
            or not self.roster.uploads_profile(info)
        ):
            return None
        overdue = self.sweeps.note(info.gpu_model, info.stage, iteration, steps)
        if overdue is None:
            return None
        if overdue.failed:
            self.fail(f"no plan: {overdue.reason()}", retryable=True)
        else:
            self.profile_dropped = clip(overdue.reason())
            self._changed()
        return overdue

    @property
    def phase(self) -> JobPhase:
        if self._phase is None:
            self._phase = self._current_phase()
        return self._phase

    def _current_phase(self) -> JobPhase:
        if self.error:
            return JobPhase.FAILED
        pipelines = range(self.spec.dp)
        if all(k in self.plans and self.plans[k].models == self.models(k) for k in pipelines):
            return JobPhase.PLANNED
        if all(self.pipeline_profile(models) is not None for models in {self.models(k) for k in pipelines}):
            return JobPhase.PLANNING
        return JobPhase.PROFILING

    # ---- profiles ----------------------------------------------------------------------------------

    def add_profile(self, rank: int, stage: int, profile: Profile) -> str | None:
        """Accept a tensor-parallel rank's profile of its stage; the state-file name to save it
        under, or None if that rank's share of (GPU model, stage) is already in (the first one is
        kept). Once every tensor-parallel rank of the stage is in, the stage is profiled."""
        assert self.schedule is not None, "the service takes no profile while the schedule is being built"
        name = self.profiling.add(self.schedule, self.rank(rank), stage, profile)
        if name is not None:
            self._changed()
        return name

    def drop_upload(self, rank: int, name: str) -> None:
        """Forget the upload `add_profile` took under `name` (its state file could not be written:
        the rank is told to retry, so nothing unsaved is acknowledged)."""
        self.profiling.drop(self.rank(rank), name)
        self._changed()

    def add_cached(self, model: str, profile: Profile) -> None:
        """A whole-pipeline profile of `model` from the signature cache: no profiling on it."""
        self.profiling.cached[model] = profile
        self.profiling.inherited.add(model)
        self._changed()

    def model_profile(self, model: str) -> Profile | None:
        """Every stage's profile on `model` merged (what the signature cache keeps), if complete."""
        return self.profiling.model_profile(model)

    def pipeline_profile(self, models: Models) -> Profile | None:
        """The profile a pipeline with these stage models is planned with; None until complete
        (or while the schedule is being built)."""
        if self.schedule is None:
            return None
        return self.profiling.pipeline_profile(self.schedule, models)

    def planning_profile(self, models: Models) -> Profile | None:
        """The profile plans for these stage models are solved on (calibrated, with any
        verification margin); None until it may be (see perseus.service.model)."""
        return self.model.planning_profile(models, self.pipeline_profile(models))

    def pipelines_of(self, models: Models) -> list[int]:
        """The pipelines whose stages run on these GPU models."""
        return [k for k in range(self.spec.dp) if self.models(k) == models]

    # ---- calibration and verification ------------------------------------------------------------

    def add_spans(self, spans: ReportSpans) -> bool:
        """One rank's instruction spans of one iteration; True if a calibration may be due."""
        info = self.rank(spans.rank)
        if self.schedule is None:
            return False
        return self.model.add_spans(info, spans, len(self.schedule.stages[info.stage]))

    def calibration_tasks(self) -> list[tuple[Models, Profile, list]]:
        """(models, measured profile, baseline timelines) of each set of pipeline models due a fit:
        fitted on the first pipeline of those models, whose ranks profiled them (another may be a
        straggler on the same GPU model)."""
        tasks = []
        for models in dict.fromkeys(self.models(k) for k in range(self.spec.dp)):
            profile = self.pipeline_profile(models)
            pipelines = self.pipelines_of(models)[:1]
            if profile is not None and self.model.due(models, pipelines):
                tasks.append((models, profile, self.model.start_fit(models, pipelines)))
        return tasks

    def set_calibration(self, models: Models, result: object) -> set[str]:
        """A fit from the worker (or what it raised); no plan at all if the model cannot be planned
        on. A fit on profiles this run did not measure first checks them against its spans: the
        GPU models whose profiles no longer fit the workload are dropped, with their plans, and
        profiled again; returned (empty when none was). So are, once, profiles this run measured
        that its baseline contradicts (see perseus.service.model.PipelineModels.take_fit)."""
        inherited = self.profiling.inherited & set(models)
        state = self.model.calibrations.get(models)
        refitting, before = state.refitting, state.calibration
        mismatch = self.model.take_fit(models, result, bool(inherited))  # type: ignore[arg-type]
        if mismatch:
            dropped = inherited or set(models)
            self.drop_profiles(dropped, mismatch)
            return dropped
        if refitting and state.calibration is not before:
            # Fitted again on a reference window: its plans are solved again on the new fit.
            for key in [key for key in self.results if key[0] == models]:
                del self.plan_book.results[key]
        if not isinstance(result, BaseException):
            self.profiling.inherited -= set(models)  # they fit this run's workload
        if state.state == "failed" and not self.error:
            self.fail(f"no plan: {state.reason}", retryable=True)
        self._changed()
        return set()

    def drop_profiles(self, gpu_models: set[str], why: str) -> None:
        """Forget the profiles of these GPU models and every plan made on them: profiled again."""
        self.profile_dropped = clip(f"{', '.join(sorted(gpu_models))}: {why}")
        frequencies = self.ranks[min(self.ranks)].frequencies if self.ranks else None
        self.profiling.forget_models(gpu_models, frequencies)
        self.sweeps.resweep(gpu_models, self.spec.pp, self.last_iteration)  # ranks that uploaded sweep again
        self.plan_book.forget_models(gpu_models)
        self.model.profiles_dropped(gpu_models)
        self._changed()

    def correct(self, pipeline: int, verdict: Verdict) -> list[PlanKey]:
        """Act on a verdict against the pipeline's plan: run a reference window at maximum clocks
        (or end it), re-solve its models' plans with a grown margin, or fall back to maximum
        clocks. The keys dropped (to solve again)."""
        plan = self.plans.get(pipeline)
        if plan is None:
            return []
        models = plan.models
        references = self.plan_book.references
        if verdict.action == REFERENCE:
            profile = self.pipeline_profile(models)
            assert self.schedule is not None and profile is not None  # a plan was solved on them
            references[pipeline] = max_clock_result(self.schedule, profile, plan.result())
            return []
        references.pop(pipeline, None)
        if verdict.action == RESUME:
            self.model.refit(models, pipeline, verdict.measured_s)  # if due, solved again once fitted
            return []
        self.model.correct(models, verdict)
        state = self.model.calibrations.get(models)
        keys = [key for key in self.results if key[0] == models]
        if state.fallback:
            profile = self.pipeline_profile(models)
            assert self.schedule is not None and profile is not None  # a plan was solved on them
            for key in keys:
                solved = self.results[key]
                if isinstance(solved, PlanResult):
                    self.plan_book.results[key] = max_clock_result(self.schedule, profile, solved)
            return []
        for key in keys:
            del self.plan_book.results[key]
        self._changed()
        return keys

    # ---- plans ---------------------------------------------------------------------------------

    def straggler(self) -> Straggling | None:
        """(pipeline, factor, "declared" or "detected") of the slowest straggler, if any."""
        return self.measurements.straggler()

    def wanted(self) -> dict[int, PlanKey]:
        """The plan each pipeline should run (see PlanBook.wanted); no slowdown for pipelines
        verification put back at maximum clocks."""
        wanted = self.plan_book.wanted(self.straggler())
        return {k: (key[0], None) if self.model.calibrations.get(key[0]).fallback else key for k, key in wanted.items()}

    def missing_plans(self) -> list[tuple[PlanKey, Profile]]:
        """Plans to solve (with their profile): base plans first, then straggler deadlines."""
        return self.plan_book.missing(self.wanted(), self.planning_profile)

    def add_result(self, key: PlanKey, result: PlanResult | str) -> None:
        """A solved plan, or the planner's reason it could not (a base plan failing fails the job;
        a straggler deadline failing leaves the pipelines on their no-slowdown plans)."""
        self.plan_book.add_result(key, result)
        self._changed()
        if isinstance(result, str) and key[1] is None:
            self.fail(result, retryable=True)

    def publish(self) -> list[int]:
        """Publish, with one new version and one start iteration, the wanted plan of every pipeline
        whose plan changes and is solved (a lead ahead of the latest iteration); the pipelines changed."""
        start = self.last_iteration + plan_lead(self.measurements.recent_time_s) if self.last_iteration >= 0 else 0
        wanted = self.wanted()
        changed = self.plan_book.publish(wanted, start)
        if changed:
            self.measurements.published(self.plans, changed, self.last_iteration, self.plans_in_force())
            self.model.plans_published(self.plans, changed, self.pipelines_of)
        if self.plan_book.retarget(wanted) or changed:
            self._changed()
        return changed

    def kept(self, key: PlanKey, result: PlanResult) -> list[int]:
        """The pipelines that want the plan solved for `key` and already run its clocks: their plan
        stays (see PlanBook.runs)."""
        return [k for k, wanted in self.wanted().items() if wanted == key and self.plan_book.runs(k, key, result)]

    def plans_in_force(self) -> PlansInForce:
        """Each pipeline's plan key and frequencies, a reference window's those of the plan it checks."""
        return {k: (p.key, self.plan_book.checked(p).stage_frequencies) for k, p in self.plans.items()}

    def declare_straggler(self, pipeline: int, factor: float | None) -> None:
        self.measurements.declare(pipeline, factor)

    # ---- measurements ----------------------------------------------------------------------------

    def record(self, report: ReportIteration) -> tuple[Measured, bool] | None:
        """Add one rank's report; (the iteration's total, whether it ran a plan) once complete.
        Each pipeline's iterations also feed the straggler detector (see `update_stragglers`)."""
        info = self.rank(report.rank)
        self.note_iteration(report.rank, report.iteration)
        is_baseline = self.model.is_baseline if self.model.calibrates else None
        done = self.measurements.record(info, report, self.plans, self._base_time_s, is_baseline)
        self.model.measured(self.measurements.take_completed())
        return done

    def _base_time_s(self, pipeline: int) -> float | None:
        base = self.plan_book.base(pipeline)
        return None if base is None else base.iteration_time_s

    def update_stragglers(self) -> bool:
        """Re-decide the detected straggler after new pipeline iterations; True if it changed
        (the service then publishes or solves the plans the pipelines now want)."""
        return self.measurements.update_stragglers()

    def describe(self, measured: Measured) -> str:
        return status.describe(self, measured)

    def status(self) -> JobStatus:
        return status.job_status(self)

    # ---- persistence ---------------------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return persistence.to_record(self)

    @classmethod
    def from_record(cls, doc: dict[str, Any], stage_profiles: dict[str, Profile], cached: dict[str, Profile]) -> Job:
        """Rebuild a job saved by `to_record` (see `persistence.restore`)."""
        spec = JobSpec.from_wire(doc["spec"])
        if spec.job_id() != doc["job_id"]:
            raise ValueError(f"record of {doc['job_id']} holds the spec of {spec.job_id()}")
        job = cls(spec, build_schedule=False)
        persistence.restore(job, doc, stage_profiles, cached)
        job._changed()
        return job
