"""The rank side of the planner protocol: `PlannerClient`.

One background thread owns the DEALER socket (see connection.py); the training thread only reads
an immutable table snapshot and puts messages on a queue. So `assignment()` is a few attribute
reads, and no call blocks training longer than `timeout_s`. When the service is unreachable the
client logs one warning, keeps what it has (max clocks before the first plan, the current plan
after), and reconnects on a fresh socket when the service is back. Registrations and profile
uploads are retried until the service answers; iteration reports are sent while connected and
dropped past a bounded queue.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from perseus.client.assignments import UNPLANNED, Assignment, RankState
from perseus.client.connection import Connection, Handoff, Outgoing, Waiter
from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile
from perseus.wire.envelope import ErrorCode, encode_request
from perseus.wire.fields import Message
from perseus.wire.limits import DEFAULT_ADDRESS, MAX_MESSAGE_BYTES
from perseus.wire.messages import (
    Ack,
    DeclareStraggler,
    GetStatus,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    Status,
    UploadProfile,
)
from perseus.wire.security import Security, security_from_env
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import JobSpec, RankInfo

# Assignment and UNPLANNED are what assignment() returns: importable from here, where they always were.
__all__ = ["UNPLANNED", "Assignment", "PlannerClient"]

log = logging.getLogger(__name__)


class PlannerClient:
    """Talks to `perseus serve` for one rank. See the module docstring for its guarantees."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout_s: float = 1.0,
        *,
        poll_interval_s: float = 0.25,
        security: Security | None = None,
    ) -> None:
        """`security`: e.g. `CurveClient.from_dir(DIR, name)` for a service started with
        --curve-keys DIR; default: from PERSEUS_CURVE_KEYS if set, else plaintext."""
        if not isinstance(address, str) or address.partition("://")[0] not in ("tcp", "ipc", "inproc"):
            raise ConfigError(f"planner address must be a ZeroMQ endpoint like {DEFAULT_ADDRESS}, got {address!r}")
        for name, value in (("timeout_s", timeout_s), ("poll_interval_s", poll_interval_s)):
            if not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ConfigError(f"{name} must be a number of seconds in (0, 3600], got {value!r}")
        self.address = address
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self._security = security if security is not None else security_from_env()
        self._rank = RankState()  # shared with the connection thread
        self._handoff = Handoff()
        self._thread = threading.Thread(target=self._run, name="perseus-planner-client", daemon=True)
        self._thread.start()

    def register_job(self, spec: JobSpec) -> str:
        """Register the job (rank 0; repeating it with the same spec is harmless) and return its id.
        Waits at most `timeout_s` for the service; if it does not answer, the registration is
        retried in the background. Raises ServiceError (code bad_field) if the service rejects the spec."""
        if not isinstance(spec, JobSpec):
            raise ConfigError(f"register_job takes a JobSpec, got {type(spec).__name__}")
        self._rank.spec = spec
        self._raise_if_refused(self._call(RegisterJob(spec), reliable=True))
        return spec.job_id()

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        """Register this client's rank (one rank per client). Waits at most `timeout_s`; raises
        ServiceError (bad_field) if the service rejects it. Until the job is known (rank 0 may
        register it later) the client retries in the background."""
        message = RegisterRank(job_id, info)
        rank = self._rank
        if rank.info is not None and (rank.info.rank != info.rank or rank.job_id != job_id):
            raise ConfigError(
                f"this PlannerClient serves rank {rank.info.rank} of {rank.job_id}; create one client per rank"
            )
        rank.job_id, rank.info, rank.uploaded_round = job_id, info, None
        self._raise_if_refused(self._call(message, reliable=True))

    def assignment(self, iteration: int) -> Assignment:
        """What to run at `iteration` (0-based, counted by the caller). Never blocks."""
        return self._rank.assignment(iteration)

    def upload_profile(self, job_id: str, stage: int, profile: Profile) -> None:
        """Offer this rank's stage profile; the rank runs at max clocks from now until the plan
        arrives. It is sent (and retried until the service takes it) once the service's table
        names this rank its stage's uploader (Table.upload), and dropped if the stage gets
        profiled by another data-parallel replica first. Raises ConfigError/ProfileError for a
        malformed profile."""
        info = self._rank.info
        if info is None or job_id != self._rank.job_id:
            raise ConfigError("call register_rank(job_id, info) with this job before upload_profile")
        message = UploadProfile(job_id, info.rank, stage, profile)
        size = len(encode_request(0, message))
        if size > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"stage {stage}'s profile is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit; profile "
                "fewer frequencies"
            )
        self._rank.offered()
        self._handoff.send(Outgoing(message, reliable=True))

    def report_iteration(
        self,
        job_id: str,
        rank: int,
        iteration: int,
        time_s: float,
        energy_j: float,
        compute_time_s: float | None = None,
        off_clock: int | None = None,
        closing: bool = False,
    ) -> None:
        """Queue one iteration's measured time and energy of this rank's GPU (`compute_time_s`:
        the time without waiting on other data-parallel pipelines, if known; it lets the service
        see stragglers; `closing`: the last, see ReportIteration). Never raises: a report with bad
        values is logged (once) and dropped."""
        try:
            message = ReportIteration(job_id, rank, iteration, time_s, energy_j, compute_time_s, off_clock, closing)
        except ConfigError as e:
            if self._rank.first_time("report"):
                log.warning("dropping an iteration report the service would refuse: %s", e)
            return
        self._handoff.send(Outgoing(message, reliable=False))

    def report_spans(self, spans: ReportSpans) -> None:
        """Queue one iteration's instruction spans (the service asked for them: `Assignment.spans`).
        Never raises: a report the service would refuse is logged (once) and dropped."""
        self._handoff.send(Outgoing(spans, reliable=False))

    def declare_straggler(self, job_id: str, pipeline: int, factor: float | None) -> bool:
        """Tell the service that pipeline (data-parallel index) `pipeline` runs `factor` x its
        planned iteration time (1.2: 20% slower), so the other pipelines are re-planned to that
        pace; `factor` None clears it. True once the service took it, False if it did not answer
        within `timeout_s`. ServiceError if it refused (unknown job, no such pipeline)."""
        result = self._call(DeclareStraggler(job_id, pipeline, factor), reliable=False)
        if isinstance(result, ServiceError):
            raise result
        return isinstance(result, Ack)

    def status(self, job_id: str | None = None) -> Status | None:
        """The service's view of one job (or all): phases, predicted and measured figures.
        None if the service does not answer within `timeout_s`."""
        result = self._call(GetStatus(job_id), reliable=False)
        if isinstance(result, ServiceError):
            raise result
        return result if isinstance(result, Status) else None

    def wait_for_plan(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until a plan has arrived; True if one has."""
        return self._rank.plan_arrived.wait(timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (up to `timeout_s`, default the client's timeout) until queued uploads, registrations
        and reports have been answered; True if nothing is left."""
        return self._handoff.idle.wait(self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Send what is queued (for at most `timeout_s`), then stop the background thread."""
        if self._handoff.closing.is_set():
            return
        self._handoff.closing.set()
        self._handoff.wake()
        self._thread.join(self.timeout_s + 1.0)
        self._handoff.close()

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, message: Message, *, reliable: bool) -> Message | ServiceError | None:
        waiter = Waiter()
        self._handoff.send(Outgoing(message, reliable, waiter))
        waiter.event.wait(self.timeout_s)
        return waiter.result

    def _raise_if_refused(self, result: Message | ServiceError | None) -> None:
        if isinstance(result, ServiceError) and result.code == ErrorCode.BAD_FIELD.value:
            raise result

    def _run(self) -> None:
        context = zmq.Context()
        try:
            Connection(
                self._rank,
                self._handoff,
                context,
                address=self.address,
                security=self._security,
                timeout_s=self.timeout_s,
                poll_interval_s=self.poll_interval_s,
            ).run()
        except Exception:  # the thread's boundary: the traceback is logged, training goes on with what the rank has
            log.exception("planner client thread stopped; this rank keeps its current clocks and plan")
        finally:
            context.destroy(linger=0)
