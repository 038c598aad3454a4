"""Rank 0's progress display: a one-line bar on a terminal, log lines otherwise."""

from __future__ import annotations

import sys
from typing import TextIO

from perseus.wire.phases import Phase

BAR_WIDTH = 24


class Progress:
    """Shows phase, what clocks run and iteration. Log lines only when the phase or clocks change."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self._last: tuple[Phase, int | None, int, tuple[int, ...]] | None = None
        self._open_line = False

    def update(
        self,
        iteration: int,
        phase: Phase,
        frequency: int | None = None,
        done: int | None = None,
        total: int | None = None,
        plan_version: int = 0,
        at_most: bool = False,
        waiting: tuple[int, ...] = (),
        repeats: int = 0,
        job_iteration: int | None = None,
    ) -> None:
        """`done`/`total`: progress through the profiling sweep (frequencies profiled / to
        profile); `at_most`: `total` is an upper bound (the sweep may stop early, once lower
        clocks only cost more); `repeats`: clocks profiled again since, where their energy was
        still uncertain (so a line at "28 of 28" that moves on is not stuck). `plan_version`: the
        plan this iteration runs (phase planned). `waiting`: the stages whose profiles the plan
        still waits for (phase planning). `job_iteration`: the iteration as the planner counts it
        (from the rank's first it answered), said beside this rank's where they differ."""
        if phase == Phase.PLANNED and plan_version:
            clock = f"plan v{plan_version}'s clocks"
        elif phase == Phase.REFERENCE:
            clock = "maximum clocks (verification's reference window)"
        else:
            clock = "default clocks" if frequency is None else f"{frequency} MHz"
        bound = "at most " if at_most else ""
        again = f", {repeats} again where energy is uncertain" if repeats and phase == Phase.PROFILING else ""
        sweep = f" [{done} of {bound}{total} clocks{again}]" if done is not None and total else ""
        if waiting and phase == Phase.PLANNING:
            stages = ", ".join(map(str, waiting))
            sweep += f", waiting for stage{'s' if len(waiting) > 1 else ''} {stages} to be profiled"
        if job_iteration is not None and job_iteration != iteration:
            iteration_text = f"{iteration} (the planner's {job_iteration})"
        else:
            iteration_text = str(iteration)
        if self._tty:
            bar = ""
            if done is not None and total:
                filled = round(BAR_WIDTH * done / total)
                bar = " |" + "#" * filled + "-" * (BAR_WIDTH - filled) + "|"
            self._stream.write(f"\r\x1b[2K[perseus] {phase:<9} {clock:>14}  iteration {iteration_text}{bar}{sweep}")
            self._stream.flush()
            self._open_line = True
            return
        key = (phase, frequency, plan_version, waiting if phase == Phase.PLANNING else ())
        if key != self._last:
            self._stream.write(f"[perseus] iteration {iteration_text}: {phase} at {clock}{sweep}\n")
            self._stream.flush()
        self._last = key

    def close(self) -> None:
        if self._open_line:
            self._stream.write("\n")
            self._stream.flush()
            self._open_line = False
