"""What a job's ranks measure, and the stragglers it reveals: iterations summed over every rank
(baseline and planned means, against the plans' predictions), each pipeline's iterations
against the plan it ran (fed to the straggler detector), and the stragglers an operator declared.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from perseus.service.plans import PlanKey, PublishedPlan, Straggling
from perseus.service.ranks import bad_field
from perseus.service.straggler import Straggler, StragglerDetector
from perseus.service.tally import IterationTally, Mean, Measured
from perseus.service.verification import SKIP
from perseus.wire.messages import ReportIteration
from perseus.wire.spec import JobSpec, RankInfo

log = logging.getLogger(__name__)

HISTORY = 8  # plan changes per pipeline kept to read measured iterations against their plan
# A declared factor this far from the pipeline's measured one is said (WARNING, status), and the
# measured one sets the pace until the pipeline runs near the declared one again.
DECLARED_OFF = 0.10
RECENT = 8  # iterations per pipeline whose median its status reports

# What the planned mean measures: each pipeline's (plan key, frequencies), a reference window
# counted as the plan it checks (see PlanBook.checked).
PlansInForce = dict[int, tuple[PlanKey, tuple[tuple[int, ...], ...]]]


class Measurements:
    """The measurements of one job since its ranks (re)started; `declared` outlives restarts."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.declared: dict[int, float] = {}  # pipeline -> factor an operator declared
        # Pipeline -> (its measured factor, why) where that contradicts its declared one.
        self.declared_off: dict[int, tuple[float, str]] = {}
        # The stages whose compute time is a pipeline's (perseus.planner.dag.ending_stages); None: all.
        self.ending_stages: frozenset[int] | None = None
        self.restart({})

    def restart(self, plans: dict[int, PublishedPlan]) -> None:
        """Forget every measurement (the ranks start from iteration 0 under `plans`)."""
        spec = self.spec
        self.tally = IterationTally(spec.world_size)
        self.pipeline_tally = [IterationTally(spec.pp * spec.tp) for _ in range(spec.dp)]
        self.history: list[deque[tuple[int, float]]] = [
            deque(maxlen=HISTORY) for _ in range(spec.dp)
        ]  # (start, planned time)
        for k, plan in plans.items():
            self.history[k].append((plan.start_iteration, plan.iteration_time_s))
        self.measured_time: list[deque[float]] = [deque(maxlen=RECENT) for _ in range(spec.dp)]
        self.completed: list[tuple[int, Measured]] = []  # pipelines' iterations since `take_completed`
        self.detector = StragglerDetector(spec.dp)
        self._fed = False  # the detector has values it has not decided on
        self.baseline = Mean()
        # Each pipeline's baseline iterations (its compute time): how far its slowest pipeline
        # lagged then, which the planned iterations' saving is only comparable with.
        self.baseline_pipelines = [Mean() for _ in range(spec.dp)]
        self.planned = Mean()  # iterations of the plans in force, reference windows left out
        self.planned_in_force: PlansInForce = {}
        self.saved_iteration = -1  # the latest iteration before the service restarted, as last saved
        self.since_published = 0  # planned iterations (reference windows too) since the last publication
        self.odd = 0  # iterations left out of the means: one rank's time far from the others' (see Measured)
        self._off_clock = [0, 0]  # since the latest plan: instructions off their clock, reports telling it
        self.recent_time_s: float | None = None

    def published(
        self, plans: dict[int, PublishedPlan], changed: list[int], last_iteration: int, in_force: PlansInForce
    ) -> None:
        """New plans for the pipelines `changed`: measured iterations are read against them from
        their start, and the planned mean starts over unless the plans `in_force` are those it
        measures (a reference window begins or ends: its iterations are left out meanwhile)."""
        for k in changed:
            plan = plans[k]
            history = self.history[k]
            while history and history[-1][0] > last_iteration:
                history.pop()  # superseded before its start: the ranks never run it (see PlannerClient)
            history.append((plan.start_iteration, plan.iteration_time_s))
        self.since_published = 0
        if in_force != self.planned_in_force:
            self.planned = Mean()
            self.planned_in_force = in_force
            self._off_clock = [0, 0]

    def record(
        self,
        info: RankInfo,
        report: ReportIteration,
        plans: dict[int, PublishedPlan],
        base_time_s: Callable[[int], float | None],
        is_baseline: Callable[[int], bool] | None = None,
    ) -> tuple[Measured, bool] | None:
        """Add one rank's report; (the iteration's total, whether it ran a plan) once complete.
        Each pipeline's iterations also feed the straggler detector, at the scale of its
        no-slowdown plan (`base_time_s`; see `update_stragglers`). `is_baseline` tells the
        baseline iterations (default clocks, no profiling) where the ranks say which they are;
        without it, the warm-up iterations are, but the first (it sets up: see SpanBook.add)."""
        warmup = self.spec.warmup_iterations
        baseline = (lambda i: 0 < i < warmup) if is_baseline is None else is_baseline
        first_planned = max((p.start_iteration for p in plans.values()), default=None)

        def planned(iteration: int) -> bool:
            return first_planned is not None and iteration >= first_planned

        self._record_pipeline(info, report, base_time_s, lambda i: baseline(i) and not planned(i))
        if report.off_clock is not None and planned(report.iteration):
            self._off_clock[0] += report.off_clock
            self._off_clock[1] += 1
        measured = self.tally.add(report.rank, report.iteration, report.time_s, report.energy_j)
        if measured is None:
            return None
        if measured.iteration == 0:  # set-up (a rank's first step builds its schedule): never averaged
            return replace(measured, odd_rank=None), False
        if measured.odd_rank is not None:
            self.odd += 1
            return measured, False
        self.recent_time_s = measured.time_s
        if planned(measured.iteration):
            self.since_published += 1
            if not any(p.reference for p in plans.values()):  # a window at maximum clocks saves nothing
                self.planned.add(measured)
            elif all(p.reference for p in plans.values()) and measured.iteration >= (first_planned or 0) + SKIP:
                # Every pipeline at default clocks, past the switch: a baseline iteration too. The
                # pre-plan baseline is a few seconds of iterations, whose reading an energy counter
                # that steps every 100 ms moves by a few percent; each reference window adds more,
                # taken beside the plans, on the host as it is by then.
                self.baseline.add(measured)
            return measured, True
        if baseline(measured.iteration):
            self.baseline.add(measured)
        return measured, False

    def _record_pipeline(
        self,
        info: RankInfo,
        report: ReportIteration,
        base_time_s: Callable[[int], float | None],
        is_baseline: Callable[[int], bool],
    ) -> None:
        k = info.dp_index
        time_s = report.time_s if report.compute_time_s is None else report.compute_time_s
        paces = self.ending_stages is None or info.stage in self.ending_stages
        measured = self.pipeline_tally[k].add(report.rank, report.iteration, time_s, report.energy_j, paces)
        if measured is None or measured.odd_rank is not None:
            return
        self.measured_time[k].append(measured.time_s)
        if is_baseline(measured.iteration):
            self.baseline_pipelines[k].add(measured)
        if len(self.completed) < 1024:  # taken after every report; bounded all the same
            self.completed.append((k, measured))
        planned = self._planned_time_at(k, measured.iteration)
        base = base_time_s(k)
        if planned is not None and base is not None:
            # At its no-slowdown plan's time scale: a pipeline slowed on purpose is not slow.
            self.detector.add(k, measured.time_s / planned * base)
            self._fed = True

    @property
    def off_clock_instructions(self) -> float | None:
        """Per planned iteration, summed over the ranks: instructions that ran at a clock other than
        planned (ranks that cannot tell count as the others do); None if no rank tells."""
        total, reports = self._off_clock
        return total * self.spec.world_size / reports if reports else None

    def _planned_time_at(self, pipeline: int, iteration: int) -> float | None:
        times = [t for start, t in self.history[pipeline] if start <= iteration]
        return times[-1] if times else None

    def take_completed(self) -> list[tuple[int, Measured]]:
        """Each pipeline's iterations completed since the last call: (pipeline, its slowest rank's
        compute time, or iteration time where ranks report none)."""
        completed, self.completed = self.completed, []
        return completed

    def measured_time_s(self, pipeline: int) -> float | None:
        """The median of the pipeline's recent iteration times, if any."""
        recent = self.measured_time[pipeline]
        return statistics.median(recent) if recent else None

    # ---- stragglers --------------------------------------------------------------------------------

    def update_stragglers(self) -> bool:
        """Re-decide the detected straggler after new pipeline iterations; True if it changed."""
        if not self._fed:
            return False
        self._fed = False
        before = self.straggler()
        previous = self.detector.current
        current = self.detector.update()
        self._check_declared()
        if current is None and previous is not None:
            log.info("job %s: pipeline %d recovered; back to the no-slowdown plans", self.job_id, previous.pipeline)
        elif current is not None and current != previous:
            log.info(
                "job %s: pipeline %d straggles (%.3fx the others' iteration time)",
                self.job_id,
                current.pipeline,
                current.factor,
            )
        return self.straggler() != before

    def stragglers_measured(self) -> bool:
        """Whether every pipeline ran enough iterations under its plan for the detector to tell
        its straggler, if any (not yet after a plan first applies, or the service restarted)."""
        return len(self.detector.medians()) == self.spec.dp

    def baseline_lag(self) -> tuple[int, float] | None:
        """(the slowest pipeline, its time over the others' median) in the baseline iterations;
        None with one pipeline, or before each has a baseline iteration."""
        times = [m.time_s for m in self.baseline_pipelines]
        if len(times) < 2 or any(t is None for t in times):
            return None
        known = [float(t) for t in times if t is not None]
        slowest = max(range(len(known)), key=lambda k: known[k])
        return slowest, known[slowest] / statistics.median(t for k, t in enumerate(known) if k != slowest)

    def _check_declared(self) -> None:
        """Where a declared factor is not what the pipeline's iterations measure, the measured one
        sets the pace (the others would wait for a pace nobody keeps, or not wait long enough),
        revised only past the detector's threshold (no re-plan for noise); said once."""
        medians = self.detector.medians()
        for k, factor in self.declared.items():
            others = [m for j, m in medians.items() if j != k]
            if k not in medians or not others:
                continue
            measured = medians[k] / statistics.median(others)
            held = self.declared_off.get(k)
            if abs(measured / factor - 1) <= DECLARED_OFF:
                if self.declared_off.pop(k, None) is not None:
                    log.info("job %s: pipeline %d runs its declared %.3fx again", self.job_id, k, factor)
                continue
            if held is not None and abs(measured / held[0] - 1) <= self.detector.threshold:
                continue
            pace = (
                f"the measured {measured:.3f}x sets the others' pace"
                if measured > 1 + self.detector.threshold
                else "the measured factor sets the pace: none, it is no straggler"
            )
            why = (
                f"declared {factor:.3f}x, contradicted by measurement: its iterations measure {measured:.3f}x the "
                f"others' time, so {pace}, until it runs near the declared factor (the others would otherwise wait "
                f"for a pace it does not keep). Declare what it runs (perseus straggler --job {self.job_id} "
                f"--pipeline {k} --factor {max(1.0, measured):.2f}) or withdraw it (--clear)"
            )
            if held is None:
                log.warning("job %s: pipeline %d %s", self.job_id, k, why)
            self.declared_off[k] = (measured, why)

    def detected_record(self) -> list[float] | None:
        """The detected straggler as a job record keeps it: [pipeline, factor], or None."""
        current = self.detector.current
        return None if current is None else [current.pipeline, current.factor]

    def resume_detected(self, record: object) -> None:
        """Start the detector from a `detected_record` (ValueError or TypeError if it is not one)."""
        if not isinstance(record, list) or len(record) != 2:
            raise ValueError(f"expected [pipeline, factor], got {record!r}")
        pipeline, factor = record
        if isinstance(pipeline, bool) or not (isinstance(pipeline, int) and 0 <= pipeline < self.spec.dp):
            raise ValueError(f"pipeline {pipeline!r} is not one of 0..{self.spec.dp - 1}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 < factor < math.inf:
            raise ValueError(f"factor {factor!r} is not a straggler's (a number above 1)")
        self.detector.current = Straggler(pipeline, float(factor))

    def declare(self, pipeline: int, factor: float | None) -> None:
        """An operator's word that `pipeline` runs `factor` x its planned time (None: it no longer does)."""
        dp = self.spec.dp
        if dp == 1 and factor is not None:
            raise bad_field(
                f"job {self.job_id} has one pipeline (dp=1): a straggler is a data-parallel pipeline the others "
                "wait for, and there are no others to slow to its pace"
            )
        if pipeline >= dp:
            raise bad_field(
                f"pipeline {pipeline} does not exist: job {self.job_id} has dp={dp} (pipelines 0..{dp - 1})"
            )
        self.declared_off.pop(pipeline, None)
        if factor is None:
            self.declared.pop(pipeline, None)
        else:
            self.declared[pipeline] = factor
            # Against what its iterations measure now: a factor they contradict gets no plan of its
            # own, which the next iteration would withdraw (and `perseus straggler` show as in force).
            self._check_declared()

    def straggler(self) -> Straggling | None:
        """(pipeline, factor, "declared" or "detected") of the slowest straggler, if any. A
        declaration its iterations contradict counts as their factor, measured against the others'
        ("detected"), if it is a straggler's at all."""
        candidates = []
        for k, factor in self.declared.items():
            source = "declared"
            off = self.declared_off.get(k)
            if off is not None:
                factor, source = off[0], "detected"
                if factor <= 1 + self.detector.threshold:
                    continue
            if k < self.spec.dp:
                candidates.append((factor, k, source))
        detected = self.detector.current
        if detected is not None:
            candidates.append((detected.factor, detected.pipeline, "detected"))
        if not candidates:
            return None
        factor, pipeline, source = max(candidates)
        return pipeline, factor, source
