"""A schedule and a profile flattened into arrays: the input of every planning algorithm.

Node i is `dag.nodes[i]` (a topological order). Instructions that share a profile row set share
an `Options` (a "type"). A choice vector holds, per node, an index into its type's options.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from perseus.planner.dag import DagArrays, dag_arrays
from perseus.planner.options import Options, pareto_options
from perseus.profiler.profile import Profile
from perseus.schedules.instruction import Schedule


@dataclass(frozen=True)
class Problem:
    """Everything the solvers need, as flat arrays; built once per (schedule, profile)."""

    dag: DagArrays
    options: tuple[Options, ...]
    node_type: np.ndarray
    blocking_power_w: float

    @classmethod
    def build(cls, schedule: Schedule, profile: Profile) -> Problem:
        profile.validate(schedule)
        dag = dag_arrays(schedule)
        keys: dict[tuple[int, str], int] = {}
        options: list[Options] = []
        node_type = np.empty(dag.num_nodes, dtype=np.int64)
        for i, ins in enumerate(dag.nodes):
            key = (profile.stage_for(ins, schedule), ins.kind.value)
            if key not in keys:
                keys[key] = len(options)
                what = f"stage {key[0]} instruction {key[1]}"
                options.append(pareto_options(profile.points_for(ins, schedule), profile.blocking_power_w, what))
            node_type[i] = keys[key]
        return cls(dag, tuple(options), node_type, float(profile.blocking_power_w))

    @property
    def num_nodes(self) -> int:
        return self.dag.num_nodes

    @property
    def num_stages(self) -> int:
        return self.dag.schedule.num_stages

    def restricted(self, deadline_s: float) -> Problem:
        """The same problem without the choices no plan meeting `deadline_s` can take: node i
        starts no earlier than its predecessors allow at their fastest, and what follows it needs
        at least its fastest tail, so d_i <= deadline - earliest start - fastest rest. The hull of
        the choices left is tighter where that room is short (a stronger bound, same plans)."""
        fastest = self.times(self.fastest())
        start, _ = self.dag.longest_path(fastest)
        room = deadline_s - start - (self.dag.longest_tail(fastest) - fastest)
        room = room * (1 + 1e-12) + 1e-15  # never drop a choice that fits by rounding
        options = list(self.options)
        node_type = self.node_type.copy()
        cut_type: dict[tuple[int, int], int] = {}
        for k, opts in enumerate(self.options):
            nodes = np.flatnonzero(self.node_type == k)
            keep = np.maximum(np.searchsorted(opts.time, room[nodes], side="right"), 1)
            for count in np.unique(keep[keep < len(opts)]).tolist():
                cut_type[(k, count)] = len(options)
                options.append(opts.prefix(count))
                node_type[nodes[keep == count]] = cut_type[(k, count)]
        if not cut_type:
            return self
        return Problem(self.dag, tuple(options), node_type, self.blocking_power_w)

    def on_hull(self) -> Problem:
        """The same problem with each type's hull vertices as its only choices: choice k of type t
        is `options[t].hull[k]` here (`from_hull` maps back). Rounding onto hull vertices alone
        lands on the points the relaxation mixes, where rounding to the nearest profiled clock
        often lands between them, above the hull (noisy profiles, most of all)."""
        options = tuple(
            Options(o.frequency[o.hull], o.time[o.hull], o.energy[o.hull], o.cost[o.hull], np.arange(len(o.hull)))
            for o in self.options
        )
        return Problem(self.dag, options, self.node_type, self.blocking_power_w)

    def from_hull(self, choice: np.ndarray) -> np.ndarray:
        """A choice vector of `on_hull()`'s problem as one of this problem."""
        out = np.empty_like(choice)
        for k, opts in enumerate(self.options):
            mask = self.node_type == k
            out[mask] = opts.hull[choice[mask]]
        return out

    def node_options(self, i: int) -> Options:
        return self.options[self.node_type[i]]

    @cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        """Each field's choices as one (type, choice) table padded with +inf: a choice vector's values
        are then one gather (a loop over types took 10-15% of a service re-plan at 8 x 96), and no
        padded slot ever fits a time limit (the vectorized pair sweep reads them too)."""
        width = max(len(opts) for opts in self.options)
        tables = {}
        for field in ("time", "cost", "frequency"):
            table = np.full((len(self.options), width), np.inf)
            for k, opts in enumerate(self.options):
                table[k, : len(opts)] = getattr(opts, field)
            tables[field] = table
        return tables

    def table(self, field: str) -> np.ndarray:
        """`field` ("time", "cost" or "frequency") of choice k of type t at [t, k], +inf past the type's
        choices. Shared: read, never write."""
        return self._tables[field]

    def _per_node(self, field: str, choice: np.ndarray) -> np.ndarray:
        return self._tables[field][self.node_type, choice]

    def times(self, choice: np.ndarray) -> np.ndarray:
        return self._per_node("time", choice)

    def costs(self, choice: np.ndarray) -> np.ndarray:
        return self._per_node("cost", choice)

    def fastest(self) -> np.ndarray:
        """Every node at its fastest Pareto choice."""
        return np.zeros(self.num_nodes, dtype=np.int64)

    def iteration_time(self, times: np.ndarray) -> float:
        return float(self.dag.longest_path(times)[1].max())

    def energy(self, choice: np.ndarray) -> tuple[float, float]:
        """(iteration time, energy) of a choice vector: sum(c) + P_block * N * T."""
        t = self.iteration_time(self.times(choice))
        return t, float(self.costs(choice).sum()) + self.blocking_power_w * self.num_stages * t

    def frequencies(self, choice: np.ndarray) -> np.ndarray:
        """Each node's frequency (MHz) for a choice vector."""
        return self._per_node("frequency", choice).astype(np.int64)
