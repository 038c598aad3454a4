"""The phase vocabularies of the wire protocol.

`Phase` is what one rank does in one iteration: the rank side's only phase vocabulary (the
client's `Assignment.phase`, `PerseusRank.phase`, `IterationRecord.phase`). `JobPhase` is a
different concept: the state of a whole job at the planner service (`JobStatus.phase`, the
phase in register and upload replies).
"""

from __future__ import annotations

import enum


class WireName(str, enum.Enum):
    """A wire name: str() and f-strings give the value ("planned"), as on the wire."""

    def __str__(self) -> str:
        return self.value


class Phase(WireName):
    """What a rank does in one iteration (the rank side's one phase vocabulary)."""

    UNPLANNED = "unplanned"  # no table from the service (unreachable, or planning failed): max clocks
    WARMUP = "warmup"  # max clocks, not measured
    PROFILING = "profiling"  # a step of the service's sweep: each instruction kind at its clock
    PLANNING = "planning"  # profile uploaded (or sweep over): max clocks until the plan arrives
    PLANNED = "planned"  # the plan's frequency for each instruction
    REFERENCE = "reference"  # max clocks for one window while a plan runs: verification's fresh target, no saving


class JobPhase(WireName):
    """Where a job is, as the service sees it: the job's state at the planner service.

    Not a rank's per-iteration phase (that is `Phase`): a job is PROFILING while its ranks warm
    up and sweep, and each rank moves on to PLANNING once its own stage is profiled, while the
    job stays PROFILING until every stage is.
    """

    PROFILING = "profiling"  # waiting for every stage's profile (ranks warm up, then sweep)
    PLANNING = "planning"  # every stage profiled; the planner is running
    PLANNED = "planned"  # a plan is published
    FAILED = "failed"  # the planner rejected the profile or schedule; ranks stay at max clocks


#: JobPhase values, as replies carry them.
JOB_PHASES = tuple(p.value for p in JobPhase)
