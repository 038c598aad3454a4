"""From continuous durations to profile frequencies, never breaking the deadline.

`round_down` and `fill_slack` walk the nodes in topological order, start each node when its
predecessors end (exactly as the evaluator does, so the floating-point times agree bit for bit)
and give it the cheapest choice that still ends by a per-node limit. Cheaper is slower on the
Pareto set, so "cheapest within a limit" is "slowest within a limit". `exchange` then trades time
between dependent pairs, and ends with such a walk, so its result is checked the same way.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from perseus.planner.problem import Problem


class Walker:
    """Plain-Python views of a Problem's arrays (built once per Problem): the passes are scalar
    loops, and over lists those beat per-element numpy calls."""

    def __init__(self, problem: Problem) -> None:
        dag = problem.dag
        ptr, idx = dag.pred_ptr.tolist(), dag.pred_idx.tolist()
        self.preds = [idx[ptr[i] : ptr[i + 1]] for i in range(problem.num_nodes)]
        sptr, sidx = dag.succ_ptr.tolist(), dag.succ_idx.tolist()
        self.succs = [sidx[sptr[i] : sptr[i + 1]] for i in range(problem.num_nodes)]
        type_times = [opts.time.tolist() for opts in problem.options]
        type_costs = [opts.cost.tolist() for opts in problem.options]
        self.times = [type_times[k] for k in problem.node_type.tolist()]
        self.costs = [type_costs[k] for k in problem.node_type.tolist()]

    def walk(self, limit: list[float]) -> list[int]:
        """Topological pass: node i takes the slowest choice that ends by limit[i] (the fastest
        if none does; the caller re-checks the deadline)."""
        end = [0.0] * len(self.times)
        out = [0] * len(self.times)
        for i, times in enumerate(self.times):
            start = max((end[p] for p in self.preds[i]), default=0.0)
            k = bisect_right(times, limit[i] - start) - 1
            # Correct for rounding in `limit - start`: the test that counts is start + t <= limit.
            while k >= 0 and start + times[k] > limit[i]:
                k -= 1
            if k + 1 < len(times) and start + times[k + 1] <= limit[i]:
                k += 1
            out[i] = max(k, 0)
            end[i] = start + times[out[i]]
        return out

    def latest_finish(self, choice: list[int], deadline_s: float) -> list[float]:
        """Latest end of every node such that, with successors at their current choices, the
        iteration still ends by the deadline."""
        n = len(self.times)
        latest = [deadline_s] * n
        for i in range(n - 1, -1, -1):
            for j in self.succs[i]:
                v = latest[j] - self.times[j][choice[j]]
                if v < latest[i]:
                    latest[i] = v
        return latest


def round_down(
    problem: Problem, finish_s: np.ndarray, slack_s: float = 0.0, walker: Walker | None = None
) -> np.ndarray:
    """Each node at the slowest choice that ends by its relaxed finish time (plus `slack_s`, a
    tolerance for the LP's own rounding). Nodes start no later than in the relaxation."""
    walker = walker or Walker(problem)
    limit = (np.asarray(finish_s) + slack_s).tolist()
    return np.array(walker.walk(limit), dtype=np.int64)


def fill_slack(problem: Problem, choice: np.ndarray, deadline_s: float, walker: Walker | None = None) -> np.ndarray:
    """Slow every node down into the slack the deadline leaves it, earliest nodes first. A plan
    that met the deadline still meets it; each node is at least as slow (as cheap) as before."""
    walker = walker or Walker(problem)
    current = choice.tolist()
    latest = walker.latest_finish(current, deadline_s)
    return np.array(walker.walk(latest), dtype=np.int64)


def exchange(
    problem: Problem, choice: np.ndarray, deadline_s: float, walker: Walker | None = None, reach: int = 3
) -> np.ndarray:
    """Local search over dependent pairs (i -> j): re-choose both within `reach` steps of their
    current choices so that together they cost less and still fit, e.g. one instruction one step
    slower and its successor one step faster. Rounding leaves gaps shorter than any single step;
    a pair can fill them. Sweeps until no pair improves, then fills any slack left. A plan that
    met `deadline_s` still meets it."""
    walker = walker or Walker(problem)
    current = choice.tolist()
    while _pair_sweep(walker, current, deadline_s, reach):
        pass
    return fill_slack(problem, np.array(current, dtype=np.int64), deadline_s, walker)


def _pair_sweep(walker: Walker, choice: list[int], deadline_s: float, reach: int) -> int:
    """One sweep of improving pair moves, in place; returns how many were made.

    Feasibility is checked against latest finishes (`lf`) of the sweep's start state: every
    node that ends by its lf keeps the deadline. A moved pair takes its predecessors' latest
    finishes as their ends (safe whatever else moves), and the pair and its neighbours are then
    locked for the rest of the sweep, so no later move relies on a changed value."""
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
                for y in walker.preds[x]:
                    locked[y] = True
                for y in walker.succs[x]:
                    locked[y] = True
    return moves
