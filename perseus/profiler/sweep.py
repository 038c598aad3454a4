"""The profiling sweep as a rank walks it: which of the service's steps to run next, and when to stop.

The planner service designs the sweep (perseus.service.sweep) and sends it in every table of a
rank still profiling: `SweepPlan.steps`, each one iteration's clock per instruction kind, in
blocks of `steps_per_frequency` steps that profile one frequency of `frequencies` (highest
first). A rank never computes what a step runs; `Sweep` only chooses which step comes next:

- the blocks in order, highest frequency first, one step per iteration;
- after each block, the stage's energy per iteration at that frequency (from the fit over
  every window so far, perseus.profiler.energy_fit): once it has stayed above its minimum for
  `early_stop_rises` frequencies in a row, lower clocks would only cost more energy and time,
  and the main sweep stops. Above means by more than RISE_SIGMAS of the two points' relative
  errors: on a fine clock grid (15 MHz apart) neighbouring clocks differ by less than the
  counter's noise, and noise must not end the sweep near the top clock;
- then the blocks of frequencies whose energy is still uncertain (relative standard error over
  `target_error`) again, each at most `max_repeats` more times, and in all at most
  `max_extra_fraction` of the main sweep's steps: profiling longer where the counter windows
  have not yet told the kinds apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from perseus.exceptions import ConfigError

#: Relative standard error of a profile point's energy below which it needs no more profiling.
DEFAULT_TARGET_ERROR = 0.006
DEFAULT_MAX_REPEATS = 2
DEFAULT_MAX_EXTRA_FRACTION = 0.5
RISE_SIGMAS = 2.0  # a rise in energy counts toward the early stop past this many relative errors
RISE_ERROR_CAP = 0.05  # the relative error a rise is judged with where the fit cannot tell one (infinite)


@dataclass(frozen=True)
class SweepPlan:
    """What the service told a rank to sweep (see the module docstring). `steps[i]` maps each
    instruction kind to its clock (MHz) in step i; step i profiles `frequencies[i // steps_per_frequency]`."""

    frequencies: tuple[int, ...]
    steps_per_frequency: int
    steps: tuple[Mapping[str, int], ...]

    def __post_init__(self) -> None:
        if not self.frequencies or self.steps_per_frequency < 1:
            raise ConfigError("a sweep plan needs at least one frequency and one step per frequency")
        if len(self.steps) != len(self.frequencies) * self.steps_per_frequency:
            raise ConfigError(
                f"a sweep plan of {len(self.frequencies)} frequencies x {self.steps_per_frequency} steps has "
                f"{len(self.steps)} steps; the service and this rank disagree on the protocol (same release?)"
            )

    def block(self, k: int) -> range:
        """The step indices that profile frequencies[k]."""
        n = self.steps_per_frequency
        return range(k * n, (k + 1) * n)


class Sweep:
    """The pure walker over a `SweepPlan` for one stage; the profiler feeds it the fit's figures."""

    def __init__(
        self,
        stage: int,
        *,
        early_stop_rises: int = 3,
        target_error: float = DEFAULT_TARGET_ERROR,
        max_repeats: int = DEFAULT_MAX_REPEATS,
        max_extra_fraction: float = DEFAULT_MAX_EXTRA_FRACTION,
    ) -> None:
        if early_stop_rises < 1:
            raise ConfigError(f"early_stop_rises must be >= 1, got {early_stop_rises}")
        if not target_error > 0:
            raise ConfigError(f"the profiler's target error must be > 0, got {target_error}")
        if max_repeats < 0 or max_extra_fraction < 0:
            raise ConfigError("max_repeats and max_extra_fraction must be >= 0")
        self.stage = stage
        self.early_stop_rises = early_stop_rises
        self.target_error = target_error
        self.max_repeats = max_repeats
        self.max_extra_fraction = max_extra_fraction
        self.plan: SweepPlan | None = None
        self._queue: list[int] = []  # step indices still to run in the current block
        self._next_block = 0  # the main sweep's next block
        self._main_over = False
        self._main_steps = 0
        self._extra_steps = 0
        self._repeats: dict[int, int] = {}
        self._energy: dict[int, float] = {}  # J per iteration, per evaluated frequency
        self._rises = 0
        self._done = False
        self.steps_run = 0

    @property
    def done(self) -> bool:
        return self._done

    @property
    def profiled_frequencies(self) -> list[int]:
        """Frequencies whose block ran at least once, highest first."""
        if self.plan is None:
            return []
        return [f for f in self.plan.frequencies if f in self._energy]

    @property
    def repeats(self) -> int:
        """Blocks run (or running) again after the main sweep, where energy was still uncertain."""
        return sum(self._repeats.values())

    @property
    def frequency_count(self) -> tuple[int, bool]:
        """How many frequencies the sweep profiles, and whether that is known: the plan's count
        (an upper bound: the main sweep may stop early) until the main sweep is over, then the
        frequencies it profiled."""
        if self._main_over:
            return len(self._energy), True
        return (len(self.plan.frequencies) if self.plan is not None else 0), False

    def follow(self, plan: SweepPlan) -> None:
        """Take the service's plan (the same one every iteration; a new one restarts the walk)."""
        if plan != self.plan:
            if self.plan is not None:
                raise ConfigError(
                    f"stage {self.stage}: the service changed the sweep mid-way "
                    f"({len(self.plan.steps)} -> {len(plan.steps)} steps); profiling stops"
                )
            self.plan = plan

    def next_step(self) -> int | None:
        """The step index to run this iteration (None: the sweep is over, upload the profile)."""
        if self._done or self.plan is None:
            return None
        if not self._queue and not self._main_over:
            self._queue = list(self.plan.block(self._next_block))
        return self._queue[0] if self._queue else None

    def step_done(self, index: int) -> int | None:
        """Step `index` ran; the frequency index whose block this completed (time to evaluate it), else None."""
        if not self._queue or self._queue[0] != index:
            return None
        self._queue.pop(0)
        self.steps_run += 1
        if self._main_over:
            self._extra_steps += 1
        else:
            self._main_steps += 1
        if self._queue:
            return None
        assert self.plan is not None
        return index // self.plan.steps_per_frequency

    def evaluated(self, k: int, energy_j: float, errors: Mapping[int, float]) -> None:
        """The fit after block `k`: the stage's energy per iteration at frequencies[k], and every
        profiled frequency's relative error. Decides the early stop and the repeats."""
        assert self.plan is not None
        f = self.plan.frequencies[k]
        if not self._main_over:
            best = min(self._energy, key=self._energy.__getitem__, default=None)
            if best is None:
                self._rises = 0
            else:
                error = min(max(errors.get(f, 0.0), errors.get(best, 0.0)), RISE_ERROR_CAP)
                rose = energy_j > self._energy[best] * (1 + RISE_SIGMAS * error)
                self._rises = self._rises + 1 if rose else 0
            self._energy[f] = energy_j
            self._next_block = k + 1
            if self._rises >= self.early_stop_rises or self._next_block == len(self.plan.frequencies):
                self._main_over = True
        else:
            self._energy[f] = energy_j
        if self._main_over:
            self._queue = self._repeat(errors)
            self._done = not self._queue

    def _repeat(self, errors: Mapping[int, float]) -> list[int]:
        """The block of the most uncertain frequency still over target, if the bounds allow one."""
        assert self.plan is not None
        budget = self.max_extra_fraction * self._main_steps - self._extra_steps
        if budget < self.plan.steps_per_frequency:
            return []
        index = {f: k for k, f in enumerate(self.plan.frequencies)}
        worst = sorted(
            (
                (e, f)
                for f, e in errors.items()
                if f in self._energy and e > self.target_error and self._repeats.get(f, 0) < self.max_repeats
            ),
            reverse=True,
        )
        if not worst:
            return []
        f = worst[0][1]
        self._repeats[f] = self._repeats.get(f, 0) + 1
        return list(self.plan.block(index[f]))

    def iteration_energy(self) -> dict[int, float]:
        """Per evaluated frequency, the stage's energy per iteration (J) at the latest fit of it."""
        return dict(self._energy)
