"""Online profiling: measure each instruction's time and energy during real training iterations.

The sweep (shared with the planner service's table, see docs of `Sweep.step_at`):
iterations [0, warmup) run at default clocks and are not measured; then frequency k (highest
first) runs for `iterations_per_frequency` iterations, the first of which is dropped as
warm-up when there are several. Each measured iteration contributes one sample per
instruction; a profile point is the median over samples. The sweep stops early once the
stage's energy per iteration has stayed above its minimum for `early_stop_rises` frequencies
in a row (lower clocks would only cost more energy and time).

`Sweep` is the pure core (feed it measurements, ask it what to run); `OnlineProfiler` adds the
GPU reads around each instruction.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, DeviceError
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.wire.phases import Phase

logger = logging.getLogger(__name__)

#: Gaps shorter than this between instructions are too noisy to estimate blocking power from.
MIN_BLOCKING_GAP_S = 1e-3


@dataclass(frozen=True)
class SweepStep:
    """What one iteration is for: `Phase.WARMUP`, `Phase.PROFILING` (at `frequency`), or
    `Phase.PLANNING` once the sweep is over (default clocks until a plan arrives)."""

    phase: Phase
    frequency: int | None  # None: default clocks
    measured: bool  # whether its instruction measurements count
    index: int = -1  # position of `frequency` in the sweep


class Sweep:
    """The pure core of online profiling for one stage."""

    def __init__(
        self,
        stage: int,
        frequencies: Sequence[int],
        *,
        warmup_iterations: int = 2,
        iterations_per_frequency: int = 2,
        early_stop_rises: int = 3,
    ) -> None:
        freqs = [int(f) for f in frequencies]
        if not freqs:
            raise ConfigError("the profiling sweep needs at least one frequency")
        if freqs != sorted(set(freqs), reverse=True):
            raise ConfigError(f"sweep frequencies must be distinct and highest first, got {freqs}")
        if warmup_iterations < 0:
            raise ConfigError(f"warmup_iterations must be >= 0, got {warmup_iterations}")
        if iterations_per_frequency < 1:
            raise ConfigError(f"iterations_per_frequency must be >= 1, got {iterations_per_frequency}")
        if early_stop_rises < 1:
            raise ConfigError(f"early_stop_rises must be >= 1, got {early_stop_rises}")
        self.stage = stage
        self.frequencies = tuple(freqs)
        self.warmup_iterations = warmup_iterations
        self.iterations_per_frequency = iterations_per_frequency
        self._dropped = 1 if iterations_per_frequency > 1 else 0  # warm-up iterations per frequency
        self.early_stop_rises = early_stop_rises
        # frequency -> (virtual stage, kind) -> [(time s, energy J)]
        self._samples: dict[int, dict[tuple[int, str], list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self._measured_iterations: dict[int, int] = defaultdict(int)
        self._blocking: list[float] = []  # W, one per long-enough gap
        self._energy: dict[int, float] = {}  # J per iteration, per completed frequency
        self._stopped_at: int | None = None  # sweep index past the last one profiled
        self._rises = 0
        self._current: SweepStep | None = None

    # The table
    def step_at(self, iteration: int) -> SweepStep:
        """What iteration `iteration` (0-based, counted from the job's first) runs and measures."""
        if iteration < self.warmup_iterations:
            return SweepStep(Phase.WARMUP, None, False)
        k, j = divmod(iteration - self.warmup_iterations, self.iterations_per_frequency)
        end = len(self.frequencies) if self._stopped_at is None else self._stopped_at
        if k >= end:
            return SweepStep(Phase.PLANNING, None, False)
        return SweepStep(Phase.PROFILING, self.frequencies[k], j >= self._dropped, k)

    @property
    def done(self) -> bool:
        """No more iterations to profile (finished or stopped early)."""
        return self._stopped_at is not None

    @property
    def profiled_frequencies(self) -> list[int]:
        """Frequencies with at least one measured iteration, highest first."""
        return [f for f in self.frequencies if self._measured_iterations.get(f)]

    # Feeding measurements
    def begin_iteration(self, iteration: int, frequency: int | None = None) -> SweepStep:
        """Start `iteration`. `frequency`: the clock it really runs at, when a service decides."""
        step = self.step_at(iteration)
        if frequency is not None and step.phase is Phase.PROFILING and frequency != step.frequency:
            raise ConfigError(
                f"stage {self.stage}: iteration {iteration} runs at {frequency} MHz but this rank's "
                f"sweep expects {step.frequency} MHz; rank and service disagree on the sweep settings"
            )
        self._current = step
        return step

    def record(self, kind: str, time_s: float, energy_j: float, stage: int | None = None) -> None:
        """One instruction of the current iteration; `stage`: its virtual stage when this rank
        holds several model chunks (default: this sweep's stage)."""
        step = self._current
        if step is None or not step.measured:
            return
        assert step.frequency is not None  # only profiling steps are measured, and they have a frequency
        key = (self.stage if stage is None else stage, str(kind))
        self._samples[step.frequency][key].append((time_s, energy_j))

    def record_gap(self, time_s: float, energy_j: float) -> None:
        """Time between two instructions, when the GPU waits on a peer (blocking power)."""
        step = self._current
        if step is None or not step.measured or time_s < MIN_BLOCKING_GAP_S:
            return
        self._blocking.append(energy_j / time_s)

    def end_iteration(self) -> bool:
        """Finish the current iteration. Returns True when this finished the sweep."""
        step, self._current = self._current, None
        if step is None or step.phase is not Phase.PROFILING or self.done:
            return False
        assert step.frequency is not None  # a profiling step has one (Sweep.step_at)
        if step.measured:
            self._measured_iterations[step.frequency] += 1
        if self._measured_iterations[step.frequency] < self.iterations_per_frequency - self._dropped:
            return False
        energy = self._iteration_energy(step.frequency)
        best = min(self._energy.values(), default=None)
        self._energy[step.frequency] = energy
        self._rises = self._rises + 1 if best is not None and energy > best else 0
        if self._rises >= self.early_stop_rises or step.index == len(self.frequencies) - 1:
            self._stopped_at = step.index + 1
            return True
        return False

    # Results
    def profile(self, fallback_blocking_power_w: float | None = None) -> Profile:
        """The stage's profile: per kind, the median time and energy at each profiled clock."""
        points: dict[tuple[int, str], list[ProfilePoint]] = defaultdict(list)
        for f in self.profiled_frequencies:
            for key, samples in sorted(self._samples[f].items()):
                t = statistics.median(s[0] for s in samples)
                e = statistics.median(s[1] for s in samples)
                points[key].append(ProfilePoint(f, t, e))
        if not points:
            raise ConfigError(f"stage {self.stage}: no instruction was measured; nothing to profile")
        if self._blocking:
            blocking = statistics.median(self._blocking)
        elif fallback_blocking_power_w is not None:
            blocking = fallback_blocking_power_w
        else:
            raise ConfigError(
                f"stage {self.stage}: no gap between instructions was long enough to measure "
                "blocking power; pass fallback_blocking_power_w"
            )
        meta = {
            "source": "online",
            "iterations_per_frequency": str(self.iterations_per_frequency),
            "frequencies": ",".join(map(str, self.profiled_frequencies)),
        }
        return Profile(points=dict(points), blocking_power_w=blocking, meta=meta)

    def iteration_energy(self) -> dict[int, float]:
        """Per completed frequency, the stage's instruction energy per iteration (J)."""
        return dict(self._energy)

    def _iteration_energy(self, frequency: int) -> float:
        n = self._measured_iterations[frequency]
        return sum(
            statistics.median(s[1] for s in samples) * len(samples) / n for samples in self._samples[frequency].values()
        )


class OnlineProfiler:
    """A `Sweep` fed from a GPU's energy counter, synchronising around each instruction."""

    def __init__(self, gpu: GPU, sweep: Sweep) -> None:
        self.gpu = gpu
        self.sweep = sweep
        self._clock = gpu.clock
        self._step: SweepStep | None = None
        self._begin: tuple[float, float] | None = None  # (time s, energy mJ) at instruction start
        self._last_end: tuple[float, float] | None = None

    def begin_iteration(self, iteration: int, frequency: int | None = None) -> SweepStep:
        self._step = self.sweep.begin_iteration(iteration, frequency)
        self._last_end = None
        return self._step

    @property
    def measuring(self) -> bool:
        return self._step is not None and self._step.measured

    def before_instruction(self) -> None:
        if not self.measuring:
            return
        now = self._read()
        if self._last_end is not None:
            self.sweep.record_gap(now[0] - self._last_end[0], (now[1] - self._last_end[1]) / 1000.0)
        self._begin = now

    def after_instruction(self, kind: str, stage: int | None = None) -> None:
        if not self.measuring or self._begin is None:
            return
        now = self._read()
        t0, e0 = self._begin
        self.sweep.record(kind, now[0] - t0, (now[1] - e0) / 1000.0, stage)
        self._begin = None
        self._last_end = now

    def end_iteration(self) -> bool:
        """True when this iteration finished the sweep (time to upload `profile()`)."""
        self._step = None
        self._begin = self._last_end = None
        return self.sweep.end_iteration()

    def profile(self) -> Profile:
        return self.sweep.profile(fallback_blocking_power_w=self._idle_power_w())

    def _read(self) -> tuple[float, float]:
        self.gpu.synchronize()
        return self._clock.now(), self.gpu.energy_mj()

    def _idle_power_w(self) -> float | None:
        """The GPU's power now, the fallback blocking power when no gap was long enough to
        measure it; None if the GPU cannot read its power (the profile then needs a measured gap)."""
        self.gpu.synchronize()  # a failure here (a CUDA error) is the training's, not hidden
        try:
            return self.gpu.power_mw() / 1000.0
        except DeviceError as e:
            logger.warning(
                "stage %d: cannot read the GPU's power for the fallback blocking power (%s)", self.sweep.stage, e
            )
            return None
