"""AMD Instinct GPUs through AMD SMI, via AMD's official Python package `amdsmi` (`pip install 'perseus-energy[amd]'`).

Which GPUs. `amd_gpus()` returns the GPUs this process sees, indexed as HIP (and torch's ROCm
build, through `torch.cuda`) indexes them, narrowed the way ROCm narrows them: first
ROCR_VISIBLE_DEVICES among all GPUs, then HIP_VISIBLE_DEVICES among those -- or, where that is
unset, CUDA_VISIBLE_DEVICES, which HIP reads the same way. Each lists indices or UUIDs (ROCm's
`GPU-<16 hex digits>` as `rocminfo` prints it, amdsmi's own UUID, or a unique prefix of either).
An empty value hides every GPU and is an error. HIP's order is amdsmi's `hip_id`
(amdsmi_get_gpu_enumeration_info) where the installed amdsmi has it, else amdsmi's own order.

What each capability calls (amdsmi's units converted to Perseus': mJ, mW, MHz):
- name: amdsmi_get_gpu_asic_info()["market_name"], else amdsmi_get_gpu_board_info()["product_name"].
- UUID: amdsmi_get_gpu_device_uuid().
- energy: amdsmi_get_energy_count(): "energy_accumulator" (named "power" before amdsmi 6.2.1)
  counts of "counter_resolution" microjoules each (typically 15.3 uJ).
- power: amdsmi_get_power_info(): "current_socket_power" (W; instantaneous, what MI300 reports),
  else "average_socket_power" (W; what MI200 reports), else "socket_power". 1 W resolution.
- supported GFX clocks: the range the clock-range setter accepts, amdgpu's OD_RANGE for SCLK
  (amdsmi_get_gpu_od_volt_info()["sclk_freq_limits"]), else the lowest and highest GFX DPM level
  (amdsmi_get_clk_freq(GFX)). AMD takes any whole MHz in that range; Perseus offers a grid from
  the top down in CLOCK_STEP_MHZ steps, above the floor (the floor itself cannot be a cap, see
  below). Read once and cached.
- current GFX clock: amdsmi_get_clock_info(GFX)["clk"] (MHz).
- clock control, the closest AMD has to NVIDIA's locked SM clock:
  `lock_sm_clock(f)` calls amdsmi_set_gpu_clk_range(floor, f, GFX). amdsmi switches the GPU's
  performance level to manual and writes the GFX soft minimum and maximum (amdgpu's
  pp_od_clk_voltage `s 0 floor`, `s 1 f`, then commits). What that guarantees: the SMU keeps the
  GFX clock at or below f; under load it runs at f unless the power cap or a thermal limit pulls it
  lower (as a locked clock on NVIDIA also yields to those); idle, it may drop towards the floor,
  where an NVIDIA locked clock would stay. So it is a cap, and `sm_clock()` reads what the GPU
  runs at right now. The range must have min < max (ROCm SMI refuses min == max), so the floor is
  never itself a cap. `reset_sm_clock()` widens the range back to (floor, top) and hands the
  clock back to the driver: amdsmi_set_gpu_perf_level(AUTO), which restores amdgpu's default
  soft limits too.
- power cap: amdsmi_get_power_cap_info() ("power_cap", "default_power_cap", "min_power_cap",
  "max_power_cap", all uW), amdsmi_set_power_cap(sensor 0, uW) to set and, with the default, to reset.

Privileges. amdsmi's setters write amdgpu's sysfs files (power_dpm_force_performance_level,
pp_od_clk_voltage, hwmon power1_cap), which belong to root: run as root, or have an
administrator open those files to your group (a udev rule). In a container /sys is read-only
unless the container runs --privileged. A virtual machine guest (an SR-IOV virtual function)
supports none of the setters. Reading needs no privilege.

Vendor quirks handled:
- Energy counters that advance at the wrong rate, or not at all (ROCm/amdsmi#38, reported on an
  MI100: a reboot fixed it there). Before first use every counter is
  cross-checked against the GPU's integrated power over ENERGY_CHECK_S (all GPUs of a selection
  at once); a counter off by more than COUNTER_TOLERANCE x is not used: a warning says by how much,
  and the Monitor measures that GPU by sampling power instead (`has_energy_counter()` is False).
- Wraparound. amdsmi returns 64 bits, but where the firmware keeps a 32-bit accumulator it wraps
  every 2**32 counts (65.7 kJ at 15.3 uJ: about 90 s at 750 W). A counter below 2**32 that drops
  by more than half its range has wrapped: Perseus adds 2**32 counts. It sees one wrap between two
  reads; where the energy drawn between two reads (the power now times the time between them) is a
  whole wrap's, it may have missed one, and a warning says so (read more often). A 64-bit counter
  stays quiet: after that much energy it is past 2**32, where no wrap is assumed.
- A counter that steps back a little (a stale read, ROCm/amdsmi#115) is held at its last value;
  one that restarts near zero (a GPU reset) continues from where it was. `energy_mj()` never decreases.
- MI250X: each package has two GCDs, which appear as two GPUs, and amdgpu reports the power and
  energy of both on the first (even) one; the second reads 0 W. The cross-check finds no power and
  no energy on the second and warns: measure the pair on the first.
- Units: amdsmi reports DPM clocks in Hz and the clock-range setter takes MHz; values of 100,000
  or more are read as Hz, so either is accepted.

Every amdsmi failure surfaces as a perseus DeviceError (or subclass) that says what to do.

This module is the AMDGPU device and its selection; loading amdsmi and mapping its errors is in
`amd_smi`, the visibility variables in `amd_visibility`, the counter cross-check in `amd_counter_check`.
"""

from __future__ import annotations

import bisect
import glob
import logging
import os
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from perseus.clock import REAL_CLOCK, Clock
from perseus.devices.amd_counter_check import CounterCheck
from perseus.devices.amd_smi import SIMULATE_HINT, as_str, binding, call
from perseus.devices.amd_visibility import gpu_uuids, hip_order, narrow, visibility_variables
from perseus.devices.gpu import GPU, torch_synchronize
from perseus.devices.instruction_timer import DeviceTimer, InstructionTimer
from perseus.exceptions import ConfigError, DeviceError, DeviceNotFoundError, DeviceNotSupportedError

logger = logging.getLogger(__name__)

#: Grid of supported GFX clocks offered for `lock_sm_clock` (AMD takes any whole MHz in range).
CLOCK_STEP_MHZ = 20
WRAP = 2**32  # a 32-bit firmware accumulator's range
SYSFS_PCI = "/sys/bus/pci/devices"  # where amdgpu's writable files are, per PCI address


def amd_gpus(environ: Mapping[str, str] | None = None, clock: Clock | None = None) -> list[AMDGPU]:
    """The AMD GPUs this process may use, indexed as HIP indexes them.

    `environ` (default os.environ) supplies ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES and
    CUDA_VISIBLE_DEVICES; `clock` is the one their energy cross-check waits on (tests pass a virtual one).
    """
    env = os.environ if environ is None else environ
    amdsmi = binding()
    handles = list(call(amdsmi, "amdsmi_get_processor_handles"))
    if not handles:
        raise DeviceNotFoundError(f"amdsmi found no AMD GPU on this machine; {SIMULATE_HINT}")
    chosen = hip_order(amdsmi, handles)  # amdsmi positions, in HIP's order
    identities: dict[int, list[str]] = {}

    def ids(position: int) -> list[str]:
        if position not in identities:
            identities[position] = gpu_uuids(amdsmi, handles[position], position)
        return identities[position]

    for var in visibility_variables(env):
        chosen = narrow(var, env[var], chosen, ids)
    gpus = [AMDGPU(index, handles[position], amdsmi, position, clock) for index, position in enumerate(chosen)]
    check = CounterCheck(gpus)
    for gpu in gpus:
        gpu.counter_check = check
    return gpus


def _mhz(value: Any) -> int | None:
    """A clock amdsmi reported, in MHz (values of 100,000 or more are Hz); None if not a clock."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 2**63:
        return None
    return round(value / 1e6) if value >= 100_000 else round(value)


def clock_grid(floor: int, top: int, step: int = CLOCK_STEP_MHZ) -> list[int]:
    """The caps offered between a GPU's clock floor and top: top, top - step, ... while above the floor."""
    return list(range(top, floor, -step))


class AMDGPU(GPU):
    """One AMD GPU. `index` is its HIP index in this process, `amdsmi_index` its position in amdsmi's list."""

    def __init__(
        self,
        index: int,
        handle: Any,
        amdsmi: ModuleType,
        amdsmi_index: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.index = index
        self.amdsmi_index = index if amdsmi_index is None else amdsmi_index
        self._amdsmi = amdsmi
        self._handle = handle
        self._clock = clock or REAL_CLOCK
        self._where = f"GPU {index}"
        self._name = self._read_name()
        self._where = f"GPU {index} ({self._name})"
        self._uuid: str | None = None
        self._limits: tuple[int, int] | None = None  # (floor, top) of the GFX clock, MHz
        self._has_energy: bool | None = None
        self.counter_check = CounterCheck([self])
        # Energy counter state: the last raw count, its time, and counts added for wraps and restarts.
        self._counter_lock = threading.Lock()
        self._last_count: int | None = None
        self._last_read_at = 0.0
        self._added = 0
        self._seen_64_bit = False
        self._max_cap_mw: int | None = None
        self._warned: set[str] = set()

    @property
    def clock(self) -> Clock:
        return self._clock

    def _call(self, name: str, *args: Any) -> Any:
        """A call on this GPU's handle; errors name the call and this GPU."""
        return call(self._amdsmi, name, self._handle, *args, where=self._where)

    def _read_name(self) -> str:
        try:
            name = str(self._call("amdsmi_get_gpu_asic_info").get("market_name", "")).strip()
        except DeviceNotSupportedError:
            name = ""
        if not name or name == "N/A" or name.startswith("0x"):
            try:
                name = str(self._call("amdsmi_get_gpu_board_info").get("product_name", "")).strip()
            except DeviceNotSupportedError:
                name = ""
        return name if name and name != "N/A" else "AMD GPU"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    # Reads
    def name(self) -> str:
        return self._name

    def uuid(self) -> str:
        if self._uuid is None:
            self._uuid = as_str(self._call("amdsmi_get_gpu_device_uuid"))
        return self._uuid

    def has_energy_counter(self) -> bool:
        """Whether the counter passed the cross-check against integrated power (see the module docstring)."""
        if self._has_energy is None:
            self.counter_check.run()
        return bool(self._has_energy)

    def set_counter_verdict(self, usable: bool) -> None:
        self._has_energy = usable

    def energy_mj(self) -> float:
        if not self.has_energy_counter():
            raise DeviceNotSupportedError(
                f"{self._where}: Perseus does not use its energy counter (it has none, or it failed the check "
                "against power logged when it was made); measure it by sampling power "
                "(perseus.measurement.Monitor does this on its own)"
            )
        return self.read_counter_mj()

    def read_counter_mj(self) -> float:
        """The energy counter in mJ, continued across wraps and restarts; never decreases. Unchecked."""
        doc = self._call("amdsmi_get_energy_count")
        count = doc.get("energy_accumulator", doc.get("power"))  # "power" before amdsmi 6.2.1
        resolution_uj = doc.get("counter_resolution")
        if not isinstance(count, int) or not isinstance(resolution_uj, (int, float)) or not resolution_uj > 0:
            raise DeviceNotSupportedError(f"{self._where} reports no energy count (amdsmi_get_energy_count: {doc})")
        now = self._clock.now()
        with self._counter_lock:
            last = self._last_count
            if count >= WRAP:
                self._seen_64_bit = True
            if last is not None and count < last:
                if last < WRAP and last - count > WRAP // 2:
                    self._added += WRAP  # a 32-bit accumulator wrapped
                elif count < last // 2:
                    self._added += last - count  # restarted (a GPU reset): continue from where it was
                    self._warn_once("restart", "%r: its energy counter restarted (a GPU reset?); continuing", self)
                else:
                    count = last  # a stale read a little behind: hold the last value
            elif last is not None and not self._seen_64_bit:
                self._check_missed_wraps(now - self._last_read_at, resolution_uj)
            self._last_count = count
            self._last_read_at = now
            return (count + self._added) * float(resolution_uj) / 1000.0

    def _check_missed_wraps(self, elapsed_s: float, resolution_uj: float) -> None:
        """Warn if this (so far 32-bit-sized) counter may have wrapped twice since its last read."""
        if self._max_cap_mw is None:
            try:
                self._max_cap_mw = self.power_limit_range_mw()[1]
            except DeviceError:
                self._max_cap_mw = 0  # unknown: no warning
        wrap_mj = WRAP * resolution_uj / 1000.0
        if not self._max_cap_mw or elapsed_s * self._max_cap_mw < wrap_mj or "wraps" in self._warned:
            return  # no wrap could be missed at even the highest power (the usual case: no extra read)
        try:
            drawn_mj = self.power_mw() * elapsed_s
        except DeviceError:
            return
        if drawn_mj >= wrap_mj:
            self._warn_once(
                "wraps",
                "%r: about %.0f kJ were drawn in the %.0f s between two energy reads, but its counter is below "
                "2**32: if it is a 32-bit one it wraps every %.1f kJ and wraps between reads are missed; "
                "read it more often (at least every %.0f s at its highest power cap)",
                self,
                drawn_mj / 1e6,
                elapsed_s,
                wrap_mj / 1e6,
                wrap_mj / self._max_cap_mw,
            )

    def power_mw(self) -> float:
        doc = self._call("amdsmi_get_power_info")
        for key in ("current_socket_power", "average_socket_power", "socket_power"):
            watts = doc.get(key)
            if isinstance(watts, (int, float)) and not isinstance(watts, bool):
                return float(watts) * 1000.0
        raise DeviceNotSupportedError(f"{self._where} reports no power (amdsmi_get_power_info: {doc})")

    def clock_limits(self) -> tuple[int, int]:
        """(floor, top) of the GFX clock in MHz: OD_RANGE, else the DPM levels (read once)."""
        if self._limits is None:
            try:
                limits = self._call("amdsmi_get_gpu_od_volt_info")["sclk_freq_limits"]
                low, high = _mhz(limits.get("lower_bound")), _mhz(limits.get("upper_bound"))
            except (DeviceError, KeyError, TypeError, AttributeError):
                low = high = None
            if low is None or high is None or not low < high:
                levels = self._call("amdsmi_get_clk_freq", self._amdsmi.AmdSmiClkType.GFX).get("frequency") or []
                mhz = sorted(m for m in map(_mhz, levels) if m is not None)
                if len(mhz) < 2 or mhz[0] == mhz[-1]:
                    raise DeviceNotSupportedError(f"{self._where} reports no GFX clock range (levels: {levels})")
                low, high = mhz[0], mhz[-1]
            self._limits = (low, high)
        return self._limits

    def supported_frequencies(self) -> list[int]:
        """GFX clocks Perseus may cap at, highest first: CLOCK_STEP_MHZ steps above the floor."""
        return clock_grid(*self.clock_limits())

    def sm_clock(self) -> int:
        """The GFX clock now (MHz): at most the cap; lower while idle."""
        mhz = self._call("amdsmi_get_clock_info", self._amdsmi.AmdSmiClkType.GFX).get("clk")
        if isinstance(mhz, bool) or not isinstance(mhz, int):
            raise DeviceNotSupportedError(f"{self._where} reports no current GFX clock (amdsmi: {mhz!r})")
        return mhz

    def _power_caps_mw(self) -> dict[str, int]:
        doc = self._call("amdsmi_get_power_cap_info")
        caps = {}
        for key in ("power_cap", "default_power_cap", "min_power_cap", "max_power_cap"):
            uw = doc.get(key)
            if isinstance(uw, bool) or not isinstance(uw, int) or not 0 <= uw < 2**63:
                raise DeviceNotSupportedError(f"{self._where} reports no {key} (amdsmi_get_power_cap_info: {doc})")
            caps[key] = round(uw / 1000)
        return caps

    def power_limit_mw(self) -> int:
        return self._power_caps_mw()["power_cap"]

    def power_limit_range_mw(self) -> tuple[int, int]:
        caps = self._power_caps_mw()
        low, high = caps["min_power_cap"], caps["max_power_cap"]
        if not 0 < high or low > high:
            raise DeviceNotSupportedError(f"{self._where} reports no usable power cap range ({low} to {high} mW)")
        return low, high

    def default_power_limit_mw(self) -> int:
        return self._power_caps_mw()["default_power_cap"]

    # Writes
    def lock_sm_clock(self, mhz: int) -> None:
        """Cap the GFX clock at `mhz`: amdsmi_set_gpu_clk_range(floor, mhz, GFX); see the module docstring."""
        supported = self.supported_frequencies()
        if mhz not in supported:
            ascending = supported[::-1]
            i = bisect.bisect_left(ascending, mhz)
            nearest = min(ascending[max(0, i - 1) : i + 1], key=lambda f: abs(f - mhz))
            raise ConfigError(
                f"{self._where} does not support a GFX clock cap of {mhz} MHz (supported: {supported[-1]} to "
                f"{supported[0]} MHz in {CLOCK_STEP_MHZ} MHz steps; nearest is {nearest} MHz)"
            )
        floor, _ = self.clock_limits()
        self._call("amdsmi_set_gpu_clk_range", floor, int(mhz), self._amdsmi.AmdSmiClkType.GFX)

    def reset_sm_clock(self) -> None:
        """Widen the GFX range back to (floor, top), then give the clock back to the driver (perf level auto)."""
        floor, top = self.clock_limits()
        self._call("amdsmi_set_gpu_clk_range", floor, top, self._amdsmi.AmdSmiClkType.GFX)
        self._call("amdsmi_set_gpu_perf_level", self._amdsmi.AmdSmiDevPerfLevel.AUTO)

    def set_power_limit_mw(self, mw: int) -> None:
        self._call("amdsmi_set_power_cap", 0, self.check_power_limit_mw(mw) * 1000)

    def reset_power_limit(self) -> None:
        self._call("amdsmi_set_power_cap", 0, self.default_power_limit_mw() * 1000)

    def can_change_clocks(self) -> bool:
        """Whether this process may write amdgpu's files for this GPU (root, or a group they were
        opened to). Where they cannot be found (no sysfs), whether it is root. Changes nothing."""
        try:
            bdf = as_str(self._call("amdsmi_get_gpu_device_bdf")).lower()
        except DeviceError:
            bdf = ""
        device = os.path.join(SYSFS_PCI, bdf) if bdf else ""
        files = [os.path.join(device, name) for name in ("power_dpm_force_performance_level", "pp_od_clk_voltage")]
        files += sorted(glob.glob(os.path.join(device, "hwmon", "hwmon*", "power1_cap"))) if device else []
        present = [f for f in files if device and os.path.exists(f)]
        if not present:
            return os.geteuid() == 0
        return all(os.access(f, os.W_OK) for f in present)

    def synchronize(self) -> None:
        """Wait for this GPU's queued work (see torch_synchronize)."""
        torch_synchronize(self.index)

    def instruction_timer(self) -> InstructionTimer:
        """Timing events on torch's current stream once torch drives this GPU (see DeviceTimer)."""
        return DeviceTimer(self)
