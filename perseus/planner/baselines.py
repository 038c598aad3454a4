"""Baseline frequency plans to compare the planner against, all scored by the same evaluator.

- `max_frequency_plan`: every GPU at its highest clock (what training does by default).
- `uniform_plan`: one clock for every GPU, the lowest-energy one that meets the deadline (what a
  single global knob can do).
- `envpipe_plan`: the EnvPipe heuristic (ATC'23).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perseus.exceptions import PlanError
from perseus.planner.evaluator import Evaluator, max_frequencies, shared_frequencies
from perseus.schedules.instruction import Instruction, Kind

_BACKWARD_KINDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class BaselinePlan:
    """A baseline's frequencies and their evaluated iteration time and energy."""

    name: str
    frequencies: dict[Instruction, int]
    iteration_time_s: float
    energy_j: float


def _evaluated(name: str, evaluator: Evaluator, choices: np.ndarray) -> BaselinePlan:
    frequencies = evaluator.frequencies_of(choices)
    evaluation = evaluator.evaluate(frequencies)
    return BaselinePlan(name, frequencies, evaluation.iteration_time_s, evaluation.energy_j)


def max_frequency_plan(evaluator: Evaluator) -> BaselinePlan:
    frequencies = max_frequencies(evaluator.schedule, evaluator.profile)
    evaluation = evaluator.evaluate(frequencies)
    return BaselinePlan("max frequency", frequencies, evaluation.iteration_time_s, evaluation.energy_j)


def uniform_plan(evaluator: Evaluator, deadline_s: float) -> BaselinePlan:
    """The one clock for all GPUs with the least energy among those that meet the deadline."""
    freqs = shared_frequencies(evaluator.schedule, evaluator.profile)
    if not freqs:
        raise PlanError("no frequency is profiled for every instruction, so no uniform clock exists")
    n = len(evaluator.nodes)
    choices = np.array([evaluator.frequency_indices(np.full(n, f)) for f in freqs])
    T, E = evaluator.evaluate_arrays(*evaluator.times_energies(choices))
    assert isinstance(T, np.ndarray) and isinstance(E, np.ndarray)  # one plan per row of `choices`
    ok = np.flatnonzero(T <= deadline_s)
    if len(ok) == 0:
        raise PlanError(f"no uniform clock meets the deadline {deadline_s:.6g} s (fastest takes {T.min():.6g} s)")
    best = ok[np.argmin(E[ok])]
    return _evaluated(f"uniform {freqs[best]} MHz", evaluator, choices[best])


def envpipe_plan(evaluator: Evaluator, deadline_s: float | None = None) -> BaselinePlan:
    """EnvPipe: the last stage and every stage's first forward and last backward at the highest
    clock, everything else at its stage's minimum-energy clock; then, while the iteration is
    slower than the deadline (default: the all-max time), raise every instruction on the critical
    path one clock step."""
    arrays, schedule = evaluator.arrays, evaluator.schedule
    n = len(arrays.nodes)
    if deadline_s is None:
        deadline_s = max_frequency_plan(evaluator).iteration_time_s
    pinned = set(schedule.stages[-1])
    for row in schedule.stages:
        forwards = [ins for ins in row if ins.kind == Kind.FORWARD]
        backwards = [ins for ins in row if ins.kind in _BACKWARD_KINDS]
        pinned.update(forwards[:1] + backwards[-1:])
    best_freq = {s: _min_energy_frequency(evaluator, s) for s in range(schedule.num_stages)}
    choices = np.zeros(n, dtype=np.int64)
    for i, ins in enumerate(arrays.nodes):
        if ins not in pinned:
            opts = evaluator.node_choices(i)
            choices[i] = int(np.argmin(np.abs(opts.frequency - best_freq[ins.stage])))
    while True:
        times, _ = evaluator.times_energies(choices)
        start, end = arrays.longest_path(times)
        if end.max() <= deadline_s:
            break
        raised = False
        for i in _critical_path(arrays, start, end):
            if choices[i] > 0:
                choices[i] -= 1  # index 0 is the highest clock
                raised = True
        if not raised:
            raise PlanError(
                f"EnvPipe cannot meet the deadline {deadline_s:.6g} s: its critical path is all at the highest clock"
            )
    return _evaluated("EnvPipe", evaluator, choices)


def _min_energy_frequency(evaluator: Evaluator, stage: int) -> int:
    """The clock at which one microbatch of the stage (all its instruction kinds) takes least energy."""
    total: dict[int, float] = {}
    kinds = {evaluator.choice_of[i] for i, ins in enumerate(evaluator.nodes) if ins.stage == stage}
    common: set[int] | None = None
    for k in kinds:
        opts = evaluator.choices[k]
        freqs = set(opts.frequency.tolist())
        common = freqs if common is None else common & freqs
        for f, e in zip(opts.frequency.tolist(), opts.energy.tolist()):
            total[f] = total.get(f, 0.0) + e
    candidates = sorted(common or total)
    return min(candidates, key=lambda f: (total[f], -f))


def _critical_path(arrays, start: np.ndarray, end: np.ndarray) -> list[int]:
    """Node indices of one longest path, last node first: from the node that ends last, each
    node's predecessor that ends last (the first such in predecessor order), found for every
    node at once (a walk of one argmax per node took half of EnvPipe's time at 32 x 512)."""
    ends = np.append(end, -np.inf)  # the padding slot never ends last
    pad = arrays.pred_pad
    latest = pad[np.arange(len(end)), np.argmax(ends[pad], axis=1)].tolist()
    starts = start.tolist()
    i = int(np.argmax(end))
    path = [i]
    while starts[i] > 0.0:
        i = latest[i]
        path.append(i)
    return path
