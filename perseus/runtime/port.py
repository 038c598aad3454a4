"""What the rank side needs from the planner: `PlannerPort`.

`PerseusRank` talks to the planner service only through these methods, so the rank side depends
on this small protocol and the shared wire types, not on the client or service packages.
`perseus.client.PlannerClient` implements it over ZeroMQ; tests implement it in memory.
Implementations must never block training past their own timeout, and must not raise from
`assignment` or `report_iteration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from perseus.profiler.profile import Profile
from perseus.profiler.sweep import SweepPlan
from perseus.wire.phases import Phase
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo


class PortAssignment(Protocol):
    """What a rank runs in one iteration (`perseus.client.Assignment` is one).

    `frequencies`: one MHz value per instruction of the rank, in schedule order (phase
    PLANNED), or None: default clocks. `sweep`: the profiling sweep the service designed
    (phase PROFILING; the rank's profiler picks each iteration's step), else None."""

    @property
    def phase(self) -> Phase: ...

    @property
    def frequencies(self) -> Sequence[int] | None: ...

    @property
    def sweep(self) -> SweepPlan | None: ...

    @property
    def plan_version(self) -> int: ...

    @property
    def spans(self) -> bool:
        """The service asks for this iteration's instruction spans (`report_spans`)."""
        ...


class PlannerPort(Protocol):
    """The planner, as one rank sees it (the methods `PerseusRank` calls)."""

    def register_job(self, spec: JobSpec) -> str:
        """Register the job (rank 0) and return its id; ConfigError/ServiceError if refused."""
        ...

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        """Register this rank with job `job_id`; ConfigError/ServiceError if refused."""
        ...

    def assignment(self, iteration: int) -> PortAssignment:
        """What to run at `iteration` (counted from the first answered one). Never blocks."""
        ...

    def upload_profile(self, job_id: str, stage: int, profile: Profile) -> None:
        """Offer this rank's measured stage profile (the planner plans once every stage's is in)."""
        ...

    def report_iteration(
        self,
        job_id: str,
        rank: int,
        iteration: int,
        time_s: float,
        energy_j: float,
        compute_time_s: float | None = None,
        off_clock: int | None = None,
        closing: bool = False,
    ) -> None:
        """One iteration's measured time and energy on this rank's GPU (`closing`: its last, ended
        by close()). Never raises."""
        ...

    def report_spans(self, spans: ReportSpans) -> None:
        """One iteration's instruction spans, when the assignment asked for them. Never raises."""
        ...

    def close(self) -> None:
        """Send what is queued (bounded by the port's timeout) and stop."""
        ...
