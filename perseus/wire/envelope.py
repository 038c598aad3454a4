"""Framing of the wire protocol: one msgpack map per ZeroMQ frame (never pickle).

A request is `{"v": 1, "id": <int>, "type": <str>, ...fields}`; its reply is
`{"v": 1, "id": <same>, "ok": true, ...fields}` or
`{"v": 1, "id": <same>, "ok": false, "error": {"code": <ErrorCode>, "message": <str>}}`.
The fields are a message's (`perseus.wire.messages`); the service and the client use the same
classes, so what a rank can build is exactly what the service accepts. Frames over
`MAX_MESSAGE_BYTES` are refused (too_large); zmq drops a peer past `HARD_MESSAGE_BYTES`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from perseus.exceptions import ConfigError, ProfileError, ServiceError
from perseus.wire.fields import Message, show
from perseus.wire.limits import MAX_ID, MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from perseus.wire.messages import REQUESTS
from perseus.wire.phases import WireName


class ErrorCode(WireName):
    """Why the service refused a request (`error.code` of an error reply)."""

    BAD_FRAME = "bad_frame"  # not one msgpack map in one frame
    BAD_VERSION = "bad_version"  # missing or other protocol version
    BAD_FIELD = "bad_field"  # a field is missing, unknown, of the wrong type or out of range
    TOO_LARGE = "too_large"  # over MAX_MESSAGE_BYTES
    UNKNOWN_JOB = "unknown_job"
    UNKNOWN_RANK = "unknown_rank"
    UNKNOWN_TYPE = "unknown_type"
    NOT_READY = "not_ready"  # the job's schedule is still being built, or its state could not be saved: retry shortly
    OVER_BUDGET = "over_budget"  # the service's job, memory or planning budget would be exceeded
    UNAUTHORIZED = "unauthorized"  # the client's CURVE key was revoked
    INTERNAL = "internal"


class RequestRejected(ServiceError):
    """A request the service cannot act on; `request_id` is None when it could not be read."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None) -> None:
        super().__init__(code.value, message)
        self.request_id = request_id


def _pack(doc: dict[str, Any]) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def _unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, ext_hook=_reject_ext, strict_map_key=True)


def encode_request(request_id: int, message: Message) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "type": message.TYPE, **message.to_wire()})


def encode_reply(request_id: int | None, message: Message) -> bytes:
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **message.to_wire()})


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    return _pack(
        {"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code.value, "message": message}}
    )


def decode_request(payload: bytes) -> tuple[int, Message]:
    """(request id, validated request) from one frame, or RequestRejected saying what is wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise RequestRejected(
            ErrorCode.TOO_LARGE,
            f"message is {len(payload)} bytes; the limit is {MAX_MESSAGE_BYTES} bytes (upload one stage's profile per "
            "message)",
        )
    try:
        doc = _unpack(payload)
    except Exception as e:
        raise RequestRejected(
            ErrorCode.BAD_FRAME, f"frame is not one msgpack map ({type(e).__name__}: {e}); send msgpack, never pickle"
        ) from None
    if not isinstance(doc, dict):
        raise RequestRejected(
            ErrorCode.BAD_FRAME,
            f"frame holds a msgpack {type(doc).__name__}, not a map; send {{'v': {PROTOCOL_VERSION}, 'id': ..., "
            "'type': ..., ...}",
        )
    request_id = doc.pop("id", None)
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= MAX_ID:
        raise RequestRejected(ErrorCode.BAD_FIELD, f"id must be an integer in [0, {MAX_ID}], got {show(request_id)}")
    version = doc.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # not True, not 1.0
        raise RequestRejected(
            ErrorCode.BAD_VERSION,
            f"protocol version {show(version)} is not supported; this service speaks v{PROTOCOL_VERSION} "
            "(upgrade perseus on the ranks and the service to the same release)",
            request_id,
        )
    kind = doc.pop("type", None)
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise RequestRejected(
            ErrorCode.UNKNOWN_TYPE, f"unknown request type {show(kind)}; known: {', '.join(REQUESTS)}", request_id
        )
    try:
        return request_id, REQUESTS[kind][0].from_wire(doc)
    except (ConfigError, ProfileError) as e:
        raise RequestRejected(ErrorCode.BAD_FIELD, str(e), request_id) from None


def decode_reply(payload: bytes) -> tuple[int | None, dict[str, Any] | ServiceError]:
    """(request id, reply fields) or (request id, the ServiceError it carries). Raises
    ProtocolError (a ServiceError) when the frame is not a reply of this protocol."""
    try:
        doc = _unpack(payload)
    except Exception as e:
        raise ServiceError(ErrorCode.BAD_FRAME.value, f"reply is not msgpack ({e})") from None
    if not isinstance(doc, dict) or doc.pop("v", None) != PROTOCOL_VERSION or not isinstance(doc.get("ok"), bool):
        raise ServiceError(
            ErrorCode.BAD_VERSION.value, f"reply is not a protocol v{PROTOCOL_VERSION} reply: {show(doc)}"
        )
    request_id = doc.pop("id", None)
    if not doc.pop("ok"):
        error = doc.get("error")
        if (
            not isinstance(error, dict)
            or not isinstance(error.get("code"), str)
            or not isinstance(error.get("message"), str)
        ):
            raise ServiceError(ErrorCode.BAD_FRAME.value, f"error reply without a code and message: {show(doc)}")
        return request_id, ServiceError(error["code"], error["message"])
    return request_id, doc
