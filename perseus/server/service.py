"""The planner service: a ZeroMQ ROUTER that registers jobs and ranks, hands out frequency
tables, collects stage profiles, plans on a worker thread, and logs predicted against measured.

Every request gets exactly one reply; a request that cannot be read or acted on gets an error
reply (protocol.ErrorCode plus a message saying what to fix), and the service keeps serving.
Job state is written to the state directory on every change, so a restarted service resumes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from perseus import __version__
from perseus.exceptions import ConfigError, PerseusError, ProfileError, ScheduleError, ServiceError
from perseus.server.job import Job
from perseus.server.planning import PlanResult, plan_job
from perseus.server.protocol import (
    DEFAULT_ADDRESS,
    HARD_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    ErrorCode,
    GetStatus,
    GetTable,
    JobPhase,
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
LOG_FIRST = 3  # log this many planned iterations of each plan, then every `log_every`-th


class PlannerService:
    """Serve on `address` (tcp://host:0 picks a free port; see `endpoint` after `bind()`)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        state_dir: str | None = None,
        *,
        security: Security = PLAINTEXT,
        log_every: int = 10,
    ) -> None:
        self.address = address
        self.security = security
        self.log_every = max(1, log_every)
        self.state = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.jobs: dict[str, Job] = {}
        self.endpoint: str | None = None
        self._planning: set[str] = set()
        self._results: queue.SimpleQueue[tuple[str, tuple[PlanResult, dict] | BaseException, float]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._handlers: dict[type[Message], Callable[[Any], Message]] = {
            RegisterJob: self._register_job,
            RegisterRank: self._register_rank,
            GetTable: self._get_table,
            UploadProfile: self._upload_profile,
            ReportIteration: self._report_iteration,
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
            raise ConfigError(f"cannot bind {self.address}: {e}; is another perseus serve running there? pick another --bind address") from None
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if not is_local_endpoint(self.endpoint) and not self.security.authenticated:
            log.warning(
                "\n%s\nWARNING: the planner service listens on %s, reachable from other machines, WITHOUT authentication.\n"
                "Anyone who can reach this port can register jobs and change the GPU clocks of your ranks.\n"
                "Bind a loopback address (the default, tcp://127.0.0.1:7787) unless this network is trusted.\n%s",
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
            self._finish_plans()
        log.info("planner service stopped")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
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
            job = Job(spec, cached_profile=cached)
            self.jobs[job.job_id] = job
            log.info(
                "job %s registered: %s, %d stages x %d microbatches, world size %d, GPU %s%s",
                job.job_id,
                spec.schedule_name,
                spec.pp,
                spec.num_microbatches,
                spec.world_size,
                spec.gpu_model,
                "; profile cached, skipping profiling" if cached is not None else "",
            )
        self._save(job)
        if job.phase == JobPhase.PLANNING:
            self._start_planning(job)
        return JobRegistered(job.job_id, job.phase.value, job.cached_profile is not None)

    def _register_rank(self, msg: RegisterRank) -> RankRegistered:
        job = self._job(msg.job_id)
        job.add_rank(msg.info)
        self._save(job)
        log.info("job %s: rank %d registered (stage %d, dp %d, tp %d)", job.job_id, msg.info.rank, msg.info.stage, msg.info.dp_index, msg.info.tp_index)
        return RankRegistered(job.phase.value)

    def _get_table(self, msg: GetTable) -> Message:
        return self._job(msg.job_id).table(msg.rank, msg.iteration, msg.plan_version)

    def _upload_profile(self, msg: UploadProfile) -> Ack:
        job = self._job(msg.job_id)
        if job.add_profile(msg.rank, msg.stage, msg.profile):
            self.state.save_stage_profile(job.job_id, msg.stage, msg.profile)
            self._save(job)
            log.info("job %s: stage %d profiled (%d of %d)", job.job_id, msg.stage, len(job.profiles), job.spec.pp)
            if job.phase == JobPhase.PLANNING:
                self._start_planning(job)
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
        return Ack(job.phase.value)

    def _status(self, msg: GetStatus) -> Status:
        jobs = [self._job(msg.job_id)] if msg.job_id is not None else [self.jobs[j] for j in sorted(self.jobs)]
        return Status(tuple(job.status() for job in jobs))

    # ---- planning ------------------------------------------------------------------------------

    def _start_planning(self, job: Job) -> None:
        if job.job_id in self._planning:
            return
        self._planning.add(job.job_id)
        log.info("job %s: every stage profiled; planning", job.job_id)
        worker = threading.Thread(
            target=self._plan_worker, args=(job.job_id, job.schedule, job.merged_profile()), name=f"plan-{job.job_id}", daemon=True
        )
        worker.start()

    def _plan_worker(self, job_id: str, schedule: Any, profile: Any) -> None:
        start = time.perf_counter()
        try:
            result: tuple[PlanResult, dict] | BaseException = plan_job(schedule, profile)
        except BaseException as e:  # reported to the loop thread, which records the failure
            result = e
        self._results.put((job_id, result, time.perf_counter() - start))

    def _finish_plans(self) -> None:
        while True:
            try:
                job_id, result, seconds = self._results.get_nowait()
            except queue.Empty:
                return
            self._planning.discard(job_id)
            job = self.jobs[job_id]
            if isinstance(result, BaseException):
                if isinstance(result, PerseusError):
                    job.fail(f"planning failed: {result}")
                else:
                    log.error("job %s: planner crashed", job_id, exc_info=result)
                    job.fail(f"planning failed with an internal error ({type(result).__name__}: {result})")
                log.error("job %s: %s; its ranks stay at maximum clocks", job_id, job.error)
            else:
                result, document = result
                profile = job.merged_profile()
                plan = job.publish(result)
                self.state.save_plan_document(job_id, document)
                if job.cached_profile is None:
                    self.state.save_cached_profile(job.spec.profile_key(), job.spec.signature(), profile)
                saving = 1.0 - result.energy_j / result.baseline_energy_j
                log.info(
                    "job %s: plan v%d in %.2f s from iteration %d: iteration %.4f s (max clocks %.4f s), "
                    "energy %.1f J per pipeline (max clocks %.1f J, saving %.1f%%, lower bound %.1f J)",
                    job_id,
                    plan.version,
                    seconds,
                    plan.start_iteration,
                    result.iteration_time_s,
                    result.baseline_iteration_time_s,
                    result.energy_j,
                    result.baseline_energy_j,
                    100 * saving,
                    result.lower_bound_j,
                )
            self._save(job)

    # ---- state ---------------------------------------------------------------------------------

    def _save(self, job: Job) -> None:
        self.state.save_job(job.to_record())

    def _load_jobs(self) -> None:
        for record in self.state.load_jobs():
            try:
                spec = JobSpec.from_wire(record["spec"])
                cached = self.state.load_cached_profile(spec.profile_key(), spec.signature()) if record.get("cached") else None
                job = Job.from_record(record, self.state.load_stage_profiles(record["job_id"]), cached)
            except (PerseusError, KeyError, TypeError, ValueError) as e:
                log.warning("cannot resume job %s from %s: %s", record.get("job_id"), self.state.root, e)
                continue
            self.jobs[job.job_id] = job
            log.info("resumed job %s (phase %s, plan v%d)", job.job_id, job.phase.value, job.plan.version if job.plan else 0)
            if job.phase == JobPhase.PLANNING:
                self._start_planning(job)
