"""GPU-execution emulation: each instruction of a demo stage runs on the rank's simulated GPU.

A forward or backward does its real, tiny CPU compute, then runs the stage's `Work` on the
simulated GPU and waits for it. So the instruction takes the time and draws the power the
simulator gives at the SM clock in effect then, and an energy counter read around the
instruction (as `perseus.instrument` does) sees the busy work. The GPU work comes after the
CPU compute so that a clock the controller sets off the training thread as the instruction
begins has had that compute's time to take effect. The backward's work runs from an
autograd marker at the stage input, which the backward reaches last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU, Work
from perseus.exceptions import ConfigError
from perseus.schedules.instruction import Kind
from perseus.demo.model import StageModel


@dataclass(frozen=True)
class Span:
    """One instruction's GPU work on the measured timeline (monotonic seconds)."""

    kind: str
    microbatch: int
    start: float
    end: float
    frequency: int  # SM clock (MHz) when it was issued


class GPUEmulator:
    """Runs a stage's instructions on its simulated GPU and records when they ran."""

    def __init__(self, gpu: GPU, works: dict[Kind, Work]) -> None:
        if not isinstance(gpu, SimGPU):
            raise ConfigError(
                f"the demo emulates GPU execution on simulated GPUs, got {gpu!r}; "
                "set PERSEUS_GPU=sim:a100-sxm:4"
            )
        self.gpu = gpu
        self.works = works
        self._counts = dict.fromkeys(works, 0)
        self._spans: list[Span] = []

    def run(self, kind: Kind) -> None:
        """Run the work of the next `kind` instruction at the current clock; wait until it ends."""
        microbatch = self._counts[kind]
        self._counts[kind] = microbatch + 1
        frequency = self.gpu.sm_clock()
        start = self.gpu.clock.now()
        self.gpu.execute(self.works[kind], blocking=True)
        self._spans.append(Span(kind.value, microbatch, start, self.gpu.clock.now(), frequency))

    def take_spans(self) -> list[Span]:
        """The spans recorded since the last call; microbatch numbering restarts (a new iteration)."""
        spans, self._spans = self._spans, []
        self._counts = dict.fromkeys(self.works, 0)
        return spans


class _BackwardMarker(torch.autograd.Function):
    """Identity at the stage input; the backward reaches it last and runs the backward work there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, emulator: GPUEmulator) -> torch.Tensor:  # type: ignore[override]
        ctx.emulator = emulator
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.emulator.run(Kind.BACKWARD)
        return grad, None


class EmulatedStage(nn.Module):
    """A demo stage whose forward and backward each run on the simulated GPU."""

    def __init__(self, stage: StageModel, emulator: GPUEmulator) -> None:
        super().__init__()
        self.stage = stage
        self.emulator = emulator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage.is_first:
            x = self.stage.embed(x)
        x = _BackwardMarker.apply(x, self.emulator)
        x = self.stage.body(x)
        if self.stage.is_last:
            x = self.stage.head_out(x)
        self.emulator.run(Kind.FORWARD)
        return x
