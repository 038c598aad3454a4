"""Instructions and schedules: what each pipeline stage runs, in order."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from perseus.exceptions import ScheduleError


class Kind(str, enum.Enum):
    """What an instruction computes. Values are the names used in profiles and plan files."""

    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"  # zero-bubble: input-gradient half of the backward (I)
    BACKWARD_WEIGHT = "backward_weight"  # zero-bubble: weight-gradient half of the backward (W)

    def __str__(self) -> str:
        return self.value


KIND_LETTERS = {
    Kind.FORWARD: "F",
    Kind.BACKWARD: "B",
    Kind.BACKWARD_INPUT: "I",
    Kind.BACKWARD_WEIGHT: "W",
}

# How model chunks are laid out over ranks. "loop": virtual stage = chunk * N + rank (Megatron's
# interleaving); "v": chunks zig-zag, so even chunks run rank 0 -> N-1 and odd chunks N-1 -> 0
# (torch's ScheduleZBVZeroBubble and ScheduleDualPipeV).
STYLES = ("loop", "v")


@dataclass(frozen=True, order=True)
class Instruction:
    """One computation of one microbatch on one pipeline stage (rank); `chunk` for interleaving."""

    stage: int
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        c = f".c{self.chunk}" if self.chunk else ""
        return f"{KIND_LETTERS[self.kind]}{self.microbatch}@s{self.stage}{c}"


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered instruction lists. `stages[s]` is what stage (rank) s runs, in order.

    With `num_chunks` > 1 every rank holds several model chunks; `style` says which virtual
    (model) stage a (rank, chunk) pair is, see `virtual_stage`.

    `overlapped[s]`: positions in `stages[s]` of instructions that run overlapped with the next
    one (torch's OVERLAP_F_B): what they send to other stages leaves only once that next one has
    run too.
    """

    name: str
    num_microbatches: int
    stages: tuple[tuple[Instruction, ...], ...]
    num_chunks: int = 1
    style: str = "loop"
    overlapped: tuple[tuple[int, ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.stages) * self.num_chunks

    def instructions(self) -> list[Instruction]:
        return [ins for stage in self.stages for ins in stage]

    def virtual_stage(self, ins: Instruction) -> int:
        """The model partition `ins` computes: its position in the forward chain."""
        n = len(self.stages)
        if self.style == "v" and ins.chunk % 2 == 1:
            return ins.chunk * n + (n - 1 - ins.stage)
        return ins.chunk * n + ins.stage

    def placement(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) that runs a virtual stage; the inverse of `virtual_stage`."""
        n = len(self.stages)
        chunk, offset = divmod(virtual_stage, n)
        if self.style == "v" and chunk % 2 == 1:
            return n - 1 - offset, chunk
        return offset, chunk

    def validate(self) -> None:
        """Check that every virtual stage runs each microbatch's forward once and its backward
        once (as B, or as I then W), on the right rank. Raises ScheduleError naming the culprit."""
        if self.style not in STYLES:
            raise ScheduleError(f"schedule {self.name!r}: unknown style {self.style!r}; use one of {STYLES}")
        if not self.stages:
            raise ScheduleError(f"schedule {self.name!r} has no stages")
        if self.num_microbatches < 1 or self.num_chunks < 1:
            raise ScheduleError(
                f"schedule {self.name!r}: need at least one microbatch and one chunk, got "
                f"{self.num_microbatches} microbatches and {self.num_chunks} chunks"
            )
        if self.overlapped and len(self.overlapped) != len(self.stages):
            raise ScheduleError(
                f"schedule {self.name!r}: overlapped lists {len(self.overlapped)} stages, the schedule has "
                f"{len(self.stages)}"
            )
        for rank, positions in enumerate(self.overlapped):
            last = len(self.stages[rank]) - 2
            if any(not 0 <= i <= last for i in positions) or list(positions) != sorted(set(positions)):
                raise ScheduleError(
                    f"schedule {self.name!r}: stage {rank}'s overlapped positions {list(positions)[:8]} must be "
                    f"distinct, increasing and in 0..{last} (an instruction overlapped with the next one)"
                )
        seen: Counter[tuple[int, Kind, int]] = Counter()
        for rank, row in enumerate(self.stages):
            for ins in row:
                if ins.stage != rank:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {ins} is listed on stage {rank}; its stage field must equal the rank "
                        "that runs it"
                    )
                if not 0 <= ins.chunk < self.num_chunks:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {ins} has chunk {ins.chunk}, outside 0..{self.num_chunks - 1}"
                    )
                if not 0 <= ins.microbatch < self.num_microbatches:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {ins} has microbatch {ins.microbatch}, outside "
                        f"0..{self.num_microbatches - 1}"
                    )
                key = (self.virtual_stage(ins), ins.kind, ins.microbatch)
                seen[key] += 1
                if seen[key] > 1:
                    raise ScheduleError(f"schedule {self.name!r}: {ins} appears more than once on stage {rank}")
        for vs in range(self.num_virtual_stages):
            rank, chunk = self.placement(vs)
            for m in range(self.num_microbatches):
                name = f"microbatch {m} on stage {rank} chunk {chunk}"
                if not seen[(vs, Kind.FORWARD, m)]:
                    raise ScheduleError(f"schedule {self.name!r}: no forward for {name}")
                full = seen[(vs, Kind.BACKWARD, m)]
                split_i, split_w = seen[(vs, Kind.BACKWARD_INPUT, m)], seen[(vs, Kind.BACKWARD_WEIGHT, m)]
                if not ((full and not split_i and not split_w) or (not full and split_i and split_w)):
                    raise ScheduleError(
                        f"schedule {self.name!r}: {name} needs either one backward (B) or one "
                        f"backward_input (I) and one backward_weight (W); it has B={full}, I={split_i}, W={split_w}"
                    )
