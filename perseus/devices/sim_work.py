"""What work costs on a simulated GPU: its time and energy at a clock and power limit.

The model, apart from the device (perseus.devices.sim) so that planners, tests and benchmarks
can predict a cost without making a GPU. Work runs at the locked SM clock, slowed further when
its power would exceed the power limit. For work of nominal time t0 at f_max with
compute-bound fraction alpha, t(f) = t0 * (alpha * f_max / f + 1 - alpha) and busy power
P(f) = P_floor + intensity * P_dyn * r * max(knee, r) ** gamma with r = f / f_max: below the
voltage knee dynamic power falls in proportion to the clock, above it faster. Calibrated on the
measured GPT-3 175B and Bloom 176B stage profiles on A100-SXM (1080 MHz takes about 1.24x the time
and 0.74x the energy of 1410 MHz); P_floor, P_dyn, knee and gamma are the preset's
(perseus.devices.sim_presets). `predict` is the ground truth: what the work costs on a GPU held
at that clock, which a simulated GPU's counters integrate.
"""

from __future__ import annotations

from dataclasses import dataclass

from perseus.devices.sim_presets import SimPreset, get_preset
from perseus.exceptions import ConfigError

# Calibration (see tests/devices/test_sim.py::test_calibration_against_measured_gpt3_profiles).
DEFAULT_ALPHA = 0.78


@dataclass(frozen=True)
class Work:
    """A piece of GPU work for a simulated GPU (`SimGPU.execute`, `emulate`).

    time_s: seconds it takes at the highest SM clock with no power cap.
    alpha: the compute-bound fraction, whose time scales with 1/clock (the rest, e.g. memory
    traffic, does not): 0.78 is a GPT-3 stage on an A100; lower is more memory-bound, whose
    time barely moves as the power limit drops.
    intensity: scales dynamic power (1.0: a large matmul-heavy training step).
    What it costs at a given clock and power limit: `predict` or `SimGPU.predict`.
    """

    time_s: float
    alpha: float = DEFAULT_ALPHA
    intensity: float = 1.0

    def __post_init__(self) -> None:
        if not self.time_s >= 0:
            raise ConfigError(f"Work.time_s must be >= 0 seconds, got {self.time_s!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"Work.alpha (compute-bound fraction) must be in [0, 1], got {self.alpha!r}")
        if not self.intensity >= 0:
            raise ConfigError(f"Work.intensity must be >= 0, got {self.intensity!r}")


def dynamic_share(preset: SimPreset, frequency: float) -> float:
    """Dynamic power at `frequency` as a share of that at the highest clock (1.0 there)."""
    r = frequency / preset.max_mhz
    return r * max(preset.knee, r) ** preset.gamma


def busy_power_w(preset: SimPreset, work: Work, frequency: float) -> float:
    """Busy power at SM clock `frequency` (before any power capping)."""
    return preset.floor_w + work.intensity * preset.dynamic_w * dynamic_share(preset, frequency)


def effective_frequency(preset: SimPreset, work: Work, frequency: float, power_limit_w: float) -> float:
    """The clock the work really runs at: `frequency`, lowered until power fits the limit.

    Never below the minimum supported clock (there the GPU draws what it draws).
    """
    if busy_power_w(preset, work, frequency) <= power_limit_w:
        return frequency
    share = (power_limit_w - preset.floor_w) / (work.intensity * preset.dynamic_w)
    if share <= 0:
        return float(preset.min_mhz)
    knee_share = preset.knee ** (1.0 + preset.gamma)  # dynamic_share at the knee
    if share <= knee_share:
        r = share / preset.knee**preset.gamma  # below the knee: linear in the clock
    else:
        r = share ** (1.0 / (1.0 + preset.gamma))
    return max(float(preset.min_mhz), preset.max_mhz * r)


def predict(
    preset: str | SimPreset,
    work: Work,
    frequency: float,
    power_limit_w: float | None = None,
    slowdown: float = 1.0,
) -> tuple[float, float]:
    """(time_s, energy_j) of `work` with the SM clock at `frequency` and the given power limit.

    `power_limit_w` defaults to the preset's TDP; `slowdown` stretches time at the same power.
    """
    p = get_preset(preset)
    limit = p.tdp_w if power_limit_w is None else power_limit_w
    f = effective_frequency(p, work, frequency, limit)
    t = work.time_s * (work.alpha * p.max_mhz / f + 1.0 - work.alpha) * slowdown
    return t, busy_power_w(p, work, f) * t
