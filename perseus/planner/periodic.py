"""A long pipeline's steady state as a small LP: where a large pipeline's cold relaxation solves start.

In the middle of a long pipeline every microbatch repeats the one before, and so does the LP
optimum there (measured: GPT-3 8 x 96, microbatches 24..71, the same optimum to 1e-10). The
steady-state restriction keeps explicit columns for the first and last `MARGIN_PER_STAGE` x
virtual stages microbatches and one representative per (stage, kind, chunk) for the microbatches
between, which start `offset` periods P after it: S(m) = S(a) + (m - a) P, d(m) = d(a). Every
edge becomes a row over representatives with a multiple of P, identical rows merge, and a
representative's cost counts once per microbatch it stands for.

Its optimum is feasible for the full LP and close to optimal there, so HiGHS reaches an optimal
vertex of the full LP from it in a fraction of a cold solve's iterations (`HullLP`). The full
LP's own optimum stays the bound and the point that is rounded, so the restriction never has to
be exact: a margin of one microbatch per virtual stage solves fastest overall (measured, GPT-3
no-slowdown LP, CPU: 8 x 96 0.09 s against 0.29 s cold, 0.25 s with a margin of three; 16 x 256
1.3 s against 5.3 s; 32 x 512 26 s, where a whole cold plan ran past 150 s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perseus.planner.problem import Problem

# Microbatches kept explicit at each end, per virtual stage (the warm-up and cool-down).
MARGIN_PER_STAGE = 1
# Fewer steady microbatches than this: no restriction (the full LP is small anyway).
MIN_PERIODS = 8


@dataclass(frozen=True, eq=False)
class Compression:
    """Columns of a relaxation: node i of the full DAG is column `rep[i]`, `offset[i]` periods
    later; a column stands for `weight` nodes of type `rep_type`. Rows: edges (src, dst, shift)
    with the shift in periods, and sinks (column, offset)."""

    rep: np.ndarray
    offset: np.ndarray
    rep_type: np.ndarray
    weight: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_shift: np.ndarray
    sink_rep: np.ndarray
    sink_offset: np.ndarray

    @property
    def num_columns(self) -> int:
        return len(self.rep_type)

    @property
    def periodic(self) -> bool:
        return bool(self.offset.any())

    @classmethod
    def identity(cls, problem: Problem) -> Compression:
        """Every node its own column (the full LP)."""
        dag = problem.dag
        n = problem.num_nodes
        sinks = np.flatnonzero(np.diff(dag.succ_ptr) == 0)
        return cls(
            rep=np.arange(n),
            offset=np.zeros(n, dtype=np.int64),
            rep_type=problem.node_type,
            weight=np.ones(n),
            edge_src=dag.src,
            edge_dst=dag.dst,
            edge_shift=np.zeros(len(dag.src), dtype=np.int64),
            sink_rep=sinks,
            sink_offset=np.zeros(len(sinks), dtype=np.int64),
        )


def steady_state(problem: Problem) -> Compression | None:
    """The restriction of `problem` to a periodic steady state, or None where there are too few
    steady microbatches or their instructions do not share one set of choices (a restricted
    problem)."""
    schedule = problem.dag.schedule
    margin = MARGIN_PER_STAGE * schedule.num_virtual_stages
    first, last = margin, schedule.num_microbatches - margin  # steady microbatches: [first, last)
    if last - first < MIN_PERIODS:
        return None
    nodes = problem.dag.nodes
    n = len(nodes)
    micro = np.array([ins.microbatch for ins in nodes], dtype=np.int64)
    steady = (micro >= first) & (micro < last)
    key_of: dict[tuple[int, str, int], int] = {}
    rep = np.empty(n, dtype=np.int64)
    outside = np.flatnonzero(~steady)
    rep[outside] = np.arange(len(outside))
    for i in np.flatnonzero(steady).tolist():
        ins = nodes[i]
        rep[i] = key_of.setdefault((ins.stage, ins.kind.value, ins.chunk), len(outside) + len(key_of))
    num_columns = len(outside) + len(key_of)
    rep_type = np.full(num_columns, -1, dtype=np.int64)
    rep_type[rep] = problem.node_type
    if (rep_type[rep] != problem.node_type).any():
        return None
    offset = np.where(steady, micro - first, 0)
    weight = np.bincount(rep, minlength=num_columns).astype(float)
    dag = problem.dag
    edges = np.unique(np.stack([rep[dag.src], rep[dag.dst], offset[dag.dst] - offset[dag.src]], axis=1), axis=0)
    sinks = np.flatnonzero(np.diff(dag.succ_ptr) == 0)
    sink_keys = np.unique(np.stack([rep[sinks], offset[sinks]], axis=1), axis=0)
    return Compression(
        rep=rep,
        offset=offset,
        rep_type=rep_type,
        weight=weight,
        edge_src=edges[:, 0].copy(),
        edge_dst=edges[:, 1].copy(),
        edge_shift=edges[:, 2].copy(),
        sink_rep=sink_keys[:, 0].copy(),
        sink_offset=sink_keys[:, 1].copy(),
    )
