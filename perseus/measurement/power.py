"""PowerMonitor: sample GPU power in the background; integrate it where there is no energy counter.

Samples live in a fixed-size ring buffer (oldest dropped first), so memory stays bounded however
long the job runs. Energy over an interval is the trapezoid integral of the samples, with power
interpolated linearly at the interval's ends (and held flat beyond the first and last sample).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from perseus.clock import Clock
from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, MeasurementError


class PowerMonitor:
    """Samples the power of `gpus` every `interval_s` seconds on a daemon thread.

    Timestamps come from `clock` (default: the first GPU's clock), the clock a Monitor uses, so
    windows and samples line up. `sample()` takes one sample now, from any thread; tests on a
    virtual clock call it directly instead of `start()`.
    """

    def __init__(
        self,
        gpus: Sequence[GPU],
        interval_s: float = 0.1,
        max_samples: int = 100_000,
        clock: Clock | None = None,
    ) -> None:
        if not gpus:
            raise ConfigError("PowerMonitor needs at least one GPU")
        if not interval_s > 0:
            raise ConfigError(f"PowerMonitor interval must be > 0 seconds, got {interval_s!r}")
        if max_samples < 2:
            raise ConfigError(f"PowerMonitor max_samples must be >= 2, got {max_samples!r}")
        self._gpus = list(gpus)
        self._power_fns = [g.power_mw for g in self._gpus]
        self._column = {g.index: i for i, g in enumerate(self._gpus)}
        self.interval_s = float(interval_s)
        self._clock = clock or self._gpus[0].clock
        self._times = np.empty(max_samples)
        self._watts = np.empty((max_samples, len(self._gpus)))
        self._next = 0  # slot the next sample goes to
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    @property
    def gpu_indices(self) -> list[int]:
        return list(self._column)

    def start(self) -> PowerMonitor:
        """Take a first sample, then keep sampling on a daemon thread until `stop()`."""
        if self._thread is not None:
            return self
        self.sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="perseus-power-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def __enter__(self) -> PowerMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.sample()
        except Exception as e:  # surfaced by the next energy_j/timeline call, not lost in a thread
            self._error = e

    def _check(self) -> None:
        if self._error is not None:
            raise MeasurementError(f"power sampling stopped: {self._error}") from self._error

    def sample(self) -> None:
        """Read every GPU's power now and store it (W)."""
        watts = [fn() / 1000.0 for fn in self._power_fns]
        with self._lock:
            t = self._clock.now()
            i = self._next
            self._times[i] = t
            self._watts[i] = watts
            self._next = (i + 1) % len(self._times)
            self._count = min(self._count + 1, len(self._times))

    def _ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the samples in time order."""
        with self._lock:
            n, head = self._count, self._next
            if n < len(self._times):
                return self._times[:n].copy(), self._watts[:n].copy()
            return np.roll(self._times, -head), np.roll(self._watts, -head, axis=0)

    def _column_of(self, gpu_index: int) -> int:
        try:
            return self._column[gpu_index]
        except KeyError:
            raise MeasurementError(
                f"GPU {gpu_index} is not sampled by this PowerMonitor (it samples {self.gpu_indices})"
            ) from None

    def energy_j(self, gpu_index: int, start: float, end: float) -> float:
        """Energy (J) GPU `gpu_index` drew between clock times `start` and `end`."""
        column = self._column_of(gpu_index)
        if end < start:
            raise MeasurementError(f"energy interval ends before it starts ({start} > {end})")
        self._check()
        times, watts = self._ordered()
        if len(times) == 0:
            raise MeasurementError("no power samples yet: call start() or sample() first")
        if times[0] > start:
            raise MeasurementError(
                f"power samples start at {times[0]:.3f}, after the interval's start {start:.3f} "
                f"(the ring buffer of {len(self._times)} samples has dropped older ones)"
            )
        power = watts[:, column]
        lo, hi = np.searchsorted(times, [start, end], side="right")
        t = np.concatenate(([start], times[lo:hi], [end]))
        p = np.concatenate(([np.interp(start, times, power)], power[lo:hi], [np.interp(end, times, power)]))
        return float(np.sum((p[1:] + p[:-1]) * np.diff(t)) / 2.0)

    def timeline(self, gpu_index: int | None = None) -> dict[int, list[tuple[float, float]]]:
        """Samples as {gpu_index: [(time, watts), ...]} in time order (one GPU or all)."""
        self._check()
        times, watts = self._ordered()
        indices = self.gpu_indices if gpu_index is None else [gpu_index]
        return {i: list(zip(times.tolist(), watts[:, self._column_of(i)].tolist())) for i in indices}
