"""The simulated GPU models `PERSEUS_GPU=sim:PRESET` names: clocks, power limits and power figures.

Apart from the device (perseus.devices.sim) so that whatever needs a model's figures alone (the
work model in perseus.devices.sim_work, `perseus info`, the demo launcher, benchmarks) reads them
without making a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from perseus.exceptions import ConfigError

FREQUENCY_STEP_MHZ = 15

# Calibration (see tests/devices/test_sim.py::test_calibration_against_measured_gpt3_profiles).
DEFAULT_GAMMA = 4.5
FLOOR_FRACTION = 0.40  # P_floor / TDP
DYNAMIC_FRACTION = 0.55  # P_dyn / TDP: intensity-1 work draws 0.95 x TDP at f_max


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

    def __post_init__(self) -> None:
        c = self.clocks
        if c and (c[0] != self.max_mhz or c[-1] != self.min_mhz or any(a <= b for a, b in zip(c, c[1:]))):
            raise ConfigError(
                f"simulated GPU preset {self.name!r}: clocks must fall from max_mhz ({self.max_mhz}) "
                f"to min_mhz ({self.min_mhz}), highest first"
            )

    @property
    def floor_w(self) -> float:
        return FLOOR_FRACTION * self.tdp_w

    @property
    def dynamic_w(self) -> float:
        return DYNAMIC_FRACTION * self.tdp_w

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
        SimPreset("a100-sxm", "NVIDIA A100-SXM4-40GB", 1410, 210, 400.0, 100.0, 400.0, 83.64),
        SimPreset("a100-pcie", "NVIDIA A100-PCIE-40GB", 1410, 210, 250.0, 150.0, 250.0, 55.0),
        SimPreset("h100-sxm", "NVIDIA H100 80GB HBM3", 1980, 345, 700.0, 200.0, 700.0, 115.0),
        SimPreset("a40", "NVIDIA A40", 1740, 210, 300.0, 100.0, 300.0, 70.38),
        # AMD Instinct. From AMD's public spec sheets: peak engine clock and board power (TBP), MI300X
        # 2100 MHz and 750 W; MI250X 1700 MHz and 500 W for the package (the air-cooled OAM; 560 W
        # liquid-cooled is not modelled), whose two GCDs appear as two GPUs: one GCD gets half, 250 W.
        # The clocks are the caps the amdsmi backend offers (perseus.devices.amd.clock_grid): 20 MHz
        # steps from the peak down to just above the 500 MHz floor of the GFX clock range, which is
        # amdgpu's and not on the spec sheets. Not published either, so estimates: the lowest power cap
        # (40% of TBP; a real GPU reports its own, amdsmi_get_power_cap_info) and idle power (about a
        # fifth of TBP, as the A100's measured 83.64 W is of 400 W); the power curve is the A100's.
        SimPreset(
            "mi300x", "AMD Instinct MI300X", 2100, 520, 750.0, 300.0, 750.0, 150.0, clocks=tuple(range(2100, 500, -20))
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
