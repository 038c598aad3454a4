"""A profile point the sweep could not measure (every span of that instruction at that clock
straddled a clock change, or the energy fit could not tell its power) is scaled from the same
instruction's nearest measured clock by how the stage's other instructions change between the
two clocks; the sweep profiles such a clock again first."""

from __future__ import annotations

import math

import pytest

from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.profiler.online import _impute

FREQS = (1410, 1200, 1005, 810)
WORKS = {(0, "forward"): Work(0.006), (0, "backward"): Work(0.012, alpha=0.6), (1, "forward"): Work(0.008, alpha=0.9)}


def truth() -> dict:
    gpu = SimGPU("a100-sxm", realism="ideal")
    return {key: {f: (*gpu.predict(work, f), 0.01) for f in FREQS} for key, work in WORKS.items()}


def test_a_missing_point_is_scaled_from_the_instructions_nearest_clock():
    exact = truth()
    points = {key: dict(per_clock) for key, per_clock in exact.items()}
    del points[(0, "backward")][1005]
    filled = _impute(points, set(FREQS))
    assert filled == [((0, "backward"), 1005)]
    t, e, err = points[(0, "backward")][1005]
    t_true, e_true, _ = exact[(0, "backward")][1005]
    assert t == pytest.approx(t_true, rel=0.05) and e == pytest.approx(e_true, rel=0.05)
    assert err > 0.01  # less certain than a measured point


def test_measured_points_are_kept_and_only_measured_ones_are_sources():
    exact = truth()
    points = {key: dict(per_clock) for key, per_clock in exact.items()}
    del points[(0, "forward")][810]
    del points[(1, "forward")][810]
    filled = _impute(points, set(FREQS))
    assert sorted(filled) == [((0, "forward"), 810), ((1, "forward"), 810)]  # from the backward alone
    for key in WORKS:
        for f in FREQS:
            if (key, f) not in filled:
                assert points[key][f] == exact[key][f]


def test_a_clock_no_other_instruction_measured_stays_empty():
    exact = truth()
    points = {key: {f: p for f, p in per_clock.items() if f != 810} for key, per_clock in exact.items()}
    assert _impute(points, set(FREQS)) == []
    assert all(810 not in per_clock for per_clock in points.values())


def test_nothing_to_fill():
    points = truth()
    assert _impute(points, set(FREQS)) == []
    assert not any(math.isnan(p[0]) for per_clock in points.values() for p in per_clock.values())
