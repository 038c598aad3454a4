"""`emissions.csv` as CodeCarbon writes it, so dashboards and scripts made for CodeCarbon read
Perseus' figures: the same columns in the same order, energy in kWh, emissions in kg CO2e,
power in W, duration in s, RAM in GB; one row per run, appended.

What Perseus does not know stays empty (cloud provider and region, coordinates);
`codecarbon_version` is empty too, since no CodeCarbon wrote the row (`tracking_mode` says
"perseus" instead). The file is rewritten atomically with each row.
"""

from __future__ import annotations

import csv
import io
import os
import platform
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from perseus.atomic import write_text_atomic
from perseus.exceptions import ConfigError

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
    """What one run measured, in Perseus' units (J, s, g CO2e)."""

    duration_s: float
    gpu_energy_j: float
    cpu_energy_j: float
    ram_energy_j: float
    carbon_g: float
    gpu_count: int
    gpu_name: str


@dataclass(frozen=True)
class RunInfo:
    """Who and where: CodeCarbon's descriptive columns."""

    project_name: str = "perseus"
    experiment_id: str = ""
    country_name: str = ""
    country_iso_code: str = ""
    region: str = ""


def row(run: RunEnergy, info: RunInfo, when: datetime | None = None) -> dict[str, object]:
    """One CodeCarbon row for `run`."""
    kwh = {
        k: j / JOULES_PER_KWH
        for k, j in (("cpu", run.cpu_energy_j), ("gpu", run.gpu_energy_j), ("ram", run.ram_energy_j))
    }
    seconds = run.duration_s

    def power(joules: float) -> float:
        return joules / seconds if seconds > 0 else 0.0

    emissions_kg = run.carbon_g / 1000
    return {
        "timestamp": (when or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "project_name": info.project_name,
        "run_id": str(uuid.uuid4()),
        "experiment_id": info.experiment_id,
        "duration": seconds,
        "emissions": emissions_kg,
        "emissions_rate": emissions_kg / seconds if seconds > 0 else 0.0,
        "cpu_power": power(run.cpu_energy_j),
        "gpu_power": power(run.gpu_energy_j),
        "ram_power": power(run.ram_energy_j),
        "cpu_energy": kwh["cpu"],
        "gpu_energy": kwh["gpu"],
        "ram_energy": kwh["ram"],
        "energy_consumed": sum(kwh.values()),
        "country_name": info.country_name,
        "country_iso_code": info.country_iso_code,
        "region": info.region,
        "cloud_provider": "",
        "cloud_region": "",
        "os": platform.platform(),
        "python_version": platform.python_version(),
        "codecarbon_version": "",
        "cpu_count": os.cpu_count() or 0,
        "cpu_model": platform.processor() or platform.machine(),
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


def _ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError, AttributeError):
        return 0.0
