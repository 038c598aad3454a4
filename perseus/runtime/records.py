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
    # From the previous record's end to this one's (the first, and the first after a pause, from
    # its own start): a run's records add up to one energy counter difference (see perseus.runtime.rank).
    energy_j: float
    compute_time_s: float | None = None  # to the end of the last instruction (see perseus.runtime.rank)
    sweep_step: int | None = None  # the profiling sweep's step it ran (phase profiling)
    # Instructions that ran at a clock other than planned (phase planned, on a GPU that tells its
    # clock in force: see perseus.controller.controller); else None.
    off_clock: int | None = None


@dataclass(frozen=True)
class ProfilingSettings:
    """The online sweep, as rank 0 registers it with the planner service (which designs its steps:
    perseus.service.sweep). `iterations_per_frequency`: steps per frequency, one iteration each
    (the first runs every kind at the new frequency, the others mix kinds at it and at the previous
    one). `switch_latency_s`: how long a clock change takes to come into force on this GPU
    (default: see perseus.controller.latency)."""

    warmup_iterations: int = 2
    iterations_per_frequency: int = 3
    frequencies: tuple[int, ...] | None = None  # default: every supported clock, highest first
    early_stop_rises: int = 3
    switch_latency_s: float | None = None
