"""The cross-check of AMD energy counters against integrated power, before first use.

Some AMD GPUs' counters advance at the wrong rate or not at all (ROCm/amdsmi#38), and an MI250X's
second GCD reports neither power nor energy: a counter that fails the check is not used, and the
Monitor measures that GPU by sampling its power instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from perseus.exceptions import DeviceError, DeviceNotSupportedError

if TYPE_CHECKING:
    from perseus.devices.amd import AMDGPU

logger = logging.getLogger(__name__)

#: How long the energy counters are cross-checked against integrated power before first use.
ENERGY_CHECK_S = 0.5
ENERGY_CHECK_SAMPLES = 5
#: A counter within this factor of the integrated power is trusted (power reads are whole watts,
#: instantaneous, and a running job's power moves during the check).
COUNTER_TOLERANCE = 1.5
#: Below this average power (W) the check cannot judge the counter: the GPU reports no power.
MIN_CHECK_W = 1.0


class CounterCheck:
    """Cross-checks the energy counters of some GPUs against their integrated power, once, all together."""

    def __init__(self, gpus: Sequence[AMDGPU], duration_s: float = ENERGY_CHECK_S) -> None:
        self.gpus = list(gpus)
        self.duration_s = duration_s
        self._lock = threading.Lock()
        self._done = False

    def run(self) -> None:
        """Decide `has_energy_counter` for every GPU (waits `duration_s` once; later calls return at once)."""
        with self._lock:
            if self._done:
                return
            self._done = True
            gpus = []
            for gpu in self.gpus:
                try:
                    gpu.read_counter_mj()
                    gpus.append(gpu)
                except DeviceNotSupportedError as e:
                    logger.info("%r has no energy counter (%s); measuring it by sampling power", gpu, e)
                    gpu.set_counter_verdict(False)
            if not gpus:
                return
            clock = gpus[0].clock
            start = [gpu.read_counter_mj() for gpu in gpus]
            times = [clock.now()]
            powers = [[_power_or_none(gpu)] for gpu in gpus]
            for _ in range(ENERGY_CHECK_SAMPLES):
                clock.sleep(self.duration_s / ENERGY_CHECK_SAMPLES)
                times.append(clock.now())
                for gpu, samples in zip(gpus, powers):
                    samples.append(_power_or_none(gpu))
            end = [gpu.read_counter_mj() for gpu in gpus]
            for gpu, e0, e1, samples in zip(gpus, start, end, powers):
                gpu.set_counter_verdict(_judge(gpu, e1 - e0, times, samples))


def _power_or_none(gpu: AMDGPU) -> float | None:
    try:
        return gpu.power_mw()
    except DeviceError:
        return None


def _judge(gpu: AMDGPU, counted_mj: float, times: list[float], samples: list[float | None]) -> bool:
    """Whether `gpu`'s counter, which advanced `counted_mj` while its power read `samples`, is usable."""
    elapsed = times[-1] - times[0]
    if elapsed <= 0 or any(p is None for p in samples):
        return counted_mj > 0  # no power to check against: trust a counter that moves
    powers = [float(p) for p in samples if p is not None]
    integrated_mj = sum((powers[i] + powers[i + 1]) / 2 * (times[i + 1] - times[i]) for i in range(len(powers) - 1))
    average_w = integrated_mj / elapsed / 1000
    if average_w < MIN_CHECK_W:
        if counted_mj > 0:
            logger.warning(
                "%r reads 0 W, so Perseus cannot check its energy counter against its power; using the counter", gpu
            )
            return True
        pair = (
            f"; an MI250X reports both GCDs of a package on its first (even) GCD: measure GPU {gpu.index - 1}, "
            "whose figures include this one"
            if "MI250" in gpu.name() and gpu.amdsmi_index % 2 == 1
            else ""
        )
        logger.warning("%r reports neither power nor energy of its own: it measures as 0 J%s", gpu, pair)
        return False
    ratio = counted_mj / integrated_mj
    if 1 / COUNTER_TOLERANCE <= ratio <= COUNTER_TOLERANCE:
        return True
    logger.warning(
        "%r: its energy counter advanced %.0f mJ in %.2f s while its power averaged %.1f W (%.0f mJ): %.2fx. "
        "Some AMD GPUs' counters run at a wrong rate or stand still (ROCm/amdsmi#38; a reboot or a firmware "
        "update has fixed it); Perseus measures this GPU by sampling its power instead "
        "(compare `amd-smi metric --energy --power`)",
        gpu,
        counted_mj,
        elapsed,
        average_w,
        integrated_mj,
        ratio,
    )
    return False
