"""One power limit for all GPUs of a data-parallel job, chosen while it trains.

`GlobalPowerLimitOptimizer` sweeps power limits, measures time and energy per step at each,
and keeps the one a selector picks: `Time`, `Energy`, `ZeusCost(eta)`,
`MaxSlowdownConstraint(factor)`, `CarbonCost(eta, provider)`, or a `PowerLimitSelector` of
your own.
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
