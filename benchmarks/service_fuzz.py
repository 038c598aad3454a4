"""Fuzz the planner service with malformed frames; it must answer each with an error and keep working.

    python benchmarks/service_fuzz.py [--frames 10000] [--seed 1] [--reply-timeout 5]

Starts a real `perseus serve` on loopback, registers a decoy job (rank 0 registered), then sends
--frames malformed requests, one at a time on one DEALER socket, drawn (seeded) from these categories:
  random_bytes       random bytes of random length
  wrong_msgpack      valid msgpack that is not a map (ints, strings, lists, binary, nil, ...)
  wrong_types        a valid request with one field (top level or nested) of the wrong type
  missing_fields     a valid request with one required field (top level or nested) removed
  huge_lengths       msgpack headers declaring maps, arrays, strings, binaries of up to 4 G items
  unknown_ids        well-formed requests naming unknown jobs, unregistered ranks, unknown types
  truncated          a valid request's encoding cut short
  wrong_version      protocol version other than the integer 1
  extra_frames       a valid request with extra ZeroMQ frames (before or after it)
  empty_frames       empty frames
  bad_values         right types, wrong values (ranges, NaN, duplicates, unknown names, deep nesting)
  oversized          over the service's message limit (4 MiB), under zmq's hard limit
  huge_sizes         fields that declare huge work: lists past their limits, jobs of millions of instructions
Every frame must get an error reply within --reply-timeout seconds, with a code the category
allows and the request id echoed when it was readable; any frame without one is a failure and is
printed. Then a few frames over zmq's hard size limit, which zmq drops with the connection (no
reply is possible): the service must answer a new connection after each. Afterwards the service
must still be running, and a real job (two ranks through PlannerClient: register, upload
profiles, plan, fetch) must complete.

Prints frames and failures per category, replies per error code, the service's RSS every 1,000
frames, and the total time. Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_support import PRESET, ServeProcess, stage_profile

from perseus.client.planner_client import PlannerClient
from perseus.wire.limits import HARD_MESSAGE_BYTES, MAX_FREQUENCIES, MAX_MESSAGE_BYTES, MAX_PROFILE_ROWS, MAX_RANKS
from perseus.wire.messages import REQUESTS
from perseus.wire.profiles import profile_to_wire
from perseus.wire.spec import JobSpec, RankInfo

FREQUENCIES = PRESET.frequencies
GPU = PRESET.product
ANY_ERROR = frozenset(
    {"bad_frame", "bad_version", "bad_field", "too_large", "unknown_job", "unknown_rank", "unknown_type"}
)
HARD_LIMIT_FRAMES = 3  # frames over zmq's MAXMSGSIZE (no reply possible: zmq drops the connection)
RECOVER_TIMEOUT_S = 120.0  # after a missing reply: how long to wait for the service to answer a ping again


# ---- a small valid job: the decoy the fuzz frames aim at, and the real job afterwards --------------


def job_spec(tag: str) -> JobSpec:
    return JobSpec(
        2,
        2,
        schedule_name="1f1b",
        num_microbatches=4,
        gpu_model=GPU,
        warmup_iterations=0,
        iterations_per_frequency=1,
        tag=tag,
    )


def rank_info(rank: int) -> RankInfo:
    return RankInfo(rank, rank, gpu_model=GPU, frequencies=FREQUENCIES)


# ---- frames -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    category: str
    frames: tuple[bytes, ...]
    expect: frozenset[str]  # error codes this frame may get
    request_id: int | None = None  # the id the reply must echo (None: unreadable, not checked)

    def show(self) -> str:
        parts = [f.hex() if len(f) <= 48 else f"{f[:40].hex()}...({len(f)} bytes)" for f in self.frames]
        return f"[{self.category}] frames {parts}"


def pack(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


@dataclass
class Context:
    """What the generators build on: templates of valid requests aimed at the decoy job."""

    rng: random.Random
    decoy: JobSpec
    next_id: int = 1
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        job_id = self.decoy.job_id()
        self.templates = {
            "ping": {},
            "status": {"job_id": job_id},
            "register_job": {"spec": self.decoy.to_wire()},
            "register_rank": {"job_id": job_id, "info": rank_info(1).to_wire()},
            "get_table": {"job_id": job_id, "rank": 0, "iteration": 5, "plan_version": 0},
            "upload_profile": {
                "job_id": job_id,
                "rank": 0,
                "stage": 0,
                "profile": profile_to_wire(stage_profile(0, 2)),
            },
            "report_iteration": {"job_id": job_id, "rank": 0, "iteration": 3, "time_s": 0.5, "energy_j": 100.0},
            "declare_straggler": {"job_id": job_id, "pipeline": 0, "factor": 1.2},
        }
        self.templates = {k: v for k, v in self.templates.items() if k in REQUESTS}

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def request(self, kind: str | None = None) -> tuple[str, dict[str, Any]]:
        """A deep copy of a valid request (with its envelope) of `kind` or a random kind."""
        kind = kind or self.rng.choice(sorted(self.templates))
        return kind, {"v": 1, "id": self.rid(), "type": kind, **copy.deepcopy(self.templates[kind])}


# Required fields of the nested maps, from the protocol's dataclasses (plus the profile's).
def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.name != "_" and f.default is MISSING and f.default_factory is MISSING]


NESTED = {"spec": JobSpec, "info": RankInfo}
OPTIONAL_TOP = {("status", "job_id"), ("get_table", "iteration"), ("get_table", "plan_version")}  # may be left out
NULLABLE = {"stage_orders", "sweep_frequencies", "blocking_power_w", "meta"}  # may be None (nested fields)
NULLABLE_TOP = {("status", "job_id"), ("declare_straggler", "factor")}


def _paths(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every key path of a request map: top level and one level down."""
    paths = [(k,) for k in doc]
    for k, v in doc.items():
        if isinstance(v, dict):
            paths += [(k, sub) for sub in v]
    return paths


def _get(doc: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _set(doc: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _code_for(path: tuple[str, ...]) -> str:
    """The code a bad value at `path` must draw (the service checks id, then v, then type)."""
    return {("v",): "bad_version", ("id",): "bad_field", ("type",): "unknown_type"}.get(path, "bad_field")


WRONG_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**63),
    1.5,
    math.nan,
    "",
    "x" * 10,
    b"\x00\x01",
    [],
    [1, 2],
    {},
    {"a": 1},
    [[[]]],
]


def _wrong_type_for(rng: random.Random, template: Any, allow_none: bool) -> Any:
    """A value of another msgpack type than `template` (ints and floats count as one type for floats)."""
    while True:
        value = rng.choice(WRONG_VALUES)
        if value is None and not allow_none:
            continue
        if isinstance(template, bool):
            if not isinstance(value, bool):
                return value
        elif isinstance(template, int):
            if isinstance(value, bool) or not isinstance(value, int):
                return value
        elif isinstance(template, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return value
        elif template is None or not isinstance(value, type(template)):
            return value


def gen_random_bytes(c: Context) -> Case:
    data = c.rng.randbytes(c.rng.randint(0, 300))
    return Case("random_bytes", (data,), frozenset({"bad_frame"}) if not data else ANY_ERROR)


def gen_wrong_msgpack(c: Context) -> Case:
    r = c.rng
    value = r.choice(
        [
            r.randint(-(2**63), 2**64 - 1),
            r.random(),
            "ping",
            r.randbytes(r.randint(0, 40)),
            None,
            True,
            False,
            [1, "v", {"v": 1}],
            [{"v": 1, "id": 1, "type": "ping"}],
            ["ping"] * r.randint(0, 20),
        ]
    )
    return Case("wrong_msgpack", (pack(value),), frozenset({"bad_frame"}))


def gen_wrong_types(c: Context) -> Case:
    kind, doc = c.request()
    path = c.rng.choice([p for p in _paths(doc) if _get(doc, p) is not None])  # None: an unset option
    nullable = (kind, path[-1]) in NULLABLE_TOP | OPTIONAL_TOP or path[-1] in NULLABLE
    value = _wrong_type_for(c.rng, _get(doc, path), allow_none=not nullable)
    _set(doc, path, value)
    request_id = doc["id"] if path != ("id",) else None
    expect = {_code_for(path)} | ({"bad_field"} if path == ("type",) else set())  # a type that is not even a string
    return Case("wrong_types", (pack(doc),), frozenset(expect), request_id)


def gen_missing_fields(c: Context) -> Case:
    kind, doc = c.request()
    required = [("v",), ("id",), ("type",)]
    required += [(k,) for k in doc if k not in ("v", "id", "type") and (kind, k) not in OPTIONAL_TOP]
    for key, cls in NESTED.items():
        if key in doc:
            required += [(key, name) for name in _required(cls)]
    if "profile" in doc:
        required += [("profile", "blocking_power_w"), ("profile", "rows")]
    if c.rng.random() < 0.05:
        return Case("missing_fields", (pack({}),), frozenset({"bad_field"}))
    path = c.rng.choice(required)
    parent = _get(doc, path[:-1])
    del parent[path[-1]]
    request_id = doc["id"] if path != ("id",) else None
    return Case("missing_fields", (pack(doc),), frozenset({_code_for(path)}), request_id)


HUGE_HEADERS = [b"\xdf", b"\xdd", b"\xdb", b"\xc6", b"\xc9"]  # map32, array32, str32, bin32, ext32
SMALL_HEADERS = [b"\xde", b"\xdc", b"\xda", b"\xc5", b"\xc8"]  # the 16-bit forms


def gen_huge_lengths(c: Context) -> Case:
    r = c.rng
    if r.random() < 0.5:
        header = r.choice(HUGE_HEADERS) + r.randint(2**16, 2**32 - 1).to_bytes(4, "big")
    else:
        header = r.choice(SMALL_HEADERS) + r.randint(2**12, 2**16 - 1).to_bytes(2, "big")
    tail = r.randbytes(r.randint(0, 64))
    if r.random() < 0.5:
        # Inside a well-formed envelope: the last value's header lies about its length.
        prefix = (
            b"\x84" + pack("v") + pack(1) + pack("id") + pack(c.rid()) + pack("type") + pack("status") + pack("job_id")
        )
        return Case("huge_lengths", (prefix + header + tail,), frozenset({"bad_frame"}))
    return Case("huge_lengths", (header + tail,), frozenset({"bad_frame"}))


def gen_unknown_ids(c: Context) -> Case:
    r = c.rng
    choice = r.random()
    if choice < 0.4:
        kind, doc = c.request(r.choice(["status", "register_rank", "get_table", "upload_profile", "report_iteration"]))
        doc["job_id"] = "job-" + r.randbytes(8).hex()
        return Case("unknown_ids", (pack(doc),), frozenset({"unknown_job"}), doc["id"])
    if choice < 0.7:
        kind, doc = c.request(r.choice(["get_table", "report_iteration", "upload_profile"]))
        doc["rank"] = r.choice([2, r.randint(3, MAX_RANKS - 1)])  # past the decoy's world size: never registered
        return Case("unknown_ids", (pack(doc),), frozenset({"unknown_rank"}), doc["id"])
    kind, doc = c.request()
    doc["type"] = r.choice(
        ["", "shutdown", "PING", "register", "get-table", r.randbytes(6).hex(), "x" * r.randint(100, 5000)]
    )
    return Case("unknown_ids", (pack(doc),), frozenset({"unknown_type"}), doc["id"])


def gen_truncated(c: Context) -> Case:
    _, doc = c.request()
    data = pack(doc)
    return Case("truncated", (data[: c.rng.randrange(len(data))],), frozenset({"bad_frame"}))


def gen_wrong_version(c: Context) -> Case:
    _, doc = c.request()
    doc["v"] = c.rng.choice([0, 2, 3, -1, 255, 2**32, "1", "v1", None, 1.5, 1.0, True, [1], {"v": 1}, b"\x01"])
    return Case("wrong_version", (pack(doc),), frozenset({"bad_version"}), doc["id"])


def gen_extra_frames(c: Context) -> Case:
    r = c.rng
    _, doc = c.request()
    data = pack(doc)
    extra = [r.randbytes(r.randint(0, 20)) for _ in range(r.randint(1, 3))]
    frames = r.choice([[b"", data], [data, *extra], [*extra, data], [data, data]])
    return Case("extra_frames", tuple(frames), frozenset({"bad_frame"}))


def gen_empty_frames(c: Context) -> Case:
    return Case("empty_frames", (b"",) * c.rng.randint(1, 3), frozenset({"bad_frame"}))


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"  # [[[...[1]...]]] as raw msgpack


def gen_bad_values(c: Context) -> Case:
    r = c.rng
    job_id = c.decoy.job_id()
    spec = c.decoy.to_wire()
    variants: list[Callable[[], tuple[str, dict[str, Any]]]] = [
        lambda: ("get_table", {"job_id": job_id, "rank": r.choice([-1, MAX_RANKS, 2**63])}),
        lambda: ("get_table", {"job_id": job_id, "rank": 0, "iteration": r.choice([-2, 2**62 + 1])}),
        lambda: (
            "get_table",
            {"job_id": r.choice(["job-XYZ", "job-00 ", "jobs-00", "x" * 65, "job-" + "0" * 61]), "rank": 0},
        ),
        lambda: (
            "report_iteration",
            {
                "job_id": job_id,
                "rank": 0,
                "iteration": 1,
                "time_s": r.choice([math.nan, math.inf, -1.0, 0.0]),
                "energy_j": 1.0,
            },
        ),
        lambda: (
            "report_iteration",
            {
                "job_id": job_id,
                "rank": 0,
                "iteration": 1,
                "time_s": 1.0,
                "energy_j": r.choice([math.nan, -math.inf, -5.0]),
            },
        ),
        lambda: ("register_job", {"spec": {**spec, "world_size": r.choice([3, 0, MAX_RANKS + 1])}}),
        lambda: ("register_job", {"spec": {**spec, "schedule_name": r.choice(["zigzag", "", "1f1b" * 40])}}),
        lambda: ("register_job", {"spec": {**spec, "tag": "t" * 129}}),
        lambda: ("register_job", {"spec": {**spec, "schedule_style": "spiral"}}),
        lambda: ("register_job", {"spec": {**spec, "sweep_frequencies": r.choice([[], [1410, 1410], [0], [10**6]])}}),
        lambda: (
            "register_job",
            {
                "spec": {
                    **spec,
                    "stage_orders": r.choice(
                        [
                            [],
                            [[["forward", 0, 0]]],
                            [[["sideways", 0, 0]], [["forward", 0, 0]]],
                            [[["forward", 9, 0]], [["forward", 0, 0]]],
                            [[["forward", 0]], [["forward", 0, 0]]],
                        ]
                    ),
                }
            },
        ),
        lambda: ("register_job", {"spec": {**spec, "surprise": 1}}),
        lambda: ("register_rank", {"job_id": job_id, "info": {**rank_info(1).to_wire(), "stage": r.choice([2, 4095])}}),
        lambda: (
            "register_rank",
            {"job_id": job_id, "info": {**rank_info(1).to_wire(), "frequencies": r.choice([[], [1410, 1410], [0, 5]])}},
        ),
        lambda: (
            "register_rank",
            {"job_id": job_id, "info": {**rank_info(1).to_wire(), "stage": 0}},
        ),  # rank 0 holds stage 0
        lambda: (
            "register_rank",
            {"job_id": job_id, "info": {**rank_info(1).to_wire(), "frequencies": [1410]}},
        ),  # misses sweep frequencies
        lambda: (
            "upload_profile",
            {"job_id": job_id, "rank": 0, "stage": 1, "profile": profile_to_wire(stage_profile(1, 2))},
        ),
        lambda: (
            "upload_profile",
            {
                "job_id": job_id,
                "rank": 0,
                "stage": 0,
                "profile": {"blocking_power_w": 80.0, "rows": [[0, "forward", 1410, 0.01, 1.0]]},
            },
        ),
        lambda: (
            "upload_profile",
            {
                "job_id": job_id,
                "rank": 0,
                "stage": 0,
                "profile": {"blocking_power_w": 80.0, "rows": [[0, "sideways", 1410, 0.01, 1.0]]},
            },
        ),
        lambda: (
            "upload_profile",
            {
                "job_id": job_id,
                "rank": 0,
                "stage": 0,
                "profile": {"blocking_power_w": 80.0, "rows": [[0, "forward", 1410, -0.01, 1.0, 7]]},
            },
        ),
        lambda: (
            "upload_profile",
            {
                "job_id": job_id,
                "rank": 0,
                "stage": 0,
                "profile": {**profile_to_wire(stage_profile(0, 2)), "meta": {"k": "v" * 2000}},
            },
        ),
        lambda: ("ping", {"unexpected": r.randint(0, 9)}),
    ]
    kind, fields_ = r.choice(variants)()
    doc = {"v": 1, "id": c.rid(), "type": kind, **fields_}
    if r.random() < 0.1:
        # A deeply nested value (the unpacker allows about 1,000 levels): raw msgpack, as a client could send.
        depth = r.randint(100, 1020)
        prefix = (
            b"\x84"
            + pack("v")
            + pack(1)
            + pack("id")
            + pack(doc["id"])
            + pack("type")
            + pack("status")
            + pack("job_id")
        )
        return Case("bad_values", (prefix + _nested(depth),), frozenset({"bad_field", "bad_frame"}), doc["id"])
    return Case("bad_values", (pack(doc),), frozenset({"bad_field"}), doc["id"])


def gen_oversized(c: Context) -> Case:
    r = c.rng
    _, doc = c.request("ping")
    doc["pad"] = b"\x00" * r.randint(MAX_MESSAGE_BYTES, HARD_MESSAGE_BYTES - 1024)
    return Case("oversized", (pack(doc),), frozenset({"too_large"}))


def gen_huge_sizes(c: Context) -> Case:
    r = c.rng
    spec = c.decoy.to_wire()
    rid = c.rid()
    variants: list[Callable[[], dict[str, Any]]] = [
        lambda: {
            "type": "register_rank",
            "job_id": c.decoy.job_id(),
            "info": {**rank_info(1).to_wire(), "frequencies": list(range(1, MAX_FREQUENCIES + 2))},
        },
        lambda: {
            "type": "upload_profile",
            "job_id": c.decoy.job_id(),
            "rank": 0,
            "stage": 0,
            "profile": {"blocking_power_w": 80.0, "rows": [[0, "forward", 1410, 0.01, 1.0]] * (MAX_PROFILE_ROWS + 1)},
        },
        lambda: {"type": "register_job", "spec": {**spec, "world_size": 2**40, "pp": 2, "dp": 2**39}},
        # A job whose schedule would have tens of millions of instructions: refused, not built.
        lambda: {"type": "register_job", "spec": {**spec, "world_size": 16, "pp": 16, "num_microbatches": 1 << 16}},
    ]
    doc = {"v": 1, "id": rid, **r.choice(variants)()}
    return Case("huge_sizes", (pack(doc),), frozenset({"bad_field"}), rid)


CATEGORIES: dict[str, tuple[Callable[[Context], Case], float]] = {
    "random_bytes": (gen_random_bytes, 12),
    "wrong_msgpack": (gen_wrong_msgpack, 6),
    "wrong_types": (gen_wrong_types, 16),
    "missing_fields": (gen_missing_fields, 12),
    "huge_lengths": (gen_huge_lengths, 8),
    "unknown_ids": (gen_unknown_ids, 12),
    "truncated": (gen_truncated, 10),
    "wrong_version": (gen_wrong_version, 6),
    "extra_frames": (gen_extra_frames, 6),
    "empty_frames": (gen_empty_frames, 2),
    "bad_values": (gen_bad_values, 10),
    "oversized": (gen_oversized, 0.4),
    "huge_sizes": (gen_huge_sizes, 0.3),
}


def cases(seed: int, count: int, decoy: JobSpec) -> Iterator[Case]:
    """`count` seeded malformed requests; every category at least once."""
    rng = random.Random(seed)
    context = Context(rng, decoy)
    names = list(CATEGORIES)
    weights = [CATEGORIES[n][1] for n in names]
    order = names + rng.choices(names, weights, k=max(0, count - len(names)))
    for name in order[:count]:
        yield CATEGORIES[name][0](context)


# ---- sending them ---------------------------------------------------------------------------------


@dataclass
class Report:
    sent: Counter = field(default_factory=Counter)  # per category
    failed: Counter = field(default_factory=Counter)  # per category
    codes: Counter = field(default_factory=Counter)  # per error code
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    service_died: bool = False
    over_hard_limit: tuple[int, int, int] = (
        0,
        0,
        0,
    )  # frames over zmq's hard limit: (sent, connections dropped, pings answered after)

    @property
    def frames(self) -> int:
        return sum(self.sent.values())


class Fuzzer:
    """One DEALER on `endpoint`; `send(case)` waits for that case's reply (lockstep, so replies
    cannot be confused); after a missing reply it reconnects once the service answers again."""

    def __init__(self, endpoint: str, reply_timeout_s: float, alive: Callable[[], bool]) -> None:
        self.endpoint = endpoint
        self.reply_timeout_ms = int(reply_timeout_s * 1000)
        self.alive = alive
        self.context = zmq.Context()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def request(self, frames: tuple[bytes, ...], timeout_ms: int) -> dict | None:
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(timeout_ms):
            return None
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def recover(self) -> bool:
        """A fresh socket (a late reply must not answer the next frame) and a ping answered."""
        self.sock.close(linger=0)
        self.sock = self._connect()
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < deadline and self.alive():
            reply = self.request((pack({"v": 1, "id": 1, "type": "ping"}),), 1000)
            if reply is not None and reply.get("ok"):
                return True
            self.sock.close(linger=0)
            self.sock = self._connect()
        return False

    def run(self, all_cases: Iterator[Case], report: Report, progress: Callable[[int], None] | None = None) -> None:
        start = time.monotonic()
        for n, case in enumerate(all_cases, 1):
            report.sent[case.category] += 1
            problem = self._check(case, self.request(case.frames, self.reply_timeout_ms), report)
            if problem is not None:
                report.failed[case.category] += 1
                report.failures.append(f"{problem}: {case.show()}")
                if problem.startswith("no reply") and not self.recover():
                    report.service_died = True
                    report.failures.append(
                        f"the service stopped answering (process alive: {self.alive()}) after frame {n}"
                    )
                    break
            if progress is not None and n % 1000 == 0:
                progress(n)
        report.seconds = time.monotonic() - start

    def _check(self, case: Case, reply: dict | None, report: Report) -> str | None:
        if reply is None:
            return f"no reply within {self.reply_timeout_ms} ms"
        if not isinstance(reply, dict) or reply.get("v") != 1:
            return f"reply is not a protocol v1 map: {str(reply)[:120]}"
        if reply.get("ok") is not False:
            return f"accepted (ok reply {str(reply)[:120]})"
        error = reply.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        report.codes[code] += 1
        if not isinstance(error, dict) or not error.get("message"):
            return f"error reply without a message: {str(reply)[:120]}"
        if code not in case.expect:
            return f"code {code} ({error.get('message', '')[:160]}), expected {'/'.join(sorted(case.expect))}"
        if case.request_id is not None and reply.get("id") != case.request_id:
            return f"reply id {reply.get('id')} for request id {case.request_id}"
        return None

    def over_hard_limit(self, count: int) -> tuple[int, int]:
        """Send `count` frames over zmq's MAXMSGSIZE: the service's zmq drops the connection before
        the service sees the frame, so no reply can come. (drops the client saw, pings the service
        answered on a new connection right after)."""
        dropped = answered = 0
        for _ in range(count):
            monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                self.sock.send(b"\x00" * (HARD_MESSAGE_BYTES + 1))
                if monitor.poll(self.reply_timeout_ms):
                    dropped += recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            finally:
                self.sock.disable_monitor()
                monitor.close(linger=0)
            answered += self.recover()
        return dropped, answered

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def register_decoy(fuzzer: Fuzzer, decoy: JobSpec) -> None:
    """The decoy job, with rank 0 registered: the target of unknown-rank and bad-value frames."""
    for message in (
        {"type": "register_job", "spec": decoy.to_wire()},
        {"type": "register_rank", "job_id": decoy.job_id(), "info": rank_info(0).to_wire()},
    ):
        reply = fuzzer.request((pack({"v": 1, "id": 1, **message}),), 10_000)
        if not (reply and reply.get("ok")):
            raise RuntimeError(f"setting up the decoy job failed: {message['type']} -> {reply}")


def real_job(endpoint: str, tag: str, timeout_s: float = 60.0) -> str | None:
    """Two ranks through PlannerClient: register, upload both stages' profiles, wait for the plan,
    fetch it. None if the job completed, else what went wrong."""
    spec = job_spec(tag)
    clients = [PlannerClient(endpoint, timeout_s=5.0, poll_interval_s=0.05) for _ in range(2)]
    try:
        job_id = clients[0].register_job(spec)
        for rank, client in enumerate(clients):
            client.register_rank(job_id, rank_info(rank))
        for rank, client in enumerate(clients):
            client.upload_profile(job_id, rank, stage_profile(rank, 2))
        for rank, client in enumerate(clients):
            if not client.wait_for_plan(timeout_s):
                return f"rank {rank}: no plan within {timeout_s:.0f} s (status: {client.status(job_id)})"
            assignment = client.assignment(10**6)
            expected = 2 * spec.num_microbatches
            if (
                assignment.phase.value != "planned"
                or len(assignment.frequencies or ()) != expected
                or not set(assignment.frequencies) <= set(FREQUENCIES)
            ):
                return f"rank {rank}: bad assignment {assignment}"
        return None
    finally:
        for client in clients:
            client.close()


def fuzz_service(
    endpoint: str,
    alive: Callable[[], bool],
    frames: int,
    seed: int,
    reply_timeout_s: float,
    progress: Callable[[int], None] | None = None,
) -> tuple[Report, str | None]:
    """Fuzz the service at `endpoint` (`alive`: whether its process runs), then run a real job on
    it: (report, what went wrong with the real job or None)."""
    decoy = job_spec(f"fuzz-decoy-{seed}")
    fuzzer = Fuzzer(endpoint, reply_timeout_s, alive)
    report = Report()
    try:
        register_decoy(fuzzer, decoy)
        fuzzer.run(cases(seed, frames, decoy), report, progress)
        if not report.service_died:
            report.over_hard_limit = (HARD_LIMIT_FRAMES, *fuzzer.over_hard_limit(HARD_LIMIT_FRAMES))
    finally:
        fuzzer.close()
    if not alive():
        return report, "the service process exited"
    return report, real_job(endpoint, f"fuzz-after-{seed}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=10_000, help="malformed frames to send (default 10000)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--reply-timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)")
    a = parser.parse_args(argv)
    if a.frames < len(CATEGORIES):
        parser.error(f"--frames must be at least {len(CATEGORIES)} (one per category)")
    with tempfile.TemporaryDirectory(prefix="perseus-fuzz-") as tmp:
        service = ServeProcess(Path(tmp) / "state", Path(tmp) / "serve.log")
        print(f"service {service.endpoint} (pid {service.pid}); {a.frames} frames, seed {a.seed}", flush=True)
        rss_before = service.memory_mb()[0]
        try:

            def progress(n: int) -> None:
                rss = service.memory_mb()[0] if service.alive() else math.nan
                print(f"  {n} frames, service RSS {rss:.0f} MiB", flush=True)

            report, job_problem = fuzz_service(
                service.endpoint, service.alive, a.frames, a.seed, a.reply_timeout, progress
            )
            alive = service.alive()
            rss_after, peak = service.memory_mb() if alive else (math.nan, math.nan)
            log_tail = service.log_tail() if not alive or report.failures else ""
        finally:
            service.stop()

    print(f"\n{'category':<16} {'frames':>7} {'failed':>7}")
    for name in CATEGORIES:
        print(f"{name:<16} {report.sent[name]:7d} {report.failed[name]:7d}")
    print(f"{'total':<16} {report.frames:7d} {sum(report.failed.values()):7d}")
    print(f"\n{'error code':<16} {'replies':>7}")
    for code, n in sorted(report.codes.items(), key=lambda kv: str(kv[0])):
        print(f"{code!s:<16} {n:7d}")
    print(
        f"\ntotal time {report.seconds:.2f} s ({report.frames / report.seconds:.0f} frames/s, lockstep on one socket)"
    )
    sent, dropped, answered = report.over_hard_limit
    print(
        f"frames over zmq's {HARD_MESSAGE_BYTES >> 20} MiB hard limit (no reply by design): {sent}; "
        f"connection dropped by the service {dropped}, "
        f"service answered a new connection after {answered}"
    )
    print(
        f"service alive afterwards: {alive}; RSS {rss_before:.0f} MiB before the frames, "
        f"{rss_after:.0f} MiB after the real job (peak {peak:.0f} MiB; planning imports the planner)"
    )
    print(
        "real job afterwards (register, upload, plan, fetch): "
        f"{'completed' if job_problem is None else 'FAILED: ' + job_problem}"
    )
    if report.failures:
        print(f"\n{len(report.failures)} failures (first 30):", *report.failures[:30], sep="\n  ")
    if log_tail:
        print("\nservice log tail:\n" + log_tail)
    return 0 if alive and not report.failures and job_problem is None and dropped == answered == sent else 1


if __name__ == "__main__":
    sys.exit(main())
