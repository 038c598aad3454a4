"""What `perseus.profiler.checks` says of a profile: numbers that look like other units (each with
the figure in the right one), and clocks the max-frequency baseline misreads; and that
`load_profile` logs the unit problems."""

from __future__ import annotations

import logging

from perseus.profiler import Profile, ProfilePoint, load_profile, save_profile
from perseus.profiler.checks import clock_notes, unit_problems


def profile(blocking_w: float = 70.0, time_scale: float = 1.0, faster_low: bool = False, drop_top: bool = False):
    """Two stages x (forward, backward) at 1410/1200/900 MHz drawing about 300/240/180 W."""
    points = {}
    for stage in (0, 1):
        for kind, t in (("forward", 0.05), ("backward", 0.1)):
            rows = [(1410, t, 300.0), (1200, t * 1.1, 240.0), (900, t * 1.4, 180.0)]
            if faster_low and stage == 1:
                rows[1] = (1200, t * 0.98, 240.0)
            if drop_top and stage == 0 and kind == "backward":
                rows = rows[1:]
            points[(stage, kind)] = [ProfilePoint(f, d * time_scale, w * d) for f, d, w in rows]
    return Profile(points, blocking_w)


def test_right_units_and_clocks_say_nothing():
    assert unit_problems(profile()) == [] and clock_notes(profile()) == []


def test_each_unit_mistake_is_named_with_the_right_figure():
    assert unit_problems(profile(blocking_w=0.07)) == [
        "the blocking power 0.07 W is under 1/50 of the 240 W its instructions draw (median): is it in kW? (70 W)"
    ]
    assert unit_problems(profile(blocking_w=70000)) == [
        "the blocking power 70000 W is above the 240 W its instructions draw (median): is it in mW? (70 W)"
    ]
    (ms,) = unit_problems(profile(time_scale=1000))
    assert ms.endswith("below the blocking power 70 W: are its times in ms? (in seconds they would draw 240 W)")


def test_clocks_the_baseline_misreads_are_named():
    (short,) = clock_notes(profile(drop_top=True))
    assert short.startswith("most instructions are profiled up to 1410 MHz, but stage 0 backward 1200 MHz only lower")
    (faster,) = clock_notes(profile(faster_low=True))
    assert faster.startswith(
        "a lower clock runs 2 of 4 instructions faster than their highest (most: stage 1 backward, 1200 MHz 2.0% faster"
    )


def test_load_profile_logs_unit_problems(tmp_path, caplog):
    path = tmp_path / "p.csv"
    save_profile(profile(time_scale=1000), path)
    with caplog.at_level(logging.WARNING, logger="perseus.profiler.profile"):
        load_profile(path, 70.0)
    assert f"{path}: its instructions draw 0.24 W (median)" in caplog.text
    caplog.clear()
    save_profile(profile(), path)
    load_profile(path, 70.0)
    assert caplog.text == ""
