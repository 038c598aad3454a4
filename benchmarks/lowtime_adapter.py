"""Run lowtime 0.3.0 (Perseus' own Phillips-Dessouky solver, `pip install lowtime==0.3.0`) on our
schedule and profile, and score every frequency assignment it visits with OUR evaluator.

lowtime works on 1 ms-quantized times and an exponential cost model fitted to each instruction's
(time, effective energy) choices, so its own reported cost cannot be compared; only its knob
(frequency) choices are used. Its sweep starts at the slowest plan and shortens the iteration one
quantum at a time, so one run yields plans for every deadline. Benchmark-only: not imported by
the perseus package.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import networkx as nx
import numpy as np

from perseus.planner.evaluator import Evaluator

UNIT_TIME_S = 0.001  # lowtime's Perseus example quantizes time to 1 ms


@dataclass
class LowtimeRun:
    """What one lowtime sweep produced, evaluated by our evaluator."""

    solve_time_s: float  # time inside lowtime only (our evaluation excluded)
    iterations: int
    finished: bool  # False when the time budget cut the sweep short
    times_s: np.ndarray  # evaluated iteration time of each visited plan
    energies_j: np.ndarray  # evaluated energy of each visited plan
    choices: list[np.ndarray]  # per-node choice indices (evaluator order) of each visited plan

    def best_within(self, deadline_s: float) -> int | None:
        """Index of the least-energy visited plan that meets the deadline, if any."""
        ok = np.flatnonzero(self.times_s <= deadline_s)
        return None if len(ok) == 0 else int(ok[np.argmin(self.energies_j[ok])])


def run_lowtime(evaluator: Evaluator, budget_s: float = float("inf"), batch: int = 256) -> LowtimeRun:
    """Build lowtime's DAG from `evaluator`'s schedule and profile and run its solver to the end
    (or until `budget_s` seconds of solver time)."""
    from lowtime.cost_model import ExponentialModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec
    from lowtime.solver import PhillipsDessouky

    logging.getLogger("lowtime").setLevel(logging.WARNING)
    started = time.perf_counter()
    specs = []
    for choice in evaluator.choices:
        options = [
            ExecutionOption[int](real_time=float(t), unit_time=UNIT_TIME_S, cost=float(e), knob=int(f))
            for f, t, e in zip(choice.frequency, choice.time, choice.energy)
        ]
        candidates = CandidateExecutionOptions[int](options=options)
        # Effective energy, as in lowtime's Perseus example.
        for option in candidates.options:
            option.cost -= evaluator.blocking_power_w * option.quant_time * option.unit_time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its curve-fit grid search warns on the guesses it rejects
            model = ExponentialModel(candidates)
        specs.append(OperationSpec[int](options=candidates, cost_model=model))

    arrays = evaluator.arrays
    n = len(arrays.nodes)
    dag = nx.DiGraph()
    ops = []
    for i in range(n):
        op = Operation[int](spec=specs[evaluator.choice_of[i]])
        ops.append(op)
        dag.add_node(i + 2, op=op)
    dag.add_edges_from(zip((arrays.src + 2).tolist(), (arrays.dst + 2).tolist()))
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    by_frequency = [{int(f): k for k, f in enumerate(choice.frequency)} for choice in evaluator.choices]
    index = [by_frequency[evaluator.choice_of[i]] for i in range(n)]

    solve_time = time.perf_counter() - started
    times, energies, visited, pending = [], [], [], []

    def flush() -> None:
        if pending:
            t, e = evaluator.evaluate_arrays(*evaluator.times_energies(np.array(pending)))
            times.extend(np.atleast_1d(t).tolist())
            energies.extend(np.atleast_1d(e).tolist())
            visited.extend(pending)
            pending.clear()

    iterations, finished = 0, False
    steps = PhillipsDessouky(dag).run()
    while True:
        tick = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            finished = True
        solve_time += time.perf_counter() - tick
        if finished:
            break
        iterations += 1
        pending.append(np.array([index[i][op.assigned_knob] for i, op in enumerate(ops)], dtype=np.int64))
        if len(pending) >= batch:
            flush()
        if solve_time > budget_s:
            break
    flush()
    return LowtimeRun(solve_time, iterations, finished, np.array(times), np.array(energies), visited)
