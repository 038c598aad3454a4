"""The planner: minimum-energy frequency plans at a deadline, and the time-energy frontier.

Per deadline: solve the LP relaxation over each instruction's convex hull (the certified lower
bound), round every instruction down to the slowest profiled choice that ends by its relaxed
finish time (so the deadline still holds), then slow instructions into whatever slack the
rounding left. Single plans also try iterative rounding (`refine`), and small DAGs are solved
exactly as a MILP; the least-energy candidate wins and is polished by pair exchanges
(`exchange`). Every plan is re-evaluated by
the evaluator, and only plans that meet the deadline there are returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from perseus.exceptions import ConfigError, PlanError
from perseus.planner.evaluator import Evaluator
from perseus.planner.exact import MAX_BINARIES, num_binaries, solve_exact
from perseus.planner.flow import FlowLP, relaxation_lp, uses_flow
from perseus.planner.lp import SEED_MIN_NODES, HullLP, Relaxation
from perseus.planner.plan import Plan
from perseus.planner.problem import Problem
from perseus.planner.refine import refine
from perseus.planner.rounding import Walker, exchange, fill_slack, round_down, round_over
from perseus.planner.steady import pinned_relaxations, steady_groups
from perseus.profiler.profile import Profile
from perseus.schedules.instruction import Schedule

# Tolerance (s) for the LP's own rounding when comparing choice times to relaxed finish times.
_LP_SLACK_S = 1e-9
# Fractions of the relaxed minimum-energy time also tried when the deadline does not bind.
_MIN_ENERGY_TARGETS = (0.99, 0.97)
# A plan further than this from its bound where the deadline binds is tried again with the
# roundings of looser deadlines' optima (these factors of it) as well. GPT-3 A40 8 x 96 padded at
# 1.02x: 2.81% -> 1.75%; Bloom A40 at 1.03x: 1.97% -> 0.74%. Plans closer than this (every GPT-3
# and Bloom A100 plan benchmarked) skip the three solves.
LOOSER_RETRY_GAP = 0.005
_LOOSER_TARGETS = (1.005, 1.01, 1.02)
# A plan further than this from its bound, in a pipeline with a steady state, is tried again with
# the roundings of relaxations whose steady instructions are pinned (`steady`): to one choice each,
# and dithered between two. Bloom A100 8 x 96 padded at 1.05x: 0.31% -> 0.075%; GPT-3 A40 8 x 96 at
# no slowdown: 0.98% -> 0.63%; Bloom A40 8 x 96 at no slowdown: 0.28% -> 0.15%. Plans past no
# slowdown from 0.1%: GPT-3 A100 8 x 24 to 8 x 96 at 1.2x, 0.11-0.16% -> 0.06-0.09%. Plans at no
# slowdown (or faster) from 0.2%: there the bottleneck stage at its highest clock sets the period,
# GPT-3 A100 8 x 96 lands 0.145% above its bound, and the 14 solves (45 ms of a 0.2 s plan, padded
# or not) found nothing better.
STEADY_RETRY_GAP = 0.002
STEADY_RETRY_GAP_SLOWER = 0.001
# A plan further than this from its bound is tried again with every relaxation it was rounded
# from rounded onto hull vertices alone (`Problem.on_hull`), then polished over every choice.
HULL_RETRY_GAP = 0.001
# A plan further than this from its bound (past no slowdown: the second) is tried again with every
# relaxation it was rounded from rounded past its finish times by these fractions of a step
# (`round_over`), then polished: 10-35 ms at 8 x 96. Jittered GPT-3 A100 points at 8 x 96: 0.73% ->
# 0.61% at no slowdown, 0.57% -> 0.54% at 1.1x; GPT-3 A40 8 x 48 at no slowdown 0.61% -> 0.51% (from
# its pinned relaxations); Bloom A100 8 x 12 at 1.05x: 0.165% -> 0.151%. The GPT-3 A100 plans at no
# slowdown (0.12-0.15%) gain nothing, so stay within 0.2 s.
OVER_RETRY_GAP = 0.002
OVER_RETRY_GAP_SLOWER = 0.001
_OVERSHOOTS = (0.125, 0.25, 0.375, 0.5)
# A frontier point further than this from its bound gets a single plan's retries (looser deadlines'
# optima, steady-state pins, hull vertices, rounding past finish times). 8 x 96 frontiers on the A40
# profiles had points 2.0% (GPT-3) and 3.8% (Bloom) above single plans at their deadlines (0.32% and
# 0.53% on average): after, 0.23% and 0.90% (0.03% and 0.17%), worst gaps 3.17% -> 1.62% and 3.91% ->
# 1.00%, for 1.7-2.6 s more (2.2-2.9 s in all). From 0.5% the A40 frontiers came within 0.08-0.17% of
# single plans but took 4-5 s, and the noisy GPT-3 A100 one 10 s; from 1% the GPT-3 A100 and noisy
# frontiers (no point above it) keep their plans and their time.
FRONTIER_RETRY_GAP = 0.01
# Candidates polished by pair exchanges, best first (frontier sweeps, and single plans above
# REFINE_MAX_NODES: the best only). Above that size there is no iterative rounding's candidate,
# and polishing the next two never changed the plan (32 x 512, GPT-3 and Bloom A100, no slowdown
# and 1.1x padded: the same energy, 6-15 s of CPU less each).
_EXCHANGED = 3
# The restricted relaxation costs one more cold LP solve (superlinear in the instructions): used
# up to this many, where the solve is short.
RESTRICT_MAX_NODES = 4096
# Iterative rounding (`refine`) costs a few warm LP re-solves: used for single plans up to this
# many instructions, not for frontier sweeps (50 points stay within seconds).
REFINE_MAX_NODES = 16384
# Deadlines whose cold LP results a Planner keeps (`Planner._relaxations`).
_REMEMBERED = 8
# Network simplex solves at deadlines above the all-max time start from an optimum nearer than the
# crash tree (every instruction at its slowest): up to this factor of it from the no-slowdown
# optimum, past it from the least-energy one (no deadline). At 8 x 96 on the A100 and A40 profiles:
# 18-49 ms against 108-159 ms cold at 1.02x, 38-108 ms against 92-119 ms at 1.05x, but 76-147 ms
# against 60-109 ms at 1.08x, where the least-energy optimum starts it in 52-103 ms.
NEAR_NO_SLOWDOWN = 1.06

# A deadline's plain relaxation, its basis, each relaxation to round with the deadline it is rounded
# for, and those of the minimum-energy targets (empty where the deadline binds; None: not solved).
_Rounded = tuple[tuple[Relaxation, float | None], ...]
_Relaxed = tuple[Relaxation, Any, _Rounded, _Rounded | None]
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the time-energy frontier: the plan for one deadline and its bound."""

    time_s: float
    energy_j: float
    lower_bound_j: float
    plan: Plan

    @property
    def gap(self) -> float:
        """Relative distance of this point's energy to its bound, as `Plan.gap`."""
        return _gap(self.energy_j, self.lower_bound_j)


class Planner:
    """Plans for one (schedule, profile). Pure: no I/O, no clocks; same inputs, same plans.

    One LP instance is shared by all calls, so calls on one Planner are serialised by a lock.
    """

    def __init__(self, schedule: Schedule, profile: Profile) -> None:
        self.schedule = schedule
        self.profile = profile
        self.problem = Problem.build(schedule, profile)
        self.evaluator = Evaluator(self.problem.dag, profile)
        self._walker = Walker(self.problem)
        self._lp = relaxation_lp(self.problem)
        self._exact = num_binaries(self.problem) <= MAX_BINARIES
        # Index 0 of every profiled choice table is the highest clock.
        max_times, max_energies = self.evaluator.times_energies(np.zeros(self.problem.num_nodes, dtype=np.int64))
        reference_t, reference_e = self.evaluator.evaluate_arrays(max_times, max_energies)
        self.max_frequency_time_s = float(reference_t)
        self.max_frequency_energy_j = float(reference_e)
        self.fastest_time_s = self.problem.iteration_time(self.problem.times(self.problem.fastest()))
        # Per node, the Pareto choice that is no slower and no costlier than its highest clock:
        # a plan never worse than all-max, kept as a fallback candidate.
        self._max_frequency_dominated = np.zeros(self.problem.num_nodes, dtype=np.int64)
        for k, opts in enumerate(self.problem.options):
            nodes = np.flatnonzero(self.problem.node_type == k)
            within = np.searchsorted(opts.time, max_times[nodes], side="right") - 1
            self._max_frequency_dominated[nodes] = np.maximum(within, 0)
        self._min_energy: Plan | None = None
        # The optimum at the all-max time and with no deadline (None): where cold solves start.
        self._anchors: dict[float | None, Any] = {}
        self._relaxed: dict[tuple[float | None, bool], _Relaxed] = {}
        self._own: dict[tuple[float, bool, bool], Relaxation | None] = {}
        self._steady: list[np.ndarray] | None = None  # `steady_groups`, once a plan needs them
        self._twin: HullLP | FlowLP | None = None  # a second LP for the dithered pins, once needed
        self._on_hull: tuple[Problem, Walker] | None = None  # rounding onto hull vertices, once a plan needs it
        self._lock = threading.Lock()

    def plan(self, deadline: float | None = None, max_slowdown: float | None = None, padded: bool = False) -> Plan:
        """Minimum-energy plan with iteration time <= deadline (s). Default: no slowdown against
        every GPU at its maximum frequency; `max_slowdown` F: deadline F x that time. Beyond the
        minimum-energy time T* the plan stays at T*.

        `padded`: the iteration lasts the deadline whatever the plan (a straggler pipeline sets
        the pace, and every GPU blocks until it), so minimise the energy padded to the deadline:
        past T* the plan uses the slack. The plan's energy and bound are then for an iteration of
        the deadline (`Plan.padded`)."""
        deadline_s = self._deadline(deadline, max_slowdown)
        if not isinstance(padded, (bool, np.bool_)):
            raise ConfigError(f"padded must be True or False, got {padded!r} ({type(padded).__name__})")
        if max_slowdown is not None and deadline_s < self.fastest_time_s:
            raise PlanError(
                f"a slowdown of {max_slowdown:g}x asks for {deadline_s:.6g} s per iteration, but even the fastest "
                f"frequencies take {self.fastest_time_s:.6g} s: the factor must be at least "
                f"{self.fastest_time_s / self.max_frequency_time_s:.6g} (1.0 = no slowdown against maximum clocks)"
            )
        with self._lock:
            return self._solve(deadline_s, warm=False, refined=True, padded=padded)

    def min_energy_plan(self) -> Plan:
        """The plan of least energy at any iteration time (its time is T*)."""
        with self._lock:
            if self._min_energy is None:
                self._min_energy = self._solve(None, warm=False, refined=True)
            return self._min_energy

    def energy_at_pace(self, energy_j: float, time_s: float, pace_s: float) -> float:
        """The energy of an iteration that lasts `pace_s` when the work takes `energy_j` over
        `time_s`: every GPU that is done blocks until then (as beside a straggler)."""
        return energy_j + self.evaluator.blocking_power_w * self.evaluator.num_stages * max(pace_s - time_s, 0.0)

    def saving(self, plan: Plan) -> float:
        """The fraction of energy `plan` saves against every GPU at its maximum clock, as `perseus
        plan` prints it: both over one iteration of the plan's deadline or the all-max time,
        whichever is longer (a plan that ends early blocks until then; a padded plan's energy
        already counts that)."""
        pace = max(plan.deadline_s, self.max_frequency_time_s)
        span = plan.deadline_s if plan.padded else plan.iteration_time_s
        ours = self.energy_at_pace(plan.energy_j, span, pace)
        return 1.0 - ours / self.energy_at_pace(self.max_frequency_energy_j, self.max_frequency_time_s, pace)

    def frontier(self, num_points: int = 50, progress: Callable[[int, int], None] | None = None) -> list[FrontierPoint]:
        """Plans for `num_points` deadlines evenly spaced from the fastest iteration time to T*,
        fastest first. Energy never increases along the list. `progress(done, total)` is called
        after each point (a large job's frontier takes minutes)."""
        if num_points < 2:
            raise ConfigError(f"a frontier needs at least 2 points, got {num_points}")
        slowest = self.min_energy_plan()
        deadlines = np.linspace(self.fastest_time_s, slowest.iteration_time_s, num_points)
        with self._lock:
            return self._sweep(deadlines, slowest, progress)

    def _sweep(
        self, deadlines: np.ndarray, slowest: Plan, progress: Callable[[int, int], None] | None = None
    ) -> list[FrontierPoint]:
        num_points = len(deadlines)
        self._lp.solve(float(deadlines[0]), warm=False)
        points: list[FrontierPoint] = []
        best: Plan | None = None
        for k, deadline in enumerate(deadlines.tolist()):
            plan = slowest if k == num_points - 1 else self._solve(deadline, warm=True, refined=False, point=True)
            if best is not None and best.energy_j < plan.energy_j:
                # A faster plan is cheaper: it meets this deadline too.
                plan = _with_deadline(best, plan.lower_bound_j, deadline)
            best = plan
            points.append(FrontierPoint(plan.iteration_time_s, plan.energy_j, plan.lower_bound_j, plan))
            if progress is not None:
                progress(k + 1, num_points)
        return points

    def _deadline(self, deadline: float | None, max_slowdown: float | None) -> float:
        if deadline is not None and max_slowdown is not None:
            raise ConfigError("give either a deadline or a max_slowdown, not both")
        for name, value, example in (("deadline", deadline, "16.5 (seconds)"), ("max_slowdown", max_slowdown, "1.1")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))):
                raise ConfigError(f"{name} must be a number, e.g. {example}; got {value!r} ({type(value).__name__})")
        if max_slowdown is not None:
            if not (np.isfinite(max_slowdown) and max_slowdown > 0):
                raise ConfigError(f"max_slowdown must be a positive factor (1.0 = no slowdown), got {max_slowdown}")
            return max_slowdown * self.max_frequency_time_s
        if deadline is None:
            return self.max_frequency_time_s
        if not (np.isfinite(deadline) and deadline > 0):
            raise ConfigError(f"deadline must be a positive number of seconds, got {deadline}")
        return float(deadline)

    def _solve(
        self, deadline_s: float | None, warm: bool, refined: bool, padded: bool = False, point: bool = False
    ) -> Plan:
        if deadline_s is not None and deadline_s < self.fastest_time_s:
            raise PlanError(
                f"no plan finishes within {deadline_s:.6g} s: even the fastest frequencies take "
                f"{self.fastest_time_s:.6g} s per iteration; relax the deadline"
            )
        start = self._start(deadline_s) if not warm else None
        own_key, restricted, narrowed = None, None, self.problem
        if deadline_s is not None and (refined or padded):
            # The objective's own relaxation certifies the plan: padded if asked, and without the
            # choices no plan within the deadline can take (a tighter hull where room is short).
            # Its rounding is one more candidate.
            restrict = refined and self.problem.num_nodes <= RESTRICT_MAX_NODES
            own_key = (deadline_s, padded, restrict)
            plain_key = (deadline_s, False, restrict)
            if restrict and padded and own_key not in self._own and _binds(self._own.get(plain_key), deadline_s):
                # The plain restricted optimum, kept, is the padded one (`_restricted`).
                _remember(self._own, own_key, self._own[plain_key])
            if restrict and own_key not in self._own:
                narrowed = self.problem.restricted(deadline_s)
                if narrowed is not self.problem and uses_flow(self.problem):
                    # A separate LP that needs nothing from the plain one: network simplex solves
                    # it on another core meanwhile (it releases the GIL and shares nothing), a
                    # cold solve as long as the plain one. HiGHS' small LPs take milliseconds inline.
                    pool = ThreadPoolExecutor(max_workers=1)
                    restricted = pool.submit(_restricted, narrowed, deadline_s, padded)
                    pool.shutdown(wait=False)
        relaxation, basis, rounded, tighter = self._relaxations(deadline_s, warm, refined, start, not padded)
        roundings = list(rounded + (tighter if not padded and tighter else ()))
        candidates = []
        for relaxed, target_s in roundings:
            candidates += self._round(relaxed, target_s)
        bound = relaxation
        if own_key is not None:
            binds = _binds(relaxation, own_key[0])
            own = self._own_relaxation(own_key, restricted, narrowed, basis if binds else start)
            if own is not None:
                bound = own
                roundings.append((own, deadline_s))
                candidates += self._round(own, deadline_s)
                if not padded and bound.lower_bound_j < relaxation.lower_bound_j:
                    bound = relaxation  # both certify; keep the higher
        if self._exact:
            for objective in {False, padded}:
                exact = solve_exact(self.problem, deadline_s, objective)
                if exact is not None:
                    candidates.append(exact)
        if deadline_s is None or deadline_s >= self.max_frequency_time_s:
            candidates.append(self._max_frequency_dominated)
        refining = refined and self.problem.num_nodes <= REFINE_MAX_NODES
        exchanged = _EXCHANGED if refining else 1
        plan = self._best(candidates, deadline_s, bound, padded, exchanged)
        # A frontier point (`point`) far from its bound gets a single plan's retries.
        retrying = refined or (point and plan.gap > FRONTIER_RETRY_GAP)
        if (
            retrying
            and deadline_s is not None
            and plan.gap > LOOSER_RETRY_GAP
            and self.problem.num_nodes <= RESTRICT_MAX_NODES
            and _binds(relaxation, deadline_s)
        ):
            # Where the deadline binds, the roundings of its own optimum can all land well above
            # the bound (noisy profiles just past no slowdown); optima of slightly looser deadlines,
            # repaired to fit, sometimes land much lower. From this deadline's optimum (`basis`), so
            # the same whatever the planner solved before.
            looser = []
            for factor in _LOOSER_TARGETS:
                looser += self._round(self._lp.solve(factor * deadline_s, start=basis), deadline_s)
            # Repaired roundings rank low before their pair exchanges: polish each of them.
            retried = self._best(candidates + looser, deadline_s, bound, padded, exchanged + len(looser))
            if retried.energy_j < plan.energy_j:
                plan = retried
        if (
            retrying
            and plan.gap > (STEADY_RETRY_GAP if self._no_slower(deadline_s) else STEADY_RETRY_GAP_SLOWER)
            and self.problem.num_nodes <= RESTRICT_MAX_NODES
            and self._steady_groups()
        ):
            pinned, kept = self._pinned(deadline_s, padded, relaxation, basis)
            roundings += [(r, deadline_s) for r in kept]
            retried = self._best(candidates + pinned, deadline_s, bound, padded, exchanged + len(pinned))
            if retried.energy_j < plan.energy_j:
                plan = retried
        if retrying and plan.gap > HULL_RETRY_GAP and self.problem.num_nodes <= RESTRICT_MAX_NODES:
            on_hull = [c for relaxed, target_s in roundings for c in self._round(relaxed, target_s, hull=True)]
            retried = self._best(candidates + on_hull, deadline_s, bound, padded, exchanged + len(on_hull))
            if retried.energy_j < plan.energy_j:
                plan = retried
        if (
            retrying
            and deadline_s is not None
            and plan.gap > (OVER_RETRY_GAP if self._no_slower(deadline_s) else OVER_RETRY_GAP_SLOWER)
            and self.problem.num_nodes <= RESTRICT_MAX_NODES
        ):
            over = []
            for relaxed, _ in roundings:
                for overshoot in _OVERSHOOTS:
                    past = round_over(
                        self.problem, relaxed.finish_s, relaxed.duration_s, overshoot, deadline_s, self._walker
                    )
                    if past is not None:
                        over.append(fill_slack(self.problem, past, deadline_s, self._walker))
            retried = self._best(candidates + over, deadline_s, bound, padded, exchanged + len(over))
            if retried.energy_j < plan.energy_j:
                plan = retried
        if warm and retrying:
            self._lp.solve(deadline_s, start=basis)  # a sweep goes on warm from this deadline's optimum
        return plan

    def _pinned(
        self, deadline_s: float | None, padded: bool, relaxation: Relaxation, basis: Any
    ) -> tuple[list[np.ndarray], list[Relaxation]]:
        """The roundings of steady-state pinned relaxations (`steady`) from this deadline's optimum:
        pinned uniformly on the planner's LP and dithered on a second one meanwhile (network
        simplex releases the GIL; a level's solves take 5-10 ms each at 8 x 96)."""
        groups = self._steady_groups()
        roundings: dict[int, list[np.ndarray]] = {}  # per relaxation scored: kept ones are not rounded again

        def score(r: Relaxation) -> float:
            roundings[id(r)] = self._round(r, deadline_s)
            return self._least_energy(roundings[id(r)], deadline_s, padded)

        twin = self._twin = self._twin or relaxation_lp(self.problem)

        def pinned(lp: HullLP | FlowLP, patterns: tuple[str, ...]) -> list[Relaxation]:
            start = (relaxation, basis)
            return [
                r
                for pattern in patterns
                for r in pinned_relaxations(self.problem, lp, deadline_s, padded, start, groups, score, pattern=pattern)
            ]

        with ThreadPoolExecutor(max_workers=1) as pool:
            dithered = pool.submit(pinned, twin, ("even", "nested"))
            kept = pinned(self._lp, ("uniform",)) + dithered.result()
        return [choice for r in kept for choice in roundings[id(r)]], kept

    def _no_slower(self, deadline_s: float | None) -> bool:
        """Whether a deadline asks for no slowdown against every GPU at its maximum clock (or less)."""
        return deadline_s is not None and deadline_s <= self.max_frequency_time_s * (1 + 1e-9)

    def _steady_groups(self) -> list[np.ndarray]:
        if self._steady is None:
            self._steady = steady_groups(self.problem)
        return self._steady

    def _least_energy(self, candidates: list[np.ndarray], deadline_s: float | None, padded: bool) -> float:
        """The least energy of the candidates that meet the deadline (inf if none does)."""
        energies = [
            e
            for t, e in (self._objective(c, deadline_s, padded) for c in candidates)
            if deadline_s is None or t <= deadline_s
        ]
        return min(energies, default=float("inf"))

    def _start(self, deadline_s: float | None) -> Any:
        """Where a cold network-simplex solve at `deadline_s` starts: past the all-max time, the
        no-slowdown optimum up to `NEAR_NO_SLOWDOWN` x it, further the least-energy optimum; else
        None (the crash tree). Each is a function of the problem and the deadline, so plans do not
        depend on earlier calls."""
        if deadline_s is None or not uses_flow(self.problem) or deadline_s <= self.max_frequency_time_s:
            return None
        anchor = self.max_frequency_time_s if deadline_s <= NEAR_NO_SLOWDOWN * self.max_frequency_time_s else None
        if anchor not in self._anchors:
            self._lp.solve(anchor)
            self._anchors[anchor] = self._lp.basis()
        return self._anchors[anchor]

    def _relaxations(
        self, deadline_s: float | None, warm: bool, refined: bool, start: Any = None, targets: bool = True
    ) -> _Relaxed:
        """The relaxation over every profiled choice at the plain (unpadded) objective, and each
        relaxation to round with the deadline it is rounded for: its own, iterative rounding's and,
        if `targets`, the minimum-energy targets', the candidates the planner always had (so no
        plan is ever worse than before). A padded plan skips the targets: it blocks until the
        deadline anyway, so their tighter roundings only give up slack (over 168 padded plans,
        GPT-3 and Bloom on A100 and A40 and two noisy profiles, 8 x 12 to 8 x 96, 1.0-1.5 x, not one
        changed without them; 40 ms of an 8 x 96 re-plan past the least-energy time). From a
        cold start they depend on the deadline alone, so the last few deadlines' are kept: a
        re-plan at one of them (the service going back to no straggler, or padding a deadline it
        planned unpadded) skips these LP solves and gets the same plan."""
        key = (deadline_s, refined)
        kept = None if warm else self._relaxed.get(key)
        if kept is not None and (kept[3] is not None or not targets):
            return kept
        relaxation = self._lp.solve(deadline_s, warm=warm, start=start)
        basis = self._lp.basis()
        if deadline_s in (self.max_frequency_time_s, None) and not warm and uses_flow(self.problem):
            self._anchors[deadline_s] = basis
        rounded = [(relaxation, deadline_s)]
        if refined and self.problem.num_nodes <= REFINE_MAX_NODES:
            rounded.append((refine(self.problem, self._lp, relaxation, deadline_s), deadline_s))
        tighter: _Rounded | None = ()
        if deadline_s is None or not _binds(relaxation, deadline_s):
            # The deadline does not bind: the minimum-energy plan. Rounding loses time that every
            # stage then spends blocked, so slightly tighter targets can round to less energy.
            # Warm from iterative rounding's last basis up to 4,096 instructions (plans as they
            # were); above, cold (seeded) is 2-3x quicker (GPT-3 16 x 256: 1.8 and 2.9 s against
            # 5.5 and 7.2 s), as a deadline 1-3% tighter moves every instruction.
            cold = self.problem.num_nodes > SEED_MIN_NODES
            solved = []
            for factor in _MIN_ENERGY_TARGETS if targets else ():
                target_s = max(factor * relaxation.iteration_time_s, self.fastest_time_s)
                solved.append(self._lp.solve(target_s, warm=not cold))
            tighter = tuple((r, r.iteration_time_s) for r in solved) if targets else None
        result = (relaxation, basis, tuple(rounded), tighter)
        if not warm:
            _remember(self._relaxed, key, result)
        return result

    def _own_relaxation(
        self,
        key: tuple[float, bool, bool],
        restricted: Future[tuple[Relaxation, Relaxation]] | None,
        narrowed: Problem,
        plain: Any,
    ) -> Relaxation | None:
        """The relaxation of the plan's own objective (padded or not, restricted to the choices
        the deadline allows if `restrict`), or None where that is the plain one. Restricted where
        the deadline rules choices out (`narrowed`), it may be solving already (`restricted`,
        see `_solve`), and the plain restricted one is kept with it (`_restricted`).
        Else the padded LP is the plain one with no cost on T, solved from `plain`: where the
        deadline binds the plain optimum, that optimum's basis (primal feasible, and optimal: with
        T at the deadline, the cost it no longer has changes nothing, so it takes no pivots, where
        a cold solve took as long as the plain one); past the least-energy time, where the padded
        optimum moves T to the deadline, the cold solves' start (`_start`). Either way a function
        of the deadline and the flags `key` holds, kept for the last few as `_relaxations` is."""
        if key not in self._own:
            deadline_s, padded, restrict = key
            own = None
            if restricted is not None or narrowed is not self.problem:
                pair = restricted.result() if restricted is not None else _restricted(narrowed, deadline_s, padded)
                plain, own = pair
                _remember(self._own, (deadline_s, False, restrict), plain)
            elif padded:
                own = self._lp.solve(deadline_s, padded=True, start=plain)
            _remember(self._own, key, own)
        return self._own[key]

    def _round(self, relaxation: Relaxation, deadline_s: float | None, hull: bool = False) -> list[np.ndarray]:
        """The relaxation rounded down (onto hull vertices alone with `hull`), then with slack filled."""
        if hull:
            if self._on_hull is None:
                on_hull = self.problem.on_hull()
                self._on_hull = on_hull, Walker(on_hull)
            problem, walker = self._on_hull
            rounded = self.problem.from_hull(round_down(problem, relaxation.finish_s, _LP_SLACK_S, walker))
        else:
            rounded = round_down(self.problem, relaxation.finish_s, _LP_SLACK_S, self._walker)
        rounded_time = self.problem.iteration_time(self.problem.times(rounded))
        candidates = [rounded]
        # Fill slack up to the rounded plan's own time (a longer iteration costs blocking power
        # on every stage) and, when a deadline leaves more room, up to the deadline.
        limit = rounded_time if deadline_s is None else min(rounded_time, deadline_s)
        candidates.append(fill_slack(self.problem, rounded, limit, self._walker))
        if deadline_s is not None and deadline_s > limit:
            candidates.append(fill_slack(self.problem, rounded, deadline_s, self._walker))
        return candidates

    def _objective(self, choice: np.ndarray, deadline_s: float | None, padded: bool) -> tuple[float, float]:
        """(iteration time, energy to minimise): padded, every stage blocks until the deadline."""
        return self._padded(*self.problem.energy(choice), deadline_s, padded)

    def _padded(self, t: float, e: float, deadline_s: float | None, padded: bool) -> tuple[float, float]:
        if padded and deadline_s is not None:
            e += self.problem.blocking_power_w * self.problem.num_stages * (deadline_s - t)
        return t, e

    def _best(
        self,
        candidates: list[np.ndarray],
        deadline_s: float | None,
        relaxation: Relaxation,
        padded: bool = False,
        exchanged: int = _EXCHANGED,
    ) -> Plan:
        scored = []
        plain_te: dict[int, tuple[float, float]] = {}
        seen = set()
        for k, choice in enumerate(candidates):
            # Roundings of different relaxations often agree: score each plan once (a copy
            # would lose every tie to the first anyway, as candidates rank by (E, T, index)).
            key = choice.tobytes()
            if key in seen:
                continue
            seen.add(key)
            plain_te[k] = self.problem.energy(choice)
            t, e = self._padded(*plain_te[k], deadline_s, padded)
            if deadline_s is None or t <= deadline_s:
                scored.append((e, t, k))
        if not scored:
            raise PlanError(
                f"no rounding of the relaxation met the deadline {deadline_s:.9g} s; report this with the profile"
            )
        scored.sort()
        best, best_te = candidates[scored[0][2]], (scored[0][1], scored[0][0])
        if padded and deadline_s is not None:
            # Also the plan the unpadded objective would pick, polished as it would be.
            plain = min((plain_te[k][::-1], k) for _, _, k in scored)[1]
            improved = exchange(self.problem, candidates[plain], plain_te[plain][0], self._walker)
            t, e = self._objective(improved, deadline_s, padded)
            if t <= deadline_s and (e, t) < (best_te[1], best_te[0]):
                best, best_te = improved, (t, e)
        # Pair exchanges within each leading candidate's own time (the iteration never gets
        # longer; padded, the time up to the deadline is free): the best before them is not
        # always the best after.
        tried: list[np.ndarray] = []
        for _, t0, k in scored:
            if len(tried) == exchanged:
                break
            if any(np.array_equal(candidates[k], c) for c in tried):
                continue
            tried.append(candidates[k])
            within = deadline_s if padded and deadline_s is not None else t0
            improved = exchange(self.problem, candidates[k], within, self._walker)
            t, e = self._objective(improved, deadline_s, padded)
            if t <= within and (e, t) < (best_te[1], best_te[0]):
                best, best_te = improved, (t, e)
        frequencies = self.problem.frequencies(best)
        iteration_time_s, energy = self.evaluator.time_energy(frequencies)
        if deadline_s is not None and iteration_time_s > deadline_s:
            raise PlanError(f"internal error: plan takes {iteration_time_s!r} s, over the deadline {deadline_s!r} s")
        # The LP optimum can exceed an optimal plan's energy only by the solver's tolerance.
        if relaxation.lower_bound_j > self._objective(best, deadline_s, padded)[1] * (1 + 1e-7):
            raise PlanError(
                f"internal error: LP bound {relaxation.lower_bound_j!r} J above a plan's energy "
                f"{self._objective(best, deadline_s, padded)[1]!r} J"
            )
        if padded and deadline_s is not None:
            energy += self.evaluator.blocking_power_w * self.evaluator.num_stages * (deadline_s - iteration_time_s)
        bound = min(relaxation.lower_bound_j, energy)
        return Plan(
            frequencies=dict(zip(self.problem.dag.nodes, frequencies.tolist())),
            iteration_time_s=iteration_time_s,
            energy_j=energy,
            lower_bound_j=bound,
            gap=_gap(energy, bound),
            deadline_s=iteration_time_s if deadline_s is None else deadline_s,
            schedule=self.schedule,
            padded=padded and deadline_s is not None,
        )


def _binds(relaxation: Relaxation | None, deadline_s: float) -> bool:
    """Whether a relaxation's iteration lasts its deadline (up to the solver's tolerance)."""
    return relaxation is not None and relaxation.iteration_time_s >= deadline_s * (1 - 1e-9)


def _restricted(problem: Problem, deadline_s: float, padded: bool) -> tuple[Relaxation, Relaxation]:
    """The relaxation of a restricted `problem` at `deadline_s`, plain and of the plan's own
    objective. Padded, from the plain optimum: where that lasts the deadline it is the padded
    optimum too (padding only adds blocking energy to iterations shorter than the deadline), so a
    padded re-plan at a deadline just planned plain (the service at a straggler's pace equal to
    its no-slowdown plan) solves nothing, and either optimum is a function of the deadline alone."""
    lp = relaxation_lp(problem)
    plain = lp.solve(deadline_s)
    if not padded or _binds(plain, deadline_s):
        return plain, plain
    return plain, lp.solve(deadline_s, padded=True, warm=True)


def _remember(memo: dict[K, V], key: K, value: V) -> None:
    """Keep `value` under `key`, dropping the oldest entry beyond `_REMEMBERED`."""
    memo[key] = value
    while len(memo) > _REMEMBERED:
        del memo[next(iter(memo))]


def _with_deadline(plan: Plan, lower_bound_j: float, deadline_s: float) -> Plan:
    bound = min(lower_bound_j, plan.energy_j)
    return Plan(
        plan.frequencies,
        plan.iteration_time_s,
        plan.energy_j,
        bound,
        _gap(plan.energy_j, bound),
        deadline_s,
        plan.schedule,
    )


def _gap(energy_j: float, bound_j: float) -> float:
    """Relative distance to the bound; infinite when the bound certifies nothing (<= 0)."""
    return (energy_j - bound_j) / bound_j if bound_j > 0 else float("inf")
