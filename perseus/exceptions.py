"""Exception hierarchy: every failure a user can act on is a PerseusError."""


class PerseusError(Exception):
    """Base class of every error Perseus raises on purpose."""


class ConfigError(PerseusError, ValueError):
    """Bad input from the user: a spec, a file, an argument. The message says how to fix it."""


class DeviceError(PerseusError):
    """A GPU or CPU energy interface failed."""


class DeviceNotFoundError(DeviceError):
    """No driver, no such device, or a counter that this machine cannot read."""


class DevicePermissionError(DeviceError):
    """The operation needs privileges (root or CAP_SYS_ADMIN)."""


class DeviceNotSupportedError(DeviceError):
    """The GPU does not support this call."""


class MeasurementError(PerseusError):
    """Misuse of the Monitor: unknown or duplicate window names, and the like."""


class ScheduleError(PerseusError):
    """A pipeline schedule is malformed or would deadlock."""


class ProfileError(PerseusError, ValueError):
    """A time-energy profile is malformed (the message names the row)."""


class PlanError(PerseusError):
    """The planner cannot produce a plan for the given input."""


class ProtocolError(PerseusError):
    """A malformed or refused message between a rank and the planner service."""


class CarbonIntensityError(PerseusError):
    """A carbon-intensity source failed: bad key, rate limit, timeout, or malformed data."""


class ServiceError(ProtocolError):
    """The planner service refused a request; `code` says why (bad_field, unknown_job, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
