"""Probing one GPU: watch its counters idle and under a load, and (only when allowed) time clock changes.

Read-only by default: the probe reads the energy counter, the power reading and the clocks, and
runs a load (perseus.probe.workload); it changes no setting. With clock changes allowed it locks SM
clocks for a sample of pairs and always puts the default clock back, on any exit, through
perseus.safety (a ResetGuard in this process, a Watchdog process should this one be killed).
Every duration is a parameter (ProbeSettings): on a real GPU a probe takes seconds.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone

from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, DeviceError, DevicePermissionError
from perseus.probe.analysis import averaging_window, change_times, counter_power_w, refresh_period
from perseus.probe.cache import model_key
from perseus.probe.result import ProbeResult
from perseus.probe.workload import Load, load_for
from perseus.safety import ResetGuard, Watchdog

logger = logging.getLogger(__name__)

Sample = tuple[float, float, float]  # time s, energy mJ, power mW


@dataclass(frozen=True)
class ProbeSettings:
    """How long the probe watches, and how often it polls (seconds).

    idle_s: watch the idle GPU (counter period, idle power, power refresh): many counter periods.
    load_s: watch under a load: longer than the power reading's averaging window, with a margin.
    switch_clocks_mhz: clocks whose every ordered pair is timed (empty: highest, middle, lowest).
    switch_settle_s: time at the first clock of a pair before switching to the second.
    switch_timeout_s: give up on a pair whose clock is not in force by then.
    """

    poll_s: float = 0.002
    idle_s: float = 3.0
    load_s: float = 4.0
    switch_clocks_mhz: tuple[int, ...] = ()
    switch_settle_s: float = 0.2
    switch_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.poll_s <= 0.1:
            raise ConfigError(f"probe poll interval must be in (0, 0.1] seconds, got {self.poll_s!r}")
        for name in ("idle_s", "load_s", "switch_settle_s", "switch_timeout_s"):
            value = getattr(self, name)
            if not value >= 10 * self.poll_s:
                raise ConfigError(f"probe {name} must be at least 10 polls ({10 * self.poll_s:g} s), got {value!r}")


def probe_gpu(gpu: GPU, settings: ProbeSettings | None = None, allow_clock_changes: bool = False) -> ProbeResult:
    """Measure `gpu`'s counters (and, with `allow_clock_changes`, its clock switching latency)."""
    settings = settings or ProbeSettings()
    clocks = tuple(gpu.supported_frequencies())
    pairs = _switch_pairs(gpu, clocks, settings) if allow_clock_changes else []
    gpu.synchronize()
    idle = _watch(gpu, settings.idle_s, settings.poll_s)
    counter = [(t, e) for t, e, _ in idle]
    idle_readings = [(t, p / 1000.0) for t, _, p in idle]
    load = load_for(gpu)
    refresh = refresh_period(idle_readings, settings.poll_s)
    window = None
    if load is not None:
        began = load.start(settings.load_s)
        try:
            busy = _watch(gpu, settings.load_s, settings.poll_s)
        finally:
            load.stop()
        busy_readings = [(t, p / 1000.0) for t, _, p in busy]
        refresh = refresh_period(idle_readings + busy_readings, settings.poll_s)
        idle_level = statistics.median(p for _, p in idle_readings)
        busy_level = statistics.median(p for _, p in busy_readings[-max(1, len(busy_readings) // 4) :])
        if refresh is None:  # a reading that only changed with the load: did it follow at once?
            first = next(iter(change_times(idle_readings[-1:] + busy_readings)), None)
            refresh = 0.0 if first is not None and first - began <= 2 * settings.poll_s else None
        window = averaging_window(busy_readings, began, idle_level, busy_level, refresh)
    holder = load if load is not None and load.holds_clocks else None
    latencies = _switch_latencies(gpu, pairs, settings, holder) if pairs else {}
    return ProbeResult(
        name=gpu.name(),
        key=model_key(gpu),
        energy_counter_update_s=refresh_period(counter, settings.poll_s),
        power_update_s=refresh,
        power_average_window_s=window,
        idle_power_w=counter_power_w(counter),
        supported_clocks_mhz=clocks,
        clock_switch_latency_s=latencies,
        probed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def _watch(gpu: GPU, seconds: float, poll_s: float) -> list[Sample]:
    clock = gpu.clock
    end = clock.now() + seconds
    samples = []
    while True:
        now = clock.now()
        samples.append((now, gpu.energy_mj(), gpu.power_mw()))
        if now >= end:
            return samples
        clock.sleep(poll_s)


def _switch_pairs(gpu: GPU, clocks: tuple[int, ...], settings: ProbeSettings) -> list[tuple[int, int]]:
    """The (from, to) pairs to time; checked before anything is measured or changed."""
    if not gpu.can_change_clocks():
        raise DevicePermissionError(
            f"{gpu!r}: this process may not lock SM clocks, so the probe cannot time clock switches; "
            "run it as root (or with CAP_SYS_ADMIN), or without --allow-clock-changes"
        )
    sample = settings.switch_clocks_mhz or tuple(dict.fromkeys((clocks[0], clocks[len(clocks) // 2], clocks[-1])))
    unknown = [f for f in sample if f not in clocks]
    if unknown:
        raise ConfigError(
            f"{gpu!r} does not support SM clock(s) {', '.join(map(str, unknown))} MHz to time switches between "
            f"(supported: {clocks[0]} down to {clocks[-1]} MHz; `perseus info` lists them)"
        )
    if len(sample) < 2:
        raise ConfigError("timing clock switches needs at least two different clocks")
    return [(a, b) for a in sample for b in sample if a != b]


def _switch_latencies(
    gpu: GPU, pairs: list[tuple[int, int]], settings: ProbeSettings, load: Load | None
) -> dict[str, float]:
    """Seconds from each lock call until the new clock is in force; the default clock restored after."""
    guard = ResetGuard(gpu.reset_sm_clock)
    watchdog = Watchdog.for_gpus([gpu], sm_clock=True, power_limit=False)
    latencies: dict[str, float] = {}
    try:
        if load is not None:  # a busy GPU runs at its locked clock; an idle one may park lower
            load.start((settings.switch_settle_s + 2 * settings.switch_timeout_s) * len(pairs))
        for a, b in pairs:
            try:
                gpu.lock_sm_clock(a)
                _until_in_force(gpu, a, b, settings)
                gpu.clock.sleep(settings.switch_settle_s)
                asked = gpu.clock.now()
                gpu.lock_sm_clock(b)
                latencies[f"{a}->{b}"] = _until_in_force(gpu, b, a, settings) - asked
            except TimeoutError as e:
                logger.warning("%r: %s; that pair is left out", gpu, e)
    finally:
        try:
            gpu.reset_sm_clock()
        finally:
            try:
                if load is not None:
                    load.stop()
            finally:
                guard.close()
                if watchdog is not None:
                    watchdog.stop()
    return latencies


def _until_in_force(gpu: GPU, target: int, previous: int, settings: ProbeSettings) -> float:
    """Poll until the SM clock is at `target` (within a tenth of the way from `previous`); when it was seen."""
    clock = gpu.clock
    deadline = clock.now() + settings.switch_timeout_s
    tolerance = abs(target - previous) / 10
    while True:
        now = clock.now()
        try:
            current = gpu.sm_clock()
        except DeviceError as e:
            raise TimeoutError(f"cannot read the SM clock ({e})") from e
        if abs(current - target) <= tolerance:
            return now
        if now >= deadline:
            raise TimeoutError(
                f"the SM clock reached {current} MHz, not {target}, within {settings.switch_timeout_s:g} s"
            )
        clock.sleep(settings.poll_s)
