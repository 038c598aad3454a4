"""`emissions.csv` as CodeCarbon writes it, so dashboards and scripts made for CodeCarbon read
Perseus' figures: the same columns in the same order, energy in kWh, emissions in kg CO2e,
power in W, duration in s, RAM in GB; one row per run, appended.

What Perseus does not know stays empty: cloud provider and region, coordinates, CPU and RAM
energy and power where no counter measured them (no RAPL, or a Monitor without CPUs; RAM is
the DRAM counter of RAPL, where CodeCarbon estimates it), the CPU model where the system does
not name it. `country_name` comes from `country_iso_code` (ISO 3166-1 alpha-3, perseus.
measurement.iso3166) unless given. `codecarbon_version` is empty too, since no CodeCarbon
wrote the row (`tracking_mode` says "perseus" instead). The file is rewritten atomically with
each row.
"""

from __future__ import annotations

import csv
import io
import os
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from perseus.atomic import write_text_atomic
from perseus.exceptions import ConfigError
from perseus.measurement.iso3166 import COUNTRIES

JOULES_PER_KWH = 3.6e6

#: CodeCarbon 2.x's EmissionsData fields, in its order.
COLUMNS = (
    "timestamp",
    "project_name",
    "run_id",
    "experiment_id",
    "duration",
    "emissions",
    "emissions_rate",
    "cpu_power",
    "gpu_power",
    "ram_power",
    "cpu_energy",
    "gpu_energy",
    "ram_energy",
    "energy_consumed",
    "country_name",
    "country_iso_code",
    "region",
    "cloud_provider",
    "cloud_region",
    "os",
    "python_version",
    "codecarbon_version",
    "cpu_count",
    "cpu_model",
    "gpu_count",
    "gpu_model",
    "longitude",
    "latitude",
    "ram_total_size",
    "tracking_mode",
    "on_cloud",
    "pue",
)


@dataclass(frozen=True)
class RunEnergy:
    """What one run measured, in Perseus' units (J, s, g CO2e); None: not measured."""

    duration_s: float
    gpu_energy_j: float
    cpu_energy_j: float | None
    ram_energy_j: float | None
    carbon_g: float | None
    gpu_count: int
    gpu_name: str


@dataclass(frozen=True)
class RunInfo:
    """Who and where: CodeCarbon's descriptive columns. `country_iso_code` is ISO 3166-1
    alpha-3, as in CodeCarbon ("DEU"); `country_name` defaults to that country's name."""

    project_name: str = "perseus"
    experiment_id: str = ""
    country_name: str = ""
    country_iso_code: str = ""
    region: str = ""

    def __post_init__(self) -> None:
        code = self.country_iso_code
        if not isinstance(code, str):
            raise ConfigError(f"RunInfo country_iso_code must be a string such as 'DEU', got {code!r}")
        if code and code.upper() not in COUNTRIES:
            alpha3 = next((a3 for a3, (a2, _) in COUNTRIES.items() if a2 == code.upper()), None)
            hint = f"for {COUNTRIES[alpha3][1]}, give {alpha3!r}" if alpha3 else "e.g. 'DEU' for Germany"
            raise ConfigError(
                f"RunInfo country_iso_code {code!r} is not an ISO 3166-1 alpha-3 code, which CodeCarbon's "
                f"emissions.csv holds ({hint})"
            )
        object.__setattr__(self, "country_iso_code", code.upper())
        if not self.country_name and code:
            object.__setattr__(self, "country_name", COUNTRIES[code.upper()][1])


def row(run: RunEnergy, info: RunInfo, when: datetime | None = None) -> dict[str, object]:
    """One CodeCarbon row for `run` (columns of what was not measured left empty)."""
    seconds = run.duration_s

    def kwh(joules: float | None) -> float | str:
        return "" if joules is None else joules / JOULES_PER_KWH

    def power(joules: float | None) -> float | str:
        if joules is None:
            return ""
        return joules / seconds if seconds > 0 else 0.0

    measured_j = [j for j in (run.gpu_energy_j, run.cpu_energy_j, run.ram_energy_j) if j is not None]
    emissions_kg = None if run.carbon_g is None else run.carbon_g / 1000
    return {
        "timestamp": (when or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "project_name": info.project_name,
        "run_id": str(uuid.uuid4()),
        "experiment_id": info.experiment_id,
        "duration": seconds,
        "emissions": "" if emissions_kg is None else emissions_kg,
        "emissions_rate": "" if emissions_kg is None else emissions_kg / seconds if seconds > 0 else 0.0,
        "cpu_power": power(run.cpu_energy_j),
        "gpu_power": power(run.gpu_energy_j),
        "ram_power": power(run.ram_energy_j),
        "cpu_energy": kwh(run.cpu_energy_j),
        "gpu_energy": kwh(run.gpu_energy_j),
        "ram_energy": kwh(run.ram_energy_j),
        "energy_consumed": sum(measured_j) / JOULES_PER_KWH,
        "country_name": info.country_name,
        "country_iso_code": info.country_iso_code,
        "region": info.region,
        "cloud_provider": "",
        "cloud_region": "",
        "os": platform.platform(),
        "python_version": platform.python_version(),
        "codecarbon_version": "",
        "cpu_count": os.cpu_count() or 0,
        "cpu_model": cpu_model(),
        "gpu_count": run.gpu_count,
        "gpu_model": f"{run.gpu_count} x {run.gpu_name}" if run.gpu_count else "",
        "longitude": "",
        "latitude": "",
        "ram_total_size": _ram_gb(),
        "tracking_mode": "perseus",
        "on_cloud": "N",
        "pue": 1.0,
    }


def append_row(path: str | os.PathLike[str], values: dict[str, object]) -> None:
    """Append `values` to the CSV at `path` (created with CodeCarbon's header if absent)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            existing = f.read()
    except FileNotFoundError:
        existing = ""
    except OSError as e:
        raise ConfigError(f"cannot read the emissions file {path}: {e}") from None
    if existing:
        header = next(csv.reader(io.StringIO(existing)), [])
        if tuple(header) != COLUMNS:
            raise ConfigError(
                f"{path} has other columns than CodeCarbon's emissions.csv ({', '.join(header[:4])}, ...); "
                "give another path or move the file away"
            )
        if not existing.endswith("\n"):
            existing += "\n"
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    if not existing:
        writer.writeheader()
    writer.writerow(values)
    write_text_atomic(path, existing + out.getvalue())


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as the system gives it ("" where it gives none): Linux's /proc/cpuinfo
    (`model name` on x86, `cpu model`, `Model` or `cpu` on other architectures), macOS' sysctl,
    Windows' processor string. Never the architecture (`platform.machine()`) in its place."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            fields: dict[str, str] = {}
            for line in f:
                key, sep, value = line.partition(":")
                if sep and value.strip():
                    fields.setdefault(key.strip(), value.strip())
        for key in ("model name", "cpu model", "Model", "cpu"):
            if key in fields:
                return fields[key]
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            done = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5, check=False
            )
            return done.stdout.strip() if done.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            return ""
    if sys.platform == "win32":
        name = platform.processor()
        return name if name and name != platform.machine() else ""
    return ""


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return 0.0
