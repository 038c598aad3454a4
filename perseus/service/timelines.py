"""A job's measured timelines and the calibration of each pipeline's model on them.

Ranks send each baseline iteration's instruction spans (`ReportSpans`) while the service asks
for them (`Table.spans`). `SpanBook` assembles, per data-parallel pipeline, the iterations every
stage reported (the first tensor-parallel rank of each stage speaks for it), and
`Calibrations` tracks, per pipeline GPU models, where its model stands:

    collecting -> fitting -> fitted                (a plan may be made on the calibrated model)
                          -> collecting            (the fit missed: more iterations, up to MAX_ATTEMPTS;
                                                    then each later fit on a fresh window, see `fit_interval`)
                          -> failed                (no plan: the profile explains too little, or no fit)
    uncalibrated                                   (some rank sends no spans: the GPU profile alone)
    overridden                                     (the job spec gives the overheads itself)

A fitted model is fitted again (`Calibrations.refit`) on a verification reference window's
spans (maximum clocks) when that window ran over REFIT_DRIFT faster than the iterations the
model was fitted on: the host sped up, and the host work and hops the plans counted on shrank.

The fit itself (perseus.service.calibration) runs on a worker thread; nothing here imports it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from perseus.service.ranks import Models, bad_field
from perseus.service.tally import Completed
from perseus.service.verification import WINDOW
from perseus.wire.phases import Phase
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo

log = logging.getLogger(__name__)

#: The planner's model must reproduce the measured baseline iteration within this fraction, or
#: within what the measured median itself is uncertain by (`Calibration.noise`), if more.
TOLERANCE = 0.01
#: Standard errors of the measured median a model may differ by on a noisy host (see `noise`).
NOISE_SIGNIFICANCE = 2.0
#: Below this share of the measured iteration explained by the GPU profile, no plan is made.
MIN_EXPLAINED = 0.5
#: Baseline iterations a calibration needs (beyond the first iteration of the job).
MIN_ITERATIONS = 8
#: A reference window at maximum clocks this much faster than the iterations a model was fitted
#: on (the host sped up since: host gaps and hops shrank) fits the model again on that window.
REFIT_DRIFT = 0.10
#: Fits again on reference windows per set of models and run, at most.
MAX_REFITS = 2
#: Baseline iterations kept per pipeline (the latest).
MAX_TIMELINES = 24
#: Timelines of a reference window kept per pipeline: the iterations verification counts in it.
REFERENCE_TIMELINES = WINDOW
#: Iterations awaiting some stage's spans; older ones are dropped.
PENDING_LIMIT = 16
#: Fits tried on more iterations of the baseline (the latest MAX_TIMELINES) while the model misses
#: it; past these, each fit waits for a fresh window of MAX_TIMELINES iterations, twice as many
#: after each miss (host load that outlasts a window is seldom steady for long; a fit costs the
#: ranks nothing and the job runs at maximum clocks meanwhile).
MAX_ATTEMPTS = 3
#: A profile from an earlier run (or the signature cache) no longer fits the job's workload when a
#: stage's measured spans moved this much against the profile's times, compared with the fit of
#: the run that measured it (at least; more where the spans' spread says it is noise) ...
STALE_TOLERANCE = 0.1
#: ... or, with no such fit to compare with, this much off the profile's times themselves.
STALE_UNREFERENCED = 0.5
#: Relative spreads (of the two runs' spans, added) a change from that fit must exceed, if over STALE_TOLERANCE.
STALE_SIGNIFICANCE = 3.0

_BASELINE = (Phase.WARMUP.value, Phase.PLANNING.value)
_REFERENCE = Phase.REFERENCE.value

COLLECTING = "collecting"
FITTING = "fitting"
FITTED = "fitted"
FAILED = "failed"
UNCALIBRATED = "uncalibrated"
OVERRIDDEN = "overridden"


@dataclass(frozen=True)
class Timeline:
    """One baseline iteration (default clocks) of one pipeline as its ranks measured it: for each
    stage (rank), every instruction's begin and end (seconds after that rank's step began, in the
    rank's schedule order) and its step's length."""

    begins: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    steps: tuple[float, ...]

    @property
    def time_s(self) -> float:
        """The iteration: the longest rank's step."""
        return max(self.steps)

    @property
    def compute_s(self) -> float:
        """To the end of the last instruction of the slowest rank (what ranks report as compute time)."""
        return max(row[-1] for row in self.ends)


@dataclass(frozen=True)
class StageFit:
    """One stage (rank): its measured instruction window (first begin to last end, median over
    iterations) against the planner's calibrated model, its busy time, the fitted host gap
    between its instructions (median over kinds), and its instructions' measured spans against
    the profile's times at the top clock (`span_ratio`, median over instructions; `span_spread`:
    its relative spread over iterations): what tells a profile that no longer fits the workload."""

    stage: int
    measured_s: float
    model_s: float
    busy_s: float
    host_gap_s: float
    span_ratio: float = 1.0
    span_spread: float = 0.0

    @property
    def error(self) -> float:
        return self.model_s / self.measured_s - 1.0 if self.measured_s > 0 else 0.0


@dataclass(frozen=True)
class Calibration:
    """What `fit` found. Times in seconds; `overheads` are the planner's per profile row."""

    iterations: int
    measured_s: float  # median baseline iteration (the longest rank's step)
    model_s: float  # the planner's calibrated model at maximum clocks, plus the step's host time
    gpu_only_s: float  # the GPU-only profile at maximum clocks, plus the same host time
    outside_s: float  # the step's time outside the instruction window (on the first stage)
    explained: float  # share of the measured iteration the GPU profile alone accounts for
    hop_s: float  # median stage-to-stage hop (one way)
    host_gap_s: float  # median host gap between a stage's instructions
    overheads: dict[tuple[int, str], float]
    stages: tuple[StageFit, ...]
    noise: float = 0.0  # NOISE_SIGNIFICANCE standard errors of the measured median (relative)
    # Per profile row, what host noise adds to its instructions on average (their mean span and
    # gap over the median): room a plan that slows the row leaves, since it takes the slack that
    # absorbed the noise at maximum clocks (perseus.service.model.with_margin).
    reserve: dict[tuple[int, str], float] = field(default_factory=dict)

    @property
    def tolerance(self) -> float:
        """How far the model may be from the measured median: TOLERANCE, or on a host whose
        iterations vary more, the median's own uncertainty (a slowest-of-ranks median is also
        biased up by that spread, which no model of one iteration reproduces)."""
        return max(TOLERANCE, self.noise)

    @property
    def error(self) -> float:
        """The planner's model against the measured baseline iteration (+: the model is slower)."""
        return self.model_s / self.measured_s - 1.0

    @property
    def fit_ok(self) -> bool:
        return abs(self.error) <= self.tolerance

    @property
    def plannable(self) -> bool:
        return self.explained >= MIN_EXPLAINED

    def reason(self) -> str:
        """Why no plan may be made on this model ("" when one may)."""
        if not self.plannable:
            return (
                f"the GPU profile explains only {100 * self.explained:.0f}% of the measured iteration "
                f"({self.gpu_only_s:.4f} s of {self.measured_s:.4f} s): host work and transfers dominate, so clocks "
                "cannot save energy without slowing it; on simulated GPUs, emulate the model's GPU work "
                "(perseus.instrument(..., emulate=...))"
            )
        if not self.fit_ok:
            return (
                f"the calibrated model does not reproduce the measured baseline iteration: {self.model_s:.4f} s "
                f"against {self.measured_s:.4f} s measured ({100 * self.error:+.1f}%, tolerance "
                f"{100 * self.tolerance:.1f}%: {100 * TOLERANCE:.0f}%, or the baseline's noise if more); the job "
                "runs at maximum clocks until a fit on later baseline iterations does"
            )
        return ""

    def describe(self) -> str:
        return (
            f"model {self.model_s:.4f} s vs measured {self.measured_s:.4f} s ({100 * self.error:+.2f}%, "
            f"tolerance {100 * self.tolerance:.1f}%) over "
            f"{self.iterations} iterations; GPU profile alone {self.gpu_only_s:.4f} s "
            f"({100 * self.explained:.0f}% explained); host gap {1000 * self.host_gap_s:.2f} ms, hop "
            f"{1000 * self.hop_s:.2f} ms; noise reserve {1000 * self.reserve_s:.2f} ms on slowed instructions"
        )

    @property
    def reserve_s(self) -> float:
        """The median row's reserve."""
        return float(statistics.median(self.reserve.values())) if self.reserve else 0.0


class SpanBook:
    """Baseline timelines of each pipeline of one job."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.timelines: list[deque[Timeline]] = [deque(maxlen=MAX_TIMELINES) for _ in range(spec.dp)]
        self.added = [0] * spec.dp  # timelines each pipeline ever completed (the deque keeps the latest)
        self.pending: dict[tuple[int, int], dict[int, ReportSpans]] = {}
        self.completed = Completed()  # (pipeline, iteration): spans sent again count once
        self.received = 0  # span reports taken (any pipeline)
        # Each pipeline's latest reference window at maximum clocks (see Calibrations.refit).
        self.references: list[deque[Timeline]] = [deque(maxlen=REFERENCE_TIMELINES) for _ in range(spec.dp)]

    def restart(self) -> None:
        """The ranks run again from iteration 0: iterations in flight are forgotten."""
        self.pending.clear()
        self.completed = Completed()
        for window in self.references:
            window.clear()

    def new_run(self) -> None:
        """A new run of the job: its baseline is measured anew, an earlier run's is forgotten."""
        self.restart()
        for timelines in self.timelines:
            timelines.clear()
        self.added = [0] * self.spec.dp

    def add(self, info: RankInfo, spans: ReportSpans, instructions: int) -> int | None:
        """Take one rank's spans; the pipeline whose timelines gained an iteration, if any.
        ServiceError (bad_field) if the spans do not match the rank's schedule."""
        if len(spans.begins_us) != instructions:
            raise bad_field(
                f"rank {info.rank} sent {len(spans.begins_us)} instruction spans for iteration {spans.iteration}, "
                f"but stage {info.stage} runs {instructions} instructions per iteration"
            )
        reference = spans.phase == _REFERENCE
        measured = reference or spans.phase in _BASELINE  # at maximum clocks, not profiling
        if info.tp_index or spans.iteration == 0 or not measured or spans.frequency is not None:
            return None  # the first tensor-parallel rank speaks for its stage; iteration 0 warms up
        key = (info.dp_index, spans.iteration)
        if key in self.completed:
            return None
        self.received += 1
        stages = self.pending.setdefault(key, {})
        stages[info.stage] = spans
        if len(stages) < self.spec.pp:
            if len(self.pending) > PENDING_LIMIT:
                del self.pending[min(self.pending, key=lambda k: k[1])]
            return None
        del self.pending[key]
        self.completed.add(key)
        if reference:
            self.references[info.dp_index].append(_timeline(self.spec.pp, stages))
            return None
        self.timelines[info.dp_index].append(_timeline(self.spec.pp, stages))
        self.added[info.dp_index] += 1
        return info.dp_index

    def spread(self, pipelines: list[int]) -> tuple[float, int]:
        """(relative spread of the baseline compute times: 1.4826 MADs over the median, how many)."""
        times = [tl.compute_s for k in pipelines for tl in self.timelines[k]]
        if len(times) < 2:
            return 0.0, len(times)
        median = statistics.median(times)
        return 1.4826 * statistics.median(abs(t - median) for t in times) / median, len(times)

    def baseline_s(self, pipelines: list[int]) -> tuple[float | None, float | None]:
        """(iteration time, compute time): medians over these pipelines' baseline timelines."""
        rows = [tl for k in pipelines for tl in self.timelines[k]]
        if not rows:
            return None, None
        return statistics.median(tl.time_s for tl in rows), statistics.median(tl.compute_s for tl in rows)


def _timeline(pp: int, stages: dict[int, ReportSpans]) -> Timeline:
    ordered = [stages[s] for s in range(pp)]
    return Timeline(
        begins=tuple(tuple(t / 1e6 for t in s.begins_us) for s in ordered),
        ends=tuple(tuple(t / 1e6 for t in s.ends_us) for s in ordered),
        steps=tuple(s.step_us / 1e6 for s in ordered),
    )


@dataclass
class ModelState:
    """Where one set of pipeline models stands (see the module docstring)."""

    state: str = COLLECTING
    calibration: Calibration | None = None
    reason: str = ""
    attempts: int = 0
    fitted_with: int = 0  # timelines the last fit saw
    margin: float = 0.0  # verification's margin on slowed instructions (perseus.service.verification)
    fallback: bool = False  # verification gave up: maximum clocks
    history: list[str] = field(default_factory=list)  # the re-plans and fallback, why
    # Per stage: (span ratio, its spread) of the last fit whose profile fitted the workload: what
    # a later run's spans are compared with (see `profile_mismatch`).
    reference: tuple[tuple[float, float], ...] = ()
    # Per pipeline: (iteration, compute time, noise) measured at the baseline, kept for restarts
    # (noise: the excess the baseline's spread alone may show, see perseus.service.verification).
    baselines: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    # A fit again on a reference window (see `Calibrations.refit`): the median compute time of the
    # iterations the model was last fitted on, the window's timelines awaiting the fit, whether
    # it runs, and how many were made. Not kept across restarts.
    fitted_compute_s: float = 0.0
    fitting_compute_s: float = 0.0  # of the fit in flight
    refit: tuple[Timeline, ...] = ()
    refitting: bool = False
    refits: int = 0

    def to_record(self) -> dict[str, Any]:
        """What a restarted service needs: the fit the plans were made on and verification's state."""
        transient = (
            *("calibration", "attempts", "fitted_with"),
            *("fitted_compute_s", "fitting_compute_s", "refit", "refitting", "refits"),
        )
        doc = {k: v for k, v in asdict(self).items() if k not in transient}
        if self.calibration is not None:
            doc["calibration"] = {
                **asdict(self.calibration),
                "overheads": [[s, k, v] for (s, k), v in sorted(self.calibration.overheads.items())],
                "reserve": [[s, k, v] for (s, k), v in sorted(self.calibration.reserve.items())],
            }
        return doc

    @classmethod
    def from_record(cls, doc: dict[str, Any]) -> ModelState:
        c = doc.get("calibration")
        calibration = None
        if c is not None:
            stages = tuple(StageFit(**s) for s in c.get("stages", ()))
            overheads = {(int(s), str(k)): float(v) for s, k, v in c.get("overheads", ())}
            reserve = {(int(s), str(k)): float(v) for s, k, v in c.get("reserve", ())}
            calibration = Calibration(**{**c, "stages": stages, "overheads": overheads, "reserve": reserve})
        state = str(doc.get("state", COLLECTING))
        return cls(
            state=COLLECTING if state == FITTING else state,  # a fit in flight is made again
            calibration=calibration,
            reason=str(doc.get("reason", "")),
            margin=float(doc.get("margin", 0.0)),
            fallback=bool(doc.get("fallback", False)),
            history=[str(h) for h in doc.get("history", [])][-8:],
            reference=tuple((float(r), float(n)) for r, n in doc.get("reference", ())),
            baselines={int(k): (float(t), float(c), float(n)) for k, (t, c, n) in doc.get("baselines", {}).items()},
        )


class Calibrations:
    """The calibration of each set of pipeline models of one job."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.overridden = bool(spec.instruction_overhead_s or spec.hop_latency_s)
        self.states: dict[Models, ModelState] = {}

    def get(self, models: Models) -> ModelState:
        state = self.states.get(models)
        if state is None:
            state = self.states[models] = ModelState(OVERRIDDEN if self.overridden else COLLECTING)
        return state

    def new_run(self) -> None:
        """A new run of the job: every model is fitted again on the new run's baseline (a model
        that failed gets a fresh chance, verification starts over); only what the new run's spans
        are compared with stays (see `profile_mismatch`)."""
        for models, old in self.states.items():
            self.states[models] = ModelState(OVERRIDDEN if self.overridden else COLLECTING, reference=old.reference)

    def ready(self, models: Models) -> bool:
        """Whether plans for these models may be solved now (not while a fit again is due or runs)."""
        state = self.get(models)
        return state.state in (FITTED, UNCALIBRATED, OVERRIDDEN) and not (state.refit or state.refitting)

    def wants_spans(self, models: Models) -> bool:
        """Spans are wanted until a plan is in force (the more baseline iterations, the steadier
        the baseline plans are verified against), unless the model failed."""
        return self.get(models).state in (COLLECTING, FITTING, FITTED)

    def due(self, models: Models, timelines: int) -> bool:
        """Whether enough new timelines are in to fit these models (again), or a reference window
        to fit them again on; `timelines`: how many their pipelines ever completed."""
        state = self.get(models)
        collected = timelines >= state.fitted_with + fit_interval(state.attempts)
        return bool(state.refit) or (state.state == COLLECTING and collected)

    def refit(self, models: Models, reference_s: float, window: list[Timeline]) -> str:
        """A reference window ran at maximum clocks in `reference_s` (median compute time): if that
        is over REFIT_DRIFT faster than the iterations the model was fitted on, the host sped up
        since (the baseline ran while other work slowed it), and the host gaps and hops the plans
        slowed instructions into shrank: the models are fitted again on the window's timelines,
        their plans solved again after. Why ("" if not). A slower window is not fitted on: a
        model of a faster host leaves the plans less slack than a slow one has, and a slow window
        may be a passing spike of other work."""
        state = self.get(models)
        fitted_s = state.fitted_compute_s
        if state.state != FITTED or fitted_s <= 0 or state.refits >= MAX_REFITS or len(window) < MIN_ITERATIONS:
            return ""
        drift = reference_s / fitted_s - 1.0
        if drift >= -REFIT_DRIFT:
            return ""
        state.refit = tuple(window)
        state.refits += 1
        why = (
            f"maximum clocks take {reference_s:.4f} s, {100 * drift:+.1f}% from the {fitted_s:.4f} s the model was "
            f"fitted on (the host sped up: less host work between instructions than the plan counted on): the "
            f"model is fitted again on that window ({state.refits} of {MAX_REFITS})"
        )
        state.history = (state.history + [why])[-8:]
        return why

    def fitting(self, models: Models, timelines: int) -> tuple[Timeline, ...]:
        """A fit of these models starts, `timelines` completed so far: the reference window it fits
        again on, if that is what it does (else empty: the baseline)."""
        state = self.get(models)
        window, state.refit = state.refit, ()
        if window:
            state.refitting = True
            return window
        state.state = FITTING
        state.fitted_with = timelines
        state.attempts += 1
        return ()

    def fitted(self, job_id: str, models: Models, result: Calibration | BaseException) -> bool:
        """Take a fit; True if the models may now be planned (else they collect more, or failed).
        A fit again that misses keeps the model it would have replaced."""
        state = self.get(models)
        if state.refitting:
            state.refitting = False
            if isinstance(result, BaseException) or result.reason():
                why = f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else result.reason()
                log.warning("job %s: fitting %s again missed (%s); its model stays", job_id, model_names(models), why)
                return True
            before = state.calibration.reserve if state.calibration is not None else {}
            # Ten iterations of one window tell the host's noise less well than the baseline did:
            # each row keeps the larger reserve.
            reserve = {row: max(r, before.get(row, 0.0)) for row, r in result.reserve.items()}
            state.calibration = replace(result, reserve=reserve)
            state.fitted_compute_s = state.fitting_compute_s
            log.info("job %s: model fitted again (%s): %s", job_id, model_names(models), state.calibration.describe())
            return True
        if isinstance(result, BaseException):
            state.state, state.reason = FAILED, f"calibration failed: {type(result).__name__}: {result}"
            log.error("job %s: %s", job_id, state.reason, exc_info=result)
            return False
        state.calibration = result
        reason = result.reason()
        if not reason:
            state.state, state.reason = FITTED, ""
            state.fitted_compute_s = state.fitting_compute_s
            log.info("job %s: model calibrated (%s): %s", job_id, model_names(models), result.describe())
            return True
        if result.plannable:
            state.state = COLLECTING
            if state.attempts < MAX_ATTEMPTS:
                then = "fitting again on more iterations"
            else:
                then = f"no plan yet: fitting again on the next {fit_interval(state.attempts)} baseline iterations"
            state.reason = f"calibration attempt {state.attempts} missed ({reason}); {then}"
            # A miss on the full window is what a user must hear of (the job runs at maximum clocks).
            level = logging.INFO if state.attempts < MAX_ATTEMPTS else logging.WARNING
            log.log(
                level, "job %s: calibration attempt %d missed: %s; %s", job_id, state.attempts, result.describe(), then
            )
            return False
        state.state, state.reason = FAILED, reason
        log.warning("job %s: no plan: %s", job_id, reason)
        return False


def fit_interval(attempts: int) -> int:
    """New baseline iterations the next fit waits for after `attempts` fits (see MAX_ATTEMPTS)."""
    if attempts < MAX_ATTEMPTS:
        return MIN_ITERATIONS
    return MAX_TIMELINES * 2 ** (attempts - MAX_ATTEMPTS)


def profile_mismatch(
    calibration: Calibration,
    reference: tuple[tuple[float, float], ...],
    unreferenced: float = STALE_UNREFERENCED,
    cause: str = "the workload changed under the same job signature",
) -> str:
    """Why the profile a fit was made on no longer fits the workload its spans measured ("" when
    it does): some stage's spans against the profile's times at the top clock moved past
    STALE_TOLERANCE (and the two runs' spread) from `reference`, the fit of the run that
    measured the profile; with no reference, past `unreferenced` from the profile's times. `cause`
    ends the reason."""
    worst = []
    for fit in calibration.stages:
        if len(reference) == len(calibration.stages):
            expected, spread = reference[fit.stage]
            tolerance = max(STALE_TOLERANCE, STALE_SIGNIFICANCE * (spread + fit.span_spread))
            basis = f"{expected:.2f}x when the profile was measured"
        else:
            expected, tolerance, basis = 1.0, unreferenced, "a profile of this workload: about 1x"
        if expected > 0:
            change = fit.span_ratio / expected - 1.0
        else:  # spans of no length when the profile was measured
            change = math.inf if fit.span_ratio > 0 else 0.0
        if abs(change) > tolerance:
            worst.append((abs(change), fit.stage, fit.span_ratio, basis))
    if not worst:
        return ""
    _, stage, ratio, basis = max(worst)
    return (
        f"the measured timeline no longer matches the job's profile: stage {stage}'s instructions take "
        f"{ratio:.2f}x the profile's time at the top clock ({basis}; {len(worst)} of {len(calibration.stages)} "
        f"stages moved): {cause}"
    )


def model_names(models: Models) -> str:
    """The pipeline's GPU models as logs and status name them: one name, or one per stage."""
    names = sorted(set(models))
    return names[0] if len(names) == 1 else "/".join(models)
