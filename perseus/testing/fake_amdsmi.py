"""A fake `amdsmi` module: AMD SMI without an AMD GPU, for tests only.

`installed(gpus)` puts a module object that looks like AMD's official `amdsmi` package (7.0)
into `sys.modules["amdsmi"]` and restores what was there afterwards, so code that does
`import amdsmi` (Perseus' AMD backend) runs unchanged against configurable GPUs:

    with installed([FakeAMDGPU(), FakeAMDGPU(power_w=300)], clock=VirtualClock()) as smi:
        gpus = amd_gpus()

Names and values mirror the real package: the functions Perseus calls (and a few more), the
enums (`AmdSmiInitFlags`, `AmdSmiClkType`, `AmdSmiDevPerfLevel`), the exceptions
(`AmdSmiLibraryException(err_code)` with `get_error_code()`, `AmdSmiParameterException` for a
wrong argument type) and the status codes (`fake.amdsmi_wrapper.AMDSMI_STATUS_*`), all defined in
`perseus.testing.amdsmi_codes`. Units too: power in W, power caps in uW, DPM clocks in Hz, the
clock-range setter in MHz, energy in counts of `counter_resolution` uJ.

Each `FakeAMDGPU` integrates its power over the given clock into its energy accumulator (times
`counter_rate`: 2.0 models a counter that runs at twice the right rate, 0.0 one that stands
still; `counter_bits=32` makes it wrap), keeps its GFX soft range and performance level as
amdgpu does (the range setter needs min < max within OD_RANGE and switches to manual; `auto`
restores the defaults), keeps its power cap, and raises any amdsmi status injected for a call name
(`errors={"amdsmi_set_power_cap": AMDSMI_STATUS_NO_PERM}`). `unimportable(exc)` makes
`import amdsmi` raise `exc` instead, as the real package does without libamd_smi.so.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from perseus.clock import REAL_CLOCK, Clock
from perseus.testing.amdsmi_codes import (
    AMDSMI_STATUS_INVAL,
    AMDSMI_STATUS_NOT_FOUND,
    AMDSMI_STATUS_NOT_INIT,
    AMDSMI_STATUS_NOT_SUPPORTED,
    STATUS,
    AmdSmiClkType,
    AmdSmiDevPerfLevel,
    AmdSmiException,
    AmdSmiInitFlags,
    AmdSmiLibraryException,
    AmdSmiParameterException,
    AmdSmiRetryException,
    AmdSmiTimeoutException,
    raise_status,
)


@dataclass
class FakeAMDGPU:
    """One fake AMD GPU (an MI300X by default). Power in W, caps in uW, clocks in MHz."""

    market_name: str = "AMD Instinct MI300X"
    product_name: str = "AMD Instinct MI300X OAM"
    uuid: str = ""  # empty: installed() assigns uuid_for(position)
    asic_serial: str = ""  # empty: installed() assigns serial_for(position), e.g. 0x4CC6D2E8D2A9B1F6
    bdf: str = ""  # empty: installed() assigns bdf_for(position)
    hip_id: int | None = None  # None: its position
    power_w: int = 140
    power_key: str = "current_socket_power"  # the power field it reports ("average_socket_power" on MI200)
    counter_resolution_uj: float = 15.300000190734863  # 15.3 as a C float
    counter_start: int = 1_000_000
    counter_rate: float = 1.0  # how fast the counter runs against the energy really drawn
    counter_bits: int = 64
    sclk_range_mhz: tuple[int, int] = (500, 2100)  # OD_RANGE: what the range setter accepts
    load_clock_mhz: int | None = None  # what it runs at under its soft max (None: busy, at the max)
    power_cap_range_uw: tuple[int, int] = (200_000_000, 750_000_000)
    default_power_cap_uw: int = 750_000_000
    errors: dict[str, int] = field(default_factory=dict)  # amdsmi call name -> status it raises here

    def __post_init__(self) -> None:
        self.soft_range_mhz = self.sclk_range_mhz
        self.perf_level = AmdSmiDevPerfLevel.AUTO
        self.power_cap_uw = self.default_power_cap_uw
        self._joules = 0.0
        self._since: float | None = None
        self._clock: Clock = REAL_CLOCK
        self._lock = threading.Lock()

    def _attach(self, clock: Clock) -> None:
        with self._lock:
            self._clock = clock
            self._since = clock.now()

    def _accumulate(self) -> float:
        now = self._clock.now()
        if self._since is not None:
            self._joules += self.power_w * (now - self._since)
        self._since = now
        return self._joules

    def set_power(self, watts: int) -> None:
        """Change the power draw from now on (energy so far stays integrated at the old power)."""
        with self._lock:
            self._accumulate()
            self.power_w = watts

    def count(self) -> int:
        """The raw accumulator: counts since its start, at `counter_rate`, modulo 2**counter_bits."""
        with self._lock:
            joules = self._accumulate()
        raw = self.counter_start + int(joules * 1e6 * self.counter_rate / self.counter_resolution_uj)
        return raw % 2**self.counter_bits

    def gfx_clock(self) -> int:
        low, high = self.soft_range_mhz
        return max(low, min(high, self.load_clock_mhz or high))


class FakeAMDSMI:
    """The state behind one installed fake module: its GPUs, clock and init count."""

    def __init__(
        self,
        gpus: Sequence[FakeAMDGPU],
        clock: Clock = REAL_CLOCK,
        errors: dict[str, int] | None = None,
        energy_key: str = "energy_accumulator",
    ) -> None:
        self.gpus = list(gpus)
        self.clock = clock
        self.errors = dict(errors or {})  # calls that take no handle (amdsmi_init, ...)
        self.energy_key = energy_key  # "power" before amdsmi 6.2.1
        self.init_count = 0
        self.calls: dict[str, int] = {}
        self.writes: list[tuple[str, int, tuple]] = []  # (call, GPU position, arguments), in order
        for i, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or uuid_for(i)
            gpu.asic_serial = gpu.asic_serial or serial_for(i)
            gpu.bdf = gpu.bdf or bdf_for(i)
            gpu._attach(clock)

    # Plumbing ---------------------------------------------------------------------------
    def _enter(self, call: str, handle: object = None, needs_handle: bool = True, needs_init: bool = True) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        if needs_handle and not isinstance(handle, FakeAMDGPU):
            raise AmdSmiParameterException(handle, "amdsmi_processor_handle")
        code = self.errors.get(call)
        if code is None and isinstance(handle, FakeAMDGPU):
            if handle not in self.gpus:
                code = AMDSMI_STATUS_NOT_FOUND
            else:
                code = handle.errors.get(call)
        if code is not None:
            raise_status(code)
        if needs_init and self.init_count == 0:
            raise_status(AMDSMI_STATUS_NOT_INIT)

    def _write(self, call: str, handle: FakeAMDGPU, *args: object) -> None:
        self.writes.append((call, self.gpus.index(handle), args))

    # Library ----------------------------------------------------------------------------
    def amdsmi_init(self, flag: AmdSmiInitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag, AmdSmiInitFlags)
        self._enter("amdsmi_init", needs_handle=False, needs_init=False)
        self.init_count += 1

    def amdsmi_shut_down(self) -> None:
        self._enter("amdsmi_shut_down", needs_handle=False)
        self.init_count -= 1

    def amdsmi_get_processor_handles(self) -> list[FakeAMDGPU]:
        self._enter("amdsmi_get_processor_handles", needs_handle=False)
        return list(self.gpus)

    def amdsmi_get_processor_type(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_processor_type", handle)
        return {"processor_type": "AMDSMI_PROCESSOR_TYPE_AMD_GPU"}

    # Identity ---------------------------------------------------------------------------
    def amdsmi_get_gpu_enumeration_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_gpu_enumeration_info", handle)
        position = self.gpus.index(handle)
        hip_id = position if handle.hip_id is None else handle.hip_id
        return {
            "drm_render": 128 + position,
            "drm_card": position,
            "hsa_id": 2 + position,
            "hip_id": hip_id,
            "hip_uuid": f"GPU-{int(handle.asic_serial, 16):016x}",
        }

    def amdsmi_get_gpu_asic_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_gpu_asic_info", handle)
        return {
            "market_name": handle.market_name,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x74a1",
            "rev_id": "0x00",
            "asic_serial": handle.asic_serial,
            "oam_id": self.gpus.index(handle),
            "num_compute_units": 304,
            "target_graphics_version": "gfx942",
            "subsystem_id": "0x74a1",
        }

    def amdsmi_get_gpu_board_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_gpu_board_info", handle)
        return {
            "model_number": "102-G30211-00",
            "product_serial": "692251001124",
            "fru_id": "N/A",
            "product_name": handle.product_name,
            "manufacturer_name": "AMD",
        }

    def amdsmi_get_gpu_device_uuid(self, handle: FakeAMDGPU) -> str:
        self._enter("amdsmi_get_gpu_device_uuid", handle)
        return handle.uuid

    def amdsmi_get_gpu_device_bdf(self, handle: FakeAMDGPU) -> str:
        self._enter("amdsmi_get_gpu_device_bdf", handle)
        return handle.bdf

    # Energy and power -------------------------------------------------------------------
    def amdsmi_get_energy_count(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_energy_count", handle)
        return {
            self.energy_key: handle.count(),
            "counter_resolution": handle.counter_resolution_uj,
            "timestamp": int(self.clock.now() * 1e9),
        }

    def amdsmi_get_power_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_power_info", handle)
        doc: dict[str, object] = dict.fromkeys(
            ("socket_power", "current_socket_power", "average_socket_power", "gfx_voltage", "soc_voltage"), "N/A"
        )
        doc["mem_voltage"] = "N/A"
        if handle.power_key in doc:
            doc[handle.power_key] = int(handle.power_w)
        doc["power_limit"] = handle.power_cap_uw
        return doc

    def amdsmi_get_power_cap_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_power_cap_info", handle)
        low, high = handle.power_cap_range_uw
        return {
            "power_cap": handle.power_cap_uw,
            "default_power_cap": handle.default_power_cap_uw,
            "dpm_cap": 2100,
            "min_power_cap": low,
            "max_power_cap": high,
        }

    def amdsmi_set_power_cap(self, handle: FakeAMDGPU, sensor_ind: int, cap: int) -> None:
        if not isinstance(sensor_ind, int):
            raise AmdSmiParameterException(sensor_ind, int)
        if not isinstance(cap, int):
            raise AmdSmiParameterException(cap, int)
        self._enter("amdsmi_set_power_cap", handle)
        low, high = handle.power_cap_range_uw
        if sensor_ind != 0 or not low <= cap <= high:
            raise_status(AMDSMI_STATUS_INVAL)
        handle.power_cap_uw = cap
        self._write("amdsmi_set_power_cap", handle, sensor_ind, cap)

    # Clocks -----------------------------------------------------------------------------
    def amdsmi_get_clock_info(self, handle: FakeAMDGPU, clock_type: AmdSmiClkType) -> dict:
        if not isinstance(clock_type, AmdSmiClkType):
            raise AmdSmiParameterException(clock_type, AmdSmiClkType)
        self._enter("amdsmi_get_clock_info", handle)
        if clock_type == AmdSmiClkType.MEM:
            return {"clk": 1300, "min_clk": 900, "max_clk": 1300, "clk_locked": "N/A", "clk_deep_sleep": "N/A"}
        if clock_type != AmdSmiClkType.GFX:
            raise_status(AMDSMI_STATUS_NOT_SUPPORTED)
        low, high = handle.soft_range_mhz
        locked = handle.perf_level == AmdSmiDevPerfLevel.MANUAL
        return {"clk": handle.gfx_clock(), "min_clk": low, "max_clk": high, "clk_locked": locked, "clk_deep_sleep": 0}

    def amdsmi_get_clk_freq(self, handle: FakeAMDGPU, clk_type: AmdSmiClkType) -> dict:
        """The DPM levels in Hz: as amdgpu's pp_dpm_sclk on MI200/MI300, the soft min, now, and soft max."""
        if not isinstance(clk_type, AmdSmiClkType):
            raise AmdSmiParameterException(clk_type, AmdSmiClkType)
        self._enter("amdsmi_get_clk_freq", handle)
        if clk_type != AmdSmiClkType.GFX:
            raise_status(AMDSMI_STATUS_NOT_SUPPORTED)
        low, high = handle.soft_range_mhz
        levels = sorted({low, handle.gfx_clock(), high})
        return {
            "num_supported": len(levels),
            "current": levels.index(handle.gfx_clock()),
            "frequency": [mhz * 1_000_000 for mhz in levels],
        }

    def amdsmi_get_gpu_od_volt_info(self, handle: FakeAMDGPU) -> dict:
        self._enter("amdsmi_get_gpu_od_volt_info", handle)
        (low, high), (soft_low, soft_high) = handle.sclk_range_mhz, handle.soft_range_mhz
        return {
            "curr_sclk_range": {"lower_bound": soft_low * 1_000_000, "upper_bound": soft_high * 1_000_000},
            "curr_mclk_range": {"lower_bound": 900_000_000, "upper_bound": 1_300_000_000},
            "sclk_freq_limits": {"lower_bound": low * 1_000_000, "upper_bound": high * 1_000_000},
            "mclk_freq_limits": {"lower_bound": 900_000_000, "upper_bound": 1_300_000_000},
            "curve.vc_points": [],
            "num_regions": 0,
        }

    def amdsmi_set_gpu_clk_range(
        self, handle: FakeAMDGPU, min_clk_value: int, max_clk_value: int, clk_type: AmdSmiClkType
    ) -> None:
        for value in (min_clk_value, max_clk_value):
            if not isinstance(value, int):
                raise AmdSmiParameterException(value, int)
        if not isinstance(clk_type, AmdSmiClkType):
            raise AmdSmiParameterException(clk_type, AmdSmiClkType)
        self._enter("amdsmi_set_gpu_clk_range", handle)
        low, high = handle.sclk_range_mhz
        if clk_type != AmdSmiClkType.GFX or not low <= min_clk_value < max_clk_value <= high:
            raise_status(AMDSMI_STATUS_INVAL)  # ROCm SMI needs min < max; amdgpu refuses values outside OD_RANGE
        handle.perf_level = AmdSmiDevPerfLevel.MANUAL
        handle.soft_range_mhz = (min_clk_value, max_clk_value)
        self._write("amdsmi_set_gpu_clk_range", handle, min_clk_value, max_clk_value, clk_type)

    def amdsmi_get_gpu_perf_level(self, handle: FakeAMDGPU) -> str:
        self._enter("amdsmi_get_gpu_perf_level", handle)
        return f"AMDSMI_DEV_PERF_LEVEL_{handle.perf_level.name}"

    def amdsmi_set_gpu_perf_level(self, handle: FakeAMDGPU, perf_level: AmdSmiDevPerfLevel) -> None:
        if not isinstance(perf_level, AmdSmiDevPerfLevel):
            raise AmdSmiParameterException(perf_level, AmdSmiDevPerfLevel)
        self._enter("amdsmi_set_gpu_perf_level", handle)
        handle.perf_level = perf_level
        if perf_level == AmdSmiDevPerfLevel.AUTO:
            handle.soft_range_mhz = handle.sclk_range_mhz  # amdgpu restores its default soft limits
        self._write("amdsmi_set_gpu_perf_level", handle, perf_level)


_MODULE_FUNCTIONS = [name for name in vars(FakeAMDSMI) if name.startswith("amdsmi_")]
_MODULE_CLASSES = (
    AmdSmiInitFlags,
    AmdSmiClkType,
    AmdSmiDevPerfLevel,
    AmdSmiException,
    AmdSmiLibraryException,
    AmdSmiRetryException,
    AmdSmiTimeoutException,
    AmdSmiParameterException,
)


def make_module(state: FakeAMDSMI, enumeration_info: bool = True) -> types.ModuleType:
    """A module object named `amdsmi` whose functions act on `state`.

    Without `enumeration_info` it lacks amdsmi_get_gpu_enumeration_info, as amdsmi before ROCm 6.4 does.
    """
    fake = types.ModuleType("amdsmi", "Fake AMD SMI (perseus.testing.fake_amdsmi); tests only.")
    for cls in _MODULE_CLASSES:
        setattr(fake, cls.__name__, cls)
    for name in _MODULE_FUNCTIONS:
        if enumeration_info or name != "amdsmi_get_gpu_enumeration_info":
            setattr(fake, name, getattr(state, name))
    wrapper = types.ModuleType("amdsmi.amdsmi_wrapper")
    for name, code in STATUS.items():
        setattr(wrapper, name, code)
    vars(fake)["amdsmi_wrapper"] = wrapper
    vars(fake)["PERSEUS_FAKE_AMDSMI"] = state  # the state behind it, for tests
    return fake


@contextlib.contextmanager
def installed(
    gpus: Sequence[FakeAMDGPU],
    clock: Clock = REAL_CLOCK,
    errors: dict[str, int] | None = None,
    energy_key: str = "energy_accumulator",
    enumeration_info: bool = True,
) -> Iterator[FakeAMDSMI]:
    """Make `import amdsmi` return a fake over `gpus` inside the block; restore afterwards.

    `errors` injects failures into calls that take no handle (e.g. {"amdsmi_init":
    AMDSMI_STATUS_DRIVER_NOT_LOADED}); per-GPU failures go in `FakeAMDGPU.errors`.
    """
    state = FakeAMDSMI(gpus, clock=clock, errors=errors, energy_key=energy_key)
    with _module("amdsmi", make_module(state, enumeration_info)):
        yield state


class _Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, error: BaseException) -> None:
        self.name = name
        self.error = error

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == self.name:
            raise self.error
        return None


@contextlib.contextmanager
def unimportable(error: BaseException) -> Iterator[None]:
    """Make `import amdsmi` raise `error` inside the block (ImportError: not installed; OSError:
    the package installed without libamd_smi.so, as the real one fails)."""
    finder = _Refuse("amdsmi", error)
    with _module("amdsmi", None, remove=True):
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            sys.meta_path.remove(finder)


@contextlib.contextmanager
def _module(name: str, module: types.ModuleType | None, remove: bool = False) -> Iterator[None]:
    previous = sys.modules.get(name)
    if remove:
        sys.modules.pop(name, None)
    elif module is not None:
        sys.modules[name] = module
    try:
        yield
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous


def uuid_for(i: int) -> str:
    """A distinct, well-formed amdsmi UUID for fake GPU number `i`."""
    return f"{i:02x}ff74a1-0000-1000-80{i:02x}-d3c76e27a9c4"


def serial_for(i: int) -> str:
    """A distinct ASIC serial (ROCm's unique id) for fake GPU number `i`, as amdsmi formats it."""
    return f"0x{0x4CC6D2E8D2A9B100 + i:016X}"


def bdf_for(i: int) -> str:
    return f"0000:{0x0C + 0x10 * i:02x}:00.0"
