"""The steady-state restriction that starts every cold LP solve of a long pipeline: it maps each
steady microbatch onto one representative, its optimum is a feasible start for the full LP, and
the full LP solved from it reaches the same optimum as a cold solve (the bound is the full LP's
own either way)."""

from __future__ import annotations

import numpy as np
import pytest
from test_solver import random_profile

from perseus.planner.lp import HullLP
from perseus.planner.periodic import MIN_PERIODS, Compression, steady_state
from perseus.planner.problem import Problem
from perseus.schedules import build_schedule


def problem(name: str, stages: int, microbatches: int, seed: int) -> Problem:
    return Problem.build(build_schedule(name, stages, microbatches), random_profile(seed, stages, num_freqs=6))


def test_short_pipelines_have_no_steady_state():
    assert steady_state(problem("1f1b", 4, 4 * 2 + MIN_PERIODS - 1, 1)) is None


def test_steady_microbatches_share_one_column_per_stage_and_kind():
    p = problem("1f1b", 2, 16, 2)
    steady = steady_state(p)
    assert steady is not None and steady.periodic
    micro = np.array([ins.microbatch for ins in p.dag.nodes])
    inside = (micro >= 2) & (micro < 14)
    # 2 stages x (forward, backward) representatives, plus the 2 + 2 microbatches at the ends.
    assert steady.num_columns == 4 + int((~inside).sum())
    assert np.array_equal(steady.offset[inside], micro[inside] - 2)
    assert not steady.offset[~inside].any()
    assert np.array_equal(steady.weight[steady.rep[inside]], np.full(int(inside.sum()), 12.0))


def test_restriction_optimum_is_feasible_for_the_full_dag():
    p = problem("1f1b", 3, 20, 3)
    lp = HullLP(p, seeded=True)
    assert lp._seed is not None
    deadline = 1.05 * p.iteration_time(p.times(p.fastest()))
    seed = lp._seed._optimum(deadline, padded=False)
    assert seed is not None
    x = np.array(lp._expand(lp._seed, seed).col_value) / 1000.0
    start, duration, end = x[: p.num_nodes], x[p.num_nodes : 2 * p.num_nodes], x[-1]
    finish = start + duration
    assert (start[p.dag.dst] >= finish[p.dag.src] - 1e-9).all()
    assert finish.max() <= min(end, deadline) + 1e-9


@pytest.mark.parametrize(
    "name,stages,microbatches,seed",
    # gpipe has no period-1 steady state: its restriction is infeasible and the solve starts cold.
    [("1f1b", 3, 20, 4), ("zb-h1", 2, 16, 5), ("gpipe", 2, 14, 6)],
)
def test_seeded_solve_reaches_the_cold_optimum(name, stages, microbatches, seed):
    p = problem(name, stages, microbatches, seed)
    seeded = HullLP(p, seeded=True)
    cold = HullLP(p, Compression.identity(p))
    fastest = p.iteration_time(p.times(p.fastest()))
    for factor, padded in ((1.0, False), (1.1, False), (1.3, True)):
        a = seeded.solve(factor * fastest, padded=padded)
        b = cold.solve(factor * fastest, padded=padded)
        assert a.lower_bound_j == pytest.approx(b.lower_bound_j, rel=1e-9)
        assert a.iteration_time_s <= factor * fastest * (1 + 1e-12)
    assert seeded.solve(None).lower_bound_j == pytest.approx(cold.solve(None).lower_bound_j, rel=1e-9)
