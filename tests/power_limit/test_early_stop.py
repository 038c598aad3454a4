"""The power-limit sweep stops once no lower limit could be chosen, and chooses what the full
sweep chooses; the choice reaches the user without any logging set-up."""

from __future__ import annotations

import json
import logging

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work, predict
from perseus.measurement import Monitor
from perseus.measurement.carbon import StaticIntensity
from perseus.power_limit import (
    CarbonCost,
    Energy,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    Phase,
    PowerLimitMeasurement,
    PowerLimitSelector,
    SelectionContext,
    Time,
    ZeusCost,
)
from perseus.power_limit.selectors import rising

PRESET = "a100-sxm"
WORKLOADS = {  # the benchmark's: memory-bound, the simulator's default (a GPT-3 stage), compute-bound
    "alpha 0.3": Work(0.1, alpha=0.3),
    "alpha 0.78": Work(0.1),
    "alpha 0.95": Work(0.1, alpha=0.95),
}
SELECTORS = {
    "MaxSlowdownConstraint(1.1)": lambda: MaxSlowdownConstraint(1.1),
    "MaxSlowdownConstraint(1.5)": lambda: MaxSlowdownConstraint(1.5),
    "Energy()": Energy,
    "Time()": Time,
    "ZeusCost(0.5)": lambda: ZeusCost(0.5),
    "ZeusCost(0.9)": lambda: ZeusCost(0.9),
    "CarbonCost(0.5, 900 g/kWh)": lambda: CarbonCost(0.5, StaticIntensity(900)),
}


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def sweep(selector, work=WORKLOADS["alpha 0.3"], early_stop=True, stall=None, **kwargs):
    """Run steps until the optimizer is done; returns it (closed) and the steps taken.

    stall: (limit in mW, seconds): the first step measured at that limit takes that much longer
    (the training thread waits, e.g. on a data loader: the GPUs idle)."""
    clock = VirtualClock()
    gpus = sim_gpus(PRESET, 2, clock)
    kwargs.setdefault("warmup_steps", 2)
    kwargs.setdefault("profile_steps", 5)
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=gpus, cpus=[]), selector, early_stop=early_stop, watchdog=False, **kwargs
    )
    steps = 0
    optimizer.on_epoch_begin()
    while optimizer.phase is not Phase.DONE:
        optimizer.on_step_begin()
        for gpu in gpus:
            gpu.execute(work, blocking=False)
        for gpu in gpus:
            gpu.synchronize()
        if stall is not None and optimizer.phase is Phase.MEASURE and optimizer.power_limit_mw == stall[0]:
            clock.advance(stall[1])
            stall = None
        optimizer.on_step_end()
        steps += 1
    optimizer.on_epoch_end()
    optimizer.close()
    return optimizer, steps


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("selector", SELECTORS)
def test_early_stop_chooses_what_the_full_sweep_chooses(workload, selector):
    full, full_steps = sweep(SELECTORS[selector](), WORKLOADS[workload], early_stop=False)
    early, early_steps = sweep(SELECTORS[selector](), WORKLOADS[workload])
    assert early.selected_mw == full.selected_mw
    n = len(early.measurements)
    assert early.measurements == full.measurements[:n]  # the same sweep, cut short
    assert early.skipped_mw == full.power_limits_mw[n:]
    assert early_steps == early.sweep_steps == n * 7 and full_steps == 13 * 7
    assert full.skipped_mw == []


def test_the_benchmark_workload_skips_the_slowest_limits():
    """Memory-bound steps under MaxSlowdownConstraint(1.1): 200 W is 1.138x slower than 400 W and
    175 W slower still, so the sweep stops there and never runs 150-100 W (up to 2.6x slower)."""
    early, _ = sweep(MaxSlowdownConstraint(1.1))
    measured = [400, 375, 350, 325, 300, 275, 250, 225, 200, 175]
    assert [m.power_limit_mw // 1000 for m in early.measurements] == measured
    assert early.skipped_mw == [150_000, 125_000, 100_000]
    assert early.selected_mw == 225_000


def test_one_slow_reading_does_not_end_the_sweep():
    """A stall in one measured step at 350 W makes 350 W read 1.125x slower than 400 W: stopping
    there would choose 375 W. The sweep goes on (the next limit is fast enough) and chooses what
    the full sweep with the same stall chooses, which is the clean sweep's choice."""
    t_top, _ = predict(PRESET, WORKLOADS["alpha 0.3"], 1410, 400)
    t_350, _ = predict(PRESET, WORKLOADS["alpha 0.3"], 1410, 350)
    stall = (350_000, 5 * (1.125 * t_top - t_350))  # over the 5 measured steps: 1.125x on average
    full, _ = sweep(MaxSlowdownConstraint(1.1), early_stop=False, stall=stall)
    early, _ = sweep(MaxSlowdownConstraint(1.1), stall=stall)
    clean, _ = sweep(MaxSlowdownConstraint(1.1))
    outlier = early.measurements[2]
    assert outlier.power_limit_mw == 350_000 and outlier.time_s == pytest.approx(1.125 * early.measurements[0].time_s)
    assert early.selected_mw == full.selected_mw == clean.selected_mw == 225_000
    assert early.measurements == full.measurements[: len(early.measurements)]
    assert early.skipped_mw == clean.skipped_mw

    jumpy = MaxSlowdownConstraint(1.1)  # what stopping on one slow reading did
    jumpy.slow_limits_to_stop = 1
    stopped, _ = sweep(jumpy, stall=stall)
    assert stopped.selected_mw == 375_000 and len(stopped.measurements) == 3


def test_rising_means_a_rise_then_no_fall():
    assert rising([5, 4, 5, 6, 7], 3)
    assert rising([5, 4, 5, 5, 5], 3)  # level after a rise: the lowest clock, whatever the limit
    assert not rising([5, 5, 5, 5, 6], 3)  # level first: limits above what the work draws
    assert not rising([5, 4, 5, 6, 5.9], 3)  # a fall breaks the run
    assert not rising([1, 2, 3], 3)  # too few
    assert not rising([1, 2, 3, 4], None)


def test_selector_stop_rules():
    context = SelectionContext(400_000, 1)

    def rows(*pairs):
        return [PowerLimitMeasurement(400_000 - 25_000 * i, t, e) for i, (t, e) in enumerate(pairs)]

    slow = rows((1.0, 10), (1.05, 9), (1.12, 8), (1.15, 7))
    assert MaxSlowdownConstraint(1.1).stop_sweep(slow, context)  # 1.12x and 1.15x: beyond 1.1 twice
    assert not MaxSlowdownConstraint(1.1).stop_sweep(slow[:3], context)  # once: it may be noise
    assert not MaxSlowdownConstraint(1.1).stop_sweep(rows((1.0, 10), (1.12, 9), (1.05, 8)), context)
    assert not MaxSlowdownConstraint(1.2).stop_sweep(slow, context)
    bottomed = rows((1.0, 10), (1.01, 8), (1.02, 9), (1.03, 10), (1.04, 11))
    assert MaxSlowdownConstraint(2.0).stop_sweep(bottomed, context)  # energy rose 3 times
    assert Energy().stop_sweep(bottomed, context) and Time().stop_sweep(bottomed, context)
    assert not Energy().stop_sweep(bottomed[:-1], context)
    assert CarbonCost(0.1, StaticIntensity(50)).stop_sweep(bottomed, context)

    class Lowest(PowerLimitSelector):  # overrides only select: cannot tell, so the whole sweep
        def select(self, measurements, context):
            return min(m.power_limit_mw for m in measurements)

    assert not Lowest().stop_sweep(bottomed, context)
    patient = Energy()
    patient.stop_patience = None
    assert not patient.stop_sweep(bottomed, context)


def test_a_selector_that_cannot_tell_gets_the_whole_sweep():
    class Lowest(PowerLimitSelector):
        def select(self, measurements, context):
            return min(m.power_limit_mw for m in measurements)

    optimizer, _ = sweep(Lowest())
    assert len(optimizer.measurements) == 13 and optimizer.skipped_mw == []
    assert optimizer.selected_mw == 100_000


def test_skipped_limits_are_recorded_in_the_profile_and_a_reuse_that_needs_them_warns(tmp_path, caplog):
    path = tmp_path / "pl.json"
    early, _ = sweep(MaxSlowdownConstraint(1.1), profile_path=path)
    data = json.loads(path.read_text())
    assert data["skipped_power_limits_mw"] == [150_000, 125_000, 100_000]
    assert len(data["measurements"]) == 10

    again = GlobalPowerLimitOptimizer(
        Monitor(gpus=sim_gpus(PRESET, 2, VirtualClock()), cpus=[]),
        MaxSlowdownConstraint(1.1),
        profile_path=path,
        watchdog=False,
    )
    assert again.selected_mw == 225_000 and again.skipped_mw == early.skipped_mw
    assert "delete the file" not in caplog.text  # the same selector would stop there too
    again.close()
    # Energy would have stopped where energy rose 3 times in a row, which this profile never saw.
    other = GlobalPowerLimitOptimizer(
        Monitor(gpus=sim_gpus(PRESET, 2, VirtualClock()), cpus=[]), Energy(), profile_path=path, watchdog=False
    )
    assert "stops at 175 W" in caplog.text and "delete the file to profile again" in caplog.text
    other.close()


def test_one_line_reaches_stderr_without_logging_set_up(capsys):
    sweep(MaxSlowdownConstraint(1.1))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    line = err[0]
    t_top, e_top = predict(PRESET, WORKLOADS["alpha 0.3"], 1410, 400)
    t, e = predict(PRESET, WORKLOADS["alpha 0.3"], 1410, 225)
    assert line.startswith("perseus: power limit 225 W for 2 GPU(s) (MaxSlowdownConstraint(factor=1.1))")
    assert f"per step {t / t_top - 1:+.1%} time, {e / e_top - 1:+.1%} energy vs 400 W" in line
    assert line.endswith("; 10 of 13 limits measured in 70 steps, 3 skipped: none below could be chosen")


def test_the_table_goes_to_the_log_at_info_and_nothing_is_printed_twice(capsys, caplog):
    caplog.set_level(logging.INFO, logger="perseus.power_limit")
    sweep(MaxSlowdownConstraint(1.1))
    assert capsys.readouterr().err == ""
    [record] = [r for r in caplog.records if "power limit 225 W" in r.getMessage()]
    table = record.getMessage().splitlines()
    assert table[0].startswith("power limit 225 W for 2 GPU(s)")
    assert sum("<- selected" in row for row in table) == 1
    assert [row.split()[0] for row in table if row.endswith("skipped")] == ["150", "125", "100"]


def test_verbose_false_prints_nothing(capsys):
    sweep(MaxSlowdownConstraint(1.1), verbose=False)
    assert capsys.readouterr().err == ""
