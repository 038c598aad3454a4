"""Energy saved by the global power-limit optimizer, what its sweep costs, and CarbonCost
following the grid.

    python benchmarks/power_limit.py [--no-zeus]

Part 0: the cost of choosing. On the same simulated GPUs and workloads (this step, and the
simulator's default compute-bound fraction 0.78), each selector's sweep runs three ways, 10
warm-up and 40 measured steps per limit, 400 -> 100 W by 25 W: Perseus measuring every limit
(the sweep before early stopping), Perseus stopping once no lower limit can be chosen (the
default), and Zeus 0.16's GlobalPowerLimitOptimizer (zeus' NVML calls served by the same
simulated GPUs through perseus.testing.fake_nvml, its clock pointed at the same virtual clock).
Printed: training steps spent sweeping, the GPUs' energy and the time they took, the chosen
limit, and the ratios early/full and early/zeus. Exits 1 if early stopping ever chooses other
than the full sweep. Zeus is optional (`pip install zeus==0.16.0`); its MaxSlowdownConstraint
keeps the lowest limit within the slowdown, Perseus' the least energy within it.

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
from typing import NamedTuple


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


class Sweep(NamedTuple):
    """What one sweep cost: training steps, GPU energy (J, all GPUs), time (s), the chosen limit (W)."""

    limits: int
    steps: int
    energy_j: float
    time_s: float
    chosen_w: float


def perseus_sweep(gpus, clock, work, selector, early_stop):
    from perseus.measurement import Monitor
    from perseus.power_limit import GlobalPowerLimitOptimizer, Phase

    start_j = sum(g.energy_mj() for g in gpus) / 1000
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=gpus, cpus=[]), selector, early_stop=early_stop, watchdog=False, verbose=False
    )
    optimizer.on_epoch_begin()
    while optimizer.phase is not Phase.DONE:
        run_steps(gpus, work, 1, optimizer)
    energy_j = sum(g.energy_mj() for g in gpus) / 1000 - start_j
    result = Sweep(
        len(optimizer.measurements), optimizer.sweep_steps, energy_j, clock.now(), optimizer.selected_mw / 1000
    )
    optimizer.close()
    return result


class ZeusRig:
    """Zeus 0.16 over the fake pynvml, each fake GPU standing for a SimGPU that can be swapped."""

    def __init__(self, num_gpus):
        import logging
        import warnings

        from perseus.testing.fake_nvml import FakeGPU, installed

        class SimBackedGPU(FakeGPU):
            """zeus' NVML view of a SimGPU: its energy counter and power limit are the SimGPU's."""

            sim = None

            def energy(self):
                return int(self.sim.energy_mj()) if self.sim is not None else 0

            @property
            def power_limit_mw(self):
                return self.sim.power_limit_mw() if self.sim is not None else self.default_power_limit_mw

            @power_limit_mw.setter
            def power_limit_mw(self, mw):
                if self.sim is not None:
                    self.sim.set_power_limit_mw(int(mw))

        self.fakes = [SimBackedGPU() for _ in range(num_gpus)]
        self._installed = installed(self.fakes)
        self._installed.__enter__()
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(num_gpus)))
        warnings.filterwarnings("ignore", module="zeus")
        import zeus  # imported here: zeus binds pynvml at import time
        import zeus.monitor.energy as zeus_energy

        logging.getLogger("zeus").setLevel(logging.WARNING)
        self.version = zeus.__version__
        self.clock = None
        zeus_energy.time = lambda: self.clock.now()  # windows on the simulation's clock
        zeus_energy.sync_execution_fn = lambda *a, **k: None  # each step already waits for its GPUs

    def sweep(self, gpus, clock, work, selector_name):
        from zeus.monitor import ZeusMonitor
        from zeus.optimizer import power_limit as zeus_pl

        self.clock = clock
        for fake, gpu in zip(self.fakes, gpus):
            fake.sim = gpu
        selectors = {
            "MaxSlowdownConstraint(1.1)": lambda: zeus_pl.MaxSlowdownConstraint(1.1),
            "ZeusCost(0.5)": lambda: zeus_pl.ZeusCost(0.5, world_size=len(gpus)),
            "Energy()": zeus_pl.Energy,
            "Time()": zeus_pl.Time,
        }
        start_j = sum(g.energy_mj() for g in gpus) / 1000
        monitor = ZeusMonitor(gpu_indices=list(range(len(gpus))), cpu_indices=[])
        optimizer = zeus_pl.GlobalPowerLimitOptimizer(monitor, selectors[selector_name]())  # 10 + 40 steps, 25 W
        steps = 0
        while not isinstance(optimizer.state, zeus_pl.Done):
            optimizer.on_step_begin()
            run_steps(gpus, work, 1)
            steps += 1
        energy_j = sum(g.energy_mj() for g in gpus) / 1000 - start_j
        chosen = optimizer.state.optimal_power_limit / 1000
        for gpu in gpus:
            gpu.reset_power_limit()
        return Sweep(len(optimizer.measurements), steps, energy_j, clock.now(), chosen)


def ratios(a: Sweep, b: Sweep) -> str:
    return f"steps {a.steps / b.steps:.2f}, time {a.time_s / b.time_s:.2f}, energy {a.energy_j / b.energy_j:.2f}"


def profiling_cost(args) -> bool:
    """Part 0; False if early stopping ever chose other than the full sweep."""
    from perseus.clock import VirtualClock
    from perseus.devices.sim import sim_gpus
    from perseus.devices.sim_work import DEFAULT_ALPHA, Work
    from perseus.power_limit import Energy, MaxSlowdownConstraint, Time, ZeusCost

    selectors = {
        "MaxSlowdownConstraint(1.1)": lambda: MaxSlowdownConstraint(1.1),
        "ZeusCost(0.5)": lambda: ZeusCost(0.5),
        "Energy()": Energy,
        "Time()": Time,
    }
    rig = None
    if not args.no_zeus:
        try:
            rig = ZeusRig(args.gpus)
        except ImportError:
            rig = None
    zeus_name = f"zeus {rig.version}" if rig is not None else "zeus"
    print(f"Part 0: what choosing costs, {args.gpus} x simulated A100-SXM, 10 warm-up + 40 measured steps per limit")
    if rig is None:
        print("  (zeus not installed or --no-zeus: pip install zeus==0.16.0 for its column)")
    ok = True
    totals = {"full": [0, 0.0], "early": [0, 0.0], "zeus": [0, 0.0]}
    for alpha in dict.fromkeys((args.alpha, DEFAULT_ALPHA)):
        work = Work(args.step_s, alpha=alpha)
        print(f"\nstep {args.step_s:g} s at 400 W, alpha {alpha:g}")
        print(f"  {'selector':28}{'sweep':14}{'limits':>7}{'steps':>7}{'time':>9}{'energy':>11}{'chosen':>8}")
        for name, make in selectors.items():
            runs = {}
            for kind in ("full", "early", "zeus"):
                clock = VirtualClock()
                gpus = sim_gpus("a100-sxm", args.gpus, clock)
                if kind == "zeus":
                    if rig is None:
                        continue
                    runs[kind] = rig.sweep(gpus, clock, work, name)
                else:
                    runs[kind] = perseus_sweep(gpus, clock, work, make(), early_stop=kind == "early")
            labels = {"full": "perseus, full", "early": "perseus, early", "zeus": zeus_name}
            for kind, r in runs.items():
                totals[kind][0] += r.steps
                totals[kind][1] += r.energy_j
                print(
                    f"  {name if kind == 'full' else '':28}{labels[kind]:14}{r.limits:7d}{r.steps:7d}"
                    f"{r.time_s / 60:8.1f}m{r.energy_j / 1e3:9.1f}kJ{r.chosen_w:7.0f}W"
                )
            full, early = runs["full"], runs["early"]
            same = early.chosen_w == full.chosen_w
            ok &= same
            print(f"  {'':28}early/full: {ratios(early, full)}; same limit: {'yes' if same else 'NO'}")
            if "zeus" in runs:
                z = runs["zeus"]
                chose = "the same" if z.chosen_w == early.chosen_w else f"{z.chosen_w:.0f} W"
                print(f"  {'':28}early/zeus: {ratios(early, z)}; zeus chose {chose}")
    full_steps, full_j = totals["full"]
    early_steps, early_j = totals["early"]
    print(
        f"\nall of Part 0: early stopping took {early_steps / full_steps:.2f}x the steps and "
        f"{early_j / full_j:.2f}x the energy of the full sweep"
        + (
            f", {early_steps / totals['zeus'][0]:.2f}x and {early_j / totals['zeus'][1]:.2f}x zeus'"
            if rig is not None
            else ""
        )
        + f"; same limit as the full sweep every time: {'yes' if ok else 'NO'}\n"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.5, help="step time at the maximum limit (s)")
    parser.add_argument("--alpha", type=float, default=0.3, help="compute-bound fraction of the step")
    parser.add_argument("--steps", type=int, default=200, help="steps measured at each limit for the comparison")
    parser.add_argument("--no-zeus", action="store_true", help="leave zeus out of Part 0")
    args = parser.parse_args()
    os.environ["PERSEUS_SIM_DIR"] = tempfile.mkdtemp(prefix="perseus-bench-")  # private simulated GPUs

    from perseus.clock import VirtualClock
    from perseus.devices.sim import sim_gpus
    from perseus.devices.sim_work import Work
    from perseus.measurement import Monitor
    from perseus.measurement.carbon import CarbonReporter, IntensityPoint, IntensityTimeSeries
    from perseus.power_limit import CarbonCost, GlobalPowerLimitOptimizer, MaxSlowdownConstraint, Phase

    wall = time.perf_counter()
    work = Work(args.step_s, alpha=args.alpha)
    ok = profiling_cost(args)

    # Part 1: MaxSlowdownConstraint(1.1) against the maximum limit.
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", args.gpus, clock)
    monitor = Monitor(gpus=gpus, cpus=[])
    # Defaults: 10 warm-up and 40 measured steps per limit, early stopping; verbose=False: this prints its own table.
    optimizer = GlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(1.1), verbose=False)
    steps_per_epoch = 1000
    while optimizer.phase is not Phase.DONE:
        optimizer.on_epoch_begin()
        run_steps(gpus, work, steps_per_epoch, optimizer)
        optimizer.on_epoch_end()
    chosen = optimizer.selected_mw
    sweep_s = clock.now()
    print(f"{args.gpus} x simulated A100-SXM, step {args.step_s:g} s at 400 W, alpha {args.alpha:g}")
    print(
        f"sweep: {len(optimizer.measurements)} limits in {sweep_s / 60:.1f} simulated minutes "
        f"({len(optimizer.skipped_mw)} skipped: none below could be chosen)"
    )
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
    optimizer = GlobalPowerLimitOptimizer(
        monitor, CarbonCost(0.5, series), warmup_steps=5, profile_steps=20, verbose=False
    )
    reporter = CarbonReporter(monitor, series, verbose=False)
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
