"""A simulated GPU's synchronize is a device sync: it waits for all work queued on that GPU,
whichever SimGPU object or process queued it; `emulate` runs work on simulated GPUs only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from unittest import mock

import pytest

from perseus.clock import VirtualClock
from perseus.devices import GPU, Work, emulate
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import predict
from perseus.measurement import Monitor

WORK = Work(0.05, alpha=0.3)


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    return tmp_path


def test_sync_waits_for_work_another_object_queued_on_the_same_gpu():
    clock = VirtualClock()
    issuer, waiter = SimGPU("a100-sxm", 0, clock=clock), SimGPU("a100-sxm", 0, clock=clock)
    neighbour = SimGPU("a100-sxm", 1, clock=clock)
    duration = sum(issuer.execute(WORK, blocking=False) for _ in range(4))
    assert clock.now() == 0.0
    neighbour.synchronize()  # another GPU: nothing to wait for
    assert clock.now() == 0.0
    waiter.synchronize()
    assert clock.now() == pytest.approx(duration)
    # Its energy counter counts the other object's work, as the GPU's counter does.
    _, energy_j = predict("a100-sxm", WORK, 1410)
    assert waiter.energy_mj() / 1000 == pytest.approx(4 * energy_j, rel=1e-9)
    assert neighbour.energy_mj() / 1000 == pytest.approx(duration * neighbour.preset.idle_w, rel=1e-9)


def test_a_monitor_measures_work_issued_through_another_object():
    """The new user's case: Monitor over one SimGPU, non-blocking work through another."""
    clock = VirtualClock()
    monitor = Monitor(gpus=[SimGPU("a100-sxm", 0, clock=clock)], cpus=[])
    worker = SimGPU("a100-sxm", 0, clock=clock)
    monitor.begin_window("steps")
    for _ in range(10):
        worker.execute(WORK, blocking=False)
    m = monitor.end_window("steps")
    t, e = predict("a100-sxm", WORK, 1410)
    assert m.time_s == pytest.approx(10 * t) and m.gpu_energy_j[0] == pytest.approx(10 * e)


def test_objects_on_different_virtual_clocks_do_not_share_work():
    a, b = SimGPU("a100-sxm", 0, clock=VirtualClock()), SimGPU("a100-sxm", 0, clock=VirtualClock())
    a.execute(WORK, blocking=False)
    b.synchronize()
    assert b.clock.now() == 0.0


def test_sync_waits_for_work_another_process_queued_on_the_real_clock(sim_dir):
    """A process queues 0.3 s of work without blocking and exits; this one's sync waits for it."""
    code = textwrap.dedent(
        """
        from perseus.devices.sim import SimGPU
        from perseus.devices.sim_work import Work
        gpu = SimGPU("a100-sxm", 0)
        gpu.execute(Work(0.3), blocking=False)
        print(gpu._busy_until, flush=True)
        """
    )
    env = {"PERSEUS_SIM_DIR": str(sim_dir), "PATH": "/usr/bin:/bin"}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0, child.stderr
    busy_until = float(child.stdout)  # on the system-wide monotonic clock
    gpu = SimGPU("a100-sxm", 0)
    gpu.synchronize()
    assert time.monotonic() >= busy_until
    SimGPU("a100-sxm", 1).synchronize()  # another GPU returns at once (nothing bounds how fast)


def test_emulate_runs_work_on_every_simulated_gpu_at_once_and_skips_real_ones():
    clock = VirtualClock()
    gpus = [SimGPU("a100-sxm", i, clock=clock) for i in range(2)]
    gpus[1].set_power_limit_mw(200_000)
    real = mock.create_autospec(GPU, instance=True)
    longest = emulate([gpus[0], real, gpus[1]], WORK)
    slow, _ = predict("a100-sxm", WORK, 1410, 200)
    assert longest == pytest.approx(slow) and clock.now() == pytest.approx(slow)  # in parallel, not in turn
    real.assert_not_called()
    assert not real.method_calls
    assert emulate(gpus[0], 0.02, blocking=False) == pytest.approx(0.02)  # seconds: Work(0.02)
    assert emulate([real], WORK) == 0.0
