"""`perseus probe`: what this GPU's counters and clocks really do, measured, cached per GPU model.

`probe_gpu(gpu)` measures the energy counter's update period, the power reading's refresh and
averaging window, idle power and the supported clocks; with `allow_clock_changes=True`, the clock
switching latency for a sample of clock pairs. `save` keeps a result per GPU model; `load(gpu)`
returns it (or None): the runtime and planner read it to size energy windows and clock switches.
"""

from perseus.probe.cache import CACHE_ENV, UNMEASURED_KEEPS, cache_dir, energy_counter_period_s, load, model_key, save
from perseus.probe.result import ProbeResult
from perseus.probe.run import ProbeSettings, probe_gpu

__all__ = [
    "CACHE_ENV",
    "UNMEASURED_KEEPS",
    "ProbeResult",
    "ProbeSettings",
    "cache_dir",
    "energy_counter_period_s",
    "load",
    "model_key",
    "probe_gpu",
    "save",
]
