"""Choosing a GPU backend: an explicit spec, else PERSEUS_GPU, else NVML. Never a silent fallback."""

from __future__ import annotations

import os
from dataclasses import dataclass

from perseus.devices.gpu import GPU
from perseus.devices.nvml import nvml_gpus
from perseus.devices.sim import sim_gpus
from perseus.exceptions import ConfigError

ENV_VAR = "PERSEUS_GPU"


@dataclass(frozen=True)
class GPUSpec:
    backend: str  # "nvml" or "sim"
    preset: str | None = None  # simulated GPU preset, e.g. "a100-sxm"
    count: int = 1


def parse_gpu_spec(spec: str) -> GPUSpec:
    """Parse `nvml` or `sim:PRESET[:COUNT]`."""
    text = spec.strip()
    if text == "nvml":
        return GPUSpec("nvml")
    parts = text.split(":")
    if parts[0] == "sim" and len(parts) in (2, 3) and parts[1]:
        count = 1
        if len(parts) == 3:
            try:
                count = int(parts[2])
            except ValueError:
                count = 0
            if count < 1:
                raise ConfigError(
                    f"GPU spec {spec!r}: the count {parts[2]!r} must be a positive integer, e.g. sim:a100-sxm:4"
                )
        return GPUSpec("sim", parts[1], count)
    raise ConfigError(
        f"unknown GPU spec {spec!r}: use 'nvml' for real GPUs or 'sim:PRESET[:COUNT]' "
        "for simulated ones (e.g. sim:a100-sxm:4; `perseus info --presets` lists presets)"
    )


def get_gpus(spec: str | None = None) -> list[GPU]:
    """The GPUs to use: `spec`, else $PERSEUS_GPU, else NVML."""
    if spec is None:
        spec = os.environ.get(ENV_VAR) or "nvml"
    parsed = parse_gpu_spec(spec)
    # list() makes each a list[GPU] (list is invariant, so a list[NVMLGPU] is not one)
    if parsed.backend == "nvml":
        return list(nvml_gpus())
    assert parsed.preset is not None  # parse_gpu_spec gives every sim spec a preset
    return list(sim_gpus(parsed.preset, parsed.count))
