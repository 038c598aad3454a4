"""Steady-state pinning: relaxations whose repeated instructions take one profiled choice, or two
dithered.

In the middle of a long pipeline every microbatch repeats the one before, and so does the LP
optimum (`periodic`): where the period it settles on falls between two choices of some stage's
instructions, every one of them is fractional by the same amount. Rounding them one at a time
cannot move the period, so each rounds down to an off-hull choice or leaves the same sliver of
time unused in every period (Bloom A100 8 x 96 at 1.05x: 0.39% of energy above the hull at the
plan's durations). Pinning all of them to one choice, faster or slower, and re-solving moves the
period itself and lets the other stages and the warm-up and cool-down re-balance around it (one
minute of branch and cut on Bloom A100 8 x 24 at 1.05x found 11,153.5 J; this finds 11,149.3 J).

A level pins the steady instructions that are still fractional, all to their faster neighbouring
choice, then all to their slower one, then to the hull vertices either side (where the profile
is noisy, the neighbouring choices lie above the hull: GPT-3 A40 8 x 96 at no slowdown, 0.81%
from its bound pinning to neighbours alone, 0.63% with the vertices); the best of each level by
`score` is kept and the next level starts from it, `DEPTH` levels in all.

Pinned by a dithering `pattern`, a level instead spreads each group over the two hull vertices
around its duration, a fraction of its instructions at the slower one so that their mean is the
relaxation's, in step across stages (`_dither_keys`): every period of the pipeline then runs at
one of two lengths, each on the hull, where a uniform pin moves the period off its optimum.
Branch and cut's best plan in five minutes on Bloom A100 8 x 96 at 1.05x had this shape (0.141%
above the bound, where uniform pins reached 0.308%); dithering finds 0.075%. The slower
instructions are spread evenly per group (Bresenham), or nested: period k is slow for every group
whose fraction exceeds a shared low-discrepancy value, so groups with different fractions (noisy
profiles) stretch in the same periods (the GPT-3 A100 profile with seeded noise, 8 x 48 at 1.05x:
0.76% -> 0.67%). Dithered patterns go `DITHERED_DEPTH` levels deep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from perseus.exceptions import PlanError
from perseus.planner.flow import FlowLP
from perseus.planner.lp import HullLP, Relaxation
from perseus.planner.periodic import steady_state
from perseus.planner.problem import Problem

DEPTH = 2
# A dithered pin leaves few groups fractional: a second level changed none of the 96 benchmarked
# plans (six profiles, 8 x 12 to 8 x 96, 1.0-1.2x) and cost a re-plan 10-15 ms at 8 x 96.
DITHERED_DEPTH = 1
_TOL_S = 1e-9


def steady_groups(problem: Problem) -> list[np.ndarray]:
    """The nodes each steady-state representative stands for (none where the pipeline has too
    few microbatches for a steady state)."""
    compression = steady_state(problem)
    if compression is None:
        return []
    order = np.argsort(compression.rep, kind="stable")
    reps, first = np.unique(compression.rep[order], return_index=True)
    groups = np.split(order, first[1:])
    return [g for rep, g in zip(reps.tolist(), groups) if compression.weight[rep] > 1]


def pinned_relaxations(
    problem: Problem,
    lp: HullLP | FlowLP,
    deadline_s: float | None,
    padded: bool,
    start: tuple[Relaxation, Any],
    groups: list[np.ndarray],
    score: Callable[[Relaxation], float],
    *,
    pattern: str,
) -> list[Relaxation]:
    """The best relaxation of each level (see the module's docstring), pinned by `pattern` (one
    of `PATTERNS`), from `start` (an optimum at `deadline_s`, None for no deadline, and its basis).
    Each solve starts from its level's basis, so the result depends on the arguments alone.
    Leaves every duration of `lp` free."""
    relaxation, basis = start
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    keys = [] if pattern == "uniform" else _dither_keys(problem)
    sides = [(pattern, side) for side in range(_UNIFORM if pattern == "uniform" else len(keys))]
    pins: dict[int, np.ndarray] = {}
    kept: list[Relaxation] = []
    for _ in range(DEPTH if pattern == "uniform" else DITHERED_DEPTH):
        fractional = _fractional(problem, relaxation, groups, pins)
        if not fractional:
            break
        best: tuple[float, Relaxation, Any, dict[int, np.ndarray]] | None = None
        tried: set[bytes] = set()
        for side in sides:
            trial = pins | {g: _pinned(groups[g], side, keys, *bracket) for g, bracket in fractional}
            signature = b"".join(trial[g].tobytes() for g in sorted(trial))
            if signature in tried:
                continue
            tried.add(signature)
            for g, durations in trial.items():
                lp.fix_durations(groups[g], durations)
            try:
                solved = lp.solve(deadline_s, padded=padded, start=basis)
            except PlanError:
                continue  # pinned too slow: no plan meets the deadline
            finally:
                lp.release_durations()
            energy = score(solved)
            if best is None or energy < best[0]:
                best = (energy, solved, lp.basis(), trial)
        if best is None:
            break
        _, relaxation, basis, pins = best
        kept.append(relaxation)
    return kept


# How a level pins each fractional group: all to one duration, one side of its bracket per trial
# (the choice just faster, just slower, the hull vertex just faster, just slower: `_fractional`);
# or dithered between the two vertices, one key of `_dither_keys` per trial, evenly or nested.
# Each pattern's levels go their own way, so adding one never loses another's relaxations.
PATTERNS = ("uniform", "even", "nested")
_UNIFORM = 4
_GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0


def _dither_keys(problem: Problem) -> list[np.ndarray]:
    """Per node, the orderings a dithered pin spreads its slower instructions along: the
    microbatch, and the microbatch less or plus the virtual stage. Instructions with one key run
    in one period of the pipeline's rhythm under some schedule; in 1F1B the backward of microbatch
    m on stage s runs in step with that of m - 1 on stage s - 1 (where branch and cut put the slow
    ones on Bloom A100 8 x 96 at 1.05x, so every stage's period stretches at once)."""
    schedule = problem.dag.schedule
    micro = np.array([ins.microbatch for ins in problem.dag.nodes], dtype=np.int64)
    virtual = np.array([schedule.virtual_stage(ins) for ins in problem.dag.nodes], dtype=np.int64)
    return [micro, micro - virtual, micro + virtual]


def _pinned(
    nodes: np.ndarray, side: tuple[str, int], keys: list[np.ndarray], uniform: tuple[float, ...], alpha: float
) -> np.ndarray:
    """The durations a group is pinned to on `side` (a pattern and an index): `uniform`'s for
    all, or dithered between the two hull vertices (`uniform[2:]`) along that key so that a
    fraction `alpha` of the keys take the slower one: evenly spread (`floor(alpha k)` steps up at
    k), or nested (the golden-ratio sequence of k falls below alpha; within 2.5 instructions of
    alpha's share over any run of keys). Either way the group's mean duration is near the
    relaxation's."""
    pattern, index = side
    if pattern == "uniform":
        return np.full(len(nodes), uniform[index])
    k = keys[index][nodes].astype(float)
    if pattern == "nested":
        slower = np.mod(k * _GOLDEN, 1.0) < alpha
    else:
        slower = np.floor(alpha * (k + 1)) > np.floor(alpha * k)
    return np.where(slower, uniform[3], uniform[2])


def _fractional(
    problem: Problem, relaxation: Relaxation, groups: list[np.ndarray], pins: dict[int, np.ndarray]
) -> list[tuple[int, tuple[tuple[float, float, float, float], float]]]:
    """Each unpinned group whose representative duration lies strictly between two choices, with
    the durations it may be pinned to (the choices just faster and just slower, and the hull
    vertices just faster and just slower) and where between those vertices it lies (0 to 1)."""
    out = []
    for g, nodes in enumerate(groups):
        if g in pins:
            continue
        options = problem.node_options(int(nodes[0]))
        times = options.time
        d = float(np.median(relaxation.duration_s[nodes]))
        k = int(np.searchsorted(times, d + _TOL_S, side="right")) - 1
        if 0 <= k < len(times) - 1 and abs(times[k] - d) > _TOL_S:
            vertices = times[options.hull]
            v = int(np.searchsorted(vertices, d + _TOL_S, side="right")) - 1
            faster, slower = float(vertices[v]), float(vertices[v + 1])
            alpha = (d - faster) / (slower - faster)
            out.append((g, ((float(times[k]), float(times[k + 1]), faster, slower), alpha)))
    return out
