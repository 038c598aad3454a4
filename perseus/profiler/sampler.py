"""Energy-counter sampling: when did the counter advance, and by how much.

NVML's total-energy counter advances in steps (every 100 ms on recent NVIDIA parts; see
perseus.devices.sim_realism). A step is an exact integral of power up to the update instant,
so the energy between two known update instants is exact, whatever ran in between. The
sampler polls the counter every `interval_s` (1-2 ms) while the profiler measures, and records
each change with the bracket it happened in: after the last read that still saw the old value,
no later than the read that saw the new one. `windows()` turns the record into
`perseus.profiler.energy_fit.Window`s.

A counter that updates on a regular grid (NVML's does) gives away its update instants far more
precisely than one bracket does: a line fitted through hundreds of brackets' midpoints puts
each instant within a few microseconds. Where every bracket contains its fitted grid instant,
those instants bound the windows; otherwise (an irregular counter) the brackets' midpoints do.

A counter that changes at (nearly) every read updates continuously, or faster than the
sampler polls: then a read's own instant is its update instant, and consecutive reads are
merged into windows of at least `MIN_CONTINUOUS_WINDOW_S` to keep the fit small.

On a real clock a daemon thread polls; on a `perseus.clock.VirtualClock` (tests, benchmarks)
the clock calls `poll` at every tick of its time, so what the sampler sees is exact and
repeatable.
"""

from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass

import numpy as np

from perseus.devices.gpu import GPU
from perseus.profiler.energy_fit import Window

logger = logging.getLogger(__name__)

#: Polling interval: well under any real counter's update period (100 ms on NVIDIA), and no
#: divisor of a round one, so that on a virtual clock the reads fall at every phase of the updates.
DEFAULT_INTERVAL_S = 0.0017
#: Shortest window made of a continuously updating counter's reads.
MIN_CONTINUOUS_WINDOW_S = 0.005


@dataclass(frozen=True)
class Change:
    """The counter read `energy_mj` from an instant in (`after`, `by`]; `read` is the instant
    of that read itself (the middle of the call)."""

    after: float
    by: float
    read: float
    energy_mj: float


class CounterSampler:
    """Polls one GPU's energy counter while started; see the module docstring."""

    def __init__(self, gpu: GPU, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.gpu = gpu
        self.interval_s = interval_s
        self._clock = gpu.clock
        self._lock = threading.Lock()
        self._changes: list[Change] = []
        self._last: tuple[float, float] | None = None  # (read instant, value) of the latest read
        self._polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticker = None
        self._failed = False

    @property
    def running(self) -> bool:
        return self._thread is not None or self._ticker is not None

    def start(self) -> None:
        """Start polling (idempotent)."""
        if self.running:
            return
        self._last = None
        self.poll()
        every = getattr(self._clock, "every", None)
        if every is not None:
            self._ticker = every(self.interval_s, self.poll)
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"perseus-counter-{self.gpu.index}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (idempotent); what was recorded stays."""
        if not self.running:
            return
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)
            self._thread = None
        self.poll()

    def poll(self) -> None:
        """Read the counter once; record a change."""
        try:
            t0 = self._clock.now()
            value = self.gpu.energy_mj()
            t1 = self._clock.now()
        except Exception as e:  # a counter that cannot be read leaves the fit without windows
            if not self._failed:
                self._failed = True
                logger.warning("%r: cannot read the energy counter for profiling (%s)", self.gpu, e)
            return
        read = 0.5 * (t0 + t1)
        with self._lock:
            self._polls += 1
            last = self._last
            if last is not None and value != last[1]:
                self._changes.append(Change(last[0], t1, read, value))
            if last is None or value != last[1] or read > last[0]:
                self._last = (read, value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def windows(self) -> list[Window]:
        """Energy windows between consecutive recorded changes, oldest first."""
        with self._lock:
            changes = list(self._changes)
            polls = self._polls
        if len(changes) < 2:
            return []
        if self._continuous(changes, polls):
            return _merged(changes)
        instants = _grid_instants(changes)
        if instants is None:
            instants = [(0.5 * (c.after + c.by), 0.5 * (c.by - c.after)) for c in changes]
        out = []
        for (a, ua), (b, ub), ca, cb in zip(instants, instants[1:], changes, changes[1:]):
            if b > a and cb.energy_mj >= ca.energy_mj:
                out.append(Window(a, b, (cb.energy_mj - ca.energy_mj) / 1000.0, (ua, ub)))
        return out

    def update_period_s(self) -> float | None:
        """The counter's update period as seen so far: its grid's where it has one, else the
        median time between changes (None before two)."""
        with self._lock:
            changes = list(self._changes)
        grid = _grid_instants(changes) if len(changes) >= 2 else None
        instants = [u for u, _ in grid] if grid is not None else [0.5 * (c.after + c.by) for c in changes]
        if len(instants) < 2:
            return None
        return statistics.median(b - a for a, b in zip(instants, instants[1:]))

    def clear_before(self, instant: float) -> None:
        """Forget changes before `instant` (keeping the last one, a window's start)."""
        with self._lock:
            keep = [i for i, c in enumerate(self._changes) if c.read >= instant]
            first = max(0, keep[0] - 1) if keep else max(0, len(self._changes) - 1)
            self._changes = self._changes[first:]

    def _continuous(self, changes: list[Change], polls: int) -> bool:
        """Whether the counter changed at most reads: then it updates at least as often as we poll."""
        return len(changes) >= 0.5 * polls


def _grid_instants(changes: list[Change]) -> list[tuple[float, float]] | None:
    """Each change's update instant and its uncertainty on a regular grid u_k = phase + k * period
    that passes through every bracket; None if none does (an irregular counter).

    Every bracket bounds the grid: after_k < phase + k * period <= by_k. For a given period the
    phase is bounded by all brackets at once, so the bounds close in as brackets at other
    phases accumulate; the period is the one, near the slope of a line through the brackets'
    midpoints, that leaves the phase the widest room (the middle of the feasible set)."""
    mids = np.array([0.5 * (c.after + c.by) for c in changes])
    after = np.array([c.after for c in changes]) - mids[0]
    by = np.array([c.by for c in changes]) - mids[0]
    widths = by - after
    if len(changes) < 8:
        return None
    period = float(np.median(np.diff(mids)))
    if not period > 2.0 * float(widths.max()):
        return None
    ticks = np.round((mids - mids[0]) / period)
    if len(np.unique(ticks)) != len(ticks):
        return None
    slope = float(np.polyfit(ticks, mids - mids[0], 1)[0])
    span = float(ticks[-1] - ticks[0]) or 1.0
    candidates = slope + np.linspace(-1.0, 1.0, 81) * float(widths.max()) / span
    low = (after[None, :] - candidates[:, None] * ticks[None, :]).max(axis=1)
    high = (by[None, :] - candidates[:, None] * ticks[None, :]).min(axis=1)
    best = int(np.argmax(high - low))
    tolerance = 1e-6 + 0.01 * float(np.median(widths))
    if low[best] > high[best] + tolerance:
        return None
    phase = mids[0] + 0.5 * (low[best] + high[best])
    uncertainty = max(0.5 * float(high[best] - low[best]), 1e-7)
    return [(float(phase + candidates[best] * k), uncertainty) for k in ticks]


def _merged(changes: list[Change]) -> list[Window]:
    """A continuously updating counter: windows between read instants, at least MIN_CONTINUOUS_WINDOW_S long."""
    out = []
    first = changes[0]
    for c in changes[1:]:
        if c.read - first.read >= MIN_CONTINUOUS_WINDOW_S:
            half = (first.by - first.read, c.by - c.read)
            out.append(Window(first.read, c.read, (c.energy_mj - first.energy_mj) / 1000.0, half))
            first = c
    return out
