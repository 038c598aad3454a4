"""GlobalPowerLimitOptimizer on simulated A100s driven by a VirtualClock (instant, exact)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError, ProfileError
from perseus.measurement import Monitor
from perseus.measurement.carbon import IntensityPoint, IntensityTimeSeries, StaticIntensity
from perseus.power_limit import (
    CarbonCost,
    GlobalPowerLimitOptimizer,
    MaxSlowdownConstraint,
    Phase,
    PowerLimitMeasurement,
    SelectionContext,
    Time,
    sweep_power_limits,
)

PRESET = "a100-sxm"
WORK = Work(0.1, alpha=0.3)  # memory-bound-ish: time barely moves between 300 and 250 W
A100_SWEEP_W = [400, 375, 350, 325, 300, 275, 250, 225, 200, 175, 150, 125, 100]


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    path = tmp_path / "sim"
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(path))
    return path


def make(num_gpus=2, **kwargs):
    clock = VirtualClock()
    gpus = sim_gpus(PRESET, num_gpus, clock)
    kwargs.setdefault("warmup_steps", 2)
    kwargs.setdefault("profile_steps", 5)
    kwargs.setdefault("watchdog", False)  # a process per optimizer; the SIGKILL test below covers it
    optimizer = GlobalPowerLimitOptimizer(Monitor(gpus=gpus, cpus=[]), **kwargs)
    return optimizer, gpus, clock


def train(optimizer, gpus, epochs, steps, work=WORK, limits=None):
    """Run epochs of steps, each step one `work` on every GPU; `limits` records the limit of each step."""
    for _ in range(epochs):
        optimizer.on_epoch_begin()
        for _ in range(steps):
            optimizer.on_step_begin()
            if limits is not None:
                limits.append(gpus[0].power_limit_mw() // 1000)
            for gpu in gpus:
                gpu.execute(work, blocking=False)
            for gpu in gpus:
                gpu.synchronize()
            optimizer.on_step_end()
        optimizer.on_epoch_end()


def predicted_sweep(num_gpus=2, work=WORK):
    rows = []
    for watts in A100_SWEEP_W:
        t, e = predict(PRESET, work, 1410, watts)
        rows.append(PowerLimitMeasurement(watts * 1000, t, e * num_gpus))
    return rows


def test_sweep_limits_go_from_max_down_to_min():
    assert sweep_power_limits(100_000, 400_000, 25) == [w * 1000 for w in A100_SWEEP_W]
    assert sweep_power_limits(100_000, 400_000, 70) == [400_000, 330_000, 260_000, 190_000, 120_000, 100_000]


def test_measures_every_limit_and_applies_the_choice_to_every_gpu():
    optimizer, gpus, _ = make(selector=MaxSlowdownConstraint(1.1), early_stop=False)
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000]
    limits = []
    train(optimizer, gpus, epochs=1, steps=len(A100_SWEEP_W) * 7 + 10, limits=limits)
    assert optimizer.phase is Phase.DONE

    expected = predicted_sweep()
    assert [m.power_limit_mw for m in optimizer.measurements] == [m.power_limit_mw for m in expected]
    for got, want in zip(optimizer.measurements, expected):
        assert got.time_s == pytest.approx(want.time_s, rel=1e-9)
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-9)
    # Hand check on the model: 250 W is 1.066x slower, 225 W 1.093x, 200 W 1.138x -> 225 W.
    assert optimizer.selected_mw == 225_000
    assert [g.power_limit_mw() for g in gpus] == [225_000, 225_000]
    # 2 warm-up + 5 measured steps at each limit, highest first, then the choice.
    assert limits == [w for w in A100_SWEEP_W for _ in range(7)] + [225] * 10

    optimizer.close()
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000]
    assert optimizer.phase is Phase.CLOSED


def test_an_epoch_ending_mid_measurement_retries_that_limit():
    optimizer, gpus, _ = make(selector=Time())
    limits = []
    train(optimizer, gpus, epochs=14, steps=10, limits=limits)  # one limit done per epoch
    assert optimizer.phase is Phase.DONE
    # 400 W: steps 0-6; 375 W: 2 warm-up + 1 measured, cut by the epoch end, then 7 more.
    assert limits[:20] == [400] * 7 + [375] * 3 + [375] * 7 + [350] * 3
    for got, want in zip(optimizer.measurements, predicted_sweep()):
        assert got.energy_j == pytest.approx(want.energy_j, rel=1e-9)
    assert optimizer.selected_mw == 400_000
    optimizer.close()


def test_too_short_epochs_warn(caplog):
    optimizer, gpus, _ = make(warmup_steps=4, profile_steps=4)
    train(optimizer, gpus, epochs=2, steps=5)
    assert "fewer than warmup_steps + profile_steps" in caplog.text
    optimizer.close()


def test_bad_arguments():
    with pytest.raises(ConfigError, match="profile_steps"):
        make(profile_steps=0)
    with pytest.raises(ConfigError, match="warmup_steps"):
        make(warmup_steps=-1)
    with pytest.raises(ConfigError, match="pl_step_w"):
        make(pl_step_w=0)
    with pytest.raises(ConfigError, match="PowerLimitSelector"):
        make(selector="time")


def test_profile_file_is_written_and_reused(tmp_path):
    path = tmp_path / "profiles" / "pl.json"
    optimizer, gpus, _ = make(selector=MaxSlowdownConstraint(1.1), profile_path=path, early_stop=False)
    train(optimizer, gpus, epochs=1, steps=len(A100_SWEEP_W) * 7)
    optimizer.close()
    data = json.loads(path.read_text())
    assert data["num_gpus"] == 2 and len(data["measurements"]) == len(A100_SWEEP_W)
    assert os.listdir(path.parent) == ["pl.json"]  # no temp file left

    again, gpus, _ = make(selector=MaxSlowdownConstraint(1.1), profile_path=path)
    assert again.phase is Phase.DONE
    assert [g.power_limit_mw() for g in gpus] == [225_000, 225_000]  # at once, before any step
    assert again.measurements == optimizer.measurements
    other, _, _ = make(selector=Time(), profile_path=path)  # same sweep, another choice
    assert other.selected_mw == 400_000
    again.close()
    other.close()


def test_a_profile_of_other_gpus_or_another_sweep_is_refused(tmp_path):
    path = tmp_path / "pl.json"
    optimizer, gpus, _ = make(selector=MaxSlowdownConstraint(1.1), profile_path=path, early_stop=False)
    train(optimizer, gpus, epochs=1, steps=len(A100_SWEEP_W) * 7)
    optimizer.close()
    with pytest.raises(ProfileError, match=r"recorded on 2 x .*A100.*this job runs 1 x") as info:
        make(num_gpus=1, profile_path=path)
    assert "delete it to profile again (or give each setup a profile_path of its own)" in str(info.value)
    with pytest.raises(ProfileError, match=r"measured 375, 325, .* W, not on this sweep's limits .* another pl_step_w"):
        make(profile_path=path, pl_step_w=50)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "gpu_name": "NVIDIA A40 (simulated)"}))
    with pytest.raises(
        ProfileError, match=r"recorded on 2 x 'NVIDIA A40 \(simulated\)', this job runs 2 x 'NVIDIA A100"
    ):
        make(profile_path=path)


def test_a_profile_path_that_cannot_be_written_is_refused_at_once(tmp_path, sim_dir):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"afile is a file, not a folder; pass a profile_path in a folder"):
        make(profile_path=tmp_path / "afile" / "deeper" / "pl.json")
    assert not os.path.exists(sim_dir) or not os.listdir(sim_dir)  # nothing left changed


def test_a_profile_that_cannot_be_saved_loses_the_file_not_the_choice(tmp_path, caplog):
    folder = tmp_path / "profiles"
    optimizer, gpus, _ = make(selector=MaxSlowdownConstraint(1.1), profile_path=folder / "pl.json")
    folder.write_text("")  # the folder became a file (a full or read-only disk alike) before profiling ends
    train(optimizer, gpus, epochs=1, steps=len(A100_SWEEP_W) * 7)
    assert optimizer.phase is Phase.DONE and gpus[0].power_limit_mw() == optimizer.selected_mw == 225_000
    assert "could not save the power-limit profile" in caplog.text and "the next run profiles again" in caplog.text
    optimizer.close()
    assert gpus[0].power_limit_mw() == 400_000


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "something"}', "not a Perseus power-limit profile"),
        ('{"format": "perseus.power_limit_profile", "version": 9}', "version 9"),
        (
            '{"format": "perseus.power_limit_profile", "version": 1, "num_gpus": 2, "measurements": []}',
            "non-empty list",
        ),
        (
            '{"format": "perseus.power_limit_profile", "version": 1, "num_gpus": 2, "measurements": '
            '[{"power_limit_mw": 400000, "time_s": 0.1, "energy_j": 5}, '
            '{"power_limit_mw": 300000, "time_s": -1, "energy_j": 5}]}',
            r"measurements\[1\].time_s must be a positive number",
        ),
        (
            '{"format": "perseus.power_limit_profile", "version": 1, "num_gpus": 2, "measurements": '
            '[{"power_limit_mw": 700000, "time_s": 0.1, "energy_j": 5}]}',
            "outside these GPUs' power-limit range",
        ),
    ],
)
def test_a_malformed_profile_file_is_a_clear_error(tmp_path, sim_dir, content, message):
    path = tmp_path / "pl.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message) as info:
        make(profile_path=path)
    assert "delete it to profile again" in str(info.value)
    assert not os.path.exists(sim_dir) or not os.listdir(sim_dir)  # nothing left changed


def test_context_manager_restores_the_default_on_an_exception():
    optimizer, gpus, _ = make()
    with pytest.raises(RuntimeError):
        with optimizer:
            train(optimizer, gpus, epochs=1, steps=9)
            assert gpus[0].power_limit_mw() == 375_000
            raise RuntimeError("training crashed")
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000]


def test_carbon_cost_follows_the_grid_from_clean_to_dirty_and_back():
    """Clean (50 g/kWh) for 30 simulated seconds, dirty (900) for 30, clean again. Each epoch is
    20 steps of about 0.1 s (2 s); the choice is made again at every epoch begin."""
    clock = VirtualClock()
    gpus = sim_gpus(PRESET, 2, clock)
    t0 = datetime(2024, 5, 1, tzinfo=timezone.utc)
    series = IntensityTimeSeries(
        [
            IntensityPoint(t0, 50),
            IntensityPoint(t0 + timedelta(seconds=30), 900),
            IntensityPoint(t0 + timedelta(seconds=60), 50),
        ],
        clock=clock,
    )
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=gpus, cpus=[]), CarbonCost(0.5, series), warmup_steps=0, profile_steps=5, watchdog=False
    )
    chosen = []  # (clock at epoch begin, limit during the epoch)
    for _ in range(40):
        start = clock.now()
        train(optimizer, gpus, epochs=1, steps=20)
        if optimizer.phase is Phase.DONE:
            chosen.append((start, gpus[0].power_limit_mw() // 1000))
    optimizer.close()

    context = SelectionContext(optimizer.max_power_limit_mw, optimizer.num_gpus, 20)
    clean = CarbonCost(0.5, StaticIntensity(50)).select(optimizer.measurements, context) // 1000
    dirty = CarbonCost(0.5, StaticIntensity(900)).select(optimizer.measurements, context) // 1000
    assert clean > dirty  # a dirty grid warrants a lower limit on this workload
    # Epochs begin every ~2 s; one wholly inside a phase sees that phase's intensity.
    assert chosen[0][0] < 30
    for start, limit in chosen:
        if start + 2.5 < 30 or 60 <= start:
            assert limit == clean, (start, limit)
        elif 30 <= start and start + 2.5 < 60:
            assert limit == dirty, (start, limit)
    assert {limit for start, limit in chosen if start > 60} == {clean}


# Restoring the default from a separate process: exit, uncaught exception, SIGTERM, SIGKILL.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from perseus.clock import VirtualClock
    from perseus.devices.sim import sim_gpus
    from perseus.measurement import Monitor
    from perseus.power_limit import GlobalPowerLimitOptimizer, Time

    mode = sys.argv[1]
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[2], "w").write("user handler"), sys.exit(3)))
    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    opt = GlobalPowerLimitOptimizer(
        Monitor(gpus=gpus, cpus=[]), Time(), warmup_steps=0, profile_steps=1, watchdog=mode == "sigkill"
    )
    opt.on_epoch_begin(); opt.on_step_begin(); opt.on_step_end()  # now at 375 W
    assert gpus[1].power_limit_mw() == 375_000
    print("ready", flush=True)
    if mode == "exception":
        raise RuntimeError("crash in training")
    if mode in ("sigterm", "sigkill"):
        time.sleep(60)
    """
)


def run_child(mode, *args):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("mode", ["exit", "exception"])
def test_default_restored_when_the_process_ends(mode):
    child = run_child(mode)
    out, err = child.communicate(timeout=60)
    assert "ready" in out, err
    assert child.returncode == (0 if mode == "exit" else 1)
    assert [g.power_limit_mw() for g in sim_gpus(PRESET, 2)] == [400_000, 400_000]


def test_default_restored_on_sigterm_and_the_user_handler_still_runs(tmp_path):
    marker = tmp_path / "marker"
    child = run_child("sigterm", str(marker))
    assert child.stdout.readline().strip() == "ready"
    assert sim_gpus(PRESET, 2)[0].power_limit_mw() == 375_000
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=60)
    assert child.returncode == 3  # the user's handler ran after the reset
    assert marker.read_text() == "user handler"
    assert [g.power_limit_mw() for g in sim_gpus(PRESET, 2)] == [400_000, 400_000]


def test_watchdog_restores_the_default_after_sigkill():
    """Nothing in the killed process runs: the watchdog process restores both GPUs' limits."""
    child = run_child("sigkill")
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    gpus = sim_gpus(PRESET, 2)
    assert [g.power_limit_mw() for g in gpus] == [375_000, 375_000]
    child.kill()
    child.communicate(timeout=10)
    deadline = time.monotonic() + 30.0  # ends once reset; the watchdog reacts at once, a loaded machine slowly
    while any(g.power_limit_mw() != 400_000 for g in gpus) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000]


def test_measurements_shorter_than_ten_counter_steps_are_lengthened(monkeypatch, capsys):
    """On GPUs whose energy counter steps every 100 ms, 3 steps of 50 ms read the counter's steps:
    energy per step off by tens of percent. The optimizer measures more steps, until a limit's
    measurement spans 20 counter steps (2 s), and then reads each limit within 5% (one counter
    step at each end of the window at most) and chooses as on exact counters."""
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    work = Work(0.05, alpha=0.3)
    steps = len(A100_SWEEP_W) * 60
    short, gpus, _ = make(num_gpus=1, profile_steps=3, early_stop=False)
    short.min_measure_s = 0.0  # as before: three steps, whatever the counter
    train(short, gpus, epochs=1, steps=steps, work=work)
    short.close()
    truth = predicted_sweep(num_gpus=1, work=work)
    errors = [abs(got.energy_j / want.energy_j - 1) for got, want in zip(short.measurements, truth)]
    assert max(errors) > 0.1

    optimizer, gpus, _ = make(num_gpus=1, profile_steps=3, early_stop=False, selector=MaxSlowdownConstraint(1.1))
    assert optimizer.min_measure_s == pytest.approx(2.0)
    train(optimizer, gpus, epochs=1, steps=steps, work=work)
    assert optimizer.phase is Phase.DONE and optimizer.measure_steps >= 40
    assert "profile_steps=3 take 0.15 s" in capsys.readouterr().err
    for got, want in zip(optimizer.measurements, truth):
        assert got.energy_j == pytest.approx(want.energy_j, rel=0.05)
        assert got.time_s == pytest.approx(want.time_s, rel=0.01)
    assert optimizer.selected_mw == 225_000  # as on exact counters (see the full sweep above)
    optimizer.close()


def test_a_lengthened_measurement_fits_the_epochs(monkeypatch, caplog):
    """Epochs of 20 steps leave room for 18 measured steps after 2 of warm-up: a measurement
    lengthened to span 2 s of 50 ms steps (45) would be cut at every epoch's end and the sweep
    never end. It measures 18 per limit instead, says so, and chooses."""
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    optimizer, gpus, _ = make(num_gpus=1, profile_steps=3, early_stop=False, selector=MaxSlowdownConstraint(1.1))
    train(optimizer, gpus, epochs=40, steps=20, work=Work(0.05, alpha=0.3))
    assert optimizer.phase is Phase.DONE and optimizer.measure_steps == 18
    assert "epochs of 20 steps leave room for 18 measured steps per limit" in caplog.text
    assert len(optimizer.measurements) == len(A100_SWEEP_W)
    optimizer.close()
