"""The online profile against the simulator's ground truth, on a GPU whose energy counter steps
every 100 ms and whose clock changes take 10 ms to come into force, and on an ideal one.

One rank of a 4-stage 1F1B pipeline (8 microbatches) runs through `PerseusRank`, warm-up then
the service's sweep (every 5th clock, three steps per clock, stopping early), on a virtual
clock: every profiled point of its stage must be within 3% of `sim_work.predict` in time and
in energy, for instructions of 5 to 60 ms, on the first stage (warm-up forwards, cool-down
backwards) and the last (forward and backward strictly alternating)."""

from __future__ import annotations

import pytest
from stage_run import profile_stage

from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import IDEAL, SimRealism
from perseus.devices.sim_work import Work, predict

PRESET = PRESETS["a100-sxm"]
STEPPING = SimRealism(counter_period_s=0.1, switch_latency_s=0.01)
TOLERANCE = 0.03
SHORT = {"forward": Work(0.005, alpha=0.8, intensity=0.92), "backward": Work(0.010, alpha=0.75, intensity=0.91)}
LONG = {"forward": Work(0.030, alpha=0.8, intensity=0.92), "backward": Work(0.060, alpha=0.75, intensity=0.91)}


def worst_errors(profile, works, stage):
    """The largest relative error of any profiled point in time and in energy."""
    time_err = energy_err = 0.0
    for (s, kind), points in profile.points.items():
        assert s == stage
        for p in points:
            t, e = predict(PRESET, works[kind], p.frequency)
            time_err = max(time_err, abs(p.time / t - 1))
            energy_err = max(energy_err, abs(p.energy / e - 1))
    return time_err, energy_err


def check(profile, works, stage, tolerance=TOLERANCE):
    time_err, energy_err = worst_errors(profile, works, stage)
    assert time_err < tolerance and energy_err < tolerance, (time_err, energy_err)
    freqs = [p.frequency for p in profile.points[(stage, "forward")]]
    assert len(freqs) >= 6 and freqs[0] == PRESET.max_mhz  # highest first, down past the energy minimum
    assert [p.frequency for p in profile.points[(stage, "backward")]] == freqs
    assert profile.blocking_power_w == pytest.approx(PRESET.idle_w, rel=TOLERANCE)
    return time_err, energy_err


@pytest.mark.parametrize("stage", [0, 3])
def test_stepping_counter_and_switch_latency_short_instructions(tmp_path, stage):
    profile, gpu, _ = profile_stage(SHORT, STEPPING, str(tmp_path), stage=stage)
    check(profile, SHORT, stage)
    assert profile.meta["counter_update_s"] == "0.1"  # the sampler found the counter's grid
    assert profile.switch_latency_s() == 0.01  # for the planner (see test_switch_latency_plan)
    freqs = {p.frequency for p in profile.points[(stage, "forward")]}
    assert profile.switch_latencies_s() == dict.fromkeys(freqs, 0.01)  # per target, for the plan's replay
    gpu.clock.sleep(1.0)  # the reset's switch latency
    assert gpu.at_defaults()  # reset when the rank closed


@pytest.mark.parametrize("stage", [0, 3])
def test_stepping_counter_and_switch_latency_long_instructions(tmp_path, stage):
    profile, _, _ = profile_stage(LONG, STEPPING, str(tmp_path), stage=stage)
    check(profile, LONG, stage)


@pytest.mark.parametrize("works", [SHORT, LONG], ids=["short", "long"])
def test_ideal_gpu(tmp_path, works):
    profile, _, _ = profile_stage(works, IDEAL, str(tmp_path), stage=3)
    time_err, energy_err = check(profile, works, 3)
    assert time_err < 1e-9 and energy_err < 1e-3  # exact windows: only the fit's rounding


def test_the_presets_realistic_behaviour(tmp_path):
    """The A100 preset's whole realistic set: 10-30 ms switches depending on the target, noisy
    and partly sampled power readings (unused: the counter is what counts)."""
    profile, _, records = profile_stage(SHORT, PRESET.realism, str(tmp_path), stage=0, sweep_step=3)
    check(profile, SHORT, 0)
    steps = [r.sweep_step for r in records if r.sweep_step is not None]
    main = len(set(steps))  # the main sweep runs each step once, in order; repeats come after it
    assert steps[:main] == list(range(main)) and set(steps[main:]) <= set(steps[:main])
    assert [r.phase for r in records[:2]] == ["warmup", "profiling"] and records[-1].phase == "profiling"


def test_the_confidence_is_reported_per_point(tmp_path):
    profile, _, _ = profile_stage(SHORT, STEPPING, str(tmp_path), stage=3)
    for kind in ("forward", "backward"):
        errors = dict(item.split(":") for item in profile.meta[f"rel_error:3:{kind}"].split(","))
        assert [int(f) for f in errors] == [p.frequency for p in profile.points[(3, kind)]]
        assert all(0 < float(e) < 0.01 for e in errors.values())
    assert float(profile.meta["blocking_rel_error"]) < 0.01
    assert int(profile.meta["windows"]) > 50
