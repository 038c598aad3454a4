"""Zeus 0.16 code on Perseus' optimizer: its argument names, its ZeusMonitor, loops calling one
step hook. Simulated A100s on a VirtualClock, so runs compare exactly."""

from __future__ import annotations

import logging

import pytest

from perseus.clock import VirtualClock
from perseus.devices import get_gpus
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.measurement import Monitor
from perseus.measurement.carbon import StaticIntensity
from perseus.power_limit import (
    CarbonCost,
    GlobalPowerLimitOptimizer,
    PowerLimitMeasurement,
    SelectionContext,
    ZeusCost,
)

WORK = Work(0.1, alpha=0.3)


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def optimizer(**kwargs):
    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    kwargs.setdefault("warmup_steps", 2)
    kwargs.setdefault("profile_steps", 5)
    kwargs.setdefault("verbose", False)
    return GlobalPowerLimitOptimizer(Monitor(gpus=gpus, cpus=[]), watchdog=False, **kwargs), gpus


def run(opt, gpus, steps, hooks=("begin", "end"), epochs=1):
    """`steps` steps per epoch, calling the step hooks named in `hooks`; the limit of each step."""
    limits = []
    for _ in range(epochs):
        opt.on_epoch_begin()
        for _ in range(steps):
            if "begin" in hooks:
                opt.on_step_begin()
            limits.append(gpus[0].power_limit_mw() // 1000)
            for gpu in gpus:
                gpu.execute(WORK, blocking=False)
            for gpu in gpus:
                gpu.synchronize()
            if "end" in hooks:
                opt.on_step_end()
        opt.on_epoch_end()
    return limits


def test_zeus_argument_names_choose_what_perseus_names_choose():
    ours, ours_gpus = optimizer(selector=ZeusCost(0.5), pl_step_w=50, early_stop=False)
    ours_limits = run(ours, ours_gpus, 7 * 7)
    ours.close()  # one optimizer at a time: both drive the same simulated GPUs
    zeus, zeus_gpus = optimizer(optimum_selector=ZeusCost(eta=0.5), pl_step=50, wait_steps=3, early_stop=False)
    zeus_limits = run(zeus, zeus_gpus, 3 + 7 * 7)
    zeus.close()
    assert ours.power_limits_mw == zeus.power_limits_mw == [w * 1000 for w in range(400, 99, -50)]
    assert zeus_limits[:10] == [400] * 10  # 3 waited, then 2 warm-up and 5 measured at 400 W
    assert zeus_limits[3:] == ours_limits
    for got, want in zip(zeus.measurements, ours.measurements, strict=True):
        assert got.power_limit_mw == want.power_limit_mw
        assert got.time_s == pytest.approx(want.time_s, rel=1e-9)
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-9)
    assert zeus.selected_mw == ours.selected_mw is not None


def test_a_setting_named_twice_is_refused():
    with pytest.raises(ConfigError, match="selector= and optimum_selector="):
        optimizer(selector=ZeusCost(0.5), optimum_selector=ZeusCost(0.5))
    with pytest.raises(ConfigError, match="pl_step_w= and pl_step="):
        optimizer(pl_step_w=25, pl_step=25)
    with pytest.raises(ConfigError, match="eta_knob= and eta="):
        ZeusCost(0.5, eta=0.5)
    with pytest.raises(ConfigError, match="needs eta_knob"):
        ZeusCost()
    with pytest.raises(ConfigError, match="eta_knob must be in"):
        ZeusCost(eta=2)
    with pytest.raises(ConfigError, match="wait_steps"):
        optimizer(wait_steps=-1)
    with pytest.raises(ConfigError, match="world_size"):
        ZeusCost(0.5, world_size=0)


def test_eta_and_world_size_mean_what_they_mean_in_zeus():
    m = PowerLimitMeasurement(300_000, 2.0, 1000.0)
    counted = SelectionContext(max_power_limit_mw=400_000, num_gpus=2)
    assert ZeusCost(eta=0.25).cost(m, counted) == ZeusCost(0.25).cost(m, counted) == 0.25 * 1000 + 0.75 * 400 * 2 * 2
    assert ZeusCost(0.25, world_size=8).cost(m, counted) == 0.25 * 1000 + 0.75 * 400 * 8 * 2
    assert repr(ZeusCost(0.25, world_size=8)) == "ZeusCost(eta_knob=0.25, world_size=8)"  # the line at the choice
    assert repr(ZeusCost(eta=0.25)) == "ZeusCost(eta_knob=0.25)"
    carbon = CarbonCost(eta=0.5, provider=StaticIntensity(400))
    assert carbon.eta_knob == 0.5


@pytest.mark.parametrize("hooks", [("begin",), ("end",)], ids=["on_step_begin only", "on_step_end only"])
def test_a_loop_calling_one_step_hook_measures_what_both_hooks_measure(hooks, caplog):
    both, both_gpus = optimizer(selector=ZeusCost(0.5), early_stop=False)
    steps = 13 * 7 + 5
    both_limits = run(both, both_gpus, steps)
    both.close()  # one optimizer at a time: both drive the same simulated GPUs
    one, one_gpus = optimizer(selector=ZeusCost(0.5), early_stop=False)
    with caplog.at_level(logging.WARNING):
        one_limits = run(one, one_gpus, steps, hooks)
    one.close()
    assert "warmup_steps" not in caplog.text
    assert one.selected_mw == both.selected_mw is not None
    assert [m.power_limit_mw for m in one.measurements] == [m.power_limit_mw for m in both.measurements]
    for got, want in zip(one.measurements, both.measurements):
        assert got.time_s == pytest.approx(want.time_s, rel=1e-9)
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-9)
    assert one_limits == both_limits


def test_begin_only_epochs_that_end_mid_measurement_retry_the_limit():
    opt, gpus = optimizer(selector=ZeusCost(0.5))
    limits = run(opt, gpus, 10, ("begin",), epochs=2)
    # 400 W: 2 warm-up + 5 measured; 375 W: 3 steps cut by the epoch end, then again.
    assert limits == [400] * 7 + [375] * 3 + [375] * 7 + [350] * 3
    assert [m.power_limit_mw for m in opt.measurements] == [400_000, 375_000]
    opt.close()


@pytest.mark.parametrize("epoch_steps", [100, 20])
def test_the_steps_a_sweep_took_add_up(epoch_steps, capsys):
    """wait_steps=1, 2 warm-up + 5 measured per limit, 6 limits: 43 steps when no epoch ends in
    the middle of a limit. With 20-step epochs, each epoch's end discards the limit it cuts short
    (5 steps in the first epoch: 1 waited + 2 x 7 + 5; 6 in the second: 2 x 7 + 6) and the last
    epoch measures 2 limits: 54 steps, 11 of them discarded, as the line printed says."""
    opt, gpus = optimizer(selector=ZeusCost(0.5), pl_step=60, wait_steps=1, early_stop=False, verbose=True)
    assert len(opt.power_limits_mw) == 6
    limits = run(opt, gpus, epoch_steps, epochs=100 // epoch_steps)
    assert opt.selected_mw is not None
    cut = 0 if epoch_steps == 100 else 11
    assert (opt.sweep_steps, opt.waited_steps, opt.cut_steps) == (43 + cut, 1, cut)
    assert limits[opt.sweep_steps - 1] == 100 and set(limits[opt.sweep_steps :]) == {opt.selected_mw // 1000}
    line = capsys.readouterr().err.strip()
    more = ", 11 discarded: an epoch ended before their limit was measured" if cut else ""
    assert line.endswith(f"; 6 of 6 limits measured in {43 + cut} steps (1 waited{more})"), line
    opt.close()


def test_an_epoch_without_a_counted_step_names_the_hooks(caplog):
    opt, gpus = optimizer()
    with caplog.at_level(logging.WARNING):
        run(opt, gpus, 3, hooks=())
    assert "no step counted: call on_step_begin() or on_step_end()" in caplog.text
    opt.close()


class ZeusLikeMonitor:
    """What Zeus users hand over: a ZeusMonitor's shape (the GPUs it watches, and windows)."""

    def __init__(self, gpu_indices):
        self.gpu_indices = gpu_indices

    def begin_window(self, key, sync_execution=True):
        raise AssertionError("Perseus measures with its own Monitor")

    def end_window(self, key, sync_execution=True, cancel=False):
        raise AssertionError("Perseus measures with its own Monitor")


def test_a_zeus_monitor_is_taken_for_its_gpus(monkeypatch):
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:3")
    opt = GlobalPowerLimitOptimizer(ZeusLikeMonitor([2]), warmup_steps=1, profile_steps=1, watchdog=False)
    assert [g.index for g in opt.gpus] == [2]
    gpus = get_gpus()
    assert [g.power_limit_mw() for g in gpus] == [400_000] * 3
    opt._apply(250_000)
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000, 250_000]
    opt.close()
    assert [g.power_limit_mw() for g in gpus] == [400_000] * 3


@pytest.mark.parametrize(
    "monitor, message",
    [
        (object(), "must be a perseus.measurement.Monitor or a zeus ZeusMonitor"),
        (ZeusLikeMonitor([]), "monitors no GPU"),
        (ZeusLikeMonitor(["x"]), "must be a list of GPU indices"),
    ],
)
def test_other_monitors_are_a_clear_error(monitor, message, monkeypatch):
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:1")
    with pytest.raises(ConfigError, match=message):
        GlobalPowerLimitOptimizer(monitor, watchdog=False)
