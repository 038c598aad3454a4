"""How far a job's ranks got: each rank's latest iteration, and the job's, kept safe from one
rank's wild number.

The job's latest iteration schedules when a new plan starts (a lead after it) and when the
next reference window runs, so one rank that sends an absurd iteration (a buggy client sending
its global step, or a timestamp; a forged report) must not move it: ranks of one job move in
lockstep (pipeline sends, gradient all-reduce), so an iteration far ahead of the median rank's
is no rank's real progress.
"""

from __future__ import annotations

import bisect

LEAD = 256  # how many iterations one rank may be ahead of the median rank's


class RankIterations:
    def __init__(self) -> None:
        self._latest: dict[int, int] = {}  # rank -> its latest iteration in this run
        self._sorted: list[int] = []  # the same values, sorted
        # The first rank this run that reported an iteration over LEAD before its latest:
        # (rank, latest, iteration). A rank restarted alone, or two trainings of one spec.
        self.went_back: tuple[int, int, int] | None = None

    def reset(self) -> None:
        """A new run: its ranks count from 0 again."""
        self._latest.clear()
        self._sorted.clear()
        self.went_back = None

    @property
    def median(self) -> int | None:
        """The median rank's latest iteration (the lower one of an even count); None before any."""
        return self._sorted[(len(self._sorted) - 1) // 2] if self._sorted else None

    def ahead(self, iteration: int) -> int:
        """How many iterations `iteration` is past what the median rank plus LEAD allows (0: plausible)."""
        median = self.median
        return 0 if median is None else max(0, iteration - median - LEAD)

    def note(self, rank: int, iteration: int) -> None:
        """`rank` reached `iteration` (an earlier one than it already reached changes nothing)."""
        old = self._latest.get(rank)
        if old is not None:
            if iteration <= old:
                if iteration < old - LEAD and self.went_back is None:
                    self.went_back = (rank, old, iteration)
                return
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._latest[rank] = iteration
        bisect.insort(self._sorted, iteration)

    @property
    def latest(self) -> int:
        """The latest iteration a rank reached within LEAD of the median rank's; -1 before any.
        A first report that went wild (nothing to compare it with yet) stops counting once
        the other ranks report."""
        median = self.median
        if median is None:
            return -1
        return self._sorted[bisect.bisect_right(self._sorted, median + LEAD) - 1]
