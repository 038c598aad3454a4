"""The dependency DAG of a schedule, as a networkx graph and as flat numpy arrays.

Edges: consecutive instructions on a rank; F(v, m) -> F(v+1, m) along the virtual (model)
stages; F of the last virtual stage -> its backward; the input-gradient producer (B or I) of
v+1 -> that of v; and I(v, m) -> W(v, m). The arrays put nodes in level order (level = most
edges on any path from a source), so a level is a contiguous slice and the longest path can be
computed one level at a time with vectorized numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import networkx as nx
import numpy as np

from perseus.exceptions import ScheduleError
from perseus.planner.native import extension as _flow
from perseus.schedules.instruction import Instruction, Kind, Schedule


def schedule_edges(schedule: Schedule) -> tuple[list[Instruction], np.ndarray, np.ndarray]:
    """The dependency edges of `schedule` as distinct index pairs into its instructions (in stage
    order), without checking for cycles: (instructions, src, dst)."""
    schedule.validate()
    nodes = [ins for row in schedule.stages for ins in row]
    index = {ins: i for i, ins in enumerate(nodes)}
    src: list[int] = []
    dst: list[int] = []
    by_key: dict[tuple[int, Kind, int], int] = {}
    for row in schedule.stages:
        ids = [index[ins] for ins in row]
        src += ids[:-1]
        dst += ids[1:]
        for ins, i in zip(row, ids):
            by_key[(schedule.virtual_stage(ins), ins.kind, ins.microbatch)] = i
    # What an instruction sends to another rank leaves with the last of its overlapped group.
    sender = list(range(len(nodes)))
    for rank, positions in enumerate(schedule.overlapped):
        ids = [index[ins] for ins in schedule.stages[rank]]
        for i in reversed(positions):
            sender[ids[i]] = sender[ids[i + 1]]

    def transfer(a: int, b: int) -> None:
        src.append(sender[a] if nodes[a].stage != nodes[b].stage else a)
        dst.append(b)

    last = schedule.num_virtual_stages - 1
    for m in range(schedule.num_microbatches):
        grads = []
        for v in range(last + 1):
            grad = by_key.get((v, Kind.BACKWARD, m))
            grad = by_key[(v, Kind.BACKWARD_INPUT, m)] if grad is None else grad
            grads.append(grad)
            weight = by_key.get((v, Kind.BACKWARD_WEIGHT, m))
            if weight is not None:
                src.append(grad)
                dst.append(weight)
            if v < last:
                transfer(by_key[(v, Kind.FORWARD, m)], by_key[(v + 1, Kind.FORWARD, m)])
        src.append(by_key[(last, Kind.FORWARD, m)])
        dst.append(grads[last])
        for v in range(1, last + 1):
            transfer(grads[v], grads[v - 1])
    # A rank's next instruction can also be its data successor (I then W): one edge.
    pairs = np.unique(np.array([src, dst], dtype=np.int64).reshape(2, -1).T, axis=0)
    return nodes, pairs[:, 0].copy(), pairs[:, 1].copy()


def ending_stages(schedule: Schedule) -> frozenset[int]:
    """The stages that may finish an iteration: those whose last instruction no other stage's
    waits for (1F1B, GPipe, interleaved: the first, whose last backward ends the iteration; with
    weight passes that wait for nothing downstream, every stage). A pipeline's iteration time is
    their compute time: a stage another waits for starts a step as soon as its data-parallel
    gradient sync lets it, which beside a straggler is earlier than the pipeline's own start."""
    nodes, src, dst = schedule_edges(schedule)
    stage = np.array([ins.stage for ins in nodes], dtype=np.int64)
    ends = np.cumsum([len(row) for row in schedule.stages]) - 1
    waited = set(stage[src[(stage[src] != stage[dst]) & np.isin(src, ends)]].tolist())
    return frozenset(s for s, row in enumerate(schedule.stages) if row and s not in waited)


def build_dag(schedule: Schedule) -> nx.DiGraph:
    """The dependency graph of `schedule` (nodes are Instructions; `graph.graph["schedule"]` is
    the schedule). A cycle means the schedule would deadlock: ScheduleError names it."""
    nodes, src, dst = schedule_edges(schedule)
    graph = nx.DiGraph(schedule=schedule)
    graph.add_nodes_from(nodes)
    graph.add_edges_from((nodes[a], nodes[b]) for a, b in zip(src.tolist(), dst.tolist()))
    if not nx.is_directed_acyclic_graph(graph):
        cycle = [u for u, _ in nx.find_cycle(graph)]
        path = " -> ".join(str(ins) for ins in cycle + cycle[:1])
        raise ScheduleError(
            f"schedule {schedule.name!r} would deadlock: its dependencies form the cycle {path}; "
            "reorder the stages' instruction lists so that every instruction comes after the ones it waits for"
        )
    return graph


@dataclass(frozen=True, eq=False)
class DagArrays:
    """A DAG flattened for fast repeated evaluation. Node i is `nodes[i]`; nodes are sorted by
    level, then stage, then position on the stage, so `nodes` is a topological order.

    - `src`, `dst`: edge endpoints (int64), sorted by (dst, src).
    - `pred_ptr`, `pred_idx`: CSR predecessors: preds of i are pred_idx[pred_ptr[i]:pred_ptr[i+1]].
    - `succ_ptr`, `succ_idx`: CSR successors, likewise.
    - `level_ptr`: nodes of level L are the slice level_ptr[L]:level_ptr[L+1].
    - `pred_pad`: (n, max in-degree) predecessor table padded with n (a slot that always holds 0).
    - `succ_pad`: (n, max out-degree) successor table, padded likewise.
    - `stage`: rank of each node (int64).
    """

    schedule: Schedule
    nodes: tuple[Instruction, ...]
    index: dict[Instruction, int]
    src: np.ndarray
    dst: np.ndarray
    pred_ptr: np.ndarray
    pred_idx: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    level_ptr: np.ndarray
    pred_pad: np.ndarray
    succ_pad: np.ndarray
    stage: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def preds(self, i: int) -> np.ndarray:
        return self.pred_idx[self.pred_ptr[i] : self.pred_ptr[i + 1]]

    def succs(self, i: int) -> np.ndarray:
        return self.succ_idx[self.succ_ptr[i] : self.succ_ptr[i + 1]]

    @cached_property
    def _pred_slots(self) -> tuple[list[int], list[int], list[list[int] | None]]:
        """Per node, for the scalar longest path: its first two predecessors (one repeated when it
        has one, n when none: a slot that holds 0), or all of them when it has more than two."""
        n = len(self.nodes)
        ptr, idx = self.pred_ptr.tolist(), self.pred_idx.tolist()
        preds = [idx[ptr[i] : ptr[i + 1]] for i in range(n)]
        first = [p[0] if p else n for p in preds]
        second = [p[1] if len(p) > 1 else q for p, q in zip(preds, first)]
        more = [p if len(p) > 2 else None for p in preds]
        return first, second, more

    def longest_path(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Earliest (start, end) of every node given node durations; `times` is (n,) or (k, n)
        for k assignments at once. The iteration time is end.max(axis=-1)."""
        times = np.asarray(times, dtype=float)
        if times.ndim == 1:
            return self._longest_path_one(times)
        n = len(self.nodes)
        end = np.zeros(times.shape[:-1] + (n + 1,))
        start = np.zeros(times.shape)
        ptr = self.level_ptr
        # Level 0 has no predecessors: it starts at 0.
        end[..., ptr[0] : ptr[1]] = times[..., ptr[0] : ptr[1]]
        for lo, hi in zip(ptr[1:-1], ptr[2:]):
            s = end[..., self.pred_pad[lo:hi]].max(axis=-1)
            start[..., lo:hi] = s
            end[..., lo:hi] = s + times[..., lo:hi]
        return start, end[..., :n]

    @cached_property
    def _pred_csr32(self) -> tuple[np.ndarray, np.ndarray]:
        return self.pred_ptr.astype(np.int32), self.pred_idx.astype(np.int32)

    def _longest_path_one(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`longest_path` of one assignment: in C where the extension is built (a Python loop
        over a 32 x 512 pipeline takes about 6 ms, EnvPipe runs hundreds), else `_longest_path_loop`."""
        if _flow is None:
            return self._longest_path_loop(times)
        n = len(self.nodes)
        start, end = np.empty(n), np.empty(n)
        _flow.longest_path(*self._pred_csr32, np.array(times, dtype=float), start, end)
        return start, end

    def _longest_path_loop(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`longest_path` of one assignment as a scalar loop: most nodes wait on one or two
        predecessors, and reading those two beats a numpy call per level (3-4x at 8 x 96). The
        same float operations as the C one (max of the predecessors' ends, plus the time), so the
        same bits."""
        first, second, more = self._pred_slots
        t = times.tolist()
        n = len(t)
        end = [0.0] * (n + 1)  # end[n] stays 0: the start of a node without predecessors
        start = [0.0] * n
        for i in range(n):
            many = more[i]
            if many is None:
                a = end[first[i]]
                b = end[second[i]]
                s = a if a >= b else b
            else:
                s = max([end[q] for q in many])
            start[i] = s
            end[i] = s + t[i]
        return np.array(start), np.array(end[:n])

    def longest_tail(self, times: np.ndarray) -> np.ndarray:
        """For every node, the longest path from its start to the end of the iteration (its own
        time included), given node durations `times` (n,)."""
        n = len(self.nodes)
        tail = np.zeros(n + 1)
        ptr = self.level_ptr
        for lo, hi in zip(ptr[-2::-1], ptr[:0:-1]):
            tail[lo:hi] = times[lo:hi] + tail[self.succ_pad[lo:hi]].max(axis=1)
        return tail[:n]


def dag_arrays(schedule_or_dag: Schedule | nx.DiGraph) -> DagArrays:
    """Flatten a schedule (its edges built directly) or a DAG from `build_dag` into DagArrays."""
    if isinstance(schedule_or_dag, nx.DiGraph):
        schedule = schedule_or_dag.graph.get("schedule")
        if not isinstance(schedule, Schedule):
            raise ScheduleError("the DAG carries no schedule; build it with perseus.planner.dag.build_dag(schedule)")
        listed = [ins for row in schedule.stages for ins in row]
        at = {ins: i for i, ins in enumerate(listed)}
        pairs = np.array([(at[u], at[v]) for u, v in schedule_or_dag.edges], dtype=np.int64).reshape(-1, 2)
        raw_src, raw_dst = pairs[:, 0], pairs[:, 1]
    else:
        schedule = schedule_or_dag
        listed, raw_src, raw_dst = schedule_edges(schedule)
    n = len(listed)
    level = _levels(n, raw_src, raw_dst)
    if level is None:
        build_dag(schedule)  # raises ScheduleError naming the cycle
        raise ScheduleError(f"schedule {schedule.name!r} has a dependency cycle")
    # Stage-order listing is (stage, position), so a stable sort by level keeps that order inside a level.
    order = np.argsort(level, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    nodes = tuple(listed[k] for k in order.tolist())
    index = {ins: i for i, ins in enumerate(nodes)}

    src_r, dst_r = rank[raw_src], rank[raw_dst]
    by_dst = np.lexsort((src_r, dst_r))
    src, dst = src_r[by_dst], dst_r[by_dst]
    pred_ptr = np.concatenate(([0], np.cumsum(np.bincount(dst, minlength=n)))).astype(np.int64)
    by_src = np.lexsort((dst, src))
    succ_idx = dst[by_src].copy()
    succ_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=n)))).astype(np.int64)

    width = int(np.diff(pred_ptr).max(initial=0)) or 1
    pred_pad = np.full((n, width), n, dtype=np.int64)
    pred_pad[dst, np.arange(len(dst)) - pred_ptr[dst]] = src
    succ_pad = np.full((n, int(np.diff(succ_ptr).max(initial=0)) or 1), n, dtype=np.int64)
    succ_src = src[by_src]
    succ_pad[succ_src, np.arange(len(succ_src)) - succ_ptr[succ_src]] = succ_idx

    level_ptr = np.concatenate(([0], np.cumsum(np.bincount(level[order])))).astype(np.int64)
    stage = np.array([ins.stage for ins in nodes], dtype=np.int64)
    return DagArrays(
        schedule, nodes, index, src, dst, pred_ptr, src.copy(), succ_ptr, succ_idx, level_ptr, pred_pad, succ_pad, stage
    )


def _levels(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """Most edges on any path from a source to each node (Kahn's algorithm, one level at a
    time); None if the edges hold a cycle."""
    level = np.full(n, -1, dtype=np.int64)
    indegree = np.bincount(dst, minlength=n)
    order = np.argsort(src, kind="stable")
    succ_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=n))))
    succ = dst[order]
    frontier = np.flatnonzero(indegree == 0)
    depth = 0
    while len(frontier):
        level[frontier] = depth
        starts, ends = succ_ptr[frontier], succ_ptr[frontier + 1]
        counts = ends - starts
        reached = succ[np.repeat(ends - counts.cumsum(), counts) + np.arange(counts.sum())]
        indegree -= np.bincount(reached, minlength=n)
        touched = np.unique(reached)
        frontier = touched[indegree[touched] == 0]
        depth += 1
    return None if (level < 0).any() else level
