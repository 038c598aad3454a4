"""Iterative rounding (perseus.planner.refine): pins that would break the deadline are seen by a
longest path before the LP is asked, so no re-solve is spent proving a pinning infeasible."""

from __future__ import annotations

import pytest
from test_solver import random_profile

from perseus.exceptions import PlanError
from perseus.planner.lp import HullLP
from perseus.planner.problem import Problem
from perseus.planner.refine import refine
from perseus.schedules import build_schedule


class CountingLP:
    """An LP that counts the solves that found no schedule within the deadline."""

    def __init__(self, lp: HullLP) -> None:
        self.lp = lp
        self.infeasible = 0

    def solve(self, *args, **kwargs):
        try:
            return self.lp.solve(*args, **kwargs)
        except PlanError:
            self.infeasible += 1
            raise

    def __getattr__(self, name):
        return getattr(self.lp, name)


@pytest.mark.parametrize("seed", [1, 5, 7])
def test_no_pinning_that_breaks_the_deadline_is_solved(seed):
    # At the fastest deadline, pinning each duration to its nearest choice breaks it 1-3 times
    # per run on these problems (measured with the check turned off).
    problem = Problem.build(build_schedule("1f1b", 4, 16), random_profile(seed, 4, 10))
    deadline = problem.iteration_time(problem.times(problem.fastest()))
    lp = CountingLP(HullLP(problem))
    relaxation = refine(problem, lp, lp.solve(deadline), deadline)
    assert lp.infeasible == 0
    assert relaxation.iteration_time_s <= deadline * (1 + 1e-9)
