"""The LP relaxation: a certified lower bound on a plan's energy at a deadline.

Each instruction's duration d_i may take any value on its hull (continuous in [t_min, t_max]) and
costs the lower convex hull of its choices' effective energies there. Minimising
sum(hull_i(d_i)) + P_block * N * T over start times S with S_j >= S_i + d_i along every edge and
S_i + d_i <= T <= deadline is project crashing with convex costs. Its optimum is at most the
energy of any frequency plan that meets the deadline, so it certifies how far a plan can be from
optimal, and its durations guide the rounding.

With `padded`, every stage blocks until the deadline whatever the plan (a straggler sets the
pace): the objective is sum(hull_i(d_i)) + P_block * N * deadline, so T has no cost and the plan
may use all the slack; for deadlines up to the minimum-energy time both optima coincide.

Hull costs are written as d_i = t_min,i + sum_k delta_ik with 0 <= delta_ik <= len_k and cost
slope_k per unit of delta_ik (convex, so cheaper slopes fill first). Time is in milliseconds
inside the LP so that the solver's absolute tolerances are tight relative to iteration times.
"""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np
import scipy.sparse as sp

from perseus.exceptions import PlanError
from perseus.planner.periodic import Compression, steady_state
from perseus.planner.problem import Problem

_MS = 1000.0
# Instructions above which a cold solve starts from the steady-state restriction's optimum. The
# full LP reached from there is optimal too, but often at another of its optimal vertices, which
# rounds to a slightly different plan: measured against a cold start on 72 plans of 8 x 96,
# 8 x 128 and 16 x 64 (GPT-3 and Bloom on A100 and A40, two noisy GPT-3 profiles, no slowdown to
# 1.2 x), -0.0006% energy on average but from -0.020% to +0.018%, and 3 of the benchmark's 24
# 8 x 96 plans above the planner before issue 15 (by up to 0.0034%), while the seeded LP takes a
# third of the CPU. Up to this size (the benchmark's table, the tests) plans stay as they were;
# above, a cold solve runs for seconds (16 x 256: 12 s of CPU per plan against 5.5 s seeded).
SEED_MIN_NODES = 4096
_DANTZIG, _DEVEX = 0, 1  # HiGHS' simplex_dual_edge_weight_strategy


@dataclass(frozen=True)
class Relaxation:
    """One LP optimum. `lower_bound_j` bounds the energy of every plan with T <= deadline."""

    lower_bound_j: float
    iteration_time_s: float
    start_s: np.ndarray
    duration_s: np.ndarray

    @property
    def finish_s(self) -> np.ndarray:
        return self.start_s + self.duration_s


class HullLP:
    """The relaxation of one Problem, kept in a HiGHS instance so successive deadlines warm-start.

    A cold solve of a large pipeline starts from the optimum of its steady-state restriction
    (`periodic`: a few times fewer columns, an optimum close to the full one): from there HiGHS
    needs a quarter to a third of a cold solve's iterations to an optimal vertex of the full LP,
    which stays the bound and the point that is rounded. `seeded` forces that on or off.
    """

    def __init__(self, problem: Problem, compression: Compression | None = None, seeded: bool | None = None) -> None:
        self.problem = problem
        net = compression if compression is not None else Compression.identity(problem)
        self._net = net
        n = net.num_columns
        seg_node, seg_len, seg_slope = [], [], []
        t_min = np.empty(n)
        c_max = np.empty(n)
        for k, opts in enumerate(problem.options):
            nodes = np.flatnonzero(net.rep_type == k)
            length, slope = opts.segments()
            t_min[nodes] = opts.time[0]
            c_max[nodes] = opts.cost[0]
            seg_node.append(np.repeat(nodes, len(length)))
            seg_len.append(np.tile(length, len(nodes)))
            seg_slope.append(np.tile(slope, len(nodes)))
        seg = np.concatenate(seg_node)
        order = np.argsort(seg, kind="stable")  # keep each node's segments together
        seg = seg[order]
        length = np.concatenate(seg_len)[order] * _MS
        slope = np.concatenate(seg_slope)[order] / _MS * net.weight[seg]
        ns = len(seg)
        self._constant = float((c_max * net.weight).sum())

        # Columns: S (n), d (n), delta (ns), T, and the period P when periodic.
        self._t_col = 2 * n + ns
        self._p_col = self._t_col + 1
        num_cols = self._p_col + 1 if net.periodic else self._t_col + 1
        sinks = net.sink_rep
        e = len(net.edge_src)
        r_edge = np.arange(e)
        r_sink = e + np.arange(len(sinks))
        r_dur = e + len(sinks) + np.arange(n)
        rows = [np.repeat(r_edge, 3), np.repeat(r_sink, 3), r_dur, e + len(sinks) + seg]
        cols = [
            np.stack([net.edge_dst, net.edge_src, n + net.edge_src], 1).ravel(),
            np.stack([np.full(len(sinks), self._t_col), sinks, n + sinks], 1).ravel(),
            n + np.arange(n),
            2 * n + np.arange(ns),
        ]
        vals = [np.tile([1.0, -1.0, -1.0], e), np.tile([1.0, -1.0, -1.0], len(sinks)), np.ones(n), -np.ones(ns)]
        if net.periodic:
            # S_dst + shift P >= S_src + d_src; T >= S_i + offset P + d_i.
            shifted = np.flatnonzero(net.edge_shift)
            offset = np.flatnonzero(net.sink_offset)
            rows += [shifted, e + offset]
            cols += [np.full(len(shifted) + len(offset), self._p_col)]
            vals += [net.edge_shift[shifted].astype(float), -net.sink_offset[offset].astype(float)]
        num_rows = e + len(sinks) + n
        a = sp.csc_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(num_rows, num_cols)
        )
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = num_cols
        lp.num_row_ = num_rows
        cost = np.zeros(num_cols)
        cost[2 * n : 2 * n + ns] = slope
        self._t_cost = problem.blocking_power_w * problem.num_stages / _MS
        cost[self._t_col] = self._t_cost
        lp.col_cost_ = cost
        lp.col_lower_ = np.zeros(num_cols)
        upper = np.full(num_cols, inf)
        upper[2 * n : 2 * n + ns] = length
        lp.col_upper_ = upper
        lp.row_lower_ = np.concatenate([np.zeros(e + len(sinks)), t_min * _MS])
        lp.row_upper_ = np.concatenate([np.full(e + len(sinks), inf), t_min * _MS])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = a.indptr
        lp.a_matrix_.index_ = a.indices
        lp.a_matrix_.value_ = a.data
        self._highs = _quiet_highs()
        self._highs.setOptionValue("random_seed", 0)
        if seeded is None:
            seeded = problem.num_nodes > SEED_MIN_NODES
        self._seeded = seeded
        # Dual pricing, measured on GPT-3 A100 1F1B plans (2-core machine): Dantzig's is about 3x
        # faster than HiGHS' default on cold solves of these DAG LPs; from the steady-state seed,
        # Devex is (a 32 x 512 solve 16 s against 38 s; 16 x 256 plans at 1.0, 1.05 and 1.2 x
        # 4.8, 3.0 and 8.2 s against 6.1, 4.7 and 14.8 s, with the same or less energy).
        self._highs.setOptionValue("simplex_dual_edge_weight_strategy", _DEVEX if seeded else _DANTZIG)
        self._highs.passModel(lp)
        self._n = n
        self._seg_column = seg
        self._t_state = (inf, self._t_cost)
        self._seed: HullLP | None = None
        self._seg_of = np.zeros(0, dtype=np.int64)
        steady = steady_state(problem) if compression is None and seeded else None
        if steady is not None:
            self._seed = HullLP(problem, steady)
            # Segment column k of the full LP is segment column _seg_of[k] of the restriction.
            count = np.bincount(seg, minlength=n)
            first = np.concatenate(([0], np.cumsum(count)))[:-1]
            seed_count = np.bincount(self._seed._seg_column, minlength=self._seed._n)
            seed_first = np.concatenate(([0], np.cumsum(seed_count)))[:-1]
            within = np.arange(ns) - np.repeat(first, count)
            self._seg_of = seed_first[steady.rep[seg]] + within

    def fix_durations(self, nodes: np.ndarray, durations_s: np.ndarray) -> None:
        """Pin the duration of `nodes` (until `release_durations`)."""
        cols = (self._n + np.asarray(nodes, dtype=np.int32)).astype(np.int32)
        d = np.asarray(durations_s, dtype=float) * _MS
        self._highs.changeColsBounds(len(cols), cols, d, d)

    def release_durations(self) -> None:
        n = self._n
        cols = np.arange(n, 2 * n, dtype=np.int32)
        self._highs.changeColsBounds(n, cols, np.zeros(n), np.full(n, highspy.kHighsInf))

    def basis(self) -> highspy.HighsBasis:
        """The basis of the last optimum, for a later `solve(start=...)`."""
        return self._highs.getBasis()

    def solve(
        self,
        deadline_s: float | None,
        warm: bool = False,
        padded: bool = False,
        start: highspy.HighsBasis | None = None,
    ) -> Relaxation:
        """Optimum with T <= deadline_s (None: no deadline). `warm` reuses the last basis, which
        is faster for a sweep but lets the chosen optimum depend on the previous call; `start`
        starts from that basis instead (of this LP, from `basis`). `padded`: the iteration lasts
        deadline_s whatever T (the bound is for that energy)."""
        if padded and deadline_s is None:
            raise PlanError("a padded objective needs a deadline to pad to")
        h = self._highs
        upper = highspy.kHighsInf if deadline_s is None else deadline_s * _MS
        self._set_end(deadline_s, padded)
        if start is not None:
            if not self._seeded:
                # From the basis alone: HiGHS otherwise carries state of earlier solves past
                # `setBasis`, and a pinned solve reached another optimum after other plans. Above
                # SEED_MIN_NODES the refactorisation costs 0.2 s of a padded 16 x 256 plan, and
                # the only solve from a basis there is the padded one from the plain optimum.
                h.clearSolver()
            h.setBasis(start)
        elif not warm:
            h.clearSolver()
            # After the end is set: changing it would drop the solution given.
            restriction = self._seed
            if restriction is not None:
                # Cold too: the start, and so the vertex reached, must not depend on earlier calls.
                restriction._highs.clearSolver()
            seed = None if restriction is None else restriction._optimum(deadline_s, padded)
            if restriction is not None and seed is not None:
                h.setSolution(self._expand(restriction, seed))
        x = self._optimum(deadline_s, padded)
        if x is None:
            status = h.getModelStatus()
            if status == highspy.HighsModelStatus.kInfeasible:
                raise PlanError(f"no plan can finish within {deadline_s:.6g} s, even at the fastest frequencies")
            raise PlanError(f"the LP relaxation did not solve: {h.modelStatusToString(status)}")
        n = self._n
        bound = h.getInfo().objective_function_value + self._constant
        if padded:
            bound += self._t_cost * upper
        return Relaxation(float(bound), float(x[self._t_col] / _MS), x[:n] / _MS, x[n : 2 * n] / _MS)

    def _optimum(self, deadline_s: float | None, padded: bool) -> np.ndarray | None:
        """Run HiGHS from its current state at this deadline and objective: the column values,
        or None where it found no optimum."""
        h = self._highs
        self._set_end(deadline_s, padded)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return np.asarray(h.getSolution().col_value)

    def _set_end(self, deadline_s: float | None, padded: bool) -> None:
        """The end's bound (the deadline) and cost (none when padded)."""
        upper = highspy.kHighsInf if deadline_s is None else deadline_s * _MS
        cost = 0.0 if padded else self._t_cost
        # Only actual changes: any change drops a solution given to HiGHS (`setSolution`).
        if (upper, cost) != self._t_state:
            self._highs.changeColBounds(self._t_col, 0.0, upper)
            self._highs.changeColCost(self._t_col, cost)
            self._t_state = (upper, cost)

    def _expand(self, restriction: HullLP, seed: np.ndarray) -> highspy.HighsSolution:
        """The steady-state restriction's optimum as a solution of the full LP (feasible there:
        the restriction only adds constraints)."""
        net = restriction._net
        m = restriction._n
        start = seed[net.rep] + net.offset * seed[restriction._p_col]
        x = np.concatenate([start, seed[m + net.rep], seed[2 * m + self._seg_of], [seed[restriction._t_col]]])
        solution = highspy.HighsSolution()
        solution.col_value = x.tolist()
        solution.value_valid = True
        return solution


class _QuietHighs(highspy.Highs):
    """A HiGHS instance that never writes to stdout, so planning (e.g. in the threaded service)
    leaves the process's stdout alone.

    HiGHS prints its banner when an instance first logs, unless its output_flag is already off.
    highspy.Highs() logs during construction: its __init__ installs highspy's callbacks
    (enableCallbacks -> setCallback) before a caller could set any option. This hook runs just
    before that call, on the constructed instance; setting the option again afterwards covers
    highspy versions whose __init__ does not call it.
    """

    def enableCallbacks(self) -> None:
        self.setOptionValue("output_flag", False)
        super().enableCallbacks()


def _quiet_highs() -> highspy.Highs:
    highs = _QuietHighs()
    highs.setOptionValue("output_flag", False)
    return highs
