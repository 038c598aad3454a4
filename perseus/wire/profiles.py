"""A stage profile on the wire: `{"blocking_power_w", "rows": [[stage, kind, MHz, s, J], ...], "meta"}`."""

from __future__ import annotations

from typing import Any

from perseus.exceptions import ConfigError, ProfileError
from perseus.profiler.profile import KINDS, Profile, ProfilePoint
from perseus.wire.fields import check_float, check_int, check_seq, check_str, show
from perseus.wire.limits import (
    MAX_ENERGY_J,
    MAX_FREQUENCY_MHZ,
    MAX_PROFILE_ROWS,
    MAX_TIME_S,
    MIN_TIME_S,
)


def profile_to_wire(profile: Profile) -> dict[str, Any]:
    rows = [
        [stage, kind, p.frequency, p.time, p.energy]
        for (stage, kind), points in sorted(profile.points.items())
        for p in points
    ]
    return {"blocking_power_w": profile.blocking_power_w, "rows": rows, "meta": dict(profile.meta)}


def profile_from_wire(doc: Any, name: str) -> Profile:
    """A validated Profile from `{"blocking_power_w", "rows": [[stage, kind, MHz, s, J], ...], "meta"}`."""
    if (
        not isinstance(doc, dict)
        or set(doc) - {"blocking_power_w", "rows", "meta"}
        or not {"blocking_power_w", "rows"} <= set(doc)
    ):
        raise ConfigError(f"{name} must be a map with blocking_power_w, rows and optionally meta, got {show(doc)}")
    power = check_float(doc["blocking_power_w"], f"{name}.blocking_power_w", 0.0, 100_000.0)
    meta = doc.get("meta", {})
    if (
        not isinstance(meta, dict)
        or len(meta) > 64
        or not all(isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= 1024 for k, v in meta.items())
    ):
        raise ConfigError(f"{name}.meta must be a map of at most 64 short strings to strings")
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    for i, row in enumerate(check_seq(doc["rows"], f"{name}.rows", MAX_PROFILE_ROWS, min_len=1)):
        where = f"{name}.rows[{i}]"
        row = check_seq(row, where, 5, min_len=5)
        key = (check_int(row[0], f"{where}.stage", 0, 1 << 20), check_str(row[1], f"{where}.kind", 32, choices=KINDS))
        point = ProfilePoint(
            check_int(row[2], f"{where}.frequency", 1, MAX_FREQUENCY_MHZ),
            check_float(row[3], f"{where}.time", MIN_TIME_S, MAX_TIME_S),
            check_float(row[4], f"{where}.energy", 0.0, MAX_ENERGY_J, open_lo=True),
        )
        points.setdefault(key, []).append(point)
    for pts in points.values():
        pts.sort(key=lambda p: p.frequency, reverse=True)
    profile = Profile(points, power, dict(meta))
    try:
        profile.validate()
    except ProfileError as e:
        raise ConfigError(f"{name}: {e}") from None
    return profile
