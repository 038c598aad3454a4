"""What `perseus probe` found about one GPU model: the figures the runtime and planner use."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from perseus.exceptions import ConfigError


@dataclass(frozen=True)
class ProbeResult:
    """Measured behaviour of one GPU model. Seconds and watts; None: not measured.

    energy_counter_update_s: the energy counter's update period (0.0: it changed at every poll,
        so it updates at least that often). Energy windows shorter than this read nothing.
    power_update_s: how often the power reading refreshes (0.0: at every poll).
    power_average_window_s: the span a power reading averages (0.0: instantaneous).
    idle_power_w: power while idle, from the energy counter.
    supported_clocks_mhz: SM clocks, highest first.
    clock_switch_latency_s: for "FROM->TO" clock pairs (MHz), seconds from the lock call until the
        new clock was in force; empty unless probed with clock changes allowed.
    """

    name: str
    key: str
    energy_counter_update_s: float | None
    power_update_s: float | None
    power_average_window_s: float | None
    idle_power_w: float | None
    supported_clocks_mhz: tuple[int, ...]
    clock_switch_latency_s: Mapping[str, float] = field(default_factory=dict)
    probed_at: str = ""

    @property
    def max_clock_switch_latency_s(self) -> float | None:
        """The longest switch measured: what a planner must allow for a clock change to take effect."""
        return max(self.clock_switch_latency_s.values(), default=None)

    def switch_latency_to_s(self, target_mhz: int) -> float | None:
        """The longest measured switch to `target_mhz` (switches depend mostly on the target)."""
        times = [s for pair, s in self.clock_switch_latency_s.items() if pair.endswith(f"->{target_mhz}")]
        return max(times, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, figures rounded to the microsecond (and microwatt): far below what a probe resolves."""
        return {
            "name": self.name,
            "key": self.key,
            "energy_counter_update_s": _round(self.energy_counter_update_s),
            "power_update_s": _round(self.power_update_s),
            "power_average_window_s": _round(self.power_average_window_s),
            "idle_power_w": _round(self.idle_power_w),
            "supported_clocks_mhz": list(self.supported_clocks_mhz),
            "clock_switch_latency_s": {pair: round(s, 6) for pair, s in self.clock_switch_latency_s.items()},
            "probed_at": self.probed_at,
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> ProbeResult:
        """Parse what `to_dict` wrote; ConfigError naming `where` and the bad field otherwise."""
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: a probe result must be a JSON object")
        try:
            latencies = doc.get("clock_switch_latency_s") or {}
            if not isinstance(latencies, dict):
                raise TypeError("clock_switch_latency_s must be an object")
            return cls(
                name=str(doc["name"]),
                key=str(doc["key"]),
                energy_counter_update_s=_seconds(doc, "energy_counter_update_s"),
                power_update_s=_seconds(doc, "power_update_s"),
                power_average_window_s=_seconds(doc, "power_average_window_s"),
                idle_power_w=_seconds(doc, "idle_power_w"),
                supported_clocks_mhz=tuple(int(f) for f in doc.get("supported_clocks_mhz") or ()),
                clock_switch_latency_s={str(k): _number(v, k) for k, v in latencies.items()},
                probed_at=str(doc.get("probed_at", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: not a probe result ({e}); delete it or run `perseus probe` again") from e


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _seconds(doc: dict[str, Any], name: str) -> float | None:
    value = doc.get(name)
    return None if value is None else _number(value, name)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)
