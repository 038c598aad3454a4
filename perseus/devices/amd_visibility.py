"""Which AMD GPUs a process sees, in HIP's order, narrowed as ROCm narrows them.

First ROCR_VISIBLE_DEVICES among all GPUs, then HIP_VISIBLE_DEVICES among those (or, where that is
unset, CUDA_VISIBLE_DEVICES), each listing indices or UUIDs; `perseus.devices.amd.amd_gpus` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from perseus.devices.amd_smi import as_str, call
from perseus.exceptions import ConfigError, DeviceError, DeviceNotFoundError


def hip_order(amdsmi: ModuleType, handles: Sequence[Any]) -> list[int]:
    """Positions in `handles` in HIP's order (amdsmi's hip_id) where every GPU reports one, else as given."""
    hip_ids = []
    for handle in handles:
        try:
            hip_id = call(amdsmi, "amdsmi_get_gpu_enumeration_info", handle).get("hip_id")
        except DeviceError:
            hip_id = None
        if not isinstance(hip_id, int):
            return list(range(len(handles)))
        hip_ids.append(hip_id)
    return sorted(range(len(handles)), key=lambda i: hip_ids[i])


def visibility_variables(env: Mapping[str, str]) -> list[str]:
    """The variables that narrow the GPUs, in the order ROCm applies them."""
    names = []
    if "ROCR_VISIBLE_DEVICES" in env:
        names.append("ROCR_VISIBLE_DEVICES")
    if "HIP_VISIBLE_DEVICES" in env:
        names.append("HIP_VISIBLE_DEVICES")
    elif "CUDA_VISIBLE_DEVICES" in env:  # HIP reads it where HIP_VISIBLE_DEVICES is unset
        names.append("CUDA_VISIBLE_DEVICES")
    return names


def narrow(var: str, value: str, visible: list[int], identities: Any) -> list[int]:
    """The entries of `visible` (amdsmi positions) that `var`=`value` keeps, in its order.

    Indices count within `visible`; `identities(position)` gives a GPU's UUIDs for other entries.
    """
    if not value.strip():
        raise DeviceNotFoundError(
            f"{var} is set to an empty string, which hides every GPU: unset it (`unset {var}`) "
            f"or list the GPUs to use, e.g. {var}=0,1"
        )
    chosen: list[int] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit():
            index = int(entry)
            if index >= len(visible):
                raise ConfigError(
                    f"{var}={value!r} names GPU {index}, but {len(visible)} GPU(s) are visible to it "
                    f"(indices 0 to {len(visible) - 1}; `amd-smi list` lists them)"
                )
            position = visible[index]
        else:
            position = _match_uuid(var, value, entry, visible, identities)
        if position in chosen:
            raise ConfigError(f"{var}={value!r} lists GPU {entry!r} twice")
        chosen.append(position)
    return chosen


def _match_uuid(var: str, value: str, entry: str, visible: list[int], identities: Any) -> int:
    """A full UUID or a unique prefix of one, with or without `GPU-`."""
    wanted = entry.lower().removeprefix("gpu-")
    if not wanted or not all(c in "0123456789abcdef-" for c in wanted):
        raise ConfigError(
            f"{var}={value!r}: {entry!r} is neither a GPU index nor a GPU UUID "
            "(like GPU-4cc6d2e8d2a9b1f6; `rocminfo` and `amd-smi list` list them)"
        )
    matches = [p for p in visible if any(u.lower().removeprefix("gpu-").startswith(wanted) for u in identities(p))]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        listed = ", ".join(u for p in visible for u in identities(p)) or "none"
        raise ConfigError(f"{var}={value!r}: no GPU has a UUID starting {entry!r} (GPUs: {listed})")
    raise ConfigError(f"{var}={value!r}: {entry!r} matches {len(matches)} GPUs; give more of the UUID")


def gpu_uuids(amdsmi: ModuleType, handle: Any, position: int) -> list[str]:
    """The UUIDs a user may name GPU `handle` by: amdsmi's, and ROCm's GPU-<unique id> (rocminfo's)."""
    where = f"amdsmi GPU {position}"
    names = [as_str(call(amdsmi, "amdsmi_get_gpu_device_uuid", handle, where=where))]
    try:
        serial = call(amdsmi, "amdsmi_get_gpu_asic_info", handle, where=where).get("asic_serial")
        names.append(f"GPU-{int(serial, 16):016x}")
    except (DeviceError, TypeError, ValueError):
        pass  # no unique id (N/A): amdsmi's UUID only
    return names
