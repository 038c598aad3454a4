"""The exact discrete problem as a MILP, for small DAGs where it solves in well under a second.

Binary x_ik picks choice k of node i; S_j >= S_i + sum_k t_ik x_ik along every edge; the sinks end
by T <= deadline; minimise sum c_ik x_ik + P_block * N * T. Time is in milliseconds so that the
solver's absolute feasibility tolerance is small against instruction times; the caller still
re-checks the deadline with exact floating-point longest paths.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from perseus.planner.problem import Problem

_MS = 1000.0

# Choices (binaries) up to which `solve_exact` is used; beyond, the LP rounding stands alone.
MAX_BINARIES = 120
# Branch-and-bound nodes before the best solution found so far is taken as is.
MAX_NODES = 5_000


def num_binaries(problem: Problem) -> int:
    sizes = np.array([len(opts) for opts in problem.options], dtype=np.int64)
    return int(sizes[problem.node_type].sum())


def solve_exact(problem: Problem, deadline_s: float | None, padded: bool = False) -> np.ndarray | None:
    """Optimal choice vector with T <= deadline_s (None: no deadline), or None if the solver
    finds none; the best found if MAX_NODES runs out first. Deterministic (HiGHS, zero gap).
    `padded`: the iteration lasts deadline_s anyway, so T costs nothing."""
    # Imported here: a third of a second that only plans of small DAGs need.
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = problem.num_nodes
    dag = problem.dag
    sizes = np.array([len(problem.node_options(i)) for i in range(n)])
    offset = np.concatenate(([0], np.cumsum(sizes)))
    nb = int(offset[-1])
    s_col, t_col = nb, nb + n
    num_cols = t_col + 1
    time = np.concatenate([problem.node_options(i).time for i in range(n)]) * _MS
    cost = np.zeros(num_cols)
    cost[:nb] = np.concatenate([problem.node_options(i).cost for i in range(n)])
    cost[t_col] = 0.0 if padded else problem.blocking_power_w * problem.num_stages / _MS

    rows, cols, vals = [], [], []
    lower: list[float] = []
    upper: list[float] = []

    def add_row(entries: list[tuple[np.ndarray, np.ndarray]], lo: float, hi: float) -> None:
        r = len(lower)
        for c, v in entries:
            rows.append(np.full(len(c), r))
            cols.append(c)
            vals.append(v)
        lower.append(lo)
        upper.append(hi)

    def duration(i: int) -> tuple[np.ndarray, np.ndarray]:
        span = np.arange(offset[i], offset[i + 1])
        return span, -time[span]

    for a, b in zip(dag.src.tolist(), dag.dst.tolist()):
        add_row([(np.array([s_col + b, s_col + a]), np.array([1.0, -1.0])), duration(a)], 0.0, np.inf)
    for i in range(n):
        if dag.succ_ptr[i + 1] == dag.succ_ptr[i]:
            add_row([(np.array([t_col, s_col + i]), np.array([1.0, -1.0])), duration(i)], 0.0, np.inf)
        span = np.arange(offset[i], offset[i + 1])
        add_row([(span, np.ones(len(span)))], 1.0, 1.0)

    a_matrix = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(lower), num_cols)
    )
    upper_bounds = np.full(num_cols, np.inf)
    upper_bounds[:nb] = 1.0
    if deadline_s is not None:
        upper_bounds[t_col] = deadline_s * _MS
    integrality = np.zeros(num_cols)
    integrality[:nb] = 1
    result = milp(
        cost,
        constraints=LinearConstraint(a_matrix, lower, upper),
        integrality=integrality,
        bounds=Bounds(np.zeros(num_cols), upper_bounds),
        # A node limit, not a time limit, keeps the result independent of machine speed.
        options={"mip_rel_gap": 0.0, "presolve": True, "node_limit": MAX_NODES},
    )
    if result.x is None:
        return None
    x = result.x[:nb]
    return np.array([int(np.argmax(x[offset[i] : offset[i + 1]])) for i in range(n)], dtype=np.int64)
