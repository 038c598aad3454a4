"""The planner service: a ZeroMQ ROUTER that registers jobs and ranks, hands out frequency
tables, collects stage profiles, plans on a worker thread, and logs predicted against measured.

The socket loop must answer every rank within its timeout, so nothing slow runs on it: a new
job's schedule is built and validated on a worker thread (register_job replies at once with
the job id; an invalid schedule then fails the job, which its status and every rank's table
report), plans are solved on worker threads, and rank registrations are saved in batches.

Every request gets exactly one reply; a request that cannot be read or acted on gets an error
reply (protocol.ErrorCode plus a message saying what to fix), and the service keeps serving.
Job state is written to the state directory on every change, so a restarted service resumes.
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
from perseus.server.job import Job, PlanKey, document_name
from perseus.server.planning import PlanResult, job_schedule, make_planner, plan_pipeline
from perseus.server.protocol import (
    DEFAULT_ADDRESS,
    HARD_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    DeclareStraggler,
    ErrorCode,
    GetStatus,
    GetTable,
    JobRegistered,
    JobSpec,
    Message,
    Ping,
    Pong,
    RankRegistered,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    RequestRejected,
    Status,
    UploadProfile,
    decode_request,
    encode_error,
    encode_reply,
)
from perseus.server.security import PLAINTEXT, Security, is_local_endpoint
from perseus.server.state import StateDir, default_state_dir

log = logging.getLogger(__name__)

POLL_MS = 50  # how often the loop checks for a stop request and finished plans
MAX_PLANNERS = 16  # planners kept for re-planning (least recently used dropped): each holds its LP
SAVE_INTERVAL_S = 0.5  # rank registrations are saved this often (ranks re-register after a crash)
LOG_FIRST = 3  # log this many planned iterations of each plan, then every `log_every`-th
GIL_SWITCH_S = 0.001  # see serve_forever


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
    ) -> None:
        self.address = address
        self.security = security
        self.insecure = insecure
        self.log_every = max(1, log_every)
        self.state = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.jobs: dict[str, Job] = {}
        self.endpoint: str | None = None
        self._planning: set[str] = set()
        # (job, stage models) -> Planner, reused for later deadlines; used by worker threads only.
        self._planners: OrderedDict[tuple[str, tuple[str, ...]], Any] = OrderedDict()
        self._planners_lock = threading.Lock()
        self._cache_saved: set[tuple[str, str]] = set()
        self._unsaved: set[str] = set()  # jobs with rank registrations not yet written
        self._saved_at = 0.0
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
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        sock.send_multipart(self.handle(frames), zmq.NOBLOCK)
                    except zmq.Again:
                        log.warning("reply to a peer dropped: its queue is full")
            self._finish_builds()
            self._finish_plans()
            if self._unsaved and time.monotonic() - self._saved_at >= SAVE_INTERVAL_S:
                self._save_unsaved()

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
            log.info("rejected a request: %s", e)
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
        quiet = code in (ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_RANK)  # ranks retry these until rank 0 registers
        log.log(logging.DEBUG if quiet else logging.INFO, "%s refused: [%s] %s", request.TYPE, code.value, message)
        return [identity, encode_error(request_id, code, message)]

    # ---- requests ------------------------------------------------------------------------------

    def _job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise ServiceError(ErrorCode.UNKNOWN_JOB.value, f"no job {job_id} on this service; rank 0 registers the job (register_job) first")
        return self.jobs[job_id]

    def _register_job(self, msg: RegisterJob) -> JobRegistered:
        spec = msg.spec
        job = self.jobs.get(spec.job_id())
        if job is not None:
            job.rerun()
            log.info("job %s registered again (phase %s)", job.job_id, job.phase.value)
        else:
            cached = self.state.load_cached_profile(spec.profile_key(), spec.signature())
            job = Job(spec, cached_profile=cached, build_schedule=False)
            self.jobs[job.job_id] = job
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
        if job.schedule is None and not job.error:
            # Not acknowledged: a profile is only taken once it can be checked and saved, so a
            # crash while the schedule builds never loses one the rank believes delivered.
            job.rank(msg.rank)
            raise ServiceError(ErrorCode.NOT_READY.value, f"job {job.job_id}'s schedule is still being built; the client retries")
        name = job.add_profile(msg.rank, msg.stage, msg.profile)
        if name is not None:
            self.state.save_stage_profile(job.job_id, name, msg.profile)
            model = job.ranks[msg.rank].gpu_model
            if msg.stage in job.profiled_stages_of(model):
                log.info("job %s: stage %d profiled on %s (%d of %d)", job.job_id, msg.stage, model, len(job.profiled_stages_of(model)), job.spec.pp)
            else:
                log.info("job %s: stage %d tensor-parallel share %d of %d in", job.job_id, msg.stage, len(job.uploads[(model, msg.stage)]), job.spec.tp)
            self._plan(job)
        return Ack(job.phase.value)

    def _report_iteration(self, msg: ReportIteration) -> Ack:
        job = self._job(msg.job_id)
        done = job.record(msg)
        if done is not None:
            measured, planned = done
            if planned and (job.planned.count <= LOG_FIRST or job.planned.count % self.log_every == 0):
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
        return Status(tuple(job.status() for job in jobs))

    # ---- schedules -----------------------------------------------------------------------------

    def _build_schedule(self, spec: JobSpec) -> None:
        if self._builder is None:
            self._builder = threading.Thread(target=self._build_worker, name="build-schedules", daemon=True)
            self._builder.start()
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
            job = self.jobs[spec.job_id()]
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
        self._publish(job)
        if job.job_id not in self._planning and not job.error:
            missing = job.missing_plans()
            if missing:
                self._planning.add(job.job_id)
                log.info("job %s: planning %s", job.job_id, ", ".join(_describe_key(key) for key, _ in missing))
                worker = threading.Thread(target=self._plan_worker, args=(job.job_id, job.schedule, missing), name=f"plan-{job.job_id}", daemon=True)
                worker.start()
        self._save(job)

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
            log.info("job %s: plan v%d published for %d pipelines", job.job_id, job.last_version, len(changed))

    def _plan_worker(self, job_id: str, schedule: Any, tasks: list[tuple[PlanKey, Any]]) -> None:
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
        with self._planners_lock:
            planner = self._planners.get((job_id, models))
            if planner is not None:
                self._planners.move_to_end((job_id, models))
                return planner
        planner = make_planner(schedule, profile)
        with self._planners_lock:
            self._planners[(job_id, models)] = planner
            while len(self._planners) > MAX_PLANNERS:
                self._planners.popitem(last=False)
        return planner

    def _finish_plans(self) -> None:
        while True:
            try:
                job_id, done = self._results.get_nowait()
            except queue.Empty:
                return
            self._planning.discard(job_id)
            job = self.jobs[job_id]
            for key, result, seconds in done:
                if isinstance(result, BaseException):
                    if isinstance(result, PerseusError):
                        message = f"planning failed: {result}"
                    else:
                        log.error("job %s: planner crashed", job_id, exc_info=result)
                        message = f"planning failed with an internal error ({type(result).__name__}: {result})"
                    job.add_result(key, message)
                    log.error("job %s: %s (%s); %s", job_id, message, _describe_key(key),
                              "its ranks stay at maximum clocks" if key[1] is None else "those pipelines keep their no-slowdown plans")
                    continue
                result, document = result
                job.add_result(key, result)
                self.state.save_plan_document(job_id, document, document_name(job.spec, key))
                log.info("job %s: solved %s in %.2f s: %.4f s, %.1f J per pipeline", job_id, _describe_key(key), seconds, result.iteration_time_s, result.energy_j)
            for model in list(job.profiles):
                profile = job.model_profile(model)
                if profile is not None and model not in job.cached and (job_id, model) not in self._cache_saved:
                    self.state.save_cached_profile(job.spec.profile_key(model), job.spec.signature(model), profile)
                    self._cache_saved.add((job_id, model))
            self._plan(job)

    # ---- state ---------------------------------------------------------------------------------

    def _save(self, job: Job) -> None:
        self.state.save_job(job.to_record())
        self._unsaved.discard(job.job_id)

    def _save_unsaved(self) -> None:
        for job_id in sorted(self._unsaved):
            self._save(self.jobs[job_id])
        self._saved_at = time.monotonic()

    def _load_jobs(self) -> None:
        for record in self.state.load_jobs():
            try:
                spec = JobSpec.from_wire(record["spec"])
                models = ([spec.gpu_model] if record.get("cached") else []) + list(record.get("cached_models", []))
                cached = {m: p for m in models if (p := self.state.load_cached_profile(spec.profile_key(m), spec.signature(m))) is not None}
                job = Job.from_record(record, self.state.load_stage_profiles(record["job_id"]), cached)
            except (PerseusError, KeyError, TypeError, ValueError) as e:
                log.warning("cannot resume job %s from %s: %s", record.get("job_id"), self.state.root, e)
                continue
            self.jobs[job.job_id] = job
            log.info("resumed job %s (phase %s, plan v%d)", job.job_id, job.phase.value, job.last_version)
            self._plan(job)


def _describe_key(key: PlanKey) -> str:
    models, deadline = key
    names = sorted(set(models))
    where = names[0] if len(names) == 1 else "/".join(models)
    return f"{where}, " + ("no slowdown" if deadline is None else f"deadline {deadline:.4f} s")
