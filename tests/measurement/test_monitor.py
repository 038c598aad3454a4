"""Monitor: windows (nesting, overlap, cancel, duplicates), sync, counterless GPUs, CPUs."""

from __future__ import annotations

import json

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU, sim_gpus
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import SimRealism
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError, MeasurementError
from perseus.measurement import Measurement, Monitor

IDLE_W = PRESETS["a100-sxm"].idle_w


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))


@pytest.fixture
def clock():
    return VirtualClock()


@pytest.fixture
def gpus(clock):
    return sim_gpus("a100-sxm", 2, clock=clock)


def test_nested_and_overlapping_windows(clock, gpus):
    monitor = Monitor(gpus=gpus)
    assert monitor.clock is clock
    _, e_work = predict("a100-sxm", Work(1.0), 1410)
    monitor.begin_window("outer")
    clock.advance(1.0)
    monitor.begin_window("a")
    gpus[0].execute(Work(1.0))  # 1 s busy on GPU 0
    monitor.begin_window("b")
    clock.advance(2.0)
    a = monitor.end_window("a")  # overlaps b
    clock.advance(1.0)
    b = monitor.end_window("b")
    outer = monitor.end_window("outer")
    assert monitor.open_windows == []
    assert a.time_s == pytest.approx(3.0) and b.time_s == pytest.approx(3.0) and outer.time_s == pytest.approx(5.0)
    assert a.gpu_energy_j[0] == pytest.approx(e_work + 2 * IDLE_W)
    assert a.gpu_energy_j[1] == pytest.approx(3 * IDLE_W)
    assert b.gpu_energy_j[0] == pytest.approx(3 * IDLE_W)
    assert outer.gpu_energy_j[0] == pytest.approx(e_work + 4 * IDLE_W)
    assert outer.total_energy_j == pytest.approx(e_work + 9 * IDLE_W)
    assert outer.average_power_w == pytest.approx(outer.total_energy_j / 5)
    assert outer.cpu_energy_j is None and outer.dram_energy_j is None


def test_duplicate_and_unknown_names(gpus):
    monitor = Monitor(gpus=gpus)
    monitor.begin_window("step")
    with pytest.raises(MeasurementError, match="'step' is already open"):
        monitor.begin_window("step")
    monitor.begin_window("epoch")
    with pytest.raises(MeasurementError, match=r"no open measurement window 'stpe'; open windows: \['step', 'epoch'\]"):
        monitor.end_window("stpe")
    monitor.end_window("step")
    with pytest.raises(MeasurementError, match="'step'"):
        monitor.end_window("step")
    with pytest.raises(MeasurementError, match="window's name must be a non-empty string, got 3"):
        monitor.begin_window(3)  # type: ignore[arg-type]
    with pytest.raises(MeasurementError, match="non-empty string, got ''"):
        monitor.begin_window("")


def test_a_window_a_few_counter_steps_long_is_said_once(clock, tmp_path, caplog):
    """A stepping counter (100 ms) reads a 50 ms window as 0 J or a whole step: one WARNING says
    so, naming the window and the length to measure; windows of 20 steps and more say nothing."""
    gpu = SimGPU("a100-sxm", 0, clock=clock, state_dir=str(tmp_path), realism=SimRealism(counter_period_s=0.1))
    monitor = Monitor(gpus=[gpu])
    with caplog.at_level("WARNING", logger="perseus.measurement.monitor"):
        with monitor.window("long"):
            clock.advance(2.0)
        assert not caplog.records
        for _ in range(3):
            monitor.begin_window("step")
            clock.advance(0.05)
            monitor.end_window("step")
        monitor.begin_window("summed")
        clock.advance(0.05)
        monitor.end_window("summed", expect_short=True)
    (record,) = caplog.records
    assert "window 'step' lasted 0.05 s" in record.getMessage() and "windows of 2 s or more" in record.getMessage()


def test_cancel_discards_the_window(clock, gpus):
    monitor = Monitor(gpus=gpus)
    monitor.begin_window("step")
    gpus[0].execute(Work(1.0), blocking=False)
    assert monitor.end_window("step", cancel=True) is None
    assert clock.now() == 0.0  # a cancelled window does not wait for the GPU
    monitor.begin_window("step")  # the name is free again; begin waits for the queued work
    assert clock.now() == pytest.approx(1.0)
    assert monitor.end_window("step").time_s == 0.0


def test_sync_counts_asynchronous_work(clock, gpus):
    _, e_work = predict("a100-sxm", Work(0.5), 1410)
    monitor = Monitor(gpus=gpus)
    monitor.begin_window("step")
    gpus[1].execute(Work(0.5), blocking=False)
    m = monitor.end_window("step")
    assert m.time_s == pytest.approx(0.5)
    assert m.gpu_energy_j[1] == pytest.approx(e_work)
    unsynced = Monitor(gpus=gpus, sync=False)
    unsynced.begin_window("step")
    gpus[1].execute(Work(0.5), blocking=False)
    assert unsynced.end_window("step").time_s == 0.0
    monitor.begin_window("late", sync=False)
    assert clock.now() == pytest.approx(0.5)  # did not wait for the queued work


def test_window_context_manager(clock, gpus):
    monitor = Monitor(gpus=gpus, gpu_indices=[1])
    with monitor.window("step") as w:
        assert w.measurement is None
        gpus[1].execute(Work(1.0))
    assert w.name == "step" and w.measurement.time_s == pytest.approx(1.0)
    assert list(w.measurement.gpu_energy_j) == [1]
    with pytest.raises(RuntimeError):
        with monitor.window("failing") as failed:
            clock.advance(2.0)
            raise RuntimeError("boom")
    assert failed.measurement.time_s == pytest.approx(2.0)
    assert monitor.open_windows == []


def test_gpu_selection_errors(gpus):
    with pytest.raises(ConfigError, match=r"no GPU with index 5; available: \[0, 1\]"):
        Monitor(gpus=gpus, gpu_indices=[5])
    with pytest.raises(ConfigError, match="no CPU with index 0; available: none"):
        Monitor(gpus=gpus, cpus=[], cpu_indices=[0])
    with pytest.raises(ConfigError, match="Monitor measures no GPU .*select a GPU, or pass clock=REAL_CLOCK"):
        Monitor(gpus=gpus, gpu_indices=[], cpus=[])
    # Wrong types say what is wrong (an outsider read "no GPU with index 0" beside "available: [0]").
    for indices, wrong in (("01", "got '01'"), (["0"], r"'0' in \['0'\] is not one"), (0, "got 0")):
        with pytest.raises(ConfigError, match=rf"gpu_indices must be a list of integers, e.g. \[0, 1\]; {wrong}"):
            Monitor(gpus=gpus, gpu_indices=indices, cpus=[])
    with pytest.raises(ConfigError, match=r"gpus must be a list of GPU objects .*pass gpu_indices; 0 is not one"):
        Monitor(gpus=[0], cpus=[])
    assert Monitor(gpus=gpus, gpu_indices=range(1, 2), cpus=[]).gpus == [gpus[1]]
    monitor = Monitor(gpus=gpus, cpus=[])
    monitor.begin_window("w")
    with pytest.raises(ConfigError, match="end_window: expect_short must be True or False, got 'yes'"):
        monitor.end_window("w", expect_short="yes")  # type: ignore[call-overload]
    assert monitor.open_windows == ["w"]  # still open: nothing was read


def test_default_gpus_come_from_perseus_gpu(monkeypatch):
    monkeypatch.setenv("PERSEUS_GPU", "sim:a40:3")
    monitor = Monitor()
    assert [g.index for g in monitor.gpus] == [0, 1, 2]
    assert all(g.name().startswith("NVIDIA A40") for g in monitor.gpus)


class CounterlessGPU(SimGPU):
    def has_energy_counter(self) -> bool:
        return False


def test_gpus_without_a_counter_are_integrated_from_power_samples(clock):
    gpus = [SimGPU("a100-sxm", 0, clock=clock), CounterlessGPU("a100-sxm", 1, clock=clock)]
    with Monitor(gpus=gpus) as monitor:
        assert monitor.power_monitor is not None and monitor.power_monitor.gpu_indices == [1]
        monitor.begin_window("idle")
        clock.advance(2.0)
        m = monitor.end_window("idle")
    assert m.gpu_energy_j[0] == pytest.approx(2 * IDLE_W)
    assert m.gpu_energy_j[1] == pytest.approx(2 * IDLE_W)


class FakeCPU:
    """A CPU package with scripted counters (J)."""

    def __init__(self, index: int, dram: bool) -> None:
        self.index = index
        self.package = 1000.0
        self.dram = 500.0 if dram else None

    def package_energy_j(self) -> float:
        return self.package

    def dram_energy_j(self) -> float | None:
        return self.dram


def test_cpu_and_dram_energy(gpus):
    cpus = [FakeCPU(0, dram=True), FakeCPU(1, dram=False)]
    monitor = Monitor(gpus=gpus, cpus=cpus)
    monitor.begin_window("step")
    cpus[0].package += 30.0
    cpus[0].dram += 5.0
    cpus[1].package += 20.0
    gpus[0].clock.advance(1.0)
    m = monitor.end_window("step")
    assert m.cpu_energy_j == {0: 30.0, 1: 20.0}
    assert m.dram_energy_j == {0: 5.0}
    assert m.total_energy_j == pytest.approx(2 * IDLE_W + 55.0)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["cpu_energy_j"] == {"0": 30.0, "1": 20.0}
    assert d["total_energy_j"] == pytest.approx(m.total_energy_j)
    assert d["average_power_w"] == pytest.approx(m.average_power_w)
    only_second = Monitor(gpus=gpus, cpus=cpus, cpu_indices=[1])
    only_second.begin_window("w")
    assert only_second.end_window("w").dram_energy_j is None


def test_measurement_is_frozen():
    m = Measurement(0.0, {0: 1.0})
    assert m.average_power_w == 0.0 and m.total_energy_j == 1.0
    with pytest.raises(AttributeError):
        m.time_s = 2.0  # type: ignore[misc]


def test_works_with_torch_loaded_without_cuda(gpus):
    # Imports torch: about 2-3 s, once per test session.
    torch = pytest.importorskip("torch")
    assert not torch.cuda.is_available()
    monitor = Monitor(gpus=gpus)
    monitor.begin_window("w")
    assert monitor.end_window("w").time_s == 0.0


def test_nvml_backend_counter_and_sampled_gpus(monkeypatch):
    """Over the fake pynvml: an Ampere GPU read from its counter, a Pascal one from power samples."""
    from perseus.devices.nvml import nvml_gpus
    from perseus.testing.fake_nvml import FakeGPU, installed
    from perseus.testing.nvml_codes import NVML_DEVICE_ARCH_PASCAL

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clock = VirtualClock()
    fakes = [FakeGPU(power_mw=90_000), FakeGPU(architecture=NVML_DEVICE_ARCH_PASCAL, power_mw=50_000)]
    with installed(fakes, clock=clock):
        with Monitor(gpus=nvml_gpus(), cpus=[], clock=clock) as monitor:
            assert monitor.power_monitor is not None and monitor.power_monitor.gpu_indices == [1]
            monitor.begin_window("step")
            clock.advance(2.0)
            m = monitor.end_window("step")
    assert list(m.gpu_energy_j) == [0, 1]
    assert m.gpu_energy_j[0] == pytest.approx(180.0, abs=0.002)  # the counter counts whole mJ
    assert m.gpu_energy_j[1] == pytest.approx(100.0)


def test_cpus_default_to_rapl_only_where_readable(gpus):
    """No RAPL on this machine or CI (skipped where it is readable): no CPU energy by default,
    a clear error when CPUs are asked for."""
    from perseus.devices.cpu import rapl_cpus
    from perseus.exceptions import DeviceError

    try:
        rapl_cpus()
        pytest.skip("RAPL is readable here")
    except DeviceError:
        pass
    assert Monitor(gpus=gpus).cpus == []
    with pytest.raises(DeviceError, match="RAPL"):
        Monitor(gpus=gpus, cpu_indices=[0])
