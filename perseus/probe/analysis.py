"""What a probe's samples say about a GPU's counters: pure functions over (time, value) series.

A counter or reading that refreshes on a grid holds its value between refreshes; polling it much
faster than it refreshes shows the refresh instants as the polls where the value changed.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

Series = Sequence[tuple[float, float]]  # (time s, value), in time order


def change_times(series: Series) -> list[float]:
    """The poll times at which the value differed from the poll before."""
    return [t for (_, before), (t, value) in zip(series, series[1:]) if value != before]


def refresh_period(series: Series, poll_s: float) -> float | None:
    """The period at which `series` refreshes, from the intervals between its changes.

    0.0 when it changed at (nearly) every poll: it refreshes at least as often as it was polled.
    None when it changed too rarely to tell (fewer than three changes).
    """
    changes = change_times(series)
    if len(changes) < 3:
        return None
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    typical = statistics.median(gaps)
    if typical < 1.5 * poll_s:
        return 0.0
    # Intervals near the typical one: a refresh that did not change the value makes a double
    # interval, and a poll that ran late shortens the next one; both averaged out or left out.
    near = [g for g in gaps if 0.5 * typical <= g <= 1.5 * typical]
    return sum(near) / len(near)


def counter_power_w(series: Series) -> float | None:
    """Mean power (W) from an energy counter series in mJ, between its first and last change
    (whole update periods, so a stepping counter reads right); None without two changes."""
    changed = [(t, e) for (_, before), (t, e) in zip(series, series[1:]) if e != before]
    if len(changed) < 2:
        return None
    (t0, e0), (t1, e1) = changed[0], changed[-1]
    return (e1 - e0) / 1000.0 / (t1 - t0)


def averaging_window(
    readings: Series, load_start: float, idle_w: float, busy_w: float, refresh_s: float | None
) -> float | None:
    """The span a power reading averages over, from how it rose after a load began at `load_start`.

    An averaging reading climbs from the idle to the busy level along a ramp whose length is the
    window (its fraction of the step grows by refresh/window per refresh); a least-squares line
    through the readings on the ramp gives the window as 1/slope. A reading with fewer than two
    points on the ramp averages over at most one refresh: the window is the refresh period (0 for a
    reading that follows the load at once). None when the step is too small to read, or the
    refresh period unknown (a watch too short to see the reading change twice).
    """
    step = busy_w - idle_w
    if step <= 0 or not readings:
        return None
    rising: list[tuple[float, float]] = []
    before = None
    for t, watts in readings:
        if t < load_start:
            continue
        fraction = (watts - idle_w) / step
        if fraction >= 0.95:
            break
        if watts != before and fraction > 0.05:  # one point per refresh: where the reading changed
            rising.append((t, fraction))
        before = watts
    if len(rising) < 2:
        return refresh_s
    mean_t = sum(t for t, _ in rising) / len(rising)
    mean_f = sum(f for _, f in rising) / len(rising)
    slope = sum((t - mean_t) * (f - mean_f) for t, f in rising) / sum((t - mean_t) ** 2 for t, _ in rising)
    return 1.0 / slope if slope > 0 else None
