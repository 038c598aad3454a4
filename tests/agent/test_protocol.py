"""The agent's frames and messages: every field checked, errors named, frames bounded."""

from __future__ import annotations

import socket

import msgpack
import pytest

from perseus.agent.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    POWER_LIMIT,
    SM_CLOCK,
    Acquire,
    AgentError,
    AgentErrorCode,
    AgentRejected,
    AgentStatus,
    Done,
    FrameTooLarge,
    GPUState,
    Granted,
    Hello,
    Holder,
    LeaseHeldError,
    Write,
    decode_reply,
    decode_request,
    encode_error,
    encode_reply,
    encode_request,
    recv_frame,
)
from perseus.exceptions import ConfigError, DevicePermissionError

HOLDER = Holder(pid=10, uid=1000, gid=1000, client="python train.py", client_pid=1, since=1.7e9)


def payload(frame: bytes) -> bytes:
    (size,) = HEADER.unpack_from(frame)
    assert len(frame) == HEADER.size + size
    return frame[HEADER.size :]


def raw(doc) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


@pytest.mark.parametrize(
    "message",
    [
        Hello("python train.py", 123),
        Acquire(("GPU-a", "GPU-b")),
        Write("GPU-a", SM_CLOCK, 1410),
        Write("GPU-a", POWER_LIMIT, 250_000),
        Write("GPU-a", SM_CLOCK, None),
    ],
)
def test_requests_round_trip(message):
    request_id, decoded = decode_request(payload(encode_request(7, message)))
    assert request_id == 7 and decoded == message


def test_a_status_round_trips_with_its_holders():
    status = AgentStatus(
        agent_pid=1,
        connections=2,
        gpus=(
            GPUState(0, "GPU-a", "A100", 1410, 1410, 400_000, 400_000, None, False),
            GPUState(1, "GPU-b", "A100", None, 1410, 250_000, 400_000, HOLDER, True, "sm clock: unreadable"),
        ),
    )
    assert decode_reply(payload(encode_reply(3, status)), 3, AgentStatus, "agent") == status


@pytest.mark.parametrize(
    ("doc", "code", "words"),
    [
        ({"v": 2, "id": 1, "type": "hello", "client": "x"}, "bad_field", "missing field(s) pid"),
        ({"v": 2, "id": 1, "type": "hello", "client": "x", "pid": 1, "extra": 2}, "bad_field", "unknown field"),
        ({"v": 2, "id": 1, "type": "hello", "client": "x\n", "pid": 1}, "bad_field", "printable"),
        ({"v": 2, "id": 1, "type": "hello", "client": "x", "pid": True}, "bad_field", "hello.pid"),
        ({"v": 2, "id": 1, "type": "acquire", "uuids": []}, "bad_field", "acquire.uuids"),
        ({"v": 2, "id": 1, "type": "acquire", "uuids": ["a", "a"]}, "bad_field", "lists a GPU twice"),
        ({"v": 2, "id": 1, "type": "acquire", "uuids": "GPU-a"}, "bad_field", "acquire.uuids"),
        ({"v": 2, "id": 1, "type": "write", "uuid": "a", "setting": "fan", "value": 1}, "bad_field", "one of"),
        (
            {"v": 2, "id": 1, "type": "write", "uuid": "a", "setting": "sm_clock", "value": 0},
            "bad_field",
            "write.value",
        ),
        ({"v": 2, "id": 1, "type": "write", "uuid": "a", "setting": "sm_clock", "value": 1.5}, "bad_field", "value"),
        (
            {"v": 2, "id": 1, "type": "write", "uuid": "a", "setting": "power_limit", "value": 2**40},
            "bad_field",
            "limit",
        ),
        ({"v": 3, "id": 1, "type": "hello"}, "bad_version", "this agent speaks v2"),
        ({"v": 2, "id": -1, "type": "hello"}, "bad_field", "id must be"),
        ({"v": 2, "id": 1, "type": "pickle"}, "unknown_type", "known: hello"),
        ({"v": 2, "id": 1}, "unknown_type", "unknown request type"),
    ],
)
def test_bad_requests_are_named(doc, code, words):
    with pytest.raises(AgentRejected) as rejected:
        decode_request(raw(doc))
    assert rejected.value.code.value == code
    assert words in rejected.value.message


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01\x02\x03", raw([1, 2]), raw("hello"), b"\x81\xa1v\x01" + b"\x00" * 9, b"\xd4\x01\x00"],
)
def test_frames_that_are_no_map_are_refused(data):
    with pytest.raises(AgentRejected) as rejected:
        decode_request(data)
    assert rejected.value.code in (AgentErrorCode.BAD_FRAME, AgentErrorCode.BAD_FIELD)


def test_a_frame_cannot_declare_more_than_it_holds():
    """msgpack lengths are capped: a frame declaring a billion-item array costs nothing."""
    with pytest.raises(AgentRejected, match="not one msgpack map"):
        decode_request(b"\xdd\x3b\x9a\xca\x00")


def test_error_replies_become_the_errors_a_caller_expects():
    def error(code: AgentErrorCode, holder: int | None = None):
        frame = payload(encode_error(5, code, "why", holder))
        decode_reply(frame, 5, Done, "the agent")

    with pytest.raises(LeaseHeldError, match="the agent: why") as held:
        error(AgentErrorCode.HELD, 4242)
    assert held.value.holder_pid == 4242
    with pytest.raises(ConfigError, match="why"):
        error(AgentErrorCode.BAD_VALUE)
    with pytest.raises(DevicePermissionError, match="why"):
        error(AgentErrorCode.FORBIDDEN)
    with pytest.raises(AgentError) as other:
        error(AgentErrorCode.NOT_LEASED)
    assert other.value.code == "not_leased"


def test_replies_must_answer_the_request_and_be_well_formed():
    with pytest.raises(AgentError, match="answered another request"):
        decode_reply(payload(encode_reply(4, Done())), 5, Done, "agent")
    with pytest.raises(AgentError, match="malformed reply"):
        decode_reply(raw({"v": 2, "id": 1, "ok": True, "uuids": [1]}), 1, Granted, "agent")
    with pytest.raises(AgentError, match="no protocol v2 reply"):
        decode_reply(raw({"id": 1, "ok": True}), 1, Done, "agent")
    # an error about the connection itself carries no id
    with pytest.raises(AgentError, match="busy"):
        decode_reply(payload(encode_error(None, AgentErrorCode.BUSY, "busy")), 9, Done, "agent")


def test_frames_arrive_whole_however_the_bytes_are_split():
    a, b = socket.socketpair()
    try:
        frames = encode_request(1, Hello("x", 1)) + encode_request(2, Acquire(("GPU-a",)))
        for i in range(len(frames)):  # one byte at a time
            a.sendall(frames[i : i + 1])
        a.close()
        buffer = bytearray()
        assert decode_request(recv_frame(b, buffer))[0] == 1
        assert decode_request(recv_frame(b, buffer))[0] == 2
        assert recv_frame(b, buffer) is None
    finally:
        b.close()


def test_oversized_and_truncated_frames():
    a, b = socket.socketpair()
    try:
        a.sendall(HEADER.pack(MAX_FRAME_BYTES + 1))
        with pytest.raises(FrameTooLarge):
            recv_frame(b, bytearray())
        a.sendall(HEADER.pack(10) + b"abc")
        a.close()
        with pytest.raises(ConnectionError, match="inside a frame"):
            recv_frame(b, bytearray())
    finally:
        b.close()


def test_holders_describe_themselves():
    assert HOLDER.describe() == "pid 10 (uid 1000, pid 1 in its container, 'python train.py')"
    same = Holder(pid=10, uid=0, gid=0, client="x", client_pid=10, since=0.0)
    assert same.describe() == "pid 10 (uid 0, 'x')"
