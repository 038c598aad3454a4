"""The agent: the node's one writer of GPU clocks and power limits, serving leases on a Unix socket.

Who may connect is the socket's business: its mode and group (`--mode`, `--group`) decide, and
the kernel tells the agent each peer's pid, uid and gid (SO_PEERCRED), which name the holder of
every lease in logs and refusals. Each connection has its own thread, blocking on its socket with
the heartbeat timeout: a closed connection (the client exited or was killed: the kernel closes
its socket) or one silent for `timeout_s` ends at once, and the GPUs it leased go back to default
clocks and power limits before the thread moves on -- within milliseconds of the kill, or of the
timeout. GPU calls are serialised per GPU, so a slow driver call on one GPU delays no other.

At start the agent resets every GPU the lease file says was leased when the previous agent
stopped (its clients' connections died with it), then listens; on SIGTERM it resets the GPUs still
leased, as no one else would. Each GPU it serves is claimed first (perseus.agent.claims): a second
agent on another socket is refused before it can touch them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from perseus.agent.claims import CLAIMS_DIR, claim_gpus, release
from perseus.agent.leases import Lease, LeaseConflict, LeaseTable, read_lease_file
from perseus.agent.peer import PeerCredentials, peer_credentials
from perseus.agent.protocol import (
    SM_CLOCK,
    Acquire,
    AgentErrorCode,
    AgentRejected,
    AgentStatus,
    Done,
    FrameTooLarge,
    GPUState,
    Granted,
    Heartbeat,
    Hello,
    Holder,
    Revoke,
    Revoked,
    StatusRequest,
    Welcome,
    Write,
    decode_request,
    encode_error,
    encode_reply,
    recv_frame,
)
from perseus.agent.sim_folder import remove_marker, share, write_marker
from perseus.devices.gpu import GPU
from perseus.devices.reset import reset
from perseus.devices.select import gpu_backend
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError, DeviceError
from perseus.pidlock import release_pid_lock, take_pid_lock
from perseus.wire.fields import Message

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0
HEARTBEATS_PER_TIMEOUT = 4
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
ACCEPT_POLL_S = 0.2

T = TypeVar("T")
F = TypeVar("F")


@dataclass(frozen=True)
class AgentConfig:
    socket_path: str
    state_path: str  # the lease file
    timeout_s: float = DEFAULT_TIMEOUT_S  # silence that ends a connection and its leases
    mode: int = 0o660  # the socket's permissions
    group: int | None = None  # the socket's group (None: the agent's)
    max_connections: int = 256
    admin_uids: frozenset[int] = field(default_factory=lambda: frozenset({0, os.geteuid()}))
    claims_dir: str = CLAIMS_DIR  # where real GPUs are claimed (simulated ones: in their folder)

    def __post_init__(self) -> None:
        if not 0.05 <= self.timeout_s <= 3600:
            raise ConfigError(f"the heartbeat timeout must be 0.05 to 3600 s, got {self.timeout_s:g}")
        if not 0 <= self.mode <= 0o777:
            raise ConfigError(f"the socket mode must be an octal permission such as 660, got {self.mode:o}")
        if not 1 <= self.max_connections <= 65536:
            raise ConfigError(f"max connections must be 1 to 65536, got {self.max_connections}")
        for path in (self.socket_path, _staging_path(self.socket_path)):
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:
                raise ConfigError(
                    f"the socket path {path} is {len(os.fsencode(path))} bytes; a Unix socket's path may have at "
                    f"most {MAX_SOCKET_PATH}: choose a shorter one"
                )


def _staging_path(path: str) -> str:
    """Where the socket is bound before it gets its mode and group and is renamed into place, so
    no client ever finds it wider open than configured."""
    return os.path.join(os.path.dirname(path) or ".", f".agent-{os.getpid()}.sock")


class _Connection:
    """One client connection, served by its own thread."""

    def __init__(self, number: int, sock: socket.socket, peer: PeerCredentials) -> None:
        self.number = number
        self.sock = sock
        self.peer = peer
        self.client: str | None = None  # from hello
        self.client_pid = 0

    def holder(self) -> Holder:
        return Holder(
            pid=self.peer.pid,
            uid=self.peer.uid,
            gid=self.peer.gid,
            client=self.client or "",
            client_pid=self.client_pid,
            since=time.time(),
        )

    def who(self) -> str:
        return f"pid {self.peer.pid} (uid {self.peer.uid}, {self.client or '?'!r})"


class Agent:
    """Serves `gpus` on `config.socket_path` until `stop()`."""

    def __init__(self, gpus: Sequence[GPU], config: AgentConfig) -> None:
        self.config = config
        self._gpus: dict[str, GPU] = {}
        for gpu in gpus:
            uuid = gpu.uuid()
            if uuid in self._gpus:
                raise ConfigError(f"GPUs {self._gpus[uuid]!r} and {gpu!r} have the same UUID {uuid}")
            self._gpus[uuid] = gpu
        self._gpu_locks = {uuid: threading.Lock() for uuid in self._gpus}
        self.backend = gpu_backend(list(gpus))
        folders = sorted({os.path.abspath(os.path.dirname(g.state_path)) for g in gpus if isinstance(g, SimGPU)})
        if len(folders) > 1:
            raise ConfigError(f"one agent serves the simulated GPUs of one folder, not of {' and '.join(folders)}")
        self.sim_dir = folders[0] if folders else None
        self.leases = LeaseTable(config.state_path)
        self._listener: socket.socket | None = None
        self._lock_file: tuple[int, str] | None = None
        self._state_lock: tuple[int, str] | None = None
        self._claims: list[tuple[int, str]] = []
        self._socket_ino: int | None = None
        self._connections: dict[int, _Connection] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._conn_lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._stopping = threading.Event()
        self._stopped = False
        self._handlers: dict[type[Message], Callable[[_Connection, Message], Message | None]] = {
            Hello: self._hello,  # type: ignore[dict-item]
            Acquire: self._acquire,  # type: ignore[dict-item]
            Write: self._write,  # type: ignore[dict-item]
            Heartbeat: lambda conn, request: None,
            Revoke: self._revoke,  # type: ignore[dict-item]
            StatusRequest: lambda conn, request: self.status(conn),
        }

    # Life cycle
    def start(self) -> None:
        """Reset what leases of a previous agent left, then listen. ConfigError if the socket is
        another running agent's or cannot be made."""
        self._take_lock_file()
        try:
            self._claims = claim_gpus(
                {
                    uuid: (
                        gpu.index,
                        self.sim_dir if self.sim_dir and isinstance(gpu, SimGPU) else self.config.claims_dir,
                    )
                    for uuid, gpu in self._gpus.items()
                }
            )
            if self.sim_dir is not None:
                group = self.config.group if self.config.group is not None else os.getegid()
                share(self.sim_dir, self.config.mode, group)
            self._reset_stale()
            self._listen()
            if self.sim_dir is not None:
                sims = [gpu.index for gpu in self._gpus.values() if isinstance(gpu, SimGPU)]
                write_marker(self.sim_dir, self.config.socket_path, sims)
        except BaseException:
            self._release_locks()
            raise
        if self.config.mode & 0o002:
            logger.warning(
                "the socket's mode %03o lets every user of this node connect, and so lease GPUs and change their "
                "clocks; give it 660 and --group the users who train",
                self.config.mode,
            )
        logger.info(
            "serving %d GPU(s)%s on %s (mode %o, group %s; heartbeat timeout %g s; leases in %s)",
            len(self._gpus),
            "" if self.sim_dir is None else f", simulated in {self.sim_dir}",
            self.config.socket_path,
            self.config.mode,
            self.config.group if self.config.group is not None else os.getegid(),
            self.config.timeout_s,
            self.config.state_path,
        )

    def serve_forever(self) -> None:
        """Accept connections until `stop()` is called (from a signal handler or another thread)."""
        assert self._listener is not None, "start() first"
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopping.is_set():
                    break
                logger.error("accepting a connection failed (%s); retrying", e)
                time.sleep(ACCEPT_POLL_S)
                continue
            self._admit(sock)
        self._shutdown()

    def stop(self) -> None:
        """Ask `serve_forever` to return (safe from a signal handler): it closes every connection
        and resets the GPUs still leased."""
        self._stopping.set()

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        try:
            peer = peer_credentials(sock)
        except OSError as e:
            logger.warning("dropped a connection whose credentials could not be read (%s)", e)
            sock.close()
            return
        with self._conn_lock:
            if len(self._connections) >= self.config.max_connections:
                full = True
            else:
                full = False
                number = next(self._numbers)
                conn = _Connection(number, sock, peer)
                self._connections[number] = conn
                thread = threading.Thread(target=self._serve, args=(conn,), name=f"agent-conn-{number}", daemon=True)
                self._threads[number] = thread
        if full:
            logger.warning(
                "refused pid %d (uid %d): %d connections already", peer.pid, peer.uid, len(self._connections)
            )
            with contextlib.suppress(OSError):
                sock.sendall(encode_error(None, AgentErrorCode.BUSY, "the agent has too many connections; retry later"))
            sock.close()
            return
        thread.start()

    def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._listener is not None:
            self._listener.close()
        self._unlink_socket()
        if self.sim_dir is not None:
            remove_marker(self.sim_dir, self.config.socket_path)
        with self._conn_lock:
            connections = list(self._connections.values())
            threads = list(self._threads.values())
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=5.0)
        for lease in self.leases.clear():  # a connection thread stuck in a GPU call
            self._restore(lease, "the agent stopped")
        self._release_locks()
        logger.info("stopped")

    # The socket
    def _take_lock_file(self) -> None:
        """Lock the socket, then the lease file: another agent on either would take over, or
        rewrite away, this one's leases."""
        path = self.config.socket_path + ".lock"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o755, exist_ok=True)
            fd = take_pid_lock(path)
        except OSError as e:
            raise ConfigError(
                f"cannot create {path} beside the agent's socket: {e.strerror or e}; give --socket a path in a "
                "folder this user may write (the default, /run/perseus, needs root)"
            ) from None
        if isinstance(fd, str):
            raise ConfigError(
                f"another perseus agent (pid {fd}) serves {self.config.socket_path}; stop it first, or give "
                "this one another --socket"
            )
        self._lock_file = (fd, path)
        state, path = self.config.state_path, self.config.state_path + ".lock"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            fd = take_pid_lock(path)
        except OSError as e:
            self._release_locks()
            raise ConfigError(
                f"cannot write the lease file {state} (its lock {path}: {e.strerror or e}); choose --state-file"
            ) from None
        if isinstance(fd, str):
            self._release_locks()
            raise ConfigError(
                f"another perseus agent (pid {fd}) keeps its leases in {state}; give this one its own --state-file"
            )
        self._state_lock = (fd, path)

    def _release_locks(self) -> None:
        release(self._claims)
        for lock in (self._state_lock, self._lock_file):
            if lock is not None:
                release_pid_lock(*lock)
        self._state_lock = self._lock_file = None

    def _listen(self) -> None:
        path, staging = self.config.socket_path, _staging_path(self.config.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            listener.bind(staging)
            os.chmod(staging, self.config.mode)
            if self.config.group is not None:
                os.chown(staging, -1, self.config.group)
            listener.listen(128)
            os.replace(staging, path)  # over a socket a dead agent left, if any
        except OSError as e:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise ConfigError(f"cannot listen on {path}: {e}") from e
        listener.settimeout(ACCEPT_POLL_S)
        self._socket_ino = os.stat(path).st_ino
        self._listener = listener

    def _unlink_socket(self) -> None:
        """Remove the socket file if it is still this agent's."""
        with contextlib.suppress(OSError):
            if os.stat(self.config.socket_path).st_ino == self._socket_ino:
                os.unlink(self.config.socket_path)

    # Leases
    def _reset_stale(self) -> None:
        """Reset the GPUs the lease file says were leased when the last agent stopped."""
        try:
            stale, revoked = read_lease_file(self.config.state_path)
        except ConfigError as e:
            kept = self.config.state_path + ".damaged"
            try:
                os.replace(self.config.state_path, kept)
            except OSError:
                kept = "not kept"
            logger.error("%s (%s); resetting every GPU, as any may have been leased", e, kept)
            revoked = []
            stale = [Lease(uuid, gpu.index, Holder(0, 0, 0, "unknown", 0, 0.0), 0) for uuid, gpu in self._gpus.items()]
        for lease in stale:
            if lease.uuid not in self._gpus:
                logger.warning(
                    "the lease file names GPU %s (was %d), which this agent does not serve; not reset",
                    lease.uuid,
                    lease.index,
                )
                continue
            self._restore(lease, "the previous agent stopped while it was leased", level=logging.WARNING)
        self.leases.keep_revoked(revoked)
        self.leases.save()  # no leases: what was stale is reset

    def _restore(self, lease: Lease, why: str, level: int = logging.INFO, began: float | None = None) -> None:
        """Put a GPU whose lease ended back at default clocks and power limit; log what changed."""
        gpu = self._gpus[lease.uuid]
        began = time.monotonic() if began is None else began
        with self._gpu_locks[lease.uuid]:
            outcome = reset(gpu)  # never raises: what failed is in the outcome, logged below
        took_ms = (time.monotonic() - began) * 1000
        holder = f"pid {lease.holder.pid} (uid {lease.holder.uid}, {lease.holder.client!r})"
        if outcome.errors:
            level, what = logging.ERROR, f"resetting failed: {outcome.summary()} ({'; '.join(outcome.errors)})"
        else:
            what = f"reset to defaults: {outcome.summary()}"
        logger.log(level, "GPU %d (%s) of %s: %s; %s (%.1f ms)", gpu.index, lease.uuid, holder, why, what, took_ms)

    # Serving one connection
    def _serve(self, conn: _Connection) -> None:
        buffer = bytearray()
        why, level = "exited or was killed (its connection closed)", logging.INFO
        sock = conn.sock
        sock.settimeout(self.config.timeout_s)
        try:
            while not self._stopping.is_set():
                try:
                    payload = recv_frame(sock, buffer)
                except TimeoutError:
                    why, level = f"sent nothing for {self.config.timeout_s:g} s (heartbeats stopped)", logging.WARNING
                    break
                except FrameTooLarge as e:
                    with contextlib.suppress(OSError):
                        sock.sendall(encode_error(None, AgentErrorCode.TOO_LARGE, f"{e}; closing the connection"))
                    why, level = f"sent {e}", logging.WARNING
                    break
                except ConnectionResetError:
                    break  # closed with replies unread: a killed holder, as often as a clean EOF
                except OSError as e:
                    why = f"broke the connection ({e})"
                    break
                if payload is None:
                    break
                reply = self._answer(conn, payload)
                if reply is not None:
                    try:
                        sock.sendall(reply)
                    except OSError as e:
                        why = f"stopped reading replies ({e})"
                        break
        except Exception:  # a bug here must end only this connection, and still reset its GPUs
            logger.exception("serving %s failed", conn.who())
            why, level = "hit an agent error", logging.ERROR
        finally:
            ended = time.monotonic()
            if self._stopping.is_set():
                why = "was connected when the agent stopped"
            for lease in self.leases.end(conn.number):
                self._restore(lease, f"the holder {why}", level, began=ended)
            with contextlib.suppress(OSError):
                sock.close()
            with self._conn_lock:
                self._connections.pop(conn.number, None)
                self._threads.pop(conn.number, None)

    def _answer(self, conn: _Connection, payload: bytes) -> bytes | None:
        """The reply frame to one request frame (None for a heartbeat); never raises."""
        request_id = None
        try:
            request_id, request = decode_request(payload)
            if conn.client is None and not isinstance(request, (Hello, Heartbeat)):
                raise AgentRejected(AgentErrorCode.HELLO_FIRST, "send hello first", request_id)
            reply = self._handlers[type(request)](conn, request)
            return None if reply is None else encode_reply(request_id, reply)
        except AgentRejected as e:
            rid = e.request_id if e.request_id is not None else request_id
            return encode_error(rid, e.code, e.message, e.holder_pid)
        except Exception as e:
            logger.exception("answering %s failed", conn.who())
            return encode_error(request_id, AgentErrorCode.INTERNAL, f"the agent failed: {type(e).__name__}: {e}")

    def _hello(self, conn: _Connection, request: Hello) -> Welcome:
        conn.client, conn.client_pid = request.client, request.pid
        logger.debug("connection %d: %s", conn.number, conn.who())
        timeout = self.config.timeout_s
        return Welcome(
            agent_pid=os.getpid(),
            heartbeat_s=timeout / HEARTBEATS_PER_TIMEOUT,
            timeout_s=timeout,
            backend=self.backend,
            sim_dir=self.sim_dir,
            uuids=tuple(self._gpus),
        )

    def _gpu(self, uuid: str) -> GPU:
        gpu = self._gpus.get(uuid)
        if gpu is None:
            served = ", ".join(f"{g.index}: {u}" for u, g in list(self._gpus.items())[:16])
            raise AgentRejected(
                AgentErrorCode.UNKNOWN_GPU,
                f"this agent serves no GPU {uuid} (it serves {served}); is the agent running with the backend and "
                "GPUs this process uses (PERSEUS_GPU)?",
            )
        return gpu

    def _acquire(self, conn: _Connection, request: Acquire) -> Granted:
        gpus = [(uuid, self._gpu(uuid).index) for uuid in request.uuids]
        holder = conn.holder()
        revoked = [uuid for uuid in request.uuids if self.leases.was_revoked(uuid, holder)]
        if revoked:
            raise AgentRejected(
                AgentErrorCode.FORBIDDEN,
                f"an administrator revoked this process's lease on GPU {self._gpus[revoked[0]].index} ({revoked[0]})",
            )
        try:
            granted = self.leases.acquire(conn.number, holder, gpus)
        except LeaseConflict as e:
            held = e.lease
            raise AgentRejected(
                AgentErrorCode.HELD,
                f"GPU {held.index} ({held.uuid}) is leased to {held.holder.describe()} for "
                f"{time.time() - held.holder.since:.0f} s; one process controls a GPU at a time: end that process, "
                f"or as root run `perseus agent revoke --gpu-index {held.index}`",
                holder_pid=held.holder.pid,
            ) from None
        for lease in granted:
            logger.info("GPU %d (%s) leased to %s", lease.index, lease.uuid, conn.who())
        return Granted(request.uuids)

    def _write(self, conn: _Connection, request: Write) -> Done:
        gpu = self._gpu(request.uuid)
        if not self.leases.holds(conn.number, request.uuid):
            if self.leases.was_revoked(request.uuid, conn.holder()):
                raise AgentRejected(
                    AgentErrorCode.NOT_LEASED,
                    f"an administrator revoked this process's lease on GPU {gpu.index} ({request.uuid})",
                )
            held = self.leases.lease(request.uuid)
            whose = "" if held is None else f"; it is leased to {held.holder.describe()}"
            raise AgentRejected(
                AgentErrorCode.NOT_LEASED,
                f"this process holds no lease on GPU {gpu.index} ({request.uuid}){whose}: acquire it first",
            )
        try:
            with self._gpu_locks[request.uuid]:
                if request.setting == SM_CLOCK:
                    if request.value is None:
                        gpu.reset_sm_clock()
                    else:
                        gpu.lock_sm_clock(request.value)
                elif request.value is None:
                    gpu.reset_power_limit()
                else:
                    gpu.set_power_limit_mw(request.value)
        except ConfigError as e:
            raise AgentRejected(AgentErrorCode.BAD_VALUE, str(e)) from None
        except DeviceError as e:
            raise AgentRejected(AgentErrorCode.DEVICE, f"GPU {gpu.index} ({request.uuid}): {e}") from None
        return Done()

    def _revoke(self, conn: _Connection, request: Revoke) -> Revoked:
        if conn.peer.uid not in self.config.admin_uids:
            raise AgentRejected(
                AgentErrorCode.FORBIDDEN,
                f"only root or the agent's user (uid {os.geteuid()}) may revoke leases; this is uid {conn.peer.uid}",
            )
        for uuid in request.uuids:
            self._gpu(uuid)
        ended = self.leases.revoke(list(request.uuids))
        for lease in ended:
            self._restore(lease, f"lease revoked by {conn.who()}", logging.WARNING)
        return Revoked(tuple(lease.uuid for lease in ended))

    def status(self, asking: _Connection | None = None) -> AgentStatus:
        gpus = []
        for uuid, gpu in self._gpus.items():
            lease = self.leases.lease(uuid)
            errors: list[str] = []
            gpus.append(
                GPUState(
                    index=gpu.index,
                    uuid=uuid,
                    name=_read_or(gpu.name, "?", errors)[:200],
                    sm_clock_mhz=_read_or(gpu.sm_clock, None, errors),
                    max_mhz=_read_or(gpu.max_frequency, None, errors),
                    power_limit_mw=_read_or(gpu.power_limit_mw, None, errors),
                    default_power_limit_mw=_read_or(gpu.default_power_limit_mw, None, errors),
                    holder=None if lease is None else lease.holder,
                    yours=lease is not None and asking is not None and lease.connection == asking.number,
                    error="; ".join(errors)[:2000] or None,
                )
            )
        with self._conn_lock:
            connections = len(self._connections) - (asking is not None and asking.number in self._connections)
        return AgentStatus(agent_pid=os.getpid(), connections=connections, gpus=tuple(gpus))


def _read_or(read: Callable[[], T], fallback: F, errors: list[str] | None = None) -> T | F:
    """`read()`, or `fallback` when it fails (the error's text added to `errors`)."""
    try:
        return read()
    except Exception as e:
        if errors is not None:
            errors.append(str(e))
        return fallback


def notify_systemd(state: str) -> None:
    """Tell systemd (Type=notify) our state, e.g. READY=1; nothing outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as e:
            logger.warning("could not notify systemd at %s (%s)", os.environ.get("NOTIFY_SOCKET"), e)
