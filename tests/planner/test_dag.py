"""Schedule DAGs against hand-worked small cases, cycle detection, and the flat arrays."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from perseus.exceptions import ScheduleError
from perseus.planner import dag
from perseus.planner.dag import build_dag, dag_arrays
from perseus.schedules import Instruction, Kind, Schedule, build_schedule


def edges(schedule: Schedule) -> set[str]:
    return {f"{u} -> {v}" for u, v in build_dag(schedule).edges}


def chain(*names: str) -> set[str]:
    return {f"{a} -> {b}" for a, b in zip(names, names[1:])}


def rank_edges(schedule: Schedule) -> set[str]:
    out: set[str] = set()
    for row in schedule.stages:
        out |= chain(*map(str, row))
    return out


def test_1f1b_2x4_edges():
    s = build_schedule("1f1b", 2, 4)
    expected = chain("F0@s0", "F1@s0", "B0@s0", "F2@s0", "B1@s0", "F3@s0", "B2@s0", "B3@s0")
    expected |= chain("F0@s1", "B0@s1", "F1@s1", "B1@s1", "F2@s1", "B2@s1", "F3@s1", "B3@s1")
    for m in range(4):
        expected |= chain(f"F{m}@s0", f"F{m}@s1", f"B{m}@s1", f"B{m}@s0")
    assert edges(s) == expected
    assert len(expected) == 14 + 4 * 2  # F(s1)->B(s1) is also the rank order edge
    assert build_dag(s).graph["schedule"] is s


def test_gpipe_2x2_edges():
    s = build_schedule("gpipe", 2, 2)
    expected = chain("F0@s0", "F1@s0", "B0@s0", "B1@s0") | chain("F0@s1", "F1@s1", "B0@s1", "B1@s1")
    expected |= chain("F0@s0", "F0@s1", "B0@s1", "B0@s0") | chain("F1@s0", "F1@s1", "B1@s1", "B1@s0")
    assert edges(s) == expected


def test_interleaved_2x2_two_chunks_edges():
    s = build_schedule("interleaved-1f1b", 2, 2, num_chunks=2)
    assert [" ".join(map(str, row)) for row in s.stages] == [
        "F0@s0 F1@s0 F0@s0.c1 F1@s0.c1 B0@s0.c1 B1@s0.c1 B0@s0 B1@s0",
        "F0@s1 F1@s1 F0@s1.c1 B0@s1.c1 F1@s1.c1 B1@s1.c1 B0@s1 B1@s1",
    ]
    expected = rank_edges(s)
    for m in range(2):
        # virtual stages 0, 1, 2, 3 = (rank 0, chunk 0), (1, 0), (0, 1), (1, 1)
        expected |= chain(
            f"F{m}@s0", f"F{m}@s1", f"F{m}@s0.c1", f"F{m}@s1.c1", f"B{m}@s1.c1", f"B{m}@s0.c1", f"B{m}@s1", f"B{m}@s0"
        )
    assert edges(s) == expected


def test_zb_h1_2x2_edges():
    s = build_schedule("zb-h1", 2, 2)
    assert [" ".join(map(str, row)) for row in s.stages] == [
        "F0@s0 F1@s0 I0@s0 W0@s0 I1@s0 W1@s0",
        "F0@s1 I0@s1 F1@s1 I1@s1 W0@s1 W1@s1",
    ]
    expected = rank_edges(s)
    for m in range(2):
        expected |= chain(f"F{m}@s0", f"F{m}@s1", f"I{m}@s1", f"I{m}@s0")
        expected |= chain(f"I{m}@s0", f"W{m}@s0") | chain(f"I{m}@s1", f"W{m}@s1")
    assert edges(s) == expected
    # W of stage 1 is not on the way to stage 0: only I carries the gradient back.
    assert all(u.stage == v.stage for u, v in build_dag(s).edges if u.kind is Kind.BACKWARD_WEIGHT)


def test_cycle_is_named_in_order():
    F, B = Kind.FORWARD, Kind.BACKWARD
    s0 = (Instruction(0, F, 0), Instruction(0, B, 0), Instruction(0, F, 1), Instruction(0, B, 1))
    s1 = (Instruction(1, F, 1), Instruction(1, F, 0), Instruction(1, B, 0), Instruction(1, B, 1))
    with pytest.raises(ScheduleError, match="would deadlock") as err:
        build_dag(Schedule("bad", 2, (s0, s1)))
    names = str(err.value).split("cycle ")[1].split(";")[0].split(" -> ")
    assert names[0] == names[-1] and len(names) == 6
    cycle = ["F1@s1", "F0@s1", "B0@s1", "B0@s0", "F1@s0"]
    k = cycle.index(names[0])
    assert names[:-1] == cycle[k:] + cycle[:k]


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_arrays_are_consistent(name, chunks):
    s = build_schedule(name, 4, 8, num_chunks=chunks)
    graph = build_dag(s)
    a = dag_arrays(graph)
    assert set(a.nodes) == set(graph.nodes) and len(a.nodes) == graph.number_of_nodes()
    assert all(a.index[ins] == i for i, ins in enumerate(a.nodes))
    got = [(a.nodes[u], a.nodes[v]) for u, v in zip(a.src, a.dst)]
    assert set(got) == set(graph.edges) and len(got) == graph.number_of_edges()
    assert a.num_nodes == dag_arrays(s).num_nodes and np.array_equal(dag_arrays(s).src, a.src)
    assert np.all(a.src < a.dst)  # topological order
    for i in range(a.num_nodes):
        assert sorted(a.preds(i)) == sorted(a.index[p] for p in graph.predecessors(a.nodes[i]))
        assert sorted(a.succs(i)) == sorted(a.index[q] for q in graph.successors(a.nodes[i]))
        row = a.pred_pad[i]
        assert sorted(row[row < a.num_nodes]) == sorted(a.preds(i))
    assert a.level_ptr[0] == 0 and a.level_ptr[-1] == a.num_nodes
    assert list(a.stage) == [ins.stage for ins in a.nodes]


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_longest_path_matches_networkx(name, chunks):
    s = build_schedule(name, 4, 8, num_chunks=chunks)
    graph = build_dag(s)
    a = dag_arrays(graph)
    rng = np.random.default_rng(0)
    times = rng.uniform(0.5, 2.0, size=(3, a.num_nodes))
    start, end = a.longest_path(times)
    for k in range(3):
        for ins in graph.nodes:
            graph.nodes[ins]["t"] = times[k, a.index[ins]]
        weighted = nx.DiGraph()
        for u, v in graph.edges:
            weighted.add_edge(u, v, w=graph.nodes[u]["t"])
        sink = "sink"
        for ins in graph.nodes:
            weighted.add_edge(ins, sink, w=graph.nodes[ins]["t"])
        assert end[k].max() == pytest.approx(nx.dag_longest_path_length(weighted, weight="w"), rel=1e-12)
        single_start, single_end = a.longest_path(times[k])
        assert np.array_equal(single_end, end[k]) and np.array_equal(single_start, start[k])


def test_dag_without_schedule_is_refused():
    with pytest.raises(ScheduleError, match="build_dag"):
        dag_arrays(nx.DiGraph())


def test_every_built_schedule_is_acyclic():
    for name, chunk_counts in [("gpipe", [1]), ("1f1b", [1]), ("zb-h1", [1]), ("interleaved-1f1b", [2, 3])]:
        for n in range(1, 6):
            for m in range(1, 11):
                for v in chunk_counts:
                    if name == "interleaved-1f1b" and m % n:
                        continue
                    graph = build_dag(build_schedule(name, n, m, num_chunks=v))
                    assert nx.is_directed_acyclic_graph(graph)


def with_extra_edges(schedule: Schedule, rng: np.random.Generator):
    """The schedule's DAG arrays with up to 2 random forward edges into each node past the 4th:
    in-degrees past the two a schedule gives."""
    graph = build_dag(schedule)
    order = list(nx.topological_sort(graph))
    for v in order[4:]:
        for u in rng.choice(order[: order.index(v)], size=int(rng.integers(0, 3)), replace=False):
            graph.add_edge(u, v)
    return dag_arrays(graph)


def test_longest_path_of_one_assignment_with_many_predecessors():
    """The scalar longest path reads two predecessors directly and takes max() over more: a DAG
    with in-degrees up to 4 (extra forward edges) gives the same bits as the batched one."""
    rng = np.random.default_rng(1)
    a = with_extra_edges(build_schedule("1f1b", 3, 6), rng)
    assert np.diff(a.pred_ptr).max() >= 4
    times = rng.uniform(0.5, 2.0, size=(2, a.num_nodes))
    start, end = a.longest_path(times)
    for k in range(2):
        single_start, single_end = a.longest_path(times[k])
        assert np.array_equal(single_end, end[k]) and np.array_equal(single_start, start[k])


@pytest.mark.skipif(dag._flow is None, reason="the planner's C extension is not built here")
def test_the_c_longest_path_gives_the_python_loops_bits_and_refuses_a_bad_order():
    """One assignment's longest path runs in C where the extension is built; the Python loop
    (a build without a compiler) must give the same bits, on in-degrees up to 4 too."""
    rng = np.random.default_rng(2)
    a = with_extra_edges(build_schedule("zb-h1", 4, 8), rng)
    for times in rng.uniform(0.0, 2.0, size=(4, a.num_nodes)):
        c_start, c_end = a.longest_path(times)
        py_start, py_end = a._longest_path_loop(times)
        assert np.array_equal(c_start, py_start) and np.array_equal(c_end, py_end)
    ptr, idx = a._pred_csr32
    backwards = idx.copy()
    backwards[-1] = a.num_nodes - 1  # the last node listed as its own predecessor: not topological
    with pytest.raises(ValueError, match="all before it"):
        dag._flow.longest_path(ptr, backwards, times, np.empty(a.num_nodes), np.empty(a.num_nodes))
    with pytest.raises(ValueError, match="pred_ptr must be a writable contiguous 1-d array"):
        dag._flow.longest_path(ptr, idx, times[:-1], np.empty(a.num_nodes), np.empty(a.num_nodes))
