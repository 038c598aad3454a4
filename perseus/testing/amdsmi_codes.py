"""The names the official `amdsmi` package (7.0) exports, for the fake in `perseus.testing.fake_amdsmi`.

Status codes carry amdsmi.h's values (as `amdsmi.amdsmi_wrapper` exports them); the enums and
exceptions are amdsmi's, and `raise_status(code)` raises the exception amdsmi raises for a status.
"""

from __future__ import annotations

from enum import IntEnum

# amdsmi_status_t (amdsmi.h), as amdsmi.amdsmi_wrapper exports them.
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_FAIL_LOAD_SYMBOL = 5
AMDSMI_STATUS_DRM_ERROR = 6
AMDSMI_STATUS_API_FAILED = 7
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INTERRUPT = 11
AMDSMI_STATUS_IO = 12
AMDSMI_STATUS_INPUT_OUT_OF_BOUNDS = 17
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
AMDSMI_STATUS_NO_DATA = 40
AMDSMI_STATUS_NO_DRV = 51
AMDSMI_STATUS_FILE_NOT_FOUND = 52
AMDSMI_STATUS_SETTING_UNAVAILABLE = 55
AMDSMI_STATUS_UNKNOWN_ERROR = 4294967295
STATUS = {name: value for name, value in globals().items() if name.startswith("AMDSMI_STATUS_")}
_TEXT = {code: name.removeprefix("AMDSMI_STATUS_") for name, code in STATUS.items()}


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_AMD_APUS = 3
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0  # an alias of SYS, as in amdsmi
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5
    VCLK0 = 6
    VCLK1 = 7
    DCLK0 = 8
    DCLK1 = 9


class AmdSmiDevPerfLevel(IntEnum):
    AUTO = 0
    LOW = 1
    HIGH = 2
    MANUAL = 3
    STABLE_STD = 4
    STABLE_PEAK = 5
    STABLE_MIN_MCLK = 6
    STABLE_MIN_SCLK = 7
    DETERMINISM = 8
    UNKNOWN = 256


class AmdSmiException(Exception):
    """Base of every amdsmi exception."""


class AmdSmiLibraryException(AmdSmiException):
    """A failed library call; `err_code` is its amdsmi_status_t."""

    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = f"AMDSMI_STATUS_{_TEXT.get(err_code, 'UNKNOWN_ERROR')}"

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_code(self) -> int:
        return self.err_code

    def get_error_info(self, detailed: bool = True) -> str:
        return self.err_info


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    """An argument of the wrong type (raised before the library is called)."""

    def __init__(self, received: object, expected: object, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.err_msg = msg or f"Invalid parameter:\nActual type: {type(received)}\nExpected type: {expected}"

    def __str__(self) -> str:
        return self.err_msg


def raise_status(code: int) -> None:
    """Raise the exception amdsmi raises for status `code`."""
    if code == AMDSMI_STATUS_RETRY:
        raise AmdSmiRetryException()
    if code == AMDSMI_STATUS_TIMEOUT:
        raise AmdSmiTimeoutException()
    raise AmdSmiLibraryException(code)
