"""A fake `pynvml` module: NVML without an NVIDIA GPU, for tests and benchmarks only.

`installed(gpus)` puts a module object that looks like the official nvidia-ml-py binding into
`sys.modules["pynvml"]` and restores what was there afterwards, so code that does `import pynvml`
(Perseus' NVML backend, zeus' ZeusMonitor) runs unchanged against configurable GPUs:

    with installed([FakeGPU(), FakeGPU(uuid="GPU-1111...")], clock=VirtualClock()) as nvml:
        gpus = nvml_gpus()

Constants and exception classes carry the real names and values (`perseus.testing.nvml_codes`:
`NVMLError` with `.value`, `NVMLError_NoPermission`, ...). Each `FakeGPU` integrates its power over the given clock into
its energy counter, keeps locked clocks and power limits, and raises any NVML error injected for
a call name (`errors={"nvmlDeviceSetGpuLockedClocks": NVML_ERROR_NO_PERMISSION}`). Import code
that binds `pynvml` at import time (zeus) inside the `with` block.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from perseus.clock import REAL_CLOCK, Clock
from perseus.testing import nvml_codes
from perseus.testing.nvml_codes import (
    ERROR_TEXT,
    NVML_CLOCK_MEM,
    NVML_DEVICE_ARCH_AMPERE,
    NVML_DEVICE_ARCH_VOLTA,
    NVML_DEVICE_MIG_DISABLE,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NVML_FEATURE_DISABLED,
    NVML_FI_DEV_POWER_AVERAGE,
    NVML_FI_DEV_POWER_INSTANT,
    NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    NVML_SUCCESS,
    NVMLError,
)


@dataclass
class FakeGPU:
    """One fake NVIDIA GPU. Power in mW, energy in mJ, clocks in MHz (NVML's units)."""

    name: str = "NVIDIA A100-SXM4-40GB"
    uuid: str = ""  # empty: installed() assigns uuid_for(position)
    architecture: int = NVML_DEVICE_ARCH_AMPERE
    power_mw: int = 84_000
    graphics_clocks: list[int] = field(default_factory=lambda: list(range(1410, 209, -15)))  # an A100's
    memory_clocks: list[int] = field(default_factory=lambda: [1215])
    idle_sm_clock: int = 210
    power_limit_range_mw: tuple[int, int] = (100_000, 400_000)
    default_power_limit_mw: int = 400_000
    energy_start_mj: int = 1_000_000
    memory_total_bytes: int = 40 * 2**30
    temperature_c: int = 35
    mig_mode: int = NVML_DEVICE_MIG_DISABLE
    errors: dict[str, int] = field(default_factory=dict)  # NVML call name -> error code it raises here

    def __post_init__(self) -> None:
        self.locked_clocks: tuple[int, int] | None = None
        self.memory_locked_clocks: tuple[int, int] | None = None
        self.power_limit_mw = self.default_power_limit_mw
        self.persistence_mode = NVML_FEATURE_DISABLED
        self._energy_mj = float(self.energy_start_mj)
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
            self._energy_mj += self.power_mw * (now - self._since)
        self._since = now
        return self._energy_mj

    def set_power(self, mw: int) -> None:
        """Change the power draw from now on (energy so far stays integrated at the old power)."""
        with self._lock:
            self._accumulate()
            self.power_mw = mw

    def energy(self) -> int:
        with self._lock:
            return int(self._accumulate())

    def sm_clock(self) -> int:
        return self.locked_clocks[1] if self.locked_clocks else self.idle_sm_clock


@dataclass
class _FieldValue:
    fieldId: int
    scopeId: int
    nvmlReturn: int
    value: types.SimpleNamespace
    timestamp: int = 0
    latencyUsec: int = 0


class FakeNVML:
    """The state behind one installed fake module: its GPUs, clock and init count."""

    def __init__(
        self,
        gpus: Sequence[FakeGPU],
        clock: Clock = REAL_CLOCK,
        errors: dict[str, int] | None = None,
        driver_version: str = "550.54.15",
    ) -> None:
        self.gpus = list(gpus)
        self.clock = clock
        self.errors = dict(errors or {})  # module-level calls (nvmlInit, nvmlDeviceGetCount, ...)
        self.driver_version = driver_version
        self.init_count = 0
        self.calls: dict[str, int] = {}
        for i, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or uuid_for(i)
            gpu._attach(clock)

    # Plumbing ---------------------------------------------------------------------------
    def _enter(self, call: str, handle: FakeGPU | None = None, needs_init: bool = True) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        code = self.errors.get(call)
        if code is None and handle is not None:
            if not isinstance(handle, FakeGPU) or handle not in self.gpus:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            code = handle.errors.get(call)
        if code is not None:
            raise NVMLError(code)
        if needs_init and self.init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    # System -----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        self.init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self._enter("nvmlInitWithFlags", needs_init=False)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.init_count -= 1

    def nvmlErrorString(self, result: int) -> str:
        return ERROR_TEXT.get(result, "Unknown Error")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return "12." + self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return 12040

    def _nvmlGetFunctionPointer(self, name: str):
        """Present because callers test for it to tell the official binding from the unofficial one."""
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)

    # Handles ----------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGPU:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == text:
                return gpu
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return self.gpus.index(handle)

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeGPU) -> bool:
        self._enter("nvmlDeviceIsMigDeviceHandle", handle)
        return False

    def nvmlDeviceGetMigMode(self, handle: FakeGPU) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        return [handle.mig_mode, handle.mig_mode]

    # Identity ---------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: FakeGPU) -> str:
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGPU) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetArchitecture(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetArchitecture", handle)
        return handle.architecture

    def nvmlDeviceGetC2cModeInfoV(self, handle: FakeGPU):
        self._enter("nvmlDeviceGetC2cModeInfoV", handle)
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetPersistenceMode(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetPersistenceMode", handle)
        return handle.persistence_mode

    def nvmlDeviceSetPersistenceMode(self, handle: FakeGPU, mode: int) -> None:
        self._enter("nvmlDeviceSetPersistenceMode", handle)
        handle.persistence_mode = mode

    # Energy and power -------------------------------------------------------------------
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        if handle.architecture < NVML_DEVICE_ARCH_VOLTA:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle.energy()

    def nvmlDeviceGetPowerUsage(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return int(handle.power_mw)

    def nvmlDeviceGetFieldValues(self, handle: FakeGPU, field_ids: Sequence) -> list[_FieldValue]:
        self._enter("nvmlDeviceGetFieldValues", handle)
        values = []
        for entry in field_ids:
            field_id, scope = entry if isinstance(entry, tuple) else (entry, 0)
            ret, number = NVML_SUCCESS, 0
            if field_id in (NVML_FI_DEV_POWER_INSTANT, NVML_FI_DEV_POWER_AVERAGE):
                number = int(handle.power_mw)
            elif field_id == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
                number = handle.energy()
            else:
                ret = NVML_ERROR_NOT_SUPPORTED
            value = types.SimpleNamespace(uiVal=number, ulVal=number, ullVal=number, dVal=float(number))
            stamp = int(self.clock.now() * 1e6)
            values.append(_FieldValue(field_id, scope, ret, value, stamp))
        return values

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetPowerManagementLimit", handle)
        return handle.power_limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit", handle)
        return handle.power_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: FakeGPU) -> list[int]:
        self._enter("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        return list(handle.power_limit_range_mw)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeGPU) -> int:
        self._enter("nvmlDeviceGetPowerManagementDefaultLimit", handle)
        return handle.default_power_limit_mw

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeGPU, limit: int) -> None:
        self._enter("nvmlDeviceSetPowerManagementLimit", handle)
        low, high = handle.power_limit_range_mw
        if not low <= limit <= high:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle.power_limit_mw = int(limit)

    # Clocks -----------------------------------------------------------------------------
    def nvmlDeviceGetSupportedMemoryClocks(self, handle: FakeGPU) -> list[int]:
        self._enter("nvmlDeviceGetSupportedMemoryClocks", handle)
        return list(handle.memory_clocks)

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle: FakeGPU, memory_clock_mhz: int) -> list[int]:
        self._enter("nvmlDeviceGetSupportedGraphicsClocks", handle)
        if memory_clock_mhz not in handle.memory_clocks:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return list(handle.graphics_clocks)

    def nvmlDeviceGetClockInfo(self, handle: FakeGPU, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", handle)
        if clock_type == NVML_CLOCK_MEM:
            return max(handle.memory_clocks)
        return handle.sm_clock()

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeGPU, clock_type: int) -> int:
        self._enter("nvmlDeviceGetMaxClockInfo", handle)
        return max(handle.memory_clocks if clock_type == NVML_CLOCK_MEM else handle.graphics_clocks)

    def nvmlDeviceSetGpuLockedClocks(self, handle: FakeGPU, min_mhz: int, max_mhz: int) -> None:
        self._enter("nvmlDeviceSetGpuLockedClocks", handle)
        if handle.architecture < NVML_DEVICE_ARCH_VOLTA:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if min_mhz > max_mhz:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle.locked_clocks = (int(min_mhz), int(max_mhz))

    def nvmlDeviceResetGpuLockedClocks(self, handle: FakeGPU) -> None:
        self._enter("nvmlDeviceResetGpuLockedClocks", handle)
        handle.locked_clocks = None

    def nvmlDeviceSetMemoryLockedClocks(self, handle: FakeGPU, min_mhz: int, max_mhz: int) -> None:
        self._enter("nvmlDeviceSetMemoryLockedClocks", handle)
        handle.memory_locked_clocks = (int(min_mhz), int(max_mhz))

    def nvmlDeviceResetMemoryLockedClocks(self, handle: FakeGPU) -> None:
        self._enter("nvmlDeviceResetMemoryLockedClocks", handle)
        handle.memory_locked_clocks = None

    # Other common queries ---------------------------------------------------------------
    def nvmlDeviceGetTemperature(self, handle: FakeGPU, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        return handle.temperature_c

    def nvmlDeviceGetTemperatureV(self, handle: FakeGPU, sensor: int, version: int = 0) -> int:
        self._enter("nvmlDeviceGetTemperatureV", handle)
        return handle.temperature_c

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGPU, version: int | None = None):
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        total = handle.memory_total_bytes
        return types.SimpleNamespace(total=total, free=total, used=0, reserved=0)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU):
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        return types.SimpleNamespace(gpu=0, memory=0)


_MODULE_FUNCTIONS = [name for name in vars(FakeNVML) if name.startswith(("nvml", "_nvml"))]


def make_module(state: FakeNVML) -> types.ModuleType:
    """A module object named `pynvml` whose functions act on `state`."""
    fake = types.ModuleType("pynvml", "Fake NVML binding (perseus.testing.fake_nvml); tests only.")
    for name, value in vars(nvml_codes).items():
        if name.startswith(("NVML_", "NVMLError")):
            setattr(fake, name, value)
    for name in _MODULE_FUNCTIONS:
        setattr(fake, name, getattr(state, name))
    vars(fake)["PERSEUS_FAKE_NVML"] = state  # a dynamic module attribute: the state behind it, for tests
    return fake


@contextlib.contextmanager
def installed(
    gpus: Sequence[FakeGPU],
    clock: Clock = REAL_CLOCK,
    errors: dict[str, int] | None = None,
) -> Iterator[FakeNVML]:
    """Make `import pynvml` return a fake over `gpus` inside the block; restore afterwards.

    `errors` injects failures into calls that take no handle (e.g. {"nvmlInit":
    NVML_ERROR_DRIVER_NOT_LOADED}); per-GPU failures go in `FakeGPU.errors`.
    """
    state = FakeNVML(gpus, clock=clock, errors=errors)
    previous = sys.modules.get("pynvml")
    sys.modules["pynvml"] = make_module(state)
    try:
        yield state
    finally:
        if previous is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = previous


def uuid_for(i: int) -> str:
    """A distinct, well-formed GPU UUID for fake GPU number `i`."""
    return f"GPU-{i:08x}-1111-2222-3333-{i:012x}"
