"""The service's answers to each request, on the loop: they act on the admitted jobs, hand
new schedules to the workers and have the jobs they change planned (`Results.plan`) and saved.

A request that cannot be acted on raises ServiceError (the reply's error code and a message
saying what to fix); `PlannerService.handle` turns it into the error reply.
"""

from __future__ import annotations

import dataclasses
import logging

from perseus.exceptions import ServiceError
from perseus.service.admission import Admission
from perseus.service.job import Job
from perseus.service.keeper import Keeper
from perseus.service.results import Results
from perseus.service.tally import ODD_TIME
from perseus.service.text import clip
from perseus.service.workers import Workers
from perseus.wire.envelope import ErrorCode
from perseus.wire.fields import Message
from perseus.wire.limits import MIN_SWEEP_VERSION, REFERENCE_SWEEP_VERSION, ROUNDS_SWEEP_VERSION, SWEEP_VERSION
from perseus.wire.messages import (
    Ack,
    DeclareStraggler,
    GetStatus,
    GetTable,
    JobRegistered,
    JobStatus,
    RankRegistered,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    Status,
    UploadProfile,
)
from perseus.wire.spans import ReportSpans

log = logging.getLogger(__name__)

LOG_FIRST = 3  # log this many planned iterations of each plan, then every `log_every`-th


class Handlers:
    """One method per request type; each returns the reply message."""

    def __init__(
        self, admission: Admission, workers: Workers, keeper: Keeper, results: Results, log_every: int = 10
    ) -> None:
        self.admission = admission
        self.jobs: dict[str, Job] = admission.jobs
        self.workers = workers
        self.keeper = keeper
        self.results = results
        self.log_every = max(1, log_every)

    def register_job(self, msg: RegisterJob) -> JobRegistered:
        spec = msg.spec
        job = self.jobs.get(spec.job_id())
        if job is not None:
            self.admission.touch(job.job_id)
            job.rerun()
            if job.model.calibrates:
                self.workers.forget(job.job_id)  # its planners hold the earlier run's calibration
            log.info(
                "job %s registered again: a new run (phase %s%s)",
                job.job_id,
                job.phase.value,
                "; its baseline is measured again before any plan applies" if job.model.calibrates else "",
            )
        else:
            cost = self.admission.admit(spec)
            cached = self.keeper.state.load_cached_profile(spec.profile_key(), spec.signature())
            job = Job(spec, cached_profile=cached, build_schedule=False)
            self.admission.add(job, cost)
            self.workers.build(spec)
            log.info(
                "job %s registered: %s, %d stages%s x %d microbatches, dp %d, tp %d (world size %d, %s rank mapping), "
                "GPU %s%s",
                job.job_id,
                spec.schedule_name,
                spec.pp,
                f" of {spec.num_chunks} chunks ({spec.pp * spec.num_chunks} virtual)" if spec.num_chunks > 1 else "",
                spec.num_microbatches,
                spec.dp,
                spec.tp,
                spec.world_size,
                spec.rank_mapping,
                spec.gpu_model,
                "; profile cached, skipping profiling" if cached is not None else "",
            )
        self.results.plan(job)
        return JobRegistered(job.job_id, job.phase.value, spec.gpu_model in job.cached)

    def register_rank(self, msg: RegisterRank) -> RankRegistered:
        job = self.admission.get(msg.job_id)
        info = msg.info
        models = job.models(info.dp_index)
        job.add_rank(info)
        model = info.gpu_model
        cached = None
        if model not in job.cached and not job.profiled_stages_of(model):
            cached = self.keeper.state.load_cached_profile(job.spec.profile_key(model), job.spec.signature(model))
            if cached is not None:
                job.add_cached(model, cached)
                log.info("job %s: profile of GPU model %s cached, skipping its profiling", job.job_id, model)
        level = logging.INFO if job.spec.world_size <= 64 or len(job.ranks) == job.spec.world_size else logging.DEBUG
        log.log(
            level,
            "job %s: rank %d registered (stage %d, dp %d, tp %d, %s); %d of %d",
            job.job_id,
            info.rank,
            info.stage,
            info.dp_index,
            info.tp_index,
            model,
            len(job.ranks),
            job.spec.world_size,
        )
        if job.models(info.dp_index) != models or cached is not None or not info.timeline:
            # The pipeline's GPU models changed, a cached profile came in, or the rank sends no
            # spans to calibrate on (the job is then planned on its profile alone).
            self.results.plan(job)
        else:
            self.keeper.unsaved.add(job.job_id)
        return RankRegistered(job.phase.value)

    def get_table(self, msg: GetTable) -> Message:
        job = self.admission.get(msg.job_id)
        self._watch_sweep(job, msg.rank, msg.iteration)
        table = job.table(msg.rank, msg.iteration, msg.plan_version)
        if table.reference and msg.sweep_version < REFERENCE_SWEEP_VERSION:
            table = dataclasses.replace(table, reference=False)  # it would not know the field
        if table.sweep_steps and msg.sweep_version < (ROUNDS_SWEEP_VERSION if table.sweep_round else MIN_SWEEP_VERSION):
            how = (
                "computing the sweep itself; this service designs it and sends each step"
                if msg.sweep_version < MIN_SWEEP_VERSION
                else f"which sweeps once; this service asks stage {job.rank(msg.rank).stage} for sweep round "
                f"{table.sweep_round} (its profile never arrived)"
            )
            raise ServiceError(
                ErrorCode.BAD_VERSION.value,
                f"rank {msg.rank} follows profiling sweep v{msg.sweep_version}, {how} (sweep v{SWEEP_VERSION}): "
                f"upgrade perseus on the ranks to the service's release (a client of your own asks get_table with "
                f"sweep_version={SWEEP_VERSION} and follows Table.sweep_steps)",
            )
        return table

    def _watch_sweep(self, job: Job, rank: int, iteration: int) -> None:
        """Ask a stage whose profile is overdue to sweep again, or fail the job (Job.watch_sweep)."""
        overdue = job.watch_sweep(rank, iteration)
        if overdue is None:
            return
        if overdue.failed:
            log.warning("job %s failed: %s", job.job_id, job.error)
        else:
            log.warning("job %s: %s", job.job_id, overdue.reason())
        self.results.plan(job)  # saved: its phase or its rounds changed

    def upload_profile(self, msg: UploadProfile) -> Ack:
        job = self.admission.get(msg.job_id)
        if job.schedule is None:
            # Not acknowledged: a profile is only taken once it can be checked and saved, so a
            # crash while the schedule builds never loses one the rank believes delivered.
            job.rank(msg.rank)
            if job.error:
                raise ServiceError(
                    ErrorCode.BAD_FIELD.value,
                    f"job {job.job_id} failed ({job.error}); fix it and register the job again",
                )
            raise ServiceError(
                ErrorCode.NOT_READY.value, f"job {job.job_id}'s schedule is still being built; the client retries"
            )
        name = job.add_profile(msg.rank, msg.stage, msg.profile)
        if name is not None:
            try:
                self.keeper.state.save_stage_profile(job.job_id, name, msg.profile)
            except OSError as e:
                job.drop_upload(msg.rank, name)
                reason = f"its state could not be saved: stage {msg.stage}'s profile ({e.strerror or e})"
                job.degrade(reason)
                log.error("job %s: %s; the rank is told to retry", job.job_id, reason)
                raise ServiceError(ErrorCode.NOT_READY.value, f"{reason}; the client retries") from None
            model = job.ranks[msg.rank].gpu_model
            if msg.stage in job.profiled_stages_of(model):
                log.info(
                    "job %s: stage %d profiled on %s by rank %d (pipeline %d) (%d of %d)",
                    job.job_id,
                    msg.stage,
                    model,
                    msg.rank,
                    job.ranks[msg.rank].dp_index,
                    len(job.profiled_stages_of(model)),
                    job.spec.pp,
                )
            else:
                shares = len(job.profiling.uploads[(model, msg.stage)])
                log.info(
                    "job %s: stage %d tensor-parallel share %d of %d in", job.job_id, msg.stage, shares, job.spec.tp
                )
            self.results.plan(job)
        return Ack(job.phase.value)

    def report_iteration(self, msg: ReportIteration) -> Ack:
        job = self.admission.get(msg.job_id)
        self.admission.reported(job.job_id)
        if msg.closing:
            job.close_rank(msg.rank)
            log.info(
                "job %s: rank %d closed (%d of %d)", job.job_id, msg.rank, len(job.closed_ranks), job.spec.world_size
            )
            return Ack(job.phase.value)
        told = job.iterations.went_back
        done = job.record(msg)
        if told is None and job.iterations.went_back is not None:
            rank, latest, iteration = job.iterations.went_back
            log.warning(
                "job %s: rank %d reports iteration %d after %d: it restarted alone, or two trainings of one spec "
                "share this job (their reports mix); give each training its own tag (perseus.instrument(..., tag=))",
                job.job_id,
                rank,
                iteration,
                latest,
            )
        self._watch_sweep(job, msg.rank, msg.iteration)
        if done is not None:
            self.keeper.measured(job)
            measured, planned = done
            count = job.measurements.since_published
            odd = job.measurements.odd
            if measured.odd_rank is not None and (odd <= LOG_FIRST or odd % self.log_every == 0):
                log.warning(
                    "job %s iteration %d left out of the measured means (%d so far): rank %d reported %.4g s, over "
                    "%.0fx the median rank's; its client reports something other than the iteration's time",
                    job.job_id,
                    measured.iteration,
                    odd,
                    measured.odd_rank,
                    measured.time_s,
                    ODD_TIME,
                )
            elif planned and (count <= LOG_FIRST or count % self.log_every == 0):
                log.info("%s", job.describe(measured))
            else:
                log.debug(
                    "job %s iteration %d: %.4f s, %.1f J",
                    job.job_id,
                    measured.iteration,
                    measured.time_s,
                    measured.energy_j,
                )
        if job.update_stragglers():
            self.results.plan(job)
        self.results.verify(job)
        return Ack(job.phase.value)

    def report_spans(self, msg: ReportSpans) -> Ack:
        job = self.admission.get(msg.job_id)
        if job.add_spans(msg):
            self.results.plan(job)  # a calibration may be due
        return Ack(job.phase.value)

    def declare_straggler(self, msg: DeclareStraggler) -> Ack:
        job = self.admission.get(msg.job_id)
        job.declare_straggler(msg.pipeline, msg.factor)
        if msg.factor is None:
            log.info("job %s: pipeline %d no longer declared a straggler", job.job_id, msg.pipeline)
        else:
            log.info(
                "job %s: pipeline %d declared a straggler (%.3fx its planned time)",
                job.job_id,
                msg.pipeline,
                msg.factor,
            )
        slowest = job.straggler()
        if len(job.measurements.declared) > 1 and slowest is not None:  # only the slowest sets the pace: say which
            log.info(
                "job %s: declared stragglers %s; the slowest, pipeline %d (%.3fx, %s), sets the others' pace",
                job.job_id,
                ", ".join(f"pipeline {k} {f:.3f}x" for k, f in sorted(job.measurements.declared.items())),
                slowest[0],
                slowest[1],
                slowest[2],
            )
        self.results.plan(job)
        return Ack(job.phase.value)

    def status(self, msg: GetStatus) -> Status:
        jobs = [self.admission.get(msg.job_id)] if msg.job_id is not None else [self.jobs[j] for j in sorted(self.jobs)]
        return Status(tuple(self.job_status(job) for job in jobs))

    def job_status(self, job: Job) -> JobStatus:
        """The job's status, or, if a bug keeps it from being told, a minimal one saying so: one
        job never makes the status of all jobs fail."""
        try:
            return dataclasses.replace(job.status(), quiet_s=self.admission.quiet_s(job.job_id))
        except Exception as e:  # fault isolation: the traceback is logged, the status says so
            log.exception("job %s: its status cannot be told", job.job_id)
            return JobStatus(
                job_id=job.job_id,
                phase="failed",
                world_size=job.spec.world_size,
                ranks_registered=len(job.ranks),
                profiled_stages=(),
                plan_version=0,
                last_iteration=-1,
                error=clip(f"status unavailable: internal error ({type(e).__name__}: {e})"),
            )
