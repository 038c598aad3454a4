"""The online profiler beyond one chunk of forward and backward: interleaved chunks (a row per
virtual stage), zero-bubble kinds, the blocking power's fallback, and what it says when there is
nothing to measure. One rank through `PerseusRank` on a virtual clock (see stage_run)."""

from __future__ import annotations

import io
import logging

import pytest
from stage_run import profile_stage

from perseus.clock import VirtualClock
from perseus.controller import FrequencyController
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import IDEAL, SimRealism
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError, DeviceError
from perseus.profiler.online import OnlineProfiler
from perseus.profiler.profile import KINDS
from perseus.profiler.sweep import Sweep, SweepPlan
from perseus.runtime import Progress

PRESET = PRESETS["a100-sxm"]
STEPPING = SimRealism(counter_period_s=0.1, switch_latency_s=0.01)


def worst_energy_error(profile, work_of) -> float:
    worst = 0.0
    for (stage, kind), points in profile.points.items():
        for p in points:
            _, e = predict(PRESET, work_of(stage, kind), p.frequency)
            worst = max(worst, abs(p.energy / e - 1))
    return worst


@pytest.mark.parametrize("realism, tolerance", [(STEPPING, 0.03), (IDEAL, 1e-6)], ids=["stepping", "ideal"])
def test_interleaved_chunks_get_a_row_per_virtual_stage(tmp_path, realism, tolerance):
    works = {(k, c): Work(t * (1 + c), 0.8, 0.92) for k, t in (("forward", 0.005), ("backward", 0.01)) for c in (0, 1)}
    profile, _, _ = profile_stage(
        lambda kind, chunk: works[(kind, chunk)], realism, str(tmp_path), schedule_name="interleaved-1f1b", chunks=2
    )
    assert set(profile.points) == {(1, "forward"), (1, "backward"), (5, "forward"), (5, "backward")}
    # Rank 1 of 4 holds virtual stages 1 (chunk 0) and 5 (chunk 1), whose work differs.
    assert worst_energy_error(profile, lambda stage, kind: works[(kind, stage // 4)]) < tolerance


def test_zero_bubble_kinds(tmp_path):
    works = {
        "forward": Work(0.006),
        "backward_input": Work(0.005, alpha=0.7),
        "backward_weight": Work(0.004, alpha=0.6, intensity=0.7),
    }
    profile, _, _ = profile_stage(works, STEPPING, str(tmp_path), schedule_name="zb-h1")
    assert {kind for _, kind in profile.points} == set(works)
    assert worst_energy_error(profile, lambda stage, kind: works[kind]) < 0.03


def test_without_blocking_time_the_power_reading_stands_in(tmp_path, caplog):
    # No wait between instructions and no switch latency to wait out: blocking time only between
    # iterations, where the framework's own work (unknown) runs too.
    works = {"forward": Work(0.01), "backward": Work(0.02)}
    with caplog.at_level(logging.WARNING, logger="perseus.profiler.online"):
        profile, _, _ = profile_stage(works, IDEAL, str(tmp_path), gaps=(0.0, 0.0))
    assert "power reading" in caplog.text
    assert profile.blocking_power_w == pytest.approx(PRESET.idle_w)  # the idle GPU's reading
    assert worst_energy_error(profile, lambda stage, kind: works[kind]) < 1e-6


class _PowerFails(SimGPU):
    def __init__(self, error, **kwargs):
        super().__init__("a100-sxm", 0, **kwargs)
        self.error = error

    def power_mw(self):
        raise self.error


def _profiler_without_data(gpu):
    """A profiler that saw one instruction: no window, so no blocking power either."""
    controller = FrequencyController(gpu, handle_signals=False, watchdog=False)
    profiler = OnlineProfiler(gpu, Sweep(0), controller.settle)
    step = profiler.begin_iteration(SweepPlan((1410,), 1, (dict.fromkeys(KINDS, 1410),)))
    controller.set_uniform(step["forward"])
    controller.before_instruction("forward", 0)
    profiler.before_instruction()
    timer = gpu.instruction_timer()
    begin = timer.mark()
    gpu.execute(Work(0.01))
    end = timer.mark()
    times = timer.resolve()
    profiler.timeline.span((0, "forward"), times[begin], times[end])  # the iteration never ended
    controller.close()
    return profiler


def test_nothing_measured_is_said_clearly_and_only_a_device_error_is_swallowed(tmp_path):
    gpu = _PowerFails(DeviceError("power reading not supported"), clock=VirtualClock(), state_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="no instruction was measured: 0 energy-counter windows"):
        _profiler_without_data(gpu).profile()
    profiler = _profiler_without_data(gpu)
    with pytest.raises(
        ConfigError, match=r"cannot be read \(power reading not supported\); set JobSpec.blocking_power_w"
    ):
        profiler._blocking_power(profiler.fit())
    bug = _PowerFails(AttributeError("a bug"), clock=VirtualClock(), state_dir=str(tmp_path))
    profiler = _profiler_without_data(bug)
    with pytest.raises(AttributeError, match="a bug"):  # a bug is not hidden as "no power reading"
        profiler._blocking_power(profiler.fit())


def test_the_progress_line_counts_the_clocks_the_sweep_profiles(tmp_path):
    """Of the service's plan (every 4th A100 clock: 21), the sweep stops once lower clocks only
    cost more: rank 0's line says 'at most' until then, and the count it profiled after."""
    out = io.StringIO()
    works = {"forward": Work(0.005), "backward": Work(0.01)}
    profile, _, _ = profile_stage(works, IDEAL, str(tmp_path), sweep_step=4, progress=Progress(out, tty=False), after=1)
    profiled = len(profile.meta["frequencies"].split(","))
    lines = [line for line in out.getvalue().splitlines() if "clocks]" in line]
    assert profiled < 21
    assert lines[0].endswith("profiling at 1410 MHz [0 of at most 21 clocks]"), lines
    assert all("at most 21 clocks]" in line for line in lines[:-1])
    assert lines[-1].endswith(f"at default clocks [{profiled} of {profiled} clocks]"), lines
