"""Wire protocol of the planner service: one msgpack map per ZeroMQ frame (never pickle).

A request is `{"v": 1, "id": <int>, "type": <str>, ...fields}`; its reply is
`{"v": 1, "id": <same>, "ok": true, ...fields}` or
`{"v": 1, "id": <same>, "ok": false, "error": {"code": <ErrorCode>, "message": <str>}}`.
Each message type is a frozen dataclass whose constructor validates every field (types, ranges,
enums) and raises ConfigError; `to_wire()` gives plain msgpack-able values and `from_wire()`
rejects unknown or missing fields. The service and the client use the same classes, so what a
rank can build is exactly what the service accepts.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import reprlib
import sys
from dataclasses import KW_ONLY, MISSING, dataclass, fields
from typing import Any, ClassVar

import msgpack

from perseus.exceptions import ConfigError, ProfileError, ServiceError
from perseus.profiler.profile import KINDS, Profile, ProfilePoint
from perseus.schedules.builders import SCHEDULES
from perseus.schedules.instruction import STYLES
from perseus.wire.topology import RANK_MAPPINGS

PROTOCOL_VERSION = 1
DEFAULT_ADDRESS = "tcp://127.0.0.1:7787"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger: a too_large error reply
HARD_MESSAGE_BYTES = 4 * MAX_MESSAGE_BYTES  # zmq.MAXMSGSIZE: zmq drops a peer that sends more
MAX_ID = 2**63 - 1
MAX_ITERATION = 2**62  # what the service sends (a plan starts a bounded lead after a rank's iteration)
MAX_RANK_ITERATION = 2**53  # what a rank may report: far past any real run, far below MAX_ITERATION
# An iteration or instruction lasts at least a microsecond and at most a day; one rank's GPU
# spends at most 10 MJ in one (10 kW for 1,000 s). Values outside are bugs or attacks, and
# derived values (1 / time, sums over ranks) stay finite within them.
MIN_TIME_S = 1e-6
MAX_TIME_S = 86_400.0
MAX_ENERGY_J = 1e7
MAX_RANKS = 1 << 20
MAX_FREQUENCY_MHZ = 100_000
MAX_FREQUENCIES = 1024
# Per job. The service decodes, hashes and saves a job's stage orders on its loop thread (the
# schedule is built on a worker): 32,768 instructions keep that near 0.1 s (benchmarks/service_register.py).
MAX_INSTRUCTIONS = 1 << 15
MAX_PROFILE_ROWS = 100_000
MAX_STRAGGLER_FACTOR = 10.0


class _Name(str, enum.Enum):
    """A wire name: str() and f-strings give the value ("planned"), as on the wire."""

    def __str__(self) -> str:
        return self.value


class ErrorCode(_Name):
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


class Phase(_Name):
    """What a rank does in one iteration."""

    UNPLANNED = "unplanned"  # no table from the service (unreachable, or planning failed): max clocks
    WARMUP = "warmup"  # max clocks, not measured
    PROFILING = "profiling"  # the sweep table's frequency on every instruction
    PLANNING = "planning"  # profile uploaded (or sweep over): max clocks until the plan arrives
    PLANNED = "planned"  # the plan's frequency for each instruction


class JobPhase(_Name):
    """Where a job is, as the service sees it."""

    PROFILING = "profiling"  # waiting for every stage's profile (ranks warm up, then sweep)
    PLANNING = "planning"  # every stage profiled; the planner is running
    PLANNED = "planned"  # a plan is published
    FAILED = "failed"  # the planner rejected the profile or schedule; ranks stay at max clocks


# ---- field checks: raise ConfigError naming the field and what it must be -------------------


_SHOW = reprlib.Repr()
_SHOW.maxlevel = 3  # a field nested 1,000 deep must not make the error message recurse
_SHOW.maxstring = _SHOW.maxother = 60


def _show(value: Any) -> str:
    text = _SHOW.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}")
    return int(value)


def _float(value: Any, name: str, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or not (lo < value if open_lo else lo <= value) or value > hi:
        bound = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise ConfigError(f"{name} must be a finite number in {bound}, got {_show(value)}")
    return float(value)


def _str(value: Any, name: str, max_len: int, *, min_len: int = 0, choices: tuple[str, ...] | None = None, printable: bool = True) -> str:
    if not isinstance(value, str) or not min_len <= len(value) <= max_len:
        raise ConfigError(f"{name} must be a string of {min_len} to {max_len} characters, got {_show(value)}")
    if printable and not value.isprintable():  # names reach log lines: no newlines or terminal escapes
        raise ConfigError(f"{name} must be printable text (no control characters such as newlines or escapes), got {_show(value)}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {_show(value)}")
    return value


def _seq(value: Any, name: str, max_len: int, *, min_len: int = 0) -> list | tuple:
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise ConfigError(f"{name} must be a list of {min_len} to {max_len} items, got {_show(value)}")
    return value


def _ints(value: Any, name: str, lo: int, hi: int, max_len: int, *, min_len: int = 0) -> tuple[int, ...]:
    return tuple(_int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(_seq(value, name, max_len, min_len=min_len)))


def _frequencies(value: Any, name: str) -> tuple[int, ...]:
    """Distinct frequencies in MHz, returned highest first."""
    freqs = _ints(value, name, 1, MAX_FREQUENCY_MHZ, MAX_FREQUENCIES, min_len=1)
    if len(set(freqs)) != len(freqs):
        raise ConfigError(f"{name} lists a frequency twice; list each supported frequency once")
    return tuple(sorted(freqs, reverse=True))


def _job_id(value: Any, name: str) -> str:
    text = _str(value, name, 64, min_len=1)
    if not text.startswith("job-") or not all(c in "0123456789abcdef" for c in text[4:]):
        raise ConfigError(f"{name} must be a job id as register_job returns (job-<hex>), got {_show(value)}")
    return text


def _set(obj: object, **values: Any) -> None:
    for key, value in values.items():
        object.__setattr__(obj, key, value)


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class Message:
    """Base of every wire message: dataclass fields are the wire fields."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls, doc: Any) -> Any:
        return cls(**_fields_of(cls, doc, cls.TYPE or cls.__name__))


def _fields_of(cls: type, doc: Any, where: str) -> dict[str, Any]:
    """`doc` as constructor keywords of dataclass `cls`: a map with no unknown or missing keys."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where} must be a map, got {_show(doc)}")
    known = {f.name: f for f in fields(cls)}
    unknown = [k for k in doc if k not in known]
    if unknown:
        named = ", ".join(_show(k) for k in unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise ConfigError(f"{where}: unknown field(s) {named}; protocol v{PROTOCOL_VERSION} fields are {', '.join(known)}")
    missing = [n for n, f in known.items() if n not in doc and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    return dict(doc)


# ---- the job and the ranks -------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec(Message):
    """A training job, as rank 0 registers it.

    `stage_orders`, when given, is each stage's instruction order as (kind, microbatch, chunk)
    triples (for example from a torch schedule's pipeline_order); otherwise the schedule is
    `perseus.schedules.build_schedule(schedule_name, pp, num_microbatches, num_chunks)`.
    `sweep_frequencies` (MHz) defaults to every frequency the first registered rank supports.
    `blocking_power_w` overrides the blocking power the ranks' profiles carry (per GPU).
    `rank_mapping` says how ranks map to (stage, dp_index, tp_index): "explicit" (each rank
    states its own), "megatron" or "torch" (see perseus.wire.topology); with a named mapping
    the service checks every rank's stated coordinates against it.
    `instruction_overhead_s` (host work between a stage's instructions) and `hop_latency_s` (what
    a stage-to-stage hop takes beyond that host work) are added to the profile at planning time (`Profile.with_overheads`);
    the cached profile stays as measured, so they are not part of the signature.
    """

    world_size: int
    pp: int
    _: KW_ONLY
    dp: int = 1
    tp: int = 1
    schedule_name: str
    num_microbatches: int
    num_chunks: int = 1
    schedule_style: str = "loop"
    stage_orders: tuple[tuple[tuple[str, int, int], ...], ...] | None = None
    tag: str = ""
    gpu_model: str
    warmup_iterations: int = 2
    iterations_per_frequency: int = 2
    sweep_frequencies: tuple[int, ...] | None = None
    blocking_power_w: float | None = None
    rank_mapping: str = "explicit"
    instruction_overhead_s: float = 0.0
    hop_latency_s: float = 0.0

    def __post_init__(self) -> None:
        n = "JobSpec"
        world = _int(self.world_size, f"{n}.world_size", 1, MAX_RANKS)
        pp = _int(self.pp, f"{n}.pp", 1, 4096)
        dp = _int(self.dp, f"{n}.dp", 1, MAX_RANKS)
        tp = _int(self.tp, f"{n}.tp", 1, 4096)
        if pp * dp * tp != world:
            raise ConfigError(f"{n}: world_size {world} must equal pp * dp * tp = {pp} * {dp} * {tp} = {pp * dp * tp}")
        microbatches = _int(self.num_microbatches, f"{n}.num_microbatches", 1, 1 << 20)
        chunks = _int(self.num_chunks, f"{n}.num_chunks", 1, 256)
        if 2 * pp * microbatches * chunks > MAX_INSTRUCTIONS:
            raise ConfigError(
                f"{n}: {pp} stages x {microbatches} microbatches x {chunks} chunks is over {MAX_INSTRUCTIONS} instructions "
                "(forward and backward); plan with fewer microbatches per iteration"
            )
        _set(
            self,
            schedule_name=_str(self.schedule_name, f"{n}.schedule_name", 64, min_len=1),
            schedule_style=_str(self.schedule_style, f"{n}.schedule_style", 16, choices=STYLES),
            tag=_str(self.tag, f"{n}.tag", 128),
            gpu_model=_str(self.gpu_model, f"{n}.gpu_model", 128, min_len=1),
            warmup_iterations=_int(self.warmup_iterations, f"{n}.warmup_iterations", 0, 1_000_000),
            iterations_per_frequency=_int(self.iterations_per_frequency, f"{n}.iterations_per_frequency", 1, 10_000),
            rank_mapping=_str(self.rank_mapping, f"{n}.rank_mapping", 16, choices=RANK_MAPPINGS),
        )
        if self.stage_orders is not None:
            _set(self, stage_orders=_stage_orders(self.stage_orders, f"{n}.stage_orders", pp, microbatches, chunks))
        elif self.schedule_name not in SCHEDULES:  # checked here: the service builds the schedule later, off its loop
            raise ConfigError(f"{n}.schedule_name {self.schedule_name!r} is not a schedule perseus builds ({', '.join(SCHEDULES)}); "
                              "name one of those or give stage_orders")
        if self.sweep_frequencies is not None:
            _set(self, sweep_frequencies=_frequencies(self.sweep_frequencies, f"{n}.sweep_frequencies"))
        if self.blocking_power_w is not None:
            _set(self, blocking_power_w=_float(self.blocking_power_w, f"{n}.blocking_power_w", 0.0, 100_000.0))
        for name in ("instruction_overhead_s", "hop_latency_s"):
            value = _float(getattr(self, name), f"{n}.{name}", 0.0, 1.0)
            if value >= 1.0:
                raise ConfigError(f"{n}.{name} must be under 1 s (a per-instruction overhead), got {value}")
            _set(self, **{name: value})

    def to_wire(self) -> dict[str, Any]:
        doc = self._fields()
        if self.stage_orders is not None:
            doc["stage_orders"] = [[list(t) for t in order] for order in self.stage_orders]
        if self.sweep_frequencies is not None:
            doc["sweep_frequencies"] = list(self.sweep_frequencies)
        return doc

    def _fields(self) -> dict[str, Any]:
        """The wire fields with sequences left as tuples (JSON and msgpack write them as lists)."""
        doc = super().to_wire()
        if self.rank_mapping == "explicit":
            del doc["rank_mapping"]  # the default: specs (and job ids) of earlier releases unchanged
        for name in ("instruction_overhead_s", "hop_latency_s"):
            if doc[name] == 0.0:
                del doc[name]  # likewise
        return doc

    def signature(self, gpu_model: str | None = None) -> dict[str, Any]:
        """What a stage profile depends on: jobs with the same signature share a cached profile.
        `gpu_model`: the signature of the job's stages on that model (default the job's)."""
        signature = {
            "schedule": self.schedule_name,
            "stages": self.pp,
            "microbatches": self.num_microbatches,
            "chunks": self.num_chunks,
            "gpu_model": self.gpu_model if gpu_model is None else gpu_model,
            "tag": self.tag,
        }
        if self.tp > 1:
            signature["tp"] = self.tp  # a stage's profile sums its tensor-parallel ranks
        return signature

    def profile_key(self, gpu_model: str | None = None) -> str:
        """File-name-safe key of `signature(gpu_model)`."""
        return "sig-" + hashlib.sha256(_canonical(self.signature(gpu_model))).hexdigest()[:24]

    def job_id(self) -> str:
        """Deterministic id: registering the same spec again (a retry, a restarted job) gives the same job."""
        job_id = self.__dict__.get("_job_id")  # memo: hashing megabytes of stage orders is not free
        if job_id is None:
            job_id = self.__dict__["_job_id"] = "job-" + hashlib.sha256(_canonical(self._fields())).hexdigest()[:16]
        return job_id


def _stage_orders(value: Any, name: str, pp: int, microbatches: int, chunks: int) -> tuple:
    orders = _seq(value, name, pp, min_len=pp)
    total = 0
    out = []
    for s, order in enumerate(orders):
        order = _seq(order, f"{name}[{s}]", MAX_INSTRUCTIONS, min_len=1)
        total += len(order)
        if total > MAX_INSTRUCTIONS:
            raise ConfigError(f"{name}: more than {MAX_INSTRUCTIONS} instructions in all")
        row = _valid_order(order, microbatches, chunks)
        if row is None:  # something is wrong: find and name it
            row = tuple(_instruction(triple, f"{name}[{s}][{i}]", microbatches, chunks) for i, triple in enumerate(order))
        out.append(row)
    return tuple(out)


_KIND_SET = frozenset(KINDS)


def _valid_order(order: list | tuple, microbatches: int, chunks: int) -> tuple | None:
    """The order as (kind, microbatch, chunk) tuples if every triple is valid, else None. Checks
    whole columns at once: the service decodes up to MAX_INSTRUCTIONS triples on its loop thread."""
    if not set(map(type, order)) <= {list, tuple} or set(map(len, order)) != {3}:
        return None
    kinds, mbs, cks = zip(*order)
    if set(map(type, kinds)) != {str} or not set(kinds) <= _KIND_SET:
        return None
    for column, size in ((mbs, microbatches), (cks, chunks)):
        if set(map(type, column)) != {int} or min(column) < 0 or max(column) >= size:
            return None
    return tuple(zip(kinds, mbs, cks))


def _instruction(triple: Any, where: str, microbatches: int, chunks: int) -> tuple[str, int, int]:
    triple = _seq(triple, where, 3, min_len=3)
    kind = triple[0].value if hasattr(triple[0], "value") else triple[0]
    return (
        _str(kind, f"{where}.kind", 32, choices=KINDS),
        _int(triple[1], f"{where}.microbatch", 0, microbatches - 1),
        _int(triple[2], f"{where}.chunk", 0, chunks - 1),
    )


@dataclass(frozen=True)
class RankInfo(Message):
    """One rank: its pipeline stage, data- and tensor-parallel indices, GPU and its frequencies (MHz)."""

    rank: int
    stage: int
    _: KW_ONLY
    dp_index: int = 0
    tp_index: int = 0
    gpu_model: str
    frequencies: tuple[int, ...]

    def __post_init__(self) -> None:
        n = "RankInfo"
        _set(
            self,
            rank=_int(self.rank, f"{n}.rank", 0, MAX_RANKS - 1),
            stage=_int(self.stage, f"{n}.stage", 0, 4095),
            dp_index=_int(self.dp_index, f"{n}.dp_index", 0, MAX_RANKS - 1),
            tp_index=_int(self.tp_index, f"{n}.tp_index", 0, 4095),
            gpu_model=_str(self.gpu_model, f"{n}.gpu_model", 128, min_len=1),
            frequencies=_frequencies(self.frequencies, f"{n}.frequencies"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "frequencies": list(self.frequencies)}


# ---- profiles on the wire ----------------------------------------------------------------------


def profile_to_wire(profile: Profile) -> dict[str, Any]:
    rows = [
        [stage, kind, p.frequency, p.time, p.energy]
        for (stage, kind), points in sorted(profile.points.items())
        for p in points
    ]
    return {"blocking_power_w": profile.blocking_power_w, "rows": rows, "meta": dict(profile.meta)}


def profile_from_wire(doc: Any, name: str) -> Profile:
    """A validated Profile from `{"blocking_power_w", "rows": [[stage, kind, MHz, s, J], ...], "meta"}`."""
    if not isinstance(doc, dict) or set(doc) - {"blocking_power_w", "rows", "meta"} or not {"blocking_power_w", "rows"} <= set(doc):
        raise ConfigError(f"{name} must be a map with blocking_power_w, rows and optionally meta, got {_show(doc)}")
    power = _float(doc["blocking_power_w"], f"{name}.blocking_power_w", 0.0, 100_000.0)
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or len(meta) > 64 or not all(isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= 1024 for k, v in meta.items()):
        raise ConfigError(f"{name}.meta must be a map of at most 64 short strings to strings")
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    for i, row in enumerate(_seq(doc["rows"], f"{name}.rows", MAX_PROFILE_ROWS, min_len=1)):
        where = f"{name}.rows[{i}]"
        row = _seq(row, where, 5, min_len=5)
        key = (_int(row[0], f"{where}.stage", 0, 1 << 20), _str(row[1], f"{where}.kind", 32, choices=KINDS))
        point = ProfilePoint(
            _int(row[2], f"{where}.frequency", 1, MAX_FREQUENCY_MHZ),
            _float(row[3], f"{where}.time", MIN_TIME_S, MAX_TIME_S),
            _float(row[4], f"{where}.energy", 0.0, MAX_ENERGY_J, open_lo=True),
        )
        points.setdefault(key, []).append(point)
    for pts in points.values():
        pts.sort(key=lambda p: p.frequency, reverse=True)
    profile = Profile(points, power, dict(meta))
    try:
        profile.validate()
    except ProfileError as e:
        raise ConfigError(f"{name}: {e}") from None
    return profile


# ---- requests and replies ------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisterJob(Message):
    TYPE: ClassVar[str] = "register_job"
    spec: JobSpec

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):
            _set(self, spec=JobSpec(**_fields_of(JobSpec, self.spec, "register_job.spec")))
        elif not isinstance(self.spec, JobSpec):
            raise ConfigError(f"register_job.spec must be a JobSpec, got {_show(self.spec)}")

    def to_wire(self) -> dict[str, Any]:
        return {"spec": self.spec.to_wire()}


@dataclass(frozen=True)
class JobRegistered(Message):
    job_id: str
    phase: str
    cached: bool  # the profile came from the state directory's cache: no profiling

    def __post_init__(self) -> None:
        _job_id(self.job_id, "job_id")
        _str(self.phase, "phase", 16, choices=tuple(p.value for p in JobPhase))
        _bool(self.cached, "cached")


@dataclass(frozen=True)
class RegisterRank(Message):
    TYPE: ClassVar[str] = "register_rank"
    job_id: str
    info: RankInfo

    def __post_init__(self) -> None:
        _job_id(self.job_id, "register_rank.job_id")
        if isinstance(self.info, dict):
            _set(self, info=RankInfo(**_fields_of(RankInfo, self.info, "register_rank.info")))
        elif not isinstance(self.info, RankInfo):
            raise ConfigError(f"register_rank.info must be a RankInfo, got {_show(self.info)}")

    def to_wire(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "info": self.info.to_wire()}


@dataclass(frozen=True)
class RankRegistered(Message):
    phase: str

    def __post_init__(self) -> None:
        _str(self.phase, "phase", 16, choices=tuple(p.value for p in JobPhase))


@dataclass(frozen=True)
class GetTable(Message):
    """A rank asks for its frequency table; `plan_version` is the plan it already holds (0: none)."""

    TYPE: ClassVar[str] = "get_table"
    job_id: str
    rank: int
    iteration: int = -1  # the rank's current iteration (-1: not started), so plans start in lockstep
    plan_version: int = 0

    def __post_init__(self) -> None:
        _job_id(self.job_id, "get_table.job_id")
        _int(self.rank, "get_table.rank", 0, MAX_RANKS - 1)
        _int(self.iteration, "get_table.iteration", -1, MAX_RANK_ITERATION)
        _int(self.plan_version, "get_table.plan_version", 0, MAX_ITERATION)


@dataclass(frozen=True)
class Table(Message):
    """Everything a rank needs to know what to run at any iteration.

    Iterations [0, warmup_iterations): max clocks. Then sweep frequency k for iterations
    warmup + k * iterations_per_frequency ... (until the rank's stage is profiled). From
    `plan_start_iteration` on, once a plan exists: `frequencies`, one per instruction of the
    rank in schedule order (None when the rank already holds `plan_version`, or no plan yet).
    `upload`: this rank uploads its stage profile -- it has the lowest data-parallel index
    among the ranks of its GPU model, stage and tensor-parallel index, whose profiles the
    service shares (omitted on the wire when true, as earlier releases had every rank upload).
    """

    phase: str
    warmup_iterations: int
    iterations_per_frequency: int
    sweep_frequencies: tuple[int, ...]
    profiled_stages: tuple[int, ...]
    plan_version: int
    plan_start_iteration: int
    frequencies: tuple[int, ...] | None
    error: str = ""
    upload: bool = True

    def __post_init__(self) -> None:
        _str(self.phase, "table.phase", 16, choices=tuple(p.value for p in JobPhase))
        _int(self.warmup_iterations, "table.warmup_iterations", 0, 1_000_000)
        _int(self.iterations_per_frequency, "table.iterations_per_frequency", 1, 10_000)
        _set(self, sweep_frequencies=_ints(self.sweep_frequencies, "table.sweep_frequencies", 1, MAX_FREQUENCY_MHZ, MAX_FREQUENCIES))
        _set(self, profiled_stages=_ints(self.profiled_stages, "table.profiled_stages", 0, 4095, 4096))
        _int(self.plan_version, "table.plan_version", 0, MAX_ITERATION)
        _int(self.plan_start_iteration, "table.plan_start_iteration", 0, MAX_ITERATION)
        if self.frequencies is not None:
            _set(self, frequencies=_ints(self.frequencies, "table.frequencies", 1, MAX_FREQUENCY_MHZ, MAX_INSTRUCTIONS))
        _str(self.error, "table.error", 4096, printable=False)
        _bool(self.upload, "table.upload")

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        doc["sweep_frequencies"] = list(self.sweep_frequencies)
        doc["profiled_stages"] = list(self.profiled_stages)
        doc["frequencies"] = None if self.frequencies is None else list(self.frequencies)
        if self.upload:
            del doc["upload"]  # the default
        return doc


@dataclass(frozen=True)
class UploadProfile(Message):
    """A rank's measured profile of its stage (rows of virtual stages it holds, with chunks)."""

    TYPE: ClassVar[str] = "upload_profile"
    job_id: str
    rank: int
    stage: int
    profile: Profile

    def __post_init__(self) -> None:
        _job_id(self.job_id, "upload_profile.job_id")
        _int(self.rank, "upload_profile.rank", 0, MAX_RANKS - 1)
        _int(self.stage, "upload_profile.stage", 0, 4095)
        if isinstance(self.profile, dict):
            _set(self, profile=profile_from_wire(self.profile, "upload_profile.profile"))
        elif isinstance(self.profile, Profile):
            self.profile.validate()
        else:
            raise ConfigError(f"upload_profile.profile must be a Profile, got {_show(self.profile)}")

    def to_wire(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "rank": self.rank, "stage": self.stage, "profile": profile_to_wire(self.profile)}


@dataclass(frozen=True)
class ReportIteration(Message):
    """One rank's measured time and energy (its GPU, including time blocked) for one iteration.

    `compute_time_s`, when the rank can tell, is the iteration's time without waiting for other
    data-parallel pipelines (the gradient synchronization): straggler detection compares
    pipelines by it (by `time_s` otherwise, which a synchronizing straggler makes equal)."""

    TYPE: ClassVar[str] = "report_iteration"
    job_id: str
    rank: int
    iteration: int
    time_s: float
    energy_j: float
    compute_time_s: float | None = None

    def __post_init__(self) -> None:
        _job_id(self.job_id, "report_iteration.job_id")
        _int(self.rank, "report_iteration.rank", 0, MAX_RANKS - 1)
        _int(self.iteration, "report_iteration.iteration", 0, MAX_RANK_ITERATION)
        _set(
            self,
            time_s=_float(self.time_s, "report_iteration.time_s", MIN_TIME_S, MAX_TIME_S),
            energy_j=_float(self.energy_j, "report_iteration.energy_j", 0.0, MAX_ENERGY_J),
        )
        if self.compute_time_s is not None:
            _set(self, compute_time_s=_float(self.compute_time_s, "report_iteration.compute_time_s", MIN_TIME_S, MAX_TIME_S))

    def to_wire(self) -> dict[str, Any]:
        doc = super().to_wire()
        if self.compute_time_s is None:
            del doc["compute_time_s"]  # what earlier releases send and accept
        return doc


@dataclass(frozen=True)
class DeclareStraggler(Message):
    """An operator declares pipeline (data-parallel index) `pipeline` slow by `factor` (1.2: its
    iterations take 1.2x its plan's time); the others are re-planned to that pace. `factor`
    None clears the declaration."""

    TYPE: ClassVar[str] = "declare_straggler"
    job_id: str
    pipeline: int
    factor: float | None

    def __post_init__(self) -> None:
        _job_id(self.job_id, "declare_straggler.job_id")
        _int(self.pipeline, "declare_straggler.pipeline", 0, MAX_RANKS - 1)
        if self.factor is not None:
            _set(self, factor=_float(self.factor, "declare_straggler.factor", 1.0, MAX_STRAGGLER_FACTOR))


@dataclass(frozen=True)
class Ack(Message):
    phase: str

    def __post_init__(self) -> None:
        _str(self.phase, "phase", 16, choices=tuple(p.value for p in JobPhase))


@dataclass(frozen=True)
class GetStatus(Message):
    TYPE: ClassVar[str] = "status"
    job_id: str | None = None  # None: every job

    def __post_init__(self) -> None:
        if self.job_id is not None:
            _job_id(self.job_id, "status.job_id")


def _opt_float(value: Any, name: str) -> float | None:
    """A status figure: any finite non-negative number (a job's energy summed over many ranks and
    iterations has no useful upper bound)."""
    return None if value is None else _float(value, name, 0.0, sys.float_info.max)


@dataclass(frozen=True)
class PipelineStatus(Message):
    """One data-parallel pipeline: its plan, the deadline it was planned for (None: no
    slowdown), and whether it is a straggler ("detected" or "declared", with its factor)."""

    pipeline: int
    plan_version: int
    deadline_s: float | None
    predicted_iteration_time_s: float | None
    measured_iteration_time_s: float | None  # median of recent iterations
    straggler: str = ""
    straggler_factor: float | None = None

    def __post_init__(self) -> None:
        _int(self.pipeline, "pipeline.pipeline", 0, MAX_RANKS - 1)
        _int(self.plan_version, "pipeline.plan_version", 0, MAX_ITERATION)
        _str(self.straggler, "pipeline.straggler", 16, choices=("", "detected", "declared"))
        for name in ("deadline_s", "predicted_iteration_time_s", "measured_iteration_time_s", "straggler_factor"):
            _set(self, **{name: _opt_float(getattr(self, name), f"pipeline.{name}")})


@dataclass(frozen=True)
class JobStatus(Message):
    """One job: its phase, and predicted (the plan, scaled to all ranks) against measured figures.

    Measured figures are means over iterations every rank reported: the iteration time is the
    slowest rank's, the energy the sum over ranks. `baseline_*` covers the warm-up iterations
    (max clocks), `planned_*` the iterations run with the current plan.
    """

    job_id: str
    phase: str
    world_size: int
    ranks_registered: int
    profiled_stages: tuple[int, ...]
    plan_version: int
    last_iteration: int
    error: str = ""
    warning: str = ""  # the job runs degraded, e.g. its state could not be saved (omitted on the wire when empty)
    predicted_iteration_time_s: float | None = None
    predicted_energy_j: float | None = None
    predicted_baseline_energy_j: float | None = None  # all ranks at max clocks, by the evaluator
    baseline_iterations: int = 0
    baseline_iteration_time_s: float | None = None
    baseline_energy_j: float | None = None
    planned_iterations: int = 0
    planned_iteration_time_s: float | None = None
    planned_energy_j: float | None = None
    pipelines: tuple[PipelineStatus, ...] = ()

    def __post_init__(self) -> None:
        _job_id(self.job_id, "job.job_id")
        _str(self.phase, "job.phase", 16, choices=tuple(p.value for p in JobPhase))
        _int(self.world_size, "job.world_size", 1, MAX_RANKS)
        _int(self.ranks_registered, "job.ranks_registered", 0, MAX_RANKS)
        _set(self, profiled_stages=_ints(self.profiled_stages, "job.profiled_stages", 0, 4095, 4096))
        _int(self.plan_version, "job.plan_version", 0, MAX_ITERATION)
        _int(self.last_iteration, "job.last_iteration", -1, MAX_ITERATION)
        _str(self.error, "job.error", 4096, printable=False)
        _str(self.warning, "job.warning", 4096, printable=False)
        _int(self.baseline_iterations, "job.baseline_iterations", 0, MAX_ITERATION)
        _int(self.planned_iterations, "job.planned_iterations", 0, MAX_ITERATION)
        for name in (
            "predicted_iteration_time_s",
            "predicted_energy_j",
            "predicted_baseline_energy_j",
            "baseline_iteration_time_s",
            "baseline_energy_j",
            "planned_iteration_time_s",
            "planned_energy_j",
        ):
            _set(self, **{name: _opt_float(getattr(self, name), f"job.{name}")})
        pipelines = _seq(self.pipelines, "job.pipelines", MAX_RANKS)
        _set(self, pipelines=tuple(p if isinstance(p, PipelineStatus) else PipelineStatus.from_wire(p) for p in pipelines))

    def to_wire(self) -> dict[str, Any]:
        doc = {**super().to_wire(), "profiled_stages": list(self.profiled_stages)}
        doc["pipelines"] = [p.to_wire() for p in self.pipelines]
        if not self.warning:
            del doc["warning"]  # what earlier releases send and accept
        return doc

    @property
    def predicted_saving(self) -> float | None:
        if self.predicted_energy_j is None or not self.predicted_baseline_energy_j:
            return None
        return 1.0 - self.predicted_energy_j / self.predicted_baseline_energy_j

    @property
    def measured_saving(self) -> float | None:
        if self.planned_energy_j is None or not self.baseline_energy_j:
            return None
        return 1.0 - self.planned_energy_j / self.baseline_energy_j


@dataclass(frozen=True)
class Status(Message):
    jobs: tuple[JobStatus, ...]

    def __post_init__(self) -> None:
        jobs = _seq(self.jobs, "status.jobs", 100_000)
        _set(self, jobs=tuple(j if isinstance(j, JobStatus) else JobStatus.from_wire(j) for j in jobs))

    def to_wire(self) -> dict[str, Any]:
        return {"jobs": [j.to_wire() for j in self.jobs]}


@dataclass(frozen=True)
class Ping(Message):
    TYPE: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    protocol: int
    server: str

    def __post_init__(self) -> None:
        _int(self.protocol, "protocol", 1, 1 << 16)
        _str(self.server, "server", 128)


# Request type -> (request class, reply class).
REQUESTS: dict[str, tuple[type[Message], type[Message]]] = {
    RegisterJob.TYPE: (RegisterJob, JobRegistered),
    RegisterRank.TYPE: (RegisterRank, RankRegistered),
    GetTable.TYPE: (GetTable, Table),
    UploadProfile.TYPE: (UploadProfile, Ack),
    ReportIteration.TYPE: (ReportIteration, Ack),
    DeclareStraggler.TYPE: (DeclareStraggler, Ack),
    GetStatus.TYPE: (GetStatus, Status),
    Ping.TYPE: (Ping, Pong),
}


# ---- envelopes -----------------------------------------------------------------------------------


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
    return _pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "error": {"code": code.value, "message": message}})


def decode_request(payload: bytes) -> tuple[int, Message]:
    """(request id, validated request) from one frame, or RequestRejected saying what is wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise RequestRejected(
            ErrorCode.TOO_LARGE,
            f"message is {len(payload)} bytes; the limit is {MAX_MESSAGE_BYTES} bytes (upload one stage's profile per message)",
        )
    try:
        doc = _unpack(payload)
    except Exception as e:
        raise RequestRejected(ErrorCode.BAD_FRAME, f"frame is not one msgpack map ({type(e).__name__}: {e}); send msgpack, never pickle") from None
    if not isinstance(doc, dict):
        raise RequestRejected(ErrorCode.BAD_FRAME, f"frame holds a msgpack {type(doc).__name__}, not a map; send {{'v': {PROTOCOL_VERSION}, 'id': ..., 'type': ..., ...}}")
    request_id = doc.pop("id", None)
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id <= MAX_ID:
        raise RequestRejected(ErrorCode.BAD_FIELD, f"id must be an integer in [0, {MAX_ID}], got {_show(request_id)}")
    version = doc.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # not True, not 1.0
        raise RequestRejected(
            ErrorCode.BAD_VERSION,
            f"protocol version {_show(version)} is not supported; this service speaks v{PROTOCOL_VERSION} "
            "(upgrade perseus on the ranks and the service to the same release)",
            request_id,
        )
    kind = doc.pop("type", None)
    if not isinstance(kind, str) or kind not in REQUESTS:
        raise RequestRejected(ErrorCode.UNKNOWN_TYPE, f"unknown request type {_show(kind)}; known: {', '.join(REQUESTS)}", request_id)
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
        raise ServiceError(ErrorCode.BAD_VERSION.value, f"reply is not a protocol v{PROTOCOL_VERSION} reply: {_show(doc)}")
    request_id = doc.pop("id", None)
    if not doc.pop("ok"):
        error = doc.get("error")
        if not isinstance(error, dict) or not isinstance(error.get("code"), str) or not isinstance(error.get("message"), str):
            raise ServiceError(ErrorCode.BAD_FRAME.value, f"error reply without a code and message: {_show(doc)}")
        return request_id, ServiceError(error["code"], error["message"])
    return request_id, doc
