"""Baselines: all-max, best uniform clock, EnvPipe; and the planner never loses to them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_solver import random_profile

from perseus.exceptions import PlanError
from perseus.planner import Evaluator, Planner, shared_frequencies, uniform_frequencies
from perseus.planner.baselines import envpipe_plan, max_frequency_plan, uniform_plan
from perseus.profiler import load_profile
from perseus.schedules import Kind, build_schedule

GPT3 = Path(__file__).resolve().parents[2] / "../shared/data/perseus-sosp24/stage_profiles/gpt3-175b+a100_sxm_bf16.csv"


def test_uniform_is_best_single_clock_within_deadline():
    schedule = build_schedule("1f1b", 3, 6)
    profile = random_profile(2, 3, 6)
    ev = Evaluator(schedule, profile)
    deadline = 1.2 * max_frequency_plan(ev).iteration_time_s
    plan = uniform_plan(ev, deadline)
    assert len(set(plan.frequencies.values())) == 1
    assert plan.iteration_time_s <= deadline
    by_hand = [ev.evaluate(uniform_frequencies(schedule, profile, f)) for f in shared_frequencies(schedule, profile)]
    assert plan.energy_j == min(e.energy_j for e in by_hand if e.iteration_time_s <= deadline)
    with pytest.raises(PlanError, match="uniform"):
        uniform_plan(ev, 0.1 * deadline)


def test_envpipe_pins_the_right_instructions_and_meets_deadline():
    schedule = build_schedule("1f1b", 4, 8)
    profile = random_profile(4, 4, 10)
    ev = Evaluator(schedule, profile)
    top = {ins: profile.points_for(ins, schedule)[0].frequency for ins in schedule.instructions()}
    loose = envpipe_plan(ev, deadline_s=1e9)  # nothing needs raising
    for s, row in enumerate(schedule.stages):
        first_f = next(i for i in row if i.kind == Kind.FORWARD)
        last_b = [i for i in row if i.kind == Kind.BACKWARD][-1]
        assert loose.frequencies[first_f] == top[first_f]
        assert loose.frequencies[last_b] == top[last_b]
        if s == len(schedule.stages) - 1:
            assert all(loose.frequencies[i] == top[i] for i in row)
    tight = envpipe_plan(ev)  # default deadline: the all-max time
    assert tight.iteration_time_s <= max_frequency_plan(ev).iteration_time_s
    assert tight.energy_j == ev.evaluate(tight.frequencies).energy_j


@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_planner_beats_baselines_on_real_profile():
    profile = load_profile(GPT3, 83.64)
    schedule = build_schedule("1f1b", 8, 12)
    planner = Planner(schedule, profile)
    ev = planner.evaluator
    for factor in (1.0, 1.1):
        deadline = factor * planner.max_frequency_time_s
        plan = planner.plan(deadline=deadline)
        for baseline in (uniform_plan(ev, deadline), envpipe_plan(ev, deadline)):
            assert baseline.iteration_time_s <= deadline
            assert plan.energy_j < baseline.energy_j, baseline.name
    assert planner.plan().energy_j < max_frequency_plan(ev).energy_j
