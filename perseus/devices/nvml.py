"""NVIDIA GPUs through NVML, via the official binding nvidia-ml-py (imported as `pynvml`).

`nvml_gpus()` returns the GPUs this process sees, in CUDA order: `CUDA_VISIBLE_DEVICES` may list
NVML indices or GPU UUIDs (`GPU-8932f937-...`, or any unique prefix, with or without `GPU-`).
An empty value hides every GPU and is an error. MIG instances (`MIG-...`) are refused: an instance
shares the SM clock, power limit and energy counter of its whole GPU, so Perseus could neither
measure it alone nor lock its clock without changing every other instance on that GPU.
CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID while NVML numbers them by
PCI bus; on machines with mixed GPU models set CUDA_DEVICE_ORDER=PCI_BUS_ID so both agree.

Every NVML failure surfaces as a perseus DeviceError (or subclass) that says what to do.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any

from perseus.devices.gpu import GPU, torch_synchronize
from perseus.devices.instruction_timer import DeviceTimer, InstructionTimer
from perseus.exceptions import (
    ConfigError,
    DeviceError,
    DeviceNotFoundError,
    DeviceNotSupportedError,
    DevicePermissionError,
)

CAP_SYS_ADMIN = 21  # bit in /proc/<pid>/status CapEff
SIMULATE_HINT = "to run without a GPU, simulate one: PERSEUS_GPU=sim:a100-sxm"
PRIVILEGE_HINT = (
    "NVML lets only root or a process with CAP_SYS_ADMIN lock clocks and set power limits: run "
    "as root (sudo), or give the process CAP_SYS_ADMIN (in a container: `docker run --cap-add "
    "SYS_ADMIN`). `nvidia-smi -acp UNRESTRICTED` does not help: it only opens application "
    "clocks, which Perseus does not use"
)

_init_lock = threading.Lock()
_initialized: ModuleType | None = None  # the binding module nvmlInit succeeded on


def nvml_gpus(cuda_visible_devices: str | None = None) -> list[NVMLGPU]:
    """The GPUs this process may use, indexed as CUDA indexes them.

    `cuda_visible_devices` defaults to $CUDA_VISIBLE_DEVICES (unset: every GPU NVML sees).
    """
    nvml = binding()
    if cuda_visible_devices is None:
        cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = visible_nvml_indices(nvml, cuda_visible_devices)
    if not indices:
        raise DeviceNotFoundError(f"NVML found no NVIDIA GPU on this machine; {SIMULATE_HINT}")
    return [NVMLGPU(cuda_index, nvml_index, nvml) for cuda_index, nvml_index in enumerate(indices)]


def binding() -> ModuleType:
    """The `pynvml` module: checked to be the official binding and initialised once per process."""
    global _initialized
    try:
        import pynvml
    except ImportError as e:
        raise DeviceNotFoundError(
            f"cannot import the NVML binding ({e}): `pip install nvidia-ml-py`; {SIMULATE_HINT}"
        ) from e
    if _initialized is not None and pynvml is _initialized:
        return pynvml
    with _init_lock:
        if pynvml is not _initialized:
            check_official(pynvml)
            call(pynvml, "nvmlInit")
            _initialized = pynvml
    return pynvml


def check_official(nvml: ModuleType) -> None:
    """Refuse the unofficial PyPI package `pynvml`, which shadows nvidia-ml-py's module of the same name.

    The official module defines `_nvmlGetFunctionPointer`; the unofficial one (pynvml < 12, a
    package `pynvml/`) re-exports its names with `import *`, which drops underscored ones.
    """
    if hasattr(nvml, "_nvmlGetFunctionPointer"):
        return
    where = getattr(nvml, "__file__", None) or "an unknown location"
    raise DeviceError(
        f"the importable `pynvml` ({where}) is the unofficial PyPI package `pynvml`, not NVIDIA's "
        "official binding; replace it: `pip uninstall pynvml && pip install nvidia-ml-py`"
    )


def call(nvml: ModuleType, name: str, *args: Any, where: str = "") -> Any:
    """Call `nvml.<name>(*args)`, turning any NVML error into a DeviceError a user can act on."""
    try:
        return getattr(nvml, name)(*args)
    except nvml.NVMLError as e:
        raise nvml_error(nvml, e, name, where) from e


def nvml_error(nvml: ModuleType, error: Exception, name: str, where: str = "") -> DeviceError:
    """The perseus exception for NVML `error` raised by call `name` on `where` (e.g. "GPU 0 (A100)")."""
    code = getattr(error, "value", None)
    on = f" on {where}" if where else ""
    detail = f"{name}{on} failed: {error} (NVML code {code})"
    if code == nvml.NVML_ERROR_NO_PERMISSION:
        return DevicePermissionError(f"{detail}. {PRIVILEGE_HINT}")
    if code == nvml.NVML_ERROR_NOT_SUPPORTED:
        return DeviceNotSupportedError(f"{where or 'this GPU'} does not support {name} (NVML: not supported)")
    if code == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return DeviceNotSupportedError(
            f"{detail}: the installed NVIDIA driver is too old for this call; upgrade the driver"
        )
    if code in (nvml.NVML_ERROR_DRIVER_NOT_LOADED, nvml.NVML_ERROR_LIBRARY_NOT_FOUND):
        return DeviceNotFoundError(f"no NVIDIA driver found ({name}: {error}); {SIMULATE_HINT}")
    if code == nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return DeviceNotFoundError(
            f"{detail}: the NVIDIA driver was updated but the old kernel module is still loaded; "
            "reboot (or reload the nvidia kernel modules)"
        )
    if code in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED):
        return DeviceError(f"{detail}: the GPU needs a reset or a reboot (see `nvidia-smi -q`, dmesg)")
    if code == nvml.NVML_ERROR_INVALID_ARGUMENT:
        return DeviceError(f"{detail}: NVML rejected the arguments (a value out of range?)")
    return DeviceError(detail)


def visible_nvml_indices(nvml: ModuleType, cuda_visible_devices: str | None) -> list[int]:
    """NVML indices of the GPUs CUDA would expose, in CUDA's order."""
    count = call(nvml, "nvmlDeviceGetCount")
    if cuda_visible_devices is None:
        return list(range(count))
    if not cuda_visible_devices.strip():
        raise DeviceNotFoundError(
            "CUDA_VISIBLE_DEVICES is set to an empty string, which hides every GPU: unset it "
            "(`unset CUDA_VISIBLE_DEVICES`) or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1"
        )
    uuids: list[str] | None = None
    chosen: list[int] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if entry.upper().startswith("MIG-"):
            raise DeviceNotSupportedError(
                f"CUDA_VISIBLE_DEVICES names the MIG instance {entry!r}: a MIG instance shares the "
                "SM clock, power limit and energy counter of its whole GPU, so Perseus can neither "
                "measure nor control it alone. Use whole GPUs (by index or GPU UUID, see "
                "`nvidia-smi -L`) or disable MIG (`sudo nvidia-smi -i N -mig 0`)"
            )
        if entry.isdigit():
            index = int(entry)
            if index >= count:
                raise ConfigError(
                    f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names GPU {index}, but NVML "
                    f"sees {count} GPU(s) (indices 0 to {count - 1})"
                )
        else:
            if uuids is None:
                uuids = [_uuid(nvml, i) for i in range(count)]
            index = _match_uuid(entry, uuids, cuda_visible_devices)
        if index in chosen:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} lists GPU {entry!r} twice")
        chosen.append(index)
    return chosen


def _uuid(nvml: ModuleType, index: int) -> str:
    handle = call(nvml, "nvmlDeviceGetHandleByIndex", index, where=f"NVML GPU {index}")
    return _text(call(nvml, "nvmlDeviceGetUUID", handle, where=f"NVML GPU {index}"))


def _match_uuid(entry: str, uuids: list[str], env: str) -> int:
    """CUDA's rule: a full UUID or a unique prefix of one; we also accept it without `GPU-`."""
    wanted = entry.lower().removeprefix("gpu-")
    if not wanted or not all(c in "0123456789abcdef-" for c in wanted):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={env!r}: {entry!r} is neither a GPU index nor a GPU UUID "
            "(like GPU-8932f937-d72c-4106-c12f-20bd9faed9f6; `nvidia-smi -L` lists them)"
        )
    matches = [i for i, u in enumerate(uuids) if u.lower().removeprefix("gpu-").startswith(wanted)]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(uuids) or "none"
    if not matches:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={env!r}: no GPU has a UUID starting {entry!r} (GPUs: {listed})")
    raise ConfigError(f"CUDA_VISIBLE_DEVICES={env!r}: {entry!r} matches {len(matches)} GPUs; give more of the UUID")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def process_is_privileged(euid: int | None = None, status_path: str = "/proc/self/status") -> bool:
    """Whether this process is root or holds CAP_SYS_ADMIN (what NVML's setters require)."""
    if (os.geteuid() if euid is None else euid) == 0:
        return True
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class NVMLGPU(GPU):
    """One NVIDIA GPU. `index` is its CUDA index in this process, `nvml_index` NVML's."""

    def __init__(self, index: int, nvml_index: int, nvml: ModuleType) -> None:
        self.index = index
        self.nvml_index = nvml_index
        self._nvml = nvml
        self._where = f"GPU {index}"
        self._handle = self._call_module("nvmlDeviceGetHandleByIndex", nvml_index)
        self._name = _text(self._call("nvmlDeviceGetName"))
        self._where = f"GPU {index} ({self._name})"
        self._uuid: str | None = None
        self._has_energy: bool | None = None
        self._frequencies: list[int] | None = None

    def _call_module(self, name: str, *args: Any) -> Any:
        return call(self._nvml, name, *args, where=self._where)

    def _call(self, name: str, *args: Any) -> Any:
        """A call on this GPU's handle; errors name the call and this GPU."""
        try:
            return getattr(self._nvml, name)(self._handle, *args)
        except self._nvml.NVMLError as e:
            raise nvml_error(self._nvml, e, name, self._where) from e

    # Reads
    def name(self) -> str:
        return self._name

    def uuid(self) -> str:
        if self._uuid is None:
            self._uuid = _text(self._call("nvmlDeviceGetUUID"))
        return self._uuid

    def architecture(self) -> int | None:
        """NVML's architecture code, or None where the driver cannot say."""
        try:
            return self._call("nvmlDeviceGetArchitecture")
        except DeviceNotSupportedError:
            return None

    def has_energy_counter(self) -> bool:
        """Volta and newer keep a total energy counter; older GPUs are measured by sampling power."""
        if self._has_energy is None:
            arch = self.architecture()
            if arch is not None and arch != self._nvml.NVML_DEVICE_ARCH_UNKNOWN:
                self._has_energy = arch >= self._nvml.NVML_DEVICE_ARCH_VOLTA
            else:
                try:
                    self._call("nvmlDeviceGetTotalEnergyConsumption")
                    self._has_energy = True
                except DeviceNotSupportedError:
                    self._has_energy = False
        return self._has_energy

    def energy_mj(self) -> float:
        if not self.has_energy_counter():
            raise DeviceNotSupportedError(
                f"{self._where} has no energy counter (older than Volta); measure it by sampling "
                "power (perseus.measurement.Monitor does this on its own)"
            )
        return float(self._call("nvmlDeviceGetTotalEnergyConsumption"))

    def power_mw(self) -> float:
        return float(self._call("nvmlDeviceGetPowerUsage"))

    def supported_frequencies(self) -> list[int]:
        """SM clocks supported at the highest memory clock, highest first (fixed per GPU: cached)."""
        if self._frequencies is None:
            memory = max(self._call("nvmlDeviceGetSupportedMemoryClocks"))
            graphics = self._call("nvmlDeviceGetSupportedGraphicsClocks", memory)
            self._frequencies = sorted({int(f) for f in graphics}, reverse=True)
            if not self._frequencies:
                raise DeviceNotSupportedError(f"{self._where} reports no supported SM clocks")
        return list(self._frequencies)

    def sm_clock(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._nvml.NVML_CLOCK_SM))

    def power_limit_mw(self) -> int:
        return int(self._call("nvmlDeviceGetPowerManagementLimit"))

    def power_limit_range_mw(self) -> tuple[int, int]:
        low, high = self._call("nvmlDeviceGetPowerManagementLimitConstraints")
        return int(low), int(high)

    def default_power_limit_mw(self) -> int:
        return int(self._call("nvmlDeviceGetPowerManagementDefaultLimit"))

    # Writes
    def lock_sm_clock(self, mhz: int) -> None:
        supported = self.supported_frequencies()
        if mhz not in supported:
            nearest = min(supported, key=lambda f: abs(f - mhz))
            raise ConfigError(
                f"{self._where} does not support an SM clock of {mhz} MHz (supported: "
                f"{supported[-1]} to {supported[0]} MHz; nearest is {nearest} MHz)"
            )
        self._call("nvmlDeviceSetGpuLockedClocks", mhz, mhz)

    def reset_sm_clock(self) -> None:
        self._call("nvmlDeviceResetGpuLockedClocks")

    def set_power_limit_mw(self, mw: int) -> None:
        self._call("nvmlDeviceSetPowerManagementLimit", self.check_power_limit_mw(mw))

    def reset_power_limit(self) -> None:
        self._call("nvmlDeviceSetPowerManagementLimit", self.default_power_limit_mw())

    def can_change_clocks(self) -> bool:
        """Root or CAP_SYS_ADMIN, on a GPU that supports locked clocks (Volta+). Changes nothing."""
        if not process_is_privileged():
            return False
        arch = self.architecture()
        if arch is None or arch == self._nvml.NVML_DEVICE_ARCH_UNKNOWN:
            return True
        return arch >= self._nvml.NVML_DEVICE_ARCH_VOLTA

    def synchronize(self) -> None:
        """Wait for this GPU's queued work (see torch_synchronize)."""
        torch_synchronize(self.index)

    def instruction_timer(self) -> InstructionTimer:
        """Timing events on torch's current stream once torch drives this GPU (see DeviceTimer)."""
        return DeviceTimer(self)
