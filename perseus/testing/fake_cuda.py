"""The part of `torch.cuda` an `EventTimer` uses, without a GPU: for tests only.

Pass it to `EventTimer(index, clock, FakeCuda(clock))` (no global torch is touched), or use
`EventTimedSimGPU`, a simulated GPU whose rank times its instructions that way. The test
places GPU work on the one stream with `run(seconds)`: the host does not wait for it, as a
training loop issues kernels ahead of the GPU. An event recorded on the stream takes its time
when the GPU reaches it (after the work queued before it); like CUDA's, only differences between
two finished events can be read (`elapsed_time`). It counts what a timer must do rarely: device
synchronisations and events made.
"""

from __future__ import annotations

import math
from typing import Any

from perseus.clock import Clock
from perseus.devices.instruction_timer import EventTimer, InstructionTimer
from perseus.devices.sim import SimGPU


class FakeStream:
    """The device's current stream: GPU work queued until `busy_until` (host-clock seconds)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.busy_until = -math.inf


class FakeEvent:
    """A timing event: recorded on a stream, done once the host clock passes when the GPU reached it."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool) -> None:
        self.cuda = cuda
        self.enable_timing = enable_timing
        self.reached: float | None = None  # host-clock time the GPU reached it
        self.records = 0

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.cuda.stream
        self.reached = max(self.cuda.clock.now(), stream.busy_until)
        self.records += 1

    def synchronize(self) -> None:
        if self.reached is None:
            raise RuntimeError("event synchronized before it was recorded")
        self.cuda.clock.sleep(max(0.0, self.reached - self.cuda.clock.now()))

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds from this event to `end_event` on the GPU's clock; both must be done, as CUDA requires."""
        for event in (self, end_event):
            if not event.enable_timing:
                raise RuntimeError("elapsed_time of an event made without enable_timing=True")
            if event.reached is None or event.reached > self.cuda.clock.now():
                raise RuntimeError("elapsed_time of an event the GPU has not reached (cudaErrorNotReady)")
        assert self.reached is not None and end_event.reached is not None
        return (end_event.reached - self.reached) * 1000.0


class FakeCuda:
    """`Event`, `current_stream` and `synchronize` over one device's stream (see the module docstring)."""

    def __init__(self, clock: Clock, device: int = 0) -> None:
        self.clock = clock
        self.device = device
        self.stream = FakeStream(device)
        self.synchronize_calls = 0
        self.events_made = 0

    def run(self, seconds: float) -> None:
        """Queue `seconds` of GPU work on the stream; the host goes on at once."""
        self.stream.busy_until = max(self.stream.busy_until, self.clock.now()) + seconds

    def Event(self, enable_timing: bool = False) -> FakeEvent:
        self.events_made += 1
        return FakeEvent(self, enable_timing)

    def current_stream(self, device: int | None = None) -> FakeStream:
        if device != self.device:
            raise RuntimeError(f"asked for device {device}'s stream; this fake is device {self.device}")
        return self.stream

    def synchronize(self, device: int | None = None) -> None:
        self.synchronize_calls += 1
        self.clock.sleep(max(0.0, self.stream.busy_until - self.clock.now()))


class EventTimedSimGPU(SimGPU):
    """A simulated GPU timed as a CUDA one is: its instruction timer records `FakeCuda` events
    (`cuda`), and the test may queue work on `cuda` that the host does not wait for (it counts
    towards `synchronize`, as torch's queue does). Counts its device synchronisations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.synchronize_calls = 0
        super().__init__(*args, **kwargs)
        self.cuda = FakeCuda(self.clock, device=self.index)

    def instruction_timer(self) -> InstructionTimer:
        return EventTimer(self.index, self.clock, self.cuda)

    def synchronize(self) -> None:
        self.synchronize_calls += 1
        self.clock.sleep(max(0.0, self.cuda.stream.busy_until - self.clock.now()))
        super().synchronize()
