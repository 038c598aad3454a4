"""The planner service: registers jobs and ranks, hands out frequency tables, collects stage
profiles, has plans solved off the loop, and logs predicted against measured.

The parts: the ROUTER socket and its loop (transport.py), the jobs held within the budget
(admission.py), the threads that build schedules and solve plans (workers.py) and the loop's
side of them (results.py), the answer to each request (handlers.py), the jobs on disk
(keeper.py), and each job's own state (job.py). This module puts them together and runs the loop.

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
from perseus.exceptions import ConfigError, ProfileError, ScheduleError, ServiceError
from perseus.metrics.service import OK, ServiceMetrics
from perseus.service.admission import Admission
from perseus.service.budget import Budget
from perseus.service.handlers import Handlers
from perseus.service.job import Job
from perseus.service.keeper import Keeper
from perseus.service.results import Results
from perseus.service.state import StateDir, default_state_dir
from perseus.service.text import clip
from perseus.service.transport import Transport
from perseus.service.workers import Workers
from perseus.wire.envelope import ErrorCode, RequestRejected, decode_request, encode_error, encode_reply
from perseus.wire.fields import Message
from perseus.wire.limits import DEFAULT_ADDRESS, PROTOCOL_VERSION
from perseus.wire.messages import (
    QUIET_S,
    DeclareStraggler,
    GetStatus,
    GetTable,
    Ping,
    Pong,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    UploadProfile,
)
from perseus.wire.security import PLAINTEXT, Security
from perseus.wire.spans import ReportSpans

log = logging.getLogger(__name__)

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
        self.workers = Workers(self.budget)
        self.admission = Admission(self.budget, clock, busy=self.workers.busy_with, evict=self._evict)
        self.jobs: dict[str, Job] = self.admission.jobs
        self.keeper = Keeper(StateDir(state_dir if state_dir is not None else default_state_dir()), self.jobs)
        self.results = Results(self.budget, self.workers, self.keeper, self.jobs)
        self.handlers = Handlers(self.admission, self.workers, self.keeper, self.results, log_every)
        self._evicted_at = clock()
        self.metrics = ServiceMetrics()  # counted on this loop; published when /metrics is scraped
        self._stop = threading.Event()
        self._transport = Transport(address, security, insecure=insecure)
        self._routes: dict[type[Message], Callable[[Any], Message]] = {
            RegisterJob: self.handlers.register_job,
            RegisterRank: self.handlers.register_rank,
            GetTable: self.handlers.get_table,
            UploadProfile: self.handlers.upload_profile,
            ReportIteration: self.handlers.report_iteration,
            ReportSpans: self.handlers.report_spans,
            DeclareStraggler: self.handlers.declare_straggler,
            GetStatus: self.handlers.status,
            Ping: lambda msg: Pong(PROTOCOL_VERSION, f"perseus {__version__}"),
        }
        self._load_jobs()

    @property
    def state(self) -> StateDir:
        """The state directory (the keeper's)."""
        return self.keeper.state

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
        self.keeper.save_all()
        log.info("planner service stopped")

    def tend(self) -> None:
        """The loop's work between requests: take built schedules and solved plans, save what is
        unsaved, evict jobs idle past their time-to-live."""
        start = time.perf_counter()
        self.results.take_builds()
        self.results.take_calibrations()
        self.results.take_plans()
        if self.keeper.save_due():
            self.keeper.save_unsaved()
        now = self._clock()
        if now - self._evicted_at >= EVICT_CHECK_S:
            self._evicted_at = now
            self.admission.evict_idle(now)
            self._warn_quiet()
        self.metrics.tended(self, start)

    def _warn_quiet(self) -> None:
        """Log a job whose ranks went quiet before every one closed, once until it reports again: a
        rank killed (by torchrun after another failed, by the OOM killer) says nothing itself."""
        for job_id in self.admission.quiet(QUIET_S):
            status = self.handlers.job_status(self.jobs[job_id])
            if not status.went_quiet:
                continue
            self.admission.told_quiet(job_id)
            log.warning(
                "job %s: no iteration reported for %.0f s (the last: %d) and %d of %d ranks never closed: the job "
                "stalls, or those ranks ended without close() (killed; each rank's watchdog resets its GPU's clocks)",
                job_id,
                status.quiet_s,
                status.last_iteration,
                status.world_size - status.ranks_closed,
                status.world_size,
            )

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
        start = time.perf_counter()
        identity, payload = frames[0], frames[1:]
        if len(payload) != 1:
            message = (
                f"expected exactly one frame per message, got {len(payload)}; "
                "send one msgpack map per message (a DEALER socket, no empty delimiter)"
            )
            self.metrics.handled(self, None, ErrorCode.BAD_FRAME.value, start)
            return [identity, encode_error(None, ErrorCode.BAD_FRAME, message)]
        try:
            request_id, request = decode_request(payload[0])
        except RequestRejected as e:
            log.info("rejected a request: %s", clip(str(e), LOG_TEXT))
            self.metrics.handled(self, None, ErrorCode(e.code).value, start)
            return [identity, encode_error(e.request_id, ErrorCode(e.code), e.message)]
        try:
            reply = [identity, encode_reply(request_id, self._routes[type(request)](request))]
            self.metrics.handled(self, request, OK, start)
            return reply
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
        self.metrics.handled(self, request, code.value, start)
        return [identity, encode_error(request_id, code, message)]

    # ---- jobs ----------------------------------------------------------------------------------

    def _load_jobs(self) -> None:
        """Resume every job of the state directory (see Keeper.load_jobs)."""
        for job, cost in self.keeper.load_jobs():
            self.admission.add(job, cost)
            log.info("resumed job %s (phase %s, plan v%d)", job.job_id, job.phase.value, job.plan_book.last_version)
            self.results.plan(job)

    def _evict(self, job_id: str, why: str) -> None:
        """Forget a job and delete its state (its cached profiles stay: if it comes back, it
        registers again and skips profiling)."""
        self.admission.remove(job_id)
        self.workers.forget(job_id)
        self.keeper.forget(job_id)
        log.info("job %s evicted: %s", job_id, why)
