"""The dependency DAG of a schedule, as a networkx graph and as flat numpy arrays.

Edges: consecutive instructions on a rank; F(v, m) -> F(v+1, m) along the virtual (model)
stages; F of the last virtual stage -> its backward; the input-gradient producer (B or I) of
v+1 -> that of v; and I(v, m) -> W(v, m). The arrays put nodes in level order (level = most
edges on any path from a source), so a level is a contiguous slice and the longest path can be
computed one level at a time with vectorized numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from perseus.exceptions import ScheduleError
from perseus.schedules.instruction import Instruction, Kind, Schedule


def build_dag(schedule: Schedule) -> nx.DiGraph:
    """The dependency graph of `schedule` (nodes are Instructions; `graph.graph["schedule"]` is
    the schedule). A cycle means the schedule would deadlock: ScheduleError names it."""
    schedule.validate()
    graph = nx.DiGraph(schedule=schedule)
    by_key: dict[tuple[int, Kind, int], Instruction] = {}
    for row in schedule.stages:
        graph.add_nodes_from(row)
        graph.add_edges_from(zip(row, row[1:]))
        for ins in row:
            by_key[(schedule.virtual_stage(ins), ins.kind, ins.microbatch)] = ins

    last = schedule.num_virtual_stages - 1
    for m in range(schedule.num_microbatches):
        grads = []
        for v in range(last + 1):
            grad = by_key.get((v, Kind.BACKWARD, m)) or by_key[(v, Kind.BACKWARD_INPUT, m)]
            grads.append(grad)
            weight = by_key.get((v, Kind.BACKWARD_WEIGHT, m))
            if weight is not None:
                graph.add_edge(grad, weight)
            if v < last:
                graph.add_edge(by_key[(v, Kind.FORWARD, m)], by_key[(v + 1, Kind.FORWARD, m)])
        graph.add_edge(by_key[(last, Kind.FORWARD, m)], grads[last])
        graph.add_edges_from(zip(grads[1:], grads[:-1]))

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
    stage: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def preds(self, i: int) -> np.ndarray:
        return self.pred_idx[self.pred_ptr[i] : self.pred_ptr[i + 1]]

    def succs(self, i: int) -> np.ndarray:
        return self.succ_idx[self.succ_ptr[i] : self.succ_ptr[i + 1]]

    def longest_path(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Earliest (start, end) of every node given node durations; `times` is (n,) or (k, n)
        for k assignments at once. The iteration time is end.max(axis=-1)."""
        times = np.asarray(times, dtype=float)
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


def dag_arrays(schedule_or_dag: Schedule | nx.DiGraph) -> DagArrays:
    """Flatten a schedule (building its DAG) or a DAG from `build_dag` into DagArrays."""
    graph = schedule_or_dag if isinstance(schedule_or_dag, nx.DiGraph) else build_dag(schedule_or_dag)
    schedule = graph.graph.get("schedule")
    if not isinstance(schedule, Schedule):
        raise ScheduleError("the DAG carries no schedule; build it with perseus.planner.dag.build_dag(schedule)")
    position = {ins: (ins.stage, k) for row in schedule.stages for k, ins in enumerate(row)}
    level: dict[Instruction, int] = {}
    for ins in nx.topological_sort(graph):
        level[ins] = max((level[p] + 1 for p in graph.predecessors(ins)), default=0)
    nodes = tuple(sorted(graph.nodes, key=lambda ins: (level[ins], position[ins])))
    index = {ins: i for i, ins in enumerate(nodes)}
    n = len(nodes)

    edges = np.array([(index[u], index[v]) for u, v in graph.edges], dtype=np.int64).reshape(-1, 2)
    order = np.lexsort((edges[:, 0], edges[:, 1]))
    src, dst = edges[order, 0].copy(), edges[order, 1].copy()
    pred_ptr = np.concatenate(([0], np.cumsum(np.bincount(dst, minlength=n)))).astype(np.int64)
    by_src = np.lexsort((dst, src))
    succ_idx = dst[by_src].copy()
    succ_ptr = np.concatenate(([0], np.cumsum(np.bincount(src, minlength=n)))).astype(np.int64)

    width = int(np.diff(pred_ptr).max(initial=0)) or 1
    pred_pad = np.full((n, width), n, dtype=np.int64)
    for i in range(n):
        p = src[pred_ptr[i] : pred_ptr[i + 1]]
        pred_pad[i, : len(p)] = p

    levels = np.array([level[ins] for ins in nodes], dtype=np.int64)
    level_ptr = np.concatenate(([0], np.cumsum(np.bincount(levels)))).astype(np.int64)
    stage = np.array([ins.stage for ins in nodes], dtype=np.int64)
    return DagArrays(
        schedule, nodes, index, src, dst, pred_ptr, src.copy(), succ_ptr, succ_idx, level_ptr, pred_pad, stage
    )
