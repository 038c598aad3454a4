"""The evaluator: iteration time, energy and timeline of a frequency plan. Every number the
planner, the baselines, the benchmarks and the tests report comes from here.

Model: instruction i at frequency f takes t_i(f) and e_i(f) from the profile; it starts when its
last DAG predecessor ends; the iteration time T is the longest path. A rank that is not computing
draws the blocking power, so E = sum(e_i) + P_block * (N_ranks * T - sum(t_i)).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from perseus.exceptions import ConfigError
from perseus.planner.dag import DagArrays, dag_arrays
from perseus.profiler.profile import Profile
from perseus.schedules.instruction import Instruction, Schedule


@dataclass(frozen=True)
class StageStats:
    """One rank over one iteration: computing (busy) or waiting on a peer (blocked)."""

    stage: int
    busy_time_s: float
    blocked_time_s: float
    compute_energy_j: float
    blocking_energy_j: float

    @property
    def energy_j(self) -> float:
        return self.compute_energy_j + self.blocking_energy_j


@dataclass(frozen=True, eq=False)
class Evaluation:
    """The outcome of one frequency plan."""

    iteration_time_s: float
    energy_j: float
    frequencies: dict[Instruction, int]
    timeline: dict[Instruction, tuple[float, float]]  # (start, end) in seconds
    stages: list[StageStats]
    _evaluator: Evaluator = field(repr=False, compare=False)
    _start: np.ndarray = field(repr=False, compare=False)
    _end: np.ndarray = field(repr=False, compare=False)

    @property
    def compute_energy_j(self) -> float:
        return sum(s.compute_energy_j for s in self.stages)

    @property
    def blocking_energy_j(self) -> float:
        return sum(s.blocking_energy_j for s in self.stages)

    def critical_path(self) -> list[Instruction]:
        """A longest path, first instruction to last: each one starts when its predecessor ends."""
        arrays = self._evaluator.arrays
        start, end = self._start, self._end
        tol = 1e-9 * max(self.iteration_time_s, 1e-30)
        i = int(np.argmax(end))
        path = [i]
        while start[i] > tol:
            preds = arrays.preds(i)
            i = int(preds[np.argmax(end[preds])])
            path.append(i)
        return [arrays.nodes[k] for k in reversed(path)]


@dataclass(frozen=True, eq=False)
class Choices:
    """Profiled choices of one (profile stage, kind): arrays aligned, highest frequency first."""

    frequency: np.ndarray  # int64, MHz
    time: np.ndarray  # s
    energy: np.ndarray  # J


class Evaluator:
    """Precomputed arrays for evaluating many plans of one schedule against one profile.

    Node i is `arrays.nodes[i]` (a topological order). `choice_of[i]` indexes `choices`, the
    profiled (frequency, time, energy) choices of node i; nodes of the same profile stage and kind
    (`choice_keys`) share an entry. A plan in array form is one choice index per node, 0 being
    the highest frequency.
    """

    def __init__(self, schedule_or_dag: Schedule | nx.DiGraph | DagArrays, profile: Profile):
        self.arrays = schedule_or_dag if isinstance(schedule_or_dag, DagArrays) else dag_arrays(schedule_or_dag)
        self.schedule: Schedule = self.arrays.schedule
        self.profile = profile
        profile.validate(self.schedule)
        self.blocking_power_w = float(profile.blocking_power_w)
        self.num_stages = self.schedule.num_stages

        keys: dict[tuple[int, str], int] = {}
        choice_of = []
        for ins in self.arrays.nodes:
            key = (profile.stage_for(ins, self.schedule), ins.kind.value)
            choice_of.append(keys.setdefault(key, len(keys)))
        self.choice_keys: list[tuple[int, str]] = list(keys)
        self.choice_of = np.array(choice_of, dtype=np.int64)
        self.choices: list[Choices] = []
        for key in self.choice_keys:
            pts = profile.points[key]
            self.choices.append(
                Choices(
                    np.array([p.frequency for p in pts], dtype=np.int64),
                    np.array([p.time for p in pts], dtype=float),
                    np.array([p.energy for p in pts], dtype=float),
                )
            )
        # Nodes of each choice set, and its frequencies lowest first: `frequency_indices` per plan.
        self._nodes_of = [np.flatnonzero(self.choice_of == c) for c in range(len(self.choices))]
        self._ascending = [c.frequency[::-1] for c in self.choices]
        # All choice tables end to end, so that a plan's times are one gather.
        starts = np.cumsum([0] + [len(c.time) for c in self.choices])
        self._offset = starts[self.choice_of]
        self._flat_time = np.concatenate([c.time for c in self.choices])
        self._flat_energy = np.concatenate([c.energy for c in self.choices])

    @property
    def nodes(self) -> tuple[Instruction, ...]:
        return self.arrays.nodes

    def node_choices(self, i: int) -> Choices:
        return self.choices[self.choice_of[i]]

    def choice_indices(self, frequencies: Mapping[Instruction, int]) -> np.ndarray:
        """For each node, the index of its frequency among its choices (0 = highest)."""
        for ins in self.arrays.nodes:
            if ins not in frequencies:
                raise ConfigError(
                    f"no frequency given for instruction {ins}; the plan must cover every instruction of the schedule"
                )
        return self.frequency_indices(np.array([float(frequencies[ins]) for ins in self.arrays.nodes]))

    def times_energies(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Node time and energy arrays for per-node choice indices (as from `choice_indices`),
        shape (n,) or (k, n)."""
        flat = self._offset + np.asarray(indices, dtype=np.int64)
        return self._flat_time[flat], self._flat_energy[flat]

    def iteration_time(self, times: np.ndarray) -> float | np.ndarray:
        """Longest path length for node times `times`, shape (n,) or (k, n)."""
        _, end = self.arrays.longest_path(times)
        return end.max(axis=-1)

    def energy(self, iteration_time: float | np.ndarray, times: np.ndarray, energies: np.ndarray) -> float | np.ndarray:
        """E = sum(e_i) + P_block * (N_ranks * T - sum(t_i)): compute plus every idle rank-second."""
        return energies.sum(axis=-1) + self.blocking_power_w * (self.num_stages * iteration_time - times.sum(axis=-1))

    def evaluate_arrays(
        self, times: np.ndarray, energies: np.ndarray
    ) -> tuple[float, float] | tuple[np.ndarray, np.ndarray]:
        """(T, E) for node time and energy arrays of shape (n,) or (k, n) (k plans at once)."""
        times = np.asarray(times, dtype=float)
        energies = np.asarray(energies, dtype=float)
        T = self.iteration_time(times)
        E = self.energy(T, times, energies)
        if times.ndim == 1:
            return float(T), float(E)
        return np.asarray(T), np.asarray(E)  # already arrays (k plans); asarray only tells the type

    def time_energy(self, frequencies: np.ndarray) -> tuple[float, float]:
        """(T, E) of a plan given as each node's frequency (MHz, node order), the same floats as
        `evaluate`'s, without its timeline and per-stage statistics (the planner checks every
        plan it returns this way: a frontier is 50 plans, so no dict of instructions)."""
        t, e = self.times_energies(self.frequency_indices(frequencies))
        _, end = self.arrays.longest_path(t)
        return self._time_energy(t, e, end)

    def frequency_indices(self, frequencies: np.ndarray) -> np.ndarray:
        """`choice_indices` for each node's frequency in node order (ConfigError on one not
        profiled for its node)."""
        frequencies = np.asarray(frequencies)
        out = np.empty(len(frequencies), dtype=np.int64)
        for c, (nodes, ascending) in enumerate(zip(self._nodes_of, self._ascending)):
            at = np.searchsorted(ascending, frequencies[nodes])
            found = (at < len(ascending)) & (ascending[np.minimum(at, len(ascending) - 1)] == frequencies[nodes])
            if not found.all():
                i = int(nodes[np.argmin(found)])
                stage, kind = self.choice_keys[c]
                raise ConfigError(
                    f"instruction {self.arrays.nodes[i]}: frequency {frequencies[i]:g} MHz is not in the profile of "
                    f"stage {stage} {kind} (profiled {ascending[0]}..{ascending[-1]} MHz); use one of the profiled "
                    "frequencies"
                )
            out[nodes] = len(ascending) - 1 - at
        return out

    def _time_energy(self, t: np.ndarray, e: np.ndarray, end: np.ndarray) -> tuple[float, float]:
        T = float(end.max())
        return T, float(e.sum()) + self.blocking_power_w * (self.num_stages * T - float(t.sum()))

    def evaluate(self, frequencies: Mapping[Instruction, int]) -> Evaluation:
        """Full evaluation of a plan: T, E, the timeline and per-stage statistics."""
        t, e = self.times_energies(self.choice_indices(frequencies))
        start, end = self.arrays.longest_path(t)
        T, energy = self._time_energy(t, e, end)
        stage = self.arrays.stage
        stats = []
        for s in range(self.num_stages):
            busy = float(t[stage == s].sum())
            blocked = T - busy
            stats.append(StageStats(s, busy, blocked, float(e[stage == s].sum()), self.blocking_power_w * blocked))
        nodes = self.arrays.nodes
        return Evaluation(
            iteration_time_s=T,
            energy_j=energy,
            frequencies={ins: int(frequencies[ins]) for ins in nodes},
            timeline={ins: (float(start[i]), float(end[i])) for i, ins in enumerate(nodes)},
            stages=stats,
            _evaluator=self,
            _start=start,
            _end=end,
        )

    def frequencies_of(self, indices: np.ndarray) -> dict[Instruction, int]:
        """The plan (instruction -> MHz) for per-node choice indices."""
        return {
            ins: int(self.choices[self.choice_of[i]].frequency[indices[i]]) for i, ins in enumerate(self.arrays.nodes)
        }


def evaluate(
    schedule_or_dag: Schedule | nx.DiGraph | DagArrays, frequencies: Mapping[Instruction, int], profile: Profile
) -> Evaluation:
    """Evaluate one plan: a frequency (MHz, profiled) for every instruction of the schedule."""
    return Evaluator(schedule_or_dag, profile).evaluate(frequencies)


def max_frequencies(schedule: Schedule, profile: Profile) -> dict[Instruction, int]:
    """Every instruction at the highest frequency profiled for it."""
    return {ins: profile.points_for(ins, schedule)[0].frequency for ins in schedule.instructions()}


def uniform_frequencies(schedule: Schedule, profile: Profile, frequency: int) -> dict[Instruction, int]:
    """Every instruction at `frequency` (ConfigError naming the first instruction without it)."""
    plan = {}
    for ins in schedule.instructions():
        profile.lookup(profile.stage_for(ins, schedule), ins.kind, frequency)
        plan[ins] = frequency
    return plan


def shared_frequencies(schedule: Schedule, profile: Profile) -> list[int]:
    """Frequencies profiled for every instruction of the schedule, highest first: the choices
    of a single global clock."""
    common: set[int] | None = None
    for ins in schedule.instructions():
        freqs = {p.frequency for p in profile.points_for(ins, schedule)}
        common = freqs if common is None else common & freqs
    return sorted(common or (), reverse=True)
