"""RAPL CPU energy against a fake /sys/class/powercap tree."""

from __future__ import annotations

import os

import pytest

from perseus.devices.cpu import rapl_cpus
from perseus.exceptions import DeviceNotFoundError, DevicePermissionError

RANGE_UJ = 262_143_328_850


def zone(path, name: str, energy_uj: int, range_uj: int = RANGE_UJ):
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return path


def set_energy(zone_dir, energy_uj: int) -> None:
    (zone_dir / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.fixture
def powercap(tmp_path):
    """Two packages; package 0 meters DRAM, package 1 does not; plus a psys zone to skip."""
    root = tmp_path / "powercap"
    p0 = zone(root / "intel-rapl:0", "package-0", 1_000_000)
    zone(p0 / "intel-rapl:0:0", "core", 5)
    dram0 = zone(p0 / "intel-rapl:0:1", "dram", 2_000_000, range_uj=65_712_999_613)
    p1 = zone(root / "intel-rapl:1", "package-1", 7_000_000)
    zone(root / "intel-rapl:2", "psys", 9)
    return root, p0, dram0, p1


def test_finds_packages_and_their_dram_zones(powercap):
    root, *_ = powercap
    cpus = rapl_cpus(str(root))
    assert [c.index for c in cpus] == [0, 1]
    assert cpus[0].package_energy_j() == pytest.approx(1.0)
    assert cpus[0].dram_energy_j() == pytest.approx(2.0)
    assert cpus[1].package_energy_j() == pytest.approx(7.0)
    assert cpus[1].dram_energy_j() is None


def test_counters_stay_monotonic_across_wraparound(powercap):
    root, p0, dram0, _ = powercap
    (cpu, _) = rapl_cpus(str(root))
    set_energy(p0, RANGE_UJ - 500_000)
    set_energy(dram0, 65_712_999_613 - 1_000_000)
    before_pkg, before_dram = cpu.package_energy_j(), cpu.dram_energy_j()
    set_energy(p0, 1_500_000)  # wrapped: 0.5 J to the top, then 1.5 J
    set_energy(dram0, 3_000_000)  # wrapped: 1 J to the top, then 3 J
    assert cpu.package_energy_j() - before_pkg == pytest.approx(2.0)
    assert cpu.dram_energy_j() - before_dram == pytest.approx(4.0)
    set_energy(p0, 1_000_000)  # a second wrap
    assert cpu.package_energy_j() - before_pkg == pytest.approx(2.0 + (RANGE_UJ - 500_000) / 1e6)


def test_absent_powercap_is_a_clear_not_available(tmp_path):
    with pytest.raises(DeviceNotFoundError, match=r"CPU energy \(RAPL\) not available: .* does not exist"):
        rapl_cpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    zone(tmp_path / "empty" / "intel-rapl:0", "psys", 1)
    with pytest.raises(DeviceNotFoundError, match=r"not available: no intel-rapl package zone"):
        rapl_cpus(str(tmp_path / "empty"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_energy_is_a_permission_error_with_the_fix(powercap):
    root, p0, *_ = powercap
    (p0 / "energy_uj").chmod(0o200)
    with pytest.raises(DevicePermissionError, match=r"permission denied on .*energy_uj.*root.*chmod"):
        rapl_cpus(str(root))


def test_permission_error_message_without_needing_non_root(powercap, monkeypatch):
    """Root can read any file, so simulate the kernel's EACCES on energy_uj."""
    root, *_ = powercap
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if str(path).endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    with pytest.raises(DevicePermissionError, match=r"permission denied on .*energy_uj.*Linux 5.10.*chmod"):
        rapl_cpus(str(root))
