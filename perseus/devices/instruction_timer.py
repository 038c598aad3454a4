"""When each instruction ran on the GPU, without stalling the host's issue-ahead.

A training loop issues GPU work ahead of the GPU: the host returns from an instruction's hooks
long before its kernels ran. Reading the host clock around an instruction therefore needs a
device synchronisation on each side, which drains the queue the framework keeps full and
perturbs the very iteration being measured. An `InstructionTimer` instead places marks in the
GPU's work order and tells their times once per iteration (`resolve`, where the rank already
synchronises), as instants on the host clock, so they compare with clock changes and step
starts.

- `EventTimer`: a CUDA event (`enable_timing=True`) recorded on the device's current stream per
  mark; at `resolve`, after one synchronisation, one more event recorded at a known host instant
  anchors them: host time = anchor host time + (event - anchor), the GPU's elapsed times taken
  from the first mark (never negative). ROCm's torch
  exposes HIP events through the same `torch.cuda` API.
- `HostTimer`: synchronise and read the GPU's clock per mark. Exact for a simulated GPU (its work
  runs on that clock), and what a GPU torch does not drive falls back to.
- `DeviceTimer`: events once torch drives the GPU (checked at the first mark after each
  `resolve`: a model may reach the GPU after the rank is built), host marks before.

torch is optional: nothing here imports it; `torch_cuda` looks at an already-imported one.
"""

from __future__ import annotations

import abc
import sys
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from perseus.clock import Clock
    from perseus.devices.gpu import GPU

#: A mark: its position among the marks since the last `resolve` (an index into what it returns).
Mark = int


class InstructionTimer(abc.ABC):
    """Marks in a GPU's work order, told as host-clock instants once per iteration."""

    @abc.abstractmethod
    def mark(self) -> Mark:
        """An instant in the GPU's work order: when the GPU reaches what the host issued so far."""

    @abc.abstractmethod
    def resolve(self) -> list[float]:
        """Host-clock times (s) of every mark since the last call, in mark order; starts over.
        Waits for the GPU to reach the last mark."""


class HostTimer(InstructionTimer):
    """A device synchronisation and the GPU's clock per mark (see the module docstring)."""

    def __init__(self, gpu: GPU) -> None:
        self.gpu = gpu
        self._times: list[float] = []

    def mark(self) -> Mark:
        self.gpu.synchronize()
        self._times.append(self.gpu.clock.now())
        return len(self._times) - 1

    def resolve(self) -> list[float]:
        times, self._times = self._times, []
        return times


class TimingEvent(Protocol):
    """What a timer needs of a `torch.cuda.Event`."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class EventBackend(Protocol):
    """What a timer needs of `torch.cuda` (tests pass a fake)."""

    def Event(self, enable_timing: bool = False) -> TimingEvent: ...

    def current_stream(self, device: Any = None) -> Any: ...

    def synchronize(self, device: Any = None) -> None: ...


class EventTimer(InstructionTimer):
    """Timing events on device `index`'s current stream, anchored to `clock` at `resolve` (see
    the module docstring). `backend`: `torch.cuda`, or anything with its `Event`,
    `current_stream` and `synchronize`. Events are reused from one iteration to the next."""

    def __init__(self, index: int, clock: Clock, backend: EventBackend) -> None:
        self.index = index
        self.clock = clock
        self.backend = backend
        self._events: list[TimingEvent] = []  # every event made so far; the first `_count` are this iteration's marks
        self._count = 0
        self._anchor: TimingEvent | None = None

    def _event(self) -> TimingEvent:
        return self.backend.Event(enable_timing=True)

    def mark(self) -> Mark:
        if self._count == len(self._events):
            self._events.append(self._event())
        event = self._events[self._count]
        event.record(self.backend.current_stream(self.index))
        self._count += 1
        return self._count - 1

    def resolve(self) -> list[float]:
        marks, self._count = self._events[: self._count], 0  # starts over even if reading them fails
        if not marks:
            return []
        if self._anchor is None:
            self._anchor = self._event()
        self.backend.synchronize(self.index)  # the queue is empty: the anchor's time is when it is recorded
        before = self.clock.now()
        self._anchor.record(self.backend.current_stream(self.index))
        host = (before + self.clock.now()) / 2
        self._anchor.synchronize()
        # Elapsed times from the first mark, never negative: host = anchor's host time + (event - anchor).
        first = marks[0]
        origin = host - first.elapsed_time(self._anchor) / 1000.0
        return [origin + first.elapsed_time(event) / 1000.0 for event in marks]


class DeviceTimer(InstructionTimer):
    """A GPU torch may drive: `EventTimer` once it does, `HostTimer` before (see the module docstring)."""

    def __init__(self, gpu: GPU) -> None:
        self.gpu = gpu
        self._host = HostTimer(gpu)
        self._events: EventTimer | None = None
        self._current: InstructionTimer | None = None  # chosen at the first mark after a resolve

    @property
    def uses_events(self) -> bool:
        return self._events is not None

    def mark(self) -> Mark:
        if self._current is None:
            if self._events is None:
                backend = torch_cuda(self.gpu.index)
                if backend is not None:
                    self._events = EventTimer(self.gpu.index, self.gpu.clock, backend)
            self._current = self._events or self._host
        return self._current.mark()

    def resolve(self) -> list[float]:
        current, self._current = self._current, None
        return [] if current is None else current.resolve()


def torch_cuda(index: int) -> EventBackend | None:
    """`torch.cuda` if an already-imported torch drives GPU `index` (CUDA, or ROCm's HIP behind
    the same name), else None. Importing torch to find out would cost seconds, and a program that
    launches GPU work has imported it; a torch whose GPU runtime cannot be asked drives nothing."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        driven = torch.cuda.is_initialized() and index < torch.cuda.device_count()
    except Exception:  # no driver, a broken install: nothing queued
        return None
    return torch.cuda if driven else None
