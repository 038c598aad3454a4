"""The planner: exact on small DAGs (brute force), feasible and bounded everywhere, deterministic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perseus.exceptions import ConfigError, PlanError
from perseus.planner import Evaluator, Plan, Planner, evaluate, solver
from perseus.planner.exact import MAX_BINARIES, num_binaries
from perseus.planner.lp import HullLP
from perseus.profiler import Profile, ProfilePoint, load_profile
from perseus.schedules import build_schedule

GPT3 = Path(__file__).resolve().parents[2] / "../shared/data/perseus-sosp24/stage_profiles/gpt3-175b+a100_sxm_bf16.csv"
KINDS = ("forward", "backward", "backward_input", "backward_weight")


def random_profile(seed: int, stages: int, num_freqs: int, power_w: float = 60.0) -> Profile:
    """Noisy profiles: slower at lower clocks on the whole, energy not monotone, some points
    dominated -- like measurements."""
    rng = np.random.default_rng(seed)
    freqs = sorted(rng.choice(np.arange(600, 1500, 15), size=num_freqs, replace=False).tolist(), reverse=True)
    points = {}
    for s in range(stages):
        for kind in KINDS:
            base = rng.uniform(0.5, 2.0) * (2.0 if kind == "backward" else 1.0)
            pts = []
            for f in freqs:
                t = base * (1410 / f) ** 0.8 * rng.uniform(0.97, 1.03)
                p = rng.uniform(150, 250) * (f / 1410) ** 2 + 80
                pts.append(ProfilePoint(int(f), float(t), float(t * p * rng.uniform(0.9, 1.1))))
            points[(s, kind)] = pts
    return Profile(points, power_w)


def brute_force(schedule, profile, deadlines, padded=False):
    """Least energy over every frequency assignment with T <= deadline, for each deadline;
    `padded`: the energy of an iteration that lasts the deadline."""
    ev = Evaluator(schedule, profile)
    sizes = [len(ev.node_choices(i).frequency) for i in range(len(ev.nodes))]
    combos = np.stack(np.meshgrid(*[np.arange(k) for k in sizes], indexing="ij"), axis=-1).reshape(-1, len(sizes))
    T, E = ev.evaluate_arrays(*ev.times_energies(combos))
    best = []
    for d in deadlines:
        ok = T <= d
        pad = profile.blocking_power_w * schedule.num_stages * (d - T[ok]) if padded else 0.0
        best.append(float((E[ok] + pad).min()) if ok.any() else None)
    return best


SMALL = [
    ("1f1b", 2, 3, 3, 1),  # 12 instructions, 3 clocks each
    ("gpipe", 2, 2, 4, 2),  # 8 instructions, 4 clocks
    ("zb-h1", 2, 2, 3, 3),  # 12 instructions (F, I, W), 3 clocks
    ("1f1b", 3, 2, 3, 4),  # 12 instructions
]


@pytest.mark.parametrize("name,stages,microbatches,num_freqs,seed", SMALL)
def test_equals_brute_force_on_small_dags(name, stages, microbatches, num_freqs, seed):
    schedule = build_schedule(name, stages, microbatches)
    profile = random_profile(seed, stages, num_freqs)
    planner = Planner(schedule, profile)
    assert planner.problem.num_nodes <= 12
    t_max = planner.max_frequency_time_s
    deadlines = [
        t_max,
        planner.fastest_time_s,
        0.5 * (planner.fastest_time_s + t_max),
        1.1 * t_max,
        1.3 * t_max,
        10 * t_max,
    ]
    best = brute_force(schedule, profile, deadlines)
    for deadline, expected in zip(deadlines, best):
        plan = planner.plan(deadline=deadline)
        assert plan.iteration_time_s <= deadline
        assert plan.energy_j == pytest.approx(expected, rel=1e-9), f"deadline {deadline}"
        assert plan.lower_bound_j <= plan.energy_j
    assert planner.plan().energy_j == pytest.approx(best[0], rel=1e-9)  # default: no slowdown


@pytest.mark.parametrize("name,stages,microbatches,num_freqs,seed", SMALL)
def test_padded_equals_brute_force_on_small_dags(name, stages, microbatches, num_freqs, seed):
    schedule = build_schedule(name, stages, microbatches)
    profile = random_profile(seed, stages, num_freqs)
    planner = Planner(schedule, profile)
    t_max = planner.max_frequency_time_s
    deadlines = [t_max, 1.1 * t_max, 1.3 * t_max, 2 * t_max]
    for deadline, expected in zip(deadlines, brute_force(schedule, profile, deadlines, padded=True)):
        plan = planner.plan(deadline=deadline, padded=True)
        assert plan.padded and plan.deadline_s == deadline
        assert plan.iteration_time_s <= deadline
        assert plan.energy_j == pytest.approx(expected, rel=1e-9), f"deadline {deadline}"
        assert plan.lower_bound_j <= plan.energy_j


@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_padded_plan_uses_the_slack_past_the_least_energy_time():
    """A straggler at 1.2x: the unpadded plan stops at its least-energy time T* (about 1.15x here)
    and blocks from there; the padded one slows into the slack and is certified against the
    bound of that same objective."""
    profile = load_profile(GPT3, 83.64)
    schedule = build_schedule("1f1b", 8, 12)
    planner = Planner(schedule, profile)
    deadline = 1.2 * planner.max_frequency_time_s
    unpadded = planner.plan(deadline=deadline)
    padded = planner.plan(deadline=deadline, padded=True)
    blocking = profile.blocking_power_w * schedule.num_stages
    unpadded_at_deadline = unpadded.energy_j + blocking * (deadline - unpadded.iteration_time_s)
    assert unpadded.iteration_time_s < 1.17 * planner.max_frequency_time_s
    assert padded.iteration_time_s > unpadded.iteration_time_s
    assert padded.iteration_time_s <= deadline
    evaluation = evaluate(schedule, padded.frequencies, profile)
    assert padded.energy_j == pytest.approx(
        evaluation.energy_j + blocking * (deadline - evaluation.iteration_time_s), rel=1e-12
    )
    assert padded.energy_j < 0.99 * unpadded_at_deadline
    assert padded.lower_bound_j <= padded.energy_j and padded.gap <= 0.001
    # The unpadded bound is below the padded objective's: it certifies nothing about it.
    assert unpadded.lower_bound_j < padded.lower_bound_j
    # Up to T*, padding changes neither the objective's optimum nor its bound.
    at_no_slowdown = planner.plan(padded=True)
    assert at_no_slowdown.lower_bound_j == pytest.approx(planner.plan().lower_bound_j, rel=1e-7)


def test_lp_rounding_path_meets_deadlines_and_bounds():
    # Too many choices for the exact MILP: the LP bound + rounding path alone.
    schedule = build_schedule("1f1b", 4, 16)
    profile = random_profile(7, 4, 8)
    planner = Planner(schedule, profile)
    assert num_binaries(planner.problem) > MAX_BINARIES
    ev = Evaluator(schedule, profile)
    for factor in (1.0, 1.02, 1.1, 1.3, 3.0):
        deadline = factor * planner.max_frequency_time_s
        plan = planner.plan(deadline=deadline)
        evaluation = ev.evaluate(plan.frequencies)
        assert evaluation.iteration_time_s <= deadline
        assert evaluation.energy_j == plan.energy_j
        assert plan.lower_bound_j <= plan.energy_j
        assert plan.gap < 0.02
    assert planner.plan().energy_j < planner.max_frequency_energy_j


@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_real_profile_plans_meet_deadlines():
    profile = load_profile(GPT3, 83.64)
    schedule = build_schedule("1f1b", 8, 12)
    planner = Planner(schedule, profile)
    for factor in (1.0, 1.03, 1.1, 1.5):
        deadline = factor * planner.max_frequency_time_s
        plan = planner.plan(max_slowdown=factor)
        evaluation = evaluate(schedule, plan.frequencies, profile)
        assert plan.deadline_s == deadline
        assert evaluation.iteration_time_s <= deadline
        assert evaluation.energy_j == pytest.approx(plan.energy_j, rel=1e-12)
        assert plan.lower_bound_j <= plan.energy_j
        assert plan.gap <= 0.003
    no_slowdown = planner.plan()
    assert 1 - no_slowdown.energy_j / planner.max_frequency_energy_j > 0.152  # paper: 15.2% at 8 x 12


def test_frontier_is_monotone_and_ends_at_min_energy():
    schedule = build_schedule("1f1b", 4, 16)
    planner = Planner(schedule, random_profile(11, 4, 8))
    points = planner.frontier(num_points=8)
    assert len(points) == 8
    assert points[0].plan.deadline_s == pytest.approx(planner.fastest_time_s)
    for a, b in zip(points, points[1:]):
        assert b.energy_j <= a.energy_j
        assert a.plan.deadline_s < b.plan.deadline_s
    for p in points:
        assert p.time_s <= p.plan.deadline_s
        assert p.lower_bound_j <= p.energy_j
    slowest = planner.min_energy_plan()
    # The last point is the least-energy plan, or a faster plan the sweep found cheaper (a noisy
    # profile's least-energy plan is a rounding too).
    assert points[-1].plan.deadline_s == slowest.iteration_time_s
    assert points[-1].energy_j <= slowest.energy_j
    # Past the minimum-energy time the plan stays there.
    assert planner.plan(deadline=10 * slowest.iteration_time_s).energy_j == pytest.approx(slowest.energy_j, rel=1e-6)


def test_deterministic():
    schedule = build_schedule("interleaved-1f1b", 2, 4, num_chunks=2)
    profile = random_profile(5, 2, 10)
    planner = Planner(schedule, profile)
    a = planner.plan(max_slowdown=1.05)
    planner.frontier(num_points=4)  # leaves the LP warm; a plan starts cold regardless
    assert planner.plan(max_slowdown=1.05) == a
    assert Planner(schedule, profile).plan(max_slowdown=1.05) == a


def test_replan_at_a_planned_deadline_reuses_its_relaxations(monkeypatch):
    """A Planner keeps the last deadlines' cold LP results: planning at one of them again (padded
    or not) skips those solves, and every plan equals a fresh Planner's."""
    schedule = build_schedule("1f1b", 4, 16)
    profile = random_profile(7, 4, 8)
    planner = Planner(schedule, profile)
    solves = []
    solve = HullLP.solve

    def counted(self, *args, **kwargs):
        solves.append(args)
        return solve(self, *args, **kwargs)

    monkeypatch.setattr(HullLP, "solve", counted)
    calls = [(1.05, False), (1.2, True), (1.05, True), (1.05, False), (1.2, True), (1.0, False)]
    counts = []
    for factor, padded in calls:
        solves.clear()
        plan = planner.plan(max_slowdown=factor, padded=padded)
        counts.append(len(solves))
        assert plan == Planner(schedule, profile).plan(max_slowdown=factor, padded=padded)
    # Padding 1.05 solves only its own (padded) relaxation; repeats solve nothing.
    assert counts[0] > 2 and counts[2] == 1 and counts[3] == 0 and counts[4] == 0 and counts[5] > 2


def test_unrestricted_padded_relaxation_starts_from_the_plain_basis(monkeypatch):
    """Where the plan's own LP is not restricted (large DAGs), the padded relaxation starts from
    the plain optimum's basis: the same bound as a cold padded solve, and the same plan whatever
    the Planner solved before."""
    monkeypatch.setattr(solver, "RESTRICT_MAX_NODES", 0)
    schedule = build_schedule("1f1b", 4, 16)
    profile = random_profile(7, 4, 8)
    planner = Planner(schedule, profile)
    deadline = 1.05 * planner.max_frequency_time_s
    first = planner.plan(deadline=deadline, padded=True)
    cold = HullLP(planner.problem).solve(deadline, padded=True)
    assert first.lower_bound_j == pytest.approx(cold.lower_bound_j, rel=1e-7)
    assert first.iteration_time_s <= deadline and first.lower_bound_j <= first.energy_j
    other = Planner(schedule, profile)
    other.plan(max_slowdown=1.2, padded=True)
    other.frontier(num_points=4)
    other.plan(deadline=deadline)
    assert other.plan(deadline=deadline, padded=True) == first


def test_large_dag_minimum_energy_targets_start_cold(monkeypatch):
    """Above SEED_MIN_NODES the minimum-energy targets are cold solves: past the least-energy
    time a plan is the same whatever the Planner solved before, and meets its deadline."""
    monkeypatch.setattr(solver, "SEED_MIN_NODES", 0)
    schedule = build_schedule("1f1b", 4, 16)
    profile = random_profile(7, 4, 8)
    planner = Planner(schedule, profile)
    deadline = 3.0 * planner.max_frequency_time_s
    first = planner.plan(deadline=deadline, padded=True)
    assert first.iteration_time_s <= deadline and first.lower_bound_j <= first.energy_j
    other = Planner(schedule, profile)
    other.frontier(num_points=4)
    other.plan(max_slowdown=1.05)
    assert other.plan(deadline=deadline, padded=True) == first
    assert other.min_energy_plan().energy_j <= planner.max_frequency_energy_j


def test_frontier_points_state_their_gap():
    planner = Planner(build_schedule("1f1b", 2, 4), random_profile(2, 2, 5))
    for point in planner.frontier(num_points=4):
        assert point.gap == pytest.approx((point.energy_j - point.lower_bound_j) / point.lower_bound_j)
        assert point.gap == point.plan.gap


def test_bad_deadlines():
    planner = Planner(build_schedule("1f1b", 2, 3), random_profile(1, 2, 3))
    with pytest.raises(PlanError, match="fastest"):
        planner.plan(deadline=0.5 * planner.fastest_time_s)
    smallest = planner.fastest_time_s / planner.max_frequency_time_s
    with pytest.raises(PlanError, match=rf"a slowdown of 0.5x .* the factor must be at least {smallest:.6g} "):
        planner.plan(max_slowdown=0.5)
    with pytest.raises(ConfigError, match="either"):
        planner.plan(deadline=1.0, max_slowdown=1.1)
    with pytest.raises(ConfigError):
        planner.plan(max_slowdown=-1)
    with pytest.raises(ConfigError):
        planner.frontier(num_points=1)
    with pytest.raises(ConfigError, match=r"max_slowdown must be a number, e.g. 1.1; got '1.1' \(str\)"):
        planner.plan(max_slowdown="1.1")
    with pytest.raises(ConfigError, match="deadline must be a number"):
        planner.plan(deadline=True)


def test_plan_json_round_trip():
    schedule = build_schedule("interleaved-1f1b", 2, 4, num_chunks=2)
    planner = Planner(schedule, random_profile(3, 2, 4))
    plan = planner.plan(max_slowdown=1.1)
    doc = plan.to_json()
    assert {"iteration_time_s", "energy_j", "lower_bound_j", "stages"} <= set(doc)
    assert [s["stage"] for s in doc["stages"]] == [0, 1]
    assert {"kind", "microbatch", "frequency", "chunk"} <= set(doc["stages"][1]["instructions"][0])
    back = Plan.from_json(doc, schedule)
    assert back == plan
    padded = planner.plan(max_slowdown=1.3, padded=True)
    assert padded.to_json()["padded"] is True
    assert Plan.from_json(padded.to_json(), schedule) == padded
    with pytest.raises(PlanError, match="padded"):
        Plan.from_json({**doc, "padded": "yes"}, schedule)
    assert back.stage_frequencies(1) == [plan.frequencies[ins] for ins in schedule.stages[1]]
    with pytest.raises(PlanError, match="plan again"):
        Plan.from_json(doc, build_schedule("interleaved-1f1b", 2, 6, num_chunks=2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exchange_keeps_deadline_and_never_costs_more(seed):
    from perseus.planner.lp import HullLP
    from perseus.planner.rounding import exchange, fill_slack, round_down

    schedule = build_schedule("1f1b", 4, 12)
    planner = Planner(schedule, random_profile(seed, 4, 12))
    problem = planner.problem
    deadline = 1.05 * planner.max_frequency_time_s
    start = fill_slack(problem, round_down(problem, HullLP(problem).solve(deadline).finish_s), deadline)
    t0, e0 = problem.energy(start)
    t1, e1 = problem.energy(exchange(problem, start, deadline))
    assert t0 <= deadline and t1 <= deadline
    assert e1 <= e0


QUIET_PLANNING = """
import os


def no_redirect(*args):
    raise AssertionError("planning redirected a file descriptor")


os.dup2 = no_redirect  # the banner must stay hidden without touching the process's stdout
from perseus.planner import Planner
from perseus.profiler import Profile, ProfilePoint
from perseus.schedules import build_schedule

points = {
    (s, kind): [ProfilePoint(f, t * 1410 / f, t * 1410 / f * (80 + f / 10)) for f in (1410, 1200, 1005)]
    for s in range(2)
    for kind, t in (("forward", 1.0), ("backward", 2.0))
}
planner = Planner(build_schedule("1f1b", 2, 4), Profile(points, 60.0))
print("planned", planner.plan(max_slowdown=1.1).lower_bound_j > 0, planner.plan().lower_bound_j > 0)
"""


def test_planning_prints_no_highs_banner(capfd):
    """HiGHS prints a banner when an instance first logs (highspy's constructor does); the
    planner's instances have output off before then. A fresh interpreter, so its first HiGHS
    instance is the planner's; it writes to this test's captured file descriptor 1."""
    done = subprocess.run([sys.executable, "-c", QUIET_PLANNING], timeout=120)
    out, err = capfd.readouterr()
    assert done.returncode == 0, err
    assert out == "planned True True\n"


AFTER_ANOTHER_HIGHS_USER = """
import cvxpy as cp

x = cp.Variable()
cp.Problem(cp.Minimize(x), [x >= 1]).solve(solver=cp.HIGHS)  # starts HiGHS' thread pool its own way
from perseus.planner import Planner
from perseus.profiler import Profile, ProfilePoint
from perseus.schedules import build_schedule

points = {
    (s, kind): [ProfilePoint(f, t * 1410 / f, t * 1410 / f * (80 + f / 10)) for f in (1410, 1200, 1005, 900)]
    for s in range(2)
    for kind, t in (("forward", 1.0 + s), ("backward", 2.0))
}
planner = Planner(build_schedule("1f1b", 2, 4), Profile(points, 60.0))
print("planned", planner.plan().gap < 0.05, planner.plan(max_slowdown=1.2, padded=True).gap < 0.05)
"""


def test_planning_after_another_highs_user():
    """HiGHS refuses to run an instance whose thread count differs from the process's running
    thread pool; the planner must plan whoever started HiGHS first (here cvxpy)."""
    done = subprocess.run([sys.executable, "-c", AFTER_ANOTHER_HIGHS_USER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("planned True True")


def _retried_plans_better(monkeypatch, knobs: dict[str, float], schedule, seeds, factors) -> int:
    """How many plans the retry that `knobs` gate (off at inf, on at their thresholds) made cheaper,
    checking on each that it never costs energy, meets the deadline, and plans the same on a
    fresh Planner and after others."""
    better = 0
    for seed in seeds:
        profile = random_profile(seed, 4, 10)
        for factor in factors:
            for knob in knobs:
                monkeypatch.setattr(solver, knob, float("inf"))
            without = Planner(schedule, profile).plan(max_slowdown=factor, padded=factor > 1)
            for knob, threshold in knobs.items():
                monkeypatch.setattr(solver, knob, threshold)
            planner = Planner(schedule, profile)
            plan = planner.plan(max_slowdown=factor, padded=factor > 1)
            assert plan.iteration_time_s <= factor * planner.max_frequency_time_s
            assert plan.energy_j <= without.energy_j
            better += plan.energy_j < without.energy_j
            planner.frontier(num_points=4)
            planner.plan(max_slowdown=1.2, padded=True)
            assert planner.plan(max_slowdown=factor, padded=factor > 1) == plan
    return better


def test_a_plan_far_from_its_bound_is_tried_again_with_looser_deadlines_optima(monkeypatch):
    """Where the deadline binds and a plan lands more than LOOSER_RETRY_GAP above its bound, the
    roundings of looser deadlines' optima are tried too: never more energy than without them,
    sometimes less, within the deadline, and the same plan on a fresh Planner and after others."""
    schedule = build_schedule("1f1b", 4, 16)
    for later in ("HULL_RETRY_GAP", "OVER_RETRY_GAP", "OVER_RETRY_GAP_SLOWER"):
        monkeypatch.setattr(solver, later, float("inf"))  # the looser optima alone (later retries find some)
    assert _retried_plans_better(monkeypatch, {"LOOSER_RETRY_GAP": 0.005}, schedule, (1, 3), (1.0, 1.01, 1.02)) >= 3


def test_steady_state_pinning_only_ever_lowers_the_energy(monkeypatch):
    """Where a plan lands more than STEADY_RETRY_GAP (past no slowdown: STEADY_RETRY_GAP_SLOWER)
    above its bound in a pipeline with a steady state, the roundings of relaxations with the
    steady instructions pinned are tried too: never more energy than without them, sometimes
    less, within the deadline, and the same plan on a fresh Planner and after others."""
    schedule = build_schedule("1f1b", 4, 24)
    knobs = {"STEADY_RETRY_GAP": 0.002, "STEADY_RETRY_GAP_SLOWER": 0.001}
    assert _retried_plans_better(monkeypatch, knobs, schedule, (2, 3, 6), (1.0, 1.05, 1.1)) >= 4


def test_rounding_onto_hull_vertices_only_ever_lowers_the_energy(monkeypatch):
    """Where a plan lands more than HULL_RETRY_GAP above its bound, every relaxation it was
    rounded from is rounded again onto hull vertices alone: never more energy than without,
    sometimes less, within the deadline, and the same plan on a fresh Planner and after others."""
    schedule = build_schedule("1f1b", 4, 16)
    assert _retried_plans_better(monkeypatch, {"HULL_RETRY_GAP": 0.001}, schedule, (1, 2, 3), (1.0, 1.05, 1.1)) >= 2


def test_rounding_past_finish_times_only_ever_lowers_the_energy(monkeypatch):
    """Where a plan lands more than OVER_RETRY_GAP (past no slowdown: OVER_RETRY_GAP_SLOWER) above
    its bound, every relaxation it was rounded from is rounded again past its finish times
    (`round_over`): never more energy than without, sometimes less, within the deadline, and the
    same plan on a fresh Planner and after others."""
    schedule = build_schedule("1f1b", 4, 24)
    knobs = {"OVER_RETRY_GAP": 0.002, "OVER_RETRY_GAP_SLOWER": 0.001}
    assert _retried_plans_better(monkeypatch, knobs, schedule, (1, 2, 3), (1.0, 1.05, 1.1)) >= 3


def test_frontier_points_far_from_their_bound_are_tried_again(monkeypatch):
    """A frontier point more than FRONTIER_RETRY_GAP above its bound gets a single plan's retries:
    no point costs more than without them, some cost less, the sweep after a retried point goes on
    as before, and a fresh Planner draws the same frontier."""
    schedule = build_schedule("1f1b", 4, 16)
    better = 0
    for seed in (1, 2, 3):
        profile = random_profile(seed, 4, 10)
        monkeypatch.setattr(solver, "FRONTIER_RETRY_GAP", float("inf"))
        without = Planner(schedule, profile).frontier(num_points=8)
        monkeypatch.setattr(solver, "FRONTIER_RETRY_GAP", 0.01)
        points = Planner(schedule, profile).frontier(num_points=8)
        for before, after in zip(without, points):
            assert after.energy_j <= before.energy_j
            assert after.plan.iteration_time_s <= after.plan.deadline_s
            better += after.energy_j < before.energy_j
        assert [p.plan for p in Planner(schedule, profile).frontier(num_points=8)] == [p.plan for p in points]
    assert better >= 8


def test_a_choice_on_the_hull_maps_back_to_the_same_clock():
    problem = Planner(build_schedule("1f1b", 4, 8), random_profile(5, 4, 10)).problem
    on_hull = problem.on_hull()
    for h, o in zip(on_hull.options, problem.options):
        assert (h.time == o.time[o.hull]).all() and (h.hull == np.arange(len(o.hull))).all()
    last = np.array([len(on_hull.node_options(i).time) - 1 for i in range(problem.num_nodes)])
    for choice in (on_hull.fastest(), last):
        assert (on_hull.frequencies(choice) == problem.frequencies(problem.from_hull(choice))).all()
        assert on_hull.energy(choice) == problem.energy(problem.from_hull(choice))
