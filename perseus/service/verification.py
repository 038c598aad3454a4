"""Verify every plan on measured time while it runs, and correct it.

A plan is a promise: the no-slowdown plan keeps the job's iteration time at maximum clocks, a
straggler-aware plan keeps the straggler's pace (its deadline, at that time's scale). Each
pipeline's measured iterations under its plan (from the plan's start, less the switch) are
checked in windows of `WINDOW`: the median against the target.

The job's own speed drifts (other work on the hosts, thermals): a baseline measured minutes
before the plan started is no fair target. So a plan is judged against a fresh reference: its
first window, any later window over the tolerance once the last reference is older than
`FRESH` iterations, and any window faster than the tolerance allows (no plan outruns maximum
clocks: its reference ran in a spike), sends the pipeline to maximum clocks for one window (`REFERENCE`),
whose median becomes the target, and the plan resumes (`RESUME`). Past the job's tolerance in
`PERSISTS` windows in a row (a busy host's passing stall is not the plan's doing), then once
more right after another reference (the host may have slowed while those windows ran), and that
window against the mean of the reference before it and one more after it (the host may slow
during the window itself: a drift over the three windows cancels) -- each past what the
iterations' own spread lets two medians differ by by chance (`noise_floor`: on a quiet host the
tolerance decides, on a loaded one the noise) -- the service warns once and re-plans with a
margin: every instruction the plan slows is modelled
that much slower (`margin`, grown by twice the excess each time), which tightens the plan by
the excess it showed while keeping maximum clocks feasible. That excess is the least of the
windows that ran over on the way (`Verdict.sustained`): the plan's own excess shows in each of
them, a spike of other work in one only, and a margin sized on a spike costs the whole saving
(a smaller one that still runs over is grown at the next re-plan). Margins only grow (hysteresis: no
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
#: Measured iterations after a reference window during which no other is taken.
FRESH = 6 * WINDOW
#: Reference windows per pipeline and run at most: each runs a window at maximum clocks and
#: switches twice; past them, windows are judged against the last reference (or the baseline).
MAX_REFERENCES = 6

VERIFYING = "verifying"
HOLDS = "holds"
REPLANNING = "replanning"
FALLBACK = "fallback"
REFERENCE = "reference"  # a window at maximum clocks: the fresh target
RESUME = "resume"  # the verdict that ends a reference window: the plan runs again


@dataclass(frozen=True)
class Verdict:
    """What a full window showed: the excess over the target, and what to do."""

    action: str  # HOLDS, REPLANNING, FALLBACK, REFERENCE or RESUME
    excess: float
    measured_s: float
    target_s: float
    reason: str = ""
    sustained: float | None = None  # a re-plan's: the least excess of the windows that ran over

    @property
    def margin_excess(self) -> float:
        """The excess a re-plan's margin is sized on."""
        return self.excess if self.sustained is None else self.sustained


class PlanCheck:
    """The check of one pipeline's plans."""

    def __init__(self, tolerance: float = TOLERANCE) -> None:
        self.tolerance = tolerance
        self.state = ""
        self.before_reference = ""  # the state a reference window interrupted
        self.version = 0
        self.start = 0
        self.baseline_target_s: float | None = None  # the target at the measured baseline's speed
        self.scale = 1.0  # the target over the time at maximum clocks (a straggler's pace: above 1)
        self.target_s: float | None = None
        self.window: list[float] = []
        self.replans = 0
        self.excess: float | None = None
        self.measured_s: float | None = None
        self.reason = ""
        self.warned_fallback = False
        self.over = 0  # windows in a row over the tolerance
        self.overs: list[float] = []  # their excesses, through the reference windows that confirm them
        self.noise = 0.0  # the excess the baseline's spread alone may show (see noise_floor)
        self.reference_s: float | None = None  # the latest reference window's median
        self.reference_noise = 0.0  # its noise_floor against one window
        self.reference_end = 0  # `measured` when it ended
        self.measured = 0  # iterations measured (from any plan)
        self.references = 0
        self.awaiting = False  # a reference was asked for (or ended): no window until the switch
        self.confirming = False  # windows over the target asked for a reference: the next one over is suspect
        self.suspect: tuple[float, float] | None = None  # (median, reference before) of a suspect window

    def plan_started(
        self,
        version: int,
        start_iteration: int,
        target_s: float | None,
        fallback: bool,
        noise: float = 0.0,
        scale: float = 1.0,
        reference: bool = False,
    ) -> None:
        """A new plan (version) runs from `start_iteration`; its iterations should take `target_s`
        at the baseline's speed (None: unknown, nothing is checked), `scale` times the time at
        maximum clocks; `noise`: see `noise_floor`. `reference`: the plan is the reference window
        this check asked for (maximum clocks)."""
        self.version, self.start, self.noise, self.scale = version, start_iteration, noise, scale
        self.baseline_target_s = target_s
        self.window = []
        self.measured_s = self.excess = None  # the previous plan's window says nothing of this one
        self.over = 0
        self.awaiting = False
        if reference:
            if self.state != REFERENCE:
                self.before_reference = self.state
            self.state = REFERENCE
            return
        self.suspect = None  # another plan: the suspect window's reference never came
        if not self.confirming:
            self.overs = []
        self.target_s = self._target()
        if fallback:
            self.state = FALLBACK
        elif target_s is not None:
            self.state = VERIFYING

    def clocks_kept(self) -> None:
        """The re-plan this check asked for sets the clocks already in force (its margin changed
        none): no new plan starts, so the check goes on verifying them, and its status says so."""
        if self.state == REPLANNING:
            self.state = VERIFYING
            self.reason += "; the re-plan keeps the clocks in force: verifying them on"

    def pending(self) -> str:
        """What a plan that holds awaits after a window over its target, else "": the state is the
        last verdict, `measured_s` the last window, and an outsider read "holds" beside +3.9%."""
        if self.state != HOLDS or not self.over or self.excess is None:
            return ""
        return (
            f"its last window ran {100 * self.excess:+.1f}% over its target ({self.over} in a row; {PERSISTS} start a "
            "check at maximum clocks): it holds on the verdict before"
        )

    def shown(self, ended: bool) -> tuple[str, str]:
        """The state and a note for status; `ended`: every rank closed. A reference window the job
        ended in never ends: the verdict before it stands (an outsider read `reference` for good)."""
        if ended and self.state == REFERENCE:
            return self.before_reference or VERIFYING, "the job ended in a reference window: the verdict before stands"
        return self.state, ""

    def resume_reference(self, reference_s: float, noise: float) -> None:
        """The latest reference before the service restarted: the target (and its status) from it,
        stale, so the next window still takes a fresh reference before any plan is judged (the
        host's speed since is unknown)."""
        self.reference_s, self.reference_noise = reference_s, noise
        self.reference_end = self.measured - FRESH - 1
        self.target_s = self._target()

    def _target(self) -> float | None:
        """The target: the latest reference's median at the plan's scale, else the baseline's."""
        if self.reference_s is not None and self.baseline_target_s is not None:
            return self.reference_s * self.scale
        return self.baseline_target_s

    def add(self, iteration: int, time_s: float) -> Verdict | None:
        """One measured iteration of the pipeline; a verdict once a window is full."""
        self.measured += 1
        if not self.state or self.awaiting or self.baseline_target_s is None or iteration < self.start + SKIP:
            return None
        self.window.append(time_s)
        if len(self.window) < WINDOW:
            return None
        window, self.window = self.window, []
        measured = statistics.median(window)
        if self.state == REFERENCE:
            return self._referenced(window, measured)
        target = self._target()
        assert target is not None  # baseline_target_s is set
        self.target_s, self.measured_s = target, measured
        self.excess = measured / target - 1.0
        if self.state == FALLBACK:
            if self.excess > self.tolerance and not self.warned_fallback:
                self.warned_fallback = True
                return Verdict(
                    FALLBACK,
                    self.excess,
                    measured,
                    target,
                    f"even at maximum clocks the pipeline takes {100 * self.excess:+.1f}% over its baseline: the job "
                    "itself slowed (throttled GPUs, contention), not its plan",
                )
            return None
        noise = self.noise if self.reference_s is None else self.reference_noise
        over = self.excess > max(self.tolerance, noise)
        # A plan cannot run faster than maximum clocks: a window that does ran against a reference
        # taken while the host was slow (a spike), which would let a slow plan pass for good. A
        # straggler-aware plan's target is the straggler's pace, above maximum clocks (`scale`):
        # running between the two only saves less than it could.
        under = measured / (target / self.scale) - 1.0 < -max(self.tolerance, noise)
        stale = self.reference_s is None or self.measured - self.reference_end > FRESH or under
        if stale and self.references < MAX_REFERENCES and (over or under or self.state == VERIFYING):
            self.references += 1
            self.awaiting = True
            self.over = 0
            self.overs = []  # against a stale target
            when = "before the plan" if self.reference_s is None else "on a slower host" if under else "a while ago"
            return Verdict(
                REFERENCE,
                self.excess,
                measured,
                target,
                f"plan v{self.version} runs {100 * self.excess:+.1f}% against a target measured {when}: one "
                "window at maximum clocks measures a fresh one",
            )
        if not over:
            self.over, self.confirming, self.overs = 0, False, []
            if self.state == HOLDS:
                return None  # said once per plan
            self.state = HOLDS
            return Verdict(HOLDS, self.excess, measured, target)
        self.over += 1
        self.overs.append(self.excess)
        if self.over < (1 if self.confirming else PERSISTS):
            return None
        if not self.confirming and self.references < MAX_REFERENCES:
            # The host may have slowed while those windows ran (a burst of other work, a
            # checkpoint): one more reference, taken after them, and one more window decide.
            self.references += 1
            self.awaiting = True
            self.confirming = True
            self.over = 0
            return Verdict(
                REFERENCE,
                self.excess,
                measured,
                target,
                f"plan v{self.version} ran {100 * self.excess:+.2f}% over its target {PERSISTS} windows in a row: "
                "one window at maximum clocks checks that the host did not slow meanwhile",
            )
        if self.confirming and self.references < MAX_REFERENCES and self.reference_s is not None:
            # The host may have slowed during this very window: a reference after it decides.
            self.references += 1
            self.awaiting = True
            self.confirming = False
            self.over = 0
            self.suspect = (measured, self.reference_s)
            return Verdict(
                REFERENCE,
                self.excess,
                measured,
                target,
                f"plan v{self.version} ran {100 * self.excess:+.2f}% over a fresh target: one window at maximum "
                "clocks after it tells the plan's excess from a host that slowed meanwhile",
            )
        self.confirming = False
        noise_text = f", beyond the iterations' noise of {100 * noise:.1f}%" if noise > self.tolerance else ""
        return self._correct(
            f"plan v{self.version} runs {100 * self.excess:+.1f}% over its target ({measured:.4f} s against "
            f"{target:.4f} s, median of {WINDOW} iterations, over the tolerance of "
            f"{100 * self.tolerance:.1f}%{noise_text} {self.over} windows in a row)",
            measured,
            target,
        )

    def _correct(self, what: str, measured: float, target: float) -> Verdict:
        """The plan runs over (`what`, with `self.excess`): re-plan, or fall back past the cap."""
        assert self.excess is not None
        sustained = min([*self.overs[:-1], self.excess]) if self.overs else self.excess
        self.overs = []
        if self.replans >= MAX_REPLANS:
            self.state = FALLBACK
            self.reason = f"{what}; after {self.replans} re-plans, falling back to maximum clocks"
            return Verdict(FALLBACK, self.excess, measured, target, self.reason)
        self.replans += 1
        self.over = 0
        self.state = REPLANNING
        self.reason = f"{what}; re-planning ({self.replans} of {MAX_REPLANS})"
        if sustained < self.excess:
            self.reason += f" with a margin for {100 * sustained:+.1f}%, the least of the windows that ran over"
        return Verdict(REPLANNING, self.excess, measured, target, self.reason, sustained)

    def _referenced(self, window: list[float], measured: float) -> Verdict:
        """A reference window is complete: its median is the target from now on. After a suspect
        window, that window against the mean of the references around it decides."""
        self.reference_s, self.reference_end = measured, self.measured
        spread = 1.4826 * statistics.median(abs(t - measured) for t in window) / measured if measured > 0 else 0.0
        self.reference_noise = noise_floor(spread, WINDOW)
        self.target_s = measured * self.scale
        self.awaiting = True
        reason = (
            f"maximum clocks now take {measured:.4f} s (median of {WINDOW} iterations): the plan's target from now on"
        )
        if self.suspect is not None:
            suspect_s, before_s = self.suspect
            self.suspect = None
            around = 0.5 * (before_s + measured) * self.scale
            self.measured_s, self.excess = suspect_s, suspect_s / around - 1.0
            if self.excess > max(self.tolerance, self.reference_noise):
                return self._correct(
                    f"plan v{self.version} runs {100 * self.excess:+.1f}% over its target ({suspect_s:.4f} s against "
                    f"{around:.4f} s, the mean of the references before and after it; the {PERSISTS} windows "
                    "before them ran over too)",
                    suspect_s,
                    around,
                )
            reason += f"; the plan ran {100 * self.excess:+.1f}% against the references around it: the host slowed"
        return Verdict(RESUME, 0.0, measured, self.target_s, reason)


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
