"""When each instruction of an iteration began and ended on this rank: for the online profiler
(profiling iterations) and the planner service (baseline iterations).

The profile holds each instruction's GPU work; what the training loop does between instructions
(host work, waiting for a peer stage's activations or gradients) it does not. Until a plan runs,
the service asks the ranks (`Table.spans`) for the timelines of their baseline iterations
(default clocks, no profiling), as offsets from the rank's own step start (clocks of different
hosts never meet: the service uses the schedule's dependencies), and `MAX_SPAN_REPORTS` bounds
what one rank ever sends.

`SpanRecorder` keeps one iteration's instructions as marks of the GPU's instruction timer
(perseus.devices.instruction_timer: no synchronisation per instruction where the GPU has timing
events), which the rank resolves into host-clock spans once the iteration ends.

On a simulated GPU, iterations that ran no simulated work are a script that forgot to emulate its
model's GPU work: `WorkCheck` tells, from the energy counter.
"""

from __future__ import annotations

from collections.abc import Sequence

from perseus.devices.instruction_timer import Mark
from perseus.profiler.timeline import Key, Span

#: Iterations whose spans one rank sends at most, whatever the service asks.
MAX_SPAN_REPORTS = 512
#: Busy energy, as a fraction of idle energy over the same time, under which a GPU ran no work.
NO_WORK_FRACTION = 0.01


class SpanRecorder:
    """One iteration's instructions on this rank, as (key, begin mark, end mark) of the instruction
    timer. An instruction begun again before it ended is counted but not kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.begun = 0
        self.marks: list[tuple[Key, Mark, Mark]] = []
        self._open: tuple[Key, Mark] | None = None

    def begin(self, key: Key, mark: Mark) -> None:
        self.begun += 1
        self._open = (key, mark)

    def end(self, mark: Mark) -> None:
        if self._open is not None:
            key, begin = self._open
            self.marks.append((key, begin, mark))
            self._open = None

    @property
    def complete(self) -> bool:
        """Every instruction of the rank's schedule began and ended exactly once."""
        return self.begun == len(self.marks) == self.size

    def spans(self, times: Sequence[float]) -> list[Span]:
        """The instructions' spans, given the timer's resolved `times` (host-clock seconds)."""
        return [Span(key, times[begin], times[end]) for key, begin, end in self.marks]


def offsets_us(spans: Sequence[Span], start_s: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(begins, ends) in whole microseconds after `start_s` (the step's start)."""
    return tuple(round((s.start - start_s) * 1e6) for s in spans), tuple(round((s.end - start_s) * 1e6) for s in spans)


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
