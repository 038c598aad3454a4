"""Choosing a GPU backend: an explicit spec, else PERSEUS_GPU, else auto-detection.

Auto-detection (`auto`, the default) takes NVIDIA GPUs through NVML; only where NVML finds no
NVIDIA GPU (no driver, no binding, no GPU) does it ask amdsmi for AMD GPUs, and it logs which it
chose. An explicit `nvml` or `amd` never falls back to the other. Where a perseus agent serves the
node, the selected GPUs change clocks and power limits through it (perseus.agent.location says when).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from perseus.agent.location import agent_socket, note_direct_sim_gpus
from perseus.devices.amd import AMDGPU, amd_gpus
from perseus.devices.gpu import GPU
from perseus.devices.nvml import NVMLGPU, nvml_gpus
from perseus.devices.sim import SIM_DIR_ENV, SimGPU, sim_dir, sim_gpus
from perseus.exceptions import ConfigError, DeviceNotFoundError

logger = logging.getLogger(__name__)

ENV_VAR = "PERSEUS_GPU"


@dataclass(frozen=True)
class GPUSpec:
    backend: str  # "auto", "nvml", "amd" or "sim"
    preset: str | None = None  # simulated GPU preset, e.g. "a100-sxm"
    count: int = 1


def parse_gpu_spec(spec: str) -> GPUSpec:
    """Parse `auto`, `nvml`, `amd` or `sim:PRESET[:COUNT]`."""
    text = spec.strip()
    if text in ("auto", "nvml", "amd"):
        return GPUSpec(text)
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
        f"unknown GPU spec {spec!r}: use 'nvml' for NVIDIA GPUs, 'amd' for AMD GPUs, 'auto' for whichever "
        "this machine has, or 'sim:PRESET[:COUNT]' for simulated ones (e.g. sim:a100-sxm:4, sim:mi300x:4; "
        "`perseus info --presets` lists presets)"
    )


def get_gpus(spec: str | None = None, *, direct: bool = False) -> list[GPU]:
    """The GPUs to use: `spec`, else $PERSEUS_GPU, else auto-detected (NVML, else amdsmi).

    Their writes go through the node's perseus agent when one serves them ($PERSEUS_AGENT, or its
    socket at the default path for real GPUs; see perseus.agent.location), simulated ones then in
    the agent's folder unless $PERSEUS_SIM_DIR says otherwise; `direct` never does (the agent itself)."""
    if spec is None:
        spec = os.environ.get(ENV_VAR) or "auto"
    parsed = parse_gpu_spec(spec)
    simulated = parsed.backend == "sim"
    socket = None if direct else agent_socket(simulated=simulated)
    if socket is None:
        if simulated and not direct:
            note_direct_sim_gpus(sim_dir(), chosen=bool(os.environ.get(SIM_DIR_ENV)))
        return _backend_gpus(parsed)
    # Deliberately lazy: the agent's client (msgpack, the wire's checks) loads only where an agent serves.
    from perseus.devices.agent_gpu import sim_dir_through, through_agent

    return through_agent(_backend_gpus(parsed, sim_dir_through(socket) if simulated else None), socket)


def _backend_gpus(parsed: GPUSpec, state_dir: str | None = None) -> list[GPU]:
    # list() makes each a list[GPU] (list is invariant, so a list[NVMLGPU] is not one)
    if parsed.backend == "nvml":
        return list(nvml_gpus())
    if parsed.backend == "amd":
        return list(amd_gpus())
    if parsed.backend == "auto":
        return detect_gpus()
    assert parsed.preset is not None  # parse_gpu_spec gives every sim spec a preset
    return list(sim_gpus(parsed.preset, parsed.count, state_dir=state_dir))


def detect_gpus() -> list[GPU]:
    """NVIDIA GPUs through NVML; where NVML finds none, AMD GPUs through amdsmi. Logs the choice."""
    try:
        return list(nvml_gpus())
    except DeviceNotFoundError as nvidia:
        try:
            gpus = amd_gpus()
        except DeviceNotFoundError as amd:
            raise DeviceNotFoundError(f"found no GPU. NVIDIA: {nvidia}. AMD: {amd}") from nvidia
        logger.info("no NVIDIA GPU (%s); using the %d AMD GPU(s) amdsmi found", nvidia, len(gpus))
        return list(gpus)


def gpu_backend(gpus: list[GPU]) -> str:
    """The backend `gpus` came from: "nvml", "amd" or "sim" ("mixed" if they differ, "none" if empty)."""
    kinds = {name for g in gpus for cls, name in _BACKENDS if isinstance(g, cls)}
    if not kinds:
        return "none"
    return kinds.pop() if len(kinds) == 1 else "mixed"


_BACKENDS: tuple[tuple[type[GPU], str], ...] = ((NVMLGPU, "nvml"), (AMDGPU, "amd"), (SimGPU, "sim"))
