"""The planner service: a ZeroMQ ROUTER that registers jobs and ranks, hands out frequency
tables, collects stage profiles, plans on a worker thread, and logs predicted against measured.

The socket loop must answer every rank within its timeout, so nothing slow runs on it: a new
job's schedule is built and validated on a worker thread (register_job replies at once with
the job id; an invalid schedule then fails the job, which its status and every rank's table
report), plans are solved on worker threads, and rank registrations are saved in batches.

Every request gets exactly one reply; a request that cannot be read or acted on gets an error
reply (protocol.ErrorCode plus a message saying what to fix), and the service keeps serving.
Job state is written to the state directory on every change, so a restarted service resumes.

Faults stay with the job they happen in: an exception in one job's code fails that job (its
status and tables say why), a write error degrades it (retried; a profile that could not be
saved is not acknowledged), and a state file that cannot be read at startup is quarantined.
Jobs are admitted against the service's `Budget` and evicted when idle past its time-to-live.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from perseus import __version__
from perseus.exceptions import ConfigError, PerseusError, ProfileError, ScheduleError, ServiceError
from perseus.service.budget import Budget, job_cost_bytes
from perseus.service.job import Job
from perseus.service.planning import PlanResult, job_schedule, make_planner, plan_choices, plan_pipeline
from perseus.service.plans import PlanKey, document_name
from perseus.service.state import StateDir, default_state_dir
from perseus.service.text import clip
from perseus.wire.envelope import ErrorCode, RequestRejected, decode_request, encode_error, encode_reply
from perseus.wire.fields import Message
from perseus.wire.limits import DEFAULT_ADDRESS, HARD_MESSAGE_BYTES, PROTOCOL_VERSION
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
from perseus.wire.security import PLAINTEXT, Security, drop_connection, is_local_endpoint, peer_key
from perseus.wire.spec import JobSpec

log = logging.getLogger(__name__)

POLL_MS = 50  # how often the loop checks for a stop request and finished plans
MAX_PLANNERS = 16  # planners kept for re-planning (least recently used dropped): each holds its LP
SAVE_INTERVAL_S = 0.5  # rank registrations are saved this often (ranks re-register after a crash)
LOG_FIRST = 3  # log this many planned iterations of each plan, then every `log_every`-th
GIL_SWITCH_S = 0.001  # see serve_forever
EVICT_CHECK_S = 10.0  # how often idle jobs are looked for
LOG_TEXT = 500  # characters of a refused request's message in the log
# Peers: one that has not finished its handshake in HANDSHAKE_MS, or stops answering ZeroMQ
# heartbeats for HEARTBEAT_TIMEOUT_MS, is dropped, so idle or half-open connections do not pile
# up; replies queued to a peer that does not read them are bounded by REPLY_QUEUE.
HANDSHAKE_MS = 5_000
HEARTBEAT_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 30_000
REPLY_QUEUE = 100
FILE_LIMIT = 65_536  # open files wanted: each peer holds one; the soft limit is raised towards it


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
        self.jobs: dict[str, Job] = {}
        self._active: dict[str, float] = {}  # job id -> monotonic time of its latest request
        self._costs: dict[str, int] = {}  # job id -> estimated memory (budget.job_cost_bytes)
        self.endpoint: str | None = None
        self._planning: set[str] = set()  # jobs with plans on the planning workers
        self._building: set[str] = set()  # jobs whose schedule the builder thread has
        self._to_plan: queue.SimpleQueue[tuple[str, Any, list[tuple[PlanKey, Any]]]] = queue.SimpleQueue()
        self._planners_started = 0
        # (job, stage models) -> (Planner, its choices), reused for later deadlines (see _planner).
        self._planners: OrderedDict[tuple[str, tuple[str, ...]], tuple[Any, int]] = OrderedDict()
        self._planners_lock = threading.Lock()
        self._cache_saved: set[tuple[str, str]] = set()
        self._unsaved: set[str] = set()  # jobs with rank registrations (or a failed write) not yet written
        self._saved_at = 0.0
        self._evicted_at = clock()
        self._results: queue.SimpleQueue[tuple[str, list[tuple[PlanKey, tuple[PlanResult, dict] | BaseException, float]]]] = queue.SimpleQueue()
        # New jobs' schedules: built one at a time on one worker thread, handed back to the loop.
        self._to_build: queue.SimpleQueue[JobSpec] = queue.SimpleQueue()
        self._built: queue.SimpleQueue[tuple[JobSpec, Any, float]] = queue.SimpleQueue()
        self._builder: threading.Thread | None = None
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
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

    # ---- socket loop ---------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER; returns the endpoint (with the real port)."""
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_BYTES)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDHWM, REPLY_QUEUE)
        _raise_file_limit()
        self.security.configure_server(sock)
        address = self.address
        if address.startswith("tcp://") and address.endswith(":0"):
            address = address[:-2] + ":*"
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close()
            if e.errno == zmq.EADDRINUSE:
                hint = "is another perseus serve running there? pick another --bind address"
            else:
                hint = f"--bind takes a ZeroMQ endpoint on this machine, such as {DEFAULT_ADDRESS} or tcp://127.0.0.1:0 (a free port)"
            raise ConfigError(f"cannot bind {self.address}: {zmq.strerror(e.errno)}; {hint}") from None
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if not is_local_endpoint(self.endpoint) and not self.security.authenticated:
            if not self.insecure:
                self._socket = None
                sock.close(linger=0)
                raise ConfigError(
                    f"refusing to listen on {self.endpoint} without authentication: anyone who can reach it could change your GPUs' "
                    "clocks. Create keys with `perseus keys` and pass --curve-keys DIR, bind a loopback address, "
                    "or pass --insecure on a trusted network"
                )
            log.warning(
                "\n%s\nWARNING: the planner service listens on %s, reachable from other machines, WITHOUT authentication (--insecure).\n"
                "Anyone who can reach this port can register jobs and change the GPU clocks of your ranks.\n"
                "Use --curve-keys DIR (see `perseus keys`) or bind a loopback address unless this network is trusted.\n%s",
                "!" * 100,
                self.endpoint,
                "!" * 100,
            )
        log.info("planner service listening on %s (state: %s, %d jobs resumed)", self.endpoint, self.state.root, len(self.jobs))
        return self.endpoint

    def serve_forever(self) -> None:
        """Answer requests until `stop()` (from a signal handler or another thread)."""
        if self._socket is None:
            self.bind()
        sock = self._socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        # Worker threads (schedules, plans) run Python code; each blocking call of this loop
        # (zmq, file writes) gives them the GIL and waits up to the switch interval to get it
        # back. 1 ms instead of 5 ms keeps a request's round trip short while they run.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, GIL_SWITCH_S))
        try:
            self._serve(sock, poller)
        finally:
            sys.setswitchinterval(switch)
        self._save_unsaved()
        log.info("planner service stopped")

    def _serve(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        while not self._stop.is_set():
            if poller.poll(POLL_MS):
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if self.security.authorized(peer_key(frames[-1])):
                        reply = self.handle([frame.bytes for frame in frames])
                    else:
                        reply = self._refuse_revoked(frames)
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.Again:
                        log.warning("reply to a peer dropped: its queue is full")
            self.tend()

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
            self._evict_idle(now)

    @property
    def busy(self) -> bool:
        """Whether a schedule is being built or a plan solved (their results not yet taken)."""
        return bool(self._building or self._planning)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self.security.close()
        self._context.term()

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """Reply frames for one ROUTER message: [routing id, payload] in, [routing id, reply] out."""
        identity, payload = frames[0], frames[1:]
        if len(payload) != 1:
            message = f"expected exactly one frame per message, got {len(payload)}; send one msgpack map per message (a DEALER socket, no empty delimiter)"
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
        except Exception as e:
            log.exception("internal error handling %s", request.TYPE)
            code, message = ErrorCode.INTERNAL, f"internal error ({type(e).__name__}: {e}); the service log has the traceback"
        quiet = code in (ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_RANK, ErrorCode.NOT_READY)  # ranks retry these
        log.log(logging.DEBUG if quiet else logging.INFO, "%s refused: [%s] %s", request.TYPE, code.value, clip(message, LOG_TEXT))
        return [identity, encode_error(request_id, code, message)]

    def _refuse_revoked(self, frames: list[zmq.Frame]) -> list[bytes]:
        """The reply to a client whose CURVE key was revoked after its handshake; its connection
        is closed just after the reply goes out."""
        log.warning("refused a request from client key %s: no longer in the accepted keys; closing its connection", peer_key(frames[-1]))
        drop_connection(frames[-1])
        try:
            request_id, _ = decode_request(frames[-1].bytes)
        except RequestRejected as e:
            request_id = e.request_id
        message = "this client's CURVE key is no longer accepted by the service (revoked); its connection is being closed"
        return [frames[0].bytes, encode_error(request_id, ErrorCode.UNAUTHORIZED, message)]

    # ---- requests ------------------------------------------------------------------------------

    def _job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise ServiceError(ErrorCode.UNKNOWN_JOB.value, f"no job {job_id} on this service; rank 0 registers the job (register_job) first")
        self._active[job_id] = self._clock()
        return self.jobs[job_id]

    def _register_job(self, msg: RegisterJob) -> JobRegistered:
        spec = msg.spec
        job = self.jobs.get(spec.job_id())
        if job is not None:
            self._active[job.job_id] = self._clock()
            job.rerun()
            log.info("job %s registered again (phase %s)", job.job_id, job.phase.value)
        else:
            cost = self._admit(spec)
            cached = self.state.load_cached_profile(spec.profile_key(), spec.signature())
            job = Job(spec, cached_profile=cached, build_schedule=False)
            self._add_job(job, cost)
            self._build_schedule(spec)
            log.info(
                "job %s registered: %s, %d stages x %d microbatches, dp %d, tp %d (world size %d, %s rank mapping), GPU %s%s",
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

    def _admit(self, spec: JobSpec) -> int:
        """The new job's estimated memory, once it fits the budget (evicting the least recently
        active idle jobs to make room); `over_budget` with what to change otherwise."""
        budget = self.budget
        for value, limit, what, flag in (
            (spec.world_size, budget.max_job_ranks, "ranks (world_size)", "--max-job-ranks"),
            (spec.dp, budget.max_job_pipelines, "data-parallel pipelines (dp)", "--max-job-pipelines"),
        ):
            if value > limit:
                raise ServiceError(ErrorCode.OVER_BUDGET.value, f"job has {value} {what}; this service admits at most {limit} per job (operator: {flag})")
        cost = job_cost_bytes(spec)
        if cost > budget.memory_bytes:
            raise ServiceError(ErrorCode.OVER_BUDGET.value, f"job needs about {cost >> 20} MiB of service memory; the budget is {budget.memory_bytes >> 20} MiB (operator: --memory-budget-mib)")
        now = self._clock()
        while len(self.jobs) >= budget.max_jobs or sum(self._costs.values()) + cost > budget.memory_bytes:
            idle = [(self._active.get(j, now), j) for j in self.jobs if j not in self._planning and j not in self._building]
            oldest = min(idle, default=None)
            if oldest is None or now - oldest[0] < budget.evict_idle_s:
                full = f"{len(self.jobs)} jobs (limit {budget.max_jobs})" if len(self.jobs) >= budget.max_jobs else f"{sum(self._costs.values()) >> 20} MiB of jobs (budget {budget.memory_bytes >> 20} MiB)"
                raise ServiceError(
                    ErrorCode.OVER_BUDGET.value,
                    f"the service holds {full} and none has been idle {budget.evict_idle_s:.0f} s; retry later or ask the operator "
                    "to raise --max-jobs / --memory-budget-mib",
                )
            self._evict(oldest[1], f"making room for a new job (idle {now - oldest[0]:.0f} s)")
        return cost

    def _add_job(self, job: Job, cost: int) -> None:
        self.jobs[job.job_id] = job
        self._costs[job.job_id] = cost
        self._active[job.job_id] = self._clock()

    def _evict_idle(self, now: float) -> None:
        ttl = self.budget.job_ttl_s
        for job_id in [j for j, t in self._active.items() if now - t >= ttl and j not in self._planning and j not in self._building]:
            self._evict(job_id, f"idle for {now - self._active[job_id]:.0f} s (time-to-live {ttl:.0f} s)")

    def _evict(self, job_id: str, why: str) -> None:
        """Forget a job and delete its state (its cached profiles stay: if it comes back, it
        registers again and skips profiling)."""
        self.jobs.pop(job_id, None)
        self._active.pop(job_id, None)
        self._costs.pop(job_id, None)
        self._unsaved.discard(job_id)
        with self._planners_lock:
            for key in [k for k in self._planners if k[0] == job_id]:
                del self._planners[key]
        try:
            self.state.remove_job(job_id)
        except OSError as e:
            log.warning("job %s evicted, but its state folder could not be removed: %s", job_id, e)
        log.info("job %s evicted: %s", job_id, why)

    def _register_rank(self, msg: RegisterRank) -> RankRegistered:
        job = self._job(msg.job_id)
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
        log.log(level, "job %s: rank %d registered (stage %d, dp %d, tp %d, %s); %d of %d",
                job.job_id, info.rank, info.stage, info.dp_index, info.tp_index, model, len(job.ranks), job.spec.world_size)
        if job.models(info.dp_index) != models or cached is not None:
            self._plan(job)  # the pipeline's GPU models changed, or a cached profile came in
        else:
            self._unsaved.add(job.job_id)
        return RankRegistered(job.phase.value)

    def _get_table(self, msg: GetTable) -> Message:
        return self._job(msg.job_id).table(msg.rank, msg.iteration, msg.plan_version)

    def _upload_profile(self, msg: UploadProfile) -> Ack:
        job = self._job(msg.job_id)
        if job.schedule is None:
            # Not acknowledged: a profile is only taken once it can be checked and saved, so a
            # crash while the schedule builds never loses one the rank believes delivered.
            job.rank(msg.rank)
            if job.error:
                raise ServiceError(ErrorCode.BAD_FIELD.value, f"job {job.job_id} failed ({job.error}); fix it and register the job again")
            raise ServiceError(ErrorCode.NOT_READY.value, f"job {job.job_id}'s schedule is still being built; the client retries")
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
                log.info("job %s: stage %d profiled on %s (%d of %d)", job.job_id, msg.stage, model, len(job.profiled_stages_of(model)), job.spec.pp)
            else:
                log.info("job %s: stage %d tensor-parallel share %d of %d in", job.job_id, msg.stage, len(job.profiling.uploads[(model, msg.stage)]), job.spec.tp)
            self._plan(job)
        return Ack(job.phase.value)

    def _report_iteration(self, msg: ReportIteration) -> Ack:
        job = self._job(msg.job_id)
        done = job.record(msg)
        if done is not None:
            measured, planned = done
            if planned and (job.measurements.planned.count <= LOG_FIRST or job.measurements.planned.count % self.log_every == 0):
                log.info("%s", job.describe(measured))
            else:
                log.debug("job %s iteration %d: %.4f s, %.1f J", job.job_id, measured.iteration, measured.time_s, measured.energy_j)
        if job.update_stragglers():
            self._plan(job)
        return Ack(job.phase.value)

    def _declare_straggler(self, msg: DeclareStraggler) -> Ack:
        job = self._job(msg.job_id)
        job.declare_straggler(msg.pipeline, msg.factor)
        if msg.factor is None:
            log.info("job %s: pipeline %d no longer declared a straggler", job.job_id, msg.pipeline)
        else:
            log.info("job %s: pipeline %d declared a straggler (%.3fx its planned time)", job.job_id, msg.pipeline, msg.factor)
        self._plan(job)
        return Ack(job.phase.value)

    def _status(self, msg: GetStatus) -> Status:
        jobs = [self._job(msg.job_id)] if msg.job_id is not None else [self.jobs[j] for j in sorted(self.jobs)]
        return Status(tuple(self._job_status(job) for job in jobs))

    def _job_status(self, job: Job) -> JobStatus:
        """The job's status, or, if a bug keeps it from being told, a minimal one saying so: one
        job never makes the status of all jobs fail."""
        try:
            return job.status()
        except Exception as e:
            log.exception("job %s: its status cannot be told", job.job_id)
            return JobStatus(
                job_id=job.job_id, phase="failed", world_size=job.spec.world_size, ranks_registered=len(job.ranks), profiled_stages=(),
                plan_version=0, last_iteration=-1, error=clip(f"status unavailable: internal error ({type(e).__name__}: {e})"),
            )

    # ---- fault isolation -----------------------------------------------------------------------

    def _guard(self, job: Job, what: str, action: Callable[[], None]) -> None:
        """Run one job's `action` on the loop thread: a write error degrades the job (the write is
        retried), any other exception fails that job alone, and the service keeps serving."""
        try:
            action()
        except OSError as e:
            reason = f"its state could not be saved while {what} ({e.strerror or e}); retrying"
            if job.warning != clip(reason):
                log.error("job %s: %s", job.job_id, reason)
            job.degrade(reason)
            self._unsaved.add(job.job_id)
        except Exception as e:
            log.exception("job %s: internal error while %s; the job is failed, its ranks run at maximum clocks", job.job_id, what)
            job.fail(f"internal error while {what} ({type(e).__name__}: {e}); the service log has the traceback")

    # ---- schedules -----------------------------------------------------------------------------

    def _build_schedule(self, spec: JobSpec) -> None:
        if self._builder is None:
            self._builder = threading.Thread(target=self._build_worker, name="build-schedules", daemon=True)
            self._builder.start()
        self._building.add(spec.job_id())
        self._to_build.put(spec)

    def _build_worker(self) -> None:
        while True:
            spec = self._to_build.get()
            start = time.perf_counter()
            try:
                result: Any = job_schedule(spec)
            except BaseException as e:  # reported to the loop thread, which fails the job
                result = e
            self._built.put((spec, result, time.perf_counter() - start))

    def _finish_builds(self) -> None:
        while True:
            try:
                spec, result, seconds = self._built.get_nowait()
            except queue.Empty:
                return
            self._building.discard(spec.job_id())
            job = self.jobs.get(spec.job_id())
            if job is None or job.spec != spec:
                continue  # evicted meanwhile
            self._guard(job, "building its schedule", lambda: self._take_schedule(job, result, seconds))

    def _take_schedule(self, job: Job, result: Any, seconds: float) -> None:
        if isinstance(result, BaseException):
            reason = str(result) if isinstance(result, PerseusError) else f"internal error ({type(result).__name__}: {result})"
            job.fail(f"invalid job: {reason}")
            log.error("job %s: %s; its ranks stay at maximum clocks", job.job_id, job.error)
        else:
            job.set_schedule(result)
            log.info("job %s: schedule built in %.2f s (%d instructions)", job.job_id, seconds, sum(len(r) for r in result.stages))
        self._plan(job)

    # ---- planning ------------------------------------------------------------------------------

    def _plan(self, job: Job) -> None:
        """Publish what is solved, start solving what is missing, save the job."""
        self._guard(job, "publishing its plans", lambda: self._publish(job))
        self._guard(job, "starting its planning", lambda: self._start_planning(job))
        self._guard(job, "saving its state", lambda: self._save(job))

    def _start_planning(self, job: Job) -> None:
        if job.job_id in self._planning or job.error:
            return
        tasks = []
        for key, profile in job.missing_plans():
            choices = plan_choices(job.schedule, profile)
            if choices > self.budget.max_plan_choices:
                job.add_result(key, f"the profile gives {choices} (instruction, frequency) choices, over the service's planning budget of "
                                    f"{self.budget.max_plan_choices}; profile fewer frequencies (JobSpec.sweep_frequencies) or ask the "
                                    "operator to raise --max-plan-choices")
                log.error("job %s: %s (%s)", job.job_id, job.error or "a deadline is over the planning budget", _describe_key(key))
            else:
                tasks.append((key, profile))
        if not tasks:
            return
        self._planning.add(job.job_id)
        log.info("job %s: planning %s", job.job_id, ", ".join(_describe_key(key) for key, _ in tasks))
        while self._planners_started < min(self.budget.planning_workers, len(self._planning)):
            self._planners_started += 1
            threading.Thread(target=self._plan_worker, name=f"planner-{self._planners_started}", daemon=True).start()
        self._to_plan.put((job.job_id, job.schedule, tasks))

    def _publish(self, job: Job) -> None:
        changed = job.publish()
        if not changed:
            return
        for k in changed:
            plan = job.plans[k]
            if k == changed[0] or len(changed) <= 8:
                saving = 1.0 - plan.energy_j / plan.baseline_energy_j
                log.info(
                    "job %s: pipeline %d plan v%d from iteration %d (%s): iteration %.4f s (max clocks %.4f s), "
                    "energy %.1f J (max clocks %.1f J, saving %.1f%%, lower bound %.1f J)",
                    job.job_id, k, plan.version, plan.start_iteration, _describe_key(plan.key), plan.iteration_time_s,
                    plan.baseline_iteration_time_s, plan.energy_j, plan.baseline_energy_j, 100 * saving, plan.lower_bound_j,
                )
        if len(changed) > 8:
            log.info("job %s: plan v%d published for %d pipelines", job.job_id, job.plan_book.last_version, len(changed))

    def _plan_worker(self) -> None:
        """One of `budget.planning_workers` threads: solves one job's missing plans at a time."""
        while True:
            job_id, schedule, tasks = self._to_plan.get()
            done: list[tuple[PlanKey, tuple[PlanResult, dict] | BaseException, float]] = []
            for key, profile in tasks:
                start = time.perf_counter()
                try:
                    planner = self._planner(job_id, key[0], schedule, profile)
                    result: tuple[PlanResult, dict] | BaseException = plan_pipeline(planner, key[1])
                except BaseException as e:  # reported to the loop thread, which records the failure
                    result = e
                done.append((key, result, time.perf_counter() - start))
            self._results.put((job_id, done))

    def _planner(self, job_id: str, models: tuple[str, ...], schedule: Any, profile: Any) -> Any:
        """The pipeline's planner: kept for later deadlines while the kept ones' problems add up
        to at most one planning budget of choices (a planner's memory grows with them)."""
        with self._planners_lock:
            kept = self._planners.get((job_id, models))
            if kept is not None:
                self._planners.move_to_end((job_id, models))
                return kept[0]
        planner = make_planner(schedule, profile)
        with self._planners_lock:
            self._planners[(job_id, models)] = (planner, plan_choices(schedule, profile))
            while len(self._planners) > 1 and (
                len(self._planners) > MAX_PLANNERS or sum(c for _, c in self._planners.values()) > self.budget.max_plan_choices
            ):
                self._planners.popitem(last=False)
        return planner

    def _finish_plans(self) -> None:
        while True:
            try:
                job_id, done = self._results.get_nowait()
            except queue.Empty:
                return
            self._planning.discard(job_id)
            job = self.jobs.get(job_id)
            if job is None:
                continue  # evicted meanwhile
            self._guard(job, "taking its solved plans", lambda: self._take_plans(job, done))
            self._plan(job)

    def _take_plans(self, job: Job, done: list[tuple[PlanKey, tuple[PlanResult, dict] | BaseException, float]]) -> None:
        job_id = job.job_id
        for key, result, seconds in done:
            if isinstance(result, BaseException):
                if isinstance(result, PerseusError):
                    message = f"planning failed: {result}"
                else:
                    log.error("job %s: planner crashed", job_id, exc_info=result)
                    message = f"planning failed with an internal error ({type(result).__name__}: {result})"
                job.add_result(key, message)
                log.error("job %s: %s (%s); %s", job_id, clip(message), _describe_key(key),
                          "its ranks stay at maximum clocks" if key[1] is None else "those pipelines keep their no-slowdown plans")
                continue
            result, document = result
            job.add_result(key, result)
            log.info("job %s: solved %s in %.2f s: %.4f s, %.1f J per pipeline", job_id, _describe_key(key), seconds, result.iteration_time_s, result.energy_j)
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
                self._guard(job, "saving its state", lambda: self._save(job))
        self._saved_at = time.monotonic()

    def _load_jobs(self) -> None:
        """Resume every job of the state directory; a record that cannot be resumed is moved to
        the quarantine folder (one log line) and the others load."""
        for folder, record in self.state.load_jobs():
            try:
                spec = JobSpec.from_wire(record["spec"])
                models = ([spec.gpu_model] if record.get("cached") else []) + list(record.get("cached_models", []))
                cached = {m: p for m in models if (p := self.state.load_cached_profile(spec.profile_key(m), spec.signature(m))) is not None}
                job = Job.from_record(record, self.state.load_stage_profiles(folder), cached)
                if job.job_id != folder.name:
                    raise ValueError(f"the folder of job {folder.name} holds the record of {job.job_id}")
                cost = job_cost_bytes(spec)
            except Exception as e:  # whatever a damaged file holds, the other jobs resume
                self.state.quarantine(folder, f"{type(e).__name__}: {e}")
                continue
            self._add_job(job, cost)
            log.info("resumed job %s (phase %s, plan v%d)", job.job_id, job.phase.value, job.plan_book.last_version)
            self._plan(job)


def _raise_file_limit() -> None:
    """Raise the soft limit on open files towards FILE_LIMIT (as far as the hard limit allows):
    with the usual 1,024, a thousand idle connections would leave no descriptor for new peers
    or for the state files."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FILE_LIMIT if hard == resource.RLIM_INFINITY else min(FILE_LIMIT, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d (%s)", soft, wanted, e)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning("the open-file limit is %d: each connected rank holds one; raise it (ulimit -n) for large jobs", soft)


def _describe_key(key: PlanKey) -> str:
    models, deadline = key
    names = sorted(set(models))
    where = names[0] if len(names) == 1 else "/".join(models)
    return f"{where}, " + ("no slowdown" if deadline is None else f"deadline {deadline:.4f} s")
