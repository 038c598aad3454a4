"""Malformed frames against a real `perseus serve` on loopback: every one gets an error reply,
the service keeps serving, and a real job completes afterwards.

A short seeded run of benchmarks/service_fuzz.py (the full run sends 10,000 frames), plus one
test per crash or hang the fuzzer found, so each shows on its own. About 8 s in all (five
service starts; the real job's planning imports the planner (scipy, HiGHS) in the service).
"""

from __future__ import annotations

import msgpack
from benchmark_scripts import load_benchmark
from server_helpers import raw_request, request

fuzz = load_benchmark("service_fuzz")


def _ping_ok(endpoint: str) -> None:
    reply = request(endpoint, "ping", request_id=99)
    assert reply is not None and reply["ok"] and reply["id"] == 99, reply


def _error_code(reply: dict | None) -> str:
    assert reply is not None, "no reply"
    assert reply["v"] == 1 and reply["ok"] is False and reply["error"]["message"], reply
    return reply["error"]["code"]


def test_malformed_frames_all_get_error_replies_and_a_real_job_completes_after(serve):
    served = serve()
    report, job_problem = fuzz.fuzz_service(
        served.endpoint, lambda: served.proc.poll() is None, frames=1500, seed=7, reply_timeout_s=5.0
    )
    assert not report.failures, f"{len(report.failures)} failures, first:\n" + "\n".join(report.failures[:10])
    assert report.frames == 1500 and set(report.sent) == set(fuzz.CATEGORIES)
    assert sum(report.codes.values()) == 1500
    assert {"bad_frame", "bad_field", "bad_version", "unknown_job", "unknown_rank", "unknown_type", "too_large"} <= set(
        report.codes
    )
    assert report.over_hard_limit == (fuzz.HARD_LIMIT_FRAMES,) * 3  # sent, connection dropped, service answered after
    assert served.proc.poll() is None, served.log()
    assert job_problem is None, job_problem
    _ping_ok(served.endpoint)


def test_the_fuzz_frames_are_seeded():
    decoy = fuzz.job_spec("decoy")
    first = [(c.category, c.frames) for c in fuzz.cases(3, 300, decoy)]
    assert first == [(c.category, c.frames) for c in fuzz.cases(3, 300, decoy)]
    assert first != [(c.category, c.frames) for c in fuzz.cases(4, 300, decoy)]


def test_a_request_type_that_is_not_a_string_gets_an_error_reply(serve):
    """Found by the fuzzer: an unhashable "type" raised TypeError out of decode_request
    (`kind not in REQUESTS`) and killed the service."""
    served = serve()
    for kind in ([1, 2], {"a": 1}, [[]]):
        reply = raw_request(served.endpoint, msgpack.packb({"v": 1, "id": 4, "type": kind}))
        assert _error_code(reply) in ("unknown_type", "bad_field") and reply["id"] == 4, kind
        _ping_ok(served.endpoint)


def test_a_deeply_nested_field_gets_an_error_reply(serve):
    """Found by the fuzzer: a field nested about 1,000 deep (msgpack allows it) made the error
    message's repr() raise RecursionError, which killed the service."""
    served = serve()
    pack = msgpack.packb
    envelope = b"\x84" + pack("v") + pack(1) + pack("id") + pack(5) + pack("type") + pack("status") + pack("job_id")
    for depth in (200, 990, 1020):
        assert _error_code(raw_request(served.endpoint, envelope + b"\x91" * depth + b"\x01")) in (
            "bad_field",
            "bad_frame",
        ), depth
        _ping_ok(served.endpoint)


def test_the_protocol_version_must_be_the_integer_1(serve):
    """Found by the fuzzer: v=True and v=1.0 compare equal to 1 and were served as protocol v1,
    while every other integer field of the protocol refuses booleans and floats."""
    served = serve()
    for version in (True, 1.0):
        assert (
            _error_code(raw_request(served.endpoint, msgpack.packb({"v": version, "id": 6, "type": "ping"})))
            == "bad_version"
        ), version


def test_a_job_of_millions_of_instructions_is_refused_without_building_it(serve):
    """Found by the fuzzer: JobSpec bounds pp (4096) and num_microbatches (2**20) separately, so a
    valid spec may describe up to 2**33 instructions; the service built the schedule in its loop
    thread (16 stages x 65,536 microbatches: about 15 s and 540 MB, every rank unanswered meanwhile)."""
    served = serve()
    spec = {**fuzz.job_spec("huge").to_wire(), "world_size": 16, "pp": 16, "num_microbatches": 1 << 16}
    reply = request(served.endpoint, "register_job", request_id=8, spec=spec)  # waits 5 s at most
    assert _error_code(reply) == "bad_field", reply
    _ping_ok(served.endpoint)
