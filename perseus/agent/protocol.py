"""The agent's wire protocol: length-prefixed msgpack maps on a Unix stream socket (never pickle).

A frame is a 4-byte big-endian length, then that many bytes holding one msgpack map. A request is
`{"v": 2, "id": N, "type": T, ...fields}`; its reply `{"v": 2, "id": N, "ok": true, ...fields}` or
`{"v": 2, "id": N, "ok": false, "error": {"code": C, "message": M}}` (with `holder_pid` when C is
`held`). A `heartbeat` has no reply. Both sides build every message through the classes below,
whose constructors check every field (perseus.wire.fields), so what a client can send is exactly
what the agent accepts. A frame over MAX_FRAME_BYTES cannot be skipped safely: the agent answers
too_large and closes that connection; any other bad frame gets an error reply and the connection
stays usable.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from perseus.exceptions import ConfigError, DeviceError, DevicePermissionError
from perseus.wire.fields import Message, check_bool, check_float, check_int, check_seq, check_str, show
from perseus.wire.limits import MAX_FREQUENCY_MHZ
from perseus.wire.phases import WireName

PROTOCOL_VERSION = 2  # 2: welcome names the GPUs served (backend, simulated GPUs' folder, UUIDs)
MAX_FRAME_BYTES = 64 * 1024
HEADER = struct.Struct(">I")
MAX_ID = 2**63 - 1
MAX_GPUS = 256  # GPUs in one request or one node
MAX_UUID_CHARS = 96
MAX_NAME_CHARS = 200
MAX_PID = 2**31 - 1
MAX_POWER_LIMIT_MW = 10_000_000  # 10 kW: above any GPU's
MAX_MESSAGE_CHARS = 2000  # an error reply's text
MAX_PATH_CHARS = 4096
BACKENDS = ("nvml", "amd", "sim", "mixed")

SM_CLOCK = "sm_clock"
POWER_LIMIT = "power_limit"
SETTINGS = (SM_CLOCK, POWER_LIMIT)


class AgentErrorCode(WireName):
    """Why the agent refused a request (`error.code` of an error reply)."""

    BAD_FRAME = "bad_frame"  # not one msgpack map
    BAD_VERSION = "bad_version"
    BAD_FIELD = "bad_field"  # a field missing, unknown, of the wrong type or out of range
    TOO_LARGE = "too_large"  # over MAX_FRAME_BYTES: the connection is closed
    UNKNOWN_TYPE = "unknown_type"
    HELLO_FIRST = "hello_first"  # a request before `hello`
    UNKNOWN_GPU = "unknown_gpu"  # no GPU with that UUID on this node's agent
    HELD = "held"  # leased to another process (holder_pid names it)
    NOT_LEASED = "not_leased"  # a write to a GPU this connection holds no lease on (revoked)
    FORBIDDEN = "forbidden"  # an administrator's request from another user
    BAD_VALUE = "bad_value"  # a clock or power limit the GPU does not accept
    DEVICE = "device"  # the GPU call failed
    BUSY = "busy"  # too many connections
    INTERNAL = "internal"


class AgentError(DeviceError):
    """The agent refused a request, or could not be reached; `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LeaseHeldError(AgentError):
    """Another process holds the GPU's lease; `holder_pid` is its pid (as the agent sees it)."""

    def __init__(self, message: str, holder_pid: int | None) -> None:
        super().__init__(AgentErrorCode.HELD.value, message)
        self.holder_pid = holder_pid


def check_uuid(value: Any, name: str) -> str:
    return check_str(value, name, MAX_UUID_CHARS, min_len=1)


def check_uuids(value: Any, name: str) -> tuple[str, ...]:
    uuids = tuple(check_uuid(u, f"{name}[{i}]") for i, u in enumerate(check_seq(value, name, MAX_GPUS, min_len=1)))
    if len(set(uuids)) != len(uuids):
        raise ConfigError(f"{name} lists a GPU twice; list each GPU's UUID once")
    return uuids


def check_optional_int(value: Any, name: str, lo: int, hi: int) -> int | None:
    return None if value is None else check_int(value, name, lo, hi)


def _set(obj: object, **values: Any) -> None:
    for key, value in values.items():
        object.__setattr__(obj, key, value)


# Requests and their replies


@dataclass(frozen=True)
class Hello(Message):
    """The first request on a connection: who the client says it is (its pid in its own pid namespace)."""

    TYPE: ClassVar[str] = "hello"
    client: str
    pid: int

    def __post_init__(self) -> None:
        check_str(self.client, "hello.client", MAX_NAME_CHARS)
        check_int(self.pid, "hello.pid", 0, MAX_PID)


@dataclass(frozen=True)
class Welcome(Message):
    """The reply to hello: how often to speak, and which GPUs the agent serves, so that a client
    can check it reads the very GPUs the agent writes (for simulated ones: the same state folder)."""

    agent_pid: int
    heartbeat_s: float  # send something at least this often
    timeout_s: float  # silence this long ends the connection and its leases
    backend: str  # the agent's GPUs: "nvml", "amd", "sim" or "mixed"
    sim_dir: str | None  # the state folder of its simulated GPUs (None: it serves none)
    uuids: tuple[str, ...]

    def __post_init__(self) -> None:
        check_int(self.agent_pid, "welcome.agent_pid", 0, MAX_PID)
        check_float(self.heartbeat_s, "welcome.heartbeat_s", 0.0, 3600.0, open_lo=True)
        check_float(self.timeout_s, "welcome.timeout_s", 0.0, 3600.0, open_lo=True)
        check_str(self.backend, "welcome.backend", 16, choices=BACKENDS)
        if self.sim_dir is not None:
            check_str(self.sim_dir, "welcome.sim_dir", MAX_PATH_CHARS, min_len=1)
        uuids = check_seq(self.uuids, "welcome.uuids", MAX_GPUS)
        _set(self, uuids=tuple(check_uuid(u, f"welcome.uuids[{i}]") for i, u in enumerate(uuids)))


@dataclass(frozen=True)
class Acquire(Message):
    """Lease these GPUs to this connection (all or none)."""

    TYPE: ClassVar[str] = "acquire"
    uuids: tuple[str, ...]

    def __post_init__(self) -> None:
        _set(self, uuids=check_uuids(self.uuids, "acquire.uuids"))


@dataclass(frozen=True)
class Granted(Message):
    uuids: tuple[str, ...]

    def __post_init__(self) -> None:
        _set(self, uuids=check_uuids(self.uuids, "granted.uuids"))


@dataclass(frozen=True)
class Write(Message):
    """Set one GPU's SM clock (MHz) or power limit (mW); value None restores the default."""

    TYPE: ClassVar[str] = "write"
    uuid: str
    setting: str
    value: int | None

    def __post_init__(self) -> None:
        check_uuid(self.uuid, "write.uuid")
        check_str(self.setting, "write.setting", 16, choices=SETTINGS)
        top = MAX_FREQUENCY_MHZ if self.setting == SM_CLOCK else MAX_POWER_LIMIT_MW
        check_optional_int(self.value, f"write.value ({self.setting})", 1, top)


@dataclass(frozen=True)
class Done(Message):
    pass


@dataclass(frozen=True)
class Heartbeat(Message):
    """I am alive (no reply). Any request counts as one too."""

    TYPE: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class Revoke(Message):
    """End other processes' leases on these GPUs and restore their defaults (root or the agent's user only)."""

    TYPE: ClassVar[str] = "revoke"
    uuids: tuple[str, ...]

    def __post_init__(self) -> None:
        _set(self, uuids=check_uuids(self.uuids, "revoke.uuids"))


@dataclass(frozen=True)
class Revoked(Message):
    uuids: tuple[str, ...]  # those whose lease ended (the others were free)

    def __post_init__(self) -> None:
        _set(
            self,
            uuids=tuple(
                check_uuid(u, f"revoked.uuids[{i}]")
                for i, u in enumerate(check_seq(self.uuids, "revoked.uuids", MAX_GPUS))
            ),
        )


@dataclass(frozen=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status"


@dataclass(frozen=True)
class Holder(Message):
    """Who holds a lease: the peer's credentials from the socket, what it calls itself, since when."""

    pid: int  # SO_PEERCRED, in the agent's pid namespace (0: not visible from it)
    uid: int
    gid: int
    client: str
    client_pid: int  # the pid the client reported, in its own pid namespace
    since: float  # unix time of the grant

    def __post_init__(self) -> None:
        for name in ("pid", "client_pid"):
            check_int(getattr(self, name), f"holder.{name}", 0, MAX_PID)
        for name in ("uid", "gid"):
            check_int(getattr(self, name), f"holder.{name}", 0, 2**32 - 1)
        check_str(self.client, "holder.client", MAX_NAME_CHARS)
        check_float(self.since, "holder.since", 0.0, 1e11)

    def describe(self) -> str:
        """For messages: `pid 1234 (uid 1000, 'python train.py')`, with the client's own pid if it differs."""
        own = f", pid {self.client_pid} in its container" if self.client_pid != self.pid else ""
        return f"pid {self.pid} (uid {self.uid}{own}, {self.client!r})"


@dataclass(frozen=True)
class GPUState(Message):
    index: int  # the agent's index
    uuid: str
    name: str
    sm_clock_mhz: int | None  # None: unreadable (`error` says why)
    max_mhz: int | None
    power_limit_mw: int | None
    default_power_limit_mw: int | None
    holder: Holder | None
    yours: bool  # leased to the connection that asked
    error: str | None = None

    def __post_init__(self) -> None:
        check_int(self.index, "gpu.index", 0, MAX_GPUS)
        check_uuid(self.uuid, "gpu.uuid")
        check_str(self.name, "gpu.name", MAX_NAME_CHARS)
        for name in ("sm_clock_mhz", "max_mhz"):
            check_optional_int(getattr(self, name), f"gpu.{name}", 0, MAX_FREQUENCY_MHZ)
        for name in ("power_limit_mw", "default_power_limit_mw"):
            check_optional_int(getattr(self, name), f"gpu.{name}", 0, MAX_POWER_LIMIT_MW)
        if isinstance(self.holder, dict):
            _set(self, holder=Holder.from_wire(self.holder))
        elif self.holder is not None and not isinstance(self.holder, Holder):
            raise ConfigError(f"gpu.holder must be a map or nil, got {show(self.holder)}")
        check_bool(self.yours, "gpu.yours")
        if self.error is not None:
            check_str(self.error, "gpu.error", MAX_MESSAGE_CHARS, printable=False)

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        doc["holder"] = None if self.holder is None else self.holder.to_wire()
        return doc


@dataclass(frozen=True)
class AgentStatus(Message):
    agent_pid: int
    connections: int  # clients connected, the one asking not counted
    gpus: tuple[GPUState, ...]

    def __post_init__(self) -> None:
        check_int(self.agent_pid, "status.agent_pid", 0, MAX_PID)
        check_int(self.connections, "status.connections", 0, 1 << 20)
        gpus = check_seq(self.gpus, "status.gpus", MAX_GPUS)
        _set(self, gpus=tuple(g if isinstance(g, GPUState) else GPUState.from_wire(g) for g in gpus))

    def to_wire(self) -> dict[str, Any]:
        return {"agent_pid": self.agent_pid, "connections": self.connections, "gpus": [g.to_wire() for g in self.gpus]}

    def gpu(self, uuid: str) -> GPUState | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


#: request type -> (request class, reply class; None: no reply)
REQUESTS: dict[str, tuple[type[Message], type[Message] | None]] = {
    Hello.TYPE: (Hello, Welcome),
    Acquire.TYPE: (Acquire, Granted),
    Write.TYPE: (Write, Done),
    Heartbeat.TYPE: (Heartbeat, None),
    Revoke.TYPE: (Revoke, Revoked),
    StatusRequest.TYPE: (StatusRequest, AgentStatus),
}


# Frames


class AgentRejected(Exception):
    """A request the agent answers with an error; `request_id` is None when it could not be read."""

    def __init__(
        self, code: AgentErrorCode, message: str, request_id: int | None = None, holder_pid: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.holder_pid = holder_pid  # with HELD: the pid of the lease's holder


def _frame(doc: dict[str, Any]) -> bytes:
    payload = msgpack.packb(doc, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _unpack(payload: bytes) -> Any:
    # Limits keep a hostile frame from costing more than its size: no strings, arrays or maps
    # longer than a frame could honestly carry.
    return msgpack.unpackb(
        payload,
        raw=False,
        ext_hook=_reject_ext,
        strict_map_key=True,
        max_str_len=MAX_FRAME_BYTES,
        max_bin_len=MAX_FRAME_BYTES,
        max_array_len=MAX_GPUS * 4,
        max_map_len=64,
        max_ext_len=0,
    )


def encode_request(request_id: int, message: Message) -> bytes:
    return _frame({"v": PROTOCOL_VERSION, "id": request_id, "type": message.TYPE, **message.to_wire()})


def encode_reply(request_id: int | None, message: Message) -> bytes:
    return _frame({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **message.to_wire()})


def encode_error(request_id: int | None, code: AgentErrorCode, message: str, holder_pid: int | None = None) -> bytes:
    error: dict[str, Any] = {"code": code.value, "message": message[:MAX_MESSAGE_CHARS]}
    if holder_pid is not None:
        error["holder_pid"] = holder_pid
    return _frame({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": error})


def decode_request(payload: bytes) -> tuple[int, Message]:
    """(request id, checked request) from one frame's payload, or AgentRejected saying what is wrong."""
    try:
        doc = _unpack(payload)
    except Exception as e:
        raise AgentRejected(
            AgentErrorCode.BAD_FRAME, f"frame is not one msgpack map ({type(e).__name__}: {show(str(e))})"
        ) from None
    if not isinstance(doc, dict):
        raise AgentRejected(AgentErrorCode.BAD_FRAME, f"frame holds a msgpack {type(doc).__name__}, not a map")
    request_id = doc.pop("id", None)
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= MAX_ID:
        raise AgentRejected(AgentErrorCode.BAD_FIELD, f"id must be an integer in [0, {MAX_ID}], got {show(request_id)}")
    version = doc.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise AgentRejected(
            AgentErrorCode.BAD_VERSION,
            f"protocol version {show(version)} is not supported; this agent speaks v{PROTOCOL_VERSION} "
            "(run the same perseus release in training and in the agent)",
            request_id,
        )
    kind = doc.pop("type", None)
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise AgentRejected(
            AgentErrorCode.UNKNOWN_TYPE, f"unknown request type {show(kind)}; known: {', '.join(REQUESTS)}", request_id
        )
    try:
        return request_id, REQUESTS[kind][0].from_wire(doc)
    except (ConfigError, TypeError) as e:
        raise AgentRejected(AgentErrorCode.BAD_FIELD, str(e), request_id) from None


def decode_reply(payload: bytes, request_id: int, reply: type[Message], where: str) -> Any:
    """The checked `reply` to request `request_id`, or the error the agent answered, raised as
    AgentError (LeaseHeldError, ConfigError for a refused value, DevicePermissionError)."""
    try:
        doc = _unpack(payload)
    except Exception as e:
        raise AgentError(AgentErrorCode.BAD_FRAME.value, f"{where} sent a reply that is not msgpack ({e})") from None
    if not isinstance(doc, dict) or doc.pop("v", None) != PROTOCOL_VERSION or not isinstance(doc.get("ok"), bool):
        raise AgentError(AgentErrorCode.BAD_VERSION.value, f"{where} sent no protocol v{PROTOCOL_VERSION} reply")
    answered = doc.pop("id", None)
    if doc.pop("ok"):
        if answered != request_id:
            raise AgentError(AgentErrorCode.BAD_FRAME.value, f"{where} answered another request than {request_id}")
        try:
            return reply.from_wire(doc)
        except (ConfigError, TypeError) as e:
            raise AgentError(AgentErrorCode.BAD_FIELD.value, f"{where} sent a malformed reply: {e}") from None
    error = doc.get("error")
    if (
        not isinstance(error, dict)
        or not isinstance(error.get("code"), str)
        or not isinstance(error.get("message"), str)
    ):
        raise AgentError(AgentErrorCode.BAD_FRAME.value, f"{where} sent an error reply without a code and message")
    if answered not in (request_id, None):  # None: an error about the connection itself (too large, busy)
        raise AgentError(AgentErrorCode.BAD_FRAME.value, f"{where} answered another request than {request_id}")
    code, message = error["code"], f"{where}: {error['message']}"
    if code == AgentErrorCode.HELD.value:
        holder = error.get("holder_pid")
        raise LeaseHeldError(message, holder if isinstance(holder, int) and not isinstance(holder, bool) else None)
    if code == AgentErrorCode.BAD_VALUE.value:
        raise ConfigError(message)
    if code == AgentErrorCode.FORBIDDEN.value:
        raise DevicePermissionError(message)
    raise AgentError(code, message)


class FrameTooLarge(Exception):
    """A frame header announced more than MAX_FRAME_BYTES."""


def recv_frame(sock: socket.socket, buffer: bytearray) -> bytes | None:
    """The next frame's payload from `sock` (blocking, under the socket's timeout), keeping bytes
    of later frames in `buffer`. None at a clean end of stream; ConnectionError at an end inside
    a frame; FrameTooLarge for a header over the limit."""
    while True:
        if len(buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer)
            if size > MAX_FRAME_BYTES:
                raise FrameTooLarge(f"a frame of {size} bytes; the limit is {MAX_FRAME_BYTES}")
            end = HEADER.size + size
            if len(buffer) >= end:
                payload = bytes(buffer[HEADER.size : end])
                del buffer[:end]
                return payload
        chunk = sock.recv(MAX_FRAME_BYTES + HEADER.size)
        if not chunk:
            if buffer:
                raise ConnectionError(f"the peer closed the connection inside a frame ({len(buffer)} bytes read)")
            return None
        buffer += chunk
