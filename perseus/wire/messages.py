"""The wire protocol's requests, replies and statuses, and `REQUESTS` (each request type's
request and reply classes). Field checks: `perseus.wire.fields`; framing: `perseus.wire.envelope`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from perseus.exceptions import ConfigError
from perseus.profiler.profile import KINDS, Profile
from perseus.wire.calibration import CalibrationStatus
from perseus.wire.fields import (
    Message,
    check_bool,
    check_float,
    check_int,
    check_ints,
    check_job_id,
    check_opt_float,
    check_seq,
    check_str,
    fields_of,
    set_fields,
    show,
)
from perseus.wire.limits import (
    MAX_ENERGY_J,
    MAX_FREQUENCIES,
    MAX_FREQUENCY_MHZ,
    MAX_INSTRUCTIONS,
    MAX_ITERATION,
    MAX_POWER_W,
    MAX_RANK_ITERATION,
    MAX_RANKS,
    MAX_STRAGGLER_FACTOR,
    MAX_SWEEP_STEPS,
    MAX_TIME_S,
    MIN_TIME_S,
)
from perseus.wire.phases import JOB_PHASES
from perseus.wire.profiles import profile_from_wire, profile_to_wire
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo

COMPUTE_SLACK = 0.01  # a rank's compute time (the GPU's timer) may pass its iteration time (the host's) by this


@dataclass(frozen=True)
class RegisterJob(Message):
    TYPE: ClassVar[str] = "register_job"
    spec: JobSpec

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):
            set_fields(self, spec=JobSpec(**fields_of(JobSpec, self.spec, "register_job.spec")))
        elif not isinstance(self.spec, JobSpec):
            raise ConfigError(f"register_job.spec must be a JobSpec, got {show(self.spec)}")

    def to_wire(self) -> dict[str, Any]:
        return {"spec": self.spec.to_wire()}


@dataclass(frozen=True)
class JobRegistered(Message):
    job_id: str
    phase: str
    cached: bool  # the profile came from the state directory's cache: no profiling

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "job_id")
        check_str(self.phase, "phase", 16, choices=JOB_PHASES)
        check_bool(self.cached, "cached")


@dataclass(frozen=True)
class RegisterRank(Message):
    TYPE: ClassVar[str] = "register_rank"
    job_id: str
    info: RankInfo

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "register_rank.job_id")
        if isinstance(self.info, dict):
            set_fields(self, info=RankInfo(**fields_of(RankInfo, self.info, "register_rank.info")))
        elif not isinstance(self.info, RankInfo):
            raise ConfigError(f"register_rank.info must be a RankInfo, got {show(self.info)}")

    def to_wire(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "info": self.info.to_wire()}


@dataclass(frozen=True)
class RankRegistered(Message):
    phase: str

    def __post_init__(self) -> None:
        check_str(self.phase, "phase", 16, choices=JOB_PHASES)


@dataclass(frozen=True)
class GetTable(Message):
    """A rank asks for its frequency table; `plan_version` is the plan it already holds (0: none)."""

    TYPE: ClassVar[str] = "get_table"
    job_id: str
    rank: int
    iteration: int = -1  # the rank's current iteration (-1: not started), so plans start in lockstep
    plan_version: int = 0
    sweep_version: int = 1  # the profiling sweep format the rank follows (see limits.SWEEP_VERSION)

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "get_table.job_id")
        check_int(self.rank, "get_table.rank", 0, MAX_RANKS - 1)
        check_int(self.iteration, "get_table.iteration", -1, MAX_RANK_ITERATION)
        check_int(self.plan_version, "get_table.plan_version", 0, MAX_ITERATION)
        check_int(self.sweep_version, "get_table.sweep_version", 1, 1 << 16)

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        if self.sweep_version == 1:
            del doc["sweep_version"]  # what earlier releases send
        return doc


@dataclass(frozen=True)
class Table(Message):
    """Everything a rank needs to know what to run at any iteration.

    Iterations [0, warmup_iterations): max clocks. Then, until the rank's stage is profiled, one
    step of the profiling sweep per iteration: `sweep_steps`, designed by the service
    (perseus.service.sweep), each one clock per instruction kind in KINDS order; steps
    [k * iterations_per_frequency, (k + 1) * iterations_per_frequency) profile
    sweep_frequencies[k]. Which step runs when is the rank's (perseus.profiler.sweep: in order,
    stopping early, repeating uncertain ones); sent to ranks asking with sweep_version 2, and
    only while their stage is unprofiled (omitted on the wire when empty). From
    `plan_start_iteration` on, once a plan exists: `frequencies`, one per instruction of the
    rank in schedule order (None when the rank already holds `plan_version`, or no plan yet).
    `upload`: this rank uploads its stage profile -- it has the lowest data-parallel index
    among the ranks of its GPU model, stage and tensor-parallel index, whose profiles the
    service shares (omitted on the wire when true, as earlier releases had every rank upload).
    `spans`: the service calibrates the job's model and asks for each iteration's instruction
    spans (`ReportSpans`) until a plan is in force, and in verification's reference windows (omitted
    on the wire when false).
    `sweep_round`: the sweep the service asks of the rank's stage; a later round than the one the
    rank uploaded a profile in asks for a fresh sweep (the earlier profile never arrived; sent
    only to ranks asking with sweep_version 3, omitted on the wire when 0).
    `reference`: plan `plan_version` is no plan of Perseus but maximum clocks for one window,
    verification's fresh target (ranks record its iterations as phase "reference"; sent only to
    ranks asking with sweep_version 4, omitted on the wire when false).
    """

    phase: str
    warmup_iterations: int
    iterations_per_frequency: int
    sweep_frequencies: tuple[int, ...]
    profiled_stages: tuple[int, ...]
    plan_version: int
    plan_start_iteration: int
    frequencies: tuple[int, ...] | None
    error: str = ""
    upload: bool = True
    spans: bool = False
    sweep_steps: tuple[tuple[int, ...], ...] = ()
    sweep_round: int = 0
    reference: bool = False

    def __post_init__(self) -> None:
        check_str(self.phase, "table.phase", 16, choices=JOB_PHASES)
        check_int(self.warmup_iterations, "table.warmup_iterations", 0, 1_000_000)
        check_int(self.iterations_per_frequency, "table.iterations_per_frequency", 1, 10_000)
        set_fields(
            self,
            sweep_frequencies=check_ints(
                self.sweep_frequencies, "table.sweep_frequencies", 1, MAX_FREQUENCY_MHZ, MAX_FREQUENCIES
            ),
        )
        set_fields(self, profiled_stages=check_ints(self.profiled_stages, "table.profiled_stages", 0, 4095, 4096))
        check_int(self.plan_version, "table.plan_version", 0, MAX_ITERATION)
        check_int(self.plan_start_iteration, "table.plan_start_iteration", 0, MAX_ITERATION)
        if self.frequencies is not None:
            set_fields(
                self,
                frequencies=check_ints(self.frequencies, "table.frequencies", 1, MAX_FREQUENCY_MHZ, MAX_INSTRUCTIONS),
            )
        check_str(self.error, "table.error", 4096, printable=False)
        check_bool(self.upload, "table.upload")
        check_bool(self.spans, "table.spans")
        steps = check_seq(self.sweep_steps, "table.sweep_steps", MAX_SWEEP_STEPS)
        set_fields(
            self,
            sweep_steps=tuple(
                check_ints(step, f"table.sweep_steps[{i}]", 1, MAX_FREQUENCY_MHZ, len(KINDS), min_len=len(KINDS))
                for i, step in enumerate(steps)
            ),
        )
        check_int(self.sweep_round, "table.sweep_round", 0, MAX_ITERATION)
        check_bool(self.reference, "table.reference")

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        doc["sweep_frequencies"] = list(self.sweep_frequencies)
        doc["profiled_stages"] = list(self.profiled_stages)
        doc["frequencies"] = None if self.frequencies is None else list(self.frequencies)
        if self.upload:
            del doc["upload"]  # the default
        if not self.spans:
            del doc["spans"]  # the default, and what earlier releases send and accept
        if self.sweep_steps:
            doc["sweep_steps"] = [list(step) for step in self.sweep_steps]
        else:
            del doc["sweep_steps"]  # likewise
        if not self.sweep_round:
            del doc["sweep_round"]  # likewise
        if not self.reference:
            del doc["reference"]  # likewise
        return doc


@dataclass(frozen=True)
class UploadProfile(Message):
    """A rank's measured profile of its stage (rows of virtual stages it holds, with chunks)."""

    TYPE: ClassVar[str] = "upload_profile"
    job_id: str
    rank: int
    stage: int
    profile: Profile

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "upload_profile.job_id")
        check_int(self.rank, "upload_profile.rank", 0, MAX_RANKS - 1)
        check_int(self.stage, "upload_profile.stage", 0, 4095)
        if isinstance(self.profile, dict):
            set_fields(self, profile=profile_from_wire(self.profile, "upload_profile.profile"))
        elif isinstance(self.profile, Profile):
            self.profile.validate()
        else:
            raise ConfigError(f"upload_profile.profile must be a Profile, got {show(self.profile)}")

    def to_wire(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "rank": self.rank, "stage": self.stage, "profile": profile_to_wire(self.profile)}


@dataclass(frozen=True)
class ReportIteration(Message):
    """One rank's measured time and energy (its GPU, including time blocked) for one iteration.

    `compute_time_s`, when the rank can tell, is the iteration's time without waiting for other
    data-parallel pipelines (the gradient synchronization): straggler detection compares
    pipelines by it (by `time_s` otherwise, which a synchronizing straggler makes equal).
    `closing`: the rank's last report, of the iteration its close() ended (not a next step, so it
    runs on through the script's own work after its last step): no mean counts it, and the rank
    has closed; ranks announce a job's end no other way."""

    TYPE: ClassVar[str] = "report_iteration"
    job_id: str
    rank: int
    iteration: int
    time_s: float
    energy_j: float
    compute_time_s: float | None = None
    off_clock: int | None = None  # instructions that ran at a clock other than planned (if the rank can tell)
    closing: bool = False

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "report_iteration.job_id")
        check_bool(self.closing, "report_iteration.closing")
        check_int(self.rank, "report_iteration.rank", 0, MAX_RANKS - 1)
        check_int(self.iteration, "report_iteration.iteration", 0, MAX_RANK_ITERATION)
        set_fields(
            self,
            time_s=check_float(self.time_s, "report_iteration.time_s", MIN_TIME_S, MAX_TIME_S),
            energy_j=check_float(self.energy_j, "report_iteration.energy_j", 0.0, MAX_ENERGY_J),
        )
        if self.energy_j > self.time_s * MAX_POWER_W:
            raise ConfigError(
                f"report_iteration.energy_j {self.energy_j:g} J in time_s {self.time_s:g} s is "
                f"{self.energy_j / self.time_s:,.0f} W, over the {MAX_POWER_W:,.0f} W one GPU can draw: send the "
                "rank's own GPU energy in joules (NVML's counter counts millijoules)"
            )
        if self.compute_time_s is not None:
            compute = check_float(self.compute_time_s, "report_iteration.compute_time_s", MIN_TIME_S, MAX_TIME_S)
            if compute > self.time_s * (1 + COMPUTE_SLACK):
                raise ConfigError(
                    f"report_iteration.compute_time_s {compute:g} s is longer than time_s {self.time_s:g} s: it is "
                    "the part of the iteration up to its last instruction's end, so at most the iteration's time"
                )
            set_fields(self, compute_time_s=min(compute, self.time_s))  # two timers' disagreement
        if self.off_clock is not None:
            check_int(self.off_clock, "report_iteration.off_clock", 0, MAX_INSTRUCTIONS)

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        if self.compute_time_s is None:
            del doc["compute_time_s"]  # what earlier releases send and accept
        if self.off_clock is None:
            del doc["off_clock"]  # likewise
        if not self.closing:
            del doc["closing"]  # likewise
        return doc


@dataclass(frozen=True)
class DeclareStraggler(Message):
    """An operator declares pipeline (data-parallel index) `pipeline` slow by `factor` (1.2: its
    iterations take 1.2x its plan's time); the others are re-planned to that pace. `factor`
    None clears the declaration."""

    TYPE: ClassVar[str] = "declare_straggler"
    job_id: str
    pipeline: int
    factor: float | None

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "declare_straggler.job_id")
        check_int(self.pipeline, "declare_straggler.pipeline", 0, MAX_RANKS - 1)
        if self.factor is not None:
            set_fields(self, factor=check_float(self.factor, "declare_straggler.factor", 1.0, MAX_STRAGGLER_FACTOR))


@dataclass(frozen=True)
class Ack(Message):
    phase: str

    def __post_init__(self) -> None:
        check_str(self.phase, "phase", 16, choices=JOB_PHASES)


@dataclass(frozen=True)
class GetStatus(Message):
    TYPE: ClassVar[str] = "status"
    job_id: str | None = None  # None: every job

    def __post_init__(self) -> None:
        if self.job_id is not None:
            check_job_id(self.job_id, "status.job_id")


@dataclass(frozen=True)
class PipelineStatus(Message):
    """One data-parallel pipeline: its plan, the deadline it was planned for (None: no
    slowdown), and whether it is a straggler ("detected" or "declared", with its factor).

    The plan's verification (perseus.service.verification): `verification` is "" (nothing to
    check yet), "verifying", "reference" (a window at maximum clocks measures a fresh target),
    "holds", "replanning" or "fallback" (maximum clocks); the measured
    iteration (its compute part, median of the last window: `verified_iteration_time_s`)
    against `target_iteration_time_s` (the measured baseline, or the deadline at its scale),
    the re-plans made and why (`reason`). `plan_since`: the first version of the clocks the plan
    runs (a reference window's: of the plan it checks): versions from it on are one plan, which
    verification's reference windows interrupted and resumed; 0 before any plan.
    """

    pipeline: int
    plan_version: int
    deadline_s: float | None
    predicted_iteration_time_s: float | None
    measured_iteration_time_s: float | None  # median of recent iterations
    straggler: str = ""
    straggler_factor: float | None = None
    baseline_iteration_time_s: float | None = None  # measured at maximum clocks, before any plan
    target_iteration_time_s: float | None = None
    verification: str = ""
    verified_iteration_time_s: float | None = None
    replans: int = 0
    reason: str = ""
    plan_since: int = 0

    def __post_init__(self) -> None:
        check_int(self.pipeline, "pipeline.pipeline", 0, MAX_RANKS - 1)
        check_int(self.plan_version, "pipeline.plan_version", 0, MAX_ITERATION)
        check_str(self.straggler, "pipeline.straggler", 16, choices=("", "detected", "declared"))
        for name in (
            "deadline_s",
            "predicted_iteration_time_s",
            "measured_iteration_time_s",
            "straggler_factor",
            "baseline_iteration_time_s",
            "target_iteration_time_s",
            "verified_iteration_time_s",
        ):
            set_fields(self, **{name: check_opt_float(getattr(self, name), f"pipeline.{name}")})
        check_str(self.verification, "pipeline.verification", 16, choices=VERIFICATION_STATES)
        check_int(self.replans, "pipeline.replans", 0, MAX_ITERATION)
        check_str(self.reason, "pipeline.reason", 4096, printable=False)
        check_int(self.plan_since, "pipeline.plan_since", 0, MAX_ITERATION)

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        for name, default in _PIPELINE_DEFAULTS.items():
            if doc[name] == default:
                del doc[name]  # what earlier releases send and accept
        return doc

    @property
    def verified_excess(self) -> float | None:
        """The last verified window against its target (+: slower)."""
        if self.verified_iteration_time_s is None or not self.target_iteration_time_s:
            return None
        return self.verified_iteration_time_s / self.target_iteration_time_s - 1.0


VERIFICATION_STATES = ("", "verifying", "reference", "holds", "replanning", "fallback")
_PIPELINE_DEFAULTS: dict[str, Any] = {
    "baseline_iteration_time_s": None,
    "target_iteration_time_s": None,
    "verification": "",
    "verified_iteration_time_s": None,
    "replans": 0,
    "reason": "",
    "plan_since": 0,
}


#: A job whose ranks reported no iteration for this long, and for this many of its iterations, while
#: a rank has not closed, has ended or stalls (ranks killed before their close() announce nothing).
QUIET_S = 30.0
QUIET_ITERATIONS = 10


@dataclass(frozen=True)
class JobStatus(Message):
    """One job: its phase, and predicted (the plan, scaled to all ranks) against measured figures.

    Measured figures are means over iterations every rank reported: the iteration time is the
    slowest rank's, the energy the sum over ranks. `baseline_*` covers the baseline iterations
    (max clocks, no profiling, after the first; and verification's reference windows past their
    switch), `planned_*` the iterations run with the current plan. `calibrations`: how each
    pipeline model fits the measured timeline (see perseus.wire.calibration); `tolerance`: how
    much slower than its target a plan may run.
    `saving_withheld`: why no saving is claimed (none measured yet, too few iterations to read an
    energy counter on, every plan fell back to maximum clocks, the straggler changed: see
    perseus.service.status); `measured_saving` is then None. `profile_dropped`: why the service last
    dropped the job's profile and measured it again (its ranks' spans showed the workload changed
    under the same spec, see perseus.service.timelines.profile_mismatch); "" if it never did.
    `quiet_s`: seconds since a rank last reported an iteration (None: none since the service
    started): a job that stalls, or whose ranks ended without close(), shows here.
    `ranks_closed`: ranks whose close() reported their last iteration (this run).
    """

    job_id: str
    phase: str
    world_size: int
    ranks_registered: int
    profiled_stages: tuple[int, ...]
    plan_version: int
    last_iteration: int
    error: str = ""
    warning: str = ""  # the job runs degraded, e.g. its state could not be saved (omitted on the wire when empty)
    predicted_iteration_time_s: float | None = None
    predicted_energy_j: float | None = None
    predicted_baseline_energy_j: float | None = None  # all ranks at max clocks, by the evaluator
    baseline_iterations: int = 0
    baseline_iteration_time_s: float | None = None
    baseline_energy_j: float | None = None
    planned_iterations: int = 0
    planned_iteration_time_s: float | None = None
    planned_energy_j: float | None = None
    pipelines: tuple[PipelineStatus, ...] = ()
    calibrations: tuple[CalibrationStatus, ...] = ()
    tolerance: float | None = None
    # Per planned iteration, summed over the ranks that can tell: instructions that ran at a clock
    # other than planned (see perseus.controller.controller; None: no rank can tell).
    off_clock_instructions: float | None = None
    saving_withheld: str = ""
    profile_dropped: str = ""
    quiet_s: float | None = None
    ranks_closed: int = 0

    @property
    def went_quiet(self) -> bool:
        """No iteration reported for QUIET_S, nor for QUIET_ITERATIONS of the job's iterations, while
        a rank has not closed: the job stalls, or ranks ended without close()."""
        if self.quiet_s is None or self.ranks_closed >= self.world_size:
            return False
        iteration_s = self.planned_iteration_time_s or self.baseline_iteration_time_s or 0.0
        return self.quiet_s >= max(QUIET_S, QUIET_ITERATIONS * iteration_s)

    def __post_init__(self) -> None:
        check_job_id(self.job_id, "job.job_id")
        check_str(self.phase, "job.phase", 16, choices=JOB_PHASES)
        check_int(self.world_size, "job.world_size", 1, MAX_RANKS)
        check_int(self.ranks_registered, "job.ranks_registered", 0, MAX_RANKS)
        check_int(self.ranks_closed, "job.ranks_closed", 0, MAX_RANKS)
        set_fields(self, profiled_stages=check_ints(self.profiled_stages, "job.profiled_stages", 0, 4095, 4096))
        check_int(self.plan_version, "job.plan_version", 0, MAX_ITERATION)
        check_int(self.last_iteration, "job.last_iteration", -1, MAX_ITERATION)
        check_str(self.error, "job.error", 4096, printable=False)
        check_str(self.warning, "job.warning", 4096, printable=False)
        check_str(self.saving_withheld, "job.saving_withheld", 4096, printable=False)
        check_str(self.profile_dropped, "job.profile_dropped", 4096, printable=False)
        check_int(self.baseline_iterations, "job.baseline_iterations", 0, MAX_ITERATION)
        check_int(self.planned_iterations, "job.planned_iterations", 0, MAX_ITERATION)
        for name in (
            "predicted_iteration_time_s",
            "predicted_energy_j",
            "predicted_baseline_energy_j",
            "baseline_iteration_time_s",
            "baseline_energy_j",
            "planned_iteration_time_s",
            "planned_energy_j",
            "off_clock_instructions",
            "quiet_s",
        ):
            set_fields(self, **{name: check_opt_float(getattr(self, name), f"job.{name}")})
        pipelines = check_seq(self.pipelines, "job.pipelines", MAX_RANKS)
        set_fields(
            self,
            pipelines=tuple(p if isinstance(p, PipelineStatus) else PipelineStatus.from_wire(p) for p in pipelines),
        )
        calibrations = check_seq(self.calibrations, "job.calibrations", MAX_RANKS)
        set_fields(
            self,
            calibrations=tuple(
                c if isinstance(c, CalibrationStatus) else CalibrationStatus.from_wire(c) for c in calibrations
            ),
        )
        set_fields(self, tolerance=check_opt_float(self.tolerance, "job.tolerance"))

    def to_wire(self) -> dict[str, Any]:
        doc = {**super().to_wire(), "profiled_stages": list(self.profiled_stages)}
        doc["pipelines"] = [p.to_wire() for p in self.pipelines]
        doc["calibrations"] = [c.to_wire() for c in self.calibrations]
        for name in ("calibrations", "tolerance"):
            if not doc[name]:
                del doc[name]  # what earlier releases send and accept
        if not self.warning:
            del doc["warning"]  # what earlier releases send and accept
        if self.off_clock_instructions is None:
            del doc["off_clock_instructions"]  # likewise
        for name in ("saving_withheld", "profile_dropped"):
            if not doc[name]:
                del doc[name]  # likewise
        return doc

    @property
    def predicted_saving(self) -> float | None:
        if self.predicted_energy_j is None or not self.predicted_baseline_energy_j:
            return None
        return 1.0 - self.predicted_energy_j / self.predicted_baseline_energy_j

    @property
    def measured_saving(self) -> float | None:
        """The planned iterations' energy saved against the baseline's (None: not measured, or
        not the plan's doing: see `saving_withheld`)."""
        if self.planned_energy_j is None or not self.baseline_energy_j or self.saving_withheld:
            return None
        return 1.0 - self.planned_energy_j / self.baseline_energy_j


@dataclass(frozen=True)
class Status(Message):
    jobs: tuple[JobStatus, ...]

    def __post_init__(self) -> None:
        jobs = check_seq(self.jobs, "status.jobs", 100_000)
        set_fields(self, jobs=tuple(j if isinstance(j, JobStatus) else JobStatus.from_wire(j) for j in jobs))

    def to_wire(self) -> dict[str, Any]:
        return {"jobs": [j.to_wire() for j in self.jobs]}


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    protocol: int
    server: str

    def __post_init__(self) -> None:
        check_int(self.protocol, "protocol", 1, 1 << 16)
        check_str(self.server, "server", 128)


# Request type -> (request class, reply class).
REQUESTS: dict[str, tuple[type[Message], type[Message]]] = {
    RegisterJob.TYPE: (RegisterJob, JobRegistered),
    RegisterRank.TYPE: (RegisterRank, RankRegistered),
    GetTable.TYPE: (GetTable, Table),
    UploadProfile.TYPE: (UploadProfile, Ack),
    ReportIteration.TYPE: (ReportIteration, Ack),
    ReportSpans.TYPE: (ReportSpans, Ack),
    DeclareStraggler.TYPE: (DeclareStraggler, Ack),
    GetStatus.TYPE: (GetStatus, Status),
    Ping.TYPE: (Ping, Pong),
}
