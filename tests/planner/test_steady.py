"""Steady-state pinning (perseus.planner.steady): the groups it pins, and what a pinned
relaxation is."""

from __future__ import annotations

import numpy as np
import pytest
from test_solver import random_profile

from perseus.planner import Planner, solver, steady
from perseus.planner.steady import pinned_relaxations, steady_groups
from perseus.schedules import build_schedule


def test_steady_groups_are_each_stage_and_kind_over_the_steady_microbatches():
    planner = Planner(build_schedule("1f1b", 4, 16), random_profile(2, 4, 10))
    groups = steady_groups(planner.problem)
    nodes = planner.problem.dag.nodes
    assert len(groups) == 8  # 4 stages x (forward, backward)
    keys = set()
    for group in groups:
        members = [nodes[i] for i in group.tolist()]
        assert sorted(ins.microbatch for ins in members) == list(range(4, 12))  # a margin of one per stage
        assert len({(ins.stage, ins.kind) for ins in members}) == 1
        keys.add((members[0].stage, members[0].kind))
    assert len(keys) == 8


def test_a_pipeline_too_short_for_a_steady_state_has_no_groups():
    planner = Planner(build_schedule("1f1b", 4, 12), random_profile(2, 4, 10))
    assert steady_groups(planner.problem) == []


@pytest.mark.parametrize("padded", [False, True])
def test_pinned_relaxations_hold_each_pinned_group_at_one_choice_and_leave_the_lp_free(padded):
    planner = Planner(build_schedule("1f1b", 4, 16), random_profile(2, 4, 10))
    problem, lp = planner.problem, planner._lp
    deadline = 1.05 * planner.max_frequency_time_s
    free = lp.solve(deadline, padded=padded)
    start = (free, lp.basis())
    groups = steady_groups(problem)

    def score(r):
        return planner._least_energy(planner._round(r, deadline), deadline, padded)

    def run():
        return pinned_relaxations(problem, lp, deadline, padded, start, groups, score, pattern="uniform")

    pinned = run()
    assert pinned, "the relaxation at 1.05x has fractional steady instructions to pin"
    uniform = 0
    for relaxation in pinned:
        assert relaxation.iteration_time_s <= deadline * (1 + 1e-9)
        # Pinning only adds constraints: never below the free optimum.
        assert relaxation.lower_bound_j >= free.lower_bound_j * (1 - 1e-9)
        for group in groups:
            d = relaxation.duration_s[group]
            times = problem.node_options(int(group[0])).time
            if np.ptp(d) < 1e-12 and np.min(np.abs(times - d[0])) < 1e-12:
                uniform += 1
    assert uniform >= len(pinned)
    assert [r.lower_bound_j for r in run()] == [r.lower_bound_j for r in pinned]  # from its arguments alone
    again = lp.solve(deadline, padded=padded)
    assert again.lower_bound_j == pytest.approx(free.lower_bound_j, rel=1e-9)  # every duration free again


@pytest.mark.parametrize("padded", [False, True])
def test_dithered_pins_spread_each_group_over_the_two_hull_vertices_around_its_duration(padded):
    planner = Planner(build_schedule("1f1b", 4, 24), random_profile(2, 4, 10))
    problem, lp = planner.problem, planner._lp
    deadline = (1.05 if padded else 1.0) * planner.max_frequency_time_s
    free = lp.solve(deadline, padded=padded)
    groups = steady_groups(problem)

    def score(r):
        return planner._least_energy(planner._round(r, deadline), deadline, padded)

    for pattern in ("even", "nested"):
        pinned = pinned_relaxations(problem, lp, deadline, padded, (free, lp.basis()), groups, score, pattern=pattern)
        # The slower vertex's share keeps a group's mean within one instruction's step of the
        # relaxation's where spread evenly, 2.5 where nested.
        _assert_dithered(problem, groups, free, deadline, pinned, 1.0 if pattern == "even" else 2.5)
    with pytest.raises(ValueError, match="pattern must be one of"):
        pinned_relaxations(problem, lp, deadline, padded, (free, lp.basis()), groups, score, pattern="random")


def _assert_dithered(problem, groups, free, deadline, pinned, steps):
    assert pinned
    mixed = 0
    for relaxation in pinned:
        assert relaxation.iteration_time_s <= deadline * (1 + 1e-9)
        assert relaxation.lower_bound_j >= free.lower_bound_j * (1 - 1e-9)
    first = pinned[0]
    for group in groups:
        d = free.duration_s[group]
        options = problem.node_options(int(group[0]))
        vertices = options.time[options.hull]
        if np.min(np.abs(vertices - np.median(d))) < 1e-9:
            continue  # not fractional at the free optimum: left free at the first level
        used = np.unique(np.round(first.duration_s[group], 12))
        assert all(np.min(np.abs(vertices - u)) < 1e-9 for u in used)  # only hull vertices
        if len(used) == 2:
            mixed += 1
            step = used[1] - used[0]
            assert abs(first.duration_s[group].mean() - np.median(d)) <= steps * step / len(group) + 1e-9
    assert mixed >= 1


def test_dithered_pins_find_plans_that_uniform_pins_do_not(monkeypatch):
    """Random 4 x 24 profile (seed 2): with dithered pins the plans cost less at each deadline."""
    schedule = build_schedule("1f1b", 4, 24)
    profile = random_profile(2, 4, 10)
    monkeypatch.setattr(solver, "HULL_RETRY_GAP", float("inf"))  # dithering alone (hull rounding finds one)
    with_dither = [Planner(schedule, profile).plan(max_slowdown=f, padded=f > 1) for f in (1.0, 1.05, 1.1)]
    monkeypatch.setattr(steady, "_dither_keys", lambda problem: [])
    without = [Planner(schedule, profile).plan(max_slowdown=f, padded=f > 1) for f in (1.0, 1.05, 1.1)]
    for a, b in zip(with_dither, without):
        assert a.energy_j < b.energy_j
        assert a.iteration_time_s <= a.deadline_s
