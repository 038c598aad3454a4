"""Loading AMD SMI (the `amdsmi` package and its library) and turning its failures into perseus errors.

Everything the AMD backend asks amdsmi goes through `call`, so every amdsmi status surfaces as a
DeviceError (or subclass) that says what to do; `binding` imports and initialises amdsmi once per process.
"""

from __future__ import annotations

import contextlib
import io
import threading
from types import ModuleType
from typing import Any

from perseus.exceptions import (
    DeviceError,
    DeviceNotFoundError,
    DeviceNotSupportedError,
    DevicePermissionError,
)

SIMULATE_HINT = "to run without a GPU, simulate one: PERSEUS_GPU=sim:mi300x"
PRIVILEGE_HINT = (
    "amdgpu lets only root change clocks and power caps (amdsmi writes root's sysfs files "
    "power_dpm_force_performance_level, pp_od_clk_voltage and hwmon power1_cap): run as root (sudo), "
    "or have an administrator open those files to your group with a udev rule; in a container, /sys is "
    "read-only unless it runs --privileged"
)
INSTALL_HINT = (
    "install the amdsmi of your ROCm version (`pip install 'perseus-energy[amd]'` gets the newest; "
    "`pip install /opt/rocm/share/amd_smi` installs ROCm's own)"
)

# amdsmi_status_t values (amdsmi.h; the Python package has them in amdsmi.amdsmi_wrapper).
STATUS_INVAL = 1
STATUS_NOT_SUPPORTED = 2
STATUS_NOT_YET_IMPLEMENTED = 3
STATUS_FAIL_LOAD_MODULE = 4
STATUS_FAIL_LOAD_SYMBOL = 5
STATUS_TIMEOUT = 8
STATUS_RETRY = 9
STATUS_NO_PERM = 10
STATUS_INPUT_OUT_OF_BOUNDS = 17
STATUS_INIT_ERROR = 18
STATUS_BUSY = 30
STATUS_NOT_FOUND = 31
STATUS_DRIVER_NOT_LOADED = 34
STATUS_NO_DRV = 51
STATUS_SETTING_UNAVAILABLE = 55

_init_lock = threading.Lock()
_initialized: ModuleType | None = None  # the amdsmi module amdsmi_init succeeded on


def binding() -> ModuleType:
    """The `amdsmi` module, initialised (for AMD GPUs) once per process."""
    global _initialized
    try:
        # amdsmi prints to stdout when it cannot find libamd_smi.so; the error below says it better.
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi
    except ImportError as e:
        raise DeviceNotFoundError(f"cannot import amdsmi ({e}): {INSTALL_HINT}; {SIMULATE_HINT}") from e
    except Exception as e:  # OSError: no libamd_smi.so; AttributeError, KeyError: a package newer than the library
        raise DeviceNotFoundError(
            f"amdsmi cannot load AMD SMI's library ({type(e).__name__}: {e}): install ROCm, which provides "
            f"libamd_smi.so (set ROCM_PATH if it is not in /opt/rocm), and {INSTALL_HINT}; {SIMULATE_HINT}"
        ) from e
    if _initialized is not None and amdsmi is _initialized:
        return amdsmi
    with _init_lock:
        if amdsmi is not _initialized:
            call(amdsmi, "amdsmi_init", amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
            _initialized = amdsmi
    return amdsmi


def call(amdsmi: ModuleType, name: str, *args: Any, where: str = "") -> Any:
    """Call `amdsmi.<name>(*args)`, turning any amdsmi error into a DeviceError a user can act on."""
    try:
        function = getattr(amdsmi, name)
    except AttributeError:
        raise DeviceNotSupportedError(
            f"the installed amdsmi has no {name} (too old for it): {INSTALL_HINT}, or upgrade ROCm"
        ) from None
    try:
        return function(*args)
    except amdsmi.AmdSmiException as e:
        raise amdsmi_error(amdsmi, e, name, where) from e


def amdsmi_error(amdsmi: ModuleType, error: Exception, name: str, where: str = "") -> DeviceError:
    """The perseus exception for amdsmi `error` raised by call `name` on `where` (e.g. "GPU 0 (MI300X)")."""
    on = f" on {where}" if where else ""
    if not isinstance(error, amdsmi.AmdSmiLibraryException):  # a bad argument: a Perseus bug
        return DeviceError(f"{name}{on} refused its arguments: {error}")
    code = getattr(error, "err_code", None)
    detail = f"{name}{on} failed: {' '.join(str(error).split())} (amdsmi status {code})"
    if code == STATUS_NO_PERM:
        return DevicePermissionError(f"{detail}. {PRIVILEGE_HINT}")
    if code in (STATUS_NOT_SUPPORTED, STATUS_NOT_YET_IMPLEMENTED, STATUS_SETTING_UNAVAILABLE):
        guest = (
            "; amdsmi's setters do not work in a virtual machine guest (an SR-IOV virtual function)"
            if name.startswith("amdsmi_set_")
            else ""
        )
        return DeviceNotSupportedError(f"{where or 'this GPU'} does not support {name} (amdsmi: not supported){guest}")
    if code in (STATUS_DRIVER_NOT_LOADED, STATUS_NO_DRV, STATUS_FAIL_LOAD_MODULE, STATUS_INIT_ERROR):
        return DeviceNotFoundError(
            f"no AMD GPU driver found ({detail}): load amdgpu (`sudo modprobe amdgpu`; ROCm installs it) "
            f"and check `amd-smi list`; {SIMULATE_HINT}"
        )
    if code == STATUS_FAIL_LOAD_SYMBOL:
        return DeviceError(f"{detail}: the amdsmi package does not match the installed ROCm: {INSTALL_HINT}")
    if code == STATUS_NOT_FOUND:
        return DeviceNotFoundError(f"{detail}: the GPU is gone (reset or removed?); see dmesg and `amd-smi list`")
    if code in (STATUS_BUSY, STATUS_RETRY, STATUS_TIMEOUT):
        return DeviceError(f"{detail}: the GPU or its driver was busy; try again")
    if code in (STATUS_INVAL, STATUS_INPUT_OUT_OF_BOUNDS):
        return DeviceError(f"{detail}: amdsmi rejected the arguments (a value out of range?)")
    return DeviceError(detail)


def as_str(value: str | bytes) -> str:
    """A string amdsmi returned (some versions return bytes)."""
    return value.decode() if isinstance(value, bytes) else value
