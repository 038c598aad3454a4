"""Each selector picks what a hand-computed table says on a recorded sweep.

Sweep (per step, 4 GPUs, highest limit 400 W):

    limit   time   energy   Zeus(0.5)=0.5E+800T   Zeus(0.8)=0.8E+320T   E+800T (eta 0.5 at 2x ref)
    400 W   1.00   1400     1500                  1440                   2200
    350 W   1.02   1300     1466                  1366.4                 2116
    300 W   1.05   1150     1415  <-              1256                   1990
    250 W   1.12   1050     1421                  1198.4  <-             1946  <-
    200 W   1.30   1100     1590                  1296                   2140

Clean grid (100 g/kWh at eta 0.5, reference 400): 0.125E+800T -> 400 W: 975, 350 W: 978.5 -> 400 W.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from perseus.clock import VirtualClock
from perseus.exceptions import CarbonIntensityError, ConfigError, ProfileError
from perseus.measurement.carbon import CarbonIntensityProvider, IntensityPoint, IntensityTimeSeries, StaticIntensity
from perseus.power_limit import (
    CarbonCost,
    Energy,
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitSelector,
    SelectionContext,
    Time,
    ZeusCost,
)

SWEEP = [
    PowerLimitMeasurement(400_000, 1.00, 1400.0),
    PowerLimitMeasurement(350_000, 1.02, 1300.0),
    PowerLimitMeasurement(300_000, 1.05, 1150.0),
    PowerLimitMeasurement(250_000, 1.12, 1050.0),
    PowerLimitMeasurement(200_000, 1.30, 1100.0),
]
CONTEXT = SelectionContext(max_power_limit_mw=400_000, num_gpus=4)


@pytest.mark.parametrize(
    "selector, expected_w",
    [
        (Time(), 400),
        (Energy(), 250),
        (MaxSlowdownConstraint(1.0), 400),
        (MaxSlowdownConstraint(1.1), 300),
        (MaxSlowdownConstraint(1.2), 250),
        (ZeusCost(0.0), 400),
        (ZeusCost(0.5), 300),
        (ZeusCost(0.8), 250),
        (ZeusCost(1.0), 250),
        (CarbonCost(0.5, StaticIntensity(400)), 300),  # at the reference intensity: Zeus(0.5)
        (CarbonCost(0.5, StaticIntensity(800)), 250),  # dirty
        (CarbonCost(0.5, StaticIntensity(100)), 400),  # clean
    ],
)
def test_selector_matches_the_hand_computed_table(selector, expected_w):
    assert selector.select(SWEEP, CONTEXT) == expected_w * 1000


def test_order_of_measurements_does_not_matter():
    assert MaxSlowdownConstraint(1.1).select(list(reversed(SWEEP)), CONTEXT) == 300_000


def test_a_user_selector_overrides_cost():
    class Fastest300OrBelow(PowerLimitSelector):
        def cost(self, m, context):
            return m.time_s if m.power_limit_mw <= 300_000 else float("inf")

    assert Fastest300OrBelow().select(SWEEP, CONTEXT) == 300_000
    with pytest.raises(NotImplementedError, match="override cost"):
        PowerLimitSelector().select(SWEEP, CONTEXT)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ZeusCost(1.5),
        lambda: ZeusCost(-0.1),
        lambda: MaxSlowdownConstraint(0.9),
        lambda: CarbonCost(2, StaticIntensity(1)),
        lambda: CarbonCost(0.5, "DE"),
    ],
)
def test_bad_parameters_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()


def test_no_measurements_is_an_error():
    for selector in (Time(), MaxSlowdownConstraint(1.1), CarbonCost(0.5, StaticIntensity(1))):
        with pytest.raises(ProfileError):
            selector.select([], CONTEXT)


def test_carbon_cost_uses_the_forecast_over_the_next_epoch():
    """Clean (100) for the first hour, dirty (900) after. The next epoch (3600 steps of 1 s at
    400 W = 1 h) starting at 00:30 sees a mean of 500 g/kWh; starting at 00:00, 100."""
    clock = VirtualClock()
    t0 = datetime(2024, 5, 1, tzinfo=timezone.utc)
    series = IntensityTimeSeries([IntensityPoint(t0, 100), IntensityPoint(t0 + timedelta(hours=1), 900)], clock=clock)
    selector = CarbonCost(0.5, series)
    context = SelectionContext(400_000, 4, epoch_steps=3600)
    assert selector.select(SWEEP, context) == 400_000
    assert selector.last_intensity == pytest.approx(100)
    clock.advance(1800)
    # 0.5 * E * 500/400 + 800 T: 400 W 1675, 350 W 1628.5, 300 W 1558.75, 250 W 1552.25, 200 W 1727.5
    assert selector.select(SWEEP, context) == 250_000
    assert selector.last_intensity == pytest.approx(500)


def test_carbon_cost_reuses_the_last_intensity_when_the_provider_fails_later():
    class Flaky(CarbonIntensityProvider):
        supports_forecast = False

        def __init__(self):
            self.values = [800.0]

        def current(self):
            if not self.values:
                raise CarbonIntensityError("offline")
            return self.values.pop()

    selector = CarbonCost(0.5, Flaky())
    assert selector.select(SWEEP, CONTEXT) == 250_000
    assert selector.select(SWEEP, CONTEXT) == 250_000  # offline: 800 g/kWh again

    class Down(CarbonIntensityProvider):
        supports_forecast = False

        def current(self):
            raise CarbonIntensityError("offline")

    with pytest.raises(CarbonIntensityError, match="offline"):  # never known: no guessing
        CarbonCost(0.5, Down()).select(SWEEP, CONTEXT)
