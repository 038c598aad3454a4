"""Any bytes from any client: a real agent process takes random, truncated, oversized and
nearly-valid frames on many connections (fixed seed), answers each readable frame, and afterwards
still serves a real client, with no connection left behind and no GPU changed."""

from __future__ import annotations

import random
import socket

import msgpack
from agent_helpers import at_defaults, wait_for

from perseus.agent.client import AgentClient
from perseus.agent.protocol import HEADER, MAX_FRAME_BYTES, SM_CLOCK, StatusRequest, encode_request, recv_frame

SEED = 20240
CONNECTIONS = 60
FRAMES_PER_CONNECTION = 25


def nearly_valid(rng: random.Random, uuid: str) -> dict:
    """A request with one thing wrong (or nothing): the fields a client could get wrong."""
    doc = rng.choice(
        [
            {"v": 2, "id": 1, "type": "hello", "client": "fuzz", "pid": 1},
            {"v": 2, "id": 2, "type": "acquire", "uuids": [uuid]},
            {"v": 2, "id": 3, "type": "write", "uuid": uuid, "setting": "sm_clock", "value": 990},
            {"v": 2, "id": 4, "type": "write", "uuid": uuid, "setting": "power_limit", "value": 250_000},
            {"v": 2, "id": 5, "type": "status"},
            {"v": 2, "id": 6, "type": "revoke", "uuids": [uuid]},
            {"v": 2, "id": 7, "type": "heartbeat"},
        ]
    )
    junk = rng.choice([None, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), True, "", "x" * 5000, "\x1b[31m\n"])
    junk = rng.choice([junk, [], {}, [[[[]]]], b"\x00" * 8])
    key = rng.choice([*doc, "extra"])
    how = rng.randrange(4)
    if how == 0:
        doc[key] = junk
    elif how == 1:
        doc.pop(key, None)
    elif how == 2:
        doc["uuids"] = [uuid] * rng.randrange(0, 600)
    return doc


def fuzz_frame(rng: random.Random, uuid: str) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # random bytes in a well-formed frame
        body = rng.randbytes(rng.randrange(0, 300))
    elif kind == 1:  # random msgpack values
        body = msgpack.packb(rng.choice([1, "s", [1, 2], {"a": 1}, {1: 2}, None, 3.5, b"bin"]))
    elif kind == 2:  # unhashable or deep structures
        body = b"\x81\x91\x01\x01" if rng.random() < 0.5 else b"\x91" * 2000 + b"\x01"
    else:  # nearly valid requests
        body = msgpack.packb(nearly_valid(rng, uuid), use_bin_type=True)
    return HEADER.pack(len(body)) + body


def finish(rng: random.Random, sock: socket.socket) -> None:
    """End the connection one of the ways a broken client does."""
    ending = rng.randrange(4)
    if ending == 0:
        sock.sendall(HEADER.pack(MAX_FRAME_BYTES + rng.randrange(1, 2**20)))  # oversized: the agent hangs up
    elif ending == 1:
        sock.sendall(HEADER.pack(100) + b"half a frame")  # truncated, then closed
    elif ending == 2:
        sock.sendall(rng.randbytes(3))  # not even a header
    sock.close()


def test_the_agent_survives_any_bytes(node):
    agent = node.process("--heartbeat-timeout", "5").start()
    try:
        rng = random.Random(SEED)
        uuid = node.gpu(0).uuid()
        answered = 0
        for _ in range(CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(30)
            sock.connect(node.socket)
            buffer = bytearray()
            for n in range(FRAMES_PER_CONNECTION):
                marker = 10_000 + n  # a valid request after each frame: its reply closes the frame's replies
                sock.sendall(fuzz_frame(rng, uuid) + encode_request(marker, StatusRequest()))
                while True:
                    frame = recv_frame(sock, buffer)
                    if frame is None:
                        break
                    reply = msgpack.unpackb(frame)
                    assert reply["v"] == 2 and isinstance(reply["ok"], bool)
                    answered += 1
                    if reply["id"] == marker:
                        break
                if frame is None:
                    break
            finish(rng, sock)
        assert answered >= CONNECTIONS * FRAMES_PER_CONNECTION
        assert agent.running
        client = AgentClient(node.socket)
        try:
            wait_for(lambda: client.status().connections == 0, "the fuzzing connections to be gone")
            client.write(node.gpu(1).uuid(), SM_CLOCK, 990)
            assert node.gpu(1).sm_clock() == 990
        finally:
            client.close()
        wait_for(lambda: all(at_defaults(gpu) for gpu in node.sim_gpus()), "every GPU at defaults")
    finally:
        assert agent.stop() == 0, agent.log_tail()
    assert "Traceback" not in node.log_text()  # every frame was refused on purpose, none by a failure
