"""Stage profiles that are overdue: no job waits forever for a profile its ranks never deliver.

A rank can fail to deliver its stage's profile (its profiler raised at the end of the sweep, it
crashed and came back, its upload was lost) and, having swept, never sweeps again on its own. The
service counts the iterations the stage's uploading ranks report (`Table` requests and iteration
reports): once they run well past the end of the sweep the service designed without the stage's
profile, the stage is asked for a fresh sweep (`Table.sweep_round` goes up, which the ranks follow
even after an upload); after `MAX_SWEEPS` sweeps the job fails (retryable: a new run tries again).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Sweeps a stage is asked for in one run of its job before the job fails.
MAX_SWEEPS = 3
#: Iterations past a sweep's longest course (every step, then as many again for the repeats the
#: rank may add, see perseus.profiler.sweep) before its profile is overdue: the upload's own
#: round trip, the table's poll and a rank that started its sweep a few iterations late.
OVERDUE_SLACK = 10


@dataclass
class StageSweep:
    """One (GPU model, stage)'s sweeps in this run of the job."""

    round: int = 0  # Table.sweep_round: a new one asks the ranks for a fresh sweep
    start: int | None = None  # the iteration (as the stage's ranks count) the round was asked at; None: the run's start
    sweeps: int = 1  # the sweeps asked of the stage in this run (the first one included)
    seen: int = -1  # the latest iteration a rank that uploads the stage's profile reached
    resumed: bool = False  # restored by a restarted service: the round counts from the next iteration seen


@dataclass(frozen=True)
class Overdue:
    """A stage whose profile did not come: asked again (`failed` False) or the job fails."""

    model: str
    stage: int
    iteration: int  # the iteration its ranks reached without the profile
    deadline: int  # the iteration by which the profile was due
    sweeps: int  # the sweeps asked of the stage so far (this one included when asked again)
    failed: bool

    def reason(self) -> str:
        what = (
            f"stage {self.stage} (GPU {self.model}): no profile by iteration {self.iteration} (its sweep ends by "
            f"iteration {self.deadline})"
        )
        if not self.failed:
            return f"{what}; its ranks are asked to profile again (sweep {self.sweeps} of {MAX_SWEEPS})"
        return (
            f"{what} after {self.sweeps} sweeps: the stage's uploading rank builds no profile or cannot deliver it. "
            "Look in that rank's log for 'Perseus failed' or 'could not build its profile' (the profiler's reason, "
            "e.g. profile longer: ProfilingSettings.iterations_per_frequency), fix it and start the job again (a new "
            "run profiles it afresh)"
        )


class SweepWatch:
    """The sweep of every (GPU model, stage) of one job: its round, and whether it is overdue.

    Bounded: one entry per (GPU model, stage) a rank that uploads registered for."""

    def __init__(self, warmup_iterations: int) -> None:
        self.warmup_iterations = warmup_iterations
        self.stages: dict[tuple[str, int], StageSweep] = {}

    def round(self, model: str, stage: int) -> int:
        entry = self.stages.get((model, stage))
        return 0 if entry is None else entry.round

    def deadline(self, entry: StageSweep, steps: int) -> int:
        """The iteration by which a round's profile is due (`steps`: the sweep's steps)."""
        first = self.warmup_iterations if entry.start is None else entry.start
        return first + 2 * steps + OVERDUE_SLACK

    def note(self, model: str, stage: int, iteration: int, steps: int) -> Overdue | None:
        """An uploading rank of the unprofiled (`model`, `stage`) reached `iteration` of a sweep of
        `steps` steps; an Overdue once the round's profile is late (the round then moves on, or
        the job is to fail)."""
        entry = self.stages.setdefault((model, stage), StageSweep())
        entry.seen = max(entry.seen, iteration)
        if entry.resumed:
            entry.start, entry.resumed = entry.seen, False
        deadline = self.deadline(entry, steps)
        if entry.seen <= deadline:
            return None
        if entry.sweeps >= MAX_SWEEPS:
            return Overdue(model, stage, entry.seen, deadline, entry.sweeps, failed=True)
        entry.round += 1
        entry.sweeps += 1
        entry.start = entry.seen
        return Overdue(model, stage, entry.seen, deadline, entry.sweeps, failed=False)

    def resweep(self, models: set[str], stages: int, iteration: int) -> None:
        """The profiles of these GPU models were dropped at `iteration`: each of their `stages`
        stages sweeps afresh, its ranks' earlier uploads notwithstanding."""
        for model in models:
            for stage in range(stages):
                entry = self.stages.setdefault((model, stage), StageSweep())
                entry.round += 1
                entry.start = max(entry.seen, iteration, 0)
                entry.sweeps = 1

    def restore(self, model: str, stage: int, sweep_round: int) -> None:
        """The round a saved job's stage was at (its ranks may hold an upload of it)."""
        self.stages[(model, stage)] = StageSweep(round=sweep_round, resumed=True)

    def new_run(self) -> None:
        """A new run of the job's ranks counts iterations from 0 and gets its sweeps afresh; the
        rounds only go up (a rank that stayed follows the service's round, not a count of its own)."""
        for entry in self.stages.values():
            entry.start, entry.sweeps, entry.seen, entry.resumed = None, 1, -1, False
