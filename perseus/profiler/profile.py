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

A file may hold at most MAX_ROWS rows in MAX_BYTES, each value within LIMITS (a time from a
microsecond to a day, a whole number of MHz up to 100000, ...). `load_profile` refuses anything
else -- and any file content at all that is not a profile -- with a ProfileError, never another
exception: the planner service reads its state files with it.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from perseus.atomic import write_text_atomic
from perseus.exceptions import ConfigError, ProfileError
from perseus.profiler.checks import unit_problems
from perseus.schedules.instruction import Instruction, Kind

if TYPE_CHECKING:
    from perseus.schedules.instruction import Schedule

logger = logging.getLogger(__name__)

CSV_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
JSON_FORMAT = "perseus.profile"
KINDS = tuple(k.value for k in Kind)

# Limits on what a profile file may hold: anything beyond them is a corrupt or hostile file,
# refused with a ProfileError before it costs much time or memory, or skews a plan.
MAX_ROWS = 100_000  # 100x the largest real profile (8 stages x 2 kinds x 60 clocks); the wire's cap too
MAX_BYTES = 16 << 20  # room for MAX_ROWS rows as save_profile writes them (JSON: 12-15 MB); bounds memory too
LIMITS = {  # name: (lowest, highest, unit), both inclusive
    "stage": (0, (1 << 20) - 1, ""),
    "frequency": (1, 100_000, " MHz"),
    "time": (1e-6, 86_400.0, " s"),  # one microbatch of one instruction: a microsecond to a day
    "energy": (1e-6, 864e6, " J"),  # a microsecond at 1 W to a day at MAX_POWER_W
    "blocking power": (0.0, 100_000.0, " W"),
}
#: The most one GPU draws, averaged over an instruction: more is a unit slip (mJ for J, ms for s).
MAX_POWER_W = 10_000.0
JSON_VERSION = 1


@dataclass(frozen=True, order=True, slots=True)
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
            raise ProfileError(
                f"profile has no rows for stage {stage} instruction {key[1]}; profile that stage and kind"
            )
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
        """Raise ProfileError naming the first bad row: a value outside LIMITS, a repeated
        frequency, or (given a schedule) a stage or kind the schedule needs. Without a schedule
        a partial profile (say, one rank's stage) is valid."""
        _value(self.blocking_power_w, "blocking power")
        for (stage, kind), pts in sorted(self.points.items()):
            if kind not in KINDS:
                raise ProfileError(f"stage {stage}: unknown instruction {kind!r}; use one of {', '.join(KINDS)}")
            if not pts:
                raise ProfileError(f"stage {stage} instruction {kind} has no rows; remove the key or profile it")
            seen: set[int] = set()
            for p in pts:
                where = f"row stage={stage},instruction={kind},frequency={p.frequency}"
                try:
                    _checked(stage, kind, p.frequency, p.time, p.energy)
                except ProfileError as e:
                    raise ProfileError(f"{where}: {e}") from None
                if p.frequency in seen:
                    raise ProfileError(f"{where} appears twice; keep one measurement per frequency")
                seen.add(p.frequency)
            if [p.frequency for p in pts] != sorted(seen, reverse=True):
                raise ProfileError(
                    f"stage {stage} instruction {kind}: points must be sorted by frequency, highest first"
                )
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
                    f"{self.stages()}; profile every stage of the pipeline, or give a deeper pipeline of the same "
                    "layers the rows of the stages it repeats (`perseus plan --repeat-profile tile|stretch`, "
                    "Profile.repeated), or use a schedule with fewer stages"
                )
            hint = ""
            if (
                kind in (Kind.BACKWARD_INPUT.value, Kind.BACKWARD_WEIGHT.value)
                and (stage, Kind.BACKWARD.value) in self.points
            ):
                hint = "; profile I and W separately, or derive them with profile.with_split_backward(input_fraction)"
            raise ProfileError(
                f"schedule {schedule.name!r} needs rows for stage {stage} instruction {kind}, which the profile "
                f"lacks{hint}"
            )

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
            for new_kind, share in (
                (Kind.BACKWARD_INPUT.value, input_fraction),
                (Kind.BACKWARD_WEIGHT.value, 1.0 - input_fraction),
            ):
                points.setdefault(
                    (stage, new_kind), [ProfilePoint(p.frequency, p.time * share, p.energy * share) for p in pts]
                )
        return Profile(points, self.blocking_power_w, dict(self.meta))

    def repeated(self, num_stages: int, how: str = "tile") -> Profile:
        """A profile of `num_stages` stages made from this one's K stages, for planning a deeper
        pipeline of the same layers: `tile` repeats the whole pipeline (stage s takes the rows of
        stage s % K), `stretch` splits each profiled stage over consecutive ones (stage s takes
        those of s * K // num_stages). Which is right depends on how the layers are split; the
        plans differ (GPT-3 A100 16 x 256: 248,244 J tiled, 248,164 J stretched). Per-stage meta
        (a GPU's switch latencies) follows its rows."""
        have = self.stages()
        if how not in REPEATS:
            raise ConfigError(f"unknown stage mapping {how!r}; choose one of {', '.join(REPEATS)}")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"num_stages must be a positive whole number, got {num_stages!r}")
        if have != list(range(len(have))):
            raise ConfigError(f"the profile's stages {have} are not 0..K-1; only such a profile can be repeated")
        k = len(have)

        def source(s: int) -> int:
            return s % k if how == "tile" else s * k // num_stages

        points = {
            (s, kind): list(self.points[(source(s), kind)]) for s in range(num_stages) for kind in self.kinds(source(s))
        }
        meta = {key: value for key, value in self.meta.items() if "@" not in key}
        for s in range(num_stages):
            for key in (SWITCH_LATENCY_META, SWITCH_LATENCIES_META):
                if f"{key}@{source(s)}" in self.meta:
                    meta[f"{key}@{s}"] = self.meta[f"{key}@{source(s)}"]
        return Profile(points, self.blocking_power_w, meta)

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
        if (
            isinstance(num_stages, bool)
            or not isinstance(num_stages, int)
            or num_stages < 1
            or (stages and stages[-1] >= num_stages)
        ):
            raise ConfigError(
                f"num_stages must be a whole number covering the profile's stages {stages}, got {num_stages!r}"
            )
        last = num_stages - 1

        def receives(stage: int, kind: str) -> bool:
            if kind == Kind.FORWARD.value:
                return stage > 0
            return kind in (Kind.BACKWARD.value, Kind.BACKWARD_INPUT.value) and stage < last

        points = {}
        for (stage, kind), pts in self.points.items():
            added = instruction_s + (hop_s if receives(stage, kind) else 0.0)
            points[(stage, kind)] = [
                ProfilePoint(p.frequency, p.time + added, p.energy + self.blocking_power_w * added) for p in pts
            ]
        return Profile(points, self.blocking_power_w, dict(self.meta))

    def switch_latency_s(self, stage: int | None = None) -> float:
        """How long a clock change took to come into force on the profiled GPU (meta
        SWITCH_LATENCY_META, written by the online profiler; 0.0 when unknown). With `stage`: that
        stage's GPU's in a pipeline profile (meta SWITCH_LATENCY_META@stage), else the former."""
        keys = ([] if stage is None else [f"{SWITCH_LATENCY_META}@{stage}"]) + [SWITCH_LATENCY_META]
        try:
            value = float(next((self.meta[k] for k in keys if k in self.meta), "0"))
        except ValueError:
            return 0.0
        return value if math.isfinite(value) and value > 0 else 0.0

    def switch_latencies_s(self, stage: int | None = None) -> dict[int, float]:
        """The switch latency to each target clock (MHz -> s) the profiled GPU showed (meta
        SWITCH_LATENCIES_META, "MHz:s,..."; with `stage`, that stage's GPU's first); {} when
        unknown, and entries that do not parse are left out."""
        keys = ([] if stage is None else [f"{SWITCH_LATENCIES_META}@{stage}"]) + [SWITCH_LATENCIES_META]
        text = next((self.meta[k] for k in keys if k in self.meta), "")
        table = {}
        for entry in text.split(","):
            mhz, _, seconds = entry.partition(":")
            try:
                clock, latency = int(mhz), float(seconds)
            except ValueError:
                continue
            if math.isfinite(latency) and latency >= 0:
                table[clock] = latency
        return table


#: Profile meta: the longest clock switch latency (s) of the GPU the profile was measured on.
SWITCH_LATENCY_META = "clock_switch_latency_s"
# How `Profile.repeated` maps a deeper pipeline's stages onto the profiled ones.
REPEATS = ("tile", "stretch")
#: Profile meta: the switch latency to each profiled clock, "MHz:s,..." (it depends mostly on the target).
SWITCH_LATENCIES_META = "clock_switch_latencies_s"


def format_switch_latencies(latencies: Mapping[int, float]) -> str:
    """The SWITCH_LATENCIES_META value for a table of target clock (MHz) -> latency (s)."""
    return ",".join(f"{int(f)}:{s:.3g}" for f, s in sorted(latencies.items(), reverse=True))


def _show(value: object) -> str:
    """A value for an error message, short whatever the file holds."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (str, int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    shapes: dict[type, str] = {list: "[...]", dict: "{...}"}
    return shapes.get(type(value), f"<{type(value).__name__}>")  # no repr: it could be huge or too deep


def _value(raw: object, name: str) -> float:
    """`raw` (a CSV cell's text or a JSON value) as a number within LIMITS[name]."""
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or isinstance(raw, bool):  # JSON true is no number of anything
        raise ProfileError(f"{name} {_show(raw)} is not a number")
    low, high, unit = LIMITS[name]
    if not low <= value <= high:  # nan fails too
        positive = "positive, " if low > 0 else ""
        raise ProfileError(
            f"{name} is {_number(value)}, but it must be {positive}between {low:.10g} and {high:.10g}{unit}; "
            "fix or re-measure it"
        )
    return value


def _number(value: float) -> str:
    """`value` as a reader wrote it: -1 for -1.0, 1e-320 as 1e-320."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)


def _whole(raw: object, name: str) -> int:
    value = _value(raw, name)
    if not value.is_integer():
        raise ProfileError(f"{name} {_show(raw)} must be a whole number")
    return int(value)


def _checked(
    stage: object, kind: object, frequency: object, time: object, energy: object
) -> tuple[int, str, ProfilePoint]:
    """One row parsed and range-checked: the single check of every point, read from a file or
    validated in memory. Errors carry no location; the caller prefixes it."""
    if kind not in KINDS:
        kind = kind.strip() if isinstance(kind, str) else kind
        if kind not in KINDS:
            raise ProfileError(f"unknown instruction {_show(kind)}; use one of {', '.join(KINDS)}")
    point = ProfilePoint(_whole(frequency, "frequency"), _value(time, "time"), _value(energy, "energy"))
    if point.energy > point.time * MAX_POWER_W:
        raise ProfileError(
            f"{point.energy:g} J in {point.time:g} s is {point.energy / point.time:,.0f} W, over the "
            f"{MAX_POWER_W:,.0f} W one GPU can draw: write energy in joules and time in seconds"
        )
    return _whole(stage, "stage"), kind, point


def _from_rows(
    path: Path,
    rows: Callable[[], Iterator[tuple[int, tuple]]],
    where: Callable[[int], str],
    power: object,
    meta: dict[str, str],
) -> Profile:
    """A Profile from the (location, row values) pairs `rows()` yields, each checked as it is
    read. `where` formats a location only for an error, and `rows()` runs again only to find
    where a duplicate first appeared: a valid file pays for neither."""
    try:
        blocking_power_w = _value(power, "blocking power")
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}") from None
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    frequencies: dict[tuple[int, str], set[int]] = {}

    def identity(values: tuple) -> tuple[int, str, int]:
        stage, kind, point = _checked(*values)
        return stage, kind, point.frequency

    for count, (loc, values) in enumerate(rows(), 1):
        try:
            if count > MAX_ROWS:
                raise ProfileError(
                    f"more than {MAX_ROWS} rows, the limit for a profile; keep one row per stage, instruction and "
                    "frequency"
                )
            stage, kind, point = _checked(*values)
        except ProfileError as e:
            raise ProfileError(f"{where(loc)}: {e}") from None
        key = (stage, kind)
        if key not in points:
            points[key], frequencies[key] = [], set()
        if point.frequency in frequencies[key]:
            first = next(line for line, other in rows() if identity(other) == (stage, kind, point.frequency))
            raise ProfileError(
                f"{where(loc)}: duplicate row for stage {stage} instruction {kind} frequency {point.frequency} "
                f"(first at {where(first)}); keep one measurement per frequency"
            )
        frequencies[key].add(point.frequency)
        points[key].append(point)
    if not points:
        raise ProfileError(f"{path}: profile has no rows")
    for pts in points.values():
        pts.sort(key=operator.attrgetter("frequency"), reverse=True)
    return Profile(points, blocking_power_w, meta)


def _read_csv(path: Path, data: bytes, blocking_power_w: float | None) -> Profile:
    if blocking_power_w is None:
        raise ProfileError(
            f"{path}: a CSV profile carries no blocking power; pass blocking_power_w (watts a GPU draws "
            "while waiting on a peer, e.g. 83.64 for A100-SXM, 70.38 for A40)"
        )

    def lines() -> Iterator[str]:
        """The file's lines (ended by LF, CRLF or CR), each decoded alone: a bad byte is named by
        its line, and the file never sits in memory as one text (io.StringIO takes 4 bytes a
        character)."""
        for number, line in enumerate(data.removeprefix(codecs.BOM_UTF8).splitlines(keepends=True), 1):
            try:
                yield line.decode()
            except UnicodeDecodeError as e:
                raise ProfileError(
                    f"{path}:{number}: byte {line[e.start]:#04x} is not UTF-8 text; save the profile as UTF-8"
                ) from None

    def rows() -> Iterator[tuple[int, tuple]]:
        reader = csv.reader(lines())
        try:
            header = [h.strip() for h in next(reader, [])]
            missing = [c for c in CSV_COLUMNS if c not in header]
            if missing:
                found = (
                    f" (it has {','.join(header)}; names are lower case)"
                    if any(h != h.lower() and h.lower() in missing for h in header)
                    else ""
                )
                raise ProfileError(f"{path}:1: header lacks columns {missing}{found}; expected {','.join(CSV_COLUMNS)}")
            pick = operator.itemgetter(*(header.index(c) for c in CSV_COLUMNS))
            width = len(header)
            for row in reader:
                if len(row) != width or not all(row):  # the common row skips these checks
                    if not "".join(row).strip():
                        continue  # a blank line
                    if len(row) != width:
                        problem = "more fields than the header" if len(row) > width else "too few fields for the header"
                        raise ProfileError(
                            f"{path}:{reader.line_num}: row has {problem}; expected {','.join(CSV_COLUMNS)}"
                        )
                yield reader.line_num, pick(row)
        except csv.Error as e:
            raise ProfileError(
                f"{path}:{reader.line_num}: not valid CSV ({e}); expected {','.join(CSV_COLUMNS)}"
            ) from None

    return _from_rows(path, rows, lambda line: f"{path}:{line}", blocking_power_w, {})


def _read_json(path: Path, data: bytes, blocking_power_w: float | None) -> Profile:
    try:
        doc = json.loads(data)  # bytes: UTF-8 with or without a byte-order mark, or UTF-16/32
    except (ValueError, RecursionError) as e:  # ValueError: also bad UTF-8; RecursionError: nested too deep
        raise ProfileError(
            f"{path}: not valid JSON ({type(e).__name__}: {e}); write it with perseus.profiler.save_profile"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT or not isinstance(doc.get("points"), list):
        raise ProfileError(
            f"{path}: not a Perseus profile (expected an object with format {JSON_FORMAT!r} and a 'points' list)"
        )
    version = doc.get("version", JSON_VERSION)
    if version != JSON_VERSION or isinstance(version, bool):
        raise ProfileError(
            f"{path}: profile version {_show(version)} is not {JSON_VERSION}, the one this Perseus reads; write it "
            "with perseus.profiler.save_profile (or `perseus profile`) of this version"
        )
    power = blocking_power_w if blocking_power_w is not None else doc.get("blocking_power_w")
    if power is None:
        raise ProfileError(
            f"{path}: no blocking_power_w in the file; pass blocking_power_w (`--blocking-power` on the command "
            "line: watts a GPU draws while waiting on a peer, e.g. 83.64 for A100-SXM)"
        )
    if isinstance(power, str):
        raise ProfileError(f"{path}: blocking power {_show(power)} is not a number but a string; write the number")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ProfileError(
            f"{path}: meta must be an object mapping strings to strings, got {_show(meta)}; fix or remove it"
        )

    def rows() -> Iterator[tuple[int, tuple]]:
        for i, row in enumerate(doc["points"]):
            if not isinstance(row, dict) or any(c not in row for c in CSV_COLUMNS):
                raise ProfileError(f"{path}: points[{i}]: each point needs keys {', '.join(CSV_COLUMNS)}")
            text = next((c for c in CSV_COLUMNS if c != "instruction" and isinstance(row[c], str)), None)
            if text is not None:
                raise ProfileError(
                    f"{path}: points[{i}]: {text} {_show(row[text])} is not a number but a string; write the number"
                )
            yield i, tuple(row[c] for c in CSV_COLUMNS)

    return _from_rows(path, rows, lambda i: f"{path}: points[{i}]", power, meta)


def load_profile(path: str | os.PathLike, blocking_power_w: float | None = None) -> Profile:
    """Read a profile from CSV or JSON (by extension). `blocking_power_w` is required for CSV
    and overrides the file's value for JSON. Any bad content, hostile or not, raises a
    ProfileError naming the file, line or row, and what to fix; nothing else escapes."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise ProfileError(f"{path}: unknown profile format {suffix!r}; use a .csv or .json file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded: a huge file costs no more than the limit
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise ProfileError(
            f"{path}: larger than {MAX_BYTES >> 20} MiB, the limit for a profile; keep one row per stage, instruction "
            "and frequency"
        )
    reader = _read_csv if suffix == ".csv" else _read_json
    profile = reader(path, data, blocking_power_w)
    for problem in unit_problems(profile):
        logger.warning("%s: %s", path, problem)
    return profile


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
            "version": JSON_VERSION,
            "blocking_power_w": profile.blocking_power_w,
            "meta": profile.meta,
            "points": _rows(profile),
        }
        text = json.dumps(doc, indent=1) + "\n"
    else:
        raise ConfigError(f"{path}: unknown profile format {suffix!r}; use a .csv or .json file")
    write_text_atomic(path, text)
