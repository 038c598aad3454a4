"""One power limit for all GPUs of a data-parallel job, chosen while it trains.

`GlobalPowerLimitOptimizer` sweeps power limits from the highest down, measures time and energy
per step at each, stops once no lower limit could be chosen, and keeps the one a selector picks:
`Time`, `Energy`, `ZeusCost(eta)`, `MaxSlowdownConstraint(factor)`, `CarbonCost(eta, provider)`,
or a `PowerLimitSelector` of your own. In a torchrun job each rank measures its own GPU(s) and
all apply rank 0's choice.
"""

from perseus.power_limit.optimizer import GlobalPowerLimitOptimizer, Phase, read_profile, sweep_power_limits
from perseus.power_limit.selectors import (
    CarbonCost,
    Energy,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitSelector,
    SelectionContext,
    Time,
    ZeusCost,
)

__all__ = [
    "CarbonCost",
    "Energy",
    "GlobalPowerLimitOptimizer",
    "MaxSlowdownConstraint",
    "Phase",
    "PowerLimitMeasurement",
    "PowerLimitSelector",
    "SelectionContext",
    "Time",
    "ZeusCost",
    "read_profile",
    "sweep_power_limits",
]
