"""Measured iterations: per-rank reports summed once every rank has reported an iteration."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

ODD_TIME = 4.0  # a rank's iteration this many times the median rank's is no measurement to average
PENDING_LIMIT = 256  # iterations awaiting reports; older ones are dropped (a rank stopped reporting)
PENDING_REPORTS = 1 << 18  # reports held awaiting their iteration's last rank: bounds a large job's memory
COMPLETED_KEPT = 1024  # completed iterations remembered, so that a report sent again counts once


@dataclass(frozen=True)
class Measured:
    """One iteration of the whole job: the slowest rank's time, the sum of every rank's energy.
    `odd_rank`: a rank whose time is over ODD_TIME x the median rank's (ranks of a job wait for
    each other every iteration, so their times agree): a wrong or forged report, which the
    means leave out."""

    iteration: int
    time_s: float
    energy_j: float
    odd_rank: int | None = None


class Completed:
    """The keys (iterations) completed lately, a bounded number of them. A client sends a report
    again when the service did not answer it in time (busy, or the reply was lost): the copy of a
    report whose iteration already completed must not start it over, or count it twice."""

    def __init__(self, kept: int = COMPLETED_KEPT) -> None:
        self._order: deque[Hashable] = deque()
        self._keys: set[Hashable] = set()
        self._kept = kept

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def add(self, key: Hashable) -> None:
        if key in self._keys:
            return
        self._order.append(key)
        self._keys.add(key)
        if len(self._order) > self._kept:
            self._keys.discard(self._order.popleft())


class IterationTally:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._limit = max(2, min(PENDING_LIMIT, PENDING_REPORTS // world_size))
        self._pending: dict[int, dict[int, tuple[float, float, bool]]] = {}
        self._completed = Completed()

    def add(self, rank: int, iteration: int, time_s: float, energy_j: float, paces: bool = True) -> Measured | None:
        """Record one report; the iteration's total once its last rank reports (repeats overwrite;
        a repeat of a completed iteration is ignored). The iteration takes the slowest time of
        the ranks that pace it (`paces`; every rank where none does)."""
        if iteration in self._completed:
            return None
        ranks = self._pending.setdefault(iteration, {})
        ranks[rank] = (time_s, energy_j, paces)
        if len(ranks) == self.world_size:
            del self._pending[iteration]
            self._completed.add(iteration)
            pacing = [r for r, (_, _, p) in ranks.items() if p] or list(ranks)
            slowest = max(pacing, key=lambda r: ranks[r][0])
            time_s = ranks[slowest][0]
            median = statistics.median_low(t for t, _, _ in ranks.values())
            odd = slowest if time_s > ODD_TIME * median else None
            return Measured(iteration, time_s, sum(e for _, e, _ in ranks.values()), odd)
        if len(self._pending) > self._limit:
            del self._pending[min(self._pending)]
        return None


class Mean:
    """Running mean of measured iterations."""

    def __init__(self) -> None:
        self.count = 0
        self._time = 0.0
        self._energy = 0.0

    def add(self, m: Measured) -> None:
        self.count += 1
        self._time += m.time_s
        self._energy += m.energy_j

    def to_record(self) -> list[float]:
        return [self.count, self._time, self._energy]

    @classmethod
    def from_record(cls, doc: list[float]) -> Mean:
        """A mean as `to_record` saved it; ValueError for a malformed one."""
        count, time_s, energy_j = (float(v) for v in doc)
        if count < 0 or count != int(count) or not (math.isfinite(time_s) and math.isfinite(energy_j)):
            raise ValueError(f"not a saved mean: {doc!r}")
        mean = cls()
        mean.count, mean._time, mean._energy = int(count), time_s, energy_j
        return mean

    @property
    def time_s(self) -> float | None:
        return self._time / self.count if self.count else None

    @property
    def energy_j(self) -> float | None:
        return self._energy / self.count if self.count else None
