"""The relaxation as a min-cost flow (perseus.planner.flow, network simplex in C): the same optimum
as HiGHS on the same LP, at every deadline, padded or not, with durations pinned, warm or cold."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from test_solver import GPT3, random_profile

from perseus.exceptions import PlanError
from perseus.planner import Planner, flow, solver
from perseus.planner.lp import HullLP
from perseus.planner.problem import Problem
from perseus.profiler import load_profile
from perseus.schedules import build_schedule

built = pytest.mark.skipif(flow._flow is None, reason="the network simplex extension is not built here")
CASES = [("1f1b", 4, 16, 1), ("gpipe", 3, 8, 2), ("zb-h1", 3, 8, 3), ("interleaved-1f1b", 2, 8, 4), ("1f1b", 6, 24, 5)]


def problem_of(name: str, stages: int, microbatches: int, seed: int) -> Problem:
    kwargs = {"num_chunks": 2} if name == "interleaved-1f1b" else {}
    schedule = build_schedule(name, stages, microbatches, **kwargs)
    return Problem.build(schedule, random_profile(seed, stages, 10))


def assert_same_optimum(highs, simplex, problem: Problem) -> None:
    assert simplex.lower_bound_j == pytest.approx(highs.lower_bound_j, rel=1e-9)
    # Another optimal vertex may place the instructions differently; it is a schedule all the same.
    finish = simplex.start_s + simplex.duration_s
    dag = problem.dag
    assert (simplex.start_s >= -1e-9).all()
    assert (finish[dag.src] <= simplex.start_s[dag.dst] + 1e-9).all()
    assert finish.max() <= simplex.iteration_time_s + 1e-9


def test_extension_is_built_where_a_compiler_is():
    # pip builds it with the package; without a compiler the planner falls back to HiGHS alone.
    if shutil.which("cc") or shutil.which("gcc"):
        assert flow._flow is not None, f"perseus.planner._flow was not built for {sys.executable}"


@built
@pytest.mark.parametrize("name,stages,microbatches,seed", CASES)
def test_same_optimum_as_highs_at_every_deadline(name, stages, microbatches, seed):
    problem = problem_of(name, stages, microbatches, seed)
    fastest = problem.iteration_time(problem.times(problem.fastest()))
    highs, simplex = HullLP(problem), flow.FlowLP(problem)
    for deadline in (fastest, 1.05 * fastest, 1.2 * fastest, 2.0 * fastest, None):
        for padded in (False, True) if deadline is not None else (False,):
            ours = simplex.solve(deadline, padded=padded)
            assert_same_optimum(highs.solve(deadline, padded=padded), ours, problem)
            if deadline is not None:
                assert ours.iteration_time_s <= deadline * (1 + 1e-12)


@built
def test_warm_pinned_and_restarted_solves_match_highs():
    problem = problem_of("1f1b", 4, 16, 7)
    fastest = problem.iteration_time(problem.times(problem.fastest()))
    highs, simplex = HullLP(problem), flow.FlowLP(problem)
    first = simplex.solve(1.1 * fastest)
    basis = simplex.basis()
    nodes = np.arange(0, problem.num_nodes, 3)
    durations = first.duration_s[nodes]
    for lp in (highs, simplex):
        lp.fix_durations(nodes, durations)
    assert_same_optimum(highs.solve(1.1 * fastest, warm=True), simplex.solve(1.1 * fastest, warm=True), problem)
    pinned = simplex.solve(1.1 * fastest, warm=True)
    assert np.allclose(pinned.duration_s[nodes], durations)
    for lp in (highs, simplex):
        lp.release_durations()
    # From the kept basis, and on from there to other deadlines: the optimum of each deadline.
    assert_same_optimum(highs.solve(1.1 * fastest), simplex.solve(1.1 * fastest, start=basis), problem)
    for deadline in (1.3 * fastest, fastest, 1.02 * fastest):
        assert_same_optimum(highs.solve(deadline), simplex.solve(deadline, warm=True), problem)


@built
def test_a_deadline_no_plan_meets_is_refused():
    problem = problem_of("gpipe", 3, 8, 2)
    fastest = problem.iteration_time(problem.times(problem.fastest()))
    with pytest.raises(PlanError, match="no plan can finish within"):
        flow.FlowLP(problem).solve(0.99 * fastest)


@built
def test_a_warm_solve_after_an_infeasible_one_continues_to_the_optimum():
    # Iterative rounding pins durations that may break the deadline, then pins faster ones and
    # re-solves warm: from the tree the infeasible solve stopped at, not from a new one.
    problem = problem_of("1f1b", 4, 16, 8)
    fastest_times = problem.times(problem.fastest())
    fastest = problem.iteration_time(fastest_times)
    highs, simplex = HullLP(problem), flow.FlowLP(problem)
    simplex.solve(1.05 * fastest)
    slowest = np.array([problem.node_options(i).time[-1] for i in range(problem.num_nodes)])
    nodes = np.arange(problem.num_nodes)
    simplex.fix_durations(nodes, slowest)
    with pytest.raises(PlanError, match="no plan can finish within"):
        simplex.solve(1.05 * fastest, warm=True)
    half = nodes[::2]
    for lp in (simplex, highs):
        lp.release_durations()
        lp.fix_durations(half, fastest_times[half])
    assert_same_optimum(highs.solve(1.05 * fastest), simplex.solve(1.05 * fastest, warm=True), problem)


@built
def test_past_the_pivot_limit_highs_solves(monkeypatch):
    problem = problem_of("1f1b", 4, 16, 1)
    fastest = problem.iteration_time(problem.times(problem.fastest()))
    monkeypatch.setattr(flow, "_PIVOTS_PER_ARC", 0)
    simplex = flow.FlowLP(problem)
    simplex.fix_durations(np.array([0]), np.array([problem.times(problem.fastest())[0]]))
    highs = HullLP(problem)
    highs.fix_durations(np.array([0]), np.array([problem.times(problem.fastest())[0]]))
    assert_same_optimum(highs.solve(1.1 * fastest), simplex.solve(1.1 * fastest), problem)


@built
@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_gpt3_8x96_is_solved_by_network_simplex_with_the_same_bound():
    # 1,536 instructions: between FLOW_MIN_NODES and FLOW_MAX_NODES, the planner's own LP.
    schedule = build_schedule("1f1b", 8, 96)
    planner = Planner(schedule, load_profile(GPT3, 83.64))
    assert isinstance(planner._lp, flow.FlowLP)
    highs = HullLP(planner.problem)
    for factor in (1.0, 1.1):
        deadline = factor * planner.max_frequency_time_s
        assert_same_optimum(highs.solve(deadline), planner._lp.solve(deadline), planner.problem)
    plan = planner.plan(max_slowdown=1.0)
    assert plan.iteration_time_s <= planner.max_frequency_time_s and 0 <= plan.gap < 0.005


@built
@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_the_restricted_relaxation_solved_beside_the_plain_one_certifies_the_same_plan():
    # At network simplex sizes, where the deadline rules choices out (no slowdown), the
    # restricted relaxation runs on a second thread during the plain one: the plan and its bound
    # are those of solving it first, on this thread.
    schedule = build_schedule("1f1b", 8, 96)
    profile = load_profile(GPT3, 83.64)
    planner = Planner(schedule, profile)
    deadline = planner.max_frequency_time_s
    narrowed = planner.problem.restricted(deadline)
    assert narrowed is not planner.problem
    beside = planner.plan(deadline=deadline, padded=True)
    inline = Planner(schedule, profile)
    # The deadline binds the plain restricted optimum here, so it is the padded one too.
    plain = flow.FlowLP(narrowed).solve(deadline)
    assert plain.iteration_time_s == pytest.approx(deadline, rel=1e-9)
    inline._own[(deadline, True, True)] = plain
    assert inline.plan(deadline=deadline, padded=True) == beside
    assert beside.lower_bound_j == pytest.approx(plain.lower_bound_j, rel=1e-12)
    cold = flow.FlowLP(narrowed).solve(deadline, padded=True)
    assert beside.lower_bound_j == pytest.approx(cold.lower_bound_j, rel=1e-9)


@built
@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_a_padded_replan_at_a_deadline_just_planned_plain_solves_no_restricted_lp(monkeypatch):
    # The service plans no slowdown, then a straggler's pace that equals it: the padded plan reuses
    # the plain restricted optimum (the deadline binds it) and is the plan a fresh planner makes.
    schedule = build_schedule("1f1b", 8, 96)
    profile = load_profile(GPT3, 83.64)
    deadline = Planner(schedule, profile).max_frequency_time_s
    fresh = Planner(schedule, profile).plan(deadline=deadline, padded=True)
    planner = Planner(schedule, profile)
    planner.plan()
    built_lps = []
    relaxation_lp = solver.relaxation_lp
    monkeypatch.setattr(solver, "relaxation_lp", lambda problem: built_lps.append(problem) or relaxation_lp(problem))
    assert planner.plan(deadline=deadline, padded=True) == fresh
    assert built_lps == []


@built
@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_a_padded_relaxation_the_deadline_binds_is_the_plain_optimum_with_no_second_solve(monkeypatch):
    # Where the deadline rules out no choice and binds the plain optimum, that optimum is the
    # padded one too: the padded LP continues from its basis and takes no pivot, where a cold
    # solve of its own (on a second thread, before) took as long as the plain one.
    schedule = build_schedule("1f1b", 8, 96)
    profile = load_profile(GPT3, 83.64)
    planner = Planner(schedule, profile)
    deadline = 1.05 * planner.max_frequency_time_s
    assert planner.problem.restricted(deadline) is planner.problem
    pivots = []
    network_simplex = flow._flow.network_simplex

    def counted(*args):
        status, taken = network_simplex(*args)
        pivots.append(taken)
        return status, taken

    monkeypatch.setattr(flow._flow, "network_simplex", counted)
    solve = flow.FlowLP.solve
    padded_solves = []

    def recorded(self, deadline_s, warm=False, padded=False, start=None):
        out = solve(self, deadline_s, warm=warm, padded=padded, start=start)
        if padded:
            padded_solves.append((self, pivots[-1]))
        return out

    monkeypatch.setattr(flow.FlowLP, "solve", recorded)
    plan = planner.plan(deadline=deadline, padded=True)
    assert [(lp is planner._lp, taken) for lp, taken in padded_solves] == [(True, 0)]
    monkeypatch.undo()
    cold = flow.FlowLP(planner.problem).solve(deadline, padded=True)
    assert plan.lower_bound_j == pytest.approx(cold.lower_bound_j, rel=1e-9)
    assert plan.iteration_time_s <= deadline


@built
def test_a_solve_just_past_no_slowdown_starts_from_its_optimum_and_plans_alike_whatever_came_before(monkeypatch):
    """Deadlines up to NEAR_NO_SLOWDOWN x the all-max time start the simplex from the no-slowdown
    optimum, further ones from the least-energy optimum (fewer pivots than from the crash tree);
    either start is a function of the deadline, so a plan is the same on a fresh Planner and after
    others."""
    schedule = build_schedule("1f1b", 4, 160)  # 1,280 instructions: network simplex
    profile = random_profile(3, 4, 10)
    starts = []
    solve = flow.FlowLP.solve

    def recorded(self, deadline_s, warm=False, padded=False, start=None):
        if not warm:
            starts.append((deadline_s, start is not None))
        return solve(self, deadline_s, warm=warm, padded=padded, start=start)

    monkeypatch.setattr(flow.FlowLP, "solve", recorded)
    fresh = Planner(schedule, profile)
    assert isinstance(fresh._lp, flow.FlowLP)
    near = 1.03 * fresh.max_frequency_time_s
    plan = fresh.plan(deadline=near, padded=True)
    assert plan.iteration_time_s <= near and plan.lower_bound_j <= plan.energy_j
    # The no-slowdown optimum first (cold), then this deadline's plain LP from it; every later LP
    # at this deadline (padded, pinned) from a basis too (and, for a plan far from its bound,
    # looser deadlines' LPs from this deadline's optimum).
    assert starts[0] == (fresh.max_frequency_time_s, False)
    at_near = [s for s in starts[1:] if s[0] == near]
    assert at_near[0] == (near, True) and all(from_basis for _, from_basis in at_near)
    starts.clear()
    far = 1.2 * fresh.max_frequency_time_s
    fresh.plan(deadline=far, padded=True)
    # The least-energy optimum first (cold, no deadline), then this deadline's LPs from it.
    at_far = [s for s in starts[1:] if s[0] == far]
    assert starts[0] == (None, False) and at_far and all(from_basis for _, from_basis in at_far)
    used = Planner(schedule, profile)
    used.frontier(num_points=4)
    used.plan(max_slowdown=1.2, padded=True)
    used.plan(max_slowdown=1.0)
    assert used.plan(deadline=near, padded=True) == plan
    assert used.plan(deadline=near) == Planner(schedule, profile).plan(deadline=near)
    assert used.plan(deadline=far, padded=True) == Planner(schedule, profile).plan(deadline=far, padded=True)
