"""Realistic simulated GPUs: a stepping energy counter, averaged and part-sampled power readings,
noise, clock switching latency, thermal drift; modes and environment overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from perseus.clock import VirtualClock
from perseus.devices import get_gpus
from perseus.devices.sim import SimGPU, sim_gpus
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import (
    DEFAULT_SIM_MODE,
    IDEAL,
    NVIDIA_AVERAGED_POWER,
    NVIDIA_INSTANT_POWER,
    SimRealism,
    sim_realism,
)
from perseus.devices.sim_work import Work, busy_power_w, predict
from perseus.exceptions import ConfigError

A100 = PRESETS["a100-sxm"]
IDLE_W = A100.idle_w


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    for name in ("PERSEUS_SIM_MODE", "PERSEUS_SIM_COUNTER_PERIOD_S", "PERSEUS_SIM_SWITCH_LATENCY_S"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_counter_steps_on_its_update_grid():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock, realism=SimRealism(counter_period_s=0.1))
    busy_w = busy_power_w(A100, Work(1.0), 1410)
    gpu.execute(Work(1.0), blocking=False)
    readings = []
    for _ in range(30):
        readings.append(gpu.energy_mj())
        clock.advance(0.01)
    # Within one period the reading does not move; at each update it jumps by a period's energy.
    assert readings[:10] == [0.0] * 10
    assert readings[10:20] == [pytest.approx(busy_w * 0.1 * 1000)] * 10
    assert readings[20] == pytest.approx(busy_w * 0.2 * 1000)
    # A window shorter than the period reads zero, as on NVML; one spanning many periods is right.
    a = gpu.energy_mj()
    clock.advance(0.05)
    assert gpu.energy_mj() == a
    clock.advance(2.0)
    assert gpu.energy_mj() / 1000 == pytest.approx(busy_w * 1.0 + IDLE_W * 1.3)


def test_an_ideal_gpu_reads_exact_energy_at_any_instant():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock)
    assert gpu.realism == IDEAL and gpu.realism.ideal
    gpu.execute(Work(1.0), blocking=False)
    clock.advance(0.013)
    assert gpu.energy_mj() / 1000 == pytest.approx(busy_power_w(A100, Work(1.0), 1410) * 0.013)


def test_an_averaged_power_reading_lags_a_step_of_load():
    clock = VirtualClock()
    realism = SimRealism(power_update_s=0.1, power_window_s=1.0)
    gpu = SimGPU("h100-sxm", clock=clock, realism=realism)
    busy_w = busy_power_w(PRESETS["h100-sxm"], Work(10.0), 1980)
    idle_w = PRESETS["h100-sxm"].idle_w
    clock.advance(2.0)
    gpu.execute(Work(10.0), blocking=False)
    assert gpu.power_mw() / 1000 == pytest.approx(idle_w)
    clock.advance(0.55)  # last refresh at 2.5 s: the window [1.5, 2.5] is half busy
    assert gpu.power_mw() / 1000 == pytest.approx((idle_w + busy_w) / 2)
    clock.advance(0.5)
    assert gpu.power_mw() / 1000 == pytest.approx(busy_w)


def test_partial_sampling_sees_only_the_last_quarter_of_each_update():
    clock = VirtualClock()
    realism = SimRealism(power_update_s=0.1, power_window_s=0.1, power_coverage=0.25)
    gpu = SimGPU("a100-sxm", clock=clock, realism=realism)
    busy_w = busy_power_w(A100, Work(1.0), 1410)
    clock.advance(1.0)
    gpu.execute(Work(0.05), blocking=False)  # busy 1.00 to 1.05: in no sampled span
    clock.advance(0.1)
    assert gpu.power_mw() / 1000 == pytest.approx(IDLE_W)
    clock.advance(0.08)  # now 1.18; work from 1.18 to 1.23
    gpu.execute(Work(0.05), blocking=False)
    clock.advance(0.03)  # refresh at 1.2: sampled [1.175, 1.2], busy from 1.18
    assert gpu.power_mw() / 1000 == pytest.approx(IDLE_W + (busy_w - IDLE_W) * 0.02 / 0.025)


def test_noise_is_deterministic_and_of_the_stated_size():
    def readings(seed: int) -> list[float]:
        clock = VirtualClock()
        realism = SimRealism(power_update_s=0.1, power_noise=0.01, seed=seed)
        gpu = SimGPU("a40", clock=clock, realism=realism)
        out = []
        for _ in range(400):
            clock.advance(0.1)
            out.append(gpu.power_mw() / 1000 / PRESETS["a40"].idle_w - 1.0)
        return out

    a, b = readings(1), readings(1)
    assert a == b and readings(2) != a
    mean = sum(a) / len(a)
    sd = (sum((x - mean) ** 2 for x in a) / len(a)) ** 0.5
    assert abs(mean) < 0.003 and 0.008 < sd < 0.012


def test_a_clock_change_takes_effect_after_the_switch_latency():
    clock = VirtualClock()
    realism = SimRealism(switch_latency_s=0.010, switch_latency_low_extra_s=0.020)
    gpu = SimGPU("a100-sxm", clock=clock, realism=realism)
    assert gpu.clock_switch_latency_s(1410) == pytest.approx(0.010)
    assert gpu.clock_switch_latency_s(210) == pytest.approx(0.030)
    assert gpu.clock_switch_latency_s(810) == pytest.approx(0.020)
    gpu.lock_sm_clock(810)
    assert gpu.sm_clock() == 1410
    clock.advance(0.0199)
    assert gpu.sm_clock() == 1410
    clock.advance(0.0002)
    assert gpu.sm_clock() == 810
    gpu.reset_sm_clock()  # back to the default: 10 ms
    assert gpu.sm_clock() == 810 and not gpu.at_defaults()
    assert not os.path.exists(gpu.state_path)  # the state file goes at once: back at defaults once in force
    clock.advance(0.011)
    assert gpu.sm_clock() == 1410 and gpu.at_defaults()


def test_work_spanning_the_switch_runs_partly_at_each_clock():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock, realism=SimRealism(switch_latency_s=0.02))
    work = Work(0.1, alpha=0.8)
    gpu.lock_sm_clock(705)  # in force at 0.02
    duration = gpu.execute(work)
    t_hi, e_hi = predict(A100, work, 1410)
    t_lo, e_lo = predict(A100, work, 705)
    done = 0.02 / t_hi
    assert duration == pytest.approx(0.02 + (1 - done) * t_lo)
    assert gpu.energy_mj() / 1000 == pytest.approx(done * e_hi + (1 - done) * e_lo)
    # Work issued once the clock is in force costs exactly the ground truth at that clock.
    before, start = gpu.energy_mj(), clock.now()
    assert gpu.execute(work) == pytest.approx(t_lo)
    assert clock.now() - start == pytest.approx(t_lo)
    assert (gpu.energy_mj() - before) / 1000 == pytest.approx(e_lo)
    assert gpu.predict(work) == pytest.approx((t_lo, e_lo))


def test_work_finishing_before_the_switch_runs_at_the_old_clock():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock, realism=SimRealism(switch_latency_s=0.05))
    gpu.lock_sm_clock(705)
    work = Work(0.01)
    assert gpu.execute(work) == pytest.approx(predict(A100, work, 1410)[0])


def test_another_process_sees_the_switch_in_flight(sim_dir):
    gpu = SimGPU("a100-sxm", 2, realism=SimRealism(switch_latency_s=60.0))
    gpu.lock_sm_clock(900)
    code = "from perseus.devices.sim import SimGPU; g = SimGPU('a100-sxm', 2); print(g.sm_clock(), g.at_defaults())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1410", "False"]  # still at the old clock, but no longer at defaults (locked to 900)
    gpu.reset_sm_clock()


def test_a_switch_on_a_virtual_clock_does_not_leak_to_another_clock():
    gpu = SimGPU("a100-sxm", 3, clock=VirtualClock(), realism=SimRealism(switch_latency_s=5.0))
    gpu.lock_sm_clock(900)
    other = SimGPU("a100-sxm", 3, clock=VirtualClock())
    assert gpu.sm_clock() == 1410 and other.sm_clock() == 900


def test_thermal_drift_raises_busy_power_over_minutes():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock, realism=SimRealism(thermal_drift=0.05, thermal_time_s=60.0))
    cold = gpu.energy_mj()
    gpu.execute(Work(0.1))
    cold = gpu.energy_mj() - cold
    clock.advance(600.0)
    warm = gpu.energy_mj()
    gpu.execute(Work(0.1))
    warm = gpu.energy_mj() - warm
    assert cold / 1000 == pytest.approx(predict(A100, Work(0.1), 1410)[1], rel=0.002)
    assert warm / cold == pytest.approx(1.05, abs=0.002)


def test_modes_and_the_default():
    assert DEFAULT_SIM_MODE in ("ideal", "realistic")
    assert sim_realism("a100-sxm", "ideal") == IDEAL
    assert sim_realism("a100-sxm", "realistic") == NVIDIA_INSTANT_POWER
    assert sim_realism("h100-sxm", "realistic") == NVIDIA_AVERAGED_POWER
    assert sim_gpus("a100-sxm", 2)[1].realism == sim_realism("a100-sxm")
    assert SimGPU("a100-sxm", realism="realistic").realism.counter_period_s == 0.1
    for preset in PRESETS.values():
        r = preset.realism
        assert r.counter_period_s == 0.1 and r.switch_latency_s >= 0.010
        assert r.switch_latency_for(preset, preset.min_mhz) > r.switch_latency_for(preset, preset.max_mhz)
    with pytest.raises(ConfigError, match="ideal, realistic"):
        sim_realism("a100-sxm", "fast")


def test_environment_picks_the_mode_and_overrides_aspects(monkeypatch):
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    assert get_gpus()[0].realism == NVIDIA_INSTANT_POWER
    monkeypatch.setenv("PERSEUS_SIM_COUNTER_PERIOD_S", "0")
    monkeypatch.setenv("PERSEUS_SIM_SWITCH_LATENCY_S", "0.01")
    r = get_gpus()[0].realism
    assert r == replace(
        NVIDIA_INSTANT_POWER, counter_period_s=0.0, switch_latency_s=0.01, switch_latency_low_extra_s=0.0
    )
    monkeypatch.setenv("PERSEUS_SIM_MODE", "ideal")
    monkeypatch.setenv("PERSEUS_SIM_COUNTER_PERIOD_S", "0.1")
    assert get_gpus()[0].realism == replace(IDEAL, counter_period_s=0.1, switch_latency_s=0.01)
    for bad in ("-1", "fast", "nan", "100"):
        monkeypatch.setenv("PERSEUS_SIM_SWITCH_LATENCY_S", bad)
        with pytest.raises(ConfigError, match="PERSEUS_SIM_SWITCH_LATENCY_S.*between 0 and 60"):
            get_gpus()
    monkeypatch.delenv("PERSEUS_SIM_SWITCH_LATENCY_S")
    monkeypatch.setenv("PERSEUS_SIM_MODE", "exact")
    with pytest.raises(ConfigError, match="PERSEUS_SIM_MODE"):
        get_gpus()


def test_bad_parameters_say_what_is_wrong():
    with pytest.raises(ConfigError, match="counter_period_s"):
        SimRealism(counter_period_s=-0.1)
    with pytest.raises(ConfigError, match="power_coverage"):
        SimRealism(power_update_s=0.1, power_coverage=0.0)
    with pytest.raises(ConfigError, match="power_update_s"):
        SimRealism(power_coverage=0.5)


def test_a_gpu_opened_while_another_process_keeps_it_busy_reads_its_power_at_once():
    """Power readings look back over work issued before this SimGPU existed; its energy counter
    does not count it."""
    clock = VirtualClock()
    realism = SimRealism(power_update_s=0.1, power_window_s=1.0)
    busy = SimGPU("h100-sxm", clock=clock, realism=realism)
    busy.execute(Work(10.0), blocking=False)
    clock.advance(3.05)
    late = SimGPU("h100-sxm", clock=clock, realism=realism)
    assert late.power_mw() / 1000 == pytest.approx(busy_power_w(PRESETS["h100-sxm"], Work(10.0), 1980))
    assert late.energy_mj() == 0.0
    clock.advance(1.0)
    assert late.energy_mj() / 1000 == pytest.approx(busy_power_w(PRESETS["h100-sxm"], Work(10.0), 1980) * 1.0)
