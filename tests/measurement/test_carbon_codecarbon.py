"""CarbonReporter's CodeCarbon-style emissions.csv: CodeCarbon's columns and units (kWh, kg
CO2e, W, s), one row per run appended under one header, read back as CodeCarbon readers do."""

from __future__ import annotations

import csv

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.measurement import Monitor
from perseus.measurement.carbon import CarbonReporter, StaticIntensity
from perseus.measurement.codecarbon_csv import COLUMNS, RunInfo


class CPUPackage:
    """A CPU package whose counters the test moves (J)."""

    def __init__(self) -> None:
        self.index = 0
        self.package = 0.0
        self.dram = 0.0

    def package_energy_j(self) -> float:
        return self.package

    def dram_energy_j(self) -> float | None:
        return self.dram


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def train(reporter: CarbonReporter, gpus, cpu: CPUPackage, epochs: int = 2) -> None:
    for _ in range(epochs):
        reporter.on_epoch_begin()
        for gpu in gpus:
            gpu.execute(Work(2.0, alpha=0.6), blocking=False)
        for gpu in gpus:
            gpu.synchronize()
        cpu.package += 180.0
        cpu.dram += 36.0
        reporter.on_epoch_end()
    reporter.on_train_end()


def test_each_run_appends_one_row_in_codecarbon_units(tmp_path):
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", 2, clock)
    cpu = CPUPackage()
    path = tmp_path / "emissions.csv"
    info = RunInfo(project_name="gpt-pp4", country_name="Germany", country_iso_code="DEU", region="hesse")
    for _ in range(2):
        reporter = CarbonReporter(
            Monitor(gpus=gpus, cpus=[cpu]), StaticIntensity(400), verbose=False, codecarbon_csv=path, run_info=info
        )
        train(reporter, gpus, cpu)

    with open(path, newline="") as f:
        assert next(csv.reader(f)) == list(COLUMNS)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and rows[0]["run_id"] != rows[1]["run_id"]
    row = rows[1]
    total = reporter.totals()
    gpu_j = total.energy_j - 2 * (180.0 + 36.0)
    assert float(row["duration"]) == pytest.approx(total.time_s) == pytest.approx(4.0)
    assert float(row["gpu_energy"]) == pytest.approx(gpu_j / 3.6e6)
    assert float(row["cpu_energy"]) == pytest.approx(360.0 / 3.6e6)
    assert float(row["ram_energy"]) == pytest.approx(72.0 / 3.6e6)
    assert float(row["energy_consumed"]) == pytest.approx(total.energy_j / 3.6e6)
    assert float(row["emissions"]) == pytest.approx(total.energy_j / 3.6e6 * 400 / 1000)  # kg at 400 g/kWh
    assert float(row["emissions_rate"]) == pytest.approx(float(row["emissions"]) / total.time_s)
    assert float(row["gpu_power"]) == pytest.approx(gpu_j / total.time_s)
    assert float(row["cpu_power"]) == pytest.approx(90.0)
    assert row["gpu_count"] == "2" and row["gpu_model"] == f"2 x {gpus[0].name()}"
    assert (row["project_name"], row["country_iso_code"], row["region"]) == ("gpt-pp4", "DEU", "hesse")
    assert row["on_cloud"] == "N" and float(row["pue"]) == 1.0


def test_a_file_with_other_columns_is_not_appended_to(tmp_path):
    path = tmp_path / "emissions.csv"
    path.write_text("when,what\n1,2\n")
    gpus = sim_gpus("a100-sxm", 1, VirtualClock())
    reporter = CarbonReporter(Monitor(gpus=gpus, cpus=[]), StaticIntensity(100), verbose=False, codecarbon_csv=path)
    reporter.on_epoch_begin()
    reporter.on_epoch_end()
    with pytest.raises(ConfigError, match="other columns than CodeCarbon's emissions.csv"):
        reporter.on_train_end()
    assert path.read_text() == "when,what\n1,2\n"
