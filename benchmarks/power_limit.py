"""Energy saved by the global power-limit optimizer, and CarbonCost following the grid.

    python benchmarks/power_limit.py

Part 1: four simulated A100-SXM GPUs run a memory-bound-ish training step (alpha 0.3: its time
barely changes between 300 and 250 W). The optimizer sweeps 400 -> 100 W with its default
warm-up and profiling lengths and MaxSlowdownConstraint(1.1). Then the same number of steps
runs at the maximum limit and at the chosen one, each measured by a Monitor window, printed
side by side with the saving (target: at least 10% less energy per step).

Part 2: CarbonCost(0.5) on the same workload while the grid's intensity (a replayed series)
switches from clean to dirty mid-run: the limit is re-chosen every epoch and drops when the
grid turns dirty. Its carbon is compared with running at the maximum limit throughout.

Everything runs on a VirtualClock: simulated hours take seconds. Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone


def run_steps(gpus, work, steps, optimizer=None):
    for _ in range(steps):
        if optimizer is not None:
            optimizer.on_step_begin()
        for gpu in gpus:
            gpu.execute(work, blocking=False)
        for gpu in gpus:
            gpu.synchronize()
        if optimizer is not None:
            optimizer.on_step_end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.5, help="step time at the maximum limit (s)")
    parser.add_argument("--alpha", type=float, default=0.3, help="compute-bound fraction of the step")
    parser.add_argument("--steps", type=int, default=200, help="steps measured at each limit for the comparison")
    args = parser.parse_args()
    os.environ["PERSEUS_SIM_DIR"] = tempfile.mkdtemp(prefix="perseus-bench-")  # private simulated GPUs

    from perseus.clock import VirtualClock
    from perseus.devices.sim import Work, sim_gpus
    from perseus.measurement import Monitor
    from perseus.measurement.carbon import CarbonReporter, IntensityPoint, IntensityTimeSeries
    from perseus.power_limit import CarbonCost, GlobalPowerLimitOptimizer, MaxSlowdownConstraint, Phase

    wall = time.perf_counter()
    work = Work(args.step_s, alpha=args.alpha)
    ok = True

    # Part 1: MaxSlowdownConstraint(1.1) against the maximum limit.
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", args.gpus, clock)
    monitor = Monitor(gpus=gpus, cpus=[])
    optimizer = GlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(1.1))  # defaults: 10 warm-up, 40 measured
    steps_per_epoch = 1000
    while optimizer.phase is not Phase.DONE:
        optimizer.on_epoch_begin()
        run_steps(gpus, work, steps_per_epoch, optimizer)
        optimizer.on_epoch_end()
    chosen = optimizer.selected_mw
    sweep_s = clock.now()
    print(f"{args.gpus} x simulated A100-SXM, step {args.step_s:g} s at 400 W, alpha {args.alpha:g}")
    print(f"sweep: {len(optimizer.measurements)} limits in {sweep_s / 60:.1f} simulated minutes")
    print(f"{'limit':>8} {'time/step':>10} {'energy/step':>12}   (sweep, all GPUs)")
    for m in optimizer.measurements:
        mark = "  <- chosen" if m.power_limit_mw == chosen else ""
        print(f"{m.power_limit_w:7.0f}W {m.time_s:9.4f}s {m.energy_j:11.1f}J{mark}")

    results = {}
    for limit in (optimizer.max_power_limit_mw, chosen):
        for gpu in gpus:
            gpu.set_power_limit_mw(limit)
        run_steps(gpus, work, 5)  # settle
        monitor.begin_window("compare")
        run_steps(gpus, work, args.steps)
        m = monitor.end_window("compare")
        results[limit] = (m.time_s / args.steps, sum(m.gpu_energy_j.values()) / args.steps)
    optimizer.close()

    (t_max, e_max), (t_sel, e_sel) = results[optimizer.max_power_limit_mw], results[chosen]
    saving = 1 - e_sel / e_max
    print(f"\n{'':24}{'max limit':>12}{'chosen':>12}{'ratio':>9}")
    print(f"{'power limit (W)':24}{optimizer.max_power_limit_mw / 1000:12.0f}{chosen / 1000:12.0f}")
    print(f"{'time per step (s)':24}{t_max:12.4f}{t_sel:12.4f}{t_sel / t_max:9.3f}")
    print(f"{'energy per step (J)':24}{e_max:12.1f}{e_sel:12.1f}{e_sel / e_max:9.3f}")
    verdict = "met" if saving >= 0.10 and t_sel / t_max <= 1.1 + 1e-9 else "NOT MET"
    print(f"energy saving {saving:.1%} at {t_sel / t_max - 1:+.1%} time (target: >= 10% within 1.1x): {verdict}")
    ok &= verdict == "met"

    # Part 2: CarbonCost on a grid that turns dirty halfway.
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", args.gpus, clock)
    monitor = Monitor(gpus=gpus, cpus=[])
    t0 = datetime(2024, 5, 1, 10, tzinfo=timezone.utc)
    switch_h = 1.0
    series = IntensityTimeSeries(
        [IntensityPoint(t0, 60.0), IntensityPoint(t0 + timedelta(hours=switch_h), 650.0)], clock=clock
    )
    optimizer = GlobalPowerLimitOptimizer(monitor, CarbonCost(0.5, series), warmup_steps=5, profile_steps=20)
    reporter = CarbonReporter(monitor, series)
    epoch_steps = 600  # about 5 simulated minutes
    print(f"\nCarbonCost(0.5): grid at 60 g/kWh, 650 g/kWh after {switch_h:g} h; epochs of {epoch_steps} steps")
    print(f"{'epoch':>5} {'start':>7} {'g/kWh':>6} {'limit':>6} {'energy':>10} {'carbon':>8}")
    baseline_g = carbon_g = 0.0
    limits_before, limits_after = set(), set()
    for epoch in range(1, 25):
        start_h = clock.now() / 3600
        optimizer.on_epoch_begin()
        reporter.on_epoch_begin()
        limit_w = gpus[0].power_limit_mw() / 1000
        run_steps(gpus, work, epoch_steps, optimizer)
        optimizer.on_epoch_end()
        record = reporter.on_epoch_end()
        carbon_g += record.carbon_g
        done = optimizer.phase is Phase.DONE and epoch > 1
        if done:
            (limits_after if start_h >= switch_h else limits_before).add(limit_w)
        # The same epoch at 400 W, from the model: the carbon of not optimizing.
        baseline = optimizer.measurements[0].energy_j * epoch_steps if optimizer.measurements else record.energy_j
        baseline_g += baseline / 3.6e6 * record.g_per_kwh
        print(
            f"{epoch:5d} {start_h:6.2f}h {record.g_per_kwh:6.0f} {limit_w:5.0f}W "
            f"{record.energy_j / 1e3:9.1f}kJ {record.carbon_g:7.1f}g" + ("" if done else "  (profiling)")
        )
    reporter.on_train_end()
    optimizer.close()
    print(f"limits while clean: {sorted(limits_before)} W; while dirty: {sorted(limits_after)} W")
    print(
        f"carbon: {carbon_g:.0f} g with CarbonCost vs {baseline_g:.0f} g at 400 W throughout "
        f"({1 - carbon_g / baseline_g:.1%} less)"
    )
    follows = bool(limits_before and limits_after) and max(limits_after) < min(limits_before)
    print(f"CarbonCost lowers the limit when the grid turns dirty: {'yes' if follows else 'NO'}")
    ok &= follows
    print(f"\n(benchmark wall time {time.perf_counter() - wall:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
