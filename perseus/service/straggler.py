"""Straggler detection: which data-parallel pipeline is persistently slower than the others.

Pure (no clocks, no I/O): the job feeds one value per pipeline and iteration, the pipeline's
measured iteration time expressed at its no-slowdown plan (measured time / time the plan in
force predicts x the no-slowdown plan's time), so a pipeline slowed on purpose to a straggler's
pace does not look slow itself. A pipeline is a straggler when the (low) median of its recent values
exceeds the median of the other pipelines' medians by more than `threshold`; it recovers when
that excess falls below `threshold / 2` (hysteresis, so noise near the threshold cannot flap
the plans). Medians make single slow iterations (a checkpoint, a hiccup) invisible.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from perseus.exceptions import ConfigError


@dataclass(frozen=True)
class Straggler:
    """Pipeline `pipeline` takes `factor` times the others' (median) iteration time."""

    pipeline: int
    factor: float


class StragglerDetector:
    """Median over the last `window` values per pipeline, decided once `min_samples` are in."""

    def __init__(self, num_pipelines: int, *, window: int = 8, min_samples: int = 5, threshold: float = 0.05) -> None:
        if num_pipelines < 1:
            raise ConfigError(f"num_pipelines must be at least 1, got {num_pipelines}")
        if not 1 <= min_samples <= window:
            raise ConfigError(f"need 1 <= min_samples <= window, got min_samples={min_samples}, window={window}")
        if not 0 < threshold < 10:
            raise ConfigError(f"threshold must be a fraction in (0, 10) (0.05: 5% slower), got {threshold}")
        self.num_pipelines = num_pipelines
        self.window = window
        self.min_samples = min_samples
        self.threshold = threshold
        self._values: list[deque[float]] = [deque(maxlen=window) for _ in range(num_pipelines)]
        self.current: Straggler | None = None

    def add(self, pipeline: int, value: float) -> None:
        """One iteration's value (seconds, or any positive measure where larger is slower)."""
        if not 0 <= pipeline < self.num_pipelines:
            raise ConfigError(f"pipeline {pipeline} is outside 0..{self.num_pipelines - 1}")
        if not value > 0:
            raise ConfigError(f"an iteration value must be positive, got {value}")
        self._values[pipeline].append(float(value))

    def medians(self) -> dict[int, float]:
        """Median of each pipeline with enough recent values."""
        # The low median is always a measured value: a step change (a straggler recovering)
        # flips it at once, instead of passing through the mean of two values that never ran.
        return {k: statistics.median_low(v) for k, v in enumerate(self._values) if len(v) >= self.min_samples}

    def update(self) -> Straggler | None:
        """Decide with the values so far; returns (and keeps in `current`) the straggler or None.
        A straggler's factor is only revised when it moves by more than `threshold` (each
        revision re-plans the other pipelines: iteration noise of a few percent must not)."""
        medians = self.medians()
        if len(medians) < 2:
            return self.current
        slowest = max(medians, key=lambda k: (medians[k], -k))
        others = statistics.median(m for k, m in medians.items() if k != slowest)
        factor = medians[slowest] / others
        current = self.current
        if current is not None and current.pipeline == slowest:
            if factor < 1 + self.threshold / 2:
                self.current = None
            elif abs(factor / current.factor - 1) > self.threshold:
                self.current = Straggler(slowest, factor)
        elif factor > 1 + self.threshold:
            self.current = Straggler(slowest, factor)
        elif current is not None and factor < 1 + self.threshold / 2:
            self.current = None
        return self.current
