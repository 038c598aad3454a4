"""The rank side of the planner protocol: `PlannerClient`.

One background thread owns the DEALER socket (zmq sockets are not thread-safe); the training
thread only reads an immutable table snapshot and puts messages on a queue. So `assignment()`
is a few attribute reads, and no call blocks training longer than `timeout_s`. When the
service is unreachable the client logs one warning, keeps what it has (max clocks before the
first plan, the current plan after), and reconnects on a fresh socket when the service is back.
Registrations and profile uploads are retried until the service answers; iteration reports are
sent while connected and dropped past a bounded queue.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile
from perseus.wire.envelope import ErrorCode, decode_reply, encode_request
from perseus.wire.fields import Message
from perseus.wire.limits import DEFAULT_ADDRESS, HARD_MESSAGE_BYTES, MAX_MESSAGE_BYTES
from perseus.wire.messages import (
    REQUESTS,
    Ack,
    DeclareStraggler,
    GetStatus,
    GetTable,
    RegisterJob,
    RegisterRank,
    ReportIteration,
    Status,
    Table,
    UploadProfile,
)
from perseus.wire.phases import JobPhase, Phase
from perseus.wire.security import Security, security_from_env
from perseus.wire.spec import JobSpec, RankInfo

log = logging.getLogger(__name__)

MAX_QUEUED_REPORTS = 4096
_RETRY_CODES = (ErrorCode.UNKNOWN_JOB.value, ErrorCode.UNKNOWN_RANK.value, ErrorCode.NOT_READY.value)
_RANK_REQUESTS = (RegisterRank, GetTable, UploadProfile, ReportIteration)  # retried on _RETRY_CODES


@dataclass(frozen=True)
class Assignment:
    """What a rank runs in one iteration.

    `frequencies`: one MHz value per instruction of the rank, in schedule order (phase planned),
    or None: leave clocks at maximum/default. `profiling_frequency`: the sweep's frequency for
    every instruction (phase profiling), else None. Shared between calls: do not mutate.
    """

    phase: Phase
    frequencies: list[int] | None
    profiling_frequency: int | None
    plan_version: int


UNPLANNED = Assignment(Phase.UNPLANNED, None, None, 0)


@dataclass(frozen=True)
class _View:
    """A rank's table, as prebuilt Assignments: `assignment()` only picks one."""

    warmup_iterations: int
    iterations_per_frequency: int
    sweep: tuple[Assignment, ...]
    stage_profiled: bool
    plan: Assignment | None
    plan_start: int
    previous: Assignment | None  # the plan held before `plan`, run until `plan_start`
    warmup: Assignment
    waiting: Assignment  # after the sweep until a plan starts; UNPLANNED if planning failed
    upload: bool  # this rank uploads its stage profile (Table.upload)


class _Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Message | ServiceError | None = None

    def set(self, result: Message | ServiceError | None) -> None:
        self.result = result
        self.event.set()


@dataclass
class _Out:
    message: Message
    reliable: bool  # resent after a timeout until answered
    waiter: _Waiter | None = None
    sent_at: float = 0.0


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
        # Shared with the training thread: written by one side, read by the other (atomic refs).
        self._view: _View | None = None
        self._iteration = -1
        self._uploaded = False
        self._spec: JobSpec | None = None
        self._job_id: str | None = None
        self._info: RankInfo | None = None
        self._commands: queue.SimpleQueue[_Out] = queue.SimpleQueue()
        self._plan_arrived = threading.Event()
        self._idle = threading.Event()  # nothing queued or unanswered (see flush)
        self._idle.set()
        self._idle_lock = threading.Lock()
        self._closing = threading.Event()
        self._warned_once: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="perseus-planner-client", daemon=True)
        self._thread.start()

    # ---- training-thread API -------------------------------------------------------------------

    def register_job(self, spec: JobSpec) -> str:
        """Register the job (rank 0; repeating it with the same spec is harmless) and return its id.
        Waits at most `timeout_s` for the service; if it does not answer, the registration is
        retried in the background. Raises ServiceError (code bad_field) if the service rejects the spec."""
        if not isinstance(spec, JobSpec):
            raise ConfigError(f"register_job takes a JobSpec, got {type(spec).__name__}")
        self._spec = spec
        self._raise_if_refused(self._call(RegisterJob(spec), reliable=True))
        return spec.job_id()

    def register_rank(self, job_id: str, info: RankInfo) -> None:
        """Register this client's rank (one rank per client). Waits at most `timeout_s`; raises
        ServiceError (bad_field) if the service rejects it. Until the job is known (rank 0 may
        register it later) the client retries in the background."""
        message = RegisterRank(job_id, info)
        if self._info is not None and (self._info.rank != info.rank or self._job_id != job_id):
            raise ConfigError(f"this PlannerClient serves rank {self._info.rank} of {self._job_id}; create one client per rank")
        self._job_id, self._info, self._uploaded = job_id, info, False
        self._raise_if_refused(self._call(message, reliable=True))

    def assignment(self, iteration: int) -> Assignment:
        """What to run at `iteration` (0-based, counted by the caller). Never blocks."""
        self._iteration = iteration
        view = self._view
        if view is None:
            return UNPLANNED
        if view.plan is not None and iteration >= view.plan_start:
            return view.plan
        if view.previous is not None:
            return view.previous  # a re-plan (a straggler came or went) starts at plan_start
        if iteration < view.warmup_iterations:
            return view.warmup
        if not (view.stage_profiled or self._uploaded):
            k = (iteration - view.warmup_iterations) // view.iterations_per_frequency
            if k < len(view.sweep):
                return view.sweep[k]
        return view.waiting

    def upload_profile(self, job_id: str, stage: int, profile: Profile) -> None:
        """Offer this rank's stage profile; the rank runs at max clocks from now until the plan
        arrives. It is sent (and retried until the service takes it) once the service's table
        names this rank its stage's uploader (Table.upload), and dropped if the stage gets
        profiled by another data-parallel replica first. Raises ConfigError/ProfileError for a
        malformed profile."""
        info = self._info
        if info is None or job_id != self._job_id:
            raise ConfigError("call register_rank(job_id, info) with this job before upload_profile")
        message = UploadProfile(job_id, info.rank, stage, profile)
        size = len(encode_request(0, message))
        if size > MAX_MESSAGE_BYTES:
            raise ConfigError(f"stage {stage}'s profile is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit; profile fewer frequencies")
        self._uploaded = True
        self._send(_Out(message, reliable=True))

    def report_iteration(
        self, job_id: str, rank: int, iteration: int, time_s: float, energy_j: float, compute_time_s: float | None = None
    ) -> None:
        """Queue one iteration's measured time and energy of this rank's GPU (`compute_time_s`:
        the time without waiting on other data-parallel pipelines, if known; it lets the service
        see stragglers). Never raises: a report with bad values is logged (once) and dropped."""
        try:
            message = ReportIteration(job_id, rank, iteration, time_s, energy_j, compute_time_s)
        except ConfigError as e:
            self._warn_once("report", "dropping an iteration report the service would refuse: %s", e)
            return
        self._send(_Out(message, reliable=False))

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
        return self._plan_arrived.wait(timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (up to `timeout_s`, default the client's timeout) until queued uploads, registrations
        and reports have been answered; True if nothing is left."""
        return self._idle.wait(self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Send what is queued (for at most `timeout_s`), then stop the background thread."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake()
        self._thread.join(self.timeout_s + 1.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- hand-off to the background thread ------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already signalled (pipe full) or closing

    def _send(self, out: _Out) -> None:
        if self._closing.is_set():
            return
        with self._idle_lock:
            self._idle.clear()
            self._commands.put(out)
        self._wake()

    def _call(self, message: Message, *, reliable: bool) -> Message | ServiceError | None:
        waiter = _Waiter()
        self._send(_Out(message, reliable, waiter))
        waiter.event.wait(self.timeout_s)
        return waiter.result

    def _raise_if_refused(self, result: Message | ServiceError | None) -> None:
        if isinstance(result, ServiceError) and result.code == ErrorCode.BAD_FIELD.value:
            raise result

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned_once:
            self._warned_once.add(key)
            log.warning(message, *args)

    # ---- background thread ----------------------------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        try:
            _Connection(self, context).run()
        except Exception:
            log.exception("planner client thread stopped; this rank keeps its current clocks and plan")
        finally:
            context.destroy(linger=0)

    def _apply_table(self, table: Table) -> None:
        old = self._view
        info = self._info
        assert info is not None
        version = table.plan_version
        plan = None
        previous = old.previous if old is not None else None
        if version and table.frequencies is not None:
            plan = Assignment(Phase.PLANNED, list(table.frequencies), None, version)
            if old is not None and old.plan is not None and old.plan.plan_version != version and self._iteration >= old.plan_start:
                previous = old.plan
        elif version and old is not None and old.plan is not None and old.plan.plan_version == version:
            plan = old.plan
        if plan is None or table.plan_start_iteration == 0:
            previous = None
        failed = table.phase == JobPhase.FAILED.value  # no plan will come: no sweep either
        self._view = _View(
            warmup_iterations=table.warmup_iterations,
            iterations_per_frequency=table.iterations_per_frequency,
            sweep=() if failed else tuple(Assignment(Phase.PROFILING, None, f, version) for f in table.sweep_frequencies),
            stage_profiled=info.stage in table.profiled_stages,
            plan=plan,
            plan_start=table.plan_start_iteration,
            previous=previous,
            warmup=UNPLANNED if failed else Assignment(Phase.WARMUP, None, None, version),
            waiting=UNPLANNED if failed else Assignment(Phase.PLANNING, None, None, version),
            upload=table.upload,
        )
        if plan is not None and (old is None or old.plan is not plan):
            log.info("rank %d: plan v%d received (applies from iteration %d)", info.rank, version, table.plan_start_iteration)
            self._plan_arrived.set()
        if failed:
            self._warn_once("failed", "planner service could not plan this job (%s); this rank runs at maximum clocks", table.error)

    def _known_plan_version(self) -> int:
        view = self._view
        return view.plan.plan_version if view is not None and view.plan is not None else 0


class _Connection:
    """The background thread's state: the socket, queued and in-flight requests, retries."""

    def __init__(self, client: PlannerClient, context: zmq.Context) -> None:
        self.c = client
        self.context = context
        self.ids = itertools.count(1)
        self.outbox: deque[_Out] = deque()  # registrations, uploads, polls, status
        self.reports: deque[_Out] = deque(maxlen=MAX_QUEUED_REPORTS)
        self.inflight: dict[int, _Out] = {}
        self.delayed: list[tuple[float, _Out]] = []
        self.held: _Out | None = None  # the stage profile, until the table says this rank uploads it
        self.connected: bool | None = None  # None: not tried yet
        self.rank_registered = False
        self.register_due: float | None = None  # re-register the rank at this time
        self.next_poll = 0.0
        self.socket: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self.poller.register(client._wake_r, zmq.POLLIN)
        self._open()

    def _open(self) -> None:
        if self.socket is not None:
            self.poller.unregister(self.socket)
            self.socket.close(linger=0)
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.c._security.configure_client(sock)
        sock.connect(self.c.address)
        self.socket = sock
        self.poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        c = self.c
        close_deadline: float | None = None
        while True:
            now = time.monotonic()
            self._take_commands()
            self._release_held()
            if c._closing.is_set():
                close_deadline = close_deadline or now + c.timeout_s
                if now >= close_deadline or not (self.outbox or self.reports or self.inflight) or self.connected is False:
                    break
            self._schedule(now)
            self._transmit(now)
            self._update_idle()
            wait = self._wait_s(now)
            for sock, _ in self.poller.poll(max(0, int(wait * 1000))):
                if sock == c._wake_r:
                    self._drain_wake()
                else:
                    self._receive()
            self._check_timeouts(time.monotonic())
        if self.socket is not None:
            self.socket.close(linger=0)

    def _take_commands(self) -> None:
        while True:
            try:
                out = self.c._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(out.message, ReportIteration):
                self.reports.append(out)
            elif isinstance(out.message, UploadProfile):
                self.held = out
            else:
                if isinstance(out.message, RegisterRank):
                    self.rank_registered = False
                self.outbox.append(out)

    def _release_held(self) -> None:
        """Send the held profile once the table names this rank the uploader; drop it once
        another replica's profile of the stage is in."""
        view = self.c._view
        if self.held is not None and view is not None:
            if view.stage_profiled:
                self.held = None
            elif view.upload:
                self.outbox.append(self.held)
                self.held = None

    def _schedule(self, now: float) -> None:
        """Add due retries, re-registrations and table polls to the outbox."""
        c = self.c
        for due, out in list(self.delayed):
            if due <= now:
                self.delayed.remove((due, out))
                self.outbox.append(out)
        if self.register_due is not None and now >= self.register_due and c._info is not None and c._job_id is not None:
            self.register_due = None
            if not any(isinstance(o.message, RegisterRank) for o in self._pending()):
                self.outbox.appendleft(_Out(RegisterRank(c._job_id, c._info), reliable=True))
                if c._spec is not None and c._spec.job_id() == c._job_id:
                    self.outbox.appendleft(_Out(RegisterJob(c._spec), reliable=True))
        if self.rank_registered and not c._closing.is_set() and now >= self.next_poll and not any(isinstance(o.message, GetTable) for o in self._pending()):
            assert c._info is not None and c._job_id is not None
            self.outbox.append(_Out(GetTable(c._job_id, c._info.rank, max(-1, c._iteration), c._known_plan_version()), reliable=False))
            self.next_poll = now + c.poll_interval_s

    def _pending(self) -> list[_Out]:
        return [*self.outbox, *self.inflight.values()]

    def _transmit(self, now: float) -> None:
        """Send queued requests; while the service seems down, only one probe at a time."""
        assert self.socket is not None
        while self.outbox or self.reports:
            if self.connected is not True and self.inflight:
                return
            pending = self.outbox if self.outbox else self.reports
            request_id = next(self.ids)
            try:
                self.socket.send(encode_request(request_id, pending[0].message), zmq.NOBLOCK)
            except zmq.Again:
                return  # the socket's queue is full; try again after the next poll
            out = pending.popleft()
            out.sent_at = now
            self.inflight[request_id] = out

    def _wait_s(self, now: float) -> float:
        """Seconds until something is due: a poll, a request's timeout, a retry."""
        due = [now + 0.5, *(d for d, _ in self.delayed)]
        if self.rank_registered:
            due.append(self.next_poll)
        if self.inflight:
            due.append(min(o.sent_at for o in self.inflight.values()) + self.c.timeout_s)
        if self.register_due is not None:
            due.append(self.register_due)
        return max(0.001, min(due) - now)

    def _drain_wake(self) -> None:
        try:
            while os.read(self.c._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _update_idle(self) -> None:
        busy = self.reports or self.delayed or any(o.reliable or isinstance(o.message, ReportIteration) for o in self._pending())
        with self.c._idle_lock:
            if busy or not self.c._commands.empty():
                self.c._idle.clear()
            else:
                self.c._idle.set()

    def _receive(self) -> None:
        assert self.socket is not None
        while True:
            try:
                payload = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                request_id, body = decode_reply(payload)
            except ServiceError as e:
                log.warning("ignoring a malformed reply from the planner service: %s", e)
                continue
            out = self.inflight.pop(request_id, None) if isinstance(request_id, int) else None
            if out is None:
                continue  # a late reply to a request that timed out (and was resent)
            if self.connected is False:
                log.info("planner service at %s is reachable again", self.c.address)
            self.connected = True
            if isinstance(body, dict):
                try:
                    body = REQUESTS[out.message.TYPE][1].from_wire(body)
                except ConfigError as e:
                    body = ServiceError(ErrorCode.INTERNAL.value, f"malformed reply: {e}")
            self._on_reply(out, body)

    def _on_reply(self, out: _Out, reply: Message | ServiceError) -> None:
        c = self.c
        message = out.message
        if isinstance(reply, ServiceError) and reply.code in _RETRY_CODES and isinstance(message, _RANK_REQUESTS):
            # The service does not know the job or rank (restarted without its state, or rank 0
            # has not registered yet): register again and retry, at the poll rate. Other requests
            # (an operator's status or straggler declaration) get the error.
            self.rank_registered = False
            self.register_due = self.register_due or time.monotonic() + c.poll_interval_s
            if isinstance(message, UploadProfile):
                self.delayed.append((time.monotonic() + c.poll_interval_s, out))
            if isinstance(message, RegisterRank) and c._spec is None:
                c._warn_once("no-job", "job %s is not registered with the planner service yet; waiting for rank 0 (%s)", c._job_id, reply.message)
            return
        if out.waiter is not None:
            out.waiter.set(reply)
        if isinstance(reply, ServiceError):
            log.error("planner service refused %s: %s", message.TYPE, reply)
            return
        if isinstance(message, RegisterRank):
            self.rank_registered = True
            self.next_poll = 0.0
        elif isinstance(message, GetTable) and isinstance(reply, Table) and c._info is not None:
            c._apply_table(reply)

    def _check_timeouts(self, now: float) -> None:
        if not self.inflight or min(o.sent_at for o in self.inflight.values()) + self.c.timeout_s > now:
            return
        if self.connected is not False:
            log.warning(
                "planner service at %s did not answer within %.1f s; training continues (%s) and the client keeps retrying",
                self.c.address,
                self.c.timeout_s,
                "with its current plan" if self.c._known_plan_version() else "at default clocks",
            )
        self.connected = False
        resend = [o for _, o in sorted(self.inflight.items()) if o.reliable]
        for out in self.inflight.values():
            if not out.reliable and out.waiter is not None:
                out.waiter.set(None)
        self.inflight.clear()
        self.outbox.extendleft(reversed(resend))
        self._open()  # a fresh DEALER: the old one may hold requests for a dead peer
