"""Instructions and schedules: what each pipeline stage runs, in order."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an instruction computes. Values are the names used in profiles and plan files."""

    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"  # zero-bubble: input-gradient half of the backward (I)
    BACKWARD_WEIGHT = "backward_weight"  # zero-bubble: weight-gradient half of the backward (W)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class Instruction:
    """One computation of one microbatch on one pipeline stage (rank); `chunk` for interleaving."""

    stage: int
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        letter = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
        c = f".c{self.chunk}" if self.chunk else ""
        return f"{letter[self.kind.value]}{self.microbatch}@s{self.stage}{c}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered instruction lists. `stages[s]` is what stage (rank) s runs, in order."""

    name: str
    num_microbatches: int
    stages: tuple[tuple[Instruction, ...], ...]
    num_chunks: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def instructions(self) -> list[Instruction]:
        return [ins for stage in self.stages for ins in stage]
