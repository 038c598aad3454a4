"""Stateful fuzz of the planner service: one real `perseus serve`, restarted on its state directory,
driven through sequences of valid and nearly-valid requests while its disk fails under it.

    python benchmarks/service_stateful_fuzz.py [--steps 100000] [--seed 1] [--clients 4]

A seeded state machine (plain `random.Random`, so 100,000 steps run in minutes; the CI test,
tests/server/test_stateful_fuzz.py, runs the same machine for a few hundred steps). Each step is
one chaos action: a request from one of --clients DEALER sockets (sometimes a burst: several
sockets send at once, then every reply is collected), drawn from
  register_job       a job of a fixed seeded pool (pp 1-4, dp 1-3, tp 1-2, gpipe/1f1b, 1-6
                     microbatches, A100-SXM or A40, explicit/megatron/torch rank mapping), now and
                     then a new one; nearly valid: one spec field off, or stage orders the worker
                     then rejects (a job that fails)
  register_rank      the rank's coordinates under the job's mapping; nearly valid: shifted stage,
                     dp/tp index or rank out of range, another GPU model, sweep frequencies
                     missing, another rank's coordinates, an unknown job
  get_table          the rank's iteration (in order, out of order, -1, huge up to the protocol's
                     MAX_ITERATION) and plan versions up to MAX_ITERATION
  upload_profile     the stage's simulated profile; unsupported frequencies, times of 5e-324,
                     energies of 1e9 J per row; nearly valid: wrong stage, rows missing, a zero
                     time, an energy over the limit, a repeated frequency, ...
  report_iteration   in order and out of order, times and energies from 5e-324 to the limits
  report_spans       one rank's instruction spans: valid (a baseline iteration, or one the
                     service ignores: iteration 0, profiling at a clock); nearly valid (one
                     instruction more or fewer than the rank's stage runs); hostile (overlapping,
                     unordered, past the step, negative, floats, begins and ends of different
                     lengths, over MAX_INSTRUCTIONS, zero step, an unknown phase or job)
  a training step    every rank of a job reports one iteration (so tallies complete and the
                     straggler detector decides), one pipeline at its own pace for a few
                     iterations (slower, 5e-324 s, the maximum time), half of the time with every
                     rank's spans of it (so timelines complete and the service calibrates on
                     them, ranks registering `timeline`); then `status` of every job
  declare_straggler  factors 1-10 and None (a job of one pipeline refuses a factor); nearly valid:
                     no such pipeline, factor out of range
  status / ping      every job, one job, an unknown job
Beside the chaos traffic a "sentinel" job (2 stages) is driven from its own socket with valid
requests only, as a well-behaved client would (retrying not_ready, re-registering after a lost
registration, re-uploading a stage its table says is unprofiled), and a ping goes out every
--ping-every steps on a third socket.

Faults, drawn from a second seeded stream (so the requests of a seed do not depend on them):
  restarts           SIGTERM (70%) or SIGKILL (30%), every --restart-every steps on average; before
                     40% of them a state file (not the sentinel's) is corrupted: truncated, binary
                     junk, empty, `null`, `[]`, or one field of the wrong type (plans="x")
  disk faults        the state directory lives on a tmpfs mount of --tmpfs-mb MiB made for the run:
                     filled up (a filler file to ENOSPC, deleted at the end of the fault) or
                     remounted read-only, for 30-400 steps; without mount rights a chaos job's
                     folder is replaced by a plain file (ENOTDIR) instead, and the output says so.
                     Read-only and ENOTDIR faults end before a restart; a full disk may span one.

Invariants, checked as the run goes (each violation is printed with the seed and step):
  (a) alive          the service runs except during deliberate restarts, starts again on its
                     state directory (whatever was corrupted), and answers every request within
                     --reply-timeout; ping round trips p99 < --ping-p99-ms (checked at the end)
  (b) memory         its RSS stays under --rss-limit-mb
  (c) durability     after every restart, every job whose register_job was acknowledged (ok) is
                     still there, and every stage whose profile uploads (every tensor-parallel
                     share, on the job's GPU model) were acknowledged is still listed as profiled
                     or the job has a plan -- unless a file of that job (or its cached profile)
                     was deliberately corrupted after the acknowledgement, or the service dropped
                     the job's profile on purpose (its status says why: `profile_dropped`, the
                     spans sent showed another workload than the profile's). Acknowledgements
                     given while the disk refused writes are NOT exempt: the service must answer
                     an error rather than acknowledge what it could not save.
  (d) isolation      `status` of every job always succeeds; the sentinel's status and tables
                     always succeed (a lost rank registration is forgiven only after a SIGKILL,
                     a crash, or a disk fault since it registered) and it reaches a plan within
                     --plan-timeout of its last upload, whatever the other clients do
  (e) answers        no reply is an `internal` error unless the disk refused writes meanwhile; a
                     request the protocol accepts (get_table, report_iteration, status, ping,
                     declare_straggler) is not refused with an error its own fields cannot cause
Prints steps, restarts, disk faults, replies per error code and per action, ping latency
p50/p99/max, max RSS, the violations and the total time. Exits 1 on any violation.

Whether a request is valid is decided by the protocol's own decode_request in this process, so the
fuzzer follows the protocol's limits of whichever perseus it runs with. To run it against another
tree's service (say, HEAD while the working tree is mid-edit): `cd /tmp && PYTHONPATH=<that tree>
python <repo>/benchmarks/service_stateful_fuzz.py` (the service is `python -m perseus.cli.main`,
which puts the current directory first on its path). A violation's seed and step replay the same
requests (--trace writes them all); the service's answers, and so the exact state, depend on timing.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_fuzz import Fuzzer, pack
from service_support import PRESET, ServeProcess, stage_profile

from perseus.devices.sim_presets import SimPreset, get_preset
from perseus.schedules import build_schedule
from perseus.service.iterations import LEAD
from perseus.wire import limits
from perseus.wire.envelope import RequestRejected, decode_request
from perseus.wire.limits import MAX_INSTRUCTIONS, MAX_ITERATION, MAX_RANKS, SWEEP_VERSION
from perseus.wire.parallelism import rank_coordinates
from perseus.wire.profiles import profile_to_wire
from perseus.wire.spec import JobSpec

# The protocol's limits (later releases name them; these defaults are the earlier literals). Which
# requests are valid is not decided here: every request is checked with the protocol's own
# decode_request, as the service checks it (see `wire_valid`).
MAX_RANK_ITERATION = getattr(limits, "MAX_RANK_ITERATION", MAX_ITERATION)  # what a rank may send
MIN_TIME_S = getattr(limits, "MIN_TIME_S", 5e-324)
MAX_TIME_S = getattr(limits, "MAX_TIME_S", 1e7)
MAX_ENERGY_J = getattr(limits, "MAX_ENERGY_J", 1e12)

PRESETS: tuple[SimPreset, ...] = (PRESET, get_preset("a40"))
INITIAL_JOBS = 10  # the chaos job pool; "new job" actions grow it up to MAX_JOBS
MAX_JOBS = 40
TINY = 5e-324  # the smallest positive double: valid for every "> 0" field of the protocol
TRAIN_STRETCH = 9  # iterations of a training stretch: a calibration's 8 baseline iterations after the first
STRAGGLER_FACTORS = (None, 1.0, 1.1, 1.25, 2.0, 10.0)  # few distinct deadlines: re-plans stay bounded
WRITES = frozenset({"register_job", "register_rank", "upload_profile", "report_iteration", "declare_straggler"})
STRICT_ALLOWED = {  # error codes a request the protocol accepts may get from the service's state
    "ping": frozenset(),
    "status": frozenset({"unknown_job"}),  # one job: it may never have been registered
    "get_table": frozenset({"unknown_job", "unknown_rank"}),
    "report_iteration": frozenset({"unknown_job", "unknown_rank"}),
    "declare_straggler": frozenset({"unknown_job"}),
    "report_spans": frozenset({"unknown_job", "unknown_rank"}),
    "register_job": frozenset(),
    # Valid on the wire, but other clients' registrations may conflict with them (coordinates
    # taken, sweep frequencies set by another GPU model, a tensor-parallel share that differs).
    "register_rank": frozenset({"unknown_job", "bad_field"}),
    "upload_profile": frozenset({"unknown_job", "unknown_rank", "not_ready", "bad_field"}),
}


# ---- the jobs ---------------------------------------------------------------------------------------


def wire_valid(frame: bytes) -> bool:
    """Whether the protocol (this interpreter's perseus, the same as the service's) accepts the frame."""
    try:
        decode_request(frame)
    except RequestRejected:
        return False
    return True


def coordinates(spec: JobSpec, rank: int) -> tuple[int, int, int]:
    """(stage, dp_index, tp_index) of `rank`: the job's mapping's, Megatron's for explicit jobs."""
    mapping = "megatron" if spec.rank_mapping == "explicit" else spec.rank_mapping
    return rank_coordinates(mapping, rank, spec.pp, spec.dp, spec.tp)


@dataclass
class Ack:
    step: int
    t: float
    during_fault: bool
    note: str = ""


@dataclass
class JobModel:
    """One job: its spec (what the generators draw from, seeded) and what the service acknowledged
    (updated from replies). Acknowledgements before `epoch` are exempt from the durability check
    (a file they depend on was corrupted on purpose)."""

    spec: JobSpec
    preset: SimPreset
    sentinel: bool = False
    iteration: int = 0  # the generators' iteration counter (seeded stream only)
    pace: tuple[int, str, float] | None = (
        None  # training: (the odd pipeline, its pace's name, factor), kept a few iterations
    )
    registered: Ack | None = None  # last register_job ok after `epoch`
    ranks: dict[int, tuple[tuple[int, int, int], str, bool]] = field(
        default_factory=dict
    )  # rank -> (coords, GPU model, certain)
    shares: dict[tuple[int, int], Ack] = field(
        default_factory=dict
    )  # (stage, tp_index) -> first ok upload on the job's model
    refused_writes: set[tuple[int, int]] = field(default_factory=set)  # shares whose upload got `internal` (disk)
    epoch: float = -math.inf

    @property
    def job_id(self) -> str:
        return self.spec.job_id()

    def forget(self, now: float) -> None:
        """A file of this job was corrupted: what was acknowledged before may be gone."""
        self.epoch = now
        self.registered = None
        self.shares.clear()
        self.ranks = {r: (c, m, False) for r, (c, m, _) in self.ranks.items()}


def random_spec(rng: random.Random, tag: str) -> tuple[JobSpec, SimPreset]:
    pp, dp, tp = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 2)
    preset = rng.choice(PRESETS)
    spec = JobSpec(
        pp * dp * tp,
        pp,
        dp=dp,
        tp=tp,
        schedule_name=rng.choice(["gpipe", "1f1b"]),
        num_microbatches=rng.randint(1, 6),
        gpu_model=preset.product,
        warmup_iterations=rng.randint(0, 2),
        iterations_per_frequency=rng.randint(1, 2),
        rank_mapping=rng.choice(["explicit", "megatron", "torch"]),
        tag=tag,
    )
    return spec, preset


_INSTRUCTIONS: dict[str, tuple[int, ...]] = {}


def instructions(spec: JobSpec, stage: int) -> int:
    """How many instructions `stage` of the job runs per iteration (what valid spans hold)."""
    if spec.job_id() not in _INSTRUCTIONS:
        schedule = build_schedule(spec.schedule_name, spec.pp, spec.num_microbatches, spec.num_chunks)
        _INSTRUCTIONS[spec.job_id()] = tuple(len(row) for row in schedule.stages)
    return _INSTRUCTIONS[spec.job_id()][stage]


def spans_wire(rng: random.Random, count: int, scale_us: int) -> tuple[int, list[int], list[int]]:
    """(step, begins, ends) in whole microseconds: `count` instructions in order, with gaps."""
    begins, ends, now = [], [], rng.randint(0, scale_us)
    for _ in range(count):
        now += rng.randint(0, scale_us // 4)
        begins.append(now)
        now += rng.randint(1, scale_us)
        ends.append(now)
    return now + rng.randint(1, scale_us), begins, ends


def info_wire(spec: JobSpec, rank: int, preset: SimPreset, /, **over: Any) -> dict[str, Any]:
    stage, dp_index, tp_index = coordinates(spec, rank)
    doc = {
        "rank": rank,
        "stage": stage,
        "dp_index": dp_index,
        "tp_index": tp_index,
        "gpu_model": preset.product,
        "frequencies": list(preset.frequencies),
    }
    doc.update(over)
    return doc


_PROFILES: dict[tuple[str, int, int], dict[str, Any]] = {}


def profile_wire(preset: SimPreset, stage: int, pp: int) -> dict[str, Any]:
    key = (preset.product, stage, pp)
    if key not in _PROFILES:
        _PROFILES[key] = profile_to_wire(stage_profile(stage, pp, preset))
    doc = _PROFILES[key]
    return {"blocking_power_w": doc["blocking_power_w"], "rows": [list(r) for r in doc["rows"]], "meta": {}}


def profile_variant(rng: random.Random, preset: SimPreset, stage: int, pp: int) -> tuple[str, dict[str, Any], bool]:
    """(variant, profile map, valid on the wire) for a rank of `stage`."""
    doc = profile_wire(preset, stage, pp)
    rows = doc["rows"]
    name = rng.choices(
        [
            "valid",
            "unsupported_freqs",
            "tiny_times",
            "tiny_one",
            "huge_energy",
            "wrong_stage",
            "no_backward",
            "zero_time",
            "over_energy",
            "repeated_freq",
            "bad_power",
            "extra_field",
            "sideways",
        ],
        [40, 8, 6, 4, 6, 3, 3, 2, 2, 2, 1, 1, 1],
    )[0]
    valid = True
    if name == "unsupported_freqs":  # frequencies no GPU of the job has
        doc["rows"] = [
            [stage, kind, f, t, e]
            for kind in ("forward", "backward")
            for f, (_, _, _, t, e) in zip((99_000, 4321, 3), [r for r in rows if r[1] == kind])
        ]
    elif name == "tiny_times":
        for r in rows:
            r[3] = TINY
    elif name == "tiny_one":
        rows[0][3] = TINY
    elif name == "huge_energy":
        for r in rows:
            r[4] = 1e9
    else:
        valid = name == "valid"
        if name == "wrong_stage":
            for r in rows:
                r[0] = stage + 1 if stage + 1 < pp or stage == 0 else stage - 1
        elif name == "no_backward":
            doc["rows"] = [r for r in rows if r[1] != "backward"]
        elif name == "zero_time":
            rows[rng.randrange(len(rows))][3] = 0.0
        elif name == "over_energy":
            rows[rng.randrange(len(rows))][4] = 1.5e9
        elif name == "repeated_freq":
            rows.append(list(rows[0]))
        elif name == "bad_power":
            doc["blocking_power_w"] = -1.0
        elif name == "extra_field":
            doc["surprise"] = 1
        elif name == "sideways":
            rows[0][1] = "sideways"
    return name, doc, valid


# ---- requests -----------------------------------------------------------------------------------------


@dataclass
class Req:
    label: str  # "<type>/<variant>": replies are counted per label
    kind: str
    fields: dict[str, Any]
    job: JobModel | None = None
    # Set on sending: whether the protocol accepts it (then errors outside STRICT_ALLOWED[kind] | allow are violations).
    valid: bool = True
    allow: frozenset = frozenset()  # further error codes this (state-dependent) request may get
    nearly: bool = False  # drawn as nearly valid (one field off): its acceptance is noted
    on_reply: Callable[[dict[str, Any], float, float], None] | None = None  # (reply, sent at, received at)


@dataclass
class Report:
    seed: int = 0
    steps: int = 0
    restarts: Counter = field(default_factory=Counter)  # "SIGTERM", "SIGKILL", "crash"
    exit_codes: Counter = field(default_factory=Counter)  # exit codes of deliberate stops, by signal
    corruptions: Counter = field(default_factory=Counter)
    corrupted: list[str] = field(default_factory=list)  # "step N: path: how"
    faults: Counter = field(default_factory=Counter)
    fault_mode: str = ""
    codes: Counter = field(default_factory=Counter)  # "ok" or the error code
    labels: Counter = field(default_factory=Counter)  # label -> sent
    labels_ok: Counter = field(default_factory=Counter)
    ping_ms: list[float] = field(default_factory=list)
    reply_ms: list[float] = field(default_factory=list)
    max_rss_mb: float = 0.0
    violations: list[tuple[str, int, str]] = field(default_factory=list)  # (invariant, step, what)
    observations: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # first example of each observation
    sentinel_planned_s: float | None = None
    seconds: float = 0.0
    disk_peak_kb: int = 0

    def violation(self, invariant: str, step: int, what: str) -> None:
        self.violations.append((invariant, step, what))

    def observe(self, what: str, example: str) -> None:
        self.observations[what] += 1
        self.examples.setdefault(what, example)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the disk -------------------------------------------------------------------------------------------


class Disk:
    """The state directory on a tmpfs mount of its own, and the faults injected into it."""

    def __init__(self, root: Path, size_mb: int, use_mount: bool, report: Report) -> None:
        self.root = root
        self.mnt = root / "mnt"
        self.mnt.mkdir()
        self.mounted = False
        self.report = report
        why = "--no-mount"
        if use_mount:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(self.mnt)],
                capture_output=True,
                text=True,
            )
            self.mounted = done.returncode == 0
            why = (done.stderr or done.stdout).strip() or f"mount exit code {done.returncode}"
        report.fault_mode = (
            f"tmpfs of {size_mb} MiB: full disk (ENOSPC) and read-only remounts"
            if self.mounted
            else f"no mount ({why}): a chaos job's folder replaced by a plain file (ENOTDIR)"
        )
        self.state = self.mnt / "state"
        self.fault: str | None = None
        self.fault_end_step = 0
        self.hidden: tuple[Path, Path] | None = None  # (job folder, where it was moved)
        self.windows: list[
            list[Any]
        ] = []  # [start, end, job id or None] of every fault (end inf while active; a job: only its folder)

    def kinds(self) -> list[str]:
        return ["enospc", "readonly"] if self.mounted else ["notdir"]

    def refused_between(self, t0: float, t1: float, job_id: str | None = None) -> bool:
        """Whether writes (of `job_id`'s files; None: any) were refused at some time in [t0, t1]."""
        return any(
            start <= t1 and t0 <= end and (victim is None or job_id is None or victim == job_id)
            for start, end, victim in self.windows
        )

    def start(self, kind: str, end_step: int, victim: Path | None) -> bool:
        if kind == "enospc":
            try:
                with open(self.mnt / "filler", "wb") as f:
                    chunk = b"\xa5" * 65536
                    while True:
                        f.write(chunk)
                        f.flush()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
            # tmpfs may still take a few bytes: top it up with ever smaller writes.
            for size in (4096, 512, 64, 1):
                try:
                    with open(self.mnt / f"filler-{size}", "wb") as f:
                        while True:
                            f.write(b"\0" * size)
                            f.flush()
                except OSError:
                    pass
        elif kind == "readonly":
            if not self._remount("ro"):
                return False
        elif kind == "notdir":
            if victim is None or not victim.is_dir():
                return False
            moved = victim.with_name("." + victim.name + ".moved")
            victim.rename(moved)
            victim.write_text("not a folder\n")
            self.hidden = (victim, moved)
        self.fault, self.fault_end_step = kind, end_step
        self.windows.append(
            [time.monotonic(), math.inf, self.hidden[0].name if kind == "notdir" and self.hidden else None]
        )
        self.report.faults[kind] += 1
        return True

    def end(self) -> None:
        if self.fault is None:
            return
        if self.fault == "enospc":
            for path in self.mnt.glob("filler*"):
                path.unlink()
        elif self.fault == "readonly":
            if not self._remount("rw"):
                raise RuntimeError(f"cannot remount {self.mnt} read-write")
        elif self.fault == "notdir" and self.hidden is not None:
            victim, moved = self.hidden
            victim.unlink()
            moved.rename(victim)
            self.hidden = None
        self.fault = None
        self.windows[-1][1] = time.monotonic()

    def _remount(self, mode: str) -> bool:
        for _ in range(50):  # EBUSY while a file is open for writing
            if subprocess.run(["mount", "-o", f"remount,{mode}", str(self.mnt)], capture_output=True).returncode == 0:
                return True
            time.sleep(0.02)
        return False

    def used_kb(self) -> int:
        if not self.mounted:
            return 0
        st = os.statvfs(self.mnt)
        return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024

    def close(self) -> None:
        try:
            self.end()
        finally:
            if self.mounted:
                if subprocess.run(["umount", str(self.mnt)], capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
                self.mounted = False


def corrupt_file(rng: random.Random, path: Path) -> str:
    """Damage `path` in one of several ways; the way."""
    original = path.read_bytes()
    how = rng.choice(["truncate", "junk", "empty", "null", "list", "wrong_type", "wrong_type", "wrong_type"])
    data: bytes
    if how == "truncate":
        data = original[: rng.randrange(max(1, len(original)))]
    elif how == "junk":
        data = rng.randbytes(rng.randint(1, 200))
    elif how == "empty":
        data = b""
    elif how == "null":
        data = b"null"
    elif how == "list":
        data = b"[]"
    else:
        try:
            doc = json.loads(original)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not doc:
            how, data = "null", b"null"
        else:
            key = rng.choice(sorted(doc))
            value = rng.choice(["x", 5, -1, None, [], {}, [1, "x"], {"x": "y"}, 1e308, True])
            doc[key] = value
            how = f"{key}={json.dumps(value)}"
            data = json.dumps(doc).encode()
    path.write_bytes(data)
    return how


# ---- the machine ----------------------------------------------------------------------------------------


class Abort(Exception):
    """The service cannot be brought back: the run ends here."""


class StatefulFuzz:
    def __init__(
        self,
        workdir: Path,
        *,
        seed: int,
        clients: int = 4,
        reply_timeout_s: float = 5.0,
        ping_every: int = 10,
        sentinel_every: int = 4,
        restart_every: int = 2500,
        fault_every: int = 4000,
        corrupt_probability: float = 0.4,
        forced_restarts: dict[int, tuple[str, bool]] | None = None,
        forced_faults: dict[int, tuple[str | None, int]] | None = None,
        rss_limit_mb: float = 1024.0,
        plan_timeout_s: float = 90.0,
        tmpfs_mb: int = 16,
        use_mount: bool = True,
        trace: Path | None = None,
        progress_every: int = 0,
    ) -> None:
        self.workdir = workdir
        self.seed = seed
        self.rng = random.Random(seed)  # the requests
        self.events = random.Random(seed * 7919 + 1)  # restarts, faults, corruption
        self.n_clients = max(1, clients)
        self.reply_timeout_s = reply_timeout_s
        self.ping_every = max(1, ping_every)
        self.sentinel_every = max(1, sentinel_every)
        self.restart_every = restart_every
        self.fault_every = fault_every
        self.corrupt_probability = corrupt_probability
        self.forced_restarts = forced_restarts or {}
        self.forced_faults = forced_faults or {}
        self.rss_limit_mb = rss_limit_mb
        self.plan_timeout_s = plan_timeout_s
        self.progress_every = progress_every
        self.report = Report(seed=seed)
        self.tmpfs_mb, self.use_mount = tmpfs_mb, use_mount
        self.disk: Disk | None = None  # mounted by run()
        self.trace = open(trace, "w") if trace else None
        self.step = 0
        self.next_id = 0
        self.starts = 0
        self.service: ServeProcess | None = None
        self.chaos: list[Fuzzer] = []
        self.sentinel_sock: Fuzzer | None = None
        self.ping_sock: Fuzzer | None = None
        self.jobs: list[JobModel] = []
        for _ in range(INITIAL_JOBS):
            self._new_job()
        sentinel_spec = JobSpec(
            2,
            2,
            schedule_name="1f1b",
            num_microbatches=4,
            gpu_model=PRESET.product,
            warmup_iterations=1,
            iterations_per_frequency=1,
            tag=f"sentinel-{seed}",
        )
        self.sentinel = JobModel(sentinel_spec, PRESET, sentinel=True)
        self.s_phase = "register_job"
        self.s_pending_uploads: set[int] = set()
        self.s_iteration = 0
        self.s_tick = 0
        self.s_deadline: float | None = None  # plan expected by then (set once every stage is acknowledged)
        self.s_planned_at: float | None = None
        self.started_at = time.monotonic()
        self.service_started_at = 0.0
        self.last_refused = False  # whether the disk refused writes while the last request was served

    # ---- service lifecycle -------------------------------------------------------------------------

    def _start(self) -> None:
        self.starts += 1
        log = self.workdir / f"serve-{self.starts}.log"
        self.service = ServeProcess(self.disk.state, log, log_level="info")
        self._connect()

    def _connect(self) -> None:
        assert self.service is not None
        alive = self.service.alive
        for sock in [*self.chaos, self.sentinel_sock, self.ping_sock]:
            if sock is not None:
                sock.close()
        self.chaos = [Fuzzer(self.service.endpoint, self.reply_timeout_s, alive) for _ in range(self.n_clients)]
        self.sentinel_sock = Fuzzer(self.service.endpoint, self.reply_timeout_s, alive)
        self.ping_sock = Fuzzer(self.service.endpoint, self.reply_timeout_s, alive)

    def _lose_registrations(self, lossy: bool) -> None:
        """After a SIGKILL, a crash or a disk fault: rank registrations (saved in batches) may be gone."""
        if lossy:
            for job in self.jobs + [self.sentinel]:
                job.ranks = {r: (c, m, False) for r, (c, m, _) in job.ranks.items()}

    def restart(self, how: str, corrupt: bool) -> None:
        """Stop the service (SIGTERM/SIGKILL; "crash": it already died), maybe corrupt a state file, start it again."""
        assert self.service is not None
        if self.disk.fault in ("readonly", "notdir"):
            self.disk.end()
        t_stop = time.monotonic()
        fault_since_start = self.disk.refused_between(self.service_started_at, t_stop)
        sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM
        code = self.service.stop(sig)
        self.report.restarts[how] += 1
        if how != "crash":
            self.report.exit_codes[f"{how}: {code}"] += 1
            if how == "SIGTERM" and code != 0:
                self.report.observe(
                    "a SIGTERM stop exited non-zero",
                    f"step {self.step}: exit code {code}; log: {self._log_tail(self.service)}",
                )
        self._lose_registrations(how != "SIGTERM" or code != 0 or fault_since_start)
        corrupted: tuple[Path, bytes, str] | None = None
        if corrupt:
            corrupted = self._corrupt()
        try:
            self._start()
        except RuntimeError as e:
            what = (
                f" (after corrupting {corrupted[0].relative_to(self.disk.state)}: {corrupted[2]})" if corrupted else ""
            )
            self.report.violation(
                "a:start",
                self.step,
                f"the service did not start on its state directory{what}: "
                f"{' | '.join(x.strip() for x in str(e).splitlines()[-8:] if set(x.strip()) != {'^'})}",
            )
            if corrupted is not None:
                corrupted[0].write_bytes(corrupted[1])  # put the file back and try again
            self.disk.end()
            try:
                self._start()
            except RuntimeError as e2:
                raise Abort(f"the service did not start again after the file was put back: {str(e2)[-1500:]}") from None
        self.service_started_at = time.monotonic()
        self.check_durable()

    def _log_tail(self, service: ServeProcess, lines: int = 12) -> str:
        """The end of the service's log, on one line (a traceback: its last frames and the error)."""
        try:
            text = service.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        tail = [line.strip() for line in text[-lines:] if line.strip() and set(line.strip()) != {"^"}]
        return " | ".join(tail)

    def _corrupt(self) -> tuple[Path, bytes, str] | None:
        if self.disk.fault == "enospc":
            return None  # the damaged file could not be written whole
        rng = random.Random(self.seed * 1_000_003 + self.step)
        state = self.disk.state
        sentinel_dir = state / "jobs" / self.sentinel.job_id
        sentinel_cache = state / "profiles" / f"{self.sentinel.spec.profile_key()}.json"
        files = sorted(p for p in state.glob("jobs/*/*.json") if p.parent != sentinel_dir)
        files += sorted(p for p in state.glob("profiles/*.json") if p != sentinel_cache)
        if not files:
            return None
        # One kind of file first (job records most often: they hold the most), then one file of that kind.
        kinds = {"job.json": 40, "spec.json": 15, "stage-": 20, "plan": 15, "profiles": 10}
        by_kind = {
            k: [f for f in files if (f.parent.name == "profiles") == (k == "profiles") and f.name.startswith(k)]
            for k in kinds
        }
        by_kind["profiles"] = [f for f in files if f.parent.name == "profiles"]
        choices = [k for k in kinds if by_kind[k]]
        kind_of_file = rng.choices(choices, [kinds[k] for k in choices])[0]
        path = rng.choice(by_kind[kind_of_file])
        original = path.read_bytes()
        how = corrupt_file(rng, path)
        now = time.monotonic()
        kind = "job" if path.parent.parent.name == "jobs" else "cached profile"
        self.report.corruptions[f"{kind} {path.name.split('-')[0].removesuffix('.json')}: {how.split('=')[0]}"] += 1
        self.report.corrupted.append(f"step {self.step}: {path.relative_to(state)}: {how[:80]}")
        for job in self.jobs:
            if (kind == "job" and path.parent.name == job.job_id) or (
                kind == "cached profile" and path.stem in {job.spec.profile_key(p.product) for p in PRESETS}
            ):
                job.forget(now)
        return path, original, how

    # ---- sending ------------------------------------------------------------------------------------

    def exchange(self, sock: Fuzzer, req: Req) -> dict | None:
        return self.burst([(sock, req)])[0]

    def burst(self, pairs: list[tuple[Fuzzer, Req]]) -> list[dict | None]:
        """Send every request (one per socket), then collect every reply."""
        sent = []
        for sock, req in pairs:
            self.next_id += 1
            rid = self.next_id
            frame = pack({"v": 1, "id": rid, "type": req.kind, **req.fields})
            req.valid = wire_valid(frame)
            sock.sock.send(frame)
            sent.append((sock, req, rid, time.monotonic()))
            self.report.labels[req.label] += 1
        replies: list[dict | None] = []
        for sock, req, rid, t0 in sent:
            reply = None
            while True:  # in slices: a crashed service is noticed at once, not after the timeout
                remaining = t0 + self.reply_timeout_s - time.monotonic()
                if sock.sock.poll(max(1, min(100, int(remaining * 1000) + 1))):
                    reply = msgpack.unpackb(sock.sock.recv(), raw=False)
                    break
                if remaining <= 0 or not self.service.alive():
                    break
            t1 = time.monotonic()
            replies.append(self._check(sock, req, rid, reply, t0, t1))
        return replies

    def _check(self, sock: Fuzzer, req: Req, rid: int, reply: dict | None, t0: float, t1: float) -> dict | None:
        r = self.report
        if self.trace:
            self.trace.write(
                json.dumps(
                    {
                        "step": self.step,
                        "label": req.label,
                        "request": {"id": rid, "type": req.kind, **req.fields},
                        "reply": reply,
                    },
                    default=str,
                )
                + "\n"
            )
        if reply is None:
            if not self.service.alive():
                return None  # the step loop notices the crash
            r.violation(
                "a:silence", self.step, f"no reply within {self.reply_timeout_s} s to {req.label} {short(req.fields)}"
            )
            sock.recover()
            return None
        r.reply_ms.append((t1 - t0) * 1000)
        if (
            not isinstance(reply, dict)
            or reply.get("v") != 1
            or not isinstance(reply.get("ok"), bool)
            or reply.get("id") != rid
        ):
            r.violation("e:reply", self.step, f"malformed reply (request id {rid}) to {req.label}: {short(reply)}")
            return None
        if reply["ok"]:
            code = "ok"
            r.labels_ok[req.label] += 1
        else:
            error = reply.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            if not isinstance(error, dict) or not error.get("message"):
                r.violation(
                    "e:reply", self.step, f"error reply without a code and message to {req.label}: {short(reply)}"
                )
        r.codes[code] += 1
        self.last_refused = self.disk.refused_between(t0, t1, req.job.job_id if req.job else None)
        if req.label.startswith("sentinel/"):
            pass  # judged by sentinel_tick, as invariant (d)
        elif code == "internal":
            if req.kind in WRITES and self.last_refused:
                r.observe(
                    "internal error replies while the disk refused writes (expected: nothing saved)",
                    f"{req.label}: {reply['error']['message'][:200]}",
                )
            else:
                r.violation(
                    "e:internal", self.step, f"{req.label} {short(req.fields)} -> {reply['error']['message'][:300]}"
                )
        elif code != "ok" and req.valid and code not in STRICT_ALLOWED[req.kind] | req.allow:
            invariant = "d:status-all" if req.kind == "status" and "job_id" not in req.fields else "e:refused"
            r.violation(
                invariant, self.step, f"{req.label} {short(req.fields)} -> [{code}] {reply['error']['message'][:300]}"
            )
        if code == "ok" and req.kind in WRITES and self.last_refused:
            r.observe(
                f"acknowledged while the disk refused writes: {req.kind}",
                f"step {self.step}: {req.label} {short(req.fields)}",
            )
        elif code not in ("ok", "internal") and req.kind in WRITES and self.last_refused:
            r.observe(
                f"[{code}] while the disk refused writes: {req.kind}",
                f"step {self.step}: {reply['error']['message'][:200]}",
            )
        if code == "ok" and req.nearly:
            r.observe(f"nearly-valid request accepted: {req.label}", f"step {self.step}: {short(req.fields)}")
        if req.on_reply is not None:
            req.on_reply(reply, t0, t1)
        return reply

    # ---- chaos actions --------------------------------------------------------------------------------

    def _new_job(self) -> JobModel:
        spec, preset = random_spec(self.rng, self.rng.choice(["", "", "a", "b"]))
        for job in self.jobs:
            if job.job_id == spec.job_id():
                return job
        job = JobModel(spec, preset)
        self.jobs.append(job)
        return job

    def chaos_request(self) -> Req | list[Req]:
        rng = self.rng
        job = rng.choice(self.jobs)
        action = rng.choices(
            [
                "register_job",
                "new_job",
                "register_job_bad",
                "register_rank",
                "register_rank_bad",
                "get_table",
                "get_table_bad",
                "upload",
                "report",
                "report_bad",
                "train",
                "straggler",
                "straggler_bad",
                "status_all",
                "status_one",
                "ping",
                "spans",
                "spans_bad",
            ],
            [4, 0.3, 2, 10, 4, 14, 2, 14, 10, 2, 5, 2, 1, 3, 3, 1, 5, 3],
        )[0]
        return getattr(self, f"_a_{action}")(rng, job)

    def _a_train(self, rng: random.Random, job: JobModel) -> list[Req]:
        """One training iteration, or now and then a stretch of TRAIN_STRETCH: every rank reports
        each (the job's tallies complete, the straggler detector is fed), half of the time with
        every rank's spans of it (a stretch of them completes the timelines a calibration needs);
        one pipeline runs at another pace: slower, or a time of 5e-324 s or the maximum, for a
        few iterations in a row (the detector decides on medians of the last 8)."""
        reqs = []
        with_spans = rng.random() < 0.5
        for _ in range(TRAIN_STRETCH if rng.random() < 0.3 else 1):
            job.iteration += 1
            if job.pace is None or rng.random() < 0.15:
                job.pace = (
                    rng.randrange(job.spec.dp),
                    *rng.choices([("even", 1.0), ("slow", 1.3), ("tiny", 0.0), ("huge", math.inf)], [4, 3, 2, 1])[0],
                )
            slow, name, pace = job.pace
            base = rng.uniform(0.4, 0.5)
            for rank in range(job.spec.world_size):
                time_s = base
                if coordinates(job.spec, rank)[1] == slow:
                    time_s = TINY if pace == 0.0 else MAX_TIME_S if pace == math.inf else base * pace
                fields = {
                    "job_id": job.job_id,
                    "rank": rank,
                    "iteration": job.iteration,
                    "time_s": time_s,
                    "energy_j": 100.0 * time_s,
                }
                # The chaos traffic's stray iterations can leave the median rank far behind: the
                # job refuses a step far past it once, then the median moves with the ranks.
                far = frozenset({"bad_field"} if job.iteration > LEAD else ())
                reqs.append(Req(f"report_iteration/train_{name}", "report_iteration", fields, job, allow=far))
                if with_spans:
                    spans = self._spans_fields(rng, job, rank, job.iteration)
                    reqs.append(Req("report_spans/train", "report_spans", spans, job))
        return reqs + [Req("status/all", "status", {})]  # right after the detector decided

    def _ack_register_job(self, job: JobModel) -> Callable:
        def on_reply(reply: dict, t0: float, t1: float) -> None:
            if reply["ok"]:
                job.registered = Ack(self.step, t1, self.disk.refused_between(t0, t1, job.job_id))

        return on_reply

    def _a_register_job(self, rng: random.Random, job: JobModel) -> Req:
        return Req(
            "register_job/valid",
            "register_job",
            {"spec": job.spec.to_wire()},
            job,
            on_reply=self._ack_register_job(job),
        )

    def _a_new_job(self, rng: random.Random, job: JobModel) -> Req:
        if len(self.jobs) < MAX_JOBS and rng.random() < 0.7:
            job = self._new_job()
            return Req(
                "register_job/new",
                "register_job",
                {"spec": job.spec.to_wire()},
                job,
                on_reply=self._ack_register_job(job),
            )
        # Valid on the wire, invalid as a schedule: the worker fails the job (no backward pass).
        pp = rng.randint(1, 3)
        spec = {
            "world_size": pp,
            "pp": pp,
            "schedule_name": "custom",
            "num_microbatches": 1,
            "gpu_model": PRESET.product,
            "tag": f"fails-{rng.randint(0, 3)}",
            "stage_orders": [[["forward", 0, 0]] for _ in range(pp)],
        }
        return Req("register_job/fails_later", "register_job", {"spec": spec})

    def _a_register_job_bad(self, rng: random.Random, job: JobModel) -> Req:
        spec = job.spec.to_wire()
        name, change = rng.choice(
            [
                ("world_size", {"world_size": spec["world_size"] + 1}),
                ("pp", {"pp": 0}),
                ("schedule", {"schedule_name": "1f2b"}),
                ("gpu_model", {"gpu_model": ""}),
                ("microbatches", {"num_microbatches": 0}),
                ("extra", {"surprise": 1}),
                ("mapping", {"rank_mapping": "megatronx"}),
                ("warmup", {"warmup_iterations": -1}),
                ("sweep", {"sweep_frequencies": []}),
                ("overhead", {"instruction_overhead_s": 1.0}),
                ("tp", {"tp": 0}),
                ("tag", {"tag": "t" * 129}),
                ("instructions", {"num_microbatches": MAX_INSTRUCTIONS // 2 + 1}),
            ]
        )
        return Req(f"register_job/bad_{name}", "register_job", {"spec": {**spec, **change}}, job, nearly=True)

    def _rank_ack(self, job: JobModel, rank: int, coords: tuple[int, int, int], model: str) -> Callable:
        def on_reply(reply: dict, t0: float, t1: float) -> None:
            if reply["ok"]:
                job.ranks[rank] = (coords, model, True)

        return on_reply

    def _a_register_rank(self, rng: random.Random, job: JobModel) -> Req:
        rank = rng.randrange(job.spec.world_size)
        info = info_wire(job.spec, rank, job.preset, timeline=rng.random() < 0.95)  # an earlier release now and then
        coords = (info["stage"], info["dp_index"], info["tp_index"])
        return Req(
            "register_rank/valid",
            "register_rank",
            {"job_id": job.job_id, "info": info},
            job,
            on_reply=self._rank_ack(job, rank, coords, job.preset.product),
        )

    def _a_register_rank_bad(self, rng: random.Random, job: JobModel) -> Req:
        spec = job.spec
        rank = rng.randrange(spec.world_size)
        stage, dp_index, tp_index = coordinates(spec, rank)
        other = PRESETS[1] if job.preset is PRESETS[0] else PRESETS[0]
        name, info = rng.choice(
            [
                ("shifted_stage", info_wire(spec, rank, job.preset, stage=(stage + 1) % spec.pp)),
                ("dp_out_of_range", info_wire(spec, rank, job.preset, dp_index=spec.dp)),
                ("tp_out_of_range", info_wire(spec, rank, job.preset, tp_index=spec.tp)),
                ("rank_out_of_range", info_wire(spec, spec.world_size - 1, job.preset, rank=spec.world_size)),
                ("other_gpu", info_wire(spec, rank, other)),
                ("missing_sweep", info_wire(spec, rank, job.preset, frequencies=list(job.preset.frequencies[1:]))),
                ("others_coordinates", info_wire(spec, (rank + 1) % spec.world_size, job.preset, rank=rank)),
            ]
        )
        coords = (info["stage"], info["dp_index"], info["tp_index"])
        job_id = job.job_id if rng.random() < 0.9 else "job-" + "0" * 16
        return Req(
            f"register_rank/{name}",
            "register_rank",
            {"job_id": job_id, "info": info},
            job,
            nearly=True,
            on_reply=self._rank_ack(job, info["rank"], coords, info["gpu_model"]) if job_id == job.job_id else None,
        )

    def _iteration(self, rng: random.Random, job: JobModel) -> int:
        job.iteration += rng.randint(0, 2)
        roll = rng.random()
        if roll < 0.7:
            return job.iteration
        if roll < 0.8:
            return max(0, job.iteration - rng.randint(1, 5))  # out of order
        if roll < 0.85:
            return 0
        if roll < 0.95:
            return rng.randint(2**32, MAX_RANK_ITERATION)
        if roll < 0.98:
            return MAX_RANK_ITERATION
        return (
            MAX_ITERATION  # the protocol's maximum of what the service sends: a rank may not send it in later releases
        )

    def _a_get_table(self, rng: random.Random, job: JobModel) -> Req:
        iteration = -1 if rng.random() < 0.05 else self._iteration(rng, job)
        version = rng.choices([0, rng.randint(1, 5), MAX_ITERATION], [6, 3, 1])[0]
        rank = rng.randrange(job.spec.world_size)
        label = "get_table/huge_iteration" if iteration > 2**31 else "get_table/valid"
        return Req(
            label,
            "get_table",
            {
                "job_id": job.job_id,
                "rank": rank,
                "iteration": iteration,
                "plan_version": version,
                "sweep_version": SWEEP_VERSION,
            },
            job,
            on_reply=self._table_check(job, rank, label),
        )

    def _table_check(self, job: JobModel, rank: int, label: str) -> Callable:
        def on_reply(reply: dict, t0: float, t1: float) -> None:
            if reply["ok"] and reply.get("frequencies"):
                known = job.ranks.get(rank)
                preset = next((p for p in PRESETS if known and p.product == known[1]), None)
                if preset is not None and not set(reply["frequencies"]) <= set(preset.frequencies):
                    bad = sorted(set(reply["frequencies"]) - set(preset.frequencies))
                    self.report.observe(
                        "a table holds frequencies the rank's GPU does not support",
                        f"step {self.step} job {job.job_id} rank {rank}: {bad[:5]} MHz",
                    )

        return on_reply

    def _a_get_table_bad(self, rng: random.Random, job: JobModel) -> Req:
        name, change = rng.choice(
            [
                ("iteration_over_max", {"iteration": MAX_ITERATION + 1}),
                ("iteration_-2", {"iteration": -2}),
                ("version_-1", {"plan_version": -1}),
                ("rank_over_max", {"rank": MAX_RANKS}),
                ("no_rank", {"rank": None}),
            ]
        )
        fields = {
            "job_id": job.job_id,
            "rank": 0,
            "iteration": 0,
            "plan_version": 0,
            "sweep_version": SWEEP_VERSION,
            **change,
        }
        return Req(
            f"get_table/{name}", "get_table", {k: v for k, v in fields.items() if v is not None}, job, nearly=True
        )

    def _upload_ack(self, job: JobModel, rank: int, stage: int, tp_index: int, valid_profile: bool) -> Callable:
        def on_reply(reply: dict, t0: float, t1: float) -> None:
            known = job.ranks.get(rank)
            on_model = (
                known is not None
                and known[2]
                and known[0][0] == stage
                and known[0][2] == tp_index
                and known[1] == job.spec.gpu_model
            )
            if not on_model:
                return
            if reply["ok"]:
                if (stage, tp_index) not in job.shares:
                    note = (
                        "an earlier upload of this share got an internal error"
                        if (stage, tp_index) in job.refused_writes
                        else ""
                    )
                    job.shares[(stage, tp_index)] = Ack(
                        self.step, t1, self.disk.refused_between(t0, t1, job.job_id), note
                    )
            elif reply["error"]["code"] == "internal":
                job.refused_writes.add((stage, tp_index))

        return on_reply

    def _a_upload(self, rng: random.Random, job: JobModel) -> Req:
        rank = rng.randrange(job.spec.world_size)
        stage, _, tp_index = coordinates(job.spec, rank)
        variant, profile, valid = profile_variant(rng, job.preset, stage, job.spec.pp)
        return Req(
            f"upload_profile/{variant}",
            "upload_profile",
            {"job_id": job.job_id, "rank": rank, "stage": stage, "profile": profile},
            job,
            nearly=not valid,
            on_reply=self._upload_ack(job, rank, stage, tp_index, valid),
        )

    def _a_report(self, rng: random.Random, job: JobModel) -> Req:
        name, time_s, energy_j = rng.choices(
            [
                ("normal", rng.uniform(0.05, 2.0), rng.uniform(50, 5000)),
                ("tiny_time", TINY, rng.uniform(50, 5000)),
                ("small_time", 1e-300, 1.0),
                ("min_time", MIN_TIME_S, 1.0),
                ("max_time", MAX_TIME_S, MAX_ENERGY_J),
                ("huge_time", 1e7, 1e12),
                ("zero_energy", rng.uniform(0.05, 2.0), 0.0),
                ("max_energy", rng.uniform(0.05, 2.0), MAX_ENERGY_J),
                ("huge_energy", rng.uniform(0.05, 2.0), 1e12),
                ("tiny_energy", rng.uniform(0.05, 2.0), TINY),
            ],
            [30, 2, 1, 2, 2, 1, 2, 2, 1, 1],
        )[0]
        fields = {
            "job_id": job.job_id,
            "rank": rng.randrange(job.spec.world_size),
            "iteration": self._iteration(rng, job),
            "time_s": time_s,
            "energy_j": energy_j,
        }
        if rng.random() < 0.2:
            fields["compute_time_s"] = rng.choice([time_s, time_s * 0.9, TINY])
        # An iteration far past the median rank's is refused by the job (valid on the wire); the
        # chaos ranks do not move in lockstep, so past the first LEAD iterations any may be.
        far = fields["iteration"] > LEAD
        return Req(
            f"report_iteration/{name}", "report_iteration", fields, job, allow=frozenset({"bad_field"} if far else ())
        )

    def _a_report_bad(self, rng: random.Random, job: JobModel) -> Req:
        name, change = rng.choice(
            [
                ("zero_time", {"time_s": 0.0}),
                ("negative_energy", {"energy_j": -1.0}),
                ("time_over_max", {"time_s": MAX_TIME_S * 2}),
                ("energy_over_max", {"energy_j": MAX_ENERGY_J * 2}),
                ("iteration_-1", {"iteration": -1}),
                ("nan_time", {"time_s": math.nan}),
                ("iteration_over_max", {"iteration": MAX_ITERATION + 1}),
            ]
        )
        fields = {
            "job_id": job.job_id,
            "rank": 0,
            "iteration": job.iteration,
            "time_s": 0.5,
            "energy_j": 100.0,
            **change,
        }
        return Req(f"report_iteration/{name}", "report_iteration", fields, job, nearly=True)

    def _a_straggler(self, rng: random.Random, job: JobModel) -> Req:
        fields = {"job_id": job.job_id, "pipeline": rng.randrange(job.spec.dp), "factor": rng.choice(STRAGGLER_FACTORS)}
        alone = job.spec.dp == 1 and fields["factor"] is not None  # refused: no other pipeline to slow
        return Req(
            "declare_straggler/valid", "declare_straggler", fields, job, allow=frozenset({"bad_field"} if alone else ())
        )

    def _a_straggler_bad(self, rng: random.Random, job: JobModel) -> Req:
        name, change = rng.choice(
            [
                ("no_pipeline", {"pipeline": job.spec.dp}),
                ("factor_0.5", {"factor": 0.5}),
                ("factor_10.5", {"factor": 10.5}),
            ]
        )
        return Req(
            f"declare_straggler/{name}",
            "declare_straggler",
            {"job_id": job.job_id, "pipeline": 0, "factor": 1.5, **change},
            job,
            allow=frozenset({"bad_field"}),
        )  # no such pipeline: valid on the wire, refused by the job

    def _a_status_all(self, rng: random.Random, job: JobModel) -> Req:
        return Req("status/all", "status", {})

    def _a_status_one(self, rng: random.Random, job: JobModel) -> Req:
        job_id = job.job_id if rng.random() < 0.9 else "job-" + "f" * 16
        return Req("status/one", "status", {"job_id": job_id}, job)

    def _a_ping(self, rng: random.Random, job: JobModel) -> Req:
        return Req("ping/chaos", "ping", {})

    def _spans_fields(self, rng: random.Random, job: JobModel, rank: int, iteration: int) -> dict[str, Any]:
        """A valid report_spans of `rank` in a baseline iteration (default clocks)."""
        count = instructions(job.spec, coordinates(job.spec, rank)[0])
        step, begins, ends = spans_wire(rng, count, rng.choice([1000, 6000, 50_000]))
        return {
            "job_id": job.job_id,
            "rank": rank,
            "iteration": iteration,
            "phase": rng.choice(["planning", "planning", "warmup"]),
            "frequency": None,
            "step_us": step,
            "begins_us": begins,
            "ends_us": ends,
        }

    def _a_spans(self, rng: random.Random, job: JobModel) -> Req:
        """Valid spans: a baseline iteration, or one the service takes and ignores."""
        rank = rng.randrange(job.spec.world_size)
        fields = self._spans_fields(rng, job, rank, self._iteration(rng, job))
        name = rng.choices(["baseline", "iteration_0", "profiling", "planned", "huge_step"], [6, 1, 1, 1, 1])[0]
        if name == "iteration_0":
            fields["iteration"] = 0
        elif name == "profiling":
            fields["phase"], fields["frequency"] = "profiling", rng.choice(job.preset.frequencies)
        elif name == "planned":
            fields["phase"] = "planned"
        elif name == "huge_step":  # the longest step the protocol takes, its spans at its very end
            last = round(MAX_TIME_S * 1e6)
            count = len(fields["begins_us"])
            fields["step_us"], fields["begins_us"], fields["ends_us"] = last, [last] * count, [last] * count
        return Req(f"report_spans/{name}", "report_spans", fields, job)

    def _a_spans_bad(self, rng: random.Random, job: JobModel) -> Req:
        """Nearly valid spans (the wrong count of instructions: the job refuses them) and hostile
        ones (the protocol refuses them)."""
        rank = rng.randrange(job.spec.world_size)
        fields = self._spans_fields(rng, job, rank, job.iteration)
        begins, ends = fields["begins_us"], fields["ends_us"]
        name = rng.choice(
            [
                "one_more",
                "one_fewer",
                "overlap",
                "end_before_begin",
                "past_step",
                "negative",
                "floats",
                "lengths_differ",
                "over_max_instructions",
                "zero_step",
                "bad_phase",
                "frequency_0",
                "unknown_job",
                "empty",
            ]
        )
        allow: frozenset = frozenset()
        if name == "one_more":
            begins.append(ends[-1])
            ends.append(ends[-1])
            fields["step_us"] = max(fields["step_us"], ends[-1])
            allow = frozenset({"bad_field"})  # valid on the wire, not the rank's stage
        elif name == "one_fewer":
            if len(begins) > 1:
                begins.pop()
                ends.pop()
            allow = frozenset({"bad_field"})
        elif name == "overlap" and len(begins) > 1:
            begins[1] = max(0, ends[0] - 1) if ends[0] > begins[0] else begins[0]
            ends[0] = begins[1] + 1
        elif name == "end_before_begin":
            ends[0] = begins[0] - 1
        elif name == "past_step":
            ends[-1] = fields["step_us"] + 1
        elif name == "negative":
            begins[0] = -1
        elif name == "floats":
            fields["begins_us"] = [b + 0.5 for b in begins]
        elif name == "lengths_differ":
            ends.append(fields["step_us"])
        elif name == "over_max_instructions":
            fields["begins_us"] = [0] * (MAX_INSTRUCTIONS + 1)
            fields["ends_us"] = [0] * (MAX_INSTRUCTIONS + 1)
        elif name == "zero_step":
            fields["step_us"] = 0
        elif name == "bad_phase":
            fields["phase"] = "sideways"
        elif name == "frequency_0":
            fields["frequency"] = 0
        elif name == "unknown_job":
            fields["job_id"] = "job-" + "0" * 16
        elif name == "empty":
            fields["begins_us"], fields["ends_us"] = [], []
        return Req(f"report_spans/{name}", "report_spans", fields, job, nearly=True, allow=allow)

    # ---- the sentinel ---------------------------------------------------------------------------------

    def sentinel_tick(self) -> None:
        """One request of a well-behaved client of the sentinel job."""
        if not self.service.alive():
            return  # the step loop restarts it
        s, sock = self.sentinel, self.sentinel_sock
        spec = s.spec
        self.s_tick += 1
        if self.s_phase == "register_job":
            reply = self.exchange(
                sock,
                Req(
                    "sentinel/register_job",
                    "register_job",
                    {"spec": spec.to_wire()},
                    s,
                    on_reply=self._ack_register_job(s),
                ),
            )
            if reply is not None and reply["ok"]:
                self.s_phase = "register_ranks"
            elif reply is not None:
                self._sentinel_refused("register_job", reply, 0)
            return
        missing = [r for r in range(spec.world_size) if r not in s.ranks or not s.ranks[r][2]]
        if self.s_phase == "register_ranks" or missing:
            rank = missing[0] if missing else 0
            info = info_wire(spec, rank, s.preset)
            reply = self.exchange(
                sock,
                Req(
                    "sentinel/register_rank",
                    "register_rank",
                    {"job_id": s.job_id, "info": info},
                    s,
                    on_reply=self._rank_ack(s, rank, (info["stage"], 0, 0), s.preset.product),
                ),
            )
            if reply is not None and not reply["ok"]:
                self._sentinel_refused("register_rank", reply, rank)
            elif (
                reply is not None
                and reply["ok"]
                and len([r for r in s.ranks.values() if r[2]]) == spec.world_size
                and self.s_phase == "register_ranks"
            ):
                self.s_phase = "upload"
                self.s_pending_uploads = set(range(spec.pp))
            return
        if self.s_pending_uploads:
            stage = min(self.s_pending_uploads)
            fields = {
                "job_id": s.job_id,
                "rank": stage,
                "stage": stage,
                "profile": profile_wire(s.preset, stage, spec.pp),
            }
            reply = self.exchange(
                sock,
                Req(
                    "sentinel/upload_profile",
                    "upload_profile",
                    fields,
                    s,
                    on_reply=self._upload_ack(s, stage, stage, 0, True),
                ),
            )
            if reply is None:
                return
            if reply["ok"]:
                self.s_pending_uploads.discard(stage)
                if not self.s_pending_uploads:
                    self.s_deadline = time.monotonic() + self.plan_timeout_s
                    self.s_phase = "running"
            else:
                self._sentinel_refused("upload_profile", reply, stage)
            return
        # Running: tables, status, reports, like a training loop.
        kind = ("get_table", "get_table", "report_iteration", "status")[self.s_tick % 4]
        rank = (self.s_tick // 4) % spec.world_size
        if kind == "get_table":
            req = Req(
                "sentinel/get_table",
                "get_table",
                {"job_id": s.job_id, "rank": rank, "iteration": self.s_iteration, "plan_version": 0},
                s,
                on_reply=self._table_check(s, rank, "sentinel"),
            )
        elif kind == "report_iteration":
            req = Req(
                "sentinel/report_iteration",
                "report_iteration",
                {"job_id": s.job_id, "rank": rank, "iteration": self.s_iteration, "time_s": 0.25, "energy_j": 150.0},
                s,
            )
            if rank == spec.world_size - 1:
                self.s_iteration += 1
        else:
            req = Req("sentinel/status", "status", {"job_id": s.job_id}, s)
        reply = self.exchange(sock, req)
        if reply is None:
            return
        if not reply["ok"]:
            self._sentinel_refused(kind, reply, rank)
            return
        phase = reply["jobs"][0]["phase"] if kind == "status" else reply.get("phase")
        if phase == "failed":
            self.report.violation("d:sentinel", self.step, f"the sentinel job failed: {reply}")
            self.s_deadline = None
        elif phase == "planned":
            if self.s_planned_at is None:
                self.s_planned_at = time.monotonic()
                self.report.sentinel_planned_s = self.s_planned_at - self.started_at
            self.s_deadline = None
        elif (
            kind == "get_table"
            and phase == "profiling"
            and rank not in reply["profiled_stages"]
            and reply.get("upload", True)
        ):
            self.s_pending_uploads.add(
                rank
            )  # the service lost the stage's profile: upload it again, as the client does
            self.report.observe(
                "sentinel re-uploaded a stage its table listed as unprofiled", f"step {self.step} stage {rank}"
            )
        if self.s_deadline is not None and time.monotonic() > self.s_deadline:
            self.report.violation(
                "d:sentinel",
                self.step,
                f"the sentinel job has no plan {self.plan_timeout_s:.0f} s after its last upload (phase {phase})",
            )
            self.s_deadline = None

    def _sentinel_refused(self, what: str, reply: dict, rank: int) -> None:
        """An error reply to the sentinel's `what` (about `rank`): forgiven, retried, or a violation of (d)."""
        code = reply["error"]["code"]
        if code in ("unknown_rank", "unknown_job"):
            self._sentinel_lost(what, reply, rank)
        elif code == "not_ready" and what == "upload_profile":
            pass  # the schedule is being built: retried
        elif code == "internal" and what in WRITES and self.last_refused:
            pass  # the disk refused the write: retried (and counted among the observations by _check's caller)
        else:
            self.report.violation(
                "d:sentinel",
                self.step,
                f"sentinel {what} (rank {rank}) refused: [{code}] {reply['error']['message'][:300]}",
            )

    def _sentinel_lost(self, what: str, reply: dict, rank: int) -> None:
        """The service does not know the sentinel's job or `rank`: forgiven only if that registration
        may have been lost."""
        s = self.sentinel
        code = reply["error"]["code"]
        if code == "unknown_job":
            if s.registered is not None:
                self.report.violation(
                    "c:job-lost",
                    self.step,
                    f"sentinel {what}: the service lost the acknowledged sentinel job "
                    f"(registered at step {s.registered.step})",
                )
            self.s_phase = "register_job"
            s.registered = None
            s.ranks.clear()
            self.s_pending_uploads = set(range(s.spec.pp))
            return
        known = s.ranks.get(rank)
        if known is not None and known[2]:
            self.report.violation(
                "d:sentinel",
                self.step,
                f"sentinel {what}: [{code}] {reply['error']['message'][:200]} although rank {rank}'s "
                "registration was acknowledged and no SIGKILL, crash or disk fault followed",
            )
        if known is not None:
            s.ranks[rank] = (known[0], known[1], False)  # register it again

    # ---- checks ---------------------------------------------------------------------------------------

    def check_durable(self) -> None:
        """(c) and (d) right after a restart: every acknowledged job and stage profile is still there."""
        reply = self.exchange(self.ping_sock, Req("check/status_all", "status", {}))
        if reply is None:
            return
        status: dict[
            str, dict | None
        ] = {}  # job id -> its status; absent: unknown to the service; None: status refused
        if reply["ok"]:
            status = {j["job_id"]: j for j in reply["jobs"]}
        else:  # a violation was recorded (status of every job must succeed): ask job by job
            for job in self.jobs + [self.sentinel]:
                one = self.exchange(self.ping_sock, Req("check/status_one", "status", {"job_id": job.job_id}, job))
                if one is None or not one["ok"]:
                    if one is None or one["error"]["code"] != "unknown_job":
                        status[job.job_id] = None
                else:
                    status[job.job_id] = one["jobs"][0]
        for job in self.jobs + [self.sentinel]:
            if job.job_id in status and status[job.job_id] is None:
                continue  # cannot tell
            got = status.get(job.job_id)
            if got is None:
                if job.registered is not None:
                    fault = " (acknowledged while the disk refused writes)" if job.registered.during_fault else ""
                    self.report.violation(
                        "c:job-lost",
                        self.step,
                        f"job {job.job_id}{' (sentinel)' if job.sentinel else ''} acknowledged at step "
                        f"{job.registered.step}{fault} is gone after the restart",
                    )
                    job.registered = None
                job.shares.clear()
                job.ranks.clear()
                continue
            if got["plan_version"] > 0:
                continue
            if got.get("profile_dropped"):  # the service dropped its profile on purpose: the spans sent
                job.shares.clear()  # showed another workload (it says why); its stages are profiled again
                continue
            for stage in range(job.spec.pp):
                acks = [job.shares.get((stage, t)) for t in range(job.spec.tp)]
                if all(acks) and stage not in got["profiled_stages"]:
                    last = max(acks, key=lambda a: a.step)
                    how = "; ".join(
                        filter(
                            None,
                            [
                                "acknowledged while the disk refused writes"
                                if any(a.during_fault for a in acks)
                                else "",
                                *{a.note for a in acks if a.note},
                            ],
                        )
                    )
                    self.report.violation(
                        "c:profile-lost",
                        self.step,
                        f"job {job.job_id}{' (sentinel)' if job.sentinel else ''} stage {stage}: "
                        f"profile acknowledged at step {last.step}{f' ({how})' if how else ''} "
                        "is gone after the restart "
                        f"(status: phase {got['phase']}, profiled {got['profiled_stages']})",
                    )
                    for t in range(job.spec.tp):
                        job.shares.pop((stage, t), None)

    def ping(self) -> None:
        if not self.service.alive():
            return
        t0 = time.monotonic()
        reply = self.exchange(self.ping_sock, Req("ping/probe", "ping", {}))
        if reply is not None and reply["ok"]:
            self.report.ping_ms.append((time.monotonic() - t0) * 1000)
        try:
            rss, _ = self.service.memory_mb()
        except (OSError, KeyError):
            return
        self.report.max_rss_mb = max(self.report.max_rss_mb, rss)
        if rss > self.rss_limit_mb:
            self.report.violation("b:rss", self.step, f"service RSS {rss:.0f} MiB over {self.rss_limit_mb:.0f} MiB")
            self.rss_limit_mb = math.inf  # once

    def crashed(self) -> None:
        code = self.service.proc.poll()
        self.report.violation(
            "a:crash",
            self.step,
            f"the service exited (code {code}) outside a deliberate restart; "
            f"log tail: {self._log_tail(self.service, 14)}",
        )
        self.restart("crash", corrupt=False)

    # ---- the run ---------------------------------------------------------------------------------------

    def events_for_step(self) -> None:
        e = self.events
        draws = [e.random() for _ in range(5)]
        duration = e.randint(30, 400)
        forced = self.forced_restarts.get(self.step)
        if forced is not None:
            self.restart(forced[0], forced[1])
        elif self.restart_every and draws[0] < 1 / self.restart_every:
            self.restart("SIGKILL" if draws[1] < 0.3 else "SIGTERM", draws[2] < self.corrupt_probability)
        if self.disk.fault is not None and self.step >= self.disk.fault_end_step:
            self.disk.end()
        forced_fault = self.forced_faults.get(self.step)
        if self.disk.fault is None and (
            forced_fault is not None or (self.fault_every and draws[3] < 1 / self.fault_every)
        ):
            kinds = self.disk.kinds()
            kind = (
                forced_fault[0]
                if forced_fault is not None and forced_fault[0] in kinds
                else kinds[int(draws[4] * len(kinds))]
            )
            steps = forced_fault[1] if forced_fault is not None else duration
            victims = [self.disk.state / "jobs" / j.job_id for j in self.jobs]
            victims = [v for v in victims if v.is_dir()]
            if not self.disk.start(kind, self.step + steps, victims[int(draws[4] * len(victims))] if victims else None):
                self.report.observe("a disk fault could not be injected", f"step {self.step}: {kind}")
            elif kind == "notdir":
                for job in self.jobs:
                    if self.disk.hidden and job.job_id == self.disk.hidden[0].name:
                        job.forget(time.monotonic())  # its folder is away: a restart meanwhile would not find it

    def run(self, steps: int) -> Report:
        r = self.report
        self.started_at = time.monotonic()
        self.disk = Disk(self.workdir, self.tmpfs_mb, self.use_mount, r)
        try:
            self._start()
            self.service_started_at = time.monotonic()
            for self.step in range(1, steps + 1):
                self.events_for_step()
                if self.rng.random() < 0.1 and self.n_clients > 1:
                    k = self.rng.randint(2, self.n_clients)
                    socks = self.rng.sample(self.chaos, k)
                    pairs = [(sock, self.chaos_request()) for sock in socks]
                    self.burst([(sock, req if isinstance(req, Req) else req[0]) for sock, req in pairs])
                else:
                    sock, reqs = self.rng.choice(self.chaos), self.chaos_request()
                    for req in [reqs] if isinstance(reqs, Req) else reqs:
                        if self.exchange(sock, req) is None and not self.service.alive():
                            break
                if self.step % self.sentinel_every == 0:
                    self.sentinel_tick()
                if self.step % self.ping_every == 0:
                    self.ping()
                if not self.service.alive():
                    self.crashed()
                if self.step % 500 == 0:
                    r.disk_peak_kb = max(r.disk_peak_kb, self.disk.used_kb() if self.disk.fault != "enospc" else 0)
                if self.progress_every and self.step % self.progress_every == 0:
                    print(
                        f"  step {self.step}: {sum(r.restarts.values())} restarts, "
                        f"{sum(r.faults.values())} disk faults, {len(r.violations)} violations, "
                        f"RSS {r.max_rss_mb:.0f} MiB, {time.monotonic() - self.started_at:.0f} s",
                        flush=True,
                    )
            r.steps = steps
            self.disk.end()
            self.finish()
        except Abort as e:
            r.steps = self.step
            r.violation("a:start", self.step, f"run aborted: {e}")
        finally:
            if self.service is not None:
                self.service.stop(signal.SIGKILL)
            for sock in [*self.chaos, self.sentinel_sock, self.ping_sock]:
                if sock is not None:
                    sock.close()
            self.disk.close()
            if self.trace:
                self.trace.close()
            r.seconds = time.monotonic() - self.started_at
        return r

    def finish(self) -> None:
        """The sentinel reaches its plan; then one last graceful restart and its durability check."""
        deadline = time.monotonic() + self.plan_timeout_s
        while self.s_planned_at is None and time.monotonic() < deadline:
            self.sentinel_tick()
            if not self.service.alive():
                self.crashed()
            time.sleep(0.02)
        if self.s_planned_at is None:
            self.report.violation(
                "d:sentinel",
                self.step,
                f"the sentinel job has no plan {self.plan_timeout_s:.0f} s after the last step (phase {self.s_phase})",
            )
        self.step += 1
        self.restart("SIGTERM", corrupt=False)
        reply = self.exchange(
            self.ping_sock, Req("check/status_sentinel", "status", {"job_id": self.sentinel.job_id}, self.sentinel)
        )
        if (
            self.s_planned_at is not None
            and reply is not None
            and reply["ok"]
            and reply["jobs"][0]["phase"] != "planned"
        ):
            self.report.violation(
                "d:sentinel", self.step, f"the sentinel's plan did not survive the last restart: {reply['jobs'][0]}"
            )
        p99 = percentile(self.report.ping_ms, 0.99)
        if p99 > self.ping_p99_ms:
            self.report.violation(
                "a:latency",
                self.step,
                f"ping p99 {p99:.1f} ms over {self.ping_p99_ms:.0f} ms "
                f"({len(self.report.ping_ms)} pings, max {max(self.report.ping_ms):.1f} ms)",
            )

    ping_p99_ms = 100.0


def signature(what: str) -> str:
    """A violation's kind of failure: the error message (after "->") or the text, without numbers and ids."""
    text = what.split(" -> ", 1)[1] if " -> " in what else what
    text = re.sub(r"job-[0-9a-f]+", "job-X", text)
    text = re.sub(r"get_table/\w+|report_iteration/\w+", "", text)
    return re.sub(r"[-+]?\d[\d.e+-]*", "N", text)[:160]


def short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    if "'rows'" in text:
        text = text.split("'rows'")[0] + "'rows': ...}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_fuzz(steps: int, seed: int, workdir: Path | None = None, **kwargs: Any) -> Report:
    """The machine for `steps` chaos steps (see StatefulFuzz for the options), in `workdir` (kept:
    the service logs, the state directory if not on tmpfs) or a throw-away directory."""
    ping_p99_ms = kwargs.pop("ping_p99_ms", 100.0)
    with tempfile.TemporaryDirectory(prefix="perseus-stateful-fuzz-") as tmp:
        root = Path(tmp)
        if workdir is not None:
            workdir.mkdir(parents=True, exist_ok=False)
            root = workdir
        fuzz = StatefulFuzz(root, seed=seed, **kwargs)
        fuzz.ping_p99_ms = ping_p99_ms
        return fuzz.run(steps)


def print_report(r: Report) -> None:
    print(f"\nseed {r.seed}: {r.steps} steps in {r.seconds:.1f} s ({r.steps / max(r.seconds, 1e-9):.0f} steps/s)")
    print(f"disk faults ({r.fault_mode}): {dict(r.faults) or 'none'}")
    print(f"restarts: {dict(r.restarts) or 'none'}; exit codes of deliberate stops: {dict(r.exit_codes) or '-'}")
    print(
        f"state files corrupted before restarts: {sum(r.corruptions.values())} "
        f"{dict(r.corruptions) if r.corruptions else ''}"
    )
    for line in r.corrupted[:20]:
        print(f"  {line}")
    print(f"peak state-dir use: {r.disk_peak_kb} KiB")
    print(f"\n{'reply':<16} {'count':>8}")
    for code, n in sorted(r.codes.items(), key=lambda kv: str(kv[0])):
        print(f"{code!s:<16} {n:8d}")
    print(f"\n{'request':<36} {'sent':>7} {'ok':>7}")
    for label in sorted(r.labels):
        print(f"{label:<36} {r.labels[label]:7d} {r.labels_ok[label]:7d}")
    print(
        f"\nping round trip ({len(r.ping_ms)} pings): p50 {percentile(r.ping_ms, 0.5):.2f} ms, "
        f"p99 {percentile(r.ping_ms, 0.99):.2f} ms, "
        f"max {max(r.ping_ms, default=math.nan):.2f} ms"
    )
    print(
        f"every reply ({len(r.reply_ms)}): p50 {percentile(r.reply_ms, 0.5):.2f} ms, "
        f"p99 {percentile(r.reply_ms, 0.99):.2f} ms, "
        f"max {max(r.reply_ms, default=math.nan):.2f} ms"
    )
    print(f"service max RSS {r.max_rss_mb:.0f} MiB")
    planned = "never" if r.sentinel_planned_s is None else f"{r.sentinel_planned_s:.1f} s into the run"
    print(f"sentinel job planned: {planned}")
    if r.observations:
        print("\nobservations (not violations):")
        for what, n in r.observations.most_common():
            print(f"  {n:6d}  {what}\n          e.g. {r.examples[what][:400]}")
    kinds = Counter(v[0] for v in r.violations)
    print(f"\n{len(r.violations)} invariant violations {dict(kinds) if kinds else ''}")
    # Grouped by what went wrong (numbers, ids and the request's fields left out): count, steps, first example.
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for invariant, step, what in r.violations:
        groups.setdefault((invariant, signature(what)), []).append((step, what))
    for (invariant, _), items in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0][0])):
        steps = ", ".join(str(step) for step, _ in items[:6]) + (", ..." if len(items) > 6 else "")
        print(f"  [{invariant}] x{len(items)} (seed {r.seed}, steps {steps}): {items[0][1][:700]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="chaos steps (default 100000)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument(
        "--clients", type=int, default=4, help="chaos DEALER sockets (default 4; plus the sentinel's and the pinger's)"
    )
    parser.add_argument("--reply-timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)")
    parser.add_argument("--ping-every", type=int, default=10, help="a ping every N steps (default 10)")
    parser.add_argument(
        "--restart-every", type=int, default=2500, help="a restart every N steps on average (default 2500; 0: none)"
    )
    parser.add_argument(
        "--fault-every", type=int, default=4000, help="a disk fault every N steps on average (default 4000; 0: none)"
    )
    parser.add_argument(
        "--corrupt",
        type=float,
        default=0.4,
        help="probability of corrupting a state file before a restart (default 0.4)",
    )
    parser.add_argument("--tmpfs-mb", type=int, default=16, help="size of the state directory's tmpfs (default 16)")
    parser.add_argument(
        "--no-mount", action="store_true", help="no tmpfs: disk faults as a job folder replaced by a file (ENOTDIR)"
    )
    parser.add_argument("--rss-limit-mb", type=float, default=1024.0, help="service RSS limit (default 1024)")
    parser.add_argument("--ping-p99-ms", type=float, default=100.0, help="ping p99 limit (default 100)")
    parser.add_argument(
        "--plan-timeout",
        type=float,
        default=90.0,
        help="seconds the sentinel may wait for its plan after its last upload (default 90)",
    )
    parser.add_argument("--trace", type=Path, default=None, help="write every request and reply as JSON lines here")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="a new folder to run in and keep (service logs; default: a temporary one)",
    )
    a = parser.parse_args(argv)
    print(f"stateful fuzz: {a.steps} steps, seed {a.seed}, {a.clients} chaos clients", flush=True)
    report = run_fuzz(
        a.steps,
        a.seed,
        clients=a.clients,
        reply_timeout_s=a.reply_timeout,
        ping_every=a.ping_every,
        restart_every=a.restart_every,
        fault_every=a.fault_every,
        corrupt_probability=a.corrupt,
        tmpfs_mb=a.tmpfs_mb,
        use_mount=not a.no_mount,
        rss_limit_mb=a.rss_limit_mb,
        ping_p99_ms=a.ping_p99_ms,
        plan_timeout_s=a.plan_timeout,
        trace=a.trace,
        progress_every=max(1000, a.steps // 20),
        workdir=a.workdir,
    )
    print_report(report)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
