"""Clocks: real wall time, or a virtual clock that makes simulated runs deterministic."""

from __future__ import annotations

import threading
import time
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


class VirtualClock:
    """Time that only moves when someone sleeps or advances it: tests run instantly and exactly."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance a clock by a negative time ({seconds} s)")
        with self._lock:
            self._t += seconds


REAL_CLOCK = RealClock()
