"""The service's ZeroMQ ROUTER socket: binding it (refusing to listen unauthenticated off this
machine unless told to), and the loop that hands each request to the service and sends its reply.

Peers: one that has not finished its handshake in HANDSHAKE_MS, or stops answering ZeroMQ
heartbeats for HEARTBEAT_TIMEOUT_MS, is dropped, so idle or half-open connections do not pile
up; replies queued to a peer that does not read them are bounded by REPLY_QUEUE. A client whose
CURVE key was revoked after its handshake gets one `unauthorized` reply and its connection closed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from perseus.exceptions import ConfigError
from perseus.wire.envelope import ErrorCode, RequestRejected, decode_request, encode_error
from perseus.wire.limits import DEFAULT_ADDRESS, HARD_MESSAGE_BYTES
from perseus.wire.security import Security, drop_connection, is_local_endpoint, peer_key

log = logging.getLogger(__name__)

POLL_MS = 50  # how often the loop checks for a stop request and tends the service
MAX_BATCH = 1000  # requests answered per poll before the service is tended again
HANDSHAKE_MS = 5_000
HEARTBEAT_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 30_000
REPLY_QUEUE = 100
FILE_LIMIT = 65_536  # open files wanted: each peer holds one; the soft limit is raised towards it


class Transport:
    """The ROUTER socket on `address`, secured by `security` (closed with it)."""

    def __init__(self, address: str, security: Security, *, insecure: bool = False) -> None:
        self.address = address
        self.security = security
        self.insecure = insecure
        self.endpoint: str | None = None
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None

    @property
    def bound(self) -> bool:
        return self._socket is not None

    def bind(self) -> str:
        """Bind the ROUTER (tcp://host:0 picks a free port); returns the endpoint, with the real port."""
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
                hint = (
                    f"--bind takes a ZeroMQ endpoint on this machine, such as {DEFAULT_ADDRESS} "
                    "or tcp://127.0.0.1:0 (a free port)"
                )
            # zmq.strerror, not e.strerror: pyzmq's bind appends " (addr=...)" to the latter. errno is
            # typed Optional but always set by then (ZMQError falls back to zmq_errno()).
            reason = zmq.strerror(e.errno) if e.errno is not None else str(e)
            raise ConfigError(f"cannot bind {self.address}: {reason}; {hint}") from None
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if not is_local_endpoint(endpoint) and not self.security.authenticated:
            if not self.insecure:
                sock.close(linger=0)
                raise ConfigError(
                    f"refusing to listen on {endpoint} without authentication: anyone who can reach it could change "
                    "your GPUs' clocks. Create keys with `perseus keys` and pass --curve-keys DIR, bind a loopback "
                    "address, or pass --insecure on a trusted network"
                )
            log.warning(
                "\n%s\nWARNING: the planner service listens on %s, reachable from other machines, WITHOUT "
                "authentication (--insecure).\n"
                "Anyone who can reach this port can register jobs and change the GPU clocks of your ranks.\n"
                "Use --curve-keys DIR (see `perseus keys`) or bind a loopback address unless this network is "
                "trusted.\n%s",
                "!" * 100,
                endpoint,
                "!" * 100,
            )
        self._socket = sock
        self.endpoint = endpoint
        return endpoint

    def serve(
        self, handle: Callable[[list[bytes]], list[bytes]], tend: Callable[[], None], stop: threading.Event
    ) -> None:
        """Until `stop` is set: answer each request with `handle` (frames in, frames out), and
        `tend` between batches of requests and at least every POLL_MS."""
        sock = self._socket
        assert sock is not None, "bind() first"
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(POLL_MS):
                for _ in range(MAX_BATCH):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if self.security.authorized(peer_key(frames[-1])):
                        reply = handle([frame.bytes for frame in frames])
                    else:
                        reply = _refuse_revoked(frames)
                    try:
                        sock.send_multipart(reply, zmq.NOBLOCK)
                    except zmq.Again:
                        log.warning("reply to a peer dropped: its queue is full")
            tend()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        self.security.close()
        self._context.term()


def _refuse_revoked(frames: list[zmq.Frame]) -> list[bytes]:
    """The reply to a client whose CURVE key was revoked after its handshake; its connection
    is closed just after the reply goes out."""
    log.warning(
        "refused a request from client key %s: no longer in the accepted keys; closing its connection",
        peer_key(frames[-1]),
    )
    drop_connection(frames[-1])
    request_id: int | None
    try:
        request_id, _ = decode_request(frames[-1].bytes)
    except RequestRejected as e:
        request_id = e.request_id
    message = "this client's CURVE key is no longer accepted by the service (revoked); its connection is being closed"
    return [frames[0].bytes, encode_error(request_id, ErrorCode.UNAUTHORIZED, message)]


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
        log.warning(
            "the open-file limit is %d: each connected rank holds one; raise it (ulimit -n) for large jobs", soft
        )
