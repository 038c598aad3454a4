"""The service's threads off the socket loop: one builds new jobs' schedules (large schedules take
seconds), one calibrates pipelines' models on their measured timelines, and a pool of
`budget.planning_workers` solves plans. The loop hands work over with `build`, `calibrate` and
`solve` and takes the results with `built`, `calibrated` and `solved`; the threads touch no job.

A job's planners are kept for its later deadlines (a straggler's pace), least recently used
dropped, while their problems add up to at most one planning budget of choices.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Any

from perseus.profiler.profile import Profile
from perseus.schedules import Schedule
from perseus.service.budget import Budget
from perseus.service.planning import PlanResult, job_schedule, make_planner, plan_choices, plan_pipeline
from perseus.service.plans import PlanKey
from perseus.service.ranks import Models
from perseus.service.timelines import Timeline
from perseus.wire.spec import JobSpec

MAX_PLANNERS = 16  # planners kept for re-planning (least recently used dropped): each holds its LP

# One solved (or failed) plan: its key, the result and plan document or what was raised, seconds taken.
Solved = tuple[PlanKey, tuple[PlanResult, dict] | BaseException, float]
# One calibration: the job, the pipeline models, the fit (a perseus.service.calibration.Calibration)
# or what was raised, seconds taken, and the run of the job it was handed over in (see Job.run:
# a result of an earlier run is stale).
Calibrated = tuple[str, Models, Any, float, int]


class Workers:
    """Threads start on first use. `building`, `calibrating` and `planning`: jobs with work
    handed over whose results the loop has not taken yet."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.building: set[str] = set()
        self.calibrating: set[str] = set()
        self.planning: set[str] = set()
        self._to_calibrate: queue.SimpleQueue[tuple[str, Models, Schedule, Profile, list[Timeline], int]] = (
            queue.SimpleQueue()
        )
        self._calibrated: queue.SimpleQueue[Calibrated] = queue.SimpleQueue()
        self._calibrator: threading.Thread | None = None
        self._to_build: queue.SimpleQueue[JobSpec] = queue.SimpleQueue()
        self._built: queue.SimpleQueue[tuple[JobSpec, Schedule | BaseException, float]] = queue.SimpleQueue()
        self._builder: threading.Thread | None = None
        self._to_plan: queue.SimpleQueue[tuple[str, Schedule, list[tuple[PlanKey, Profile]], int]] = queue.SimpleQueue()
        self._solved: queue.SimpleQueue[tuple[str, list[Solved], int]] = queue.SimpleQueue()
        self._planners_started = 0
        # (job, stage models) -> (Planner, its choices), reused for later deadlines (see _planner).
        self._planners: OrderedDict[tuple[str, Models], tuple[Any, int]] = OrderedDict()
        self._planners_lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a schedule is being built, a model calibrated or a plan solved (their results
        not yet taken)."""
        return bool(self.building or self.calibrating or self.planning)

    def busy_with(self, job_id: str) -> bool:
        return job_id in self.building or job_id in self.calibrating or job_id in self.planning

    def forget(self, job_id: str) -> None:
        """Drop the job's planners (it was evicted, or the profiles they hold are)."""
        with self._planners_lock:
            for key in [k for k in self._planners if k[0] == job_id]:
                del self._planners[key]

    # ---- schedules -----------------------------------------------------------------------------

    def build(self, spec: JobSpec) -> None:
        """Build (and validate) the job's schedule on the builder thread."""
        if self._builder is None:
            self._builder = threading.Thread(target=self._build_worker, name="build-schedules", daemon=True)
            self._builder.start()
        self.building.add(spec.job_id())
        self._to_build.put(spec)

    def _build_worker(self) -> None:
        while True:
            spec = self._to_build.get()
            start = time.perf_counter()
            try:
                result: Schedule | BaseException = job_schedule(spec)
            except BaseException as e:
                result = e
            self._built.put((spec, result, time.perf_counter() - start))

    def built(self) -> list[tuple[JobSpec, Schedule | BaseException, float]]:
        """The schedules built since the last call: (spec, schedule or what was raised, seconds)."""
        done = _drain(self._built)
        for spec, _, _ in done:
            self.building.discard(spec.job_id())
        return done

    # ---- calibrations --------------------------------------------------------------------------

    def calibrate(
        self, job_id: str, models: Models, schedule: Schedule, profile: Profile, timelines: list[Timeline], run: int
    ) -> None:
        """Fit the pipeline models' calibration on the calibration thread (for the job's `run`)."""
        if self._calibrator is None:
            self._calibrator = threading.Thread(target=self._calibrate_worker, name="calibrate-models", daemon=True)
            self._calibrator.start()
        self.calibrating.add(job_id)
        self._to_calibrate.put((job_id, models, schedule, profile, timelines, run))

    def _calibrate_worker(self) -> None:
        # Imported here, as the planner is: numpy and the DAG only load once a job calibrates.
        from perseus.service.calibration import fit

        while True:
            job_id, models, schedule, profile, timelines, run = self._to_calibrate.get()
            start = time.perf_counter()
            try:
                result: Any = fit(schedule, profile, timelines)
            except BaseException as e:
                result = e
            self._calibrated.put((job_id, models, result, time.perf_counter() - start, run))

    def calibrated(self) -> list[Calibrated]:
        """The calibrations fitted since the last call."""
        done = _drain(self._calibrated)
        for job_id, *_ in done:
            self.calibrating.discard(job_id)
        return done

    # ---- plans ---------------------------------------------------------------------------------

    def solve(self, job_id: str, schedule: Schedule, tasks: list[tuple[PlanKey, Profile]], run: int) -> None:
        """Solve one job's plans (key, profile) on the pool, in order (for the job's `run`)."""
        self.planning.add(job_id)
        while self._planners_started < min(self.budget.planning_workers, len(self.planning)):
            self._planners_started += 1
            threading.Thread(target=self._plan_worker, name=f"planner-{self._planners_started}", daemon=True).start()
        self._to_plan.put((job_id, schedule, tasks, run))

    def _plan_worker(self) -> None:
        """One of `budget.planning_workers` threads: solves one job's plans at a time."""
        while True:
            job_id, schedule, tasks, run = self._to_plan.get()
            done: list[Solved] = []
            for key, profile in tasks:
                start = time.perf_counter()
                try:
                    planner = self._planner(job_id, key[0], schedule, profile)
                    result: tuple[PlanResult, dict] | BaseException = plan_pipeline(planner, key[1])
                except BaseException as e:
                    result = e
                done.append((key, result, time.perf_counter() - start))
            self._solved.put((job_id, done, run))

    def _planner(self, job_id: str, models: Models, schedule: Schedule, profile: Profile) -> Any:
        """The pipeline's planner: kept for later deadlines while the kept ones' problems add up
        to at most one planning budget of choices (a planner's memory grows with them)."""
        with self._planners_lock:
            kept = self._planners.get((job_id, models))
            if kept is not None:
                self._planners.move_to_end((job_id, models))
                return kept[0]
        planner = make_planner(schedule, profile)
        with self._planners_lock:
            self._planners[(job_id, models)] = (planner, plan_choices(schedule, profile))
            while len(self._planners) > 1 and (
                len(self._planners) > MAX_PLANNERS
                or sum(c for _, c in self._planners.values()) > self.budget.max_plan_choices
            ):
                self._planners.popitem(last=False)
        return planner

    def solved(self) -> list[tuple[str, list[Solved], int]]:
        """The jobs whose plans were solved since the last call, with their plans and run."""
        done = _drain(self._solved)
        for job_id, _, _ in done:
            self.planning.discard(job_id)
        return done


def _drain(results: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(results.get_nowait())
        except queue.Empty:
            return items
