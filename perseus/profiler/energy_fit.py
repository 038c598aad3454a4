"""Power per (instruction, clock) from energy-counter windows: weighted least squares.

A real GPU's energy counter advances in steps (every 100 ms on NVIDIA parts), so the energy of
one 5-60 ms instruction cannot be read around it. But each step of the counter is an exact
integral of power over the interval between two updates, and those instants are known to within
the sampler's polling interval (perseus.profiler.sampler). Over that interval the GPU ran a
known mix of instructions, each at a known clock, and waited between them (the timeline, from
synchronised per-instruction timing and the clock changes: perseus.profiler.timeline). So each
window gives one linear equation

    energy = sum over columns c of power_c * (seconds of column c inside the window)

in the unknown powers of every (instruction key, clock) column plus the blocking (idle) power,
and many windows over many iterations give an overdetermined system, solved here by weighted
least squares. What the GPU does between two iterations (an optimizer step, say) is unknown but
alike every time: each such gap is idle time plus one unknown energy spread over the gap (an
"event" segment, whose column counts the share of the gap inside the window). A window's
weight is the inverse of its expected error: the uncertainty of its two update instants times
the power there, plus a floor.

The standard error of each power comes from the residuals (s^2 (A'WA)^-1). A column the windows
cannot tell apart from the others (say, two kinds that always ran in the same proportion at one
clock) has a large standard error: the caller profiles longer there.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

#: The blocking (idle) power's column.
IDLE: Hashable = "idle"
#: Relative error of a window's energy beyond its update instants' uncertainty (the floor of the weights).
WINDOW_FLOOR = 1e-3


@dataclass(frozen=True)
class Window:
    """The counter advanced by `energy_j` between `start` and `end`; `uncertainty_s` is the
    half-width of each end's bracket (the counter updated within that of each instant)."""

    start: float
    end: float
    energy_j: float
    uncertainty_s: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Segment:
    """The GPU ran column `column` (an instruction key at a clock) from `start` to `end`. An
    `event` segment is blocking time plus one unknown energy (its column's "power" is joules
    per event) spread evenly over it."""

    start: float
    end: float
    column: Hashable
    event: bool = False


@dataclass(frozen=True)
class PowerFit:
    """Fitted power (W) and its standard error per column; `idle` holds the blocking power."""

    power_w: dict[Hashable, float]
    stderr_w: dict[Hashable, float]
    windows: int
    rms_residual_j: float

    def relative_error(self, column: Hashable) -> float:
        """Standard error over the value (inf when the column is not identified)."""
        p, e = self.power_w.get(column), self.stderr_w.get(column)
        if p is None or e is None or not p > 0 or not math.isfinite(e):
            return math.inf
        return e / p


def design_matrix(
    windows: Sequence[Window], segments: Sequence[Segment], covered: Sequence[tuple[float, float]]
) -> tuple[np.ndarray, list[Hashable], list[int]]:
    """(A, columns, rows): A[i, j] is the seconds of column j inside window rows[i].

    Only windows wholly inside one of `covered`'s (start, end) ranges are kept: there the
    timeline is complete, and any time no segment covers is blocking time (the IDLE column).
    Segments must not overlap.
    """
    segs = sorted(segments, key=lambda s: s.start)
    starts = [s.start for s in segs]
    ranges = sorted(covered)
    range_starts = [r[0] for r in ranges]
    columns: dict[Hashable, int] = {IDLE: 0}
    for s in segs:
        columns.setdefault(s.column, len(columns))
    rows: list[int] = []
    data: list[np.ndarray] = []
    for i, w in enumerate(windows):
        k = bisect.bisect_right(range_starts, w.start) - 1
        if k < 0 or w.end > ranges[k][1] or not w.end > w.start:
            continue
        row = np.zeros(len(columns))
        busy = 0.0
        j = max(0, bisect.bisect_right(starts, w.start) - 1)
        while j < len(segs) and segs[j].start < w.end:
            s = segs[j]
            overlap = min(s.end, w.end) - max(s.start, w.start)
            if overlap > 0 and s.event:
                row[columns[s.column]] += overlap / (s.end - s.start)
            elif overlap > 0:
                row[columns[s.column]] += overlap
                busy += overlap
            j += 1
        row[0] = max(0.0, (w.end - w.start) - busy)
        rows.append(i)
        data.append(row)
    matrix = np.array(data).reshape(len(data), len(columns))
    return matrix, list(columns), rows


def fit_powers(
    windows: Sequence[Window], segments: Sequence[Segment], covered: Sequence[tuple[float, float]]
) -> PowerFit:
    """Least-squares power of every column seen in `segments`, plus IDLE (see the module docstring)."""
    a, columns, rows = design_matrix(windows, segments, covered)
    n, p = a.shape
    if n == 0:
        return PowerFit({}, {}, 0, math.nan)
    used = [windows[i] for i in rows]
    y = np.array([w.energy_j for w in used])
    length = np.array([w.end - w.start for w in used])
    mean_power = np.maximum(y / length, 0.0)
    edge = np.hypot(*np.array([w.uncertainty_s for w in used]).T) / math.sqrt(3.0)  # uniform brackets
    sigma = np.hypot(mean_power * edge, WINDOW_FLOOR * np.maximum(y, 1e-9))
    weights = 1.0 / sigma
    aw, yw = a * weights[:, None], y * weights
    seen = a.sum(axis=0) > 0
    x = np.full(p, math.nan)
    err = np.full(p, math.inf)
    sub = aw[:, seen]
    sol, _, rank, _ = np.linalg.lstsq(sub, yw, rcond=None)
    x[seen] = sol
    resid = yw - sub @ sol
    raw_resid = y - a[:, seen] @ sol
    dof = n - int(seen.sum())
    if rank == int(seen.sum()) and dof > 0:
        s2 = float(resid @ resid) / dof
        # The residual scale can only widen the prior errors, not shrink them below the weights' own.
        cov = np.linalg.inv(sub.T @ sub) * max(s2, 1.0)
        err[seen] = np.sqrt(np.maximum(np.diag(cov), 0.0))
    power = {c: float(x[j]) for j, c in enumerate(columns) if seen[j]}
    stderr = {c: float(err[j]) for j, c in enumerate(columns) if seen[j]}
    rms = float(np.sqrt(np.mean(raw_resid**2)))
    return PowerFit(power, stderr, n, rms)
