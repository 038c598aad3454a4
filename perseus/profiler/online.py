"""Online profiling: each instruction's time and energy at each clock, from real training iterations.

Why not read the energy counter around each instruction: on a real GPU the counter advances in
steps (every 100 ms on NVIDIA parts), so around a 5-60 ms instruction it reads zero or one
whole step, and a clock change takes 10-30 ms to come into force, the old clock running
meanwhile (perseus.devices.sim_realism has the sources). So time and energy are measured apart:

- Time: each instruction's span as the GPU ran it, from the rank's instruction timer
  (perseus.devices.instruction_timer: timing events on a real GPU, resolved into host-clock
  instants once per iteration, so the host keeps issuing ahead; a synchronisation per
  instruction on a simulated one, exact there). A profile point's time is the median over the
  instructions that ran wholly at that clock. Before each instruction the controller's clock
  change is waited out (the change call plus the GPU's switch latency), so during profiling
  every instruction runs at its step's clock.
- Energy: a `CounterSampler` polls the counter every couple of milliseconds during profiling
  iterations and records when it advanced; each advance is the exact energy between two known
  instants. The `Timeline` says what ran in between, at which clock, and where the GPU was
  blocked. Least squares over all those windows (perseus.profiler.energy_fit) gives the power of
  every (stage, kind, clock) and the blocking power; a point's energy is its power times its time.
- Which clocks: the service's sweep plan (perseus.profiler.sweep). Its steps run the instruction
  kinds at different clocks (one kind at the new frequency, the others at the previous one), so
  every kind's power at every clock is tied to the rest through windows that mix them, not only
  through the few windows where one kind happens to dominate.

Measured on the simulator (tests/profiler/test_online_realistic.py, one rank of a 4-stage 1F1B
pipeline on a virtual clock): with a 100 ms counter and 10 ms switches (or the A100 preset's
10-30 ms), every point of the stage's profile within 0.7% of the simulator's ground truth in
energy for 5-60 ms instructions, and exact in time; exact in both on an ideal GPU. On the real
clock of one `perseus demo` run on a loaded machine: times +0.6% to +3.6% (host work and late
wake-ups inside the spans), energies within 4.6% (most within 2%).
The relative standard error of each point's energy is in the profile's meta
(`rel_error:<stage>:<kind>`: "MHz:error,..."); where it stays over `Sweep.target_error`, the
sweep repeats that frequency (bounded).

`OnlineProfiler` does the GPU reads; the fit and the walk over the sweep are pure.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence

from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, DeviceError
from perseus.profiler.energy_fit import IDLE, PowerFit, fit_powers
from perseus.profiler.profile import (
    SWITCH_LATENCIES_META,
    SWITCH_LATENCY_META,
    Profile,
    ProfilePoint,
    format_switch_latencies,
)
from perseus.profiler.sampler import CounterSampler
from perseus.profiler.sweep import Sweep, SweepPlan
from perseus.profiler.timeline import Key, Span, Timeline, column

logger = logging.getLogger(__name__)

#: Meta entries a profile keeps per key at most; past that, one per frequency (the worst key).
MAX_ERROR_KEYS = 48
#: Blocking power fitted with a larger relative error than this falls back to the power reading.
MAX_BLOCKING_ERROR = 0.2

#: A clock change as the profiler needs it: (in force from, MHz).
ClockChange = tuple[float, int]


class OnlineProfiler:
    """Measures one rank's instructions through the sweep; see the module docstring.

    `settle`: waits until the clock the controller was last asked for is in force and returns
    that change, (in force from, MHz), or None when the controller changes nothing (the rank
    then cannot profile). `latency`: the switch latency per target clock, recorded in the
    profile's meta for the planner. The rank calls `before_instruction` after asking the controller for
    the instruction's clock, and `end_iteration` with the iteration's instruction spans, timed by
    the GPU's instruction timer (perseus.devices.instruction_timer).
    """

    def __init__(
        self,
        gpu: GPU,
        sweep: Sweep,
        settle: Callable[[], ClockChange | None],
        latency: Callable[[int | None], float] | None = None,
    ) -> None:
        self.gpu = gpu
        self.sweep = sweep
        self._settle = settle
        self._latency = latency
        self.sampler = CounterSampler(gpu)
        self.timeline = Timeline()
        self._step: int | None = None
        self._previous_end: float | None = None  # the last instruction's end of the previous iteration, if profiled
        self._counts: Counter[Key] = Counter()  # instructions per key in the latest measured iteration
        self._last_change: ClockChange | None = None
        self._fit: PowerFit | None = None

    @property
    def done(self) -> bool:
        return self.sweep.done

    def begin_iteration(self, plan: SweepPlan) -> Mapping[str, int] | None:
        """Start a profiling iteration of `plan`: the clock per kind of the step it runs, or None
        when the sweep is over (the rank uploads `profile()`)."""
        self.sweep.follow(plan)
        self._step = self.sweep.next_step()
        if self._step is None:
            self.sampler.stop()
            return None
        self.sampler.start()
        return plan.steps[self._step]

    @property
    def step_index(self) -> int | None:
        """The sweep step this iteration runs (None when not profiling)."""
        return self._step

    def before_instruction(self) -> None:
        """The instruction's clock was asked for: wait until it is in force (so during profiling
        every instruction runs at its step's clock) and note when it came into force."""
        if self._step is None:
            return
        change = self._settle()
        if change is None:
            raise DeviceError(f"{self.gpu!r}: the controller cannot set clocks; nothing to profile")
        if change != self._last_change:
            self._last_change = change
            self.timeline.clock_change(*change)

    def end_iteration(self, spans: Sequence[Span]) -> bool:
        """Finish a profiling iteration whose instructions ran over `spans` (host-clock times, in
        the order they ran: the rank's instruction timer). True when this finished the sweep (time
        to upload `profile()`)."""
        step, self._step = self._step, None
        if step is None:
            return False
        for span in spans:
            self.timeline.span(span.key, span.start, span.end)
        if spans:
            first = spans[0].start
            if self._previous_end is not None:
                self.timeline.between(self._previous_end, first)
            self.timeline.watched(first, spans[-1].end)
            self._counts = Counter(span.key for span in spans)
        self._previous_end = spans[-1].end if spans else None
        block = self.sweep.step_done(step)
        if block is not None:
            fit = self.fit()
            assert self.sweep.plan is not None
            f = self.sweep.plan.frequencies[block]
            self.sweep.evaluated(block, self._stage_energy(fit, f), self._errors(fit))
        if self.sweep.done:
            self.sampler.stop()
        return self.sweep.done

    def stop(self) -> None:
        """Stop sampling (the rank left profiling, or closes)."""
        self._step = None
        self._previous_end = None
        self.sampler.stop()

    # The fit
    def fit(self) -> PowerFit:
        """Least squares over every window so far (see perseus.profiler.energy_fit)."""
        self._fit = fit_powers(self.sampler.windows(), self.timeline.segments(), self.timeline.covered())
        return self._fit

    def _times(self) -> dict[tuple[Key, int], list[float]]:
        times: dict[tuple[Key, int], list[float]] = defaultdict(list)
        for span in self.timeline.spans:
            f = self.timeline.clock_of(span)
            if f is not None:
                times[(span.key, f)].append(span.end - span.start)
        return times

    def _points(self, fit: PowerFit) -> dict[Key, dict[int, tuple[float, float, float]]]:
        """Per key, per clock: (time s, energy J, relative error of the energy)."""
        out: dict[Key, dict[int, tuple[float, float, float]]] = defaultdict(dict)
        for (key, f), durations in sorted(self._times().items()):
            col = column(key, f)
            power = fit.power_w.get(col)
            if power is None or not power > 0:
                continue
            t = statistics.median(durations)
            spread = statistics.stdev(durations) if len(durations) > 1 else 0.0
            time_error = 1.2533 * spread / math.sqrt(len(durations)) / t  # standard error of a median
            out[key][f] = (t, power * t, math.hypot(fit.relative_error(col), time_error))
        return out

    def _stage_energy(self, fit: PowerFit, frequency: int) -> float:
        """The stage's instruction energy per iteration at `frequency` (J); inf if not measured."""
        points = self._points(fit)
        total = 0.0
        for key, n in self._counts.items():
            point = points.get(key, {}).get(frequency)
            if point is None:
                return math.inf
            total += n * point[1]
        return total

    def _errors(self, fit: PowerFit) -> dict[int, float]:
        """Per profiled clock, the largest relative error over the stage's keys; infinite where a
        key has no point yet (its spans all straddled a clock change, or the fit could not tell
        its power): the sweep profiles that clock again first."""
        points = self._points(fit)
        worst: dict[int, float] = {}
        for per_clock in points.values():
            for f, (_, _, err) in per_clock.items():
                worst[f] = max(worst.get(f, 0.0), err)
        for f in self.sweep.profiled_frequencies:
            if any(f not in points.get(key, {}) for key in self._counts):
                worst[f] = math.inf
        return worst

    # Results
    def profile(self) -> Profile:
        """The stage's profile: every key at every clock the sweep profiled for all of them."""
        fit = self.fit()
        points = self._points(fit)
        if not self.timeline.spans:
            raise ConfigError(f"stage {self.sweep.stage}: no instruction was measured; nothing to profile")
        if not points:
            raise ConfigError(
                f"stage {self.sweep.stage}: no instruction was measured: {fit.windows} energy-counter windows fell "
                "within the profiled iterations (does the GPU run the instructions' work, and do iterations last "
                "longer than the counter's update period?)"
            )
        swept = set(self.sweep.profiled_frequencies)
        missing = [key for key in self._counts if key not in points]
        if missing:
            raise ConfigError(
                f"stage {self.sweep.stage}: {', '.join(f'{kind} of virtual stage {stage}' for stage, kind in missing)} "
                "measured at no clock (their spans all straddled a clock change, or the energy fit could not tell "
                "their power); profile longer (ProfilingSettings)"
            )
        imputed = _impute(points, swept)
        if imputed:
            logger.warning(
                "stage %d: %d profile points not measured (%s) are scaled from the same instruction's other clocks "
                "by the stage's other instructions",
                self.sweep.stage,
                len(imputed),
                ", ".join(f"{kind}@{f}" for (_, kind), f in imputed[:6]) + (", ..." if len(imputed) > 6 else ""),
            )
        common = set.intersection(*(set(per_clock) for per_clock in points.values())) & swept
        if not common:
            raise ConfigError(
                f"stage {self.sweep.stage}: no clock was profiled for every instruction kind; profile longer"
            )
        rows = {
            key: [ProfilePoint(f, per_clock[f][0], per_clock[f][1]) for f in sorted(common, reverse=True)]
            for key, per_clock in sorted(points.items())
        }
        meta = {
            "source": "online",
            "frequencies": ",".join(map(str, sorted(common, reverse=True))),
            "steps": str(self.sweep.steps_run),
            "windows": str(fit.windows),
        }
        period = self.sampler.update_period_s()
        if period is not None:
            meta["counter_update_s"] = f"{period:.4g}"
        if self._latency is not None:  # the planner keeps instructions shorter than this at one clock
            meta[SWITCH_LATENCY_META] = f"{max(self._latency(f) for f in [*common, None]):.4g}"
            meta[SWITCH_LATENCIES_META] = format_switch_latencies({f: self._latency(f) for f in common})
        meta.update(_error_meta(points, common))
        if imputed:
            meta["imputed"] = ",".join(f"{stage}:{kind}@{f}" for (stage, kind), f in imputed)
        blocking = self._blocking_power(fit)
        meta["blocking_rel_error"] = f"{fit.relative_error(IDLE):.3g}"
        return Profile(points=rows, blocking_power_w=blocking, meta=meta)

    def _blocking_power(self, fit: PowerFit) -> float:
        power = fit.power_w.get(IDLE)
        if power is not None and power > 0 and fit.relative_error(IDLE) <= MAX_BLOCKING_ERROR:
            return power
        self.gpu.synchronize()  # a failure here (a CUDA error) is the training's, not hidden
        try:
            reading = self.gpu.power_mw() / 1000.0
        except DeviceError as e:
            raise ConfigError(
                f"stage {self.sweep.stage}: the blocking power could not be fitted (too little time between "
                f"instructions) and the GPU's power cannot be read ({e}); set JobSpec.blocking_power_w"
            ) from None
        logger.warning(
            "stage %d: too little time between instructions to fit the blocking power; using the GPU's power "
            "reading (%.1f W)",
            self.sweep.stage,
            reading,
        )
        return reading


def _error_meta(points: Mapping[Key, Mapping[int, tuple[float, float, float]]], clocks: set[int]) -> dict[str, str]:
    """Relative errors of the points' energies, per key ("rel_error:<stage>:<kind>") or, past
    MAX_ERROR_KEYS keys, the worst per clock ("rel_error")."""

    def line(errors: Mapping[int, float]) -> str:
        return ",".join(f"{f}:{errors[f]:.2g}" for f in sorted(errors, reverse=True))

    if len(points) <= MAX_ERROR_KEYS:
        return {
            f"rel_error:{stage}:{kind}": line({f: p[2] for f, p in per_clock.items() if f in clocks})
            for (stage, kind), per_clock in sorted(points.items())
        }
    worst: dict[int, float] = {}
    for per_clock in points.values():
        for f, p in per_clock.items():
            if f in clocks:
                worst[f] = max(worst.get(f, 0.0), p[2])
    return {"rel_error": line(worst)}


__all__ = ["ClockChange", "OnlineProfiler", "Span", "Sweep", "SweepPlan"]


def _impute(points: dict[Key, dict[int, tuple[float, float, float]]], clocks: set[int]) -> list[tuple[Key, int]]:
    """Fill, in place, a key's point at a swept clock where it has none but the stage's other keys
    have one: the key's point at its nearest measured clock, scaled in time and energy by the
    median ratio of the other keys' points between the two clocks (a clock slows every kind of
    instruction of one stage much alike); its error is the sum of its sources'. The filled
    (key, clock) pairs, in order."""
    measured = {key: dict(per_clock) for key, per_clock in points.items()}
    filled: list[tuple[Key, int]] = []
    for key, own in sorted(measured.items()):
        for f in sorted(clocks - set(own), reverse=True):
            ref = min(own, key=lambda g: (abs(g - f), -g))
            others = [p for k, p in measured.items() if k != key and f in p and ref in p]
            if not others:
                continue
            time_ratio = statistics.median(p[f][0] / p[ref][0] for p in others)
            energy_ratio = statistics.median(p[f][1] / p[ref][1] for p in others)
            t, e, err = own[ref]
            points[key][f] = (t * time_ratio, e * energy_ratio, err + max(p[f][2] + p[ref][2] for p in others))
            filled.append((key, f))
    return filled
