"""`perseus.probe` on simulated GPUs: it recovers the simulator's own parameters, caches per model,
and always puts the default clock back."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

import perseus.probe as probe
from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import NVIDIA_AVERAGED_POWER, SimRealism
from perseus.exceptions import ConfigError, DevicePermissionError
from perseus.probe.analysis import averaging_window, counter_power_w, refresh_period

POLL_S = 0.002
FAST = probe.ProbeSettings(poll_s=POLL_S, idle_s=2.0, load_s=3.0, switch_settle_s=0.05, switch_timeout_s=0.5)


@pytest.fixture(autouse=True)
def folders(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    monkeypatch.setenv("PERSEUS_PROBE_DIR", str(tmp_path / "probe"))
    return tmp_path


def sim(preset: str, realism: SimRealism | str, index: int = 0) -> SimGPU:
    return SimGPU(preset, index, clock=VirtualClock(), realism=realism)


@pytest.mark.parametrize("preset", ["a100-sxm", "h100-sxm", "mi300x"])
def test_the_probe_recovers_a_realistic_simulators_parameters(preset):
    gpu = sim(preset, "realistic")
    r = gpu.realism
    found = probe.probe_gpu(gpu, FAST, allow_clock_changes=True)
    assert found.name == gpu.name() and found.supported_clocks_mhz == tuple(gpu.supported_frequencies())
    assert found.energy_counter_update_s == pytest.approx(r.counter_period_s, abs=1e-6)
    assert found.power_update_s == pytest.approx(r.power_update_s, abs=1e-6)
    assert found.power_average_window_s == pytest.approx(r.power_window_s, rel=0.03)
    assert found.idle_power_w == pytest.approx(gpu.preset.idle_w, abs=1e-6)  # the counter carries no noise
    top, bottom = gpu.preset.max_mhz, gpu.preset.min_mhz
    assert len(found.clock_switch_latency_s) == 6
    for pair, seconds in found.clock_switch_latency_s.items():
        target = int(pair.split("->")[1])
        assert (
            gpu.clock_switch_latency_s(target) - 1e-9 <= seconds <= gpu.clock_switch_latency_s(target) + POLL_S + 1e-9
        )
    assert found.switch_latency_to_s(bottom) == pytest.approx(0.030, abs=POLL_S + 1e-9)
    assert found.switch_latency_to_s(top) == pytest.approx(0.010, abs=POLL_S + 1e-9)
    assert found.max_clock_switch_latency_s == found.switch_latency_to_s(bottom)
    gpu.clock.sleep(0.1)
    assert gpu.at_defaults()


def test_the_probe_sees_an_ideal_gpu_as_ideal():
    found = probe.probe_gpu(sim("a40", "ideal"), FAST, allow_clock_changes=True)
    assert found.energy_counter_update_s == 0.0 and found.power_update_s == 0.0
    assert found.power_average_window_s == 0.0
    assert found.idle_power_w == pytest.approx(70.38)
    assert set(found.clock_switch_latency_s.values()) == {0.0}


def test_the_probe_recovers_chosen_parameters():
    realism = SimRealism(
        counter_period_s=0.05, power_update_s=0.02, power_window_s=0.5, switch_latency_s=0.04, power_noise=0.02, seed=7
    )
    found = probe.probe_gpu(sim("a100-pcie", realism), replace(FAST, switch_clocks_mhz=(1410, 1005)), True)
    assert found.energy_counter_update_s == pytest.approx(0.05, abs=1e-6)
    assert found.power_update_s == pytest.approx(0.02, abs=1e-6)
    assert found.power_average_window_s == pytest.approx(0.5, rel=0.03)
    assert found.clock_switch_latency_s.keys() == {"1410->1005", "1005->1410"}
    assert all(0.04 <= s <= 0.04 + POLL_S + 1e-9 for s in found.clock_switch_latency_s.values())


def test_read_only_by_default_and_without_permission_it_says_so():
    gpu = sim("a100-sxm", "realistic")
    found = probe.probe_gpu(gpu, FAST)
    assert found.clock_switch_latency_s == {} and found.max_clock_switch_latency_s is None
    assert not os.path.exists(gpu.state_path) and not os.path.exists(gpu.state_path.replace(".json", ".switch.json"))

    class Unprivileged(SimGPU):
        def can_change_clocks(self) -> bool:
            return False

    with pytest.raises(DevicePermissionError, match="--allow-clock-changes"):
        probe.probe_gpu(Unprivileged("a100-sxm", clock=VirtualClock()), FAST, allow_clock_changes=True)
    with pytest.raises(ConfigError, match="1400"):
        probe.probe_gpu(gpu, replace(FAST, switch_clocks_mhz=(1410, 1400)), allow_clock_changes=True)


def test_the_default_clock_comes_back_when_the_probe_fails_midway():
    class Failing(SimGPU):
        locks = 0

        def lock_sm_clock(self, mhz: int) -> None:
            self.locks += 1
            if self.locks == 4:
                raise KeyboardInterrupt
            super().lock_sm_clock(mhz)

    gpu = Failing("a100-sxm", clock=VirtualClock(), realism="realistic")
    with pytest.raises(KeyboardInterrupt):
        probe.probe_gpu(gpu, FAST, allow_clock_changes=True)
    assert not os.path.exists(gpu.state_path)
    gpu.clock.sleep(0.1)
    assert gpu.sm_clock() == 1410 and gpu.at_defaults()


def test_a_clock_that_never_arrives_leaves_the_pair_out():
    class Stuck(SimGPU):
        def sm_clock(self) -> int:
            return 1410

    gpu = Stuck("a100-sxm", clock=VirtualClock(), realism="realistic")
    found = probe.probe_gpu(gpu, FAST, allow_clock_changes=True)
    assert found.clock_switch_latency_s == {}  # every pair's first or second clock never came
    assert not os.path.exists(gpu.state_path)


def test_results_are_cached_per_model_and_read_back(folders):
    a100, h100 = sim("a100-sxm", "realistic"), sim("h100-sxm", "realistic")
    assert probe.load(a100) is None
    found = probe.probe_gpu(a100, FAST, allow_clock_changes=True)
    path = probe.save(found)
    assert path.parent == folders / "probe" and path.name.startswith("NVIDIA_A100-SXM4-40GB_simulated-")
    assert probe.load(sim("a100-sxm", "realistic", index=3)) == replace(
        found,
        energy_counter_update_s=round(found.energy_counter_update_s, 6),
        power_update_s=round(found.power_update_s, 6),
        power_average_window_s=round(found.power_average_window_s, 6),
        idle_power_w=round(found.idle_power_w, 6),
        clock_switch_latency_s={k: round(v, 6) for k, v in found.clock_switch_latency_s.items()},
    )
    assert probe.load(h100) is None
    assert probe.load(sim("a100-sxm", "ideal")) is None  # a different model to probe
    # A read-only probe later keeps the switch latencies measured before.
    probe.save(probe.probe_gpu(a100, FAST))
    assert probe.load(a100).clock_switch_latency_s == pytest.approx(dict(found.clock_switch_latency_s), abs=1e-6)
    doc = json.loads(path.read_text())
    assert {
        "name",
        "energy_counter_update_s",
        "power_average_window_s",
        "idle_power_w",
        "clock_switch_latency_s",
    } <= set(doc)


def test_a_corrupt_cache_names_the_file_and_the_fix(folders):
    gpu = sim("a100-sxm", "realistic")
    path = probe.cache.path_for(gpu)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"{path}.*perseus probe"):
        probe.load(gpu)
    path.write_text(json.dumps({"name": "x", "key": "y", "idle_power_w": -3}))
    with pytest.raises(ConfigError, match="idle_power_w"):
        probe.load(gpu)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("PERSEUS_PROBE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe.cache_dir() == tmp_path / "xdg" / "perseus" / "probe"


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="poll"):
        probe.ProbeSettings(poll_s=0)
    with pytest.raises(ConfigError, match="load_s"):
        probe.ProbeSettings(poll_s=0.01, load_s=0.05)


def test_refresh_period_and_counter_power_from_series():
    steps = [(i * 0.01, float(int(i * 0.01 / 0.1 + 1e-9))) for i in range(200)]  # a counter of 1 mJ per 100 ms
    assert refresh_period(steps, 0.01) == pytest.approx(0.1)
    assert counter_power_w(steps) == pytest.approx(0.01)  # 1 mJ / 0.1 s
    smooth = [(i * 0.01, float(i)) for i in range(50)]
    assert refresh_period(smooth, 0.01) == 0.0
    assert refresh_period([(0.0, 1.0), (0.5, 2.0)], 0.01) is None
    assert counter_power_w([(0.0, 1.0), (1.0, 1.0)]) is None


def test_averaging_window_from_a_ramp():
    # Reading refreshed every 0.1 s, averaging 0.8 s: after a step at 1.0 it climbs 1/8 per refresh.
    readings = [(t / 100, 100.0 + 200.0 * min(1.0, max(0.0, int(t / 10) / 10 - 1.0) / 0.8)) for t in range(300)]
    assert averaging_window(readings, 1.0, 100.0, 300.0, 0.1) == pytest.approx(0.8)
    jump = [(t / 100, 100.0 if t < 100 else 300.0) for t in range(300)]
    assert averaging_window(jump, 1.0, 100.0, 300.0, 0.1) == 0.1
    assert averaging_window(jump, 1.0, 100.0, 300.0, 0.0) == 0.0  # a reading that follows at once
    assert averaging_window(jump, 1.0, 100.0, 300.0, None) is None  # its refresh unknown: so is its window
    assert averaging_window(jump, 1.0, 100.0, 100.0, 0.1) is None


def test_averaged_reading_with_partial_coverage_is_still_its_window():
    realism = replace(NVIDIA_AVERAGED_POWER, power_noise=0.0, counter_period_s=0.0)
    found = probe.probe_gpu(sim("h100-sxm", realism), FAST)
    assert found.power_average_window_s == pytest.approx(1.0, rel=1e-6)
    assert found.energy_counter_update_s == 0.0
