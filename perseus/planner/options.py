"""The frequency choices worth considering for one kind of instruction, and their convex hull.

A plan's energy is E = sum(e_i) + P_block * (N * T - sum(t_i)) = sum(c_i) + P_block * N * T with the
effective energy c_i = e_i - P_block * t_i. A choice that is both slower and costlier in (t, c) than
another is never useful, so only the Pareto set in (t, c) is kept. Its lower convex hull is the
tightest convex function below every choice: the LP relaxation that certifies the lower bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perseus.exceptions import PlanError
from perseus.profiler.profile import ProfilePoint


@dataclass(frozen=True)
class Options:
    """Pareto-optimal choices sorted by time ascending (so effective energy strictly descending).

    `hull` indexes the vertices of the lower convex hull (first and last choice included);
    `energy` is the measured energy, `cost` the effective energy e - P_block * t.
    """

    frequency: np.ndarray
    time: np.ndarray
    energy: np.ndarray
    cost: np.ndarray
    hull: np.ndarray

    def __len__(self) -> int:
        return len(self.time)

    def slowest_within(self, limit: float) -> int:
        """The cheapest choice that takes at most `limit` seconds (the fastest if none does)."""
        return max(int(np.searchsorted(self.time, limit, side="right")) - 1, 0)

    def prefix(self, count: int) -> Options:
        """The `count` fastest choices, with their own hull."""
        t, c = self.time[:count], self.cost[:count]
        return Options(self.frequency[:count], t, self.energy[:count], c, _lower_hull(t, c))

    def segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(length, slope) of each hull segment, fastest first; slopes increase (convexity)."""
        t, c = self.time[self.hull], self.cost[self.hull]
        dt = np.diff(t)
        return dt, np.diff(c) / dt


def pareto_options(points: Sequence[ProfilePoint], blocking_power_w: float, what: str = "instruction") -> Options:
    """Keep the choices that no other choice beats in both time and effective energy."""
    if not points:
        raise PlanError(f"the profile has no frequencies for {what}")
    freq = np.array([p.frequency for p in points], dtype=np.int64)
    time = np.array([p.time for p in points], dtype=float)
    energy = np.array([p.energy for p in points], dtype=float)
    cost = energy - blocking_power_w * time
    # Time ascending; ties broken by cost, then by higher frequency (deterministic).
    order = np.lexsort((-freq, cost, time))
    keep: list[int] = []
    best = np.inf
    for k in order:
        if cost[k] < best:
            keep.append(int(k))
            best = cost[k]
    idx = np.array(keep, dtype=np.int64)
    t, c = time[idx], cost[idx]
    return Options(freq[idx], t, energy[idx], c, _lower_hull(t, c))


def _lower_hull(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by t (Andrew's monotone chain)."""
    hull: list[int] = []
    for k in range(len(t)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # Drop b when it lies on or above the chord a -> k.
            if (t[b] - t[a]) * (c[k] - c[a]) - (c[b] - c[a]) * (t[k] - t[a]) <= 0:
                hull.pop()
            else:
                break
        hull.append(k)
    return np.array(hull, dtype=np.int64)
