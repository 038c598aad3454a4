"""When each instruction of an iteration began and ended on this rank, for the planner service.

The profile holds each instruction's GPU work; what the training loop does between instructions
(host work, waiting for a peer stage's activations or gradients) it does not. Until a plan runs,
the service asks the ranks (`Table.spans`) for the timelines of their baseline iterations
(default clocks, no profiling); `SpanRecorder` keeps one iteration's, as offsets from the rank's
own step start (clocks of different hosts never meet: the service uses the schedule's
dependencies), and `MAX_SPAN_REPORTS` bounds what one rank ever sends.

On a simulated GPU, iterations that ran no simulated work are a script that forgot to emulate its
model's GPU work: `WorkCheck` tells, from the energy counter.
"""

from __future__ import annotations

#: Iterations whose spans one rank sends at most, whatever the service asks.
MAX_SPAN_REPORTS = 512
#: Busy energy, as a fraction of idle energy over the same time, under which a GPU ran no work.
NO_WORK_FRACTION = 0.01


class SpanRecorder:
    """One iteration's instruction spans on this rank (seconds on the GPU's clock)."""

    def __init__(self, step_start_s: float, size: int) -> None:
        self.start = step_start_s
        self.size = size
        self.begins: list[float] = []
        self.ends: list[float] = []

    def begin(self, now: float) -> None:
        self.begins.append(now - self.start)

    def end(self, now: float) -> None:
        if len(self.ends) < len(self.begins):
            self.ends.append(now - self.start)

    @property
    def complete(self) -> bool:
        """Every instruction of the rank's schedule began and ended exactly once."""
        return len(self.begins) == len(self.ends) == self.size

    def offsets_us(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(begins, ends) in whole microseconds after the step began."""
        return tuple(round(t * 1e6) for t in self.begins), tuple(round(t * 1e6) for t in self.ends)


class WorkCheck:
    """Whether a simulated GPU's first iterations ran any work: their energy over idle power.

    Summed over iterations until they last `WINDOW_S` (energy counters may advance in steps of
    0.1 s, like NVML's), then decided once: `add` says True when the GPU ran no work."""

    WINDOW_S = 1.0
    MAX_ITERATIONS = 20

    def __init__(self, idle_w: float) -> None:
        self.idle_w = idle_w
        self.time_s = 0.0
        self.energy_j = 0.0
        self.iterations = 0
        self.done = False

    def add(self, time_s: float, energy_j: float) -> bool:
        """One more iteration (its time and energy); True once the window shows no work at all."""
        if self.done:
            return False
        self.time_s += time_s
        self.energy_j += energy_j
        self.iterations += 1
        if self.time_s < self.WINDOW_S and self.iterations < self.MAX_ITERATIONS:
            return False
        self.done = True
        return self.energy_j - self.idle_w * self.time_s <= NO_WORK_FRACTION * self.idle_w * self.time_s
