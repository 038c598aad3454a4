"""GPU-execution emulation: each instruction of a demo stage runs on the rank's simulated GPU.

A forward or backward launches the stage's `Work` on the simulated GPU as it starts (like a
CUDA kernel launch), does its real, tiny CPU compute meanwhile, and waits for the GPU at its
end. So the instruction takes the time and draws the power the simulator gives, and an
energy counter read around the instruction (as `perseus.instrument` does) sees the busy
work. The backward uses two autograd markers: one at the stage output launches the work
when the backward reaches it, one at the stage input waits for it.

The work runs as a stream of short slices, each at the SM clock in effect just before it
starts, the way a real GPU's clock change takes effect mid-kernel: Perseus' controller sets
clocks off the training thread, so a new clock lands a moment after the instruction began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from perseus.demo.model import StageModel
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.schedules.instruction import Kind


@dataclass(frozen=True)
class Span:
    """One instruction's GPU work on the measured timeline (monotonic seconds)."""

    kind: str
    microbatch: int
    start: float
    end: float
    frequency: int  # the SM clock (MHz) most of its work ran at


#: Nominal GPU time (at the highest clock) of one slice of an instruction's work.
SLICE_S = 0.004
#: The next slice is queued this long before the current one ends, so the slices run back to
#: back even when the training thread wakes up late.
LEAD_S = 0.0025


class GPUEmulator:
    """Runs a stage's instructions on its simulated GPU and records when they ran."""

    def __init__(self, gpu: GPU, works: dict[Kind, Work]) -> None:
        if not isinstance(gpu, SimGPU):
            raise ConfigError(
                f"the demo emulates GPU execution on simulated GPUs, got {gpu!r}; set PERSEUS_GPU=sim:a100-sxm:4"
            )
        self.gpu = gpu
        self.works = works
        self._slices = {kind: max(1, round(work.time_s / SLICE_S)) for kind, work in works.items()}
        self._counts = dict.fromkeys(works, 0)
        self._spans: list[Span] = []
        # The instruction in flight: kind, microbatch, start, slices left, GPU time per clock.
        self._kind: Kind | None = None
        self._microbatch = 0
        self._start = 0.0
        self._left = 0
        self._end = 0.0
        self._busy: dict[int, float] = {}

    def launch(self, kind: Kind) -> None:
        """Start the work of the next `kind` instruction; returns at once."""
        self._microbatch = self._counts[kind]
        self._counts[kind] += 1
        self._kind, self._left, self._busy = kind, self._slices[kind], {}
        self._start = self._end = self.gpu.clock.now()
        self._issue()

    def wait(self) -> None:
        """Run the rest of the launched work and wait until it has finished: the instruction's end."""
        if self._kind is None:
            return
        clock = self.gpu.clock
        while self._left:
            ahead = self._end - LEAD_S - clock.now()
            if ahead > 0:
                clock.sleep(ahead)
            self._issue()
        self.gpu.synchronize()
        frequency = max(self._busy, key=lambda f: (self._busy[f], -f))
        self._spans.append(Span(self._kind.value, self._microbatch, self._start, clock.now(), frequency))
        self._kind = None

    def take_spans(self) -> list[Span]:
        """The spans recorded since the last call; microbatch numbering restarts (a new iteration)."""
        spans, self._spans = self._spans, []
        self._counts = dict.fromkeys(self.works, 0)
        return spans

    def _issue(self) -> None:
        """Queue the next slice behind the previous one, at the clock in effect now."""
        assert self._kind is not None
        work = self.works[self._kind]
        n = self._slices[self._kind]
        frequency = self.gpu.sm_clock()
        now = self.gpu.clock.now()
        duration = self.gpu.execute(Work(work.time_s / n, work.alpha, work.intensity), blocking=False)
        self._end = max(now, self._end) + duration
        self._busy[frequency] = self._busy.get(frequency, 0.0) + duration
        self._left -= 1


class _OnBackward(torch.autograd.Function):
    """Identity that calls `hook` when the backward reaches it: at the stage output (reached
    first) it launches the backward's work, at the stage input (reached last) it waits for it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hook: Callable[[], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hook()
        return grad, None


class EmulatedStage(nn.Module):
    """A demo stage whose forward and backward each run on the simulated GPU."""

    def __init__(self, stage: StageModel, emulator: GPUEmulator) -> None:
        super().__init__()
        self.stage = stage
        self.emulator = emulator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.emulator.launch(Kind.FORWARD)
        if self.stage.is_first:
            x = self.stage.embed(x)
        x = _OnBackward.apply(x, self.emulator.wait)
        x = self.stage.body(x)
        if self.stage.is_last:
            x = self.stage.head_out(x)
        x = _OnBackward.apply(x, self._launch_backward)
        self.emulator.wait()
        return x

    def _launch_backward(self) -> None:
        self.emulator.launch(Kind.BACKWARD)
