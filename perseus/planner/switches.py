"""Plans a GPU can follow, and what they spend where clock changes take time.

A clock change comes into force a switch latency after it is asked for. A stage's planned clocks
form segments (maximal runs of one clock); one that lasts less than the latency would run at its
neighbours' clocks, not its own, so the planned figures would not hold. Each such segment is
raised to the faster of its neighbours' clocks, never lowered (a faster clock does not lengthen
the iteration), until none is left below a neighbour. Runs of short instructions at one clock
need no change at all, so they keep their planned clock.

Even a segment long enough runs its first moments at the clock before it: the controller asks
for a lower clock as the segment starts (so the GPU keeps the faster one for the latency) and
for a higher one `early_lead_s` before it (the tail of the segment before runs faster). So each
change to a lower clock forgoes a latency's worth of its saving, and a plan that changes clocks
often saves much less than its per-instruction figures say. `stage_run` replays that on a stage's
timeline (as perseus.devices.sim runs work across a change); `followable` states the plan's
energy that way and merges short segments into a neighbour's clock wherever that costs less
energy so replayed, within the plan's iteration time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from perseus.controller.latency import early_lead_s
from perseus.planner.native import extension as _flow
from perseus.planner.plan import Plan

if TYPE_CHECKING:
    from perseus.planner.solver import Planner
    from perseus.profiler.profile import Profile
    from perseus.schedules.instruction import Instruction as Ins


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


def _at_least(times: Mapping[int, object], clock: int) -> int:
    """The lowest clock in `times` at or above `clock`, else the highest there is."""
    if clock in times:
        return clock
    return min((f for f in times if f >= clock), default=max(times))


#: A clock's (time s, energy J) for one instruction.
Table = Mapping[int, tuple[float, float]]
#: A stage's switch latency (s) to a target clock (MHz).
Latency = Callable[[int], float]
#: Segments at most this many latencies long are tried at a neighbour's clock.
MERGE_WITHIN_LATENCIES = 4.0
#: Passes over every stage's segments, and trial plans evaluated, at most (deterministic bounds).
#: At 8 x 96 with the simulator's realistic A100 latencies a merge tries about 1,100 moves over
#: all 8 stages (1,000 stopped it in stage 5), in about 40 ms.
MERGE_PASSES = 3
MERGE_TRIALS = 4000


def clock_changes(clocks: Sequence[int], starts: Sequence[float], latency: Latency) -> list[tuple[float, int, float]]:
    """When each clock is in force on a stage that runs `clocks` from `starts` (s), as
    (from, MHz, asked at), the first from -inf: the plan repeats, so an iteration begins at its
    last instruction's clock. A change to a lower clock is asked for as its segment starts, one
    to a higher clock `early_lead_s` before (not before the segment ahead of it starts, as the
    controller does); each is in force its latency later, and a request replaces one not yet in force."""
    n = len(clocks)
    calls: list[tuple[float, int]] = []
    runs = segments(clocks)
    for k, run in enumerate(runs):
        target, previous = clocks[run.start], clocks[run.start - 1]
        if target == previous:
            continue  # one segment, or the first continues the last
        at = starts[run.start]
        if target > previous:
            at -= early_lead_s(latency(target))
            if k > 0:
                at = max(at, starts[runs[k - 1].start])
        calls.append((at, target))
    force = [(-math.inf, clocks[n - 1], -math.inf)] if n else []
    pending: tuple[float, int, float] | None = None
    for asked, target in sorted(calls, key=lambda c: c[0]):
        if pending is not None and pending[0] <= asked:
            force.append(pending)
        pending = (asked + latency(target), target, asked)
    if pending is not None:
        force.append(pending)
    return force


def stage_run(
    tables: Sequence[Table], clocks: Sequence[int], starts: Sequence[float], latency: Latency
) -> tuple[list[float], list[float]]:
    """Each instruction's (time, energy) when a stage runs `clocks` from `starts` and every
    change takes its latency (`clock_changes`), as the simulated GPU runs work: at the clock in
    force, the rest of it at a new clock asked for before it started once that is in force (one
    asked for while it runs leaves it alone), energy at each clock's rate. `tables[i]`:
    instruction i's (time, energy) per clock; a clock it lacks counts as the lowest above it."""
    force = clock_changes(clocks, starts, latency)
    times, energies = [], []
    k = 0
    for table, begin in zip(tables, starts):
        while k + 1 < len(force) and force[k + 1][0] <= begin:
            k += 1
        j = k + 1
        while j < len(force) and force[j][2] <= begin:  # asked for before it started (asked in order)
            j += 1
        if j == k + 1:  # the clock in force runs all of it (most instructions): the loop below, unrolled
            t, e = table[_at_least(table, force[k][1])]
            times.append((begin + t) - begin)
            energies.append(e)
            continue
        later = force[k + 1 : j]
        pieces = [force[k][1]] + [clock for _, clock, _ in later]
        untils = [at for at, _, _ in later] + [math.inf]
        now, left, energy = begin, 1.0, 0.0
        for clock, until in zip(pieces, untils):
            t, e = table[_at_least(table, clock)]
            if now + left * t <= until:
                energy += left * e
                now += left * t
                break
            done = (until - now) / t
            left -= done
            energy += done * e
            now = until
        times.append(now - begin)
        energies.append(energy)
    return times, energies


class _Replay:
    """A plan's stages replayed with their switch latencies against the planner's DAG."""

    def __init__(self, planner: Planner, frequencies: Mapping[Ins, int], latencies: Sequence[Latency]) -> None:
        evaluator = planner.evaluator
        self.arrays = evaluator.arrays
        self.power = evaluator.blocking_power_w
        self.num_stages = evaluator.num_stages
        self.latencies = latencies
        index = evaluator.arrays.index
        self.nodes = [[index[ins] for ins in row] for row in planner.schedule.stages]
        by_choice: list[Table] = [
            dict(zip(c.frequency.tolist(), zip(c.time.tolist(), c.energy.tolist()))) for c in evaluator.choices
        ]
        self.tables = [[by_choice[int(evaluator.choice_of[i])] for i in row] for row in self.nodes]
        self.clocks = [[int(frequencies[ins]) for ins in row] for row in planner.schedule.stages]
        # Per instruction, its time at every clock of the plan (`_at_least` resolved once per kind).
        clocks = {f for row in self.clocks for f in row}
        resolved = {id(t): {f: t[_at_least(t, f)][0] for f in clocks} for t in by_choice}
        self.time_at = [[resolved[id(table)] for table in row] for row in self.tables]
        if _flow is not None:
            self._columns = [self._replay_tables(s) for s in range(len(self.nodes))]
            self._cols = [
                np.array([c[f] for f in row], dtype=np.int32) for (c, _), row in zip(self._columns, self.clocks)
            ]

    def _replay_tables(self, s: int) -> tuple[dict[int, int], tuple[np.ndarray, ...]]:
        """Stage `s` as the C replay reads it: a column per clock (ascending, those of its tables
        and its plan), each row's (time, energy) there as `_at_least` picks them, and each
        column's latency and early lead."""
        tables = self.tables[s]
        # Instructions of one kind share a table: one row each, then one per instruction.
        distinct = {id(table): table for table in tables}
        clocks = sorted({f for table in distinct.values() for f in table} | set(self.clocks[s]))
        row_of = {key: k for k, key in enumerate(distinct)}
        cells = np.array([[table[_at_least(table, f)] for f in clocks] for table in distinct.values()], dtype=float)
        cells = cells.reshape(len(distinct), len(clocks), 2)
        rows = np.array([row_of[id(table)] for table in tables], dtype=np.int64)
        latency = self.latencies[s]
        lat = np.array([latency(f) for f in clocks], dtype=float)
        lead = np.array([early_lead_s(latency(f)) for f in clocks], dtype=float)
        time = np.ascontiguousarray(cells[rows, :, 0]).ravel()
        energy = np.ascontiguousarray(cells[rows, :, 1]).ravel()
        return {f: c for c, f in enumerate(clocks)}, (lat, lead, time, energy)

    def nominal(self) -> np.ndarray:
        """Node times at the planned clocks."""
        t = np.empty(self.arrays.num_nodes)
        for s, row in enumerate(self.nodes):
            t[row] = [time_at[f] for time_at, f in zip(self.time_at[s], self.clocks[s])]
        return t

    def stage(self, s: int, start: np.ndarray) -> tuple[list[float], list[float]]:
        """Stage `s` replayed at its clocks, each instruction from its start in `start` (per node)."""
        return self._run(s, start[self.nodes[s]])

    def _run(
        self, s: int, starts: np.ndarray, move: tuple[int, int, int] | None = None
    ) -> tuple[list[float], list[float]]:
        """`stage_run` of stage `s` at its clocks from `starts`; with `move` (instructions lo..hi-1
        at another clock), each instruction from its start or when the one before it ends at its
        planned clock, if later. In C where the extension is built (the same float operations; a
        merge replays its stage for every move it tries), else in Python."""
        clocks = self.clocks[s]
        if _flow is None:
            begins = starts.tolist()
            if move is not None:
                lo, hi, clock = move
                clocks = [*clocks[:lo], *[clock] * (hi - lo), *clocks[hi:]]
                free = -math.inf
                for p, (time_at, f) in enumerate(zip(self.time_at[s], clocks)):
                    begins[p] = max(begins[p], free)
                    free = begins[p] + time_at[f]
            return stage_run(self.tables[s], clocks, begins, self.latencies[s])
        cols = self._cols[s] if move is None else self._moved(s, move)
        times, energies = np.empty(len(cols)), np.empty(len(cols))
        _flow.replay(cols, starts, *self._columns[s][1], times, energies, move is not None)
        return times.tolist(), energies.tolist()

    def _moved(self, s: int, move: tuple[int, int, int]) -> np.ndarray:
        """Stage `s`'s clock columns with instructions lo..hi-1 at `move`'s clock."""
        cols = self._cols[s].copy()
        cols[move[0] : move[1]] = self._columns[s][0][move[2]]
        return cols

    def _trial(self, s: int, starts: np.ndarray, move: tuple[int, int, int]) -> tuple[float, float]:
        """`_run` with `move`, as its (sum of times, sum of energies) added in order: all a merge
        needs of a move it tries (the C replay sums them as it goes)."""
        if _flow is None:
            times, energies = self._run(s, starts, move)
            return _in_order(times), _in_order(energies)
        cols = self._moved(s, move)
        sums: tuple[float, float] = _flow.replay(
            cols, starts, *self._columns[s][1], np.empty(len(cols)), np.empty(len(cols)), True
        )
        return sums

    def _set_clocks(self, s: int, clocks: list[int]) -> None:
        self.clocks[s] = clocks
        if _flow is not None:
            column = self._columns[s][0]
            self._cols[s] = np.array([column[f] for f in clocks], dtype=np.int32)

    def energy(self, iteration_s: float, runs: Sequence[tuple[list[float], list[float]]]) -> float:
        """E = sum(e) + P_block * (N * T - sum(t)), the evaluator's model, over replayed instructions."""
        return self._energy(iteration_s, [(sum(t), sum(e)) for t, e in runs])

    def _energy(self, iteration_s: float, sums: Sequence[tuple[float, float]]) -> float:
        """`energy` from each stage's (sum of times, sum of energies)."""
        busy = sum(t for t, _ in sums)
        return sum(e for _, e in sums) + self.power * (self.num_stages * iteration_s - busy)

    def replayed(self) -> tuple[float, float]:
        """(T at the planned clocks, replayed energy): each stage replayed on the timeline its
        replayed times give (faster than planned, never slower), to a fixed point."""
        t = self.nominal()
        iteration_s = float(self.arrays.longest_path(t)[1].max())
        runs: list[tuple[list[float], list[float]]] = []
        for _ in range(3):
            start, _ = self.arrays.longest_path(t)
            runs = [self.stage(s, start) for s in range(len(self.nodes))]
            for s, (times, _) in enumerate(runs):
                t[self.nodes[s]] = times
        return iteration_s, self.energy(iteration_s, runs)

    def merge(self, limit_s: float, window_s: Sequence[float]) -> None:
        """Local search on each stage's segments: a short segment (under `window_s[stage]`) takes
        a neighbour's clock, or a segment's first or last instruction takes the clock of the
        neighbour on that side (a change asked for one instruction earlier or later), wherever
        the replayed energy falls and the iteration at the planned clocks stays within `limit_s`.
        A trial touches its stage only: a path through the instructions it slows may grow by all
        they slow together (a bound, so no move is taken that could pass `limit_s`), and the
        stage's own instructions start no earlier than before; an accepted move times the whole
        DAG again."""
        t = self.nominal()
        start, end = self.arrays.longest_path(t)
        through = start + self.arrays.longest_tail(t)  # the longest path through each node
        iteration_s = float(end.max())
        runs = [self.stage(s, start) for s in range(len(self.nodes))]
        sums = [(sum(times), sum(energies)) for times, energies in runs]
        energy = self._energy(iteration_s, sums)
        trials = 0
        for _ in range(MERGE_PASSES):
            merged = False
            for s, nodes in enumerate(self.nodes):
                k = 0
                # Again after each move taken: the segments, and the stage's nominal times, starts
                # and longest paths through its instructions as lists (read per instruction).
                spans = segments(self.clocks[s])
                now, first, through_s = t[nodes].tolist(), start[nodes], through[nodes].tolist()
                # The other stages' sums, fixed while this stage's moves are tried and taken.
                busy = sum(t for p, (t, _) in enumerate(sums) if p != s)
                spent = sum(e for p, (_, e) in enumerate(sums) if p != s)
                while trials < MERGE_TRIALS:
                    if k >= len(spans):
                        break
                    short = sum(now[spans[k].start : spans[k].stop]) < window_s[s]
                    best: tuple[float, tuple[int, int, int]] | None = None
                    for lo, hi, clock in self._moves(s, spans, k, short):
                        trials += 1
                        # Only instructions lo..hi-1 change clock (and so may take longer).
                        changed = [time_at[clock] for time_at in self.time_at[s][lo:hi]]
                        grown = [p for p, took in enumerate(changed, lo) if took > now[p]]
                        slower = sum(changed[p - lo] - now[p] for p in grown)
                        longest = max((through_s[p] for p in grown), default=0.0) + slower
                        if longest > limit_s:
                            continue
                        busy_s, spent_s = self._trial(s, first, (lo, hi, clock))
                        slowest = max(iteration_s, longest)
                        energy_new = spent + spent_s + self.power * (self.num_stages * slowest - busy - busy_s)
                        if energy_new < energy * (1 - 1e-9) and (best is None or energy_new < best[0]):
                            best = (energy_new, (lo, hi, clock))
                    if best is None:
                        k += 1
                        continue
                    lo, hi, clock = best[1]
                    self._set_clocks(s, [*self.clocks[s][:lo], *[clock] * (hi - lo), *self.clocks[s][hi:]])
                    spans = segments(self.clocks[s])
                    t = self.nominal()
                    start, end = self.arrays.longest_path(t)
                    through = start + self.arrays.longest_tail(t)
                    now, first, through_s = t[nodes].tolist(), start[nodes], through[nodes].tolist()
                    iteration_s = float(end.max())
                    times, energies = self.stage(s, start)
                    sums[s] = (sum(times), sum(energies))
                    energy = self._energy(iteration_s, sums)
                    merged = True
                    k = max(k - 1, 0)
            if not merged or trials >= MERGE_TRIALS:
                return

    def _moves(self, s: int, spans: list[range], k: int, short: bool) -> list[tuple[int, int, int]]:
        """The moves on stage `s`'s segment `k` (see `merge`): instructions lo..hi-1 take a clock."""
        run, moves = spans[k], []
        for side, edge in ((k - 1, run.start), (k + 1, run.stop - 1)):
            if not 0 <= side < len(spans):
                continue
            clock = self.clocks[s][spans[side].start]
            if short:
                moves.append((run.start, run.stop, clock))
            if len(run) > 1:
                moves.append((edge, edge + 1, clock))
        return moves


def _in_order(values: Sequence[float]) -> float:
    """The sum of `values` added left to right (as the C replay sums; `sum` compensates on newer Pythons)."""
    total = 0.0
    for value in values:
        total += value
    return total


def profile_latency(profile: Profile, stage: int) -> Latency:
    """Stage `stage`'s switch latency per target clock from a profile's meta: the measured one
    to that clock, else the longest measured (0 when the profile says nothing)."""
    table = profile.switch_latencies_s(stage)
    longest = profile.switch_latency_s(stage)
    return lambda target: table.get(target, longest)


def followable(planner: Planner, plan: Plan, latencies: Sequence[Latency]) -> Plan:
    """`plan` as stages whose clock changes take `latencies[s]` (target MHz -> s) can follow it:
    short segments raised (`raise_short_segments`, at each stage's longest latency), short
    segments merged into a neighbour's clock where that saves replayed energy (`_Replay.merge`,
    never past the plan's iteration time), and its energy replayed with the latencies. The same
    plan when every latency is zero. `planner`: the `Planner` that solved `plan`."""
    schedule = plan.schedule
    profile = planner.profile
    clocks = {p.frequency for pts in profile.points.values() for p in pts}
    longest = [max(latency(f) for f in clocks) for latency in latencies]
    if not any(longest):
        return plan
    frequencies = dict(plan.frequencies)
    # Instructions of one (stage, chunk, kind) share a profile row set: one table each.
    by_kind: dict[tuple, dict[int, float]] = {}
    for s, row in enumerate(schedule.stages):
        times = []
        for ins in row:
            key = (ins.stage, ins.chunk, ins.kind)
            if key not in by_kind:
                by_kind[key] = {p.frequency: p.time for p in profile.points_for(ins, schedule)}
            times.append(by_kind[key])
        raised = raise_short_segments([plan.frequencies[ins] for ins in row], times, longest[s])
        frequencies.update(zip(row, raised))
    replay = _Replay(planner, frequencies, latencies)
    replay.merge(plan.iteration_time_s, [MERGE_WITHIN_LATENCIES * latency for latency in longest])
    for row, clocks_s in zip(schedule.stages, replay.clocks):
        frequencies.update(zip(row, clocks_s))
    iteration_s, energy = replay.replayed()
    deadline_s = iteration_s
    if plan.padded:  # every GPU blocks until the deadline, as the planner counted it
        deadline_s = max(plan.deadline_s, iteration_s)
        energy += planner.evaluator.blocking_power_w * planner.evaluator.num_stages * (deadline_s - iteration_s)
    elif plan.deadline_s > iteration_s:
        deadline_s = plan.deadline_s
    bound = min(plan.lower_bound_j, energy)
    return dataclasses.replace(
        plan,
        frequencies=frequencies,
        iteration_time_s=iteration_s,
        energy_j=energy,
        lower_bound_j=bound,
        gap=(energy - bound) / bound if bound > 0 else float("inf"),
        deadline_s=deadline_s,
    )
