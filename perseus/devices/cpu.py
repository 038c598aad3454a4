"""CPU package and DRAM energy through RAPL, read from the Linux powercap tree (/sys/class/powercap).

Each CPU package appears as a zone `intel-rapl:N` (name `package-N`), its DRAM, where the platform
meters it, as a subzone `intel-rapl:N:M` named `dram`. A zone's `energy_uj` counts microjoules
and wraps to zero after `max_energy_range_uj`. Counters here stay monotonic across a wrap by
remembering the last raw value; a wrap is only seen if the counter is read at least once per
wrap period (range / power: about 20 minutes for a 262 kJ range at 200 W), which is the caller's
job (perseus.measurement reads at every window boundary).
"""

from __future__ import annotations

import os
import re
import threading

from perseus.exceptions import DeviceNotFoundError, DevicePermissionError

POWERCAP_ROOT = "/sys/class/powercap"
_PACKAGE_ZONE = re.compile(r"intel-rapl:(\d+)")
_SUBZONE = re.compile(r"intel-rapl:\d+:\d+")


class RaplCounter:
    """One RAPL zone's energy counter, made monotonic across wraparound. Thread-safe."""

    def __init__(self, zone_dir: str) -> None:
        self.path = os.path.join(zone_dir, "energy_uj")
        self.range_uj = int(_read(os.path.join(zone_dir, "max_energy_range_uj")))
        self._lock = threading.Lock()
        self._last_uj = self._read_raw()
        self._wrapped_uj = 0

    def _read_raw(self) -> int:
        try:
            return int(_read(self.path))
        except PermissionError as e:
            raise DevicePermissionError(
                f"CPU energy (RAPL) is present but not readable: permission denied on {self.path}. "
                "Since Linux 5.10 energy_uj is readable by root only: run as root, or let all "
                "users read it until the next reboot with `sudo chmod a+r "
                "/sys/class/powercap/intel-rapl:*/energy_uj /sys/class/powercap/intel-rapl:*:*/energy_uj`"
            ) from e

    def energy_j(self) -> float:
        """Joules since an arbitrary origin; never decreases."""
        with self._lock:
            raw = self._read_raw()
            if raw < self._last_uj:
                self._wrapped_uj += self.range_uj
            self._last_uj = raw
            return (self._wrapped_uj + raw) / 1e6


class RaplCPU:
    """One CPU package (socket) with its package and, where metered, DRAM energy counters."""

    def __init__(self, index: int, package: RaplCounter, dram: RaplCounter | None) -> None:
        self.index = index
        self._package = package
        self._dram = dram

    def package_energy_j(self) -> float:
        return self._package.energy_j()

    def dram_energy_j(self) -> float | None:
        """DRAM energy in J, or None where this package has no DRAM zone."""
        return None if self._dram is None else self._dram.energy_j()

    def has_dram(self) -> bool:
        return self._dram is not None

    def __repr__(self) -> str:
        return f"<RaplCPU {self.index}{' +dram' if self._dram else ''}>"


def rapl_cpus(root: str = POWERCAP_ROOT) -> list[RaplCPU]:
    """Every CPU package with a readable RAPL counter, by package number."""
    unavailable = "CPU energy (RAPL) not available: "
    if not os.path.isdir(root):
        raise DeviceNotFoundError(
            f"{unavailable}{root} does not exist (no RAPL here: a VM, a non-x86 CPU, or the "
            "intel_rapl kernel modules are not loaded; try `sudo modprobe intel_rapl_msr`)"
        )
    cpus = []
    for entry in sorted(os.listdir(root)):
        match = _PACKAGE_ZONE.fullmatch(entry)
        zone = os.path.join(root, entry)
        if not match or not _zone_name(zone).startswith("package"):
            continue  # e.g. psys, or a subzone linked at the top level
        name = _zone_name(zone)
        index = int(name.split("-")[1]) if re.fullmatch(r"package-\d+", name) else int(match.group(1))
        cpus.append(RaplCPU(index, RaplCounter(zone), _dram_counter(zone)))
    if not cpus:
        raise DeviceNotFoundError(f"{unavailable}no intel-rapl package zone under {root}")
    return sorted(cpus, key=lambda cpu: cpu.index)


def _dram_counter(package_dir: str) -> RaplCounter | None:
    for entry in sorted(os.listdir(package_dir)):
        sub = os.path.join(package_dir, entry)
        if _SUBZONE.fullmatch(entry) and _zone_name(sub) == "dram":
            return RaplCounter(sub)
    return None


def _zone_name(zone_dir: str) -> str:
    try:
        return _read(os.path.join(zone_dir, "name")).strip()
    except OSError:
        return ""


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
