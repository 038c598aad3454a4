"""The certified lower bound, checked against the same relaxation written independently in cvxpy.

The planner solves its LP with HiGHS on hand-built sparse matrices (Pareto-filtered hull
segments, times in milliseconds, warm starts). Here the relaxation is stated from its definition
instead: every instruction takes a convex combination of its raw profile points (those it can
take within the deadline, the others' fastest clocks granted), starts after its predecessors
end, and the iteration ends by T <= deadline; minimise
sum(e - P_block * t) + P_block * N_stages * T (padded: * deadline). Both must agree, and the
bound must stay below every plan's energy.
"""

from __future__ import annotations

import cvxpy as cp
import networkx as nx
import numpy as np
import pytest
from test_solver import GPT3, random_profile

from perseus.planner import Planner, build_dag
from perseus.planner import lp as hull_lp
from perseus.profiler import load_profile
from perseus.schedules import build_schedule


def relaxation_bound(schedule, profile, deadline_s: float, padded: bool = False) -> float:
    dag = build_dag(schedule)
    nodes = list(dag.nodes)
    index = {ins: i for i, ins in enumerate(nodes)}
    p_block = profile.blocking_power_w
    start = cp.Variable(len(nodes))
    duration = cp.Variable(len(nodes))
    T = cp.Variable()
    cost = []
    constraints = [start >= 0, T <= deadline_s]
    # No plan within the deadline gives an instruction more than the deadline less the longest
    # paths before and after it at the fastest clocks: only those choices enter its hull.
    fastest = {ins: min(p.time for p in profile.points_for(ins, schedule)) for ins in nodes}
    before: dict = {}
    for ins in nx.topological_sort(dag):
        before[ins] = max((before[p] + fastest[p] for p in dag.predecessors(ins)), default=0.0)
    after: dict = {}
    for ins in reversed(list(nx.topological_sort(dag))):
        after[ins] = max((after[q] + fastest[q] for q in dag.successors(ins)), default=0.0)
    for i, ins in enumerate(nodes):
        room = deadline_s - before[ins] - after[ins]
        points = [p for p in profile.points_for(ins, schedule) if p.time <= room * (1 + 1e-9) or p.time == fastest[ins]]
        t = np.array([p.time for p in points])
        c = np.array([p.energy - p_block * p.time for p in points])
        weight = cp.Variable(len(points), nonneg=True)
        constraints += [cp.sum(weight) == 1, duration[i] == t @ weight]
        cost.append(c @ weight)
        if dag.out_degree(ins) == 0:
            constraints.append(start[i] + duration[i] <= T)
    for a, b in dag.edges:
        constraints.append(start[index[b]] >= start[index[a]] + duration[index[a]])
    # Padded: every stage blocks until the deadline, whenever the plan ends.
    objective = cp.Minimize(cp.sum(cp.hstack(cost)) + p_block * schedule.num_stages * (deadline_s if padded else T))
    problem = cp.Problem(objective, constraints)
    problem.solve(solver=cp.HIGHS)
    assert problem.status == cp.OPTIMAL, problem.status
    return float(problem.value)


def check(schedule, profile, slowdowns):
    planner = Planner(schedule, profile)
    for slowdown in slowdowns:
        for padded in (False, True):
            plan = planner.plan(max_slowdown=slowdown, padded=padded)
            independent = relaxation_bound(schedule, profile, plan.deadline_s, padded)
            assert plan.lower_bound_j == pytest.approx(independent, rel=1e-5), (slowdown, padded)
            assert plan.lower_bound_j <= plan.energy_j


@pytest.mark.parametrize(
    "name,stages,microbatches,seed",
    # The last two are long enough for the steady-state start of the LP (perseus.planner.periodic).
    [("1f1b", 3, 4, 5), ("gpipe", 2, 3, 6), ("zb-h1", 2, 3, 7), ("1f1b", 2, 12, 8), ("zb-h1", 2, 12, 9)],
)
def test_bound_equals_the_relaxation_stated_independently(monkeypatch, name, stages, microbatches, seed):
    # Every cold solve that has a steady state starts from it, however small the DAG.
    monkeypatch.setattr(hull_lp, "SEED_MIN_NODES", 0)
    check(build_schedule(name, stages, microbatches), random_profile(seed, stages, num_freqs=8), (1.0, 1.1, 1.3))


@pytest.mark.skipif(not GPT3.exists(), reason="shared SOSP'24 profiles not present")
def test_bound_on_measured_gpt3_profile():
    profile = load_profile(GPT3, blocking_power_w=83.64)
    check(build_schedule("1f1b", 8, 8), profile, (1.0, 1.2, 1.4))
