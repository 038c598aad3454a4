"""The planner client's connection thread: the one owner of its DEALER socket (zmq sockets are
not thread-safe), with the queued and in-flight requests, their retries and the table polls.

The training thread hands requests over through a `Handoff` (a queue and a wake-up pipe) and
never waits on the socket. While the service does not answer, one probe at a time is in flight;
reliable requests (registrations, uploads) are resent on a fresh socket until answered, reports
are dropped past a bounded queue, and the rank re-registers if the service forgot it.
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

import zmq

from perseus.client.assignments import RankState
from perseus.exceptions import ConfigError, ServiceError
from perseus.wire.envelope import ErrorCode, decode_reply, encode_request
from perseus.wire.fields import Message
from perseus.wire.limits import HARD_MESSAGE_BYTES, SWEEP_VERSION
from perseus.wire.messages import REQUESTS, GetTable, RegisterJob, RegisterRank, ReportIteration, Table, UploadProfile
from perseus.wire.security import Security
from perseus.wire.spans import ReportSpans

log = logging.getLogger(__name__)

MAX_QUEUED_REPORTS = 4096
#: Seconds a rank waits for rank 0 to register the job before it warns.
NO_JOB_WARNING_S = 60.0
_RETRY_CODES = (ErrorCode.UNKNOWN_JOB.value, ErrorCode.UNKNOWN_RANK.value, ErrorCode.NOT_READY.value)
_RANK_REQUESTS = (RegisterRank, GetTable, UploadProfile, ReportIteration, ReportSpans)  # retried on _RETRY_CODES
_REPORTS = (ReportIteration, ReportSpans)  # sent while connected, dropped past MAX_QUEUED_REPORTS


class Waiter:
    """The reply a training-thread call waits for: a message, the service's refusal, or None (no answer)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: Message | ServiceError | None = None

    def set(self, result: Message | ServiceError | None) -> None:
        self.result = result
        self.event.set()


@dataclass
class Outgoing:
    message: Message
    reliable: bool  # resent after a timeout until answered
    waiter: Waiter | None = None
    sent_at: float = 0.0


class Handoff:
    """From the training thread to the connection thread: requests, a pipe that wakes the
    connection's poll, and back whether everything handed over has been answered (`idle`)."""

    def __init__(self) -> None:
        self.commands: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        self.idle = threading.Event()  # nothing queued or unanswered (see PlannerClient.flush)
        self.idle.set()
        self.idle_lock = threading.Lock()
        self.closing = threading.Event()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)

    def send(self, out: Outgoing) -> None:
        if self.closing.is_set():
            return
        with self.idle_lock:
            self.idle.clear()
            self.commands.put(out)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # BlockingIOError included: already signalled (pipe full) or closing
            pass

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:  # BlockingIOError included: drained
            pass

    def close(self) -> None:
        """Close the pipe, once the connection thread is done with it."""
        os.close(self.wake_r)
        os.close(self._wake_w)


class Connection:
    """The connection thread's state for one rank (`rank`) of a PlannerClient: `run()` until
    the handoff is closing and what is queued is sent (or `timeout_s` passes)."""

    def __init__(
        self,
        rank: RankState,
        handoff: Handoff,
        context: zmq.Context,
        *,
        address: str,
        security: Security,
        timeout_s: float,
        poll_interval_s: float,
    ) -> None:
        self.rank = rank
        self.handoff = handoff
        self.context = context
        self.address = address
        self.security = security
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self.ids = itertools.count(1)
        self.outbox: deque[Outgoing] = deque()  # registrations, uploads, polls, status
        self.reports: deque[Outgoing] = deque(maxlen=MAX_QUEUED_REPORTS)
        self.inflight: dict[int, Outgoing] = {}
        self.delayed: list[tuple[float, Outgoing]] = []
        self.held: Outgoing | None = None  # the stage profile, until the table says this rank uploads it
        self.connected: bool | None = None  # None: not tried yet
        self.rank_registered = False
        self.register_due: float | None = None  # re-register the rank at this time
        self.no_job_since: float | None = None  # when the service first said it knows no such job
        self.next_poll = 0.0
        self.socket: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self.poller.register(handoff.wake_r, zmq.POLLIN)
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
        self.security.configure_client(sock)
        sock.connect(self.address)
        self.socket = sock
        self.poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        closing = self.handoff.closing
        close_deadline: float | None = None
        while True:
            now = time.monotonic()
            self._take_commands()
            self._release_held()
            if closing.is_set():
                close_deadline = close_deadline or now + self.timeout_s
                if (
                    now >= close_deadline
                    or not (self.outbox or self.reports or self.inflight)
                    or self.connected is False
                ):
                    break
            self._schedule(now)
            self._transmit(now)
            self._update_idle()
            wait = self._wait_s(now)
            for sock, _ in self.poller.poll(max(0, int(wait * 1000))):
                if sock == self.handoff.wake_r:
                    self.handoff.drain_wake()
                else:
                    self._receive()
            self._check_timeouts(time.monotonic())
        if self.socket is not None:
            self.socket.close(linger=0)

    def _take_commands(self) -> None:
        while True:
            try:
                out = self.handoff.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(out.message, _REPORTS):
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
        view = self.rank.view
        if self.held is not None and view is not None:
            if view.stage_profiled:
                self.held = None
            elif view.upload:
                self.outbox.append(self.held)
                self.held = None

    def _schedule(self, now: float) -> None:
        """Add due retries, re-registrations and table polls to the outbox."""
        rank = self.rank
        for due, out in list(self.delayed):
            if due <= now:
                self.delayed.remove((due, out))
                self.outbox.append(out)
        if (
            self.register_due is not None
            and now >= self.register_due
            and rank.info is not None
            and rank.job_id is not None
        ):
            self.register_due = None
            if not any(isinstance(o.message, RegisterRank) for o in self._pending()):
                self.outbox.appendleft(Outgoing(RegisterRank(rank.job_id, rank.info), reliable=True))
                if rank.spec is not None and rank.spec.job_id() == rank.job_id:
                    self.outbox.appendleft(Outgoing(RegisterJob(rank.spec), reliable=True))
        polling = self.rank_registered and not self.handoff.closing.is_set() and now >= self.next_poll
        if polling and not any(isinstance(o.message, GetTable) for o in self._pending()):
            assert rank.info is not None and rank.job_id is not None
            self.outbox.append(
                Outgoing(
                    GetTable(
                        rank.job_id,
                        rank.info.rank,
                        max(-1, rank.iteration),
                        rank.known_plan_version(),
                        sweep_version=SWEEP_VERSION,
                    ),
                    reliable=False,
                )
            )
            self.next_poll = now + self.poll_interval_s

    def _pending(self) -> list[Outgoing]:
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
            due.append(min(o.sent_at for o in self.inflight.values()) + self.timeout_s)
        if self.register_due is not None:
            due.append(self.register_due)
        return max(0.001, min(due) - now)

    def _update_idle(self) -> None:
        handoff = self.handoff
        busy = (
            self.reports or self.delayed or any(o.reliable or isinstance(o.message, _REPORTS) for o in self._pending())
        )
        with handoff.idle_lock:
            if busy or not handoff.commands.empty():
                handoff.idle.clear()
            else:
                handoff.idle.set()

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
                log.info("planner service at %s is reachable again", self.address)
            self.connected = True
            if isinstance(body, dict):
                try:
                    body = REQUESTS[out.message.TYPE][1].from_wire(body)
                except ConfigError as e:
                    body = ServiceError(ErrorCode.INTERNAL.value, f"malformed reply: {e}")
            self._on_reply(out, body)

    def _no_job(self, why: str) -> None:
        """The service does not know this rank's job: normal while the ranks start (rank 0
        registers it), worth a WARNING once that has lasted NO_JOB_WARNING_S."""
        now = time.monotonic()
        if self.no_job_since is None:
            self.no_job_since = now
            log.info("job %s: waiting for rank 0 to register it with the planner service (%s)", self.rank.job_id, why)
        elif now - self.no_job_since >= NO_JOB_WARNING_S and self.rank.first_time("no-job"):
            log.warning(
                "job %s is still not registered with the planner service after %.0f s; is rank 0 running Perseus "
                "against the same service (PERSEUS_PLANNER)? Training runs at default clocks meanwhile (%s)",
                self.rank.job_id,
                now - self.no_job_since,
                why,
            )

    def _on_reply(self, out: Outgoing, reply: Message | ServiceError) -> None:
        rank = self.rank
        message = out.message
        if isinstance(reply, ServiceError) and reply.code in _RETRY_CODES and isinstance(message, _RANK_REQUESTS):
            # The service does not know the job or rank (restarted without its state, or rank 0
            # has not registered yet): register again and retry, at the poll rate. Other requests
            # (an operator's status or straggler declaration) get the error.
            self.rank_registered = False
            self.register_due = self.register_due or time.monotonic() + self.poll_interval_s
            if isinstance(message, UploadProfile):
                self.delayed.append((time.monotonic() + self.poll_interval_s, out))
            if isinstance(message, RegisterRank) and rank.spec is None:
                self._no_job(reply.message)
            return
        if out.waiter is not None:
            out.waiter.set(reply)
        if isinstance(reply, ServiceError):
            log.error("planner service refused %s: %s", message.TYPE, reply)
            return
        if isinstance(message, RegisterRank):
            self.rank_registered = True
            self.next_poll = 0.0
        elif isinstance(message, GetTable) and isinstance(reply, Table) and rank.info is not None:
            rank.apply_table(reply)

    def _check_timeouts(self, now: float) -> None:
        if not self.inflight or min(o.sent_at for o in self.inflight.values()) + self.timeout_s > now:
            return
        if self.connected is not False:
            log.warning(
                "planner service at %s did not answer within %.1f s; training continues (%s) and the client keeps "
                "retrying",
                self.address,
                self.timeout_s,
                "with its current plan" if self.rank.known_plan_version() else "at default clocks",
            )
        self.connected = False
        resend = [o for _, o in sorted(self.inflight.items()) if o.reliable]
        for out in self.inflight.values():
            if not out.reliable and out.waiter is not None:
                out.waiter.set(None)
        self.inflight.clear()
        self.outbox.extendleft(reversed(resend))
        self._open()  # a fresh DEALER: the old one may hold requests for a dead peer
