"""GPU and CPU energy devices: NVML, a simulated GPU, and RAPL.

Select GPUs with `get_gpus(spec)` or the `PERSEUS_GPU` environment variable:
`nvml` (default) or `sim:PRESET[:COUNT]`, e.g. `sim:a100-sxm:4`. Make simulated GPUs do work
with `emulate(gpus, Work(seconds, alpha=...))` (real GPUs are skipped).
"""

from perseus.devices.gpu import GPU
from perseus.devices.select import get_gpus, parse_gpu_spec
from perseus.devices.sim import Work, emulate

__all__ = ["GPU", "Work", "emulate", "get_gpus", "parse_gpu_spec"]
