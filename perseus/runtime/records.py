"""What a rank is given and what it gives back: the settings of its online profiling sweep, and
a record of each iteration it measured (passed to `PerseusRank(on_iteration=...)`)."""

from __future__ import annotations

from dataclasses import dataclass

from perseus.wire.phases import Phase


@dataclass(frozen=True)
class IterationRecord:
    """What one finished iteration measured on this rank."""

    iteration: int
    phase: Phase
    frequency: int | None  # the uniform clock (profiling), else None
    plan_version: int
    time_s: float
    energy_j: float
    compute_time_s: float | None = None  # to the end of the last instruction (see perseus.runtime.rank)


@dataclass(frozen=True)
class ProfilingSettings:
    """The online sweep; the planner service's job spec carries the same numbers."""

    warmup_iterations: int = 2
    iterations_per_frequency: int = 2
    frequencies: tuple[int, ...] | None = None  # default: every supported clock, highest first
    early_stop_rises: int = 3
