"""Iterative rounding: pin the relaxation's nearly-integral durations to profiled choices and
re-solve, so the LP re-balances the rest around them before they are rounded in turn.

Rounding every fractional duration down at once wastes the time between a node's relaxed
duration and its next-faster choice. Here, each round pins the fractional nodes closest to a
choice (to that nearest choice; to the faster neighbour if the nearest makes the deadline
infeasible), and the warm-started LP moves the free nodes to compensate. What is still
fractional after the last round is left to `round_down`.
"""

from __future__ import annotations

import numpy as np

from perseus.exceptions import PlanError
from perseus.planner.flow import FlowLP
from perseus.planner.lp import HullLP, Relaxation
from perseus.planner.problem import Problem

ROUNDS = 5
SHARE = 0.25  # of the fractional nodes pinned per round
_TOL_S = 1e-9


def _fractional(problem: Problem, duration_s: np.ndarray, free: np.ndarray):
    """Free nodes whose duration lies strictly between two choices: (nodes, faster, slower, closeness)."""
    nodes = np.flatnonzero(free)
    lo = np.empty(len(nodes))
    hi = np.empty(len(nodes))
    inside = np.zeros(len(nodes), dtype=bool)
    node_type = problem.node_type[nodes]
    for t, opts in enumerate(problem.options):
        at = np.flatnonzero(node_type == t)
        if len(at) == 0:
            continue
        times = opts.time
        d = duration_s[nodes[at]]
        k = np.searchsorted(times, d + _TOL_S, side="right") - 1
        between = (k >= 0) & (k + 1 < len(times))
        k = np.clip(k, 0, max(len(times) - 2, 0))
        faster = times[k]
        slower = times[np.minimum(k + 1, len(times) - 1)]
        inside[at] = between & (np.abs(faster - d) > _TOL_S)
        lo[at] = faster
        hi[at] = slower
    nodes, lo, hi = nodes[inside], lo[inside], hi[inside]
    d = duration_s[nodes]
    dist = np.minimum(d - lo, hi - d) / (hi - lo)
    return nodes, lo, hi, dist


def refine(
    problem: Problem, lp: HullLP | FlowLP, relaxation: Relaxation, deadline_s: float | None, padded: bool = False
) -> Relaxation:
    """Run the rounds starting from `relaxation` (the LP's current optimum at `deadline_s`);
    returns the last relaxation, whose durations are mostly profiled choices. Leaves the LP
    with every duration free again."""
    free = np.ones(problem.num_nodes, dtype=bool)
    # Each duration's lower bound: pinned, or the fastest choice. The LP is feasible exactly when
    # the longest path at these meets the deadline: checked before a solve, which would otherwise
    # be spent proving a pinning infeasible (GPT-3 16 x 256: 4 rounds of 5, 0.04-0.2 s each).
    shortest = problem.times(problem.fastest())
    try:
        for _ in range(ROUNDS):
            nodes, faster, slower, dist = _fractional(problem, relaxation.duration_s, free)
            if len(nodes) == 0:
                break
            take = np.argsort(dist, kind="stable")[: max(1, int(len(nodes) * SHARE))]
            nodes, faster, slower = nodes[take], faster[take], slower[take]
            d = relaxation.duration_s[nodes]
            nearest = np.where(d - faster <= slower - d, faster, slower)
            trial = shortest.copy()
            trial[nodes] = nearest
            if deadline_s is not None and problem.iteration_time(trial) > deadline_s:
                nearest = faster
            lp.fix_durations(nodes, nearest)
            free[nodes] = False
            try:
                relaxation = lp.solve(deadline_s, warm=True, padded=padded)
            except PlanError:
                # Rounding down keeps the previous optimum feasible.
                nearest = faster
                lp.fix_durations(nodes, faster)
                relaxation = lp.solve(deadline_s, warm=True, padded=padded)
            shortest[nodes] = nearest
    finally:
        lp.release_durations()
    return relaxation
