"""Time-energy profiles: per (stage, instruction kind), the time and energy at each SM frequency.

Shared by the online profiler (which produces them) and the planner (which consumes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class ProfilePoint:
    """One microbatch of one instruction kind at one SM frequency."""

    frequency: int  # MHz
    time: float  # s
    energy: float  # J


@dataclass
class Profile:
    """Profiles of every (stage, kind), plus the power of a GPU blocked waiting on a peer.

    `points[(stage, kind)]` holds ProfilePoints sorted by frequency, highest first.
    `kind` is a `perseus.schedules.Kind` value string ("forward", "backward", ...).
    """

    points: dict[tuple[int, str], list[ProfilePoint]]
    blocking_power_w: float
    meta: dict[str, str] = field(default_factory=dict)
