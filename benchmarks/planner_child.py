"""One planner measurement in a fresh process, for benchmarks/planner.py: run with the perseus
tree under test first on sys.path (this repository's, or another commit's extracted by the
parent), a JSON task on stdin, a JSON answer on stdout. A fresh process measures peak memory and
lets two versions of the planner run side by side in one benchmark.

Tasks (all plans are checked against their deadline by the tree's own evaluator):
- plans: setup + plan per slowdown factor (padded past 1.0 where the tree supports it).
- speed: setup + no-slowdown plan; the 50-point frontier; re-plans of the kept planner at new
  deadlines (what the service does when a straggler appears or recovers); the same re-plans as
  the service makes them (`plan_pipeline`: the plan, made followable on GPUs whose clock changes
  take the simulator's realistic A100 latencies, 10-30 ms by target clock), where the tree has it.
- large: setup + no-slowdown plan, with the process's peak RSS.

The no-slowdown plan of `speed` and `large` also reports where its CPU time went (`phases`): LP
solves, pair exchanges, rounding walks and the exact MILP, timed by wrapping those functions of
the tree under test where it has them; the rest (refine's own work, evaluation) is "other".
`speed` reports the same for the re-plans (`replan_phases`: CPU per re-plan on average, calls
over all of them) and the frontier (`frontier_phases`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import resource
import statistics
import sys
import time
from collections import defaultdict

# (phase, module, class or None, function): what `PhaseClock` times. Nested calls count once, in
# the outermost phase (refine's LP solves are LP; exchange's own walks are exchange).
PHASES = (
    ("lp", "perseus.planner.lp", "HullLP", "solve"),
    ("lp", "perseus.planner.flow", "FlowLP", "solve"),
    ("exchange", "perseus.planner.solver", None, "exchange"),
    ("rounding", "perseus.planner.solver", None, "round_down"),
    ("rounding", "perseus.planner.solver", None, "fill_slack"),
    ("milp", "perseus.planner.solver", None, "solve_exact"),
)
# The re-plans' deadlines (x the all-max time), in this order on one kept planner.
REPLAN_FACTORS = (1.2, 1.0, 1.1, 1.05, 1.15)


class PhaseClock:
    """CPU seconds and calls per planner phase while `running` is set."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.running = False
        self._depth = 0

    def install(self) -> None:
        for phase, module_name, class_name, name in PHASES:
            try:
                owner = importlib.import_module(module_name)
            except ModuleNotFoundError:  # a tree from before that module
                continue
            owner = getattr(owner, class_name, None) if class_name else owner
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, self._timed(phase, getattr(owner, name)))

    def _timed(self, phase: str, func):
        def timed(*args, **kwargs):
            if not self.running or self._depth:
                return func(*args, **kwargs)
            self._depth += 1
            tick = time.process_time()
            try:
                return func(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[phase] += time.process_time() - tick
                self.calls[phase] += 1

        return timed

    def measure(self, run):
        """`run()`'s result and {phase: [CPU s, calls]}, with "total" and "other"."""
        self.seconds.clear()
        self.calls.clear()
        self.running = True
        tick = time.process_time()
        try:
            result = run()
        finally:
            self.running = False
        total = time.process_time() - tick
        phases = {phase: [self.seconds[phase], self.calls[phase]] for phase in self.seconds}
        phases["other"] = [total - sum(self.seconds.values()), 0]
        phases["total"] = [total, 0]
        return result, phases


def profile_from(doc: dict):
    from perseus.profiler import Profile, ProfilePoint

    points = {(int(s), k): [ProfilePoint(int(f), t, e) for f, t, e in rows] for s, k, rows in doc["points"]}
    return Profile(points, doc["blocking_power_w"])


def plan_at(planner, factor: float, padded: bool):
    deadline = factor * planner.max_frequency_time_s
    if padded and "padded" in inspect.signature(planner.plan).parameters:
        return planner.plan(deadline=deadline, padded=True), deadline
    return planner.plan(deadline=deadline), deadline


def summary(planner, plan, deadline: float, padded: bool) -> dict:
    """Energy over an iteration of the deadline when padded (the straggler's pace), as the
    plan's own bound states it; the tree's evaluator re-checks the deadline."""
    ev = planner.evaluator.evaluate(plan.frequencies)
    blocking = planner.evaluator.blocking_power_w * planner.evaluator.num_stages
    energy = ev.energy_j + (blocking * (deadline - ev.iteration_time_s) if padded else 0.0)
    same_objective = getattr(plan, "padded", False) == padded
    return {
        "time_s": ev.iteration_time_s,
        "energy_j": energy,
        "gap": plan.gap if same_objective else None,
        "claimed_gap": plan.gap,
        "met": ev.iteration_time_s <= deadline,
    }


def service_replans(schedule, profile) -> float | None:
    """Median of the service's re-plans at REPLAN_FACTORS (after its no-slowdown plan) on a
    profile that states realistic simulated A100 switch latencies; None where the tree has no
    switch-latency handling."""
    try:
        from perseus.devices.sim_presets import PRESETS
        from perseus.devices.sim_realism import NVIDIA_INSTANT_POWER
        from perseus.planner import Planner
        from perseus.profiler import Profile
        from perseus.profiler.profile import SWITCH_LATENCIES_META, SWITCH_LATENCY_META, format_switch_latencies
        from perseus.service.planning import make_planner, plan_pipeline
    except ImportError:
        return None
    preset = PRESETS["a100-sxm"]
    clocks = {p.frequency for points in profile.points.values() for p in points}
    latencies = {f: NVIDIA_INSTANT_POWER.switch_latency_for(preset, f) for f in clocks}
    meta = {
        SWITCH_LATENCY_META: str(max(latencies.values())),
        SWITCH_LATENCIES_META: format_switch_latencies(latencies),
    }
    planner: Planner = make_planner(schedule, Profile(profile.points, profile.blocking_power_w, meta))
    plan_pipeline(planner)
    took = []
    for factor in REPLAN_FACTORS:
        tick = time.perf_counter()
        plan_pipeline(planner, factor * planner.max_frequency_time_s)
        took.append(time.perf_counter() - tick)
    return statistics.median(took)


def main() -> None:
    task = json.load(sys.stdin)
    from perseus.planner import Planner
    from perseus.schedules import build_schedule

    clock = PhaseClock()
    clock.install()
    profile = profile_from(task["profile"])
    name, stages, microbatches = task["schedule"]
    schedule = build_schedule(name, stages, microbatches)
    tick = time.perf_counter()
    planner = Planner(schedule, profile)
    setup_s = time.perf_counter() - tick
    out: dict = {"nodes": planner.problem.num_nodes, "setup_s": setup_s}
    if task["task"] == "plans":
        rows = []
        for factor in task["factors"]:
            padded = factor > 1.0
            tick = time.perf_counter()
            plan, deadline = plan_at(planner, factor, padded)
            rows.append(
                {"factor": factor, "plan_s": time.perf_counter() - tick, **summary(planner, plan, deadline, padded)}
            )
        out["rows"] = rows
    elif task["task"] == "speed":
        tick = time.perf_counter()
        (plan, deadline), out["phases"] = clock.measure(lambda: plan_at(planner, 1.0, False))
        out["plan_s"] = time.perf_counter() - tick
        out["plan"] = summary(planner, plan, deadline, False)
        replans = []
        replan_phases: dict[str, list] = {}
        for factor in REPLAN_FACTORS:
            tick = time.perf_counter()
            _, phases = clock.measure(lambda factor=factor: plan_at(planner, factor, True))
            replans.append(time.perf_counter() - tick)
            for phase, (seconds, calls) in phases.items():
                total = replan_phases.setdefault(phase, [0.0, 0])
                total[0] += seconds / len(REPLAN_FACTORS)
                total[1] += calls
        out["replan_s"] = statistics.median(replans)
        out["replan_phases"] = replan_phases
        out["service_replan_s"] = service_replans(schedule, profile)
        tick = time.perf_counter()
        points, out["frontier_phases"] = clock.measure(lambda: planner.frontier(50))
        out["frontier_s"] = time.perf_counter() - tick
        out["frontier_gap"] = max(p.plan.gap for p in points)
    else:  # large
        tick = time.perf_counter()
        (plan, deadline), out["phases"] = clock.measure(lambda: plan_at(planner, 1.0, False))
        out["plan_s"] = time.perf_counter() - tick
        out["plan"] = summary(planner, plan, deadline, False)
        out["saving"] = 1 - out["plan"]["energy_j"] / planner.max_frequency_energy_j
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
