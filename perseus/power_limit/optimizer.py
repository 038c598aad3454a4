"""One power limit for every GPU of a data-parallel job, chosen while it trains.

    optimizer = GlobalPowerLimitOptimizer(Monitor(), MaxSlowdownConstraint(1.1))
    for epoch in range(epochs):
        optimizer.on_epoch_begin()
        for batch in loader:
            optimizer.on_step_begin()
            train_step(batch)
            optimizer.on_step_end()
        optimizer.on_epoch_end()
    optimizer.close()

The optimizer sweeps power limits from the highest down in `pl_step_w` steps. At each it lets
`warmup_steps` steps pass, then measures `profile_steps` steps (time and GPU energy); an epoch
that ends first discards that measurement and the limit is tried again next epoch. Then the
selector picks a limit, which stays (selectors that depend on the outside world, like
CarbonCost, pick again at every epoch). Under torch.distributed every rank measures its own
GPUs; energy is summed and time maxed over ranks, and rank 0's choice is applied everywhere.
The default power limit comes back on `close()`, at interpreter exit, on SIGTERM/SIGINT, and,
with `watchdog`, from a separate process if the trainer is SIGKILLed.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
from typing import Any

from perseus.atomic import write_json_atomic
from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, PerseusError, ProfileError
from perseus.measurement.monitor import Monitor
from perseus.power_limit import distributed
from perseus.power_limit.selectors import (
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitSelector,
    SelectionContext,
)
from perseus.safety import ResetGuard, Watchdog

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "perseus.power_limit_profile"
PROFILE_VERSION = 1


class Phase(str, enum.Enum):
    WARMUP = "warmup"  # at a sweep limit, letting warm-up steps pass
    MEASURE = "measure"  # at a sweep limit, measuring
    DONE = "done"  # the selected limit is applied
    CLOSED = "closed"  # defaults restored; hooks do nothing


def sweep_power_limits(low_mw: int, high_mw: int, step_w: float) -> list[int]:
    """Power limits from `high_mw` down in `step_w` steps, ending at `low_mw`."""
    step_mw = round(step_w * 1000)
    limits = list(range(high_mw, low_mw - 1, -step_mw))
    if limits[-1] != low_mw:
        limits.append(low_mw)
    return limits


class GlobalPowerLimitOptimizer:
    """Finds and applies one power limit for the GPUs of `monitor` (see the module docstring).

    selector: how to choose (default MaxSlowdownConstraint(1.1): least energy, at most 10%
    slower). profile_path: a JSON file; written atomically when profiling ends, and when it
    exists at start, profiling is skipped and its choice applied at once. watchdog: start a
    process that restores the default limits if this one is SIGKILLed (it costs one Python
    start-up, a fraction of a second).
    """

    def __init__(
        self,
        monitor: Monitor,
        selector: PowerLimitSelector | None = None,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step_w: float = 25,
        profile_path: str | os.PathLike[str] | None = None,
        watchdog: bool = True,
    ) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ConfigError(f"profile_steps must be an integer >= 1, got {profile_steps!r}")
        if isinstance(pl_step_w, bool) or not isinstance(pl_step_w, (int, float)) or not pl_step_w >= 1:
            raise ConfigError(f"pl_step_w must be at least 1 W, got {pl_step_w!r}")
        selector = MaxSlowdownConstraint(1.1) if selector is None else selector
        if not isinstance(selector, PowerLimitSelector):
            raise ConfigError(
                f"selector must be a PowerLimitSelector (Time(), Energy(), ZeusCost(eta), ...), got {selector!r}"
            )
        self.monitor = monitor
        self.selector = selector
        self.gpus: list[GPU] = list(monitor.gpus)
        if not self.gpus:
            raise ConfigError("GlobalPowerLimitOptimizer needs a Monitor with at least one GPU")
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.profile_path = os.fspath(profile_path) if profile_path is not None else None
        self.min_power_limit_mw = max(g.power_limit_range_mw()[0] for g in self.gpus)
        self.max_power_limit_mw = min(g.power_limit_range_mw()[1] for g in self.gpus)
        if self.min_power_limit_mw > self.max_power_limit_mw:
            raise ConfigError(f"the GPUs {self.gpus} have no power limit in common; give the Monitor one GPU model")
        self.power_limits_mw = sweep_power_limits(self.min_power_limit_mw, self.max_power_limit_mw, pl_step_w)

        self.phase = Phase.WARMUP
        self.measurements: list[PowerLimitMeasurement] = []  # over all ranks, once profiling ends
        self.local_measurements: list[PowerLimitMeasurement] = []  # this rank's GPUs
        self.selected_mw: int | None = None
        self.num_gpus = len(self.gpus)
        self._sweep_index = 0
        self._steps = 0  # in the current warm-up or measurement
        self._epoch_steps = 0
        self._last_epoch_steps: int | None = None
        self._warned_short_epoch = False
        self._window = f"perseus.power_limit.{id(self)}"
        self._guard = ResetGuard(self._reset_power_limits)
        self._watchdog = Watchdog.for_gpus(self.gpus, sm_clock=False) if watchdog else None

        try:
            if self._load_profile():
                self._select()
                self.phase = Phase.DONE
            else:
                self._apply(self.power_limits_mw[0])
        except BaseException:
            self.close()
            raise

    # Hooks
    def on_epoch_begin(self) -> None:
        self._epoch_steps = 0
        if self.phase is Phase.DONE and self.selector.reevaluate_each_epoch:
            self._select()

    def on_step_begin(self) -> None:
        if self.phase is Phase.WARMUP and self._steps >= self.warmup_steps:
            self.monitor.begin_window(self._window)
            self.phase = Phase.MEASURE
            self._steps = 0

    def on_step_end(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        self._epoch_steps += 1
        if self.phase is Phase.WARMUP:
            self._steps += 1
        elif self.phase is Phase.MEASURE:
            self._steps += 1
            if self._steps >= self.profile_steps:
                self._end_measurement()

    def on_epoch_end(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        self._last_epoch_steps = self._epoch_steps
        if self.phase in (Phase.WARMUP, Phase.MEASURE):
            if self.phase is Phase.MEASURE:
                self.monitor.end_window(self._window, cancel=True)
                logger.info(
                    "epoch ended while measuring %.0f W; it will be measured again",
                    self.power_limits_mw[self._sweep_index] / 1000,
                )
            if self._epoch_steps < self.warmup_steps + self.profile_steps and not self._warned_short_epoch:
                self._warned_short_epoch = True
                logger.warning(
                    "epochs have %d steps, fewer than warmup_steps + profile_steps = %d: profiling cannot "
                    "finish; lower warmup_steps or profile_steps",
                    self._epoch_steps,
                    self.warmup_steps + self.profile_steps,
                )
            self.phase = Phase.WARMUP
            self._steps = 0

    # Lifecycle
    def close(self) -> None:
        """Restore the default power limit and stop guarding. Idempotent."""
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.MEASURE:
            self.monitor.end_window(self._window, cancel=True)
        self.phase = Phase.CLOSED
        self._reset_power_limits()
        self._guard.close()
        if self._watchdog is not None:
            self._watchdog.stop()

    def __enter__(self) -> GlobalPowerLimitOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def power_limit_mw(self) -> int:
        """The limit this optimizer has set now."""
        return self.gpus[0].power_limit_mw()

    # Internals
    def _apply(self, limit_mw: int) -> None:
        for gpu in self.gpus:
            gpu.set_power_limit_mw(limit_mw)

    def _reset_power_limits(self) -> None:
        for gpu in self.gpus:
            gpu.reset_power_limit()

    def _end_measurement(self) -> None:
        m = self.monitor.end_window(self._window)
        energy_j = sum(m.gpu_energy_j[g.index] for g in self.gpus)
        limit = self.power_limits_mw[self._sweep_index]
        self.local_measurements.append(PowerLimitMeasurement(limit, m.time_s / self._steps, energy_j / self._steps))
        logger.debug("%.0f W: %.4f s, %.2f J per step", limit / 1000, m.time_s / self._steps, energy_j / self._steps)
        self._sweep_index += 1
        self._steps = 0
        if self._sweep_index < len(self.power_limits_mw):
            self._apply(self.power_limits_mw[self._sweep_index])
            self.phase = Phase.WARMUP
            return
        times = distributed.all_reduce([x.time_s for x in self.local_measurements], "max")
        energies = distributed.all_reduce([x.energy_j for x in self.local_measurements], "sum")
        self.num_gpus = int(distributed.all_reduce([float(len(self.gpus))], "sum")[0])
        self.measurements = [
            PowerLimitMeasurement(x.power_limit_mw, t, e) for x, t, e in zip(self.local_measurements, times, energies)
        ]
        if distributed.rank() == 0 and self.profile_path is not None:
            self._save_profile()
        self._select()
        self.phase = Phase.DONE
        logger.info(
            "power-limit sweep over %d GPUs:\n%s",
            self.num_gpus,
            "\n".join(
                f"  {x.power_limit_w:6.0f} W  {x.time_s:.4f} s  {x.energy_j:10.2f} J"
                + ("  <- selected" if x.power_limit_mw == self.selected_mw else "")
                for x in self.measurements
            ),
        )

    def _select(self) -> None:
        """Rank 0 selects; every rank applies rank 0's choice."""
        choice = -1.0
        error: Exception | None = None
        if distributed.rank() == 0:
            context = SelectionContext(self.max_power_limit_mw, self.num_gpus, self._last_epoch_steps)
            try:
                choice = float(self.selector.select(self.measurements, context))
            except Exception as e:  # tell the other ranks before raising, so none waits forever
                error = e
        choice = distributed.broadcast([choice])[0]
        if error is not None:
            raise error
        if choice < 0:
            raise PerseusError("rank 0 failed to select a power limit (see its log)")
        limit = int(choice)
        if not self.min_power_limit_mw <= limit <= self.max_power_limit_mw:
            raise ConfigError(
                f"{self.selector!r} chose {limit / 1000:g} W, outside these GPUs' range "
                f"{self.min_power_limit_mw / 1000:g}-{self.max_power_limit_mw / 1000:g} W"
            )
        if limit != self.selected_mw:
            logger.info("power limit %.0f W (%r)", limit / 1000, self.selector)
        self.selected_mw = limit
        self._apply(limit)

    # Profile file
    def _load_profile(self) -> bool:
        """Whether a profile was found (rank 0 reads it; every rank learns the answer)."""
        if self.profile_path is None:
            return False
        status, error = 0.0, None  # rank 0 tells: 1 found, 0 absent, -1 unreadable
        if distributed.rank() == 0 and os.path.exists(self.profile_path):
            try:
                self.measurements, self.num_gpus = read_profile(
                    self.profile_path, (self.min_power_limit_mw, self.max_power_limit_mw)
                )
                status = 1.0
                logger.info("power-limit profile %s found: skipping profiling", self.profile_path)
            except ProfileError as e:
                status, error = -1.0, e
        status = distributed.broadcast([status])[0]
        if error is not None:
            raise error
        if status < 0:
            raise ProfileError(f"rank 0 could not read the power-limit profile {self.profile_path} (see its log)")
        return status > 0

    def _save_profile(self) -> None:
        data = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "gpu_name": self.gpus[0].name(),
            "num_gpus": self.num_gpus,
            "warmup_steps": self.warmup_steps,
            "profile_steps": self.profile_steps,
            "measurements": [
                {"power_limit_mw": m.power_limit_mw, "time_s": m.time_s, "energy_j": m.energy_j}
                for m in self.measurements
            ],
        }
        assert self.profile_path is not None
        write_json_atomic(self.profile_path, data)


def read_profile(path: str, limit_range_mw: tuple[int, int] | None = None) -> tuple[list[PowerLimitMeasurement], int]:
    """(measurements, num_gpus) from a profile file written by the optimizer.

    Every field is checked; `limit_range_mw` also checks the limits fit the GPUs at hand.
    """
    fix = "delete it to profile again"
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except OSError as e:
        raise ProfileError(f"cannot read power-limit profile {path}: {e}") from e
    except ValueError as e:
        raise ProfileError(f"power-limit profile {path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f'{path} is not a Perseus power-limit profile (no "format": "{PROFILE_FORMAT}"); {fix}')
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path}: profile version {data.get('version')!r} is not {PROFILE_VERSION}; {fix}")
    num_gpus = data.get("num_gpus")
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ProfileError(f"{path}: num_gpus must be a positive integer, got {num_gpus!r}; {fix}")
    rows = data.get("measurements")
    if not isinstance(rows, list) or not rows:
        raise ProfileError(f"{path}: 'measurements' must be a non-empty list; {fix}")
    measurements = []
    for i, row in enumerate(rows):
        where = f"{path}: measurements[{i}]"
        if not isinstance(row, dict):
            raise ProfileError(f"{where} must be an object with power_limit_mw, time_s, energy_j; {fix}")
        limit = row.get("power_limit_mw")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise ProfileError(f"{where}.power_limit_mw must be a positive integer (mW), got {limit!r}; {fix}")
        time_s, energy_j = (_positive(row.get(name), f"{where}.{name}", fix) for name in ("time_s", "energy_j"))
        if limit_range_mw is not None and not limit_range_mw[0] <= limit <= limit_range_mw[1]:
            raise ProfileError(
                f"{where}: {limit / 1000:g} W is outside these GPUs' power-limit range "
                f"{limit_range_mw[0] / 1000:g}-{limit_range_mw[1] / 1000:g} W (recorded on other GPUs?); {fix}"
            )
        measurements.append(PowerLimitMeasurement(limit, time_s, energy_j))
    if len({m.power_limit_mw for m in measurements}) != len(measurements):
        raise ProfileError(f"{path}: a power limit appears twice in 'measurements'; {fix}")
    return measurements, num_gpus


def _positive(value: object, where: str, fix: str) -> float:
    """A profile's positive, finite number (a JSON int or float, not a bool) as a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{where} must be a positive number, got {value!r}; {fix}")
    return float(value)
