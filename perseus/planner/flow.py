"""The LP relaxation solved as a min-cost flow, by network simplex: `HullLP`'s optimum, faster.

The relaxation is a tension problem: every instruction is an arc from its start event to its end
event, its duration is the difference of their times, and it costs its convex hull there;
precedences and the deadline bound other differences. The dual of such a problem is a min-cost
flow, and the node potentials of an optimal network-simplex tree are optimal event times. With
times in milliseconds:

- each precedence i -> j is an uncapacitated arc start_j -> end_i of cost 0 (end_i <= start_j),
  each source's start an arc to the origin (start >= 0), each sink's end an arc from the end
  event T (end <= T), the deadline an arc origin -> T of cost D, and padding (T = D: the
  iteration lasts the deadline) an arc T -> origin of cost -D (0 unpadded: T >= 0);
- duration bounds t_min <= d <= t_max are arcs end -> start of cost -t_min and start -> end of
  cost t_max (a pinned duration: both at it);
- the hull h(d) = h(t_min) + s_1 (d - t_min) + sum_k (s_k - s_(k-1)) max(0, d - b_(k-1)) (slopes
  s_k rising, breakpoints b_k): the linear part is a supply of -s_1 at the start and s_1 at the
  end, each kink an arc start -> end of cost b_(k-1) and capacity s_k - s_(k-1);
- blocking power over T is a supply at T and a demand at the origin.

So a solve changes costs only: every optimum is a feasible start for the next one.
"""

from __future__ import annotations

import numpy as np

from perseus.exceptions import PlanError
from perseus.planner.lp import HullLP, Relaxation
from perseus.planner.native import extension as _flow
from perseus.planner.problem import Problem

_MS = 1000.0
_OPTIMAL, _UNBOUNDED = 0, 2
_AT_LOWER, _IN_TREE, _AT_UPPER = 1, 0, -1  # arc states (_flow.c)
# Sizes (instructions) where network simplex solves the relaxation instead of HiGHS. Measured on
# GPT-3 A100 1F1B (2-core machine): at 8 x 96 (1,536) a cold solve takes 0.09 s against HiGHS'
# 0.31-0.38 s and a whole plan half the time; at 16 x 256 (8,192) the spanning tree is deep
# (chains of thousands of instructions), every pivot moves about 1,200 nodes' potentials, and
# iterative rounding's re-solves take 10.6 s against HiGHS' 3.7 s. Below FLOW_MIN_NODES HiGHS
# solves in milliseconds and stays the planner's LP, so plans are what they were: the simplex
# reaches another optimal vertex of the same LP, which rounds to other plans (on the test's
# random DAGs of 4 x 16, from 0.44% less energy to 0.49% more; on GPT-3 8 x 96, within 0.02%).
FLOW_MIN_NODES = 1024
FLOW_MAX_NODES = 4096
# Pivots per arc before giving up on the network simplex (then HiGHS solves this LP).
_PIVOTS_PER_ARC = 50


def uses_flow(problem: Problem) -> bool:
    """Whether network simplex solves this problem's relaxation: from FLOW_MIN_NODES to
    FLOW_MAX_NODES instructions, where its extension is built."""
    return _flow is not None and FLOW_MIN_NODES < problem.num_nodes <= FLOW_MAX_NODES


def relaxation_lp(problem: Problem) -> HullLP | FlowLP:
    """The relaxation's solver: network simplex where `uses_flow`, else HiGHS."""
    return FlowLP(problem) if uses_flow(problem) else HullLP(problem)


class FlowLP:
    """HullLP's interface (solve, fix_durations, release_durations, basis) on network simplex.

    The network never changes: a deadline, padding and pinned durations are costs of its arcs, so
    every optimum stays primal feasible for the next solve, which `warm` (or `start`, a `basis`)
    continues from instead of a new tree.
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        dag = problem.dag
        n = self._n = problem.num_nodes
        origin, end = self._origin, self._end = 2 * n, 2 * n + 1
        t_min, t_max, first_slope, last_slope, c_max = (np.empty(n) for _ in range(5))
        kink_node, kink_at, kink_cap = [], [], []
        seg_node, seg_start, seg_len, seg_slope = [], [], [], []
        for k, opts in enumerate(problem.options):
            nodes = np.flatnonzero(problem.node_type == k)
            length, slope = opts.segments()
            length, slope = length * _MS, slope / _MS
            start = opts.time[0] * _MS + np.cumsum(np.concatenate(([0.0], length)))[:-1]
            t_min[nodes] = opts.time[0] * _MS
            t_max[nodes] = opts.time[0] * _MS + length.sum()
            c_max[nodes] = opts.cost[0]
            first_slope[nodes] = slope[0] if len(slope) else 0.0
            last_slope[nodes] = slope[-1] if len(slope) else 0.0
            rise = np.diff(slope)
            for j in np.flatnonzero(rise > 0):
                kink_node.append(nodes)
                kink_at.append(np.full(len(nodes), start[j + 1]))
                kink_cap.append(np.full(len(nodes), rise[j]))
            seg_node.append(np.repeat(nodes, len(length)))
            seg_start.append(np.tile(start, len(nodes)))
            seg_len.append(np.tile(length, len(nodes)))
            seg_slope.append(np.tile(slope, len(nodes)))
        self._t_min, self._t_max = t_min, t_max
        self._first_slope, self._last_slope = first_slope, last_slope
        self._constant = float(c_max.sum())
        self._segments = tuple(np.concatenate(a) for a in (seg_node, seg_start, seg_len, seg_slope))
        kinks = np.concatenate(kink_node) if kink_node else np.zeros(0, dtype=np.int64)
        sources = np.flatnonzero(np.diff(dag.pred_ptr) == 0)
        self._sinks = np.flatnonzero(np.diff(dag.succ_ptr) == 0)
        nodes = np.arange(n)
        arcs = [
            (dag.dst, n + dag.src),  # start_j -> end_i: end_i <= start_j
            (sources, np.full(len(sources), origin)),  # start >= 0
            (np.full(len(self._sinks), end), n + self._sinks),  # end <= T
            (n + nodes, nodes),  # d >= t_min (or a pinned duration)
            (nodes, n + nodes),  # d <= t_max (or a pinned duration)
            (kinks, n + kinks),  # the hull's kinks
            (np.array([origin]), np.array([end])),  # T <= deadline
            (np.array([end]), np.array([origin])),  # T >= deadline when padded (else T >= 0)
        ]
        real = self._real = sum(len(a) for a, _ in arcs)
        fixed = len(dag.src) + len(sources) + len(self._sinks)
        self._sources = sources
        self._edge_key = dag.dst.astype(np.int64) * n + dag.src  # precedence arcs are sorted by (dst, src)
        self._first_start_arc = len(dag.src)
        self._first_sink_arc = len(dag.src) + len(sources)
        self._kink_arcs = slice(fixed + 2 * n, real - 2)
        self._bounds = slice(fixed, fixed + 2 * n)
        self._deadline_arc = real - 2
        nodes_all = 2 * n + 2
        self._cost = np.zeros(real + nodes_all)
        self._cost[fixed + 2 * n : real - 2] = np.concatenate(kink_at) if kink_at else []
        self._cap = np.full(real + nodes_all, np.inf)
        self._cap[fixed + 2 * n : real - 2] = np.concatenate(kink_cap) if kink_cap else []
        self._src = np.zeros(real + nodes_all, dtype=np.int32)
        self._dst = np.zeros(real + nodes_all, dtype=np.int32)
        self._src[:real] = np.concatenate([a for a, _ in arcs])
        self._dst[:real] = np.concatenate([b for _, b in arcs])
        self._src[real:] = np.arange(nodes_all)  # node -> root: only the origin's is ever in the tree
        self._dst[real:] = nodes_all
        self._t_cost = problem.blocking_power_w * problem.num_stages / _MS
        _, slowest = dag.longest_path(t_max)
        # No deadline: one no plan reaches (every instruction at its slowest, along the longest path).
        self._no_deadline_ms = 2.0 * float(slowest.max()) + 1.0
        self._tree = _Tree(real + nodes_all, nodes_all + 1)
        self._crash(slowest)
        self._first = self._tree.copy()  # where every cold solve starts: it depends on no cost
        self._valid = False  # the tree is the last solve's optimum
        self._feasible = False  # the tree is a feasible basis to continue from
        self._pinned = np.full(n, np.nan)  # a fixed duration (ms) per node, NaN where free
        self._fallback: HullLP | None = None

    def fix_durations(self, nodes: np.ndarray, durations_s: np.ndarray) -> None:
        """Pin the duration of `nodes` (until `release_durations`)."""
        self._pinned[np.asarray(nodes, dtype=np.int64)] = np.asarray(durations_s, dtype=float) * _MS

    def release_durations(self) -> None:
        self._pinned[:] = np.nan

    def basis(self) -> _Tree | None:
        """The last optimum's tree, for a later `solve(start=...)`."""
        return self._tree.copy() if self._valid else None

    def solve(
        self, deadline_s: float | None, warm: bool = False, padded: bool = False, start: _Tree | None = None
    ) -> Relaxation:
        """Optimum with T <= deadline_s (None: no deadline). `warm` continues from the last
        optimum (faster for a sweep, but the optimum reached may depend on it), `start` from
        that basis instead (of this LP, from `basis`); otherwise a new tree, so the optimum
        depends on the arguments alone. `padded`: the iteration lasts deadline_s whatever T."""
        if padded and deadline_s is None:
            raise PlanError("a padded objective needs a deadline to pad to")
        assert _flow is not None
        n = self._n
        free = np.isnan(self._pinned)
        lo = np.where(free, self._t_min, self._pinned)
        hi = np.where(free, self._t_max, self._pinned)
        cost = self._cost
        cost[self._bounds] = np.concatenate([-lo, hi])
        deadline_ms = self._no_deadline_ms if deadline_s is None else deadline_s * _MS
        cost[self._deadline_arc] = deadline_ms
        cost[self._deadline_arc + 1] = -deadline_ms if padded else 0.0
        if start is not None:
            self._tree.load(start)
        elif not (warm and self._feasible):
            self._tree.load(self._first)
        tree = self._tree
        status, _ = _flow.network_simplex(
            self._real,
            self._src,
            self._dst,
            self._cap,
            cost,
            tree.flow,
            tree.state,
            tree.parent,
            tree.pred,
            tree.dir,
            tree.depth,
            tree.first,
            tree.next,
            tree.prev,
            tree.pi,
            _PIVOTS_PER_ARC * len(self._src),
        )
        self._valid = status == _OPTIMAL
        # A pivot that finds no finite residual returns before changing the tree, and costs are
        # all a solve changes: the next warm solve (refine's retry) continues from here.
        self._feasible = status in (_OPTIMAL, _UNBOUNDED)
        if status == _UNBOUNDED:
            raise PlanError(f"no plan can finish within {deadline_s:.6g} s, even at the fastest frequencies")
        if status != _OPTIMAL:
            return self._hull_lp().solve(deadline_s, padded=padded)
        pi = tree.pi
        begin = pi[:n] - pi[self._origin]
        duration = np.clip(pi[n : 2 * n] - pi[:n], lo, hi)
        end = float((begin + duration)[self._sinks].max())
        bound = self._hull_cost(duration) + self._t_cost * (deadline_ms if padded else end)
        return Relaxation(float(bound), end / _MS, begin / _MS, duration / _MS)

    def _crash(self, finish: np.ndarray) -> None:
        """A first feasible tree: every instruction at its slowest (the hull's kinks saturated,
        the rest of its first slope's flow on its t_max arc), each hanging from the predecessor
        that ends last in that schedule (`finish`: its instructions' ends), and the blocking
        power's flow from T back to the origin along the critical path it ends."""
        n, m, dag = self._n, self._real, self.problem.dag
        origin, end, root = self._origin, self._end, 2 * n + 2
        tree = self._tree
        tree.flow[:] = 0.0
        tree.state[:] = _AT_LOWER
        tree.state[self._kink_arcs] = _AT_UPPER
        tree.flow[self._kink_arcs] = self._cap[self._kink_arcs]
        ends = np.append(finish, -np.inf)  # slot n: pred_pad's padding
        chosen = dag.pred_pad[np.arange(n), np.argmax(ends[dag.pred_pad], axis=1)]  # n: a source
        last = int(self._sinks[np.argmax(finish[self._sinks])])
        on_path = np.zeros(n, dtype=bool)
        i = last
        while i < n:
            on_path[i] = True
            i = int(chosen[i])
        through = self._t_cost * on_path
        # Each instruction's end sends s_last (+ the blocking flow through it) to its start.
        back = self._last_slope + through
        to_start = back >= 0
        nodes = np.arange(n)
        pair_arc = np.where(to_start, self._bounds.start + nodes, self._bounds.start + n + nodes)
        parent, pred, direction = tree.parent, tree.pred, tree.dir
        parent[n : 2 * n] = nodes
        pred[n : 2 * n] = pair_arc
        direction[n : 2 * n] = np.where(to_start, 1, -1)
        tree.flow[pair_arc] = np.abs(back)
        has_pred = chosen < n
        inner = nodes[has_pred]
        parent[inner] = n + chosen[has_pred]
        pred[inner] = np.searchsorted(self._edge_key, inner * n + chosen[has_pred])
        sources = self._sources
        parent[sources] = origin
        pred[sources] = self._first_start_arc + np.arange(len(sources))
        direction[:n] = 1
        tree.flow[pred[:n]] = through
        parent[end] = n + last
        pred[end] = self._first_sink_arc + int(np.searchsorted(self._sinks, last))
        direction[end] = 1
        tree.flow[pred[end]] = self._t_cost
        parent[origin], pred[origin], direction[origin] = root, m + origin, 1
        parent[root], pred[root], direction[root] = -1, -1, 0
        tree.state[pred[:root]] = _IN_TREE
        depth = tree.depth
        depth[root], depth[origin] = 0, 1
        ptr = dag.level_ptr
        for lo, hi in zip(ptr[:-1], ptr[1:]):
            depth[lo:hi] = depth[parent[lo:hi]] + 1
            depth[n + lo : n + hi] = depth[lo:hi] + 1
        depth[end] = depth[n + last] + 1
        tree.link_children()

    def _hull_cost(self, duration_ms: np.ndarray) -> float:
        """sum_i h_i(d_i): each hull segment's slope over the part of it the duration covers."""
        node, start, length, slope = self._segments
        covered = np.clip(duration_ms[node] - start, 0.0, length)
        return self._constant + float((slope * covered).sum())

    def _hull_lp(self) -> HullLP:
        """HiGHS on the same LP, for a network the simplex gave up on (its pivot limit)."""
        if self._fallback is None:
            self._fallback = HullLP(self.problem)
        fallback = self._fallback
        pinned = np.flatnonzero(~np.isnan(self._pinned))
        fallback.release_durations()
        if len(pinned):
            fallback.fix_durations(pinned, self._pinned[pinned] / _MS)
        return fallback


class _Tree:
    """A network simplex spanning tree (see _flow.c), arrays the extension writes in place."""

    _FIELDS = ("flow", "state", "parent", "pred", "dir", "depth", "first", "next", "prev", "pi")

    def __init__(self, arcs: int, nodes: int) -> None:
        self.flow = np.zeros(arcs)
        self.state = np.zeros(arcs, dtype=np.int8)
        self.parent, self.pred, self.depth, self.first, self.next, self.prev = (
            np.zeros(nodes, dtype=np.int32) for _ in range(6)
        )
        self.dir = np.zeros(nodes, dtype=np.int8)
        self.pi = np.zeros(nodes)

    def link_children(self) -> None:
        """The child lists (first, next, prev) of the parent array."""
        self.first[:] = -1
        self.next[:] = -1
        self.prev[:] = -1
        children = np.flatnonzero(self.parent >= 0)
        order = children[np.argsort(self.parent[children], kind="stable")]
        parents = self.parent[order]
        same = parents[1:] == parents[:-1]
        self.next[order[:-1][same]] = order[1:][same]
        self.prev[order[1:][same]] = order[:-1][same]
        heads = np.ones(len(order), dtype=bool)
        heads[1:] = ~same
        self.first[parents[heads]] = order[heads]

    def copy(self) -> _Tree:
        other = _Tree.__new__(_Tree)
        for name in self._FIELDS:
            setattr(other, name, getattr(self, name).copy())
        return other

    def load(self, other: _Tree) -> None:
        for name in self._FIELDS:
            getattr(self, name)[:] = getattr(other, name)
