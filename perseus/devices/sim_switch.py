"""A simulated GPU's clock change in flight: asked for, not yet in force.

A real GPU runs at its old clock for a while after a clock change call returns (see
perseus.devices.sim_realism). The change in flight lives in a small record (perseus.devices.sim_record) beside the GPU's
state file, so every process sees the same clock at the same instant; the state file keeps
meaning "away from defaults" (a reset removes it at once even while the switch back is in flight).
Times are on the clock of the SimGPU that asked: the system-wide monotonic clock, or a virtual
clock, which only that process's objects on that clock share; others ignore the record.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from perseus.clock import Clock, RealClock
from perseus.devices import sim_record


def clock_token(clock: Clock) -> str:
    """Names the clock a switch time is on: the same for every process on the real clock."""
    return "monotonic" if isinstance(clock, RealClock) else f"virtual:{os.getpid()}:{id(clock)}"


@dataclass(frozen=True)
class ClockSwitch:
    """SM clock `from_mhz` stays in force until `at`, then `to_mhz` (None: the default, highest)."""

    from_mhz: int | None
    to_mhz: int | None
    at: float
    clock: str


class SwitchFile:
    """Reads and writes one GPU's switch record; reads are cached on the file's stat, and what
    this object writes is cached as written (no read back)."""

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self._token = token
        # (stat key, switch) last read or written: one pair, assigned at once, as the controller's
        # worker thread writes while other threads read.
        self._memo: tuple[sim_record.Key | None, ClockSwitch | None] = (None, None)

    def read(self) -> ClockSwitch | None:
        """The switch in flight on this clock, if any (in flight or already done: callers compare `at`)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._memo = (None, None)
            return None
        key = sim_record.key(st)  # taken before the read: a write meanwhile makes the next call read again
        known, switch = self._memo
        if key != known:
            switch = self._load()
            self._memo = (key, switch)
        return switch

    def _load(self) -> ClockSwitch | None:
        # A record that cannot be read is treated as no switch: the new clock is in force, and the
        # next change overwrites it.
        try:
            raw = sim_record.read(self.path)
            switch = ClockSwitch(raw["from_mhz"], raw["to_mhz"], float(raw["at"]), str(raw["clock"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return switch if switch.clock == self._token else None

    def write(self, switch: ClockSwitch) -> None:
        doc = {"from_mhz": switch.from_mhz, "to_mhz": switch.to_mhz, "at": switch.at, "clock": switch.clock}
        self._memo = (None, None)  # unknown until written whole
        key = sim_record.write(self.path, sim_record.encode(doc))  # under the GPU's state lock: no other write since
        self._memo = (key, switch if switch.clock == self._token else None)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._memo = (None, None)
