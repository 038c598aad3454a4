"""raise_short_segments: no clock held for less than a switch latency, none ever lowered."""

from __future__ import annotations

from perseus.planner.switches import raise_short_segments, segments

CLOCKS = (1410, 1200, 1005, 810)


def table(time_at_top: float) -> dict[int, float]:
    """An instruction's times: inversely proportional to the clock."""
    return {f: time_at_top * 1410 / f for f in CLOCKS}


def test_segments_are_maximal_runs():
    assert segments([1410, 1410, 810, 1005, 1005]) == [range(0, 2), range(2, 3), range(3, 5)]
    assert segments([]) == []


def test_a_short_segment_is_raised_to_its_faster_neighbour():
    times = [table(0.02), table(0.004), table(0.02)]
    assert raise_short_segments([1005, 810, 1200], times, 0.01) == (1005, 1200, 1200)


def test_short_segments_merge_until_none_is_below_a_neighbour():
    # 4 ms instructions, alternating clocks: each run alone is short, so they merge upwards.
    clocks = [810, 1005, 810, 1200, 810, 810, 810, 810]
    raised = raise_short_segments(clocks, [table(0.004)] * len(clocks), 0.01)
    assert all(r >= c for r, c in zip(raised, clocks))
    for k, run in enumerate(segments(raised)):
        length = sum(table(0.004)[raised[i]] for i in run)
        neighbours = [raised[r.start] for r in segments(raised)[max(k - 1, 0) : k + 2]]
        assert length >= 0.01 or raised[run.start] == max(neighbours)
    assert raised[-1] == 810  # the trailing run of four short instructions lasts long enough


def test_a_run_of_short_instructions_at_one_clock_is_kept():
    clocks = [1410, 810, 810, 810, 810, 1410]
    times = [table(0.004)] * len(clocks)  # four 7 ms instructions at 810 MHz: 28 ms at one clock
    assert raise_short_segments(clocks, times, 0.01) == tuple(clocks)


def test_a_plan_without_short_segments_is_unchanged():
    clocks = [1410, 1005, 1005, 810]
    assert raise_short_segments(clocks, [table(0.02)] * 4, 0.01) == tuple(clocks)


def test_latency_zero_changes_nothing():
    clocks = [1410, 810, 1200, 810]
    assert raise_short_segments(clocks, [table(0.001)] * 4, 0.0) == tuple(clocks)


def test_a_missing_target_clock_takes_the_next_one_above():
    times = [table(0.02), {1410: 0.004, 1005: 0.005, 810: 0.007}, table(0.02)]
    assert raise_short_segments([1200, 810, 1005], times, 0.01) == (1200, 1410, 1005)
