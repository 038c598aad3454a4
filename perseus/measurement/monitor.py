"""Monitor: time and energy of named measurement windows over GPUs and CPUs.

    monitor = Monitor()                 # every visible GPU; in a torchrun rank, that rank's own
    monitor.begin_window("step")
    train_step()
    m = monitor.end_window("step")      # Measurement(time_s, gpu_energy_j={0: ...}, ...)

    with monitor.window("epoch") as w:  # w.measurement is set when the block exits
        ...

Windows nest and overlap freely; each is two counter snapshots, so an open window costs
nothing while it is open. GPUs with an energy counter are read directly; those without one
are sampled by a PowerMonitor and integrated.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

from perseus.clock import Clock
from perseus.devices.cpu import rapl_cpus
from perseus.devices.gpu import GPU
from perseus.devices.local_rank import local_gpu_indices
from perseus.devices.select import get_gpus
from perseus.exceptions import ConfigError, DeviceError, MeasurementError
from perseus.measurement.power import PowerMonitor

log = logging.getLogger(__name__)

# A window this many energy-counter steps long reads its energy to within a step at each end
# (10% over 20 steps); a shorter one is said once per Monitor, for windows a loop opens each step.
SHORT_WINDOW_STEPS = 20


class CPUEnergy(Protocol):
    """What the Monitor needs from one CPU package (e.g. a RAPL domain). Joules; None where the
    package has no such counter. Values only increase (the device handles wraparound)."""

    index: int

    def package_energy_j(self) -> float: ...

    def dram_energy_j(self) -> float | None: ...


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one window. Energies in J keyed by GPU/CPU index; CPU and DRAM are
    None where no counter is available."""

    time_s: float
    gpu_energy_j: dict[int, float]
    cpu_energy_j: dict[int, float] | None = None
    dram_energy_j: dict[int, float] | None = None

    @property
    def total_energy_j(self) -> float:
        total = sum(self.gpu_energy_j.values())
        if self.cpu_energy_j:
            total += sum(self.cpu_energy_j.values())
        if self.dram_energy_j:
            total += sum(self.dram_energy_j.values())
        return total

    @property
    def average_power_w(self) -> float:
        return self.total_energy_j / self.time_s if self.time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "time_s": self.time_s,
            "gpu_energy_j": dict(self.gpu_energy_j),
            "cpu_energy_j": None if self.cpu_energy_j is None else dict(self.cpu_energy_j),
            "dram_energy_j": None if self.dram_energy_j is None else dict(self.dram_energy_j),
            "total_energy_j": self.total_energy_j,
            "average_power_w": self.average_power_w,
        }


class Window:
    """What `Monitor.window()` yields: `measurement` is None until the block exits."""

    __slots__ = ("name", "measurement")

    def __init__(self, name: str) -> None:
        self.name = name
        self.measurement: Measurement | None = None


class Monitor:
    """Measures named windows on GPUs and CPU packages.

    gpus: the GPU objects to choose from (default `get_gpus()`: $PERSEUS_GPU, else the machine's).
    gpu_indices: the `GPU.index` values to measure. Default: all of `gpus`, except in one rank
    of a distributed job (torchrun, or any launcher that sets $LOCAL_RANK) when `gpus` is not
    given: then only this rank's own GPU(s) among `get_gpus()` (`perseus.devices.local_gpu_indices`;
    one GPU per rank: GPU $LOCAL_RANK), so that N ranks do not each count all N GPUs.
    cpu_indices: CPU packages to measure (default: all RAPL packages when RAPL is readable, else
    none); naming them when RAPL is unreadable is an error. cpus: CPU objects to use instead of
    RAPL (see `CPUEnergy`).
    sync: wait for each GPU (`GPU.synchronize`: CUDA through torch when it drives an NVML GPU; a
    device sync on simulated GPUs) before reading counters, so asynchronously issued work is
    counted; `begin_window` and `end_window` can override it.
    clock: the wall clock of windows (default: the first GPU's clock: the real clock for NVML
    GPUs and for the simulated ones `get_gpus()` gives; a virtual one only for SimGPUs made with
    `clock=VirtualClock()`, as tests and benchmarks do).
    power_interval_s: sampling interval for GPUs without an energy counter.
    """

    def __init__(
        self,
        gpu_indices: Sequence[int] | None = None,
        cpu_indices: Sequence[int] | None = None,
        sync: bool = True,
        gpus: Sequence[GPU] | None = None,
        clock: Clock | None = None,
        cpus: Sequence[CPUEnergy] | None = None,
        power_interval_s: float = 0.1,
    ) -> None:
        if gpus is None:
            gpus = get_gpus()
            if gpu_indices is None:
                gpu_indices = local_gpu_indices(len(gpus))
        self.gpus = _select(_gpu_list(gpus), gpu_indices, "GPU")
        self.cpus = _select(_default_cpus(cpu_indices) if cpus is None else list(cpus), cpu_indices, "CPU")
        self.sync = sync
        if clock is None:
            if not self.gpus:
                raise ConfigError(
                    "Monitor measures no GPU (gpu_indices selects none, or none is visible), so nothing times its "
                    "windows: select a GPU, or pass clock=REAL_CLOCK (from perseus.clock) to measure CPUs alone"
                )
            clock = self.gpus[0].clock
        self.clock = clock
        self._now = clock.now

        counted = [g for g in self.gpus if g.has_energy_counter()]
        sampled = [g for g in self.gpus if not g.has_energy_counter()]
        self._counter_indices = tuple(g.index for g in counted)
        self._counter_step_s = max((g.energy_counter_period_s() for g in counted), default=0.0)
        self._short_said = False
        self._counter_reads = tuple(g.energy_mj for g in counted)
        self._sampled_indices = tuple(g.index for g in sampled)
        self._syncs = tuple(g.synchronize for g in self.gpus)
        self._gpu_indices = tuple(g.index for g in self.gpus)
        self.power_monitor: PowerMonitor | None = None
        if sampled:
            self.power_monitor = PowerMonitor(sampled, interval_s=power_interval_s, clock=clock).start()

        self._cpu_indices = tuple(c.index for c in self.cpus)
        self._cpu_reads = tuple(c.package_energy_j for c in self.cpus)
        self._dram_reads = tuple(c.dram_energy_j for c in self.cpus)
        self._has_dram = any(c.dram_energy_j() is not None for c in self.cpus)

        # name -> (start time, GPU counters in mJ, CPU counters in J, DRAM counters in J)
        self._open: dict[str, tuple[float, list[float], list[float], list[float | None]]] = {}

    @property
    def open_windows(self) -> list[str]:
        return list(self._open)

    def close(self) -> None:
        """Stop background power sampling (only runs for GPUs without an energy counter)."""
        if self.power_monitor is not None:
            self.power_monitor.stop()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _synchronize(self) -> None:
        for sync in self._syncs:  # GPU.synchronize: on NVML GPUs, CUDA's through torch when it drives them
            sync()

    def _snapshot(self) -> tuple[float, list[float], list[float], list[float | None]]:
        if self.power_monitor is not None:
            self.power_monitor.sample()
        return (
            self._now(),
            [read() for read in self._counter_reads],
            [read() for read in self._cpu_reads],
            [read() for read in self._dram_reads] if self._has_dram else [],
        )

    def begin_window(self, name: str, sync: bool | None = None) -> None:
        """Start window `name`; `sync` (default: the Monitor's) waits for the GPUs first."""
        if not isinstance(name, str) or not name:
            raise MeasurementError(f"a measurement window's name must be a non-empty string, got {name!r}")
        if name in self._open:
            raise MeasurementError(f"measurement window {name!r} is already open; end it first or use another name")
        if self.sync if sync is None else sync:
            self._synchronize()
        self._open[name] = self._snapshot()

    @overload
    def end_window(
        self, name: str, cancel: Literal[False] = False, sync: bool | None = None, *, expect_short: bool = False
    ) -> Measurement: ...
    @overload
    def end_window(
        self, name: str, cancel: Literal[True], sync: bool | None = None, *, expect_short: bool = False
    ) -> None: ...
    @overload
    def end_window(
        self, name: str, cancel: bool, sync: bool | None = None, *, expect_short: bool = False
    ) -> Measurement | None: ...
    def end_window(
        self, name: str, cancel: bool = False, sync: bool | None = None, *, expect_short: bool = False
    ) -> Measurement | None:
        """End window `name` and return its Measurement.

        With `cancel`, discard the window (nothing is read or waited for) and return None. A
        window shorter than SHORT_WINDOW_STEPS energy-counter steps is said once per Monitor (a
        WARNING), unless `expect_short` (the caller sums such windows, or says so itself).
        """
        for flag, value in (("cancel", cancel), ("expect_short", expect_short), ("sync", sync)):
            if not isinstance(value, bool) and not (flag == "sync" and value is None):
                raise ConfigError(f"end_window: {flag} must be True or False, got {value!r}")
        try:
            begin = self._open.pop(name)
        except KeyError:
            raise MeasurementError(
                f"no open measurement window {name!r}; open windows: {list(self._open) or 'none'}"
            ) from None
        if cancel:
            return None
        if self.sync if sync is None else sync:
            self._synchronize()
        end = self._snapshot()
        t0, t1 = begin[0], end[0]
        gpu = {i: (e1 - e0) / 1000.0 for i, e0, e1 in zip(self._counter_indices, begin[1], end[1])}
        if self._sampled_indices:
            for i in self._sampled_indices:
                gpu[i] = self.power_monitor.energy_j(i, t0, t1)  # type: ignore[union-attr]
            gpu = {i: gpu[i] for i in self._gpu_indices}  # in the order of self.gpus
        cpu = dram = None
        if self._cpu_indices:
            cpu = {i: e1 - e0 for i, e0, e1 in zip(self._cpu_indices, begin[2], end[2])}
            if self._has_dram:
                dram = {
                    i: e1 - e0
                    for i, e0, e1 in zip(self._cpu_indices, begin[3], end[3])
                    if e0 is not None and e1 is not None
                }
        if not expect_short and self._counter_indices and t1 - t0 < SHORT_WINDOW_STEPS * self._counter_step_s:
            self._say_short(name, t1 - t0)
        return Measurement(t1 - t0, gpu, cpu, dram)

    def _say_short(self, name: str, seconds: float) -> None:
        if self._short_said:
            return
        self._short_said = True
        step = self._counter_step_s
        log.warning(
            "measurement window %r lasted %.3g s, but the GPU energy counter steps every %.0f ms: such a window reads "
            "whole counter steps (0 J, or a power above the GPU's maximum), off by up to a step at each end; measure "
            "windows of %.0f s or more (%d steps), or sum many short ones (said once per Monitor)",
            name,
            seconds,
            1000 * step,
            SHORT_WINDOW_STEPS * step,
            SHORT_WINDOW_STEPS,
        )

    @contextmanager
    def window(self, name: str, sync: bool | None = None) -> Iterator[Window]:
        """`with monitor.window(name) as w:` measures the block; `w.measurement` is set at exit,
        also when the block raises (the energy was spent all the same)."""
        handle = Window(name)
        self.begin_window(name, sync)
        try:
            yield handle
        finally:
            handle.measurement = self.end_window(name, sync=sync)


def _gpu_list(gpus: object) -> list[GPU]:
    """`gpus` as a list, or a ConfigError saying what it should be (an outsider passed [0])."""
    want = "GPU objects (perseus.devices.get_gpus()); to pick GPUs by index, pass gpu_indices"
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Iterable):
        raise ConfigError(f"gpus must be a list of {want}; got {gpus!r}")
    out = list(gpus)
    wrong = [g for g in out if not isinstance(g, GPU)]
    if wrong:
        raise ConfigError(f"gpus must be a list of {want}; {wrong[0]!r} is not one")
    return out


def _select(devices: list, indices: Iterable[int] | None, kind: str) -> list:
    if indices is None:
        return devices
    example = f"{kind.lower()}_indices must be a list of integers, e.g. [0, 1]"
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise ConfigError(f"{example}; got {indices!r}")
    indices = list(indices)
    wrong = [i for i in indices if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if wrong:
        raise ConfigError(f"{example}; {wrong[0]!r} in {indices!r} is not one")
    by_index = {d.index: d for d in devices}
    missing = [i for i in indices if i not in by_index]
    if missing:
        raise ConfigError(
            f"no {kind} with index {', '.join(map(str, missing))}; available: {sorted(by_index) or 'none'}"
        )
    if len(set(indices)) != len(indices):
        raise ConfigError(f"{kind} indices repeat: {list(indices)}")
    return [by_index[i] for i in indices]


def _default_cpus(cpu_indices: Sequence[int] | None) -> list[CPUEnergy]:
    """RAPL packages; none when RAPL is absent or unreadable, unless `cpu_indices` asked for some
    (then the device's error, which says how to fix it)."""

    try:
        return list(rapl_cpus())
    except DeviceError:
        if cpu_indices:
            raise
        return []
