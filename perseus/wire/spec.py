"""The job and its ranks as the wire carries them: `JobSpec` (what rank 0 registers) and
`RankInfo` (what every rank registers)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import KW_ONLY, dataclass
from typing import Any

from perseus.exceptions import ConfigError
from perseus.profiler.profile import KINDS
from perseus.schedules.builders import SCHEDULES
from perseus.schedules.instruction import STYLES
from perseus.wire.fields import (
    Message,
    check_bool,
    check_float,
    check_frequencies,
    check_int,
    check_seq,
    check_str,
    set_fields,
)
from perseus.wire.limits import MAX_INSTRUCTIONS, MAX_RANKS, MAX_SWEEP_STEPS
from perseus.wire.parallelism import RANK_MAPPINGS

#: How much slower than its target a planned iteration may run, unless a job says otherwise.
DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class JobSpec(Message):
    """A training job, as rank 0 registers it.

    `stage_orders`, when given, is each stage's instruction order as (kind, microbatch, chunk)
    triples (for example from a torch schedule's pipeline_order), and `overlapped` per stage the
    positions in it of instructions run overlapped with the next one (`Schedule.overlapped`);
    otherwise the schedule is
    `perseus.schedules.build_schedule(schedule_name, pp, num_microbatches, num_chunks)`.
    `sweep_frequencies` (MHz) defaults to every frequency the first registered rank supports.
    `blocking_power_w` overrides the blocking power the ranks' profiles carry (per GPU).
    `rank_mapping` says how ranks map to (stage, dp_index, tp_index): "explicit" (each rank
    states its own), "megatron" or "torch" (see perseus.wire.parallelism); with a named mapping
    the service checks every rank's stated coordinates against it.
    `instruction_overhead_s` (host work between a stage's instructions) and `hop_latency_s` (what
    a stage-to-stage hop takes beyond that host work) are optional overrides of what the service
    fits from the ranks' timelines (perseus.service.calibration), added to the profile at planning
    time (`Profile.with_overheads`); the cached profile stays as measured, so they are not part of
    the signature. `tolerance`: how much slower than its target (the measured baseline, or a
    straggler's pace) a planned iteration may run before the service re-plans
    (perseus.service.verification); 0.01 by default.
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
    overlapped: tuple[tuple[int, ...], ...] | None = None
    tag: str = ""
    gpu_model: str
    warmup_iterations: int = 2
    iterations_per_frequency: int = 2
    sweep_frequencies: tuple[int, ...] | None = None
    blocking_power_w: float | None = None
    rank_mapping: str = "explicit"
    instruction_overhead_s: float = 0.0
    hop_latency_s: float = 0.0
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        n = "JobSpec"
        world = check_int(self.world_size, f"{n}.world_size", 1, MAX_RANKS)
        pp = check_int(self.pp, f"{n}.pp", 1, 4096)
        dp = check_int(self.dp, f"{n}.dp", 1, MAX_RANKS)
        tp = check_int(self.tp, f"{n}.tp", 1, 4096)
        if pp * dp * tp != world:
            raise ConfigError(f"{n}: world_size {world} must equal pp * dp * tp = {pp} * {dp} * {tp} = {pp * dp * tp}")
        microbatches = check_int(self.num_microbatches, f"{n}.num_microbatches", 1, 1 << 20)
        chunks = check_int(self.num_chunks, f"{n}.num_chunks", 1, 256)
        if 2 * pp * microbatches * chunks > MAX_INSTRUCTIONS:
            raise ConfigError(
                f"{n}: {pp} stages x {microbatches} microbatches x {chunks} chunks is over {MAX_INSTRUCTIONS} "
                "instructions (forward and backward); plan with fewer microbatches per iteration"
            )
        set_fields(
            self,
            schedule_name=check_str(self.schedule_name, f"{n}.schedule_name", 64, min_len=1),
            schedule_style=check_str(self.schedule_style, f"{n}.schedule_style", 16, choices=STYLES),
            tag=check_str(self.tag, f"{n}.tag", 128),
            gpu_model=check_str(self.gpu_model, f"{n}.gpu_model", 128, min_len=1),
            warmup_iterations=check_int(self.warmup_iterations, f"{n}.warmup_iterations", 0, 1_000_000),
            iterations_per_frequency=check_int(
                self.iterations_per_frequency, f"{n}.iterations_per_frequency", 1, 10_000
            ),
            rank_mapping=check_str(self.rank_mapping, f"{n}.rank_mapping", 16, choices=RANK_MAPPINGS),
        )
        if self.stage_orders is not None:
            set_fields(
                self, stage_orders=_stage_orders(self.stage_orders, f"{n}.stage_orders", pp, microbatches, chunks)
            )
        elif self.schedule_name not in SCHEDULES:  # checked here: the service builds the schedule later, off its loop
            raise ConfigError(
                f"{n}.schedule_name {self.schedule_name!r} is not a schedule perseus builds ({', '.join(SCHEDULES)}); "
                "name one of those or give stage_orders"
            )
        if self.overlapped is not None:
            set_fields(self, overlapped=_overlapped(self.overlapped, f"{n}.overlapped", self.stage_orders))
        if self.sweep_frequencies is not None:
            set_fields(self, sweep_frequencies=check_frequencies(self.sweep_frequencies, f"{n}.sweep_frequencies"))
            check_sweep_size(len(self.sweep_frequencies), self.iterations_per_frequency, f"{n}.sweep_frequencies")
        if self.blocking_power_w is not None:
            set_fields(
                self, blocking_power_w=check_float(self.blocking_power_w, f"{n}.blocking_power_w", 0.0, 100_000.0)
            )
        for name in ("instruction_overhead_s", "hop_latency_s"):
            value = check_float(getattr(self, name), f"{n}.{name}", 0.0, 1.0)
            if value >= 1.0:
                raise ConfigError(f"{n}.{name} must be under 1 s (a per-instruction overhead), got {value}")
            set_fields(self, **{name: value})
        set_fields(self, tolerance=check_float(self.tolerance, f"{n}.tolerance", 0.0, 0.5, open_lo=True))

    def to_wire(self) -> dict[str, Any]:
        doc = self._fields()
        if self.stage_orders is not None:
            doc["stage_orders"] = [[list(t) for t in order] for order in self.stage_orders]
        if self.sweep_frequencies is not None:
            doc["sweep_frequencies"] = list(self.sweep_frequencies)
        if self.overlapped is not None:
            doc["overlapped"] = [list(positions) for positions in self.overlapped]
        return doc

    def _fields(self) -> dict[str, Any]:
        """The wire fields with sequences left as tuples (JSON and msgpack write them as lists)."""
        doc = super().to_wire()
        if self.rank_mapping == "explicit":
            del doc["rank_mapping"]  # the default: specs (and job ids) of earlier releases unchanged
        for name in ("instruction_overhead_s", "hop_latency_s"):
            if doc[name] == 0.0:
                del doc[name]  # likewise
        if doc["tolerance"] == DEFAULT_TOLERANCE:
            del doc["tolerance"]  # likewise
        if doc["overlapped"] is None:
            del doc["overlapped"]  # likewise
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


def check_sweep_size(frequencies: int, iterations_per_frequency: int, name: str) -> None:
    """ConfigError unless a sweep of `frequencies` clocks fits in a table (MAX_SWEEP_STEPS steps)."""
    steps = frequencies * iterations_per_frequency
    if steps > MAX_SWEEP_STEPS:
        raise ConfigError(
            f"{name}: {frequencies} clocks x {iterations_per_frequency} iterations_per_frequency is a sweep of "
            f"{steps} steps, over {MAX_SWEEP_STEPS}; sweep fewer clocks (JobSpec.sweep_frequencies) or fewer "
            "iterations per clock"
        )


def _stage_orders(value: Any, name: str, pp: int, microbatches: int, chunks: int) -> tuple:
    orders = check_seq(value, name, pp, min_len=pp)
    total = 0
    out = []
    for s, order in enumerate(orders):
        order = check_seq(order, f"{name}[{s}]", MAX_INSTRUCTIONS, min_len=1)
        total += len(order)
        if total > MAX_INSTRUCTIONS:
            raise ConfigError(f"{name}: more than {MAX_INSTRUCTIONS} instructions in all")
        row = _valid_order(order, microbatches, chunks)
        if row is None:  # something is wrong: find and name it
            row = tuple(
                _instruction(triple, f"{name}[{s}][{i}]", microbatches, chunks) for i, triple in enumerate(order)
            )
        out.append(row)
    return tuple(out)


def _overlapped(value: Any, name: str, orders: tuple | None) -> tuple[tuple[int, ...], ...]:
    """Per stage, increasing positions of instructions overlapped with the next one."""
    if orders is None:
        raise ConfigError(f"{name} needs stage_orders: it names positions in them")
    stages = check_seq(value, name, len(orders), min_len=len(orders))
    out = []
    for s, positions in enumerate(stages):
        where = f"{name}[{s}]"
        last = len(orders[s]) - 2
        row = tuple(
            check_int(i, f"{where}[{k}]", 0, max(last, 0)) for k, i in enumerate(check_seq(positions, where, last + 1))
        )
        if last < 0 and row or list(row) != sorted(set(row)):
            raise ConfigError(
                f"{where} must list distinct, increasing positions in 0..{last} (an instruction run overlapped with "
                f"the next one), got {list(row)[:8]}"
            )
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
    triple = check_seq(triple, where, 3, min_len=3)
    kind = triple[0].value if hasattr(triple[0], "value") else triple[0]
    return (
        check_str(kind, f"{where}.kind", 32, choices=KINDS),
        check_int(triple[1], f"{where}.microbatch", 0, microbatches - 1),
        check_int(triple[2], f"{where}.chunk", 0, chunks - 1),
    )


@dataclass(frozen=True)
class RankInfo(Message):
    """One rank: its pipeline stage, data- and tensor-parallel indices, GPU and its frequencies
    (MHz). `timeline`: the rank sends its instruction spans when the service asks (Table.spans);
    the service calibrates its model of the job on them (ranks of earlier releases do not)."""

    rank: int
    stage: int
    _: KW_ONLY
    dp_index: int = 0
    tp_index: int = 0
    gpu_model: str
    frequencies: tuple[int, ...]
    timeline: bool = False

    def __post_init__(self) -> None:
        n = "RankInfo"
        set_fields(
            self,
            rank=check_int(self.rank, f"{n}.rank", 0, MAX_RANKS - 1),
            stage=check_int(self.stage, f"{n}.stage", 0, 4095),
            dp_index=check_int(self.dp_index, f"{n}.dp_index", 0, MAX_RANKS - 1),
            tp_index=check_int(self.tp_index, f"{n}.tp_index", 0, 4095),
            gpu_model=check_str(self.gpu_model, f"{n}.gpu_model", 128, min_len=1),
            frequencies=check_frequencies(self.frequencies, f"{n}.frequencies"),
            timeline=check_bool(self.timeline, f"{n}.timeline"),
        )

    def to_wire(self) -> dict[str, Any]:
        doc = {**super().to_wire(), "frequencies": list(self.frequencies)}
        if not self.timeline:
            del doc["timeline"]  # what earlier releases send and accept
        return doc


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
