"""One job's state machine: ranks, profiling sweep, stage profiles, the published plan, measurements.

No sockets and no threads: the service calls these methods from its loop thread only.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from perseus.exceptions import ServiceError
from perseus.profiler.profile import Profile
from perseus.schedules import Schedule
from perseus.server.planning import PlanResult, check_stage_profile, job_schedule, merge_profiles
from perseus.server.protocol import ErrorCode, JobPhase, JobSpec, JobStatus, RankInfo, ReportIteration, Table
from perseus.server.tally import IterationTally, Mean, Measured

log = logging.getLogger(__name__)

# A new plan starts this many iterations after the latest one any rank has reached, so that every
# rank (polling a few times per iteration) switches at the same iteration boundary.
PLAN_LEAD_ITERATIONS = 2


def _bad_field(message: str) -> ServiceError:
    return ServiceError(ErrorCode.BAD_FIELD.value, message)


@dataclass(frozen=True)
class PublishedPlan(PlanResult):
    """A plan as ranks see it: its version and the iteration it applies from (job.json's "plan")."""

    version: int
    start_iteration: int

    @classmethod
    def from_record(cls, doc: dict[str, Any]) -> PublishedPlan:
        return cls(**{**doc, "stage_frequencies": tuple(tuple(int(f) for f in row) for row in doc["stage_frequencies"])})


class Job:
    def __init__(self, spec: JobSpec, *, cached_profile: Profile | None = None) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.schedule: Schedule = job_schedule(spec)
        self.ranks: dict[int, RankInfo] = {}
        self.profiles: dict[int, Profile] = {}
        self.cached_profile = cached_profile
        self.sweep: tuple[int, ...] | None = () if cached_profile is not None else spec.sweep_frequencies
        self.phase = JobPhase.PLANNING if cached_profile is not None else JobPhase.PROFILING
        self.error = ""
        self.plan: PublishedPlan | None = None
        self.last_version = 0
        self.last_iteration = -1
        self._reset_measurements()

    def _reset_measurements(self) -> None:
        self.tally = IterationTally(self.spec.world_size)
        self.baseline = Mean()
        self.planned = Mean()

    # ---- ranks --------------------------------------------------------------------------------

    def add_rank(self, info: RankInfo) -> None:
        spec = self.spec
        for name, value, limit, what in (
            ("rank", info.rank, spec.world_size, "world_size"),
            ("stage", info.stage, spec.pp, "pp"),
            ("dp_index", info.dp_index, spec.dp, "dp"),
            ("tp_index", info.tp_index, spec.tp, "tp"),
        ):
            if value >= limit:
                raise _bad_field(f"RankInfo.{name} is {value}, but job {self.job_id} has {what}={limit}; use 0..{limit - 1}")
        if info.gpu_model != spec.gpu_model:
            raise _bad_field(
                f"rank {info.rank} has GPU {info.gpu_model!r} but job {self.job_id} was registered for {spec.gpu_model!r}; "
                "profiles are per GPU model, so run a job on one model (or register a separate job)"
            )
        coords = (info.stage, info.dp_index, info.tp_index)
        for other in self.ranks.values():
            if other.rank != info.rank and (other.stage, other.dp_index, other.tp_index) == coords:
                raise _bad_field(f"rank {info.rank} and rank {other.rank} both claim stage {info.stage}, dp_index {info.dp_index}, tp_index {info.tp_index}")
        if self.sweep is None:
            self.sweep = info.frequencies
        missing = sorted(set(self.sweep) - set(info.frequencies), reverse=True)
        if missing:
            raise _bad_field(
                f"rank {info.rank}'s GPU does not support sweep frequencies {missing[:8]} MHz; "
                "set JobSpec.sweep_frequencies to frequencies every rank supports"
            )
        self.ranks[info.rank] = info

    def rank(self, rank: int) -> RankInfo:
        if rank not in self.ranks:
            raise ServiceError(ErrorCode.UNKNOWN_RANK.value, f"rank {rank} has not registered with job {self.job_id}; call register_rank first")
        return self.ranks[rank]

    def note_iteration(self, iteration: int) -> None:
        self.last_iteration = max(self.last_iteration, iteration)

    def rerun(self) -> None:
        """The job registered again (a restart starts from iteration 0): apply any plan at once."""
        if self.plan is not None:
            self.plan = replace(self.plan, start_iteration=0)
        self.last_iteration = -1
        self._reset_measurements()

    # ---- what a rank runs --------------------------------------------------------------------------

    @property
    def profiled_stages(self) -> tuple[int, ...]:
        return tuple(range(self.spec.pp)) if self.cached_profile is not None else tuple(sorted(self.profiles))

    def table(self, rank: int, iteration: int, known_version: int) -> Table:
        info = self.rank(rank)
        self.note_iteration(iteration)
        plan = self.plan
        frequencies = plan.stage_frequencies[info.stage] if plan is not None and plan.version != known_version else None
        return Table(
            phase=self.phase.value,
            warmup_iterations=self.spec.warmup_iterations,
            iterations_per_frequency=self.spec.iterations_per_frequency,
            sweep_frequencies=self.sweep or (),
            profiled_stages=self.profiled_stages,
            plan_version=plan.version if plan else 0,
            plan_start_iteration=plan.start_iteration if plan else 0,
            frequencies=frequencies,
            error=self.error,
        )

    # ---- profiles and plans ------------------------------------------------------------------------

    def add_profile(self, rank: int, stage: int, profile: Profile) -> bool:
        """Accept stage `stage`'s profile; False if the stage already has one (it keeps the first).
        The last missing stage moves the job to planning."""
        info = self.rank(rank)
        if stage != info.stage:
            raise _bad_field(f"rank {rank} registered stage {info.stage} but uploaded a profile for stage {stage}")
        try:
            check_stage_profile(self.schedule, stage, profile)
        except Exception as e:
            raise _bad_field(str(e)) from None
        if self.phase != JobPhase.PROFILING or stage in self.profiles:
            return False
        self.profiles[stage] = profile
        if len(self.profiles) == self.spec.pp:
            self.phase = JobPhase.PLANNING
        return True

    def merged_profile(self) -> Profile:
        if self.cached_profile is not None:
            profile = self.cached_profile
            if self.spec.blocking_power_w is not None:
                profile = Profile(profile.points, self.spec.blocking_power_w, profile.meta)
            return profile
        return merge_profiles(self.profiles, self.spec.blocking_power_w)

    def publish(self, result: PlanResult) -> PublishedPlan:
        self.last_version += 1
        self.plan = PublishedPlan(
            **{f.name: getattr(result, f.name) for f in fields(result)},
            version=self.last_version,
            start_iteration=self.last_iteration + PLAN_LEAD_ITERATIONS if self.last_iteration >= 0 else 0,
        )
        self.phase = JobPhase.PLANNED
        self.error = ""
        self.planned = Mean()
        return self.plan

    def fail(self, message: str) -> None:
        self.phase = JobPhase.FAILED
        self.error = message

    # ---- predicted against measured ------------------------------------------------------------------

    @property
    def _replicas(self) -> float:
        """Pipelines' worth of GPUs: a plan's energy is one pipeline's (one GPU per stage)."""
        return self.spec.world_size / self.spec.pp

    def record(self, report: ReportIteration) -> tuple[Measured, bool] | None:
        """Add one rank's report; (the iteration's total, whether it ran the plan) once complete."""
        self.rank(report.rank)
        self.note_iteration(report.iteration)
        measured = self.tally.add(report.rank, report.iteration, report.time_s, report.energy_j)
        if measured is None:
            return None
        if self.plan is not None and measured.iteration >= self.plan.start_iteration:
            self.planned.add(measured)
            return measured, True
        if measured.iteration < self.spec.warmup_iterations:
            self.baseline.add(measured)
        return measured, False

    def describe(self, measured: Measured) -> str:
        plan = self.plan
        assert plan is not None
        time_p, energy_p = plan.iteration_time_s, plan.energy_j * self._replicas
        return (
            f"job {self.job_id} iteration {measured.iteration} (plan v{plan.version}): "
            f"time {measured.time_s:.4f} s (predicted {time_p:.4f} s, {100 * (measured.time_s / time_p - 1):+.1f}%), "
            f"energy {measured.energy_j:.1f} J (predicted {energy_p:.1f} J, {100 * (measured.energy_j / energy_p - 1):+.1f}%)"
        )

    def status(self) -> JobStatus:
        plan = self.plan
        return JobStatus(
            job_id=self.job_id,
            phase=self.phase.value,
            world_size=self.spec.world_size,
            ranks_registered=len(self.ranks),
            profiled_stages=self.profiled_stages,
            plan_version=plan.version if plan else 0,
            last_iteration=self.last_iteration,
            error=self.error,
            predicted_iteration_time_s=plan.iteration_time_s if plan else None,
            predicted_energy_j=plan.energy_j * self._replicas if plan else None,
            predicted_baseline_energy_j=plan.baseline_energy_j * self._replicas if plan else None,
            baseline_iterations=self.baseline.count,
            baseline_iteration_time_s=self.baseline.time_s,
            baseline_energy_j=self.baseline.energy_j,
            planned_iterations=self.planned.count,
            planned_iteration_time_s=self.planned.time_s,
            planned_energy_j=self.planned.energy_j,
        )

    # ---- persistence ---------------------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "spec": self.spec.to_wire(),
            "ranks": [self.ranks[r].to_wire() for r in sorted(self.ranks)],
            "sweep": None if self.sweep is None else list(self.sweep),
            "cached": self.cached_profile is not None,
            "phase": self.phase.value,
            "error": self.error,
            "last_version": self.last_version,
            "plan": None if self.plan is None else asdict(self.plan),
        }

    @classmethod
    def from_record(cls, doc: dict[str, Any], stage_profiles: dict[int, Profile], cached_profile: Profile | None) -> Job:
        """Rebuild a job saved by `to_record`. A job whose plan is lost re-plans (phase planning)
        if every stage's profile is on disk, else profiles the missing stages."""
        spec = JobSpec.from_wire(doc["spec"])
        if spec.job_id() != doc["job_id"]:
            raise ValueError(f"record of {doc['job_id']} holds the spec of {spec.job_id()}")
        job = cls(spec, cached_profile=cached_profile if doc.get("cached") else None)
        for info in doc.get("ranks", []):
            ri = RankInfo.from_wire(info)
            job.ranks[ri.rank] = ri
        if job.cached_profile is None:
            sweep = doc.get("sweep") or spec.sweep_frequencies or (job.ranks[min(job.ranks)].frequencies if job.ranks else None)
            job.sweep = None if sweep is None else tuple(int(f) for f in sweep)
            job.profiles = {s: p for s, p in stage_profiles.items() if 0 <= s < spec.pp}
            job.phase = JobPhase.PLANNING if len(job.profiles) == spec.pp else JobPhase.PROFILING
        job.last_version = int(doc.get("last_version", 0))
        if doc.get("plan") is not None:
            job.plan = PublishedPlan.from_record(doc["plan"])
            job.phase = JobPhase.PLANNED
        elif doc.get("phase") == JobPhase.FAILED.value:
            job.fail(str(doc.get("error", "")))
        return job
