"""CarbonReporter's CodeCarbon-style emissions.csv: CodeCarbon's columns and units (kWh, kg
CO2e, W, s), one row per run appended under one header, read back as CodeCarbon readers do."""

from __future__ import annotations

import csv

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.measurement import Monitor, codecarbon_csv
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


class PackageWithoutDRAM(CPUPackage):
    def dram_energy_j(self) -> float | None:
        return None


def one_run(tmp_path, cpus, info=None, epochs=1):
    """One run of `epochs` epochs; the row it appended."""
    gpus = sim_gpus("a100-sxm", 1, VirtualClock())
    path = tmp_path / "emissions.csv"
    reporter = CarbonReporter(
        Monitor(gpus=gpus, cpus=cpus), StaticIntensity(300), verbose=True, codecarbon_csv=path, run_info=info
    )
    train(reporter, gpus, cpus[0] if cpus else CPUPackage(), epochs)
    with open(path, newline="") as f:
        [row] = list(csv.DictReader(f))
    return row


def test_what_was_not_measured_stays_empty(tmp_path, capsys):
    """No CPU counters (cpus=[], or no RAPL): the CPU and RAM columns are empty, not 0.0, and
    the energy consumed is the GPUs'."""
    row = one_run(tmp_path, [])
    for column in ("cpu_energy", "cpu_power", "ram_energy", "ram_power"):
        assert row[column] == "", column
    assert float(row["gpu_energy"]) > 0 and row["energy_consumed"] == row["gpu_energy"]
    assert "training: 1 epoch, " in capsys.readouterr().err  # not "1 epochs"


def test_a_package_without_a_dram_counter_leaves_only_ram_empty(tmp_path):
    row = one_run(tmp_path / "a", [PackageWithoutDRAM()], epochs=2)
    assert float(row["cpu_energy"]) == pytest.approx(360.0 / 3.6e6) and float(row["cpu_power"]) == pytest.approx(90.0)
    assert row["ram_energy"] == row["ram_power"] == ""
    assert float(row["energy_consumed"]) == pytest.approx(float(row["gpu_energy"]) + float(row["cpu_energy"]))


def test_the_country_name_comes_from_the_alpha_3_code(tmp_path):
    row = one_run(tmp_path, [], RunInfo(project_name="gpt", country_iso_code="DEU"))
    assert (row["country_name"], row["country_iso_code"]) == ("Germany", "DEU")
    assert RunInfo(country_iso_code="kor").country_name == "South Korea"
    assert RunInfo(country_iso_code="kor").country_iso_code == "KOR"
    assert RunInfo(country_name="Deutschland", country_iso_code="DEU").country_name == "Deutschland"  # given: kept
    assert RunInfo().country_name == ""


@pytest.mark.parametrize(
    ("code", "hint"), [("DE", "for Germany, give 'DEU'"), ("XYZ", "e.g. 'DEU' for Germany"), ("UK", "e.g. 'DEU'")]
)
def test_a_code_that_is_not_alpha_3_is_a_clear_error(code, hint):
    with pytest.raises(ConfigError, match="is not an ISO 3166-1 alpha-3 code") as error:
        RunInfo(country_iso_code=code)
    assert hint in str(error.value)


@pytest.mark.parametrize(
    ("cpuinfo", "model"),
    [
        (
            "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\ncpu MHz\t\t: 2000.000\n",
            "Intel(R) Xeon(R) Platinum 8480+",
        ),
        (
            "processor\t: 0\ncpu\t\t: POWER9 (raw), altivec supported\nclock\t\t: 3800.000000MHz\n",
            "POWER9 (raw), altivec supported",
        ),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n", ""),  # aarch64: no name
    ],
    ids=["x86_64", "ppc64le", "aarch64"],
)
def test_the_cpu_model_is_the_name_the_system_gives(tmp_path, cpuinfo, model):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert codecarbon_csv.cpu_model(str(path)) == model


def test_run_info_is_importable_beside_the_reporter():
    from perseus.measurement.carbon import RunInfo as FromCarbon  # where the README imports it

    assert FromCarbon is RunInfo
