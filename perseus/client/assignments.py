"""What a rank runs in each iteration, from the latest table the planner service sent.

`RankState` is what the two threads of a `PlannerClient` share: the training thread writes who
the rank is and reads its assignments; the connection thread writes the view of each new table.
Each field is one reference, replaced whole (atomic under the GIL), so neither thread locks.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from perseus.profiler.profile import KINDS
from perseus.profiler.sweep import SweepPlan
from perseus.wire.messages import Table
from perseus.wire.phases import JobPhase, Phase
from perseus.wire.spec import JobSpec, RankInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """What a rank runs in one iteration.

    `frequencies`: one MHz value per instruction of the rank, in schedule order (phase planned),
    or None: leave clocks at maximum/default. `sweep`: the profiling sweep the service designed
    (phase profiling; the rank picks each iteration's step, see perseus.profiler.sweep), else
    None. `spans`: the service asks for this
    iteration's instruction spans (it is calibrating its model of the job, or checking it in a
    reference window). `sweep_round`: the
    service's round of the sweep (Table.sweep_round); a new one asks for a fresh sweep, whatever
    the rank swept before. `profiled_stages`: while the rank waits for its plan, the stages
    whose profiles the service has (the plan waits for the others). Shared between calls: do not
    mutate.
    """

    phase: Phase
    frequencies: list[int] | None
    sweep: SweepPlan | None
    plan_version: int
    spans: bool = False
    sweep_round: int = 0
    profiled_stages: tuple[int, ...] = ()  # phase planning: the stages profiled so far


UNPLANNED = Assignment(Phase.UNPLANNED, None, None, 0)


@dataclass(frozen=True)
class View:
    """A rank's table, as prebuilt Assignments: `RankState.assignment()` only picks one."""

    warmup_iterations: int
    profiling: Assignment | None  # the sweep, while the rank's stage is unprofiled
    stage_profiled: bool
    plan: Assignment | None
    plan_start: int
    previous: Assignment | None  # the plan held before `plan`, run until `plan_start`
    warmup: Assignment
    waiting: Assignment  # after the sweep until a plan starts; UNPLANNED if planning failed
    upload: bool  # this rank uploads its stage profile (Table.upload)
    sweep_round: int  # Table.sweep_round


class RankState:
    """One rank: its registration, the latest iteration it asked about, its latest table."""

    def __init__(self) -> None:
        self.spec: JobSpec | None = None  # the job, if this rank registered it
        self.job_id: str | None = None
        self.info: RankInfo | None = None
        self.iteration = -1
        self.uploaded_round: int | None = None  # the sweep round the rank offered its stage profile in
        self.view: View | None = None
        self.plan_arrived = threading.Event()
        self._warned: set[str] = set()

    def assignment(self, iteration: int) -> Assignment:
        """What to run at `iteration`. Never blocks."""
        self.iteration = iteration
        view = self.view
        if view is None:
            return UNPLANNED
        if view.plan is not None and iteration >= view.plan_start:
            return view.plan
        if view.previous is not None:
            return view.previous  # a re-plan (a straggler came or went) starts at plan_start
        if iteration < view.warmup_iterations:
            return view.warmup
        if view.profiling is not None and not view.stage_profiled and not self.swept(view.sweep_round):
            return view.profiling
        return view.waiting

    def swept(self, sweep_round: int) -> bool:
        """The rank offered its profile in this round of the sweep or a later one: it does not sweep
        again unless the service asks a later round (its profile never arrived)."""
        return self.uploaded_round is not None and self.uploaded_round >= sweep_round

    def offered(self) -> None:
        """The rank offered its stage profile (the training thread calls this): its sweep is over."""
        view = self.view
        self.uploaded_round = view.sweep_round if view is not None else 0

    def known_plan_version(self) -> int:
        view = self.view
        return view.plan.plan_version if view is not None and view.plan is not None else 0

    def apply_table(self, table: Table) -> None:
        """Take a table the service sent this rank (the connection thread calls this)."""
        old = self.view
        info = self.info
        assert info is not None
        version = table.plan_version
        plan = None
        previous = old.previous if old is not None else None
        if version and table.frequencies is not None:
            if table.reference:  # the service may ask for a reference window's spans
                plan = Assignment(Phase.REFERENCE, list(table.frequencies), None, version, table.spans)
            else:
                plan = Assignment(Phase.PLANNED, list(table.frequencies), None, version)
            if (
                old is not None
                and old.plan is not None
                and old.plan.plan_version != version
                and self.iteration >= old.plan_start
            ):
                previous = old.plan
        elif version and old is not None and old.plan is not None and old.plan.plan_version == version:
            plan = old.plan
        if plan is None or table.plan_start_iteration == 0:
            previous = None
        failed = table.phase == JobPhase.FAILED.value  # no plan will come: no sweep either
        spans = table.spans
        profiling = None
        if table.sweep_steps and not failed:
            steps = tuple(dict(zip(KINDS, step)) for step in table.sweep_steps)
            sweep = old.profiling.sweep if old is not None and old.profiling is not None else None
            if sweep is None or sweep.steps != steps:  # the same plan object while the sweep is the same
                sweep = SweepPlan(table.sweep_frequencies, table.iterations_per_frequency, steps)
            profiling = Assignment(Phase.PROFILING, None, sweep, version, spans, table.sweep_round)
        self.view = View(
            warmup_iterations=table.warmup_iterations,
            profiling=profiling,
            stage_profiled=info.stage in table.profiled_stages,
            plan=plan,
            plan_start=table.plan_start_iteration,
            previous=previous,
            warmup=UNPLANNED if failed else Assignment(Phase.WARMUP, None, None, version, spans),
            waiting=(
                UNPLANNED
                if failed
                else Assignment(Phase.PLANNING, None, None, version, spans, profiled_stages=table.profiled_stages)
            ),
            upload=table.upload,
            sweep_round=table.sweep_round,
        )
        if plan is not None and (old is None or old.plan is not plan):
            log.info(
                "rank %d: plan v%d received (applies from iteration %d)", info.rank, version, table.plan_start_iteration
            )
            self.plan_arrived.set()
        if failed and self.first_time("failed"):
            log.warning("planner service could not plan this job (%s); this rank runs at maximum clocks", table.error)

    def first_time(self, warning: str) -> bool:
        """True the first time `warning` comes up: each is logged once (a rank must not flood the log)."""
        if warning in self._warned:
            return False
        self._warned.add(warning)
        return True
