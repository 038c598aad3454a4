"""Time-energy profiles: per (stage, instruction kind), the time and energy at each SM frequency.

Shared by the online profiler (which produces them) and the planner (which consumes them).

Files: CSV with columns `stage,instruction,frequency,time,energy` (one microbatch of one
instruction on one GPU of the stage; seconds and joules), or JSON (same rows plus the blocking
power). A CSV has no place for the blocking power, so `load_profile` needs it as an argument.

Which profile stage an instruction uses: with one chunk per rank, its rank. With interleaving
(several chunks per rank), its virtual stage (`Schedule.virtual_stage`) when the profile covers
every virtual stage -- each chunk is a model partition with its own profile -- else its rank
(all chunks of a rank assumed alike).

Zero-bubble schedules need `backward_input` and `backward_weight` rows. A profile measured with
only `forward` and `backward` can be turned into one with `with_split_backward(fraction)`, which
splits each backward point's time and energy into I and W parts by a fraction you choose.

`with_overheads(instruction_s, hop_s)` adds per-instruction host work and stage-to-stage hops,
which a profile of GPU work alone leaves out, before planning.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from perseus.atomic import write_text_atomic
from perseus.exceptions import ConfigError, ProfileError
from perseus.schedules.instruction import Instruction, Kind

if TYPE_CHECKING:
    from perseus.schedules.instruction import Schedule

CSV_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
JSON_FORMAT = "perseus.profile"
KINDS = tuple(k.value for k in Kind)


@dataclass(frozen=True, order=True)
class ProfilePoint:
    """One microbatch of one instruction kind at one SM frequency."""

    frequency: int  # MHz
    time: float  # s
    energy: float  # J


@dataclass
class Profile:
    """Profiles of every (stage, kind), plus the power of a GPU blocked waiting on a peer.

    `points[(stage, kind)]` holds ProfilePoints sorted by frequency, highest first.
    `kind` is a `perseus.schedules.Kind` value string ("forward", "backward", ...).
    """

    points: dict[tuple[int, str], list[ProfilePoint]]
    blocking_power_w: float
    meta: dict[str, str] = field(default_factory=dict)

    def stages(self) -> list[int]:
        return sorted({stage for stage, _ in self.points})

    def kinds(self, stage: int) -> list[str]:
        return [k for k in KINDS if (stage, k) in self.points]

    def _points(self, stage: int, kind: Kind | str) -> list[ProfilePoint]:
        key = (stage, Kind(kind).value)
        if key not in self.points:
            raise ProfileError(f"profile has no rows for stage {stage} instruction {key[1]}; profile that stage and kind")
        return self.points[key]

    def frequencies(self, stage: int, kind: Kind | str) -> list[int]:
        """Profiled frequencies of (stage, kind), highest first."""
        return [p.frequency for p in self._points(stage, kind)]

    def lookup(self, stage: int, kind: Kind | str, frequency: int) -> ProfilePoint:
        for p in self._points(stage, kind):
            if p.frequency == frequency:
                return p
        freqs = self.frequencies(stage, kind)
        raise ConfigError(
            f"frequency {frequency} MHz is not in the profile of stage {stage} instruction {Kind(kind).value} "
            f"(profiled: {freqs[-1]}..{freqs[0]} MHz, {len(freqs)} values); use a profiled frequency"
        )

    def stage_for(self, instruction: Instruction, schedule: Schedule) -> int:
        """The profile stage whose rows describe `instruction` (see the module docstring)."""
        if schedule.num_chunks > 1 and set(range(schedule.num_virtual_stages)) <= set(self.stages()):
            return schedule.virtual_stage(instruction)
        return instruction.stage

    def points_for(self, instruction: Instruction, schedule: Schedule) -> list[ProfilePoint]:
        """The profile points (highest frequency first) of one instruction of `schedule`."""
        return self._points(self.stage_for(instruction, schedule), instruction.kind)

    def validate(self, schedule: Schedule | None = None) -> None:
        """Raise ProfileError naming the first bad row: a non-finite, zero or negative time or
        energy, a repeated frequency, or (given a schedule) a stage or kind the schedule needs.
        Without a schedule a partial profile (say, one rank's stage) is valid."""
        if not (isinstance(self.blocking_power_w, (int, float)) and math.isfinite(self.blocking_power_w) and self.blocking_power_w >= 0):
            raise ProfileError(f"blocking power must be a finite number of watts >= 0, got {self.blocking_power_w!r}")
        for (stage, kind), pts in sorted(self.points.items()):
            if kind not in KINDS:
                raise ProfileError(f"stage {stage}: unknown instruction {kind!r}; use one of {', '.join(KINDS)}")
            if not pts:
                raise ProfileError(f"stage {stage} instruction {kind} has no rows; remove the key or profile it")
            seen: set[int] = set()
            for p in pts:
                where = f"row stage={stage},instruction={kind},frequency={p.frequency}"
                _check_point(p, where)
                if p.frequency in seen:
                    raise ProfileError(f"{where} appears twice; keep one measurement per frequency")
                seen.add(p.frequency)
            if [p.frequency for p in pts] != sorted(seen, reverse=True):
                raise ProfileError(f"stage {stage} instruction {kind}: points must be sorted by frequency, highest first")
        if schedule is not None:
            self._check_covers(schedule)

    def _check_covers(self, schedule: Schedule) -> None:
        needed = sorted({(self.stage_for(ins, schedule), ins.kind.value) for ins in schedule.instructions()})
        for stage, kind in needed:
            if (stage, kind) in self.points:
                continue
            if stage not in self.stages():
                raise ProfileError(
                    f"schedule {schedule.name!r} needs profile stage {stage}, but the profile has stages "
                    f"{self.stages()}; profile every stage of the pipeline (or use a schedule with fewer stages)"
                )
            hint = ""
            if kind in (Kind.BACKWARD_INPUT.value, Kind.BACKWARD_WEIGHT.value) and (stage, Kind.BACKWARD.value) in self.points:
                hint = "; profile I and W separately, or derive them with profile.with_split_backward(input_fraction)"
            raise ProfileError(f"schedule {schedule.name!r} needs rows for stage {stage} instruction {kind}, which the profile lacks{hint}")

    def with_split_backward(self, input_fraction: float = 0.5) -> Profile:
        """A copy with `backward_input` and `backward_weight` rows derived from `backward`: I takes
        `input_fraction` of each point's time and energy, W the rest. An approximation for
        zero-bubble schedules when I and W were not profiled apart; existing I/W rows are kept."""
        if not 0.0 < input_fraction < 1.0:
            raise ConfigError(f"input_fraction must be strictly between 0 and 1, got {input_fraction}")
        points = {key: list(pts) for key, pts in self.points.items()}
        for (stage, kind), pts in self.points.items():
            if kind != Kind.BACKWARD.value:
                continue
            for new_kind, share in ((Kind.BACKWARD_INPUT.value, input_fraction), (Kind.BACKWARD_WEIGHT.value, 1.0 - input_fraction)):
                points.setdefault((stage, new_kind), [ProfilePoint(p.frequency, p.time * share, p.energy * share) for p in pts])
        return Profile(points, self.blocking_power_w, dict(self.meta))

    def with_overheads(self, instruction_s: float = 0.0, hop_s: float = 0.0, num_stages: int | None = None) -> Profile:
        """A copy whose points also pay what the instruction model leaves out: `instruction_s` of
        host work per instruction, plus `hop_s` for kinds that wait on a peer stage's output
        (forward on stages after the first, backward and backward_input on stages before the
        last; `num_stages` defaults to the profile's highest stage + 1). A hop from one stage's
        instruction to the next stage's then takes instruction_s + hop_s in the model, so for a
        measured hop H (sender's end to receiver's start) pass hop_s = H - instruction_s. The GPU
        idles meanwhile, so each point's energy grows by blocking_power_w times the added time.

        Conservative: a hop overlapped with other work is still counted, so a plan built on it
        keeps a little slack it might not have needed, rather than spending slack that host work
        and transfers were silently using. Zero overheads return an equal copy."""
        for name, value in (("instruction_s", instruction_s), ("hop_s", hop_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        stages = self.stages()
        if num_stages is None:
            num_stages = stages[-1] + 1 if stages else 1
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1 or (stages and stages[-1] >= num_stages):
            raise ConfigError(f"num_stages must be a whole number covering the profile's stages {stages}, got {num_stages!r}")
        last = num_stages - 1

        def receives(stage: int, kind: str) -> bool:
            if kind == Kind.FORWARD.value:
                return stage > 0
            return kind in (Kind.BACKWARD.value, Kind.BACKWARD_INPUT.value) and stage < last

        points = {}
        for (stage, kind), pts in self.points.items():
            added = instruction_s + (hop_s if receives(stage, kind) else 0.0)
            points[(stage, kind)] = [ProfilePoint(p.frequency, p.time + added, p.energy + self.blocking_power_w * added) for p in pts]
        return Profile(points, self.blocking_power_w, dict(self.meta))


def _check_point(p: ProfilePoint, where: str) -> None:
    for name in ("time", "energy"):
        value = getattr(p, name)
        if not math.isfinite(value):
            raise ProfileError(f"{where}: {name} is {value}; re-measure it or drop the row")
        if value <= 0:
            raise ProfileError(f"{where}: {name} is {value}, but it must be positive (seconds / joules per microbatch); re-measure it or drop the row")
    if p.frequency <= 0:
        raise ProfileError(f"{where}: frequency must be a positive number of MHz")


def _parse_int(text: str, what: str, where: str) -> int:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {what} {text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value):
        raise ProfileError(f"{where}: {what} {text!r} must be a whole number")
    return int(value)


def _parse_float(text: str, what: str, where: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {what} {text!r} is not a number") from None


def _from_rows(rows: Iterable[tuple[str, dict]], blocking_power_w: float, meta: dict[str, str]) -> Profile:
    """Build a Profile from (location, row) pairs, checking each row where it was read."""
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    first_seen: dict[tuple[int, str, int], str] = {}
    for where, row in rows:
        stage = _parse_int(row["stage"], "stage", where)
        if stage < 0:
            raise ProfileError(f"{where}: stage {stage} must be >= 0")
        kind = str(row["instruction"]).strip()
        if kind not in KINDS:
            raise ProfileError(f"{where}: unknown instruction {kind!r}; use one of {', '.join(KINDS)}")
        point = ProfilePoint(
            _parse_int(row["frequency"], "frequency", where),
            _parse_float(row["time"], "time", where),
            _parse_float(row["energy"], "energy", where),
        )
        _check_point(point, where)
        key = (stage, kind, point.frequency)
        if key in first_seen:
            raise ProfileError(
                f"{where}: duplicate row for stage {stage} instruction {kind} frequency {point.frequency} "
                f"(first at {first_seen[key]}); keep one measurement per frequency"
            )
        first_seen[key] = where
        points.setdefault((stage, kind), []).append(point)
    if not points:
        raise ProfileError("profile has no rows")
    for pts in points.values():
        pts.sort(key=lambda p: p.frequency, reverse=True)
    profile = Profile(points, blocking_power_w, meta)
    profile.validate()
    return profile


def _read_csv(path: Path, text: str, blocking_power_w: float | None) -> Profile:
    if blocking_power_w is None:
        raise ProfileError(
            f"{path}: a CSV profile carries no blocking power; pass blocking_power_w (watts a GPU draws "
            "while waiting on a peer, e.g. 83.64 for A100-SXM, 70.38 for A40)"
        )
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise ProfileError(f"{path}:1: header lacks columns {missing}; expected {','.join(CSV_COLUMNS)}")
    reader.fieldnames = header

    def rows():
        for row in reader:
            if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
                continue
            if None in row:
                raise ProfileError(f"{path}:{reader.line_num}: row has more fields than the header; expected {','.join(CSV_COLUMNS)}")
            if any(row.get(c) is None for c in CSV_COLUMNS):
                raise ProfileError(f"{path}:{reader.line_num}: row has too few fields; expected {','.join(CSV_COLUMNS)}")
            yield f"{path}:{reader.line_num}", row

    return _from_rows(rows(), float(blocking_power_w), {})


def _read_json(path: Path, text: str, blocking_power_w: float | None) -> Profile:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT or not isinstance(doc.get("points"), list):
        raise ProfileError(f"{path}: not a Perseus profile (expected an object with format {JSON_FORMAT!r} and a 'points' list)")
    power = blocking_power_w if blocking_power_w is not None else doc.get("blocking_power_w")
    if power is None:
        raise ProfileError(f"{path}: no blocking_power_w in the file; pass blocking_power_w")

    def rows():
        for i, row in enumerate(doc["points"]):
            where = f"{path}: points[{i}]"
            if not isinstance(row, dict) or any(c not in row for c in CSV_COLUMNS):
                raise ProfileError(f"{where}: each point needs keys {', '.join(CSV_COLUMNS)}")
            yield where, {k: str(v) for k, v in row.items()}

    meta = {str(k): str(v) for k, v in (doc.get("meta") or {}).items()}
    return _from_rows(rows(), _parse_float(str(power), "blocking_power_w", str(path)), meta)


def load_profile(path: str | os.PathLike, blocking_power_w: float | None = None) -> Profile:
    """Read a profile from CSV or JSON (by extension). `blocking_power_w` is required for CSV
    and overrides the file's value for JSON. Raises ProfileError naming the bad line or row."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _read_csv(path, text, blocking_power_w)
    if suffix == ".json":
        return _read_json(path, text, blocking_power_w)
    raise ProfileError(f"{path}: unknown profile format {suffix!r}; use a .csv or .json file")


def _rows(profile: Profile) -> list[dict]:
    return [
        {"stage": stage, "instruction": kind, "frequency": p.frequency, "time": p.time, "energy": p.energy}
        for stage in profile.stages()
        for kind in profile.kinds(stage)
        for p in profile.points[(stage, kind)]
    ]


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write `profile` atomically as CSV or JSON (by extension). CSV keeps the measurements only;
    JSON also keeps the blocking power and meta."""
    path = Path(path)
    profile.validate()
    suffix = path.suffix.lower()
    if suffix == ".csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_rows(profile))
        text = buf.getvalue()
    elif suffix == ".json":
        doc = {
            "format": JSON_FORMAT,
            "version": 1,
            "blocking_power_w": profile.blocking_power_w,
            "meta": profile.meta,
            "points": _rows(profile),
        }
        text = json.dumps(doc, indent=1) + "\n"
    else:
        raise ConfigError(f"{path}: unknown profile format {suffix!r}; use a .csv or .json file")
    write_text_atomic(path, text)
