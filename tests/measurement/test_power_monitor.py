"""PowerMonitor: trapezoid integration, bounded memory, background sampling."""

from __future__ import annotations

import time

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, busy_power_w
from perseus.exceptions import ConfigError, DeviceError, MeasurementError
from perseus.measurement import PowerMonitor

IDLE_W = PRESETS["a100-sxm"].idle_w
BUSY_W = busy_power_w(PRESETS["a100-sxm"], Work(1.0), 1410)


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))


def test_trapezoid_integration_with_interpolated_ends():
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", clock=clock)
    pm = PowerMonitor([gpu], clock=clock)
    pm.sample()  # t=0: idle
    clock.advance(1.0)
    gpu.execute(Work(2.0), blocking=False)  # busy during [1, 3]
    pm.sample()  # t=1: busy
    clock.advance(2.0)
    pm.sample()  # t=3: idle again
    samples = pm.timeline()[0]
    assert samples == [(0.0, pytest.approx(IDLE_W)), (1.0, pytest.approx(BUSY_W)), (3.0, pytest.approx(IDLE_W))]
    # Over [0, 3]: ramps (0,1) and (1,3) of the piecewise-linear samples.
    assert pm.energy_j(0, 0.0, 3.0) == pytest.approx((IDLE_W + BUSY_W) / 2 * 3)
    # Interpolated ends: [0.5, 2.0].
    p_half = (IDLE_W + BUSY_W) / 2
    p_two = (BUSY_W + IDLE_W) / 2
    expected = (p_half + BUSY_W) / 2 * 0.5 + (BUSY_W + p_two) / 2 * 1.0
    assert pm.energy_j(0, 0.5, 2.0) == pytest.approx(expected)
    # Past the last sample the power is held flat.
    assert pm.energy_j(0, 3.0, 5.0) == pytest.approx(2 * IDLE_W)
    assert pm.energy_j(0, 1.0, 1.0) == 0.0


def test_ring_buffer_keeps_memory_bounded():
    clock = VirtualClock()
    pm = PowerMonitor([SimGPU("a40", clock=clock)], max_samples=5, clock=clock)
    for _ in range(20):
        pm.sample()
        clock.advance(1.0)
    times = [t for t, _ in pm.timeline()[0]]
    assert times == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert pm.energy_j(0, 15.0, 19.0) == pytest.approx(4 * 70.38)
    with pytest.raises(MeasurementError, match="dropped older"):
        pm.energy_j(0, 10.0, 19.0)


def test_errors_name_the_problem():
    clock = VirtualClock()
    pm = PowerMonitor([SimGPU("a40", clock=clock)], clock=clock)
    with pytest.raises(MeasurementError, match="no power samples"):
        pm.energy_j(0, 0.0, 1.0)
    pm.sample()
    with pytest.raises(MeasurementError, match=r"GPU 3 is not sampled.*\[0\]"):
        pm.energy_j(3, 0.0, 1.0)
    with pytest.raises(ConfigError):
        PowerMonitor([], clock=clock)
    with pytest.raises(ConfigError):
        PowerMonitor([SimGPU("a40")], interval_s=0)


def test_background_sampling_on_the_real_clock():
    """Real threads and time: about 0.1 s (waits for 5 background samples, at most 30 s on a
    loaded machine). The GPUs idle, so the power is flat and the energy exact however the
    samples fall."""
    gpus = [SimGPU("a100-sxm", 0), SimGPU("a40", 1)]
    with PowerMonitor(gpus, interval_s=0.02) as pm:
        start = time.monotonic()
        deadline = start + 30.0
        while len(pm.timeline()[0]) < 6 and time.monotonic() < deadline:  # start() takes the first
            time.sleep(0.01)
        end = time.monotonic()
        assert pm._thread is not None and pm._thread.is_alive()
    timeline = pm.timeline()
    assert len(timeline[0]) >= 6 and len(timeline[1]) == len(timeline[0])
    assert pm.energy_j(0, start, end) == pytest.approx(IDLE_W * (end - start), rel=0.01)
    assert pm.energy_j(1, start, end) == pytest.approx(70.38 * (end - start), rel=0.01)
    n = len(pm.timeline()[0])
    time.sleep(0.05)
    assert len(pm.timeline()[0]) == n  # stopped


class FailingGPU(SimGPU):
    def __init__(self) -> None:
        super().__init__("a40")
        self.calls = 0

    def power_mw(self) -> float:
        self.calls += 1
        if self.calls > 2:
            raise DeviceError("GPU fell off the bus")
        return super().power_mw()


def test_a_failure_in_the_sampling_thread_is_reported():
    pm = PowerMonitor([FailingGPU()], interval_s=0.005).start()
    deadline = time.monotonic() + 5
    while pm._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pm.stop()
    with pytest.raises(MeasurementError, match="power sampling stopped: GPU fell off the bus"):
        pm.energy_j(0, 0.0, 1.0)
