"""Instruction timers: timing events resolved into host-clock instants once per iteration, with
no device synchronisation per mark (a fake `torch.cuda` passed to the timer, on a virtual
clock), and the synchronising host timer where torch does not drive the GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from perseus.clock import VirtualClock
from perseus.devices.instruction_timer import DeviceTimer, EventTimer, HostTimer
from perseus.devices.sim import SimGPU
from perseus.testing.fake_cuda import FakeCuda

WORK_S = (0.004, 0.010, 0.006)
HOST_S = 0.0005  # host time to issue one instruction: far less than its GPU work


def issue_ahead(timer, cuda, clock):
    """Three instructions issued as a training loop does: the host marks, queues the work, marks
    and goes on; the true (host-clock) instants the GPU reached each mark."""
    truth = []
    for seconds in WORK_S:
        clock.advance(HOST_S)
        timer.mark()
        truth.append(max(clock.now(), cuda.stream.busy_until))
        cuda.run(seconds)
        clock.advance(HOST_S)
        timer.mark()
        truth.append(cuda.stream.busy_until)
    return truth


def test_events_are_resolved_into_the_host_instants_the_gpu_reached_them():
    clock = VirtualClock(1000.0)
    cuda = FakeCuda(clock, device=3)
    timer = EventTimer(3, clock, cuda)
    truth = issue_ahead(timer, cuda, clock)
    assert cuda.synchronize_calls == 0  # none per instruction: the host stayed ahead of the GPU
    assert clock.now() < truth[-1]
    times = timer.resolve()
    assert cuda.synchronize_calls == 1
    assert times == pytest.approx(truth, abs=1e-9)
    assert times == sorted(times)
    durations = [end - begin for begin, end in zip(times[::2], times[1::2])]
    assert durations == pytest.approx(WORK_S, abs=1e-9)  # the GPU's time, not the host's issue time
    assert times[2] == pytest.approx(times[1], abs=1e-9)  # queued back to back: no gap on the GPU


def test_every_iteration_is_anchored_afresh_and_reuses_its_events():
    clock = VirtualClock(5.0)
    cuda = FakeCuda(clock)
    timer = EventTimer(0, clock, cuda)
    issue_ahead(timer, cuda, clock)
    timer.resolve()
    made = cuda.events_made
    clock.advance(3600.0)  # an hour later: the next iteration's marks are read against a new anchor
    truth = issue_ahead(timer, cuda, clock)
    assert timer.resolve() == pytest.approx(truth, abs=1e-9)
    assert cuda.events_made == made and cuda.synchronize_calls == 2
    assert timer.resolve() == [] and cuda.synchronize_calls == 2  # nothing marked: nothing to wait for


def test_marks_index_what_resolve_returns():
    clock = VirtualClock()
    cuda = FakeCuda(clock)
    timer = EventTimer(0, clock, cuda)
    assert [timer.mark(), timer.mark(), timer.mark()] == [0, 1, 2]
    timer.resolve()
    assert timer.mark() == 0


def test_the_host_timer_synchronises_per_mark_and_is_exact_on_a_simulated_gpu(tmp_path):
    from perseus.devices.sim_work import Work

    gpu = SimGPU("a100-sxm", 0, clock=VirtualClock(), state_dir=str(tmp_path))
    timer = gpu.instruction_timer()
    assert isinstance(timer, HostTimer)
    start = timer.mark()
    gpu.execute(Work(0.01), blocking=False)  # queued: the end mark waits for it
    end = timer.mark()
    times = timer.resolve()
    assert times[end] - times[start] == pytest.approx(0.01)
    assert timer.resolve() == []


class UndrivenGPU:
    """A GPU torch does not drive: an index no torch build has."""

    index = 10_000

    def __init__(self):
        self.clock = VirtualClock()
        self.synchronize_calls = 0

    def synchronize(self):
        self.synchronize_calls += 1


def test_a_device_timer_uses_host_marks_where_torch_does_not_drive_the_gpu():
    gpu = UndrivenGPU()
    timer = DeviceTimer(gpu)
    timer.mark()
    gpu.clock.advance(0.25)
    timer.mark()
    assert timer.resolve() == [0.0, 0.25] and gpu.synchronize_calls == 2
    assert not timer.uses_events


def test_nothing_imports_torch_to_time_instructions():
    code = (
        "import sys, perseus.runtime, perseus.profiler.online, perseus.devices.nvml, perseus.devices.amd\n"
        "from perseus.devices.instruction_timer import torch_cuda\n"
        "assert torch_cuda(0) is None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
