"""Verify every plan on measured time while it runs, and correct it.

A plan is a promise: the no-slowdown plan keeps the measured baseline iteration time, a
straggler-aware plan keeps the straggler's pace (its deadline, at the baseline's scale). Each
pipeline's measured iterations under its plan (from the plan's start, less the switch) are
checked in windows of `WINDOW`: the median against the target. Past the job's tolerance in
`PERSISTS` windows in a row (a busy host's passing stall is not the plan's doing) -- and past
what the baseline's own spread lets two medians differ by by chance (`noise_floor`: on a quiet
host the tolerance decides, on a loaded one the noise) -- the service warns once and re-plans
with a margin: every instruction the plan slows is modelled
that much slower (`margin`, grown by twice the excess each time), which tightens the plan by
the excess it showed while keeping maximum clocks feasible. Margins only grow (hysteresis: no
oscillation between plans) and at most `MAX_REPLANS` re-plans are made; if the plan still runs
over, the pipeline falls back to maximum clocks, with a warning and the reason in its status.

Pure: the job feeds measured iterations and plan changes, and acts on the verdicts.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: The default tolerance: a planned iteration may take this fraction longer than its target.
TOLERANCE = 0.01
#: Planned iterations whose median is checked against the target.
WINDOW = 10
#: Iterations at a plan's start left out: the switch to it, and the first iterations it runs
#: (every clock change then is a first one: slower on real and simulated GPUs alike).
SKIP = 3
#: Re-plans with a growing margin before a pipeline falls back to maximum clocks.
MAX_REPLANS = 3
#: Windows in a row over the tolerance before the plan is corrected.
PERSISTS = 2
#: Standard errors of the difference of two medians that an excess must reach to be the plan's.
SIGNIFICANCE = 2.0

VERIFYING = "verifying"
HOLDS = "holds"
REPLANNING = "replanning"
FALLBACK = "fallback"


@dataclass(frozen=True)
class Verdict:
    """What a full window showed: the excess over the target, and what to do."""

    action: str  # HOLDS, REPLANNING or FALLBACK
    excess: float
    measured_s: float
    target_s: float
    reason: str = ""


class PlanCheck:
    """The check of one pipeline's plans."""

    def __init__(self, tolerance: float = TOLERANCE) -> None:
        self.tolerance = tolerance
        self.state = ""
        self.version = 0
        self.start = 0
        self.target_s: float | None = None
        self.window: list[float] = []
        self.replans = 0
        self.excess: float | None = None
        self.measured_s: float | None = None
        self.reason = ""
        self.warned_fallback = False
        self.over = 0  # windows in a row over the tolerance
        self.noise = 0.0  # the excess the baseline's spread alone may show (see noise_floor)

    def plan_started(
        self, version: int, start_iteration: int, target_s: float | None, fallback: bool, noise: float = 0.0
    ) -> None:
        """A new plan (version) runs from `start_iteration`; its iterations should take `target_s`
        (None: unknown, nothing is checked); `noise`: see `noise_floor`."""
        self.version, self.start, self.target_s, self.noise = version, start_iteration, target_s, noise
        self.window = []
        self.measured_s = self.excess = None  # the previous plan's window says nothing of this one
        self.over = 0
        if fallback:
            self.state = FALLBACK
        elif target_s is not None:
            self.state = VERIFYING

    def add(self, iteration: int, time_s: float) -> Verdict | None:
        """One measured iteration of the pipeline; a verdict once a window is full."""
        if self.target_s is None or iteration < self.start + SKIP or not self.state:
            return None
        self.window.append(time_s)
        if len(self.window) < WINDOW:
            return None
        measured = statistics.median(self.window)
        self.window = []
        self.measured_s = measured
        self.excess = measured / self.target_s - 1.0
        if self.state == FALLBACK:
            if self.excess > self.tolerance and not self.warned_fallback:
                self.warned_fallback = True
                return Verdict(
                    FALLBACK,
                    self.excess,
                    measured,
                    self.target_s,
                    f"even at maximum clocks the pipeline takes {100 * self.excess:+.1f}% over its baseline: the job "
                    "itself slowed (throttled GPUs, contention), not its plan",
                )
            return None
        if self.excess <= max(self.tolerance, self.noise):
            self.over = 0
            if self.state == HOLDS:
                return None  # said once per plan
            self.state = HOLDS
            return Verdict(HOLDS, self.excess, measured, self.target_s)
        self.over += 1
        if self.over < PERSISTS:
            return None
        noise = f", beyond the baseline's noise of {100 * self.noise:.1f}%" if self.noise > self.tolerance else ""
        what = (
            f"plan v{self.version} runs {100 * self.excess:+.1f}% over its target ({measured:.4f} s against "
            f"{self.target_s:.4f} s, median of {WINDOW} iterations, over the tolerance of "
            f"{100 * self.tolerance:.1f}%{noise} {self.over} windows in a row)"
        )
        if self.replans >= MAX_REPLANS:
            self.state = FALLBACK
            self.reason = f"{what}; after {self.replans} re-plans, falling back to maximum clocks"
            return Verdict(FALLBACK, self.excess, measured, self.target_s, self.reason)
        self.replans += 1
        self.over = 0
        self.state = REPLANNING
        self.reason = f"{what}; re-planning ({self.replans} of {MAX_REPLANS})"
        return Verdict(REPLANNING, self.excess, measured, self.target_s, self.reason)


def grown_margin(margin: float, excess: float, tolerance: float) -> float:
    """The margin after a window ran `excess` over its target: grown by twice the excess (at
    least the tolerance), so that a few re-plans converge."""
    return margin + 2.0 * max(excess, tolerance)


def noise_floor(spread: float, baseline_iterations: int) -> float:
    """The excess a window's median may show over the baseline's by chance alone, when single
    iterations vary by `spread` (relative standard deviation) and the baseline median is of
    `baseline_iterations`: SIGNIFICANCE standard errors of the difference of the two medians."""
    if baseline_iterations < 1 or spread <= 0:
        return 0.0
    return SIGNIFICANCE * 1.2533 * spread * math.sqrt(1 / WINDOW + 1 / baseline_iterations)
