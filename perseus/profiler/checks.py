"""Signs that a profile is not what the planner's baselines assume: numbers in other units than
seconds, joules and watts, or clocks that do not rank as their frequencies do. Said, never refused
(an odd profile may be right); `load_profile` logs the unit problems, `perseus plan` says all."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # profile.py imports this module
    from perseus.profiler.profile import Profile

# Busy over blocking power past which the blocking power looks like kilowatts: measured GPUs draw
# 2-8x their waiting power computing (the A100 and A40 profiles: 3-5x).
BUSY_OVER_BLOCKING = 50
# A lower clock this much faster than the highest is said (measurement noise stays below it).
FASTER_BY = 1e-3


def unit_problems(profile: Profile) -> list[str]:
    """What looks like another unit, each with the figure it would have in the right one."""
    busy_w = statistics.median(p.energy / p.time for points in profile.points.values() for p in points)
    blocking_w = profile.blocking_power_w
    if busy_w < blocking_w:
        if blocking_w >= 1000 and blocking_w / 1000 < busy_w:
            return [
                f"the blocking power {blocking_w:g} W is above the {busy_w:.3g} W its instructions draw (median): "
                f"is it in mW? ({blocking_w / 1000:g} W)"
            ]
        if busy_w * 1000 > blocking_w:
            return [
                f"its instructions draw {busy_w:.3g} W (median), below the blocking power {blocking_w:g} W: are its "
                f"times in ms? (in seconds they would draw {busy_w * 1000:.3g} W)"
            ]
        return [
            f"its instructions draw {busy_w:.3g} W (median), below the blocking power {blocking_w:g} W a GPU draws "
            "waiting: are its times in seconds, its energies in joules and the blocking power in watts?"
        ]
    if 0 < blocking_w * BUSY_OVER_BLOCKING < busy_w:
        return [
            f"the blocking power {blocking_w:g} W is under 1/{BUSY_OVER_BLOCKING} of the {busy_w:.3g} W its "
            f"instructions draw (median): is it in kW? ({blocking_w * 1000:g} W)"
        ]
    return []


def clock_notes(profile: Profile) -> list[str]:
    """Instructions that lack the highest clock the others have, and instructions a lower clock runs
    faster than their highest: the max-frequency baseline is then not what its name says."""
    notes = []
    top = {key: points[0] for key, points in profile.points.items()}  # sorted by frequency, highest first
    highest = max(p.frequency for p in top.values())
    short = sorted((stage, kind, p.frequency) for (stage, kind), p in top.items() if p.frequency < highest)
    if short:
        named = ", ".join(f"stage {stage} {kind} {mhz} MHz" for stage, kind, mhz in short[:4])
        more = f" and {len(short) - 4} more" if len(short) > 4 else ""
        notes.append(
            f"most instructions are profiled up to {highest} MHz, but {named}{more} only lower: the max-frequency "
            "baseline runs those at their own highest clock; profile the missing rows if they exist"
        )
    faster = []
    for (stage, kind), points in sorted(profile.points.items()):
        quickest = min(points, key=lambda p: p.time)
        if quickest.time < points[0].time * (1 - FASTER_BY):
            faster.append((stage, kind, quickest.frequency, points[0].frequency, 1 - quickest.time / points[0].time))
    if faster:
        stage, kind, mhz, top_mhz, by = max(faster, key=lambda f: f[4])
        notes.append(
            f"a lower clock runs {len(faster)} of {len(profile.points)} instructions faster than their highest "
            f"(most: stage {stage} {kind}, {mhz} MHz {100 * by:.1f}% faster than {top_mhz} MHz): the max-frequency "
            "baseline is not the fastest plan, and deadlines below its iteration time can be met"
        )
    return notes
