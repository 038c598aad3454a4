"""Pair exchanges: the vectorized sweep makes exactly the moves of a plain sequential sweep (the
planner's former implementation, kept here as the oracle), so plans never get worse for it; and
the C passes (walk, latest finish, pair sweeps) give the Python ones' bits."""

from __future__ import annotations

import numpy as np
import pytest
from test_solver import GPT3, random_profile

from perseus.planner import Planner, rounding
from perseus.planner.lp import HullLP
from perseus.planner.rounding import Walker, _pair_sweep, exchange, fill_slack, round_down, round_over
from perseus.profiler import load_profile
from perseus.schedules import build_schedule


def sequential_sweep(walker: Walker, choice: list[int], deadline_s: float, reach: int) -> int:
    """One sweep, node by node: the best improving pair move of each unlocked node, then lock."""
    n = len(walker.times)
    dur = [walker.times[i][choice[i]] for i in range(n)]
    lf = walker.latest_finish(choice, deadline_s)
    locked = [False] * n
    moves = 0
    for i in range(n):
        succs = walker.succs[i]
        if locked[i] or not succs:
            continue
        times_i, costs_i, ki = walker.times[i], walker.costs[i], choice[i]
        start_i = max((lf[p] for p in walker.preds[i]), default=0.0)
        best = None
        for j in succs:
            if locked[j]:
                continue
            limit_i = min((lf[k] - dur[k] for k in succs if k != j), default=deadline_s)
            others = max((lf[p] for p in walker.preds[j] if p != i), default=0.0)
            times_j, costs_j, kj = walker.times[j], walker.costs[j], choice[j]
            for a in range(max(0, ki - reach), min(len(times_i), ki + reach + 1)):
                end_i = start_i + times_i[a]
                if end_i > limit_i:
                    break
                start_j = max(end_i, others)
                b = min(kj + reach, len(times_j) - 1)
                while b >= 0 and start_j + times_j[b] > lf[j]:
                    b -= 1
                if b < 0:
                    continue
                gain = (costs_i[ki] - costs_i[a]) + (costs_j[kj] - costs_j[b])
                if gain > 1e-9 and (best is None or gain > best[0]):
                    best = (gain, j, a, b)
        if best is not None:
            _, j, a, b = best
            choice[i], choice[j] = a, b
            moves += 1
            for x in (i, j):
                locked[x] = True
                for y in walker.preds[x] + walker.succs[x]:
                    locked[y] = True
    return moves


def sweep_both(planner: Planner, deadline: float) -> int:
    """Sweep to the end with both implementations from the same rounded plan; they must agree
    move for move. Returns the number of moves."""
    problem = planner.problem
    walker = Walker(problem)
    start = fill_slack(problem, round_down(problem, HullLP(problem).solve(deadline).finish_s, 1e-9), deadline)
    fast, slow = start.tolist(), start.tolist()
    total = 0
    while True:
        moved = _pair_sweep(walker, fast, deadline, 3)
        assert sequential_sweep(walker, slow, deadline, 3) == moved
        assert fast == slow
        total += moved
        if not moved:
            break
    t0, e0 = problem.energy(start)
    t1, e1 = problem.energy(np.array(fast))
    assert t1 <= deadline and e1 <= e0
    return total


@pytest.mark.parametrize(
    "name,stages,microbatches",
    [("1f1b", 4, 12), ("gpipe", 3, 6), ("zb-h1", 3, 6), ("interleaved-1f1b", 2, 4)],
)
def test_vectorized_sweep_makes_the_sequential_moves(name, stages, microbatches):
    schedule = build_schedule(name, stages, microbatches, num_chunks=2 if name.startswith("interleaved") else 1)
    moves = 0
    for seed in range(6):
        planner = Planner(schedule, random_profile(seed, stages, 12))
        for slowdown in (1.0, 1.05, 1.2):
            moves += sweep_both(planner, slowdown * planner.max_frequency_time_s)
    assert moves > 0


@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_vectorized_sweep_on_gpt3():
    planner = Planner(build_schedule("1f1b", 8, 12), load_profile(GPT3, 83.64))
    assert sum(sweep_both(planner, f * planner.max_frequency_time_s) for f in (1.0, 1.1)) > 0


def python_exchange(walker: Walker, choice: np.ndarray, deadline: float) -> np.ndarray:
    current = choice.tolist()
    while _pair_sweep(walker, current, deadline, 3):
        pass
    return np.array(current)


@pytest.mark.skipif(rounding._flow is None, reason="the planner's C extension is not built here")
@pytest.mark.parametrize("name,stages,microbatches", [("1f1b", 4, 12), ("zb-h1", 3, 6), ("interleaved-1f1b", 2, 4)])
def test_c_passes_give_the_python_bits(name, stages, microbatches):
    schedule = build_schedule(name, stages, microbatches, num_chunks=2 if name.startswith("interleaved") else 1)
    moved = 0
    for seed in range(4):
        planner = Planner(schedule, random_profile(seed, stages, 12))
        problem = planner.problem
        walker = Walker(problem)
        for slowdown in (1.0, 1.05, 1.2):
            deadline = slowdown * planner.max_frequency_time_s
            limit = np.asarray(HullLP(problem).solve(deadline).finish_s) + 1e-9
            walked = walker.walk(limit)
            assert walked.tolist() == walker._walk_loop(limit.tolist())
            latest = walker.latest_finish(walked, deadline)
            assert latest.tobytes() == np.array(walker._latest_finish_loop(walked.tolist(), deadline)).tobytes()
            start = fill_slack(problem, walked, deadline, walker)
            in_c = start.astype(np.int32)
            rounding._flow.exchange(*walker.graph, in_c, deadline, 3)
            assert in_c.tolist() == python_exchange(walker, start, deadline).tolist()
            assert (
                exchange(problem, start, deadline, walker).tolist()
                == fill_slack(problem, in_c.astype(np.int64), deadline, walker).tolist()
            )
            moved += int((in_c != start).sum())
    assert moved > 0


@pytest.mark.skipif(rounding._flow is None, reason="the planner's C extension is not built here")
def test_c_passes_refuse_arrays_that_would_read_out_of_bounds():
    walker = Walker(Planner(build_schedule("1f1b", 2, 4), random_profile(0, 2, 6)).problem)
    n = len(walker.times)
    pred_ptr, pred_idx, succ_ptr, succ_idx, node_type, time, cost, count, width = walker.graph
    choice = np.zeros(n, dtype=np.int32)
    with pytest.raises(ValueError, match="predecessors"):
        rounding._flow.walk(
            pred_ptr, pred_idx[::-1].copy(), succ_ptr, succ_idx, node_type, time, cost, count, width, np.ones(n), choice
        )
    with pytest.raises(ValueError, match="node_type"):
        rounding._flow.walk(*walker.graph[:4], node_type + 100, *walker.graph[5:], np.ones(n), choice)
    with pytest.raises(ValueError, match="not a choice"):
        rounding._flow.exchange(*walker.graph, np.full(n, width, dtype=np.int32), 1.0, 3)
    with pytest.raises(ValueError, match="limit"):
        rounding._flow.walk(*walker.graph, np.ones(n - 1), choice)


def test_rounding_past_finish_times_keeps_the_deadline():
    """`round_over` lets each node end up to a fraction of its step past its relaxed finish and
    takes the excess back by scaling every finish time down: the result always meets the deadline;
    with no overshoot it is rounding down; where no scale can fit, it says so (None)."""
    problem = Planner(build_schedule("1f1b", 4, 12), random_profile(4, 4, 10)).problem
    walker = Walker(problem)
    fastest = problem.iteration_time(problem.times(problem.fastest()))
    for factor in (1.0, 1.05, 1.2):
        deadline = factor * fastest
        relaxed = HullLP(problem).solve(deadline)
        assert np.array_equal(
            round_over(problem, relaxed.finish_s, relaxed.duration_s, 0.0, deadline, walker),
            round_down(problem, relaxed.finish_s, walker=walker),
        )
        for overshoot in (0.25, 0.5, 1.0):
            rounded = round_over(problem, relaxed.finish_s, relaxed.duration_s, overshoot, deadline, walker)
            assert rounded is not None
            assert problem.iteration_time(problem.times(rounded)) <= deadline
    relaxed = HullLP(problem).solve(fastest)
    assert round_over(problem, relaxed.finish_s, relaxed.duration_s, 0.5, 0.9 * fastest, walker) is None
