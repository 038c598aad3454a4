"""GPU and CPU energy devices: NVML, a simulated GPU, and RAPL.

Select GPUs with `get_gpus(spec)` or the `PERSEUS_GPU` environment variable:
`nvml` (default) or `sim:PRESET[:COUNT]`, e.g. `sim:a100-sxm:4`.
"""

from perseus.devices.gpu import GPU
from perseus.devices.select import get_gpus, parse_gpu_spec

__all__ = ["GPU", "get_gpus", "parse_gpu_spec"]
