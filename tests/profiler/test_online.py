"""Online profiler: the sweep table, warm-up drops, medians, early stop, and GPU reads on a
simulated GPU driven by a virtual clock."""

from __future__ import annotations

import logging

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError, DeviceError
from perseus.profiler.online import OnlineProfiler, Sweep, SweepStep
from perseus.wire.phases import Phase

PRESET = PRESETS["a100-sxm"]
WORKS = {"forward": Work(0.010, alpha=0.8), "backward": Work(0.020, alpha=0.75, intensity=1.1)}
FREQS = list(PRESET.frequencies[::6])  # 1410, 1320, ..., 240: energy is lowest at 960 MHz


def feed(sweep: Sweep, iteration: int, microbatches: int = 4, noise=lambda it, mb: 1.0) -> bool:
    """One iteration of sim-predicted measurements; returns whether the sweep finished."""
    step = sweep.begin_iteration(iteration)
    if step.frequency is not None:
        for mb in range(microbatches):
            for kind, work in WORKS.items():
                t, e = predict(PRESET, work, step.frequency)
                sweep.record(kind, t * noise(iteration, mb), e * noise(iteration, mb))
            sweep.record_gap(0.004, 0.004 * PRESET.idle_w)
    return sweep.end_iteration()


def test_sweep_table():
    sweep = Sweep(0, [1410, 1200, 990], warmup_iterations=2, iterations_per_frequency=3)
    steps = [sweep.step_at(i) for i in range(13)]
    assert steps[:2] == [SweepStep(Phase.WARMUP, None, False)] * 2
    assert [(s.frequency, s.measured) for s in steps[2:11]] == [
        (1410, False),
        (1410, True),
        (1410, True),
        (1200, False),
        (1200, True),
        (1200, True),
        (990, False),
        (990, True),
        (990, True),
    ]
    assert steps[11].phase is steps[12].phase is Phase.PLANNING  # the sweep is over
    single = Sweep(0, [1410, 1200], warmup_iterations=0, iterations_per_frequency=1)
    assert single.step_at(0) == SweepStep(Phase.PROFILING, 1410, True, 0)  # nothing to drop with one


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="highest first"):
        Sweep(0, [990, 1410])
    with pytest.raises(ConfigError, match="at least one"):
        Sweep(0, [])
    with pytest.raises(ConfigError, match="iterations_per_frequency"):
        Sweep(0, [1410], iterations_per_frequency=0)


def test_warmup_and_first_iteration_per_frequency_are_dropped():
    sweep = Sweep(3, [1410, 1200], warmup_iterations=2, iterations_per_frequency=2)
    # Warm-up iterations and the first iteration at each clock are 50x off; none may show.
    dropped = {0, 1, 2, 4}
    it = 0
    while not feed(sweep, it, noise=lambda i, mb: 50.0 if i in dropped else 1.0):
        it += 1
    assert it == 5
    profile = sweep.profile()
    for kind, work in WORKS.items():
        points = profile.points[(3, kind)]
        assert [p.frequency for p in points] == [1410, 1200]
        for p in points:
            t, e = predict(PRESET, work, p.frequency)
            assert p.time == pytest.approx(t) and p.energy == pytest.approx(e)
    assert profile.blocking_power_w == pytest.approx(PRESET.idle_w)


def test_points_are_medians_robust_to_outliers():
    sweep = Sweep(0, [1410], warmup_iterations=0, iterations_per_frequency=1)
    feed(sweep, 0, microbatches=5, noise=lambda i, mb: 10.0 if mb == 2 else 1.0)
    point = sweep.profile().points[(0, "forward")][0]
    t, e = predict(PRESET, WORKS["forward"], 1410)
    assert point.time == pytest.approx(t) and point.energy == pytest.approx(e)


def test_early_stop_after_energy_rises_past_its_minimum():
    sweep = Sweep(0, FREQS, warmup_iterations=1, iterations_per_frequency=2, early_stop_rises=3)
    it = 0
    while not feed(sweep, it):
        it += 1
    # Energy is lowest at 960 MHz; 870, 780 and 690 are three rises in a row: stop there.
    assert sweep.profiled_frequencies == [1410, 1320, 1230, 1140, 1050, 960, 870, 780, 690]
    assert sweep.done and sweep.step_at(it + 1).phase is Phase.PLANNING
    energy = sweep.iteration_energy()
    assert min(energy, key=energy.get) == 960
    assert it == 1 + 2 * 9 - 1  # no iteration after the last profiled clock


def test_a_dip_resets_the_rise_count():
    sweep = Sweep(0, [1410, 1320, 1230, 1140], warmup_iterations=0, iterations_per_frequency=1, early_stop_rises=2)
    energies = {1410: 10.0, 1320: 11.0, 1230: 9.0, 1140: 9.5}
    for it, f in enumerate(sweep.frequencies):
        sweep.begin_iteration(it)
        sweep.record("forward", 1.0, energies[f])
        finished = sweep.end_iteration()
    assert finished and sweep.profiled_frequencies == [1410, 1320, 1230, 1140]


def test_service_frequency_must_match_the_table():
    sweep = Sweep(0, [1410, 1200], warmup_iterations=0, iterations_per_frequency=1)
    with pytest.raises(ConfigError, match="disagree"):
        sweep.begin_iteration(0, frequency=1200)


def test_online_profiler_reads_a_simulated_gpu(tmp_path):
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", 0, clock=clock, state_dir=str(tmp_path))
    profiler = OnlineProfiler(gpu, Sweep(1, [1410, 1005], warmup_iterations=1, iterations_per_frequency=2))
    it = 0
    while True:
        step = profiler.begin_iteration(it)
        if step.frequency is None:
            gpu.reset_sm_clock()
        else:
            gpu.lock_sm_clock(step.frequency)
        for _ in range(3):
            for kind, work in WORKS.items():
                profiler.before_instruction()
                gpu.execute(work, blocking=False)  # asynchronous, like a kernel launch
                profiler.after_instruction(kind)  # synchronises before reading the counter
                clock.advance(0.002)  # waiting on a peer
        if profiler.end_iteration():
            break
        it += 1
    gpu.reset_sm_clock()
    profile = profiler.profile()
    for kind, work in WORKS.items():
        for p in profile.points[(1, kind)]:
            t, e = predict(PRESET, work, p.frequency)
            assert p.time == pytest.approx(t) and p.energy == pytest.approx(e)
    assert [p.frequency for p in profile.points[(1, "forward")]] == [1410, 1005]
    assert profile.blocking_power_w == pytest.approx(PRESET.idle_w)


def test_several_chunks_get_one_profile_row_per_virtual_stage():
    sweep = Sweep(1, [1410], warmup_iterations=0, iterations_per_frequency=1)
    sweep.begin_iteration(0)
    for virtual_stage, scale in ((1, 1.0), (5, 2.0)):  # rank 1's chunks 0 and 1 of a 4-rank loop
        for _ in range(2):
            sweep.record("forward", 0.01 * scale, 3.0 * scale, stage=virtual_stage)
    sweep.end_iteration()
    profile = sweep.profile(fallback_blocking_power_w=80.0)
    assert set(profile.points) == {(1, "forward"), (5, "forward")}
    assert profile.points[(5, "forward")][0].energy == pytest.approx(6.0)
    assert profile.blocking_power_w == 80.0


class _PowerFails(SimGPU):
    def __init__(self, error, **kwargs):
        super().__init__("a100-sxm", 0, **kwargs)
        self.error = error

    def power_mw(self):
        raise self.error


def _profile_without_gaps(gpu):
    """A profiler whose sweep measured no gap long enough for the blocking power."""
    profiler = OnlineProfiler(gpu, Sweep(0, [1410], warmup_iterations=0, iterations_per_frequency=1))
    profiler.begin_iteration(0)
    profiler.sweep.record("forward", 0.01, 3.0)
    profiler.end_iteration()
    return profiler


def test_an_unreadable_power_is_logged_and_only_a_device_error_is_swallowed(tmp_path, caplog):
    gpu = _PowerFails(DeviceError("power reading not supported"), clock=VirtualClock(), state_dir=str(tmp_path))
    with (
        caplog.at_level(logging.WARNING, logger="perseus.profiler.online"),
        pytest.raises(ConfigError, match="blocking power"),
    ):
        _profile_without_gaps(gpu).profile()  # no fallback: the profile says what is missing
    assert "power reading not supported" in caplog.text
    bug = _PowerFails(AttributeError("a bug"), clock=VirtualClock(), state_dir=str(tmp_path))
    with pytest.raises(AttributeError, match="a bug"):  # a bug is not hidden as "no power reading"
        _profile_without_gaps(bug).profile()
