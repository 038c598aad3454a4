"""Plans a GPU can follow: no clock held for less time than a clock change takes.

A clock change comes into force a switch latency after it is asked for. A stage's planned clocks
form segments (maximal runs of one clock); one that lasts less than the latency would run at its
neighbours' clocks, not its own, so the planned figures would not hold. Each such segment is
raised to the faster of its neighbours' clocks, never lowered (a faster clock does not lengthen
the iteration), until none is left below a neighbour. Runs of short instructions at one clock
need no change at all, so they keep their planned clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from perseus.planner.plan import Plan

if TYPE_CHECKING:
    from perseus.planner.solver import Planner


def segments(clocks: Sequence[int]) -> list[range]:
    """The index ranges of the maximal runs of equal clocks, in order."""
    runs: list[range] = []
    start = 0
    for i in range(1, len(clocks) + 1):
        if i == len(clocks) or clocks[i] != clocks[start]:
            runs.append(range(start, i))
            start = i
    return runs


def raise_short_segments(
    clocks: Sequence[int], times: Sequence[Mapping[int, float]], latency_s: float
) -> tuple[int, ...]:
    """`clocks` (one per instruction, in the order a stage runs them) with every segment shorter
    than `latency_s` raised to its faster neighbour's clock. `times[i]`: instruction i's time (s)
    at each clock it may run at; one without the target clock takes the lowest it has above it
    (else its highest). Each raise lifts at least one clock, so the loop ends."""
    planned = list(clocks)
    if not latency_s > 0:
        return tuple(planned)
    while True:
        runs = segments(planned)
        for k, run in enumerate(runs):
            if sum(times[i][planned[i]] for i in run) >= latency_s:
                continue
            target = max(planned[r.start] for r in runs[max(k - 1, 0) : k + 2])
            raised = [_at_least(times[i], target) for i in run]
            if any(new > planned[i] for i, new in zip(run, raised)):
                for i, new in zip(run, raised):
                    planned[i] = max(planned[i], new)
                break
        else:
            return tuple(planned)


def _at_least(times: Mapping[int, float], clock: int) -> int:
    """The lowest clock in `times` at or above `clock`, else the highest there is."""
    return min((f for f in times if f >= clock), default=max(times))


def followable(planner: Planner, plan: Plan, latencies_s: Sequence[float]) -> Plan:
    """`plan` with every stage's short segments raised (`raise_short_segments`, stage s's switch
    latency `latencies_s[s]`), its time and energy evaluated again by the planner's evaluator; the
    same plan when nothing changes. `planner`: the `Planner` that solved `plan`."""
    schedule = plan.schedule
    profile = planner.profile
    frequencies = dict(plan.frequencies)
    for s, row in enumerate(schedule.stages):
        times = [{p.frequency: p.time for p in profile.points_for(ins, schedule)} for ins in row]
        raised = raise_short_segments([plan.frequencies[ins] for ins in row], times, latencies_s[s])
        frequencies.update(zip(row, raised))
    if frequencies == plan.frequencies:
        return plan
    evaluator = planner.evaluator
    evaluation = evaluator.evaluate(frequencies)
    energy = evaluation.energy_j
    deadline_s = evaluation.iteration_time_s
    if plan.padded:  # every GPU blocks until the deadline, as the planner counted it
        deadline_s = max(plan.deadline_s, evaluation.iteration_time_s)
        energy += evaluator.blocking_power_w * evaluator.num_stages * (deadline_s - evaluation.iteration_time_s)
    elif plan.deadline_s > plan.iteration_time_s:
        deadline_s = plan.deadline_s
    bound = min(plan.lower_bound_j, energy)
    return dataclasses.replace(
        plan,
        frequencies=frequencies,
        iteration_time_s=evaluation.iteration_time_s,
        energy_j=energy,
        lower_bound_j=bound,
        gap=(energy - bound) / bound if bound > 0 else float("inf"),
        deadline_s=deadline_s,
    )
