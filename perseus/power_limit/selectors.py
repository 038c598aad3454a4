"""Which power limit to keep, given the time and energy per step measured at each one.

A selector is a strategy object: subclass `PowerLimitSelector` and override `cost` (the
limit with the least cost wins) or `select` (anything else, e.g. a constraint). It also says,
through `stop_sweep`, when the sweep (highest limit first) may stop because no lower limit
could be chosen: the optimizer then skips the rest.

Early stopping rests on what lowering a power limit does: a step never gets faster, and its
energy falls, bottoms out, then rises (the step slows more than power drops). So limits
below one that was too slow for `MaxSlowdownConstraint` are too slow as well, and once energy
(or a cost mixing energy and time) has risen at several limits in a row, every lower limit
costs more than one already measured. Both rules wait for more than one reading, against
measurement noise: two slow limits in a row (`slow_limits_to_stop`), a rise kept over three
(`stop_patience`; one stray reading is followed by a fall, which breaks the run).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from perseus.exceptions import CarbonIntensityError, ConfigError, ProfileError
from perseus.measurement.carbon import JOULES_PER_KWH, CarbonIntensityProvider

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PowerLimitMeasurement:
    """Time and energy of one training step at one power limit (energy summed over all GPUs,
    time the slowest rank's)."""

    power_limit_mw: int
    time_s: float
    energy_j: float

    @property
    def power_limit_w(self) -> float:
        return self.power_limit_mw / 1000.0


@dataclass(frozen=True)
class SelectionContext:
    """What a selector may need besides the sweep."""

    max_power_limit_mw: int  # the GPUs' highest power limit
    num_gpus: int  # over all ranks
    epoch_steps: int | None = None  # steps in the last full epoch, if one has ended

    def epoch_hours(self, measurement: PowerLimitMeasurement) -> float:
        """Expected length of the next epoch at `measurement`'s limit (one step if unknown)."""
        return measurement.time_s * (self.epoch_steps or 1) / 3600.0


def rising(values: Sequence[float], times: int | None) -> bool:
    """Whether the values rose at the first of the last `times` steps and fell at none of them
    (False for None). A level stretch after a rise counts (a GPU at its lowest clock, whatever
    the limit); one before it does not (limits above what the work draws, all alike)."""
    if times is None or times < 1 or len(values) <= times:
        return False
    tail = values[-times - 1 :]
    level = 1e-9  # relative: rounding in sums of the same figures is not a change
    return tail[1] > tail[0] + level * abs(tail[0]) and all(
        later >= earlier - level * abs(earlier) for earlier, later in zip(tail, tail[1:])
    )


class PowerLimitSelector:
    """Picks the power limit (mW) with the least `cost`; ties go to the higher limit."""

    #: Re-select at every epoch (the cost depends on something outside the sweep).
    reevaluate_each_epoch: bool = False
    #: Limits in a row at which the cost (or energy) must rise before `stop_sweep` says stop;
    #: None: never stop early.
    stop_patience: int | None = 3

    def cost(self, measurement: PowerLimitMeasurement, context: SelectionContext) -> float:
        raise NotImplementedError(f"{type(self).__name__} must override cost() or select()")

    def stop_sweep(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> bool:
        """Whether no limit below the last one measured could be chosen, so the sweep can stop.

        `measurements`: the sweep so far, highest limit first, combined over all ranks. The
        default, for a selector that defines `cost`: the cost rose at each of the last
        `stop_patience` limits. A selector that overrides only `select` gets the whole sweep
        (False) unless it overrides this too.
        """
        if type(self).cost is PowerLimitSelector.cost:
            return False
        return rising([self.cost(m, context) for m in measurements], self.stop_patience)

    def select(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> int:
        if not measurements:
            raise ProfileError("no power-limit measurements to select from")
        best = min(measurements, key=lambda m: (self.cost(m, context), -m.power_limit_mw))
        return best.power_limit_mw

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Time(PowerLimitSelector):
    """The fastest limit."""

    def cost(self, measurement: PowerLimitMeasurement, context: SelectionContext) -> float:
        return measurement.time_s


class Energy(PowerLimitSelector):
    """The limit with the least energy per step."""

    def cost(self, measurement: PowerLimitMeasurement, context: SelectionContext) -> float:
        return measurement.energy_j


def _check_eta(eta_knob: float, who: str) -> float:
    if isinstance(eta_knob, bool) or not isinstance(eta_knob, (int, float)) or not 0.0 <= eta_knob <= 1.0:
        raise ConfigError(f"{who}: eta_knob must be in [0, 1] (1: energy only, 0: time only), got {eta_knob!r}")
    return float(eta_knob)


def _eta(eta_knob: float | None, eta: float | None, who: str) -> float:
    """`eta_knob`, also accepted as `eta=`."""
    if eta_knob is not None and eta is not None:
        raise ConfigError(f"{who}: eta_knob= and eta= name the same knob: pass one")
    value = eta_knob if eta_knob is not None else eta
    if value is None:
        raise ConfigError(f"{who} needs eta_knob (1: energy only, 0: time only), e.g. {who}(0.5)")
    return _check_eta(value, who)


class ZeusCost(PowerLimitSelector):
    """Zeus' cost: eta * energy + (1 - eta) * max_power * num_gpus * time (both in joules).

    `eta=` is accepted for `eta_knob`. num_gpus is counted over all ranks; `world_size` (Zeus'
    name for the job's GPU count) sets it instead.
    """

    def __init__(self, eta_knob: float | None = None, world_size: int | None = None, *, eta: float | None = None):
        self.eta_knob = _eta(eta_knob, eta, "ZeusCost")
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise ConfigError(f"ZeusCost: world_size must be a positive number of GPUs, got {world_size!r}")
        self._world_size = world_size  # None: counted over the ranks

    def __repr__(self) -> str:
        size = "" if self._world_size is None else f", world_size={self._world_size}"
        return f"ZeusCost(eta_knob={self.eta_knob!r}{size})"

    def cost(self, measurement: PowerLimitMeasurement, context: SelectionContext) -> float:
        max_power_w = context.max_power_limit_mw / 1000.0
        num_gpus = context.num_gpus if self._world_size is None else self._world_size
        return self.eta_knob * measurement.energy_j + (1 - self.eta_knob) * max_power_w * num_gpus * measurement.time_s


class MaxSlowdownConstraint(PowerLimitSelector):
    """The least energy among limits whose step time is at most `factor` x the time at the
    highest limit measured."""

    def __init__(self, factor: float) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1.0:
            raise ConfigError(
                f"MaxSlowdownConstraint: factor must be a number >= 1.0 (1.1 = at most 10% slower), got {factor!r}"
            )
        self.factor = float(factor)

    def select(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> int:
        if not measurements:
            raise ProfileError("no power-limit measurements to select from")
        baseline = max(measurements, key=lambda m: m.power_limit_mw).time_s
        allowed = [m for m in measurements if m.time_s <= self.factor * baseline]
        best = min(allowed, key=lambda m: (m.energy_j, -m.power_limit_mw))
        return best.power_limit_mw

    #: Limits in a row slower than `factor` allows before the sweep stops: one slow reading can
    #: be a hiccup (a data-loader stall, a busy CPU) at a limit that is fast enough.
    slow_limits_to_stop: int = 2

    def stop_sweep(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> bool:
        """Stop once `slow_limits_to_stop` limits in a row were slower than `factor` x the highest
        limit's time (lower ones are slower still), or energy rose at `stop_patience` limits in a row."""
        if not measurements:
            return False
        baseline = max(measurements, key=lambda m: m.power_limit_mw).time_s
        last = measurements[-self.slow_limits_to_stop :]
        if len(last) == self.slow_limits_to_stop and all(m.time_s > self.factor * baseline for m in last):
            return True
        return rising([m.energy_j for m in measurements], self.stop_patience)


class CarbonCost(PowerLimitSelector):
    """Zeus' cost with energy replaced by carbon, re-evaluated at every epoch.

    cost = eta * carbon + (1 - eta) * max_power * num_gpus * time * reference intensity,
    where carbon is the step's energy times the intensity forecast over the next epoch. Time
    is priced in grams at `reference_g_per_kwh`, so at that intensity this is exactly
    ZeusCost(eta); a dirtier grid weighs energy more (a lower limit), a cleaner one less.
    If the provider fails after a first success, the last intensity is reused (with a warning)
    so a network hiccup does not stop training.
    """

    reevaluate_each_epoch = True

    def __init__(
        self,
        eta_knob: float | None = None,
        provider: CarbonIntensityProvider | None = None,
        reference_g_per_kwh: float = 400.0,
        *,
        eta: float | None = None,
    ) -> None:
        self.eta_knob = _eta(eta_knob, eta, "CarbonCost")
        if not isinstance(provider, CarbonIntensityProvider):
            raise ConfigError(f"CarbonCost needs a CarbonIntensityProvider, got {type(provider).__name__}")
        if not (
            isinstance(reference_g_per_kwh, (int, float))
            and math.isfinite(reference_g_per_kwh)
            and reference_g_per_kwh > 0
        ):
            raise ConfigError(f"CarbonCost: reference_g_per_kwh must be > 0, got {reference_g_per_kwh!r}")
        self.provider = provider
        self.reference_g_per_kwh = float(reference_g_per_kwh)
        self.last_intensity: float | None = None
        self._g_per_kwh: float | None = None

    def intensity(self, hours: float) -> float:
        """The forecast intensity (g/kWh) over the next `hours`."""
        try:
            self.last_intensity = self.provider.expected_intensity(hours)
        except CarbonIntensityError as e:
            if self.last_intensity is None:
                raise
            logger.warning("carbon intensity unavailable (%s); reusing %.0f g/kWh", e, self.last_intensity)
        return self.last_intensity

    def select(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> int:
        if not measurements:
            raise ProfileError("no power-limit measurements to select from")
        top = max(measurements, key=lambda m: m.power_limit_mw)
        self._g_per_kwh = self.intensity(context.epoch_hours(top))
        return super().select(measurements, context)

    def stop_sweep(self, measurements: Sequence[PowerLimitMeasurement], context: SelectionContext) -> bool:
        """Once energy rose at `stop_patience` limits in a row: every lower limit then takes more
        time and more energy than the last one measured, so it costs more at any intensity (the
        choice is made again each epoch, so the cost of today's grid cannot decide)."""
        return rising([m.energy_j for m in measurements], self.stop_patience)

    def cost(self, measurement: PowerLimitMeasurement, context: SelectionContext) -> float:
        if self._g_per_kwh is None:
            self._g_per_kwh = self.intensity(context.epoch_hours(measurement))
        max_power_w = context.max_power_limit_mw / 1000.0
        carbon_g = measurement.energy_j / JOULES_PER_KWH * self._g_per_kwh
        time_g = max_power_w * context.num_gpus * measurement.time_s / JOULES_PER_KWH * self.reference_g_per_kwh
        return self.eta_knob * carbon_g + (1 - self.eta_knob) * time_g
