"""GPU and CPU energy devices: NVML (NVIDIA), amdsmi (AMD), a simulated GPU, and RAPL.

Select GPUs with `get_gpus(spec)` or the `PERSEUS_GPU` environment variable: `auto` (default:
NVIDIA, else AMD), `nvml`, `amd` or `sim:PRESET[:COUNT]`, e.g. `sim:a100-sxm:4`. In one rank of a distributed
job, `local_gpu_indices` tells which of them are the rank's own. Make simulated GPUs do work
with `emulate(gpus, Work(seconds, alpha=...))` (real GPUs are skipped).
"""

from perseus.devices.gpu import GPU
from perseus.devices.local_rank import local_gpu_indices
from perseus.devices.select import get_gpus, parse_gpu_spec
from perseus.devices.sim import emulate
from perseus.devices.sim_work import Work

__all__ = ["GPU", "Work", "emulate", "get_gpus", "local_gpu_indices", "parse_gpu_spec"]
