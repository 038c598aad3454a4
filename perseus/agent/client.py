"""A process's connection to the node's perseus agent: one per socket path, shared by its GPUs.

Requests are request-reply, made on whichever thread calls them: for clocks, the frequency
controller's worker thread, never the training thread. The first write to a GPU takes its lease,
which lasts until the process ends: it closes the connection at exit (the kernel does on a kill),
and the agent resets the GPU.
While the process holds leases a heartbeat thread keeps the connection alive (the agent ends a
silent one); should the agent restart, it reconnects, takes the leases back and re-applies this
process's settings (unless the new agent serves other GPUs). The agent's hello reply says what it
serves, so that GPUs can check they are the ones it writes (perseus.devices.agent_gpu). A forked
child starts with no connection and no leases (its parent's stay its parent's).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TypeVar

from perseus.agent.location import is_socket
from perseus.agent.protocol import (
    Acquire,
    AgentError,
    AgentErrorCode,
    AgentStatus,
    Done,
    Granted,
    Heartbeat,
    Hello,
    LeaseHeldError,
    Revoke,
    Revoked,
    StatusRequest,
    Welcome,
    Write,
    decode_reply,
    encode_request,
    recv_frame,
)
from perseus.exceptions import DevicePermissionError, PerseusError
from perseus.wire.fields import Message

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
UNREACHABLE = "unreachable"
M = TypeVar("M", bound=Message)
BUSY = "busy"
START_OR_POINT = (
    "start the agent (`perseus agent`, or `systemctl start perseus-agent`), point PERSEUS_AGENT at its socket, or "
    "set PERSEUS_AGENT=off to write directly (needs root)"
)


def client_name() -> str:
    """This process's command line, as the agent shows it in logs and refusals."""
    argv = list(getattr(sys, "orig_argv", sys.argv)) or ["python"]
    text = " ".join([os.path.basename(argv[0]), *argv[1:]])
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:120]


class AgentClient:
    """The connection to the agent at `path`. Thread-safe; `shared_client` gives the process's one."""

    def __init__(self, path: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.where = f"the perseus agent at {path}"
        self._fresh()
        _clients.add(self)

    def _fresh(self) -> None:
        """No connection, no leases (at creation, and in a forked child)."""
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._leases: set[str] = set()
        self._settings: dict[tuple[str, str], int] = {}  # (uuid, setting) -> value this process set
        self._heartbeat_s = 0.25
        self._welcome: Welcome | None = None  # the agent's hello reply: what it serves
        self._beating: threading.Thread | None = None
        self._closed = threading.Event()
        self._outage_logged = False

    # What GPUs ask
    def write(self, uuid: str, setting: str, value: int | None) -> None:
        """Set (value None: restore the default of) `setting` of GPU `uuid`, taking its lease first
        if this process has none. Raises LeaseHeldError naming the holder's pid, ConfigError for a
        value the GPU refuses, AgentError when the agent cannot be reached."""
        request = Write(uuid, setting, value)  # checks the fields before anything is sent
        with self._exclusive():
            if uuid not in self._leases:
                self._call(Acquire((uuid,)), Granted)
                self._leases.add(uuid)
                self._start_heartbeats()
            try:
                self._call(request, Done)
            except AgentError as e:
                if e.code == AgentErrorCode.NOT_LEASED.value:  # revoked by an administrator
                    self._leases.discard(uuid)
                    self._settings = {k: v for k, v in self._settings.items() if k[0] != uuid}
                raise
            if value is None:
                self._settings.pop((uuid, setting), None)
            else:
                self._settings[(uuid, setting)] = value

    def may_control(self, uuid: str) -> tuple[bool, str]:
        """(whether this process may change GPU `uuid` through the agent, why not). Takes no lease."""
        try:
            state = self.status().gpu(uuid)
        except PerseusError as e:
            return False, str(e)
        if state is None:
            return False, f"{self.where} serves no GPU {uuid}"
        if state.holder is not None and not state.yours:
            return False, f"{self.where} has leased GPU {state.index} ({uuid}) to {state.holder.describe()}"
        return True, ""

    def served(self) -> Welcome:
        """What the agent serves (its reply to this process's hello: backend, simulated GPUs'
        folder, UUIDs), connecting if this process has not yet. AgentError if it cannot be reached."""
        with self._exclusive():
            if self._welcome is None:
                try:
                    self._connect()
                except OSError as e:
                    self._drop()
                    raise AgentError(UNREACHABLE, f"lost the connection to {self.where} ({e})") from None
            assert self._welcome is not None
            return self._welcome

    def status(self) -> AgentStatus:
        with self._exclusive():
            return self._call(StatusRequest(), AgentStatus)

    def revoke(self, uuids: tuple[str, ...]) -> tuple[str, ...]:
        """End other processes' leases on `uuids` and restore their defaults (root or the agent's
        user). Returns the UUIDs whose lease ended."""
        with self._exclusive():
            return self._call(Revoke(uuids), Revoked).uuids

    def close(self) -> None:
        """Close the connection: the agent resets every GPU this process leased. The client may
        be used again (a new connection, new leases)."""
        with self._lock:
            closed, self._closed, self._beating = self._closed, threading.Event(), None
            closed.set()  # the heartbeat thread waits on this one, and ends
            self._drop()
            self._leases.clear()
            self._settings.clear()

    # The connection
    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            raise AgentError(
                BUSY,
                f"a request to {self.where} is already under way on this thread (a signal handler interrupted it); "
                "the agent restores this process's GPUs when it ends",
            )
        if not self._lock.acquire(timeout=self.timeout_s):
            raise AgentError(BUSY, f"the connection to {self.where} stayed busy for {self.timeout_s:g} s")
        self._owner = me
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()

    def _call(self, request: Message, reply: type[M]) -> M:
        """One round trip (lock held), connecting first if needed and once more if the connection
        turns out broken (the agent restarted)."""
        for attempt in (1, 2):
            if self._sock is None:
                self._connect()
            try:
                return self._round_trip(request, reply)
            except TimeoutError:
                self._drop()
                raise AgentError(UNREACHABLE, f"{self.where} did not answer within {self.timeout_s:g} s") from None
            except OSError as e:
                self._drop()
                if attempt == 2:
                    raise AgentError(UNREACHABLE, f"lost the connection to {self.where} ({e})") from None
        raise AssertionError("unreachable")

    def _round_trip(self, request: Message, reply: type[M]) -> M:
        assert self._sock is not None
        request_id = next(self._ids)
        try:
            self._sock.sendall(encode_request(request_id, request))
        except (BrokenPipeError, ConnectionResetError):
            # The agent may refuse a connection (too many) before reading it: its reason is waiting.
            payload = recv_frame(self._sock, self._buffer)
            if payload is None:
                raise
            return decode_reply(payload, request_id, reply, self.where)
        payload = recv_frame(self._sock, self._buffer)
        if payload is None:
            raise ConnectionResetError("the agent closed the connection")
        return decode_reply(payload, request_id, reply, self.where)

    def _connect(self) -> None:
        """Connect and say hello; with leases (a reconnect), take them back and re-apply this
        process's settings, which the agent reset when the old connection ended."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except FileNotFoundError:
            sock.close()
            raise AgentError(UNREACHABLE, f"no perseus agent socket at {self.path}: {START_OR_POINT}") from None
        except PermissionError:
            sock.close()
            raise DevicePermissionError(
                f"may not connect to {self.where} as uid {os.getuid()} (groups {sorted(os.getgroups())}): its socket "
                "admits the agent's user and group; add this user to that group (in Kubernetes: the pod's "
                "supplementalGroups)"
            ) from None
        except ConnectionRefusedError:
            sock.close()
            if not is_socket(self.path):
                raise AgentError(
                    UNREACHABLE, f"{self.path} is not a Unix socket (no perseus agent listens there): {START_OR_POINT}"
                ) from None
            raise AgentError(
                UNREACHABLE,
                f"nothing listens on {self.path}, the socket of a perseus agent that stopped: {START_OR_POINT}",
            ) from None
        except OSError as e:
            sock.close()
            raise AgentError(UNREACHABLE, f"cannot connect to {self.where}: {e}") from None
        self._sock, self._buffer = sock, bytearray()
        try:
            welcome = self._round_trip(Hello(client_name(), os.getpid()), Welcome)
            self._heartbeat_s = welcome.heartbeat_s
            before, self._welcome = self._welcome, welcome
            restored = "; this process's leases and settings are restored"
            if self._leases and not self._take_back(before):
                restored = ", without this process's leases (see above)"
        except BaseException:
            self._drop()
            raise
        if self._outage_logged:
            logger.warning("%s answers again%s", self.where, restored)
            self._outage_logged = False

    def _take_back(self, before: Welcome | None) -> bool:
        """Whether the leases were taken back (else they are forgotten, and why is logged)."""
        welcome = self._welcome
        assert welcome is not None
        if before is not None and (before.backend, before.sim_dir) != (welcome.backend, welcome.sim_dir):
            logger.error(
                "%s now serves %s GPUs%s; this process's leases were on its %s GPUs%s: not taken back",
                self.where,
                welcome.backend,
                _folder(welcome),
                before.backend,
                _folder(before),
            )
            self._leases.clear()
            self._settings.clear()
            return False
        try:
            self._round_trip(Acquire(tuple(sorted(self._leases))), Granted)
        except (LeaseHeldError, DevicePermissionError) as e:
            logger.error("could not take back this process's GPU leases from %s: %s", self.where, e)
            self._leases.clear()
            self._settings.clear()
            return False
        for (uuid, setting), value in list(self._settings.items()):
            self._round_trip(Write(uuid, setting, value), Done)
        return True

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # Heartbeats
    def _start_heartbeats(self) -> None:
        if self._beating is None:
            self._beating = threading.Thread(target=self._beat, name="perseus-agent-heartbeat", daemon=True)
            self._beating.start()

    def _beat(self) -> None:
        closed = self._closed
        while not closed.wait(self._heartbeat_s):
            if not self._lock.acquire(timeout=self._heartbeat_s):
                continue  # a request under way keeps the connection alive itself
            try:
                if closed.is_set() or not self._leases:
                    continue
                if self._sock is not None:
                    try:
                        self._sock.sendall(encode_request(next(self._ids), Heartbeat()))
                        continue
                    except OSError:
                        self._drop()
                try:
                    self._connect()
                except PerseusError as e:
                    if not self._outage_logged:
                        logger.warning("lost %s (%s); retrying every %g s", self.where, e, self._heartbeat_s)
                        self._outage_logged = True
            finally:
                self._lock.release()

    def _forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the socket (not the connection, which
        is the parent's) and start over without leases."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._fresh()


def _folder(welcome: Welcome) -> str:
    return "" if welcome.sim_dir is None else f" in {welcome.sim_dir}"


_clients: weakref.WeakSet[AgentClient] = weakref.WeakSet()
_shared: dict[str, AgentClient] = {}
_shared_lock = threading.Lock()


def shared_client(path: str) -> AgentClient:
    """This process's one client for the agent at `path` (its GPUs share the connection and leases)."""
    with _shared_lock:
        client = _shared.get(path)
        if client is None:
            client = _shared[path] = AgentClient(path)
        return client


def _close_at_exit() -> None:
    """End this process's leases as it exits, before the interpreter's teardown (which can outlast
    the heartbeat timeout, its heartbeat thread already stopped) would make the agent wait for it.
    Registered at import, before any GPU's reset-at-exit, so it runs after them."""
    for client in list(_clients):
        client.close()


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    for client in list(_clients):
        client._forget_after_fork()


atexit.register(_close_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
