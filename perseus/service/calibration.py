"""Calibrate a pipeline's model on its own measured timeline: what the GPU-only profile leaves out.

The profile holds each instruction's GPU work at each clock. A training loop also spends host
time between a stage's instructions (launching, the schedule's bookkeeping, a loss) and time
moving activations and gradients between stages, and the planner must count both or it spends
slack that does not exist. The ranks send each instruction's span in baseline iterations (max
clocks, see perseus.runtime.spans); `fit` explains them with a model of the pipeline:

    begin(j) = max(end(previous on j's rank) + gap(rank, kind of j), max over j's inputs from
                   other ranks: end(input) + hop(input's rank -> j's rank))
    end(j)   = begin(j) + profile time(j) + excess(j's profile row)

Each rank's times are offsets from its own step start, and hosts' clocks need not agree, so no
time of one rank is ever compared with another's directly. A hop is read from the dependency
structure instead: per iteration, the least receive-after-send difference in one direction
between two ranks is the hop plus the ranks' clock offset, in the other direction the hop minus
it; their sum is the round trip, which the offset does not touch (one way: half of it). The gaps
start from instructions that wait on nothing remote (their whole gap is host work) and the rest
is fitted: least squares of every rank's own timeline, each rank free to shift as a whole.

The planner's model has no edge latencies: an instruction's time is its only weight. So the
calibrated model is projected onto the planner's: each profile row (stage, kind) gets one
overhead added to every clock's time (the GPU idles meanwhile: energy grows by blocking power),
fitted so that the planner's model follows the calibrated one at maximum clocks and with each
stage slowed in turn. `Calibration.fit_ok` says whether the planner's model reproduces the
measured baseline iteration within `Calibration.tolerance` (TOLERANCE, or on a noisy host the
measured median's own uncertainty); `explained` is how much of the measured
iteration the GPU profile alone accounts for (no emulated GPU work: almost none).

Pure and deterministic: numpy only, no I/O, no clocks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perseus.exceptions import ConfigError
from perseus.planner.dag import DagArrays, dag_arrays
from perseus.profiler.profile import Profile
from perseus.schedules import Schedule
from perseus.service.timelines import MIN_EXPLAINED, NOISE_SIGNIFICANCE, TOLERANCE, Calibration, StageFit, Timeline

__all__ = ["MIN_EXPLAINED", "TOLERANCE", "Calibration", "StageFit", "fit"]

_SWEEPS = 6  # coordinate-descent sweeps of each least-squares fit
_STEPS = (4.0, 2.0, 1.5, 1.0 / 1.5, 0.5, 0.25, 0.0)  # multiplicative moves tried per parameter
_GAIN = 1e-3  # a move must cut the squared error by this fraction (flat directions stay where they start)


class _Model:
    """The schedule's DAG with each node's rank, position, predecessors and profile row."""

    def __init__(self, schedule: Schedule, profile: Profile) -> None:
        self.schedule = schedule
        self.arrays: DagArrays = dag_arrays(schedule)
        arrays = self.arrays
        nodes = arrays.nodes
        self.n = n = len(nodes)
        self.rank = arrays.stage
        keys: dict[tuple[int, str], int] = {}
        self.row = np.array(
            [keys.setdefault((profile.stage_for(ins, schedule), ins.kind.value), len(keys)) for ins in nodes]
        )
        self.row_keys = list(keys)
        kinds: dict[tuple[int, str], int] = {}
        self.kind = np.array([kinds.setdefault((ins.stage, ins.kind.value), len(kinds)) for ins in nodes])
        self.kind_keys = list(kinds)
        self.max_time = np.array([profile.points_for(ins, schedule)[0].time for ins in nodes])
        self.previous = np.full(n, -1)
        for row in schedule.stages:
            for a, b in zip(row, row[1:]):
                self.previous[arrays.index[b]] = arrays.index[a]
        self.firsts = [arrays.index[row[0]] for row in schedule.stages]
        self.lasts = [arrays.index[row[-1]] for row in schedule.stages]
        # Padded predecessor table (pad: index n, whose end is 0) and which entries are remote.
        pad = arrays.pred_pad
        self.pad = pad
        src = np.where(pad < n, pad, 0)
        self.remote = (pad < n) & (self.rank[src] != self.rank[:, None])
        self.pair_keys = sorted(
            {tuple(sorted((int(self.rank[s]), int(self.rank[d])))) for s, d in zip(arrays.src, arrays.dst)}
            - {(r, r) for r in range(schedule.num_stages)}
        )
        pair_index = {p: k for k, p in enumerate(self.pair_keys)}
        self.pad_pair = np.full(pad.shape, -1)
        for i in range(n):
            for k, j in enumerate(pad[i]):
                if j < n and self.remote[i, k]:
                    self.pad_pair[i, k] = pair_index[tuple(sorted((int(self.rank[j]), int(self.rank[i]))))]
        self.has_remote = self.remote.any(axis=1)

    def simulate(self, span: np.ndarray, gap: np.ndarray, hop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(begin, end) of every node: each waits `gap` after its rank's previous instruction (or
        the step's start) and `hop[pair]` after an input from another rank. Batched: with 2-D
        arguments (k x nodes, k x pairs), k models at once."""
        single = np.ndim(span) == 1 and np.ndim(gap) == 1 and np.ndim(hop) == 1
        span, gap, hop = np.atleast_2d(span), np.atleast_2d(gap), np.atleast_2d(hop)
        k = max(len(span), len(gap), len(hop))
        n = self.n
        hops = hop[:, np.maximum(self.pad_pair, 0)] if hop.shape[1] else np.zeros((1,) + self.pad.shape)
        weight = np.where(self.remote[None], hops, gap[:, :, None])  # k x nodes x predecessors
        begin = np.zeros((k, n))
        end = np.zeros((k, n + 1))
        ptr = self.arrays.level_ptr
        for lo, hi in zip(ptr[:-1], ptr[1:]):
            b = (end[:, self.pad[lo:hi]] + weight[:, lo:hi]).max(axis=2)
            begin[:, lo:hi] = b
            end[:, lo:hi] = b + span[:, lo:hi]
        end = end[:, :n]
        return (begin[0], end[0]) if single else (begin, end)

    def makespan(self, node_time: np.ndarray) -> np.ndarray:
        """The planner's model: end of every node, each node's time its only weight."""
        return self.arrays.longest_path(node_time)[1]


@dataclass
class _Measured:
    """The baseline iterations at each node: begins and ends per iteration (iterations x nodes)
    and their medians."""

    begins: np.ndarray
    ends: np.ndarray

    def __post_init__(self) -> None:
        self.begin = np.median(self.begins, axis=0)
        self.end = np.median(self.ends, axis=0)


def _measured(m: _Model, timelines: Sequence[Timeline]) -> _Measured:
    index = m.arrays.index
    begins = np.empty((len(timelines), m.n))
    ends = np.empty((len(timelines), m.n))
    for t, tl in enumerate(timelines):
        for s, row in enumerate(m.schedule.stages):
            for k, ins in enumerate(row):
                begins[t, index[ins]] = tl.begins[s][k]
                ends[t, index[ins]] = tl.ends[s][k]
    return _Measured(begins, ends)


def _timeline_model(m: _Model, data: _Measured) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(span excess per profile row, gap per (rank, kind), hop per rank pair)."""
    b, e = data.begin, data.end
    excess = np.array([float(np.median((e - b - m.max_time)[m.row == r])) for r in range(len(m.row_keys))])

    # Gaps: host work before each instruction on its rank. Where an instruction waits on nothing
    # from another rank its whole gap is host work; where it may wait, that is the starting guess.
    previous = m.previous
    measured_gap = np.where(previous >= 0, b - e[np.maximum(previous, 0)], b)
    local = (previous >= 0) & ~m.has_remote
    pooled = float(np.median(measured_gap[local])) if local.any() else float(np.quantile(measured_gap, 0.1))
    gap = np.zeros(len(m.kind_keys))
    for k, (rank, _) in enumerate(m.kind_keys):
        mine = (m.kind == k) & local
        rank_local = (m.rank == rank) & local
        if mine.sum() >= 2:
            gap[k] = float(np.median(measured_gap[mine]))
        elif rank_local.sum() >= 2:
            gap[k] = float(np.median(measured_gap[rank_local]))
        else:
            gap[k] = pooled
    gap = np.maximum(gap, 0.0)

    # Hops: per iteration and pair of ranks, the least receive-after-send difference each way.
    hop = np.zeros(len(m.pair_keys))
    src, dst = m.arrays.src, m.arrays.dst
    for p, (u, v) in enumerate(m.pair_keys):
        up = (m.rank[src] == u) & (m.rank[dst] == v)
        down = (m.rank[src] == v) & (m.rank[dst] == u)
        if up.any() and down.any():
            there = (data.begins[:, dst[up]] - data.ends[:, src[up]]).min(axis=1)
            back = (data.begins[:, dst[down]] - data.ends[:, src[down]]).min(axis=1)
            hop[p] = max(0.0, float(np.median(there + back)) / 2)
    # A pair whose receivers never wait on each other shows its slack, not its hop: the hops of
    # one job's links are alike, so none starts above their median (the fit may raise it).
    if len(hop):
        hop = np.minimum(hop, float(np.median(hop)))

    # Least squares of every rank's own timeline (each rank shifted by its median residual) and,
    # weighted as much as all of them, of every rank's window (its first begin to its last end).
    firsts, lasts = np.array(m.firsts), np.array(m.lasts)

    span = np.maximum(m.max_time + excess[m.row], 0.0)
    measured_windows = e[lasts] - b[firsts]

    ranks = [m.rank == r for r in range(m.schedule.num_stages)]

    def losses(gaps: np.ndarray, hops: np.ndarray) -> np.ndarray:
        """Squared error of each candidate (k x kinds gaps, k x pairs hops)."""
        sb, se = m.simulate(span, gaps[:, m.kind], hops)
        total = np.zeros(len(sb))
        for res in (sb - b, se - e):
            for mine in ranks:
                part = res[:, mine]
                total += ((part - np.median(part, axis=1, keepdims=True)) ** 2).sum(axis=1)
        windows = (se[:, lasts] - sb[:, firsts]) - measured_windows
        return total + m.n * (windows**2).sum(axis=1)

    best = float(losses(gap[None], hop[None])[0])
    steps = np.array(_STEPS)
    for _ in range(_SWEEPS):
        improved = False
        for vec in (gap, hop):
            for k in range(len(vec)):
                values = vec[k] * steps if vec[k] > 0 else np.array([1e-4, 0.0])
                gaps = np.repeat(gap[None], len(values), axis=0)
                hops = np.repeat(hop[None], len(values), axis=0)
                (gaps if vec is gap else hops)[:, k] = values
                scores = losses(gaps, hops)
                j = int(np.argmin(scores))
                if scores[j] < best * (1 - _GAIN):
                    best, vec[k], improved = float(scores[j]), values[j], True
        if not improved:
            break
    return excess, gap, hop


def _project(m: _Model, span: np.ndarray, gap_node: np.ndarray, hop: np.ndarray) -> np.ndarray:
    """One overhead per profile row, so that the planner's model (node times only) follows the
    calibrated one at maximum clocks and, weighted as much in all, with each stage slowed in turn;
    then scaled together to match its iteration at maximum clocks exactly."""
    n = m.n
    scenarios = np.array([span] + [span * np.where(m.rank == r, 1.5, 1.0) for r in range(m.schedule.num_stages)])
    targets = np.array([m.simulate(s, gap_node, hop)[1] for s in scenarios])
    weights = np.ones(len(scenarios))
    weights[0] = len(scenarios) - 1  # maximum clocks, as much as every slowed stage together
    hop_in = np.zeros(n)
    for i in range(n):
        for k, j in enumerate(m.pad[i]):
            if j < n and m.remote[i, k]:
                hop_in[i] = max(hop_in[i], hop[m.pad_pair[i, k]])
    rows = len(m.row_keys)
    low = np.array([float(np.median(gap_node[m.row == r])) for r in range(rows)])
    high = np.maximum(low, [float(np.median(np.maximum(gap_node, hop_in)[m.row == r])) for r in range(rows)])
    overhead = (low + high) / 2

    def losses(candidates: np.ndarray) -> np.ndarray:
        """Squared error of each candidate overhead vector (k x rows), every scenario at once."""
        node = candidates[:, m.row]  # k x n
        times = scenarios[None, :, :] + node[:, None, :]  # k x scenarios x n
        ends = m.makespan(times.reshape(-1, n)).reshape(times.shape)
        return (((ends - targets[None]) ** 2).sum(axis=2) * weights).sum(axis=1)

    best = float(losses(overhead[None])[0])
    for _ in range(_SWEEPS):
        improved = False
        for r in range(rows):
            values = np.linspace(low[r], high[r], 9)
            candidates = np.repeat(overhead[None], len(values), axis=0)
            candidates[:, r] = values
            scores = losses(candidates)
            k = int(np.argmin(scores))
            if scores[k] < best * (1 - _GAIN):
                best, overhead[r], improved = float(scores[k]), values[k], True
        if not improved:
            break
    # Then exactly at maximum clocks, the operating point the no-slowdown plan is held to: all
    # overheads scaled together until the planner's iteration is the calibrated model's.
    goal = float(targets[0].max())
    low_scale, high_scale = 0.0, 2.0
    if m.makespan(span + high_scale * overhead[m.row]).max() < goal:
        return high_scale * overhead
    for _ in range(40):
        mid = (low_scale + high_scale) / 2
        if m.makespan(span + mid * overhead[m.row]).max() < goal:
            low_scale = mid
        else:
            high_scale = mid
    return high_scale * overhead


def _reserve(m: _Model, data: _Measured) -> np.ndarray:
    """Per profile row, the median over its instructions of what host noise adds on average to
    an instruction's span and (where it waits on nothing from another rank) the gap before it:
    their mean over the iterations less their median, which the planner's times are."""
    previous = m.previous
    local = (previous >= 0) & ~m.has_remote
    gap = np.where(local[None], data.begins - data.ends[:, np.maximum(previous, 0)], 0.0)
    taken = data.ends - data.begins + gap
    tail = np.maximum(taken.mean(axis=0) - np.median(taken, axis=0), 0.0)
    return np.array([float(np.median(tail[m.row == r])) for r in range(len(m.row_keys))])


def fit(schedule: Schedule, profile: Profile, timelines: Sequence[Timeline]) -> Calibration:
    """Calibrate the pipeline's model on `timelines` (baseline iterations at maximum clocks)."""
    if not timelines:
        raise ConfigError("calibration needs baseline iterations")
    m = _Model(schedule, profile)
    data = _measured(m, timelines)
    b, e = data.begin, data.end
    times = [tl.time_s for tl in timelines]
    measured = statistics.median(times)
    # Relative spread (1.4826 MADs) of the iterations, and so the standard error of their median.
    spread = 1.4826 * statistics.median(abs(t - measured) for t in times) / measured if measured > 0 else 0.0
    noise = NOISE_SIGNIFICANCE * 1.2533 * spread / math.sqrt(len(times))
    outside = statistics.median(tl.steps[0] - (tl.ends[0][-1] - tl.begins[0][0]) for tl in timelines)
    excess, gap, hop = _timeline_model(m, data)
    gap_node = gap[m.kind]
    span = np.maximum(m.max_time + excess[m.row], 0.0)
    # The profile's times already count the span; what a span takes beyond them is overhead too.
    overhead = np.maximum(_project(m, span, gap_node, hop) + excess, 0.0)

    planner_end = m.makespan(m.max_time + overhead[m.row])
    planner_begin = planner_end - span  # a row's overhead comes before its span
    gpu_window = float(m.makespan(m.max_time).max())
    # Each iteration's spans against the profile's times at the top clock, per stage: the median
    # over its instructions (and over iterations), and its spread over iterations.
    ratios = (data.ends - data.begins) / m.max_time
    stages = []
    for s in range(schedule.num_stages):
        first, last = m.firsts[s], m.lasts[s]
        per_iteration = np.median(ratios[:, m.rank == s], axis=1)
        ratio = float(np.median(per_iteration))
        spread = 1.4826 * float(np.median(np.abs(per_iteration - ratio))) / ratio if ratio > 0 else 0.0
        stages.append(
            StageFit(
                stage=s,
                measured_s=float(e[last] - b[first]),
                model_s=float(planner_end[last] - planner_begin[first]),
                busy_s=float((e - b)[m.rank == s].sum()),
                host_gap_s=float(np.median(gap[[k for k, (r, _) in enumerate(m.kind_keys) if r == s]])),
                span_ratio=ratio,
                span_spread=spread,
            )
        )
    model_window = float(planner_end.max() - planner_begin[m.firsts[0]])
    return Calibration(
        iterations=len(timelines),
        measured_s=measured,
        model_s=model_window + outside,
        gpu_only_s=gpu_window + outside,
        outside_s=outside,
        explained=min(1.0, gpu_window / measured),
        hop_s=float(np.median(hop)) if len(hop) else 0.0,
        host_gap_s=float(np.median(gap)),
        overheads={key: float(overhead[r]) for r, key in enumerate(m.row_keys)},
        stages=tuple(stages),
        noise=noise,
        reserve={key: float(v) for key, v in zip(m.row_keys, _reserve(m, data))},
    )
