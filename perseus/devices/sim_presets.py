"""The simulated GPU models `PERSEUS_GPU=sim:PRESET` names: clocks, power limits, power figures
and how they depart from an ideal GPU (perseus.devices.sim_realism).

Apart from the device (perseus.devices.sim) so that whatever needs a model's figures alone (the
work model in perseus.devices.sim_work, `perseus info`, the demo launcher, benchmarks) reads them
without making a GPU.

The power curve (see perseus.devices.sim_work.busy_power_w) is fitted to the measured GPT-3 175B
and Bloom 176B stage profiles on A100-SXM of the Perseus SOSP'24 artifact (../shared/data/
perseus-sosp24/stage_profiles, 855 to 1410 MHz): below the voltage knee (0.753 of the highest
clock, about 1060 MHz on an A100) the voltage is at its floor and dynamic power falls in
proportion to the clock; above it power rises as clock * clock ** 1.48. So a power cap lowers the
clock gradually down to the lowest clock (intensity-1 work on an A100 under a 150 W cap runs near
600 MHz, under 100 W near 270 MHz), where the old curve (a floor of 40% of TDP) dropped to the lowest clock
under any cap below 160 W.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from perseus.devices.sim_realism import NVIDIA_AVERAGED_POWER, NVIDIA_INSTANT_POWER, SimRealism
from perseus.exceptions import ConfigError

FREQUENCY_STEP_MHZ = 15

# Calibration: a least-squares fit to the measured A100-SXM profiles named in the module docstring
# (power relative to the highest clock's, rms error 0.021), which keeps 1080 MHz at 0.74x the
# energy of 1410 MHz (tests/devices/test_sim.py::test_calibration_against_measured_gpt3_profiles).
DEFAULT_GAMMA = 1.48  # exponent of the clock above the voltage knee
DEFAULT_KNEE = 0.753  # clock / highest clock below which the voltage stays at its floor
# P_floor / TDP: static power (memory, leakage) of a busy GPU. The profiles above 855 MHz barely
# constrain it (rms 0.021 to 0.022 for floors of 0.06 to 0.20); 0.15 (60 W on an A100) puts busy
# power at the lowest clock near 90 W. It can be below idle_w, the blocking power measured while a
# GPU spins waiting on a peer at its running clock.
FLOOR_FRACTION = 0.15
PEAK_FRACTION = 0.95  # intensity-1 work draws 0.95 x TDP at f_max: P_floor + P_dyn
# amdsmi's power and energy readings are not characterised like NVML's: the NVIDIA figures, full coverage.
AMD_REALISM = replace(NVIDIA_AVERAGED_POWER, power_coverage=1.0)


@dataclass(frozen=True)
class SimPreset:
    """One simulated GPU model. Power in W, frequency in MHz."""

    name: str
    product: str
    max_mhz: int
    min_mhz: int
    tdp_w: float  # default power limit
    min_power_limit_w: float
    max_power_limit_w: float
    idle_w: float  # power while idle or blocked on a peer
    gamma: float = DEFAULT_GAMMA
    clocks: tuple[int, ...] = ()  # supported SM clocks, highest first; empty: max_mhz down to min_mhz in 15 MHz
    knee: float = DEFAULT_KNEE
    realism: SimRealism = NVIDIA_AVERAGED_POWER  # what `sim_realism(preset, "realistic")` gives

    def __post_init__(self) -> None:
        c = self.clocks
        if c and (c[0] != self.max_mhz or c[-1] != self.min_mhz or any(a <= b for a, b in zip(c, c[1:]))):
            raise ConfigError(
                f"simulated GPU preset {self.name!r}: clocks must fall from max_mhz ({self.max_mhz}) "
                f"to min_mhz ({self.min_mhz}), highest first"
            )

    @property
    def floor_w(self) -> float:
        """Busy power at the lowest clocks, before dynamic power."""
        return FLOOR_FRACTION * self.tdp_w

    @property
    def dynamic_w(self) -> float:
        """Dynamic power of intensity-1 work at the highest clock."""
        return PEAK_FRACTION * self.tdp_w - self.floor_w

    @property
    def frequencies(self) -> tuple[int, ...]:
        """Supported SM clocks, highest first."""
        return self.clocks or tuple(range(self.max_mhz, self.min_mhz - 1, -FREQUENCY_STEP_MHZ))

    @property
    def step_mhz(self) -> int:
        """The step between supported clocks (the largest one, where they are uneven)."""
        f = self.frequencies
        return max((a - b for a, b in zip(f, f[1:])), default=0)


PRESETS: dict[str, SimPreset] = {
    p.name: p
    for p in (
        # Blocking power 83.64 W and 70.38 W: measured in the Perseus paper's artifact.
        # A100s (GA100) read power close to instantaneously; H100 and A40 average over 1 s. Yang et al.
        # measured the 25% sampling coverage on A100 and H100; the A40's is not reported: full.
        SimPreset(
            "a100-sxm", "NVIDIA A100-SXM4-40GB", 1410, 210, 400.0, 100.0, 400.0, 83.64, realism=NVIDIA_INSTANT_POWER
        ),
        SimPreset(
            "a100-pcie", "NVIDIA A100-PCIE-40GB", 1410, 210, 250.0, 150.0, 250.0, 55.0, realism=NVIDIA_INSTANT_POWER
        ),
        SimPreset("h100-sxm", "NVIDIA H100 80GB HBM3", 1980, 345, 700.0, 200.0, 700.0, 115.0),
        SimPreset(
            "a40",
            "NVIDIA A40",
            1740,
            210,
            300.0,
            100.0,
            300.0,
            70.38,
            realism=replace(NVIDIA_AVERAGED_POWER, power_coverage=1.0),
        ),
        # AMD Instinct. From AMD's public spec sheets: peak engine clock and board power (TBP), MI300X
        # 2100 MHz and 750 W; MI250X 1700 MHz and 500 W for the package (the air-cooled OAM; 560 W
        # liquid-cooled is not modelled), whose two GCDs appear as two GPUs: one GCD gets half, 250 W.
        # The clocks are the caps the amdsmi backend offers (perseus.devices.amd.clock_grid): 20 MHz
        # steps from the peak down to just above the 500 MHz floor of the GFX clock range, which is
        # amdgpu's and not on the spec sheets. Not published either, so estimates: the lowest power cap
        # (40% of TBP; a real GPU reports its own, amdsmi_get_power_cap_info) and idle power (about a
        # fifth of TBP, as the A100's measured 83.64 W is of 400 W); the power curve is the A100's.
        SimPreset(
            "mi300x",
            "AMD Instinct MI300X",
            2100,
            520,
            750.0,
            300.0,
            750.0,
            150.0,
            clocks=tuple(range(2100, 500, -20)),
            realism=AMD_REALISM,
        ),
        SimPreset(
            "mi250x",
            "AMD Instinct MI250X (GCD)",
            1700,
            520,
            250.0,
            100.0,
            250.0,
            50.0,
            clocks=tuple(range(1700, 500, -20)),
            realism=AMD_REALISM,
        ),
    )
}


def get_preset(name: str | SimPreset) -> SimPreset:
    if isinstance(name, SimPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown simulated GPU preset {name!r}; available: {', '.join(PRESETS)} (e.g. PERSEUS_GPU=sim:a100-sxm:4)"
        ) from None
