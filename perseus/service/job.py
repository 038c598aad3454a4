"""One job's state machine: ranks, profiling sweep, stage profiles, per-pipeline plans,
stragglers, measurements.

No sockets and no threads: the service calls these methods from its loop thread only.

A job runs `dp` data-parallel pipelines of `pp` stages, each stage split over `tp`
tensor-parallel ranks. Profiles are kept per GPU model and stage (the tensor-parallel ranks'
uploads merged: slowest time, summed energy), so data-parallel replicas on the same model
share them. Each pipeline has its own plan (the tensor-parallel ranks of a stage share the
stage's frequencies): the no-slowdown plan of its GPU models, or, while another pipeline
straggles, the least-energy plan at the straggler's pace. Every plan change gets a new
`plan_version` and a start iteration shared by all ranks of the pipeline.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile
from perseus.schedules import Schedule
from perseus.service.planning import PlanResult, check_stage_profile, job_schedule, merge_profiles, stage_rows
from perseus.wire.envelope import ErrorCode
from perseus.wire.messages import JobStatus, PipelineStatus, ReportIteration, Table
from perseus.wire.phases import JobPhase
from perseus.wire.spec import JobSpec, RankInfo
from perseus.service.straggler import StragglerDetector
from perseus.service.tally import IterationTally, Mean, Measured
from perseus.service.text import clip
from perseus.wire.parallelism import merge_tensor_parallel, rank_coordinates

log = logging.getLogger(__name__)

# A new plan starts this many iterations after the latest one any rank has reached, and at least
# PLAN_LEAD_S later at the measured iteration time, so that every rank (polling a few times a
# second) switches at the same iteration boundary.
PLAN_LEAD_ITERATIONS = 2
PLAN_LEAD_S = 1.0
MAX_PLAN_LEAD = 10_000
HISTORY = 8  # plan changes per pipeline kept to read measured iterations against their plan
MAX_RESULTS = 64  # solved plans kept per job (no-slowdown and in-force plans are always kept)

Models = tuple[str, ...]  # the GPU model of each stage of a pipeline
PlanKey = tuple[Models, float | None]  # (models, deadline in s or None: no slowdown)


def _bad_field(message: str) -> ServiceError:
    return ServiceError(ErrorCode.BAD_FIELD.value, message)


def _deadline_key(deadline_s: float | None) -> float | None:
    return None if deadline_s is None else round(deadline_s, 6)


@dataclass(frozen=True)
class PublishedPlan(PlanResult):
    """A pipeline's plan as its ranks see it: its version, the iteration it applies from, the GPU
    models it was planned for and its deadline (None: no slowdown) -- job.json's "plans"."""

    version: int
    start_iteration: int
    models: Models = ()
    deadline_s: float | None = None

    @property
    def key(self) -> PlanKey:
        return self.models, _deadline_key(self.deadline_s)

    @classmethod
    def from_record(cls, doc: dict[str, Any]) -> PublishedPlan:
        return cls(
            **{
                **doc,
                "stage_frequencies": tuple(tuple(int(f) for f in row) for row in doc["stage_frequencies"]),
                "models": tuple(doc.get("models", ())),
            }
        )


def document_name(spec: JobSpec, key: PlanKey) -> str:
    """File name (without .json) of a plan document: "plan" for the job's own GPU model with no
    slowdown, else "plan-<hash>" per distinct (models, deadline)."""
    models, deadline = key
    if deadline is None and set(models) == {spec.gpu_model}:
        return "plan"
    return "plan-" + hashlib.sha256(repr(key).encode()).hexdigest()[:12]


class Job:
    """`build_schedule`: build (and validate) the schedule now; the service passes False and
    builds it on a worker (large schedules take seconds), then calls `set_schedule` or `fail`.
    Until then the job profiles (ranks warm up and sweep) and holds no plan."""

    def __init__(self, spec: JobSpec, *, cached_profile: Profile | None = None, build_schedule: bool = True) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.schedule: Schedule | None = job_schedule(spec) if build_schedule else None
        self.spec_record = spec.to_wire()  # job.json's "spec", encoded once
        self.ranks: dict[int, RankInfo] = {}
        self._coords: dict[tuple[int, int, int], int] = {}
        self._group_model: dict[tuple[int, int], str] = {}  # (stage, pipeline) -> its GPU model
        # (GPU model, stage, tp_index) -> the lowest dp_index registered there: the rank that uploads.
        self._uploader: dict[tuple[str, int, int], int] = {}
        self.cached: dict[str, Profile] = {} if cached_profile is None else {spec.gpu_model: cached_profile}
        self.uploads: dict[tuple[str, int], dict[int, Profile]] = {}  # (model, stage) -> tp_index -> upload
        self.upload_names: dict[tuple[str, int, int], str] = {}  # (model, stage, tp_index) -> state file name
        self.profiles: dict[str, dict[int, Profile]] = {}  # model -> stage -> merged over tensor parallel
        self.sweep: tuple[int, ...] | None = () if cached_profile is not None else spec.sweep_frequencies
        self.error = ""
        self.warning = ""  # the job runs, but something is degraded (its state could not be saved)
        self.plans: dict[int, PublishedPlan] = {}
        self.results: dict[PlanKey, PlanResult | str] = {}  # solved plans; str: why the planner could not
        self.declared: dict[int, float] = {}
        self.last_version = 0
        self.last_iteration = -1
        self._models: dict[int, Models] = {}
        self._phase: JobPhase | None = None  # cached: tables are asked for many times a second
        self._frequency_lists: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple shared by ranks of one GPU
        self._reset_measurements()

    def _changed(self) -> None:
        self._phase = None

    def set_schedule(self, schedule: Schedule) -> None:
        """The schedule a worker built from the spec (see `build_schedule`)."""
        self.schedule = schedule
        self._changed()

    def _reset_measurements(self) -> None:
        spec = self.spec
        self.tally = IterationTally(spec.world_size)
        self.pipeline_tally = [IterationTally(spec.pp * spec.tp) for _ in range(spec.dp)]
        self.history: list[deque[tuple[int, float]]] = [deque(maxlen=HISTORY) for _ in range(spec.dp)]
        for k, plan in self.plans.items():
            self.history[k].append((plan.start_iteration, plan.iteration_time_s))
        self.measured_time: list[deque[float]] = [deque(maxlen=8) for _ in range(spec.dp)]
        self.detector = StragglerDetector(spec.dp)
        self._fed = False  # the detector has values it has not decided on
        self.baseline = Mean()
        self.planned = Mean()
        self.recent_time_s: float | None = None

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
        coords = (info.stage, info.dp_index, info.tp_index)
        if spec.rank_mapping != "explicit":
            expected = rank_coordinates(spec.rank_mapping, info.rank, spec.pp, spec.dp, spec.tp)
            if coords != expected:
                raise _bad_field(
                    f"under the {spec.rank_mapping} rank mapping rank {info.rank} is stage {expected[0]}, dp_index {expected[1]}, "
                    f"tp_index {expected[2]}, but it registered stage {info.stage}, dp_index {info.dp_index}, tp_index {info.tp_index}; "
                    "fix the RankInfo or register the job with rank_mapping='explicit'"
                )
        other = self._coords.get(coords)
        if other is not None and other != info.rank:
            raise _bad_field(f"rank {info.rank} and rank {other} both claim stage {info.stage}, dp_index {info.dp_index}, tp_index {info.tp_index}")
        group = (info.stage, info.dp_index)
        peers = [r for r in self.ranks.values() if (r.stage, r.dp_index) == group and r.rank != info.rank]
        if peers and peers[0].gpu_model != info.gpu_model:
            raise _bad_field(
                f"rank {info.rank} has GPU {info.gpu_model!r} but its tensor-parallel peer rank {peers[0].rank} (stage {info.stage}, "
                f"dp_index {info.dp_index}) has {peers[0].gpu_model!r}; the ranks of one stage replica must share a GPU model"
            )
        if self.sweep is None:
            self.sweep = info.frequencies
        missing = sorted(set(self.sweep) - set(info.frequencies), reverse=True)
        if missing:
            raise _bad_field(
                f"rank {info.rank}'s GPU does not support sweep frequencies {missing[:8]} MHz; "
                "set JobSpec.sweep_frequencies to frequencies every rank supports"
            )
        object.__setattr__(info, "frequencies", self._frequency_lists.setdefault(info.frequencies, info.frequencies))
        old = self.ranks.get(info.rank)
        if old is not None:
            self._coords.pop((old.stage, old.dp_index, old.tp_index), None)
            self._models.pop(old.dp_index, None)
        self.ranks[info.rank] = info
        self._coords[coords] = info.rank
        key = (info.gpu_model, info.stage, info.tp_index)
        if old is not None and (old.gpu_model, old.stage, old.tp_index, old.dp_index) != (*key, info.dp_index):
            self._uploader = {}  # a rank moved (rare): recount every uploader
            for r in self.ranks.values():
                k = (r.gpu_model, r.stage, r.tp_index)
                self._uploader[k] = min(self._uploader.get(k, r.dp_index), r.dp_index)
        elif info.dp_index < self._uploader.get(key, info.dp_index + 1):
            self._uploader[key] = info.dp_index
        if self._group_model.get(group) != info.gpu_model:
            self._group_model[group] = info.gpu_model
            self._models.pop(info.dp_index, None)
            self._changed()

    def rank(self, rank: int) -> RankInfo:
        if rank not in self.ranks:
            raise ServiceError(ErrorCode.UNKNOWN_RANK.value, f"rank {rank} has not registered with job {self.job_id}; call register_rank first")
        return self.ranks[rank]

    def models(self, pipeline: int) -> Models:
        """The GPU model of each stage of `pipeline` (the job's model where no rank registered yet)."""
        models = self._models.get(pipeline)
        if models is None:
            models = self._models[pipeline] = tuple(self._group_model.get((s, pipeline), self.spec.gpu_model) for s in range(self.spec.pp))
        return models

    def note_iteration(self, iteration: int) -> None:
        self.last_iteration = max(self.last_iteration, iteration)

    def rerun(self) -> None:
        """The job registered again (a restart starts from iteration 0): apply the plans at once."""
        self.plans = {k: replace(plan, start_iteration=0) for k, plan in self.plans.items()}
        self.last_iteration = -1
        self._reset_measurements()

    # ---- what a rank runs --------------------------------------------------------------------------

    def profiled_stages_of(self, model: str) -> tuple[int, ...]:
        if model in self.cached:
            return tuple(range(self.spec.pp))
        return tuple(sorted(self.profiles.get(model, {})))

    @property
    def profiled_stages(self) -> tuple[int, ...]:
        return self.profiled_stages_of(self.spec.gpu_model)

    def table(self, rank: int, iteration: int, known_version: int) -> Table:
        info = self.rank(rank)
        self.note_iteration(iteration)
        plan = self.plans.get(info.dp_index)
        frequencies = plan.stage_frequencies[info.stage] if plan is not None and plan.version != known_version else None
        return Table(
            phase=self.phase.value,
            warmup_iterations=self.spec.warmup_iterations,
            iterations_per_frequency=self.spec.iterations_per_frequency,
            sweep_frequencies=self.sweep or (),
            profiled_stages=self.profiled_stages_of(info.gpu_model),
            plan_version=plan.version if plan else 0,
            plan_start_iteration=plan.start_iteration if plan else 0,
            frequencies=frequencies,
            error=self.error,
            upload=self.uploads_profile(info),
        )

    def uploads_profile(self, info: RankInfo) -> bool:
        """Whether `info`'s rank uploads its stage profile: the data-parallel replicas of a stage on
        one GPU model share one profile, taken from the lowest data-parallel index registered."""
        return self._uploader.get((info.gpu_model, info.stage, info.tp_index)) == info.dp_index

    @property
    def phase(self) -> JobPhase:
        if self._phase is None:
            self._phase = self._current_phase()
        return self._phase

    def _current_phase(self) -> JobPhase:
        if self.error:
            return JobPhase.FAILED
        pipelines = range(self.spec.dp)
        if all(k in self.plans and self.plans[k].models == self.models(k) for k in pipelines):
            return JobPhase.PLANNED
        if all(self.pipeline_profile(models) is not None for models in {self.models(k) for k in pipelines}):
            return JobPhase.PLANNING
        return JobPhase.PROFILING

    # ---- profiles ----------------------------------------------------------------------------------

    def add_profile(self, rank: int, stage: int, profile: Profile) -> str | None:
        """Accept a tensor-parallel rank's profile of its stage; the state-file name to save it
        under, or None if that rank's share of (GPU model, stage) is already in (the first one is
        kept). Once every tensor-parallel rank of the stage is in, the stage is profiled."""
        info = self.rank(rank)
        if stage != info.stage:
            raise _bad_field(f"rank {rank} registered stage {info.stage} but uploaded a profile for stage {stage}")
        try:
            check_stage_profile(self.schedule, stage, profile)
        except ConfigError as e:
            raise _bad_field(str(e)) from None
        unsupported = sorted({p.frequency for pts in profile.points.values() for p in pts} - set(info.frequencies), reverse=True)
        if unsupported:
            raise _bad_field(
                f"profile of stage {stage} has rows at {unsupported[:8]} MHz, which rank {rank}'s GPU does not support "
                f"(it registered {len(info.frequencies)} frequencies); profile only frequencies the rank can run"
            )
        model = info.gpu_model
        if stage in self.profiled_stages_of(model) or info.tp_index in self.uploads.get((model, stage), {}):
            return None
        name = f"stage-{stage}" + (f"-tp{info.tp_index}" if info.tp_index else "")
        if model != self.spec.gpu_model:
            name += "-m" + hashlib.sha256(model.encode()).hexdigest()[:8]
        self._take_upload(model, stage, info.tp_index, profile, name)
        return name

    def _take_upload(self, model: str, stage: int, tp_index: int, profile: Profile, name: str) -> None:
        shares = self.uploads.setdefault((model, stage), {})
        shares[tp_index] = profile
        self.upload_names[(model, stage, tp_index)] = name
        if len(shares) == self.spec.tp:
            try:
                merged = merge_tensor_parallel([shares[t] for t in range(self.spec.tp)])
            except ConfigError as e:
                del shares[tp_index]
                raise _bad_field(str(e)) from None
            self.profiles.setdefault(model, {})[stage] = merged
            self._changed()

    def drop_upload(self, rank: int, name: str) -> None:
        """Forget the upload `add_profile` took under `name` (its state file could not be written:
        the rank is told to retry, so nothing unsaved is acknowledged)."""
        info = self.rank(rank)
        model, stage, tp_index = info.gpu_model, info.stage, info.tp_index
        if self.upload_names.get((model, stage, tp_index)) != name:
            return
        del self.upload_names[(model, stage, tp_index)]
        self.uploads.get((model, stage), {}).pop(tp_index, None)
        self.profiles.get(model, {}).pop(stage, None)
        self._changed()

    def add_cached(self, model: str, profile: Profile) -> None:
        """A whole-pipeline profile of `model` from the signature cache: no profiling on it."""
        self.cached[model] = profile
        self._changed()

    def model_profile(self, model: str) -> Profile | None:
        """Every stage's profile on `model` merged (what the signature cache keeps), if complete."""
        stages = self.profiles.get(model, {})
        if len(stages) < self.spec.pp:
            return None
        return merge_profiles(stages, self._blocking_power())

    def _blocking_power(self) -> float | None:
        power = self.spec.blocking_power_w
        return None if power is None else power * self.spec.tp  # every GPU of a stage blocks

    def pipeline_profile(self, models: Models) -> Profile | None:
        """The profile a pipeline with these stage models is planned with: the stages' measured
        rows plus the spec's host and hop overheads. None until complete (or while the schedule
        is being built)."""
        if self.schedule is None:
            return None
        stages: dict[int, Profile] = {}
        for s, model in enumerate(models):
            if model in self.cached:
                rows = stage_rows(self.schedule, s, self.cached[model])
            else:
                rows = self.profiles.get(model, {}).get(s)
            if rows is None:
                return None
            stages[s] = rows
        merged = merge_profiles(stages, self._blocking_power())
        return merged.with_overheads(self.spec.instruction_overhead_s, self.spec.hop_latency_s)

    # ---- plans and stragglers --------------------------------------------------------------------

    def straggler(self) -> tuple[int, float, str] | None:
        """(pipeline, factor, "declared" or "detected") of the slowest straggler, if any."""
        candidates = [(f, k, "declared") for k, f in self.declared.items() if k < self.spec.dp]
        detected = self.detector.current
        if detected is not None:
            candidates.append((detected.factor, detected.pipeline, "detected"))
        if not candidates:
            return None
        factor, pipeline, source = max(candidates)
        return pipeline, factor, source

    def _base(self, pipeline: int) -> PlanResult | None:
        result = self.results.get((self.models(pipeline), None))
        return result if isinstance(result, PlanResult) else None

    def wanted(self) -> dict[int, PlanKey]:
        """The plan each pipeline should run: its models and deadline (None: no slowdown; also
        while any base plan is unsolved, since deadlines are relative to them)."""
        keys: dict[int, PlanKey] = {k: (self.models(k), None) for k in range(self.spec.dp)}
        straggler = self.straggler()
        if straggler is None:
            return keys
        slow, factor, source = straggler
        bases = {k: self._base(k) for k in keys}
        if any(b is None for b in bases.values()):
            return keys
        if source == "declared" or self.spec.dp == 1:
            pace = factor * bases[slow].iteration_time_s
        else:
            pace = factor * statistics.median(b.iteration_time_s for k, b in bases.items() if k != slow)
        for k in keys:
            if k != slow and pace > bases[k].iteration_time_s:
                keys[k] = (self.models(k), _deadline_key(pace))
        return keys

    def missing_plans(self) -> list[tuple[PlanKey, Profile]]:
        """Plans to solve (with their profile): base plans first, then straggler deadlines."""
        missing: dict[PlanKey, Profile] = {}
        for key in [(self.models(k), None) for k in range(self.spec.dp)] + list(self.wanted().values()):
            if key not in self.results and key not in missing:
                profile = self.pipeline_profile(key[0])
                if profile is not None:
                    missing[key] = profile
        return list(missing.items())

    def add_result(self, key: PlanKey, result: PlanResult | str) -> None:
        """A solved plan, or the planner's reason it could not (a base plan failing fails the job;
        a straggler deadline failing leaves the pipelines on their no-slowdown plans)."""
        self.results[key] = result
        self._changed()
        if isinstance(result, str) and key[1] is None:
            self.fail(result)
        if len(self.results) > MAX_RESULTS:  # many declared factors: forget the oldest deadlines
            keep = {plan.key for plan in self.plans.values()} | {key}
            for old in [k for k in self.results if k[1] is not None and k not in keep][: len(self.results) - MAX_RESULTS]:
                del self.results[old]

    def publish(self) -> list[int]:
        """Publish, with one new version and one start iteration, the wanted plan of every pipeline
        whose plan changes and is solved; the pipelines changed."""
        changed: dict[int, tuple[PlanKey, PlanResult]] = {}
        for k, key in self.wanted().items():
            result = self.results.get(key)
            if result is None:
                continue  # being solved: keep the current plan meanwhile
            if isinstance(result, str):
                key = (self.models(k), None)  # the deadline failed: run the no-slowdown plan
                result = self.results.get(key)
            if isinstance(result, PlanResult) and (k not in self.plans or self.plans[k].key != key):
                changed[k] = (key, result)
        if not changed:
            return []
        self.last_version += 1
        start = self.last_iteration + self._lead() if self.last_iteration >= 0 else 0
        for k, ((models, deadline), result) in changed.items():
            base = {f.name: getattr(result, f.name) for f in fields(PlanResult)}
            self.plans[k] = PublishedPlan(**base, version=self.last_version, start_iteration=start, models=models, deadline_s=deadline)
            history = self.history[k]
            while history and history[-1][0] > self.last_iteration:
                history.pop()  # superseded before its start: the ranks never run it (see PlannerClient)
            history.append((start, result.iteration_time_s))
        self.planned = Mean()
        self._changed()
        return sorted(changed)

    def _lead(self) -> int:
        lead = PLAN_LEAD_ITERATIONS
        if self.recent_time_s:  # bounded below by the protocol; the min() keeps the ceil finite regardless
            lead = max(lead, math.ceil(min(PLAN_LEAD_S / self.recent_time_s, MAX_PLAN_LEAD)))
        return min(lead, MAX_PLAN_LEAD)

    def declare_straggler(self, pipeline: int, factor: float | None) -> None:
        if pipeline >= self.spec.dp:
            raise _bad_field(f"pipeline {pipeline} does not exist: job {self.job_id} has dp={self.spec.dp} (pipelines 0..{self.spec.dp - 1})")
        if factor is None:
            self.declared.pop(pipeline, None)
        else:
            self.declared[pipeline] = factor

    def fail(self, message: str) -> None:
        self.error = clip(message)
        self._changed()

    def degrade(self, message: str) -> None:
        """Something went wrong that leaves the job running (its state not saved); "" when mended."""
        self.warning = clip(message)

    # ---- predicted against measured ------------------------------------------------------------------

    def _planned_time_at(self, pipeline: int, iteration: int) -> float | None:
        times = [t for start, t in self.history[pipeline] if start <= iteration]
        return times[-1] if times else None

    def record(self, report: ReportIteration) -> tuple[Measured, bool] | None:
        """Add one rank's report; (the iteration's total, whether it ran a plan) once complete.
        Each pipeline's iterations also feed the straggler detector (see `update_stragglers`)."""
        info = self.rank(report.rank)
        self.note_iteration(report.iteration)
        self._record_pipeline(info, report)
        measured = self.tally.add(report.rank, report.iteration, report.time_s, report.energy_j)
        if measured is None:
            return None
        self.recent_time_s = measured.time_s
        if self.plans and measured.iteration >= max(p.start_iteration for p in self.plans.values()):
            self.planned.add(measured)
            return measured, True
        if measured.iteration < self.spec.warmup_iterations:
            self.baseline.add(measured)
        return measured, False

    def _record_pipeline(self, info: RankInfo, report: ReportIteration) -> None:
        k = info.dp_index
        time_s = report.time_s if report.compute_time_s is None else report.compute_time_s
        measured = self.pipeline_tally[k].add(report.rank, report.iteration, time_s, report.energy_j)
        if measured is None:
            return
        self.measured_time[k].append(measured.time_s)
        planned = self._planned_time_at(k, measured.iteration)
        base = self._base(k)
        if planned is not None and base is not None:
            # At its no-slowdown plan's time scale: a pipeline slowed on purpose is not slow.
            self.detector.add(k, measured.time_s / planned * base.iteration_time_s)
            self._fed = True

    def update_stragglers(self) -> bool:
        """Re-decide the detected straggler after new pipeline iterations; True if it changed
        (the service then publishes or solves the plans the pipelines now want)."""
        if not self._fed:
            return False
        self._fed = False
        previous = self.detector.current
        current = self.detector.update()
        if current == previous:
            return False
        if current is None:
            log.info("job %s: pipeline %d recovered; back to the no-slowdown plans", self.job_id, previous.pipeline)
        else:
            log.info("job %s: pipeline %d straggles (%.3fx the others' iteration time)", self.job_id, current.pipeline, current.factor)
        return True

    def describe(self, measured: Measured) -> str:
        time_p, energy_p = self._predicted()
        versions = sorted({p.version for p in self.plans.values()})
        return (
            f"job {self.job_id} iteration {measured.iteration} (plan v{','.join(map(str, versions))}): "
            f"time {measured.time_s:.4f} s (predicted {time_p:.4f} s, {100 * (measured.time_s / time_p - 1):+.1f}%), "
            f"energy {measured.energy_j:.1f} J (predicted {energy_p:.1f} J, {100 * (measured.energy_j / energy_p - 1):+.1f}%)"
        )

    def _predicted(self) -> tuple[float, float]:
        """Iteration time (the slowest pipeline's plan) and energy (summed over pipelines); a
        pipeline without a plan is counted at its peers' mean."""
        plans = list(self.plans.values())
        energy = sum(p.energy_j for p in plans) * self.spec.dp / len(plans)
        return max(p.iteration_time_s for p in plans), energy

    def status(self) -> JobStatus:
        predicted: dict[str, float | None] = {"time": None, "energy": None, "baseline": None}
        if self.plans:
            predicted["time"], predicted["energy"] = self._predicted()
            predicted["baseline"] = sum(p.baseline_energy_j for p in self.plans.values()) * self.spec.dp / len(self.plans)
        straggler = self.straggler()
        pipelines = []
        for k in range(self.spec.dp):
            plan = self.plans.get(k)
            slow = straggler is not None and straggler[0] == k
            pipelines.append(
                PipelineStatus(
                    pipeline=k,
                    plan_version=plan.version if plan else 0,
                    deadline_s=plan.deadline_s if plan else None,
                    predicted_iteration_time_s=plan.iteration_time_s if plan else None,
                    measured_iteration_time_s=statistics.median(self.measured_time[k]) if self.measured_time[k] else None,
                    straggler=straggler[2] if slow else "",
                    straggler_factor=straggler[1] if slow else None,
                )
            )
        return JobStatus(
            job_id=self.job_id,
            phase=self.phase.value,
            world_size=self.spec.world_size,
            ranks_registered=len(self.ranks),
            profiled_stages=self.profiled_stages,
            plan_version=max((p.version for p in self.plans.values()), default=0),
            last_iteration=self.last_iteration,
            error=self.error,
            warning=self.warning,
            predicted_iteration_time_s=predicted["time"],
            predicted_energy_j=predicted["energy"],
            predicted_baseline_energy_j=predicted["baseline"],
            baseline_iterations=self.baseline.count,
            baseline_iteration_time_s=self.baseline.time_s,
            baseline_energy_j=self.baseline.energy_j,
            planned_iterations=self.planned.count,
            planned_iteration_time_s=self.planned.time_s,
            planned_energy_j=self.planned.energy_j,
            pipelines=tuple(pipelines),
        )

    # ---- persistence ---------------------------------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "spec": self.spec_record,
            "ranks": [self.ranks[r].to_wire() for r in sorted(self.ranks)],
            "sweep": None if self.sweep is None else list(self.sweep),
            "cached": self.spec.gpu_model in self.cached,
            "cached_models": sorted(m for m in self.cached if m != self.spec.gpu_model),
            "uploads": [[m, s, t, name] for (m, s, t), name in sorted(self.upload_names.items())],
            "error": self.error,
            "last_version": self.last_version,
            "plans": {str(k): asdict(p) for k, p in sorted(self.plans.items())},
            "declared": {str(k): f for k, f in sorted(self.declared.items())},
        }

    @classmethod
    def from_record(cls, doc: dict[str, Any], stage_profiles: dict[str, Profile], cached: dict[str, Profile]) -> Job:
        """Rebuild a job saved by `to_record` from its uploads (by state-file name) and the cached
        profiles of its GPU models. Pipelines whose plans are lost re-plan if their profiles are
        complete, else the missing stages are profiled. Records of earlier releases (one "plan",
        uploads as stage-<s>) load too."""
        spec = JobSpec.from_wire(doc["spec"])
        if spec.job_id() != doc["job_id"]:
            raise ValueError(f"record of {doc['job_id']} holds the spec of {spec.job_id()}")
        job = cls(spec, build_schedule=False)
        try:
            job.set_schedule(job_schedule(spec))
        except ConfigError as e:
            job.fail(f"invalid job: {e}")  # as when it registered: it stays failed, and says why
        saved_sweep = doc.get("sweep")
        if saved_sweep is not None:  # before the ranks: they were checked against it in their order
            job.sweep = tuple(int(f) for f in saved_sweep)
        for info in doc.get("ranks", []):
            try:
                job.add_rank(RankInfo.from_wire(info))
            except ServiceError as e:  # the rank registers again when it next reaches the service
                log.warning("job %s: rank record not resumed: %s", job.job_id, e.message)
        for model in ([spec.gpu_model] if doc.get("cached") else []) + list(doc.get("cached_models", [])):
            if model in cached:
                job.add_cached(model, cached[model])
        uploads = doc.get("uploads")
        if uploads is None:  # an earlier release: stage-<s> files of the job's model
            uploads = [[spec.gpu_model, int(n.removeprefix("stage-")), 0, n] for n in stage_profiles if n.removeprefix("stage-").isdigit()]
        for model, stage, tp_index, name in uploads:
            if name in stage_profiles and 0 <= stage < spec.pp and 0 <= tp_index < spec.tp and stage not in job.profiled_stages_of(model):
                job._take_upload(model, stage, tp_index, stage_profiles[name], name)
        if spec.gpu_model in job.cached:
            job.sweep = ()
        elif saved_sweep is None:
            job.sweep = spec.sweep_frequencies or (job.ranks[min(job.ranks)].frequencies if job.ranks else None)
        job.last_version = int(doc.get("last_version", 0))
        plans = doc.get("plans")
        if plans is None and doc.get("plan") is not None:  # an earlier release: one plan for all pipelines
            plans = {str(k): {**doc["plan"], "models": list(job.models(k))} for k in range(spec.dp)}
        for k, record in (plans or {}).items():
            plan = PublishedPlan.from_record(record)
            job.plans[int(k)] = plan
            job.results[plan.key] = PlanResult(**{f.name: getattr(plan, f.name) for f in fields(PlanResult)})
        job.declared = {int(k): float(f) for k, f in doc.get("declared", {}).items()}
        job.error = clip(str(doc["error"])) if doc.get("error") else ""
        job._reset_measurements()
        job._changed()
        return job
