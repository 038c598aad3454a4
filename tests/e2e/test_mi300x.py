"""Everything above the device layer on simulated AMD Instinct MI300X GPUs (PERSEUS_GPU=sim:mi300x):
`perseus info`, `perseus monitor`, the power-limit optimizer and (slow) `perseus demo`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from perseus.cli.main import main
from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, predict
from perseus.measurement import Monitor
from perseus.power_limit import GlobalPowerLimitOptimizer, MaxSlowdownConstraint, Phase

MI300X = PRESETS["mi300x"]
CLOCKS = list(range(2100, 500, -20))  # what the amdsmi backend offers on a real MI300X
STALL_S = 0.1  # as in tests/cli/test_cli.py: what a loaded machine may add between two reads


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    monkeypatch.setenv("PERSEUS_GPU", "sim:mi300x:4")
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return dict(os.environ)


def perseus(env, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_presets_hold_amds_figures():
    assert MI300X.product == "AMD Instinct MI300X"
    assert list(MI300X.frequencies) == CLOCKS and MI300X.step_mhz == 20
    assert (MI300X.tdp_w, MI300X.min_power_limit_w, MI300X.max_power_limit_w) == (750.0, 300.0, 750.0)
    gcd = PRESETS["mi250x"]
    assert list(gcd.frequencies) == list(range(1700, 500, -20))
    assert (gcd.tdp_w, gcd.max_power_limit_w) == (250.0, 250.0)  # half of a 500 W package


def test_info_on_mi300x(env, capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "sim"
    assert [g["index"] for g in report["gpus"]] == [0, 1, 2, 3]
    for gpu in report["gpus"]:
        assert gpu["name"] == "AMD Instinct MI300X (simulated)"
        assert gpu["frequencies_mhz"] == CLOCKS
        assert gpu["sm_clock_mhz"] == 2100
        assert gpu["power_w"] == MI300X.idle_w
        assert (gpu["power_limit_w"], gpu["power_limit_range_w"], gpu["default_power_limit_w"]) == (
            750,
            [300, 750],
            750,
        )
        assert gpu["energy_counter"] is True and gpu["can_change_clocks"] is True
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "GPU 3: AMD Instinct MI300X (simulated)" in text
    assert "SM frequencies   520-2100 MHz, 80 steps (now 2100 MHz)" in text
    assert "power limit      750 W (range 300-750 W, default 750 W)" in text
    assert main(["info", "--presets"]) == 0
    presets = capsys.readouterr().out
    assert "mi300x       AMD Instinct MI300X" in presets and "mi250x" in presets


def test_monitor_on_mi300x(env):
    """`perseus monitor --json -- sleep 1` on two simulated MI300X: their idle power over the command."""
    env = dict(env, PERSEUS_GPU="sim:mi300x:2")
    result = perseus(env, "monitor", "--json", "--", "sleep", "1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    time_s = report["time_s"]
    assert 1.0 <= time_s < 30.0 and report["gpu_indices"] == [0, 1]
    for energy in report["gpu_energy_j"]:
        assert energy >= MI300X.idle_w * 1.0
        assert energy == pytest.approx(MI300X.idle_w * time_s, abs=MI300X.idle_w * STALL_S)
    assert report["exit_code"] == 0


def test_power_limit_optimizer_on_mi300x(env):
    """The optimizer sweeps the MI300X's caps from 750 W down (to 300 W at most, stopping at the first
    more than 10% slower), picks the lowest within 10% of the fastest time, applies it to every GPU,
    and restores 750 W at close()."""
    clock = VirtualClock()
    gpus = sim_gpus("mi300x", 2, clock)
    work = Work(0.1, alpha=0.3)
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=gpus, cpus=[]), MaxSlowdownConstraint(1.1), warmup_steps=2, profile_steps=5, watchdog=False
    )
    sweep_w = list(range(750, 299, -25))
    assert [mw // 1000 for mw in optimizer.power_limits_mw] == sweep_w
    optimizer.on_epoch_begin()
    for _ in range(len(sweep_w) * 7 + 5):
        optimizer.on_step_begin()
        for gpu in gpus:
            gpu.execute(work, blocking=False)
        for gpu in gpus:
            gpu.synchronize()
        optimizer.on_step_end()
    optimizer.on_epoch_end()
    assert optimizer.phase is Phase.DONE
    for m in optimizer.measurements:
        t, e = predict("mi300x", work, 2100, m.power_limit_mw / 1000)
        assert m.time_s == pytest.approx(t, rel=1e-9) and m.energy_j == pytest.approx(2 * e, rel=1e-9)
    fastest = min(m.time_s for m in optimizer.measurements)
    allowed = [m for m in optimizer.measurements if m.time_s <= 1.1 * fastest]
    assert optimizer.selected_mw == min(m.power_limit_mw for m in allowed) == 425_000
    assert [m.power_limit_mw // 1000 for m in optimizer.measurements] == list(range(750, 374, -25))
    assert optimizer.skipped_mw == [350_000, 325_000, 300_000]  # 400 and 375 W were over 1.1x slower: stop
    assert [g.power_limit_mw() for g in gpus] == [optimizer.selected_mw] * 2
    optimizer.close()
    assert [g.power_limit_mw() for g in gpus] == [750_000, 750_000]


@pytest.mark.slow
def test_demo_on_mi300x(env):
    """`PERSEUS_GPU=sim:mi300x:2 perseus demo` (2 stages, scaled down): profiles, plans below 2100 MHz
    on the MI300X's clocks, saves energy, and leaves every GPU at its defaults."""
    env = dict(env, PERSEUS_GPU="sim:mi300x:2")
    args = ["--json", "--ranks", "2", "--microbatches", "4", "--iterations", "6", "--sweep-step", "8"]
    result = perseus(
        env, "demo", *args, "--time-scale", "0.15", timeout=600
    )  # calibration fits within 1% at this scale under load
    assert result.returncode == 0, result.stderr[-3000:]
    demo = json.loads(result.stdout)
    assert demo["gpu"] == "sim:mi300x" and demo["clocks_reset"] is True and demo["profiled"]
    plan = demo["plan_frequencies"]
    assert len(plan) == 2 and {f for row in plan for f in row} <= set(CLOCKS)
    assert min(min(row) for row in plan) < 2100
    assert 0 < demo["predicted_saving"] < 0.5
    # The GPU work's own energy (beyond idle power over the iteration) went down: total energy also
    # counts the idle time a loaded machine adds to every iteration.
    work = {p: demo[p]["energy_j"] - 2 * MI300X.idle_w * demo[p]["iteration_time_s"] for p in ("baseline", "planned")}
    assert work["planned"] < work["baseline"], work
