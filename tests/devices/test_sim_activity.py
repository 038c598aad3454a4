"""Simulated GPUs on the real clock share their work through an activity log, so an energy
counter counts work from every process, like a real GPU's; the log stays bounded on disk."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from perseus.devices import sim_activity
from perseus.devices.sim import SimGPU
from perseus.devices.sim_activity import RECORD, ActivityLog
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, busy_power_w, predict
from perseus.exceptions import DeviceError
from perseus.measurement import Monitor

IDLE_W = PRESETS["a100-sxm"].idle_w
EXTRA_W = busy_power_w(PRESETS["a100-sxm"], Work(1.0), 1410) - IDLE_W


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    return tmp_path


class TimedReads(SimGPU):
    """A SimGPU that notes the clock just before and just after each counter read: the read's
    own instant lies between, however long a loaded machine keeps the thread from running."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[float, float]] = []

    def energy_mj(self) -> float:
        before = time.monotonic()
        energy = super().energy_mj()
        self.reads.append((before, time.monotonic()))
        return energy


def idle_bounds_j(begin: tuple[float, float], end: tuple[float, float]) -> tuple[float, float]:
    """The least and most idle energy between two timed reads."""
    return IDLE_W * (end[0] - begin[1]), IDLE_W * (end[1] - begin[0])


def test_a_counter_sees_work_another_object_ran():
    """Real clock, about 0.05 s."""
    reader, writer = TimedReads("a100-sxm", 0), SimGPU("a100-sxm", 0)
    t0 = time.monotonic()
    e0 = reader.energy_mj()
    duration = writer.execute(Work(0.05))
    e1 = reader.energy_mj()
    assert duration == pytest.approx(0.05)
    # Idle power between the two reads (bounded by the reads' timestamps) plus the work's extra.
    low, high = idle_bounds_j(*reader.reads)
    assert low + EXTRA_W * duration - 1e-6 <= (e1 - e0) / 1000 <= high + EXTRA_W * duration + 1e-6
    assert SimGPU("a100-sxm", 1).energy_mj() < 1000 * IDLE_W * (time.monotonic() - t0)  # other GPU: idle


def test_monitor_counts_work_a_child_process_runs():
    """The `perseus monitor -- CMD` situation: about 0.5 s (a Python child)."""
    gpus = [TimedReads("a100-sxm", i) for i in range(2)]
    monitor = Monitor(gpus=gpus, cpus=[])
    monitor.begin_window("child")
    code = (
        "from perseus.devices.sim import SimGPU; from perseus.devices.sim_work import Work; "
        "SimGPU('a100-sxm', 1).execute(Work(0.2))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    m = monitor.end_window("child")
    _, work_j = predict("a100-sxm", Work(0.2), 1410)
    # Idle power between each GPU's two counter reads (bounded by their timestamps, not by the
    # window's, which a stall between the clock read and the counter reads would move), and on
    # GPU 1 the child's work (about 60 J beyond idle) in place of 0.2 s of it.
    extra_j = [0.0, work_j - IDLE_W * 0.2]
    for gpu, energy, extra in zip(gpus, (m.gpu_energy_j[0], m.gpu_energy_j[1]), extra_j):
        low, high = idle_bounds_j(*gpu.reads)
        assert low + extra - 1e-6 <= energy <= high + extra + 1e-6, (gpu.index, energy, low, high)
    assert m.time_s > 0.2


def records(n, start=100.0):
    return [(start + i, start + i + 0.5, IDLE_W + 10.0 * (i + 1)) for i in range(n)]


def extra_j(recs):
    return sum((busy - IDLE_W) * (end - start) for start, end, busy in recs)


def test_log_is_bounded_and_readers_lose_nothing(sim_dir, monkeypatch):
    monkeypatch.setattr(sim_activity, "MAX_BYTES", RECORD.size * 10)
    path = str(sim_dir / "activity" / "a100-sxm-0.log")
    writer = ActivityLog(path, IDLE_W)
    steady, lagging = ActivityLog(path, IDLE_W), ActivityLog(path, IDLE_W)
    seen, missed_total = [], 0.0
    work = records(45)
    for record in work:
        writer.append(*record)
        new, missed = steady.read_new(time.monotonic())
        seen += new
        missed_total += missed
        assert os.path.getsize(path) <= RECORD.size * 10
    assert seen == work and missed_total == 0.0
    # A reader that slept through whole generations gets their energy from the header total.
    new, missed = lagging.read_new(time.monotonic())
    assert extra_j(new) + missed == pytest.approx(extra_j(work))
    assert len(new) < len(work) and missed > 0
    # A reader that starts now only reads the tail: work that may still be running.
    late = ActivityLog(path, IDLE_W)
    assert late.read_new(time.monotonic()) == ([], 0.0)
    writer.append(*records(1, start=500.0)[0])
    assert late.read_new(time.monotonic()) == (records(1, start=500.0), 0.0)


def test_a_removed_log_starts_over(sim_dir):
    path = str(sim_dir / "activity" / "a40-0.log")
    writer, reader = ActivityLog(path, IDLE_W), ActivityLog(path, IDLE_W)
    writer.append(1.0, 2.0, 200.0)
    assert reader.read_new(time.monotonic()) == ([(1.0, 2.0, 200.0)], 0.0)
    os.unlink(path)
    writer.append(3.0, 4.0, 250.0)
    later = time.monotonic() + sim_activity.PATH_CHECK_S  # removal by hand is noticed within a second
    assert reader.read_new(later) == ([(3.0, 4.0, 250.0)], 0.0)


def test_virtual_clock_gpus_keep_their_work_to_themselves(sim_dir):
    from perseus.clock import VirtualClock

    SimGPU("a100-sxm", 0, clock=VirtualClock()).execute(Work(1.0))
    assert not (sim_dir / "activity").exists()


def test_the_log_stays_out_of_the_state_files(sim_dir):
    SimGPU("a100-sxm", 2).execute(Work(0.001))
    assert sorted(p.name for p in sim_dir.iterdir()) == ["activity"]
    assert [p.name for p in (sim_dir / "activity").iterdir() if not p.name.startswith(".")] == ["a100-sxm-2.log"]


def test_an_unwritable_runtime_folder_is_a_clear_error(sim_dir):
    gpu = SimGPU("a100-sxm", 0)
    (sim_dir / "activity" / ".lock").unlink()
    (sim_dir / "activity" / "a100-sxm-0.log").unlink()
    (sim_dir / "activity").rmdir()
    (sim_dir / "activity").write_text("not a folder")
    with pytest.raises(DeviceError, match="PERSEUS_SIM_DIR to a writable folder"):
        SimGPU("a100-sxm", 0).execute(Work(0.001))
    assert gpu.energy_mj() > 0  # reading still works: idle power
