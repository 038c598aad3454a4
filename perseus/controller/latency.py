"""How long a clock change takes to come into force on a GPU.

A real GPU keeps running at its old clock for a while after a clock change call returns:
Velicka et al. (arXiv 2502.20075) measure a latency that varies across GPUs and depends mostly
on the target clock. The controller issues changes to a higher clock that much ahead of the
instruction needing them, the profiler waits changes out, and the service's plans hold no clock
for less time than that (perseus.planner.switches, from the latency a profile carries). Where
the figure comes from, first found first:

1. an explicit `override` (PerseusRank(switch_latency_s=...), ProfilingSettings);
2. what `perseus probe --allow-clock-changes` measured for this GPU model (perseus.probe's
   cache): the longest switch to each target clock, else the longest switch measured;
3. a simulated GPU's own model (`SimGPU.clock_switch_latency_s`, per target clock);
4. DEFAULT_SWITCH_LATENCY_S: conservative (too long only costs idle time while profiling and
   an earlier switch in a plan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError

logger = logging.getLogger(__name__)

#: Seconds from a clock change call until the new clock is in force, when nothing better is known.
DEFAULT_SWITCH_LATENCY_S = 0.05

#: The latency (s) of a change to a target clock (MHz; None: back to the default clock).
SwitchLatency = Callable[[int | None], float]


def early_lead_s(latency_s: float) -> float:
    """How long before an instruction the controller asks for its higher clock, for a change
    taking `latency_s`: the latency and a margin for a late worker thread (the planner models it)."""
    return 1.25 * latency_s + 0.001


def switch_latency(gpu: GPU, override: float | None = None) -> SwitchLatency:
    """The switch latency to assume for `gpu` (see the module docstring)."""
    if override is not None:
        if not 0 <= override <= 10:
            raise ConfigError(f"switch_latency_s must be seconds in [0, 10], got {override!r}")
        value = float(override)
        return lambda target: value
    probed = _probed(gpu)
    if probed is not None:
        return probed
    own = getattr(gpu, "clock_switch_latency_s", None)
    if callable(own):
        return own
    return lambda target: DEFAULT_SWITCH_LATENCY_S


def _probed(gpu: GPU) -> SwitchLatency | None:
    """The latencies `perseus probe` cached for this GPU model, if it timed any switch."""
    from perseus.probe import load  # the probe package pulls in its workloads: only when asked

    try:
        result = load(gpu)
    except ConfigError as e:
        logger.warning("%r: ignoring the probe's cached result (%s)", gpu, e)
        return None
    if result is None or result.max_clock_switch_latency_s is None:
        return None
    worst = result.max_clock_switch_latency_s
    return lambda target: (None if target is None else result.switch_latency_to_s(target)) or worst
