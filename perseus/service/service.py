"""The planner service: registers jobs and ranks, hands out frequency tables, collects stage
profiles, has plans solved off the loop, and logs predicted against measured.

The parts: the ROUTER socket and its loop (transport.py), the jobs held within the budget
(admission.py), the threads that build schedules and solve plans (workers.py), and each job's
own state (job.py). This module answers the requests and moves work between them.

The socket loop must answer every rank within its timeout, so nothing slow runs on it: a new
job's schedule is built and validated on a worker thread (register_job replies at once with
the job id; an invalid schedule then fails the job, which its status and every rank's table
report), plans are solved on worker threads, and rank registrations are saved in batches.

Every request gets exactly one reply; a request that cannot be read or acted on gets an error
reply (ErrorCode plus a message saying what to fix), and the service keeps serving. Job state
is written to the state directory on every change, so a restarted service resumes.

Faults stay with the job they happen in: an exception in one job's code fails that job (its
status and tables say why), a write error degrades it (retried; a profile that could not be
saved is not acknowledged), and a state file that cannot be read at startup is quarantined.
Jobs are admitted against the service's `Budget` and evicted when idle past its time-to-live.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from perseus import __version__
from perseus.exceptions import ConfigError, PerseusError, ProfileError, ScheduleError, ServiceError
from perseus.schedules import Schedule
from perseus.service.admission import Admission
from perseus.service.budget import Budget, job_cost_bytes
from perseus.service.job import Job
from perseus.service.planning import plan_choices
from perseus.service.plans import PlanKey, document_name
from perseus.service.state import StateDir, default_state_dir
from perseus.service.text import clip
from perseus.service.transport import Transport
from perseus.service.workers import Solved, Workers
from perseus.wire.envelope import ErrorCode, RequestRejected, decode_request, encode_error, encode_reply
from perseus.wire.fields import Message
from perseus.wire.limits import DEFAULT_ADDRESS, PROTOCOL_VERSION
from perseus.wire.messages import (
    Ack,
    DeclareStraggler,
    GetStatus,
    GetTable,
    JobRegistered,
    JobStatus,
    Ping,
    Pong,
    RankRegistered,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    Status,
    UploadProfile,
)
from perseus.wire.security import PLAINTEXT, Security
from perseus.wire.spec import JobSpec

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 0.5  # rank registrations are saved this often (ranks re-register after a crash)
LOG_FIRST = 3  # log this many planned iterations of each plan, then every `log_every`-th
EVICT_CHECK_S = 10.0  # how often idle jobs are looked for
LOG_TEXT = 500  # characters of a refused request's message in the log


class PlannerService:
    """Serve on `address` (tcp://host:0 picks a free port; see `endpoint` after `bind()`)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        state_dir: str | None = None,
        *,
        security: Security = PLAINTEXT,
        insecure: bool = False,
        log_every: int = 10,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.budget = budget or Budget()
        self._clock = clock  # for jobs' idle time (tests pass a simulated one)
        self.security = security
        self.insecure = insecure
        self.log_every = max(1, log_every)
        self.state = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.workers = Workers(self.budget)
        self.admission = Admission(self.budget, clock, busy=self.workers.busy_with, evict=self._evict)
        self.jobs: dict[str, Job] = self.admission.jobs
        self._cache_saved: set[tuple[str, str]] = set()  # (job, GPU model) whose profile went to the signature cache
        self._unsaved: set[str] = set()  # jobs with rank registrations (or a failed write) not yet written
        self._saved_at = 0.0
        self._evicted_at = clock()
        self._stop = threading.Event()
        self._transport = Transport(address, security, insecure=insecure)
        self._handlers: dict[type[Message], Callable[[Any], Message]] = {
            RegisterJob: self._register_job,
            RegisterRank: self._register_rank,
            GetTable: self._get_table,
            UploadProfile: self._upload_profile,
            ReportIteration: self._report_iteration,
            DeclareStraggler: self._declare_straggler,
            GetStatus: self._status,
            Ping: lambda msg: Pong(PROTOCOL_VERSION, f"perseus {__version__}"),
        }
        self._load_jobs()

    @property
    def endpoint(self) -> str | None:
        """Where the service listens (with the real port), once bound."""
        return self._transport.endpoint

    # ---- the loop ------------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER; returns the endpoint (with the real port)."""
        endpoint = self._transport.bind()
        log.info(
            "planner service listening on %s (state: %s, %d jobs resumed)", endpoint, self.state.root, len(self.jobs)
        )
        return endpoint

    def serve_forever(self) -> None:
        """Answer requests until `stop()` (from a signal handler or another thread).

        The worker threads share the GIL with this loop, at the interpreter's switch interval
        (5 ms by default), which the service leaves alone. Lowering it to 1 ms
        (benchmarks/service_load.py, and pings while 6 jobs' plans solve, on 2 loaded cores)
        halved the 90th-percentile round trip (about 6 ms against 12 ms) but moved neither the
        median (0.6 ms), the planning time nor the load benchmark's phases: nothing against a
        rank's 1 s timeout and 0.25 s polls, so not worth a process-wide setting."""
        if not self._transport.bound:
            self.bind()
        self._transport.serve(self.handle, self.tend, self._stop)
        self._save_unsaved()
        log.info("planner service stopped")

    def tend(self) -> None:
        """The loop's work between requests: take built schedules and solved plans, save what is
        unsaved, evict jobs idle past their time-to-live."""
        self._finish_builds()
        self._finish_plans()
        if self._unsaved and time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
            self._save_unsaved()
        now = self._clock()
        if now - self._evicted_at >= EVICT_CHECK_S:
            self._evicted_at = now
            self.admission.evict_idle(now)

    @property
    def busy(self) -> bool:
        """Whether a schedule is being built or a plan solved (their results not yet taken)."""
        return self.workers.busy

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._transport.close()

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """Reply frames for one ROUTER message: [routing id, payload] in, [routing id, reply] out."""
        identity, payload = frames[0], frames[1:]
        if len(payload) != 1:
            message = (
                f"expected exactly one frame per message, got {len(payload)}; "
                "send one msgpack map per message (a DEALER socket, no empty delimiter)"
            )
            return [identity, encode_error(None, ErrorCode.BAD_FRAME, message)]
        try:
            request_id, request = decode_request(payload[0])
        except RequestRejected as e:
            log.info("rejected a request: %s", clip(str(e), LOG_TEXT))
            return [identity, encode_error(e.request_id, ErrorCode(e.code), e.message)]
        try:
            return [identity, encode_reply(request_id, self._handlers[type(request)](request))]
        except ServiceError as e:
            code, message = ErrorCode(e.code), e.message
        except (ConfigError, ProfileError, ScheduleError) as e:
            code, message = ErrorCode.BAD_FIELD, str(e)
        except (
            Exception
        ) as e:  # a bug: this request gets an internal_error reply (traceback logged), the loop keeps serving
            log.exception("internal error handling %s", request.TYPE)
            code, message = (
                ErrorCode.INTERNAL,
                f"internal error ({type(e).__name__}: {e}); the service log has the traceback",
            )
        quiet = code in (ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_RANK, ErrorCode.NOT_READY)  # ranks retry these
        log.log(
            logging.DEBUG if quiet else logging.INFO,
            "%s refused: [%s] %s",
            request.TYPE,
            code.value,
            clip(message, LOG_TEXT),
        )
        return [identity, encode_error(request_id, code, message)]

    # ---- requests ------------------------------------------------------------------------------

    def _register_job(self, msg: RegisterJob) -> JobRegistered:
        spec = msg.spec
        job = self.jobs.get(spec.job_id())
        if job is not None:
            self.admission.touch(job.job_id)
            job.rerun()
            log.info("job %s registered again (phase %s)", job.job_id, job.phase.value)
        else:
            cost = self.admission.admit(spec)
            cached = self.state.load_cached_profile(spec.profile_key(), spec.signature())
            job = Job(spec, cached_profile=cached, build_schedule=False)
            self.admission.add(job, cost)
            self.workers.build(spec)
            log.info(
                "job %s registered: %s, %d stages x %d microbatches, dp %d, tp %d (world size %d, %s rank mapping), "
                "GPU %s%s",
                job.job_id,
                spec.schedule_name,
                spec.pp,
                spec.num_microbatches,
                spec.dp,
                spec.tp,
                spec.world_size,
                spec.rank_mapping,
                spec.gpu_model,
                "; profile cached, skipping profiling" if cached is not None else "",
            )
        self._plan(job)
        return JobRegistered(job.job_id, job.phase.value, spec.gpu_model in job.cached)

    def _register_rank(self, msg: RegisterRank) -> RankRegistered:
        job = self.admission.get(msg.job_id)
        info = msg.info
        models = job.models(info.dp_index)
        job.add_rank(info)
        model = info.gpu_model
        cached = None
        if model not in job.cached and not job.profiled_stages_of(model):
            cached = self.state.load_cached_profile(job.spec.profile_key(model), job.spec.signature(model))
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
        if job.models(info.dp_index) != models or cached is not None:
            self._plan(job)  # the pipeline's GPU models changed, or a cached profile came in
        else:
            self._unsaved.add(job.job_id)
        return RankRegistered(job.phase.value)

    def _get_table(self, msg: GetTable) -> Message:
        return self.admission.get(msg.job_id).table(msg.rank, msg.iteration, msg.plan_version)

    def _upload_profile(self, msg: UploadProfile) -> Ack:
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
                self.state.save_stage_profile(job.job_id, name, msg.profile)
            except OSError as e:
                job.drop_upload(msg.rank, name)
                reason = f"its state could not be saved: stage {msg.stage}'s profile ({e.strerror or e})"
                job.degrade(reason)
                log.error("job %s: %s; the rank is told to retry", job.job_id, reason)
                raise ServiceError(ErrorCode.NOT_READY.value, f"{reason}; the client retries") from None
            model = job.ranks[msg.rank].gpu_model
            if msg.stage in job.profiled_stages_of(model):
                log.info(
                    "job %s: stage %d profiled on %s (%d of %d)",
                    job.job_id,
                    msg.stage,
                    model,
                    len(job.profiled_stages_of(model)),
                    job.spec.pp,
                )
            else:
                shares = len(job.profiling.uploads[(model, msg.stage)])
                log.info(
                    "job %s: stage %d tensor-parallel share %d of %d in", job.job_id, msg.stage, shares, job.spec.tp
                )
            self._plan(job)
        return Ack(job.phase.value)

    def _report_iteration(self, msg: ReportIteration) -> Ack:
        job = self.admission.get(msg.job_id)
        done = job.record(msg)
        if done is not None:
            measured, planned = done
            count = job.measurements.planned.count
            if planned and (count <= LOG_FIRST or count % self.log_every == 0):
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
            self._plan(job)
        return Ack(job.phase.value)

    def _declare_straggler(self, msg: DeclareStraggler) -> Ack:
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
        self._plan(job)
        return Ack(job.phase.value)

    def _status(self, msg: GetStatus) -> Status:
        jobs = [self.admission.get(msg.job_id)] if msg.job_id is not None else [self.jobs[j] for j in sorted(self.jobs)]
        return Status(tuple(self._job_status(job) for job in jobs))

    def _job_status(self, job: Job) -> JobStatus:
        """The job's status, or, if a bug keeps it from being told, a minimal one saying so: one
        job never makes the status of all jobs fail."""
        try:
            return job.status()
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

    # ---- fault isolation -----------------------------------------------------------------------

    def _guard(self, job: Job, what: str, action: Callable[..., None], *args: Any) -> None:
        """Run one job's `action(*args)` on the loop thread: a write error degrades the job (the
        write is retried), any other exception fails that job alone, and the service keeps serving."""
        try:
            action(*args)
        except OSError as e:
            reason = f"its state could not be saved while {what} ({e.strerror or e}); retrying"
            if job.warning != clip(reason):
                log.error("job %s: %s", job.job_id, reason)
            job.degrade(reason)
            self._unsaved.add(job.job_id)
        except Exception as e:  # fault isolation: the traceback is logged, the job says why it failed
            log.exception(
                "job %s: internal error while %s; the job is failed, its ranks run at maximum clocks", job.job_id, what
            )
            job.fail(f"internal error while {what} ({type(e).__name__}: {e}); the service log has the traceback")

    # ---- schedules and plans -------------------------------------------------------------------

    def _finish_builds(self) -> None:
        for spec, result, seconds in self.workers.built():
            job = self.jobs.get(spec.job_id())
            if job is None or job.spec != spec:
                continue  # evicted meanwhile
            self._guard(job, "building its schedule", self._take_schedule, job, result, seconds)

    def _take_schedule(self, job: Job, result: Schedule | BaseException, seconds: float) -> None:
        if isinstance(result, PerseusError):
            job.fail(f"invalid job: {result}")
            log.error("job %s: %s; its ranks stay at maximum clocks", job.job_id, job.error)
        elif isinstance(result, BaseException):
            job.fail(f"invalid job: internal error ({type(result).__name__}: {result})")
            log.error("job %s: %s; its ranks stay at maximum clocks", job.job_id, job.error, exc_info=result)
        else:
            job.set_schedule(result)
            log.info(
                "job %s: schedule built in %.2f s (%d instructions)",
                job.job_id,
                seconds,
                sum(len(r) for r in result.stages),
            )
        self._plan(job)

    def _plan(self, job: Job) -> None:
        """Publish what is solved, start solving what is missing, save the job."""
        self._guard(job, "publishing its plans", self._publish, job)
        self._guard(job, "starting its planning", self._start_planning, job)
        self._guard(job, "saving its state", self._save, job)

    def _start_planning(self, job: Job) -> None:
        if job.job_id in self.workers.planning or job.error or job.schedule is None:
            return  # (no plan is missing while the schedule is being built: no profile is complete)
        tasks = []
        for key, profile in job.missing_plans():
            choices = plan_choices(job.schedule, profile)
            if choices > self.budget.max_plan_choices:
                job.add_result(
                    key,
                    f"the profile gives {choices} (instruction, frequency) choices, over the service's planning budget "
                    f"of {self.budget.max_plan_choices}; profile fewer frequencies (JobSpec.sweep_frequencies) or ask "
                    "the operator to raise --max-plan-choices",
                )
                log.error(
                    "job %s: %s (%s)",
                    job.job_id,
                    job.error or "a deadline is over the planning budget",
                    _describe_key(key),
                )
            else:
                tasks.append((key, profile))
        if tasks:
            log.info("job %s: planning %s", job.job_id, ", ".join(_describe_key(key) for key, _ in tasks))
            self.workers.solve(job.job_id, job.schedule, tasks)

    def _publish(self, job: Job) -> None:
        changed = job.publish()
        for k in changed if len(changed) <= 8 else changed[:1]:
            plan = job.plans[k]
            saving = 1.0 - plan.energy_j / plan.baseline_energy_j
            log.info(
                "job %s: pipeline %d plan v%d from iteration %d (%s): iteration %.4f s (max clocks %.4f s), "
                "energy %.1f J (max clocks %.1f J, saving %.1f%%, lower bound %.1f J)",
                job.job_id,
                k,
                plan.version,
                plan.start_iteration,
                _describe_key(plan.key),
                plan.iteration_time_s,
                plan.baseline_iteration_time_s,
                plan.energy_j,
                plan.baseline_energy_j,
                100 * saving,
                plan.lower_bound_j,
            )
        if len(changed) > 8:
            log.info(
                "job %s: plan v%d published for %d pipelines", job.job_id, job.plan_book.last_version, len(changed)
            )

    def _finish_plans(self) -> None:
        for job_id, done in self.workers.solved():
            job = self.jobs.get(job_id)
            if job is None:
                continue  # evicted meanwhile
            self._guard(job, "taking its solved plans", self._take_plans, job, done)
            self._plan(job)

    def _take_plans(self, job: Job, done: list[Solved]) -> None:
        job_id = job.job_id
        for key, result, seconds in done:
            if isinstance(result, BaseException):
                if isinstance(result, PerseusError):
                    message = f"planning failed: {result}"
                else:
                    log.error("job %s: planner crashed", job_id, exc_info=result)
                    message = f"planning failed with an internal error ({type(result).__name__}: {result})"
                job.add_result(key, message)
                log.error(
                    "job %s: %s (%s); %s",
                    job_id,
                    clip(message),
                    _describe_key(key),
                    "its ranks stay at maximum clocks"
                    if key[1] is None
                    else "those pipelines keep their no-slowdown plans",
                )
                continue
            plan, document = result
            job.add_result(key, plan)
            log.info(
                "job %s: solved %s in %.2f s: %.4f s, %.1f J per pipeline",
                job_id,
                _describe_key(key),
                seconds,
                plan.iteration_time_s,
                plan.energy_j,
            )
            # The plan is in force once published; its full document is a record for the operator,
            # so a write error here degrades the job (see _guard) and loses nothing the ranks need.
            self.state.save_plan_document(job_id, document, document_name(job.spec, key))
        for model in list(job.profiles):
            profile = job.model_profile(model)
            if profile is not None and model not in job.cached and (job_id, model) not in self._cache_saved:
                self.state.save_cached_profile(job.spec.profile_key(model), job.spec.signature(model), profile)
                self._cache_saved.add((job_id, model))

    # ---- state ---------------------------------------------------------------------------------

    def _save(self, job: Job) -> None:
        self.state.save_job(job.to_record())
        self._unsaved.discard(job.job_id)
        if job.warning:
            log.info("job %s: its state is saved again", job.job_id)
            job.degrade("")

    def _save_unsaved(self) -> None:
        for job_id in sorted(self._unsaved):
            job = self.jobs.get(job_id)
            if job is None:
                self._unsaved.discard(job_id)
            else:
                self._guard(job, "saving its state", self._save, job)
        self._saved_at = time.monotonic()

    def _load_jobs(self) -> None:
        """Resume every job of the state directory; a record that cannot be resumed is moved to
        the quarantine folder (one log line) and the others load."""
        for folder, record in self.state.load_jobs():
            try:
                spec = JobSpec.from_wire(record["spec"])
                models = ([spec.gpu_model] if record.get("cached") else []) + list(record.get("cached_models", []))
                cached = {
                    m: p
                    for m in models
                    if (p := self.state.load_cached_profile(spec.profile_key(m), spec.signature(m))) is not None
                }
                job = Job.from_record(record, self.state.load_stage_profiles(folder), cached)
                if job.job_id != folder.name:
                    raise ValueError(f"the folder of job {folder.name} holds the record of {job.job_id}")
                cost = job_cost_bytes(spec)
            except Exception as e:  # fault isolation: whatever a damaged file holds, the other jobs resume
                # One WARNING line names the file and the error; the traceback (a bug, not a damaged file?)
                # is logged at debug level.
                log.debug("job folder %s cannot be resumed", folder, exc_info=True)
                self.state.quarantine(folder, f"{type(e).__name__}: {e}")
                continue
            self.admission.add(job, cost)
            log.info("resumed job %s (phase %s, plan v%d)", job.job_id, job.phase.value, job.plan_book.last_version)
            self._plan(job)

    def _evict(self, job_id: str, why: str) -> None:
        """Forget a job and delete its state (its cached profiles stay: if it comes back, it
        registers again and skips profiling)."""
        self.admission.remove(job_id)
        self._unsaved.discard(job_id)
        self.workers.forget(job_id)
        try:
            self.state.remove_job(job_id)
        except OSError as e:
            log.warning("job %s evicted, but its state folder could not be removed: %s", job_id, e)
        log.info("job %s evicted: %s", job_id, why)


def _describe_key(key: PlanKey) -> str:
    models, deadline = key
    names = sorted(set(models))
    where = names[0] if len(names) == 1 else "/".join(models)
    return f"{where}, " + ("no slowdown" if deadline is None else f"deadline {deadline:.4f} s")
