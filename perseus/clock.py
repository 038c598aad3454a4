"""Clocks: real wall time, or a virtual clock that makes simulated runs deterministic."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds from an arbitrary origin; never goes backwards."""

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass."""


class RealClock:
    """Monotonic wall time."""

    # The bare builtin, not a method wrapping it: hot paths (simulated energy counters, the
    # controller) read the clock on every call, and a Python call layer costs as much as the read.
    now = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class Ticker:
    """A callback a VirtualClock calls every `interval_s` of its time (see `VirtualClock.every`)."""

    def __init__(self, clock: VirtualClock, interval_s: float, callback: Callable[[], None], due: float) -> None:
        self.clock, self.interval_s, self.callback, self.due = clock, interval_s, callback, due

    def cancel(self) -> None:
        self.clock._cancel(self)


class VirtualClock:
    """Time that only moves when someone sleeps or advances it: tests run instantly and exactly.

    `every(interval, callback)` stands in for a background thread polling on a timer: as time
    advances, the clock stops at each due instant and calls the callback (in the advancing
    thread), so what a poller sees is exact and repeatable."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)
        self._lock = threading.Lock()
        self._tickers: list[Ticker] = []

    def now(self) -> float:
        with self._lock:
            return self._t

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance a clock by a negative time ({seconds} s)")
        left = float(seconds)
        while True:
            with self._lock:
                due = min((t.due for t in self._tickers), default=math.inf)
                if self._t + left < due:
                    self._t += left
                    return
                left -= max(0.0, due - self._t)
                self._t = max(self._t, due)
                fire = [t for t in self._tickers if t.due <= self._t]
                for t in fire:
                    t.due += t.interval_s
            for t in fire:
                t.callback()

    def every(self, interval_s: float, callback: Callable[[], None]) -> Ticker:
        """Call `callback` every `interval_s` seconds of this clock's time until `cancel()`ed."""
        if not interval_s > 0:
            raise ValueError(f"a ticker's interval must be positive, got {interval_s} s")
        with self._lock:
            ticker = Ticker(self, float(interval_s), callback, self._t + interval_s)
            self._tickers.append(ticker)
        return ticker

    def _cancel(self, ticker: Ticker) -> None:
        with self._lock:
            if ticker in self._tickers:
                self._tickers.remove(ticker)


REAL_CLOCK = RealClock()
