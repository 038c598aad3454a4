"""From continuous durations to profile frequencies, never breaking the deadline.

`round_down` and `fill_slack` walk the nodes in topological order, start each node when its
predecessors end (exactly as the evaluator does, so the floating-point times agree bit for bit)
and give it the cheapest choice that still ends by a per-node limit. Cheaper is slower on the
Pareto set, so "cheapest within a limit" is "slowest within a limit". `exchange` then trades time
between dependent pairs, and ends with such a walk, so its result is checked the same way.

The passes run in the planner's C extension where it is built (the walks and pair sweeps were
about half of a re-plan's time at 8 x 96 in Python), with the same float operations as the Python
versions kept here for builds without a compiler, so the same plans either way.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from perseus.planner.native import extension as _flow
from perseus.planner.problem import Problem

# `round_over`: the largest fraction of every finish time it takes back (2%: a few steps of an
# instruction at most), and the bisections that find the least (2% / 2^16: ~5 us in 16 s).
_OVER_MAX_SCALE = 0.02
_OVER_BISECTIONS = 16


@dataclass(frozen=True)
class PairArrays:
    """What a vectorized pair sweep reads: choice tables per type (padded with +inf), every
    dependent pair (i -> j) sorted by i (`pair_ptr` slices a node's pairs), and padded
    predecessor and successor tables (slot value n: none)."""

    node_type: np.ndarray
    time: np.ndarray
    cost: np.ndarray
    count: np.ndarray
    pair_i: np.ndarray
    pair_j: np.ndarray
    pair_ptr: list[int]
    pred_pad: np.ndarray
    succ_pad: np.ndarray

    @classmethod
    def build(cls, problem: Problem) -> PairArrays:
        dag = problem.dag
        n = problem.num_nodes
        time, cost = problem.table("time"), problem.table("cost")
        count = np.array([len(o) for o in problem.options], dtype=np.int64)
        order = np.lexsort((dag.dst, dag.src))
        pair_i, pair_j = dag.src[order], dag.dst[order]
        out_degree = np.diff(dag.succ_ptr)
        succ_pad = np.full((n, max(int(out_degree.max(initial=0)), 1)), n, dtype=np.int64)
        slot = np.arange(len(pair_i)) - dag.succ_ptr[pair_i]
        succ_pad[pair_i, slot] = pair_j
        pred_pad = np.where(dag.pred_pad == n, n, dag.pred_pad)
        return cls(problem.node_type, time, cost, count, pair_i, pair_j, dag.succ_ptr.tolist(), pred_pad, succ_pad)


class Walker:
    """The rounding's passes over one Problem's DAG: in C where the extension is built (`graph`:
    its arrays as the C functions take them), else scalar Python loops over plain lists (over
    lists those beat per-element numpy calls)."""

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
        self.arrays = a = PairArrays.build(problem)
        self.graph: tuple | None = None
        if _flow is not None:
            # Successors in pair order (by node, then successor), as the Python sweep ranks ties.
            i32 = np.int32
            self.graph = (
                *(x.astype(i32) for x in (dag.pred_ptr, dag.pred_idx, dag.succ_ptr, a.pair_j, a.node_type)),
                np.ascontiguousarray(a.time).ravel(),
                np.ascontiguousarray(a.cost).ravel(),
                a.count.astype(i32),
                a.time.shape[1],
            )

    def walk(self, limit: np.ndarray) -> np.ndarray:
        """Topological pass: node i takes the slowest choice that ends by limit[i] (the fastest
        if none does; the caller re-checks the deadline)."""
        limit = np.ascontiguousarray(limit, dtype=float)
        if self.graph is None:
            return np.array(self._walk_loop(limit.tolist()), dtype=np.int64)
        choice = np.empty(len(self.times), dtype=np.int32)
        _flow.walk(*self.graph, limit, choice)  # type: ignore[union-attr]
        return choice.astype(np.int64)

    def latest_finish(self, choice: np.ndarray, deadline_s: float) -> np.ndarray:
        """Latest end of every node such that, with successors at their current choices, the
        iteration still ends by the deadline."""
        if self.graph is None:
            return np.array(self._latest_finish_loop(np.asarray(choice).tolist(), deadline_s))
        latest = np.empty(len(self.times))
        _flow.latest_finish(*self.graph, np.asarray(choice, dtype=np.int32), float(deadline_s), latest)  # type: ignore[union-attr]
        return latest

    def _walk_loop(self, limit: list[float]) -> list[int]:
        n = len(self.times)
        end = [0.0] * n
        out = [0] * n
        preds = self.preds
        for i, times in enumerate(self.times):
            # Most nodes wait on one predecessor: no max() over a generator for them (the hot loop).
            p = preds[i]
            if len(p) == 1:
                start = end[p[0]]
            elif p:
                start = max([end[q] for q in p])
            else:
                start = 0.0
            li = limit[i]
            k = bisect_right(times, li - start) - 1
            # Correct for rounding in `limit - start`: the test that counts is start + t <= limit.
            while k >= 0 and start + times[k] > li:
                k -= 1
            if k + 1 < len(times) and start + times[k + 1] <= li:
                k += 1
            if k < 0:
                k = 0
            out[i] = k
            end[i] = start + times[k]
        return out

    def _latest_finish_loop(self, choice: list[int], deadline_s: float) -> list[float]:
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
    return walker.walk(np.asarray(finish_s) + slack_s)


def round_over(
    problem: Problem,
    finish_s: np.ndarray,
    duration_s: np.ndarray,
    overshoot: float,
    deadline_s: float,
    walker: Walker | None = None,
) -> np.ndarray | None:
    """Each node at the slowest choice that ends by its relaxed finish time plus `overshoot` of
    its local step (the gap between the two choices around its relaxed duration), with every
    finish time scaled down by the least factor (bisected) that keeps the deadline; None if none
    does. Rounding down wastes up to a step of time at every node where two predecessors meet;
    rounding to the nearer choice wastes less and pays it back with a slightly earlier schedule
    (GPT-3 A100 with jittered points, 8 x 96 at no slowdown: 0.73% -> 0.61% from the bound)."""
    walker = walker or Walker(problem)
    step = np.empty(problem.num_nodes)
    for k, opts in enumerate(problem.options):
        nodes = np.flatnonzero(problem.node_type == k)
        if len(opts) < 2:
            step[nodes] = 0.0
            continue
        above = np.clip(np.searchsorted(opts.time, duration_s[nodes]), 1, len(opts) - 1)
        step[nodes] = opts.time[above] - opts.time[above - 1]
    reach = np.asarray(finish_s) + overshoot * step

    def fits(scale: float) -> np.ndarray | None:
        choice = walker.walk(reach - scale * np.asarray(finish_s))
        return choice if problem.iteration_time(problem.times(choice)) <= deadline_s else None

    best = fits(0.0)
    if best is not None:
        return best
    low, high = 0.0, _OVER_MAX_SCALE
    best = fits(high)
    if best is None:
        return None
    for _ in range(_OVER_BISECTIONS):
        middle = 0.5 * (low + high)
        choice = fits(middle)
        if choice is None:
            low = middle
        else:
            high, best = middle, choice
    return best


def fill_slack(problem: Problem, choice: np.ndarray, deadline_s: float, walker: Walker | None = None) -> np.ndarray:
    """Slow every node down into the slack the deadline leaves it, earliest nodes first. A plan
    that met the deadline still meets it; each node is at least as slow (as cheap) as before."""
    walker = walker or Walker(problem)
    return walker.walk(walker.latest_finish(choice, deadline_s))


def exchange(
    problem: Problem, choice: np.ndarray, deadline_s: float, walker: Walker | None = None, reach: int = 3
) -> np.ndarray:
    """Local search over dependent pairs (i -> j): re-choose both within `reach` steps of their
    current choices so that together they cost less and still fit, e.g. one instruction one step
    slower and its successor one step faster. Rounding leaves gaps shorter than any single step;
    a pair can fill them. Sweeps until no pair improves, then fills any slack left. A plan that
    met `deadline_s` still meets it."""
    walker = walker or Walker(problem)
    if walker.graph is not None:
        moved = choice.astype(np.int32)
        _flow.exchange(*walker.graph, moved, float(deadline_s), reach)  # type: ignore[union-attr]
        return fill_slack(problem, moved.astype(np.int64), deadline_s, walker)
    current = choice.tolist()
    while _pair_sweep(walker, current, deadline_s, reach):
        pass
    return fill_slack(problem, np.array(current, dtype=np.int64), deadline_s, walker)


def _pair_sweep(walker: Walker, choice: list[int], deadline_s: float, reach: int) -> int:
    """One sweep of improving pair moves, in place; returns how many were made.

    Feasibility is checked against latest finishes (`lf`) of the sweep's start state: every
    node that ends by its lf keeps the deadline. A moved pair takes its predecessors' latest
    finishes as their ends (safe whatever else moves), and the pair and its neighbours are then
    locked for the rest of the sweep, so no later move relies on a changed value. Every input of
    a pair's best move is therefore a start-state value: all pairs are scored at once (numpy),
    and only the improving ones are walked in order to apply the locks."""
    a = walker.arrays
    k = np.asarray(choice, dtype=np.int64)
    lf = np.append(walker.latest_finish(np.array(choice), deadline_s), -np.inf)
    dur = a.time[a.node_type, k]
    i, j = a.pair_i, a.pair_j
    # Start of i: its predecessors' latest finishes; of j: those of its predecessors but i.
    start_i = np.maximum(lf[a.pred_pad].max(axis=1), 0.0)[i]
    pj = a.pred_pad[j]
    others = np.maximum(np.where(pj == i[:, None], -np.inf, lf[pj]).max(axis=1), 0.0)
    # i must end before its other successors must start.
    sk = a.succ_pad[i]
    room = np.where((sk == j[:, None]) | (sk == len(k)), np.inf, lf[sk] - dur[np.minimum(sk, len(k) - 1)])
    limit_i = np.minimum(room.min(axis=1), deadline_s)
    steps = np.arange(-reach, reach + 1)
    ti, tj = a.node_type[i], a.node_type[j]
    ci = a.cost[ti, k[i]]
    cj = a.cost[tj, k[j]]
    ka = k[i][:, None] + steps  # (pairs, A)
    ok_a = (ka >= 0) & (ka < a.count[ti][:, None])
    ka = np.clip(ka, 0, a.time.shape[1] - 1)
    end_i = start_i[:, None] + a.time[ti[:, None], ka]
    ok_a &= end_i <= limit_i[:, None]
    start_j = np.maximum(end_i, others[:, None])  # (pairs, A)
    # The slowest b within reach above j's choice that still ends by lf[j] (choices are sorted
    # fastest first, so those that fit are a prefix of j's table; any of it, however far below).
    fit = _prefix_fitting(a.time, tj, start_j, lf[j])
    b = np.minimum(fit - 1, np.minimum(k[j] + reach, a.count[tj] - 1)[:, None])
    any_b = (b >= 0) & ok_a
    b = np.maximum(b, 0)
    gain = (ci[:, None] - a.cost[ti[:, None], ka]) + (cj[:, None] - a.cost[tj[:, None], b])
    gain = np.where(any_b, gain, -np.inf)
    best_a = np.argmax(gain, axis=1)
    best_gain = gain[np.arange(len(i)), best_a]
    moves = 0
    locked = [False] * len(k)
    for e in np.flatnonzero(best_gain > 1e-9).tolist():
        ii, jj = int(i[e]), int(j[e])
        if locked[ii] or locked[jj]:
            continue
        # The best pair of ii among its unlocked successors (earliest on ties), as a sequential sweep.
        group = [f for f in range(a.pair_ptr[ii], a.pair_ptr[ii + 1]) if best_gain[f] > 1e-9 and not locked[int(j[f])]]
        f = max(group, key=lambda g: (best_gain[g], -g))
        jj = int(j[f])
        choice[ii] = int(ka[f, best_a[f]])
        choice[jj] = int(b[f, best_a[f]])
        moves += 1
        for x in (ii, jj):
            locked[x] = True
            for y in walker.preds[x]:
                locked[y] = True
            for y in walker.succs[x]:
                locked[y] = True
    return moves


def _prefix_fitting(time: np.ndarray, node_type: np.ndarray, start: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """For each row p and column a: how many of type node_type[p]'s choices end by limit[p] when
    started at start[p, a], i.e. the count of k with start + time[k] <= limit (exactly that float
    test). Choice times rise along a row (+inf pads), so the choices that fit are a prefix and a
    binary search over the row's width finds its length."""
    width = time.shape[1]
    count = np.zeros(start.shape, dtype=np.int64)
    step = 1 << (width.bit_length() - 1)
    rows = node_type[:, None]
    while step:
        probe = count + step
        inside = probe <= width
        fits = start + time[rows, np.minimum(probe, width) - 1] <= limit[:, None]
        count = np.where(inside & fits, probe, count)
        step >>= 1
    return count
