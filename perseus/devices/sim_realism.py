"""How far a simulated GPU departs from an ideal one: its measurement and clock-change behaviour.

An ideal simulated GPU reads exact energy over any window, exact instantaneous power, and applies
a locked clock the instant the call returns. Real GPUs do none of this, and software that only
ever ran on ideal ones would not notice. `SimRealism` holds, as parameters, what a real GPU does
instead; each preset (perseus.devices.sim_presets) carries its realistic values, and `IDEAL`
turns every aspect off. Defaults and where they come from:

- Energy counter update period, 100 ms on every preset. NVML's total-energy counter advances in
  steps; Zeus (ml-energy/zeus) polls no slower than every 0.1 s because counters "can update as
  slow as 10 Hz". A read returns the energy integrated up to the last update instant, on a fixed
  grid of that period.
- Power reading: NVML documents `nvmlDeviceGetPowerUsage` as a one-second average on Ampere and
  newer parts except GA100 (the A100), whose reading is close to instantaneous; so H100 and A40
  average over 1 s, A100s over one 100 ms update. Yang et al. (SC'24, arXiv 2312.02741, "Part-time
  Power Measurements") found that on A100 and H100 the sensor samples only about 25% of the
  runtime: of each 100 ms update only the last 25 ms count (coverage 0.25). Other presets: full
  coverage (not measured; a parameter). The AMD presets' figures are not measured either.
- Measurement noise: each power reading carries seeded, deterministic Gaussian noise of 1%
  (a modelling choice, not a measured figure); the energy counter carries none.
- Clock switching latency: Velicka et al. (arXiv 2502.20075; the LATEST tool) measure a latency
  between asking for a clock and running at it that varies across GPUs and depends mostly on the
  target frequency. The model: 10 ms to reach the highest clock, growing linearly to 30 ms for the
  lowest (a modelling choice within what they report, not their figures). Work issued meanwhile
  runs at the old clock.
- Thermal drift: off by default; when set, busy power rises by up to `thermal_drift` (a fraction)
  as the GPU warms over `thermal_time_s` after it came into use (leakage grows with temperature).

Which behaviour a simulated GPU gets: `SimGPU(...)` made directly is ideal unless given a
`realism`; `sim_gpus`, `PERSEUS_GPU=sim:...`, the demo and the examples take `sim_realism(preset)`:
the mode in $PERSEUS_SIM_MODE (`ideal` or `realistic`), else DEFAULT_SIM_MODE, then the
overrides $PERSEUS_SIM_COUNTER_PERIOD_S and $PERSEUS_SIM_SWITCH_LATENCY_S (0: ideal for that aspect).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from perseus.exceptions import ConfigError

if TYPE_CHECKING:
    from perseus.devices.sim_presets import SimPreset

IDEAL_MODE = "ideal"
REALISTIC_MODE = "realistic"
MODES = (IDEAL_MODE, REALISTIC_MODE)
#: What `sim_gpus`, `PERSEUS_GPU=sim:...`, the demo and the examples simulate unless
#: $PERSEUS_SIM_MODE says otherwise. The one line to change to make realistic GPUs the default.
DEFAULT_SIM_MODE = REALISTIC_MODE

MODE_ENV = "PERSEUS_SIM_MODE"
COUNTER_PERIOD_ENV = "PERSEUS_SIM_COUNTER_PERIOD_S"
SWITCH_LATENCY_ENV = "PERSEUS_SIM_SWITCH_LATENCY_S"


@dataclass(frozen=True)
class SimRealism:
    """A simulated GPU's departures from ideal; every field's zero (or 1.0 coverage) is ideal.

    counter_period_s: the energy counter updates on a grid of this period; a read returns the
        energy at the last update instant.
    power_update_s: the power reading refreshes on a grid of this period.
    power_window_s: a power reading averages over this span before its update instant
        (0: the instantaneous power at the update instant).
    power_coverage: the fraction of each update period the sensor samples (its last part).
    power_noise: relative standard deviation of a power reading's Gaussian noise.
    switch_latency_s: time from a clock change call to the new clock in force, for the highest
        target clock.
    switch_latency_low_extra_s: extra latency for the lowest target clock (linear in between).
    thermal_drift: fraction by which busy power rises once the GPU is warm.
    thermal_time_s: time constant of that warming.
    seed: seeds the measurement noise (with the GPU's index), so runs repeat exactly.
    """

    counter_period_s: float = 0.0
    power_update_s: float = 0.0
    power_window_s: float = 0.0
    power_coverage: float = 1.0
    power_noise: float = 0.0
    switch_latency_s: float = 0.0
    switch_latency_low_extra_s: float = 0.0
    thermal_drift: float = 0.0
    thermal_time_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "seed":
                if not isinstance(value, int):
                    raise ConfigError(f"SimRealism.seed must be an integer, got {value!r}")
            elif not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"SimRealism.{field.name} must be a finite number >= 0, got {value!r}")
        if not 0.0 < self.power_coverage <= 1.0:
            raise ConfigError(f"SimRealism.power_coverage must be in (0, 1], got {self.power_coverage!r}")
        if self.power_coverage < 1.0 and self.power_update_s == 0:
            raise ConfigError(
                "SimRealism.power_coverage below 1 needs a power_update_s > 0 (coverage is a fraction of each update)"
            )
        if self.thermal_time_s == 0:
            raise ConfigError("SimRealism.thermal_time_s must be > 0 seconds")

    @property
    def ideal(self) -> bool:
        return self == replace(IDEAL, seed=self.seed, thermal_time_s=self.thermal_time_s)

    def switch_latency_for(self, preset: SimPreset, target_mhz: int) -> float:
        """Seconds from asking for clock `target_mhz` until it is in force."""
        if self.switch_latency_low_extra_s == 0 or preset.max_mhz == preset.min_mhz:
            return self.switch_latency_s
        low = (preset.max_mhz - target_mhz) / (preset.max_mhz - preset.min_mhz)
        return self.switch_latency_s + self.switch_latency_low_extra_s * min(1.0, max(0.0, low))

    def thermal_factor(self, warm_s: float) -> float:
        """Busy power multiplier after `warm_s` seconds of use."""
        if self.thermal_drift == 0:
            return 1.0
        return 1.0 + self.thermal_drift * (1.0 - math.exp(-max(0.0, warm_s) / self.thermal_time_s))

    def noise(self, index: int, instant: float) -> float:
        """The reading's noise factor at `instant` (deterministic in seed, GPU index and instant)."""
        if self.power_noise == 0:
            return 1.0
        key = hash((self.seed, index, round(instant * 1e6)))  # ints hash the same in every process
        return 1.0 + self.power_noise * random.Random(key).gauss(0.0, 1.0)


IDEAL = SimRealism()

#: Realistic behaviour of NVIDIA parts whose power reading is close to instantaneous (GA100).
NVIDIA_INSTANT_POWER = SimRealism(
    counter_period_s=0.1,
    power_update_s=0.1,
    power_window_s=0.1,
    power_coverage=0.25,
    power_noise=0.01,
    switch_latency_s=0.010,
    switch_latency_low_extra_s=0.020,
)
#: Realistic behaviour of parts whose power reading is a one-second average (Ampere+ but GA100).
NVIDIA_AVERAGED_POWER = replace(NVIDIA_INSTANT_POWER, power_window_s=1.0)


def sim_realism(preset: str | SimPreset, mode: str | None = None) -> SimRealism:
    """The behaviour simulated GPUs of `preset` get by default: `mode` (else $PERSEUS_SIM_MODE,
    else DEFAULT_SIM_MODE), then the environment's overrides."""
    from perseus.devices.sim_presets import get_preset

    p = get_preset(preset)
    mode = mode or os.environ.get(MODE_ENV) or DEFAULT_SIM_MODE
    if mode not in MODES:
        raise ConfigError(
            f"simulated GPU mode {mode!r} (from {MODE_ENV} or the caller) must be one of: {', '.join(MODES)}"
        )
    realism = p.realism if mode == REALISTIC_MODE else IDEAL
    period = _seconds_from_env(COUNTER_PERIOD_ENV)
    if period is not None:
        realism = replace(realism, counter_period_s=period)
    latency = _seconds_from_env(SWITCH_LATENCY_ENV)
    if latency is not None:  # one latency for every target: what the override names
        realism = replace(realism, switch_latency_s=latency, switch_latency_low_extra_s=0.0)
    return realism


def _seconds_from_env(name: str) -> float | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 60):
        raise ConfigError(f"{name}={text!r} must be seconds between 0 and 60 (0: ideal), e.g. {name}=0.1")
    return value
