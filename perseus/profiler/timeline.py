"""What one GPU ran during profiling, and at which clock: the regression's other half.

The profiler records each instruction's span (as the GPU ran it, in host-clock time: see
perseus.devices.instruction_timer), each clock change with the instant it came into force (the
change call plus the GPU's switch latency: until then the old clock runs), and the ranges of
time it watched whole (from an iteration's first instruction to its last, and on to the next
one's first when that is profiled too). Within a range, time no
instruction covers is blocking time, except between two iterations: there the framework's own
GPU work (an optimizer step) adds one unknown energy per gap (the BETWEEN column). `segments()` cuts the
spans where the clock changed, so a span that straddles a change counts partly at each clock;
`clock_of(span)` is the clock a span ran at wholly, or None (its time then says nothing about
either clock).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

from perseus.profiler.energy_fit import Segment

#: (virtual stage, instruction kind): what a profile row describes.
Key = tuple[int, str]
#: The fit's column of the energy the GPU spends between two iterations (beyond blocking power).
BETWEEN: Hashable = "between"


@dataclass(frozen=True)
class Span:
    key: Key
    start: float
    end: float


class Timeline:
    """Spans, clock changes and watched ranges; see the module docstring."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.ranges: list[tuple[float, float]] = []  # see `watched`
        self.gaps: list[tuple[float, float]] = []  # between two watched iterations
        self._changes: list[tuple[float, int]] = []  # (in force from, MHz), in order

    def clock_change(self, in_force: float, frequency: int) -> None:
        """The clock becomes `frequency` at `in_force` (a later change supersedes one not yet in force)."""
        while self._changes and self._changes[-1][0] >= in_force:
            self._changes.pop()
        self._changes.append((in_force, int(frequency)))

    def span(self, key: Key, start: float, end: float) -> None:
        if end > start:
            self.spans.append(Span(key, start, end))

    def watched(self, start: float, end: float) -> None:
        """Everything the GPU did between `start` and `end` is in the spans (the rest is blocking)."""
        if end > start:
            self.ranges.append((start, end))

    def between(self, start: float, end: float) -> None:
        """The GPU went from one watched iteration (ended at `start`) to the next (from `end`)."""
        if end > start:
            self.gaps.append((start, end))
            self.ranges.append((start, end))

    def clock_at(self, instant: float) -> int | None:
        """The clock in force at `instant` (None before the first recorded change)."""
        i = bisect.bisect_right(self._changes, (instant, float("inf"))) - 1
        return self._changes[i][1] if i >= 0 else None

    def clock_of(self, span: Span) -> int | None:
        """The clock `span` ran at from start to end, or None if it changed meanwhile (or is unknown)."""
        f = self.clock_at(span.start)
        i = bisect.bisect_right(self._changes, (span.start, float("inf")))
        if i < len(self._changes) and self._changes[i][0] < span.end:
            return None
        return f

    def segments(self) -> list[Segment]:
        """Every span cut at clock changes, each piece in column (key, MHz); pieces at an unknown clock are left out."""
        out = []
        for s in self.spans:
            start = s.start
            i = bisect.bisect_right(self._changes, (start, float("inf")))
            f = self._changes[i - 1][1] if i > 0 else None
            while i < len(self._changes) and self._changes[i][0] < s.end:
                cut = self._changes[i][0]
                if f is not None:
                    out.append(Segment(start, cut, column(s.key, f)))
                start, f = cut, self._changes[i][1]
                i += 1
            if f is not None:
                out.append(Segment(start, s.end, column(s.key, f)))
        out.extend(Segment(a, b, BETWEEN, event=True) for a, b in self.gaps)
        return out

    def covered(self) -> list[tuple[float, float]]:
        """The watched ranges from the first clock change on (before it, the clock is unknown),
        adjacent ones joined."""
        if not self._changes:
            return []
        first = self._changes[0][0]
        out: list[tuple[float, float]] = []
        for a, b in sorted(self.ranges):
            if b <= first:
                continue
            a = max(a, first)
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        return out


def column(key: Key, frequency: int) -> Hashable:
    """The fit's column of instruction `key` at `frequency`."""
    return (key[0], key[1], int(frequency))
