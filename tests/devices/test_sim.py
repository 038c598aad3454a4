"""Simulated GPU: model, calibration, energy counter, persistence across processes."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU, sim_gpus
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, busy_power_w, effective_frequency, predict
from perseus.exceptions import ConfigError, DeviceError

DATA = Path(__file__).resolve().parents[3] / "shared/data/perseus-sosp24/stage_profiles"


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    return tmp_path


def test_presets_have_real_frequency_lists():
    expected = {"a100-sxm": (1410, 210), "a100-pcie": (1410, 210), "h100-sxm": (1980, 345), "a40": (1740, 210)}
    for name, (top, bottom) in expected.items():
        freqs = SimGPU(name).supported_frequencies()
        assert freqs[0] == top and freqs[-1] == bottom
        assert all(a - b == 15 for a, b in zip(freqs, freqs[1:]))
    assert PRESETS["a100-sxm"].idle_w == 83.64 and PRESETS["a40"].idle_w == 70.38
    for p in PRESETS.values():
        assert 0 < p.floor_w < p.floor_w + p.dynamic_w <= p.tdp_w


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="a100-sxm.*a100-pcie.*h100-sxm.*a40"):
        sim_gpus("v100")


def test_time_follows_the_alpha_model():
    t, _ = predict("a100-sxm", Work(2.0, alpha=0.5), 705)
    assert t == pytest.approx(2.0 * (0.5 * 1410 / 705 + 0.5))
    t_max, e_max = predict("a100-sxm", Work(2.0, alpha=0.5), 1410)
    assert t_max == pytest.approx(2.0)
    assert e_max == pytest.approx(2.0 * busy_power_w(PRESETS["a100-sxm"], Work(2.0), 1410))


def test_power_limit_lowers_the_effective_clock():
    preset = PRESETS["a100-sxm"]
    heavy = Work(1.0, alpha=1.0, intensity=1.3)
    assert busy_power_w(preset, heavy, 1410) > 400
    t_capped, e_capped = predict(preset, heavy, 1410, power_limit_w=250)
    assert e_capped / t_capped == pytest.approx(250)
    f_eff = effective_frequency(preset, heavy, 1410, 250)
    assert busy_power_w(preset, heavy, f_eff) == pytest.approx(250)
    assert t_capped == pytest.approx(1410 / f_eff)
    # Where even the lowest clock draws more than the limit, the clock bottoms out there.
    assert busy_power_w(preset, heavy, 210) > 100
    t_min, _ = predict(preset, heavy, 1410, power_limit_w=100)
    assert t_min == pytest.approx(1410 / 210)
    # Under the limit nothing changes.
    assert predict(preset, Work(1.0), 1080, 400) == predict(preset, Work(1.0), 1080)


def test_clocks_fall_gradually_with_the_power_cap():
    """Down to the lowest clocks: 150 W and 100 W are different clocks, each above the minimum
    for default work, and every 10 W less is a lower clock (no floor at 40% of TDP)."""
    preset = PRESETS["a100-sxm"]
    work = Work(0.3)
    clocks = [effective_frequency(preset, work, 1410, limit) for limit in range(400, 99, -10)]
    assert all(a >= b for a, b in zip(clocks, clocks[1:]))
    assert len(set(clocks)) == len(clocks) - clocks.count(1410) + 1
    f150, f100 = effective_frequency(preset, work, 1410, 150), effective_frequency(preset, work, 1410, 100)
    assert 210 < f100 < f150 < 900
    assert (
        predict(preset, work, 1410, 100)[0] > predict(preset, work, 1410, 150)[0] > predict(preset, work, 1410, 200)[0]
    )
    # Below the voltage knee busy power is linear in the clock: the low end is a straight line.
    p = [busy_power_w(preset, work, f) for f in (300, 500, 700)]
    assert p[1] - p[0] == pytest.approx(p[2] - p[1])


@pytest.mark.skipif(not DATA.exists(), reason="shared Perseus data absent")
def test_power_curve_follows_the_measured_profiles_down_to_their_lowest_clock():
    """Busy power relative to the highest clock's, against every measured A100-SXM stage (GPT-3 and
    Bloom) at every measured clock from 855 MHz up: within 7% of the measured ratio everywhere."""
    preset = PRESETS["a100-sxm"]
    top = busy_power_w(preset, Work(1.0), 1410)
    lowest = 10_000
    for name in ("gpt3-175b+a100_sxm_bf16.csv", "bloom+a100_sxm_bf16.csv"):
        rows = defaultdict(dict)
        with open(DATA / name) as f:
            for row in csv.DictReader(f):
                rows[(row["stage"], row["instruction"])][int(row["frequency"])] = float(row["energy"]) / float(
                    row["time"]
                )
        for powers in rows.values():
            for freq, watts in powers.items():
                lowest = min(lowest, freq)
                measured = watts / powers[1410]
                assert busy_power_w(preset, Work(1.0), freq) / top == pytest.approx(measured, abs=0.07), (name, freq)
    assert lowest == 855


@pytest.mark.skipif(not DATA.exists(), reason="shared Perseus data absent")
def test_calibration_against_measured_gpt3_profiles():
    """Default Work at 1080 vs 1410 MHz on A100-SXM matches every measured GPT-3 175B stage."""
    measured = defaultdict(dict)
    with open(DATA / "gpt3-175b+a100_sxm_bf16.csv") as f:
        for row in csv.DictReader(f):
            measured[(row["stage"], row["instruction"])][int(row["frequency"])] = (
                float(row["time"]),
                float(row["energy"]),
            )
    t_hi, e_hi = predict("a100-sxm", Work(1.0), 1410)
    t_lo, e_lo = predict("a100-sxm", Work(1.0), 1080)
    time_ratio, energy_ratio = t_lo / t_hi, e_lo / e_hi
    assert time_ratio == pytest.approx(1.24, abs=0.01)
    assert energy_ratio == pytest.approx(0.74, abs=0.01)
    assert len(measured) == 16
    for key, points in measured.items():
        (t1, e1), (t0, e0) = points[1080], points[1410]
        assert abs(time_ratio - t1 / t0) < 0.025, key
        assert abs(energy_ratio - e1 / e0) < 0.02, key


def test_energy_counter_matches_the_analytic_value():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock)
    work = Work(0.3, alpha=0.6)
    expected_j = 0.0
    for freq in (1410, 1200, 990, 750):
        gpu.lock_sm_clock(freq)
        t, e = predict("a100-sxm", work, freq)
        assert gpu.execute(work) == pytest.approx(t)
        clock.sleep(0.2)  # idle gap
        expected_j += e + 0.2 * 83.64
    assert gpu.energy_mj() / 1000 == pytest.approx(expected_j, rel=0.01)
    assert gpu.energy_mj() / 1000 == pytest.approx(expected_j, rel=1e-9)


def test_counter_only_increases_and_power_reflects_work():
    clock = VirtualClock()
    gpu = SimGPU("a40", clock=clock)
    assert gpu.power_mw() == pytest.approx(70380)
    gpu.execute(Work(1.0), blocking=False)
    gpu.execute(Work(1.0), blocking=False)  # queues behind the first
    last = gpu.energy_mj()
    busy_w = busy_power_w(PRESETS["a40"], Work(1.0), 1740)
    for _ in range(30):
        clock.advance(0.1)
        now = gpu.energy_mj()
        assert now > last
        last = now
        if clock.now() < 2.0:
            assert gpu.power_mw() == pytest.approx(busy_w * 1000)
    assert gpu.power_mw() == pytest.approx(70380)
    assert last / 1000 == pytest.approx(2 * busy_w + 1.0 * 70.38)


def test_non_blocking_work_queues_and_synchronize_waits():
    clock = VirtualClock()
    gpu = SimGPU("h100-sxm", clock=clock)
    d1 = gpu.execute(Work(0.5), blocking=False)
    d2 = gpu.execute(Work(0.25), blocking=False)
    assert clock.now() == 0.0
    gpu.synchronize()
    assert clock.now() == pytest.approx(d1 + d2)
    gpu.synchronize()
    assert clock.now() == pytest.approx(d1 + d2)


def test_slowdown_stretches_time_at_the_same_power_and_persists():
    clock = VirtualClock()
    gpu, other = SimGPU("a100-sxm", 1, clock=clock), SimGPU("a100-sxm", 1, clock=clock)
    t, e = gpu.predict(Work(1.0))
    gpu.set_slowdown(1.2)
    assert other.slowdown() == 1.2
    t_slow, e_slow = other.predict(Work(1.0))
    assert t_slow == pytest.approx(1.2 * t) and e_slow == pytest.approx(1.2 * e)
    assert other.execute(Work(1.0)) == pytest.approx(1.2 * t)
    with pytest.raises(ConfigError, match="slowdown"):
        gpu.set_slowdown(0.5)
    gpu.reset_slowdown()
    assert other.slowdown() == 1.0


def test_bad_clock_and_power_limit_say_what_is_allowed():
    gpu = SimGPU("a100-sxm")
    with pytest.raises(ConfigError, match="1000 MHz.*nearest supported: 990 MHz or 1005 MHz"):
        gpu.lock_sm_clock(1000)
    with pytest.raises(ConfigError, match="nearest supported: 1410 MHz"):
        gpu.lock_sm_clock(1500)
    with pytest.raises(ConfigError, match="between 100 and 400 W"):
        gpu.set_power_limit_mw(450_000)
    assert gpu.sm_clock() == 1410 and gpu.power_limit_mw() == 400_000


def test_settings_persist_across_objects_and_reset_removes_the_file(sim_dir):
    a, b = sim_gpus("a100-sxm", 2)
    a.lock_sm_clock(1200)
    b.set_power_limit_mw(300_000)
    again = sim_gpus("a100-sxm", 2)
    assert again[0].sm_clock() == 1200 and again[0].power_limit_mw() == 400_000
    assert again[1].sm_clock() == 1410 and again[1].power_limit_mw() == 300_000
    assert sorted(p.name for p in sim_dir.glob("*.json")) == ["a100-sxm-0.json", "a100-sxm-1.json"]
    # Back-to-back changes are all seen by a reader with a warm cache.
    for f in (1395, 1380, 1365, 1350):
        a.lock_sm_clock(f)
        assert again[0].sm_clock() == f
    again[0].reset_sm_clock()
    again[1].reset_power_limit()
    assert a.sm_clock() == 1410 and b.power_limit_mw() == 400_000
    assert list(sim_dir.glob("*.json")) == []


def test_a_lock_left_by_a_killed_process_is_seen_and_reset(sim_dir):
    code = (
        "import os; from perseus.devices.sim import sim_gpus; "
        "sim_gpus('a100-sxm', 4)[3].lock_sm_clock(810); os._exit(9)"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 9
    gpu = sim_gpus("a100-sxm", 4)[3]
    assert gpu.sm_clock() == 810
    gpu.reset_sm_clock()
    assert gpu.sm_clock() == 1410 and not (sim_dir / "a100-sxm-3.json").exists()


def test_corrupt_state_file_names_the_fix(sim_dir):
    (sim_dir / "a40-0.json").write_text("{not json")
    with pytest.raises(Exception, match="perseus reset"):
        SimGPU("a40").sm_clock()


def test_reset_replaces_a_corrupt_state_file_and_a_change_refuses_it(sim_dir):
    """The error above tells the user to run `perseus reset`: that must then work."""
    path = sim_dir / "a40-0.json"
    path.write_text("{not json")
    gpu = SimGPU("a40")
    with pytest.raises(DeviceError, match="perseus reset"):
        gpu.lock_sm_clock(1005)  # a change would keep settings it cannot read
    gpu.reset_sm_clock()
    assert not path.exists()
    assert gpu.sm_clock() == 1740 and gpu.power_limit_mw() == 300_000 and gpu.slowdown() == 1.0
    path.write_text("{not json")
    gpu.reset_power_limit()
    assert not path.exists()


def test_work_validation():
    for bad in (dict(time_s=-1.0), dict(time_s=1.0, alpha=1.5), dict(time_s=math.nan)):
        with pytest.raises(ConfigError):
            Work(**bad)
