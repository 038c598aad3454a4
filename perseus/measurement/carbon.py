"""Carbon intensity of the grid, and the emissions of measured energy.

Emissions are energy times the grid's carbon intensity: grams CO2e = J / 3.6e6 * g/kWh.
Intensity comes from a `CarbonIntensityProvider`:
- `ElectricityMaps`: the Electricity Maps v3 API (latest, 24 h history, forecast), cached;
- `CarbonAwareSDK`: the Green Software Foundation's Carbon Aware SDK WebApi (observed, forecast);
- `StaticIntensity`: one fixed value (a region's yearly average, or a what-if);
- `IntensityTimeSeries`: a recorded series replayed on a clock (tests, benchmarks, what-ifs).
`CarbonReporter` turns Monitor windows into a per-epoch energy/carbon/time report.
"""

from __future__ import annotations

import abc
import bisect
import csv
import json
import logging
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from perseus.clock import REAL_CLOCK, Clock
from perseus.exceptions import CarbonIntensityError, ConfigError
from perseus.measurement import codecarbon_csv
from perseus.measurement.codecarbon_csv import RunEnergy, RunInfo
from perseus.measurement.http_json import CachedJSON
from perseus.measurement.monitor import Measurement, Monitor
from perseus.notice import logs_info, notice, world_size

logger = logging.getLogger(__name__)

JOULES_PER_KWH = 3.6e6
API_KEY_ENV = "PERSEUS_ELECTRICITYMAPS_KEY"
CARBON_AWARE_URL_ENV = "PERSEUS_CARBON_AWARE_URL"
ELECTRICITYMAPS_URL = "https://api.electricitymaps.com/v3"
FORECAST_HORIZONS_H = (6, 24, 48, 72)  # what the forecast endpoint's horizonHours accepts


def emissions_g(energy: Measurement | float, g_per_kwh: float) -> float:
    """Grams CO2e of `energy` (a Measurement's total, or joules) at `g_per_kwh`."""
    joules = energy if isinstance(energy, (int, float)) else energy.total_energy_j
    return joules / JOULES_PER_KWH * g_per_kwh


@dataclass(frozen=True)
class IntensityPoint:
    """The grid's carbon intensity from `timestamp` (UTC) until the next point."""

    timestamp: datetime
    g_per_kwh: float


class CarbonIntensityProvider(abc.ABC):
    """A source of grid carbon intensity (g CO2e per kWh)."""

    #: Whether `forecast` is available (else `expected_intensity` uses `current`).
    supports_forecast: bool = True

    @abc.abstractmethod
    def current(self) -> float:
        """The intensity now."""

    def forecast(self, hours: float) -> list[IntensityPoint]:
        """Points covering the next `hours`, the first one holding now."""
        raise CarbonIntensityError(f"{type(self).__name__} has no forecast")

    def history(self, hours: float = 24.0) -> list[IntensityPoint]:
        """Points covering the past `hours`, oldest first."""
        raise CarbonIntensityError(f"{type(self).__name__} has no history")

    def expected_intensity(self, hours: float) -> float:
        """Time-weighted mean intensity over the next `hours` (the current one without a forecast)."""
        if not self.supports_forecast or hours <= 0:
            return self.current()
        points = self.forecast(hours)
        if not points:
            raise CarbonIntensityError(f"{type(self).__name__} returned an empty forecast")
        start = points[0].timestamp
        end = start + timedelta(hours=hours)
        total = 0.0
        for i, point in enumerate(points):
            seg_start = start if i == 0 else max(point.timestamp, start)
            seg_end = min(points[i + 1].timestamp, end) if i + 1 < len(points) else end
            if seg_end > seg_start:
                total += point.g_per_kwh * (seg_end - seg_start).total_seconds()
        return round(total / (end - start).total_seconds(), 6)  # no float noise (399.99999999999994) in reports


def _check_intensity(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what}: carbon intensity must be a finite number >= 0 g/kWh, got {value!r}")
    return float(value)


class StaticIntensity(CarbonIntensityProvider):
    """One fixed intensity, now and in every forecast."""

    def __init__(self, g_per_kwh: float) -> None:
        self.g_per_kwh = _check_intensity(g_per_kwh, "StaticIntensity")

    def current(self) -> float:
        return self.g_per_kwh

    def forecast(self, hours: float) -> list[IntensityPoint]:
        return [IntensityPoint(datetime.now(timezone.utc), self.g_per_kwh)]

    def __repr__(self) -> str:
        return f"StaticIntensity({self.g_per_kwh:g} g/kWh)"


def _parse_timestamp(text: str) -> datetime:
    """ISO 8601 (a trailing Z allowed); naive times are taken as UTC."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class IntensityTimeSeries(CarbonIntensityProvider):
    """A recorded intensity series (a step function: each value holds until the next point).

    With a `clock` the series is replayed: its first timestamp is "now" when the series is
    built, and time moves `speedup` times as fast as the clock (with a VirtualClock, a day of
    grid data plays out as simulated training runs). Without a clock, "now" is wall-clock UTC.
    The forecast is the series itself (perfect foresight), which is what a replay needs. Replayed,
    the last value holds past the end; read at wall-clock time, it holds for one step of the
    series (its median spacing) and past that reading is a CarbonIntensityError (a stale file is
    not taken for today's grid).
    """

    def __init__(self, points: Sequence[IntensityPoint], clock: Clock | None = None, speedup: float = 1.0) -> None:
        if not points:
            raise ConfigError("IntensityTimeSeries needs at least one point")
        for i, point in enumerate(points):
            _check_intensity(point.g_per_kwh, f"IntensityTimeSeries point {i}")
            if point.timestamp.tzinfo is None:
                raise ConfigError(f"IntensityTimeSeries point {i}: timestamp {point.timestamp} needs a time zone")
            if i and point.timestamp <= points[i - 1].timestamp:
                raise ConfigError(
                    f"IntensityTimeSeries point {i}: timestamps must increase "
                    f"({point.timestamp.isoformat()} after {points[i - 1].timestamp.isoformat()})"
                )
        if not speedup > 0:
            raise ConfigError(f"IntensityTimeSeries speedup must be > 0, got {speedup!r}")
        self.points = list(points)
        self._stamps = [p.timestamp for p in self.points]
        # At wall-clock time the last value holds for the series' typical step; one point holds for good.
        steps = sorted(b - a for a, b in zip(self._stamps, self._stamps[1:]))
        self._covered_until = (
            self._stamps[-1] + steps[len(steps) // 2] if steps else datetime.max.replace(tzinfo=timezone.utc)
        )
        self._clock = clock
        self._speedup = float(speedup)
        self._origin = clock.now() if clock is not None else 0.0

    @classmethod
    def from_csv(
        cls, path: str | os.PathLike[str], clock: Clock | None = None, speedup: float = 1.0
    ) -> IntensityTimeSeries:
        """Read a CSV with the header `timestamp,g_per_kwh` (ISO 8601 times). With a `clock`, the
        replay starts at the first row when this is called (see the class); without one, the rows
        are read at today's wall-clock time, so they must cover now."""
        try:
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except OSError as e:
            raise ConfigError(f"cannot read carbon-intensity CSV {path}: {e}") from e
        if not rows or [c.strip() for c in rows[0]] != ["timestamp", "g_per_kwh"]:
            raise ConfigError(
                f"{path}: row 1 must be the header 'timestamp,g_per_kwh', got {rows[0] if rows else 'nothing'}"
            )
        points: list[IntensityPoint] = []
        for number, row in enumerate(rows[1:], start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 2:
                raise ConfigError(f"{path}: row {number} must have 2 columns (timestamp,g_per_kwh), got {len(row)}")
            try:
                stamp = _parse_timestamp(row[0])
            except ValueError:
                raise ConfigError(
                    f"{path}: row {number}: {row[0]!r} is not an ISO 8601 timestamp (e.g. 2024-05-01T13:00Z)"
                ) from None
            try:
                value = float(row[1])
            except ValueError:
                raise ConfigError(f"{path}: row {number}: {row[1]!r} is not a number of g/kWh") from None
            if points and stamp <= points[-1].timestamp:
                raise ConfigError(
                    f"{path}: row {number}: timestamps must increase ({row[0].strip()} is not after the row above)"
                )
            points.append(IntensityPoint(stamp, _check_intensity(value, f"{path}: row {number}")))
        if not points:
            raise ConfigError(f"{path}: no data rows after the header")
        return cls(points, clock, speedup)

    def now(self) -> datetime:
        """The series' current time (replayed on the clock, or wall-clock UTC)."""
        if self._clock is None:
            return datetime.now(timezone.utc)
        return self.points[0].timestamp + timedelta(seconds=(self._clock.now() - self._origin) * self._speedup)

    def _index_at(self, when: datetime) -> int:
        if when < self.points[0].timestamp:
            raise CarbonIntensityError(
                f"the intensity series starts at {self.points[0].timestamp.isoformat()}, after {when.isoformat()}"
            )
        if self._clock is None and when >= self._covered_until:
            raise CarbonIntensityError(
                f"the intensity series ends at {self.points[-1].timestamp.isoformat()} (its last value holds one step, "
                f"to {self._covered_until.isoformat()}), before now ({when.isoformat()}): give a series that covers "
                "now, or replay it on a clock (from_csv(path, clock=...))"
            )
        return bisect.bisect_right(self._stamps, when) - 1

    def current(self) -> float:
        return self.points[self._index_at(self.now())].g_per_kwh

    def forecast(self, hours: float) -> list[IntensityPoint]:
        now = self.now()
        end = now + timedelta(hours=hours)
        head = IntensityPoint(now, self.points[self._index_at(now)].g_per_kwh)
        return [head] + [p for p in self.points if now < p.timestamp < end]

    def history(self, hours: float = 24.0) -> list[IntensityPoint]:
        now = self.now()
        start = now - timedelta(hours=hours)
        return [p for p in self.points if start <= p.timestamp <= now]


class ElectricityMaps(CarbonIntensityProvider):
    """Carbon intensity of one zone from the Electricity Maps v3 API.

    The key comes from `api_key` or $PERSEUS_ELECTRICITYMAPS_KEY and is sent in the
    `auth-token` header. Responses are cached for `cache_ttl_s` (the data is hourly).
    `use_forecast=False` makes `expected_intensity` use the latest value, for plans without
    the forecast endpoint.
    """

    def __init__(
        self,
        zone: str,
        api_key: str | None = None,
        *,
        base_url: str = ELECTRICITYMAPS_URL,
        timeout_s: float = 10.0,
        cache_ttl_s: float = 300.0,
        use_forecast: bool = True,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        if not zone or not isinstance(zone, str):
            raise ConfigError(f"ElectricityMaps needs a zone code such as 'DE' or 'US-CAL-CISO', got {zone!r}")
        key = api_key or os.environ.get(API_KEY_ENV)
        if not key:
            raise ConfigError(
                "ElectricityMaps needs an API key: get a free one at https://portal.electricitymaps.com "
                f"(sign up, then copy the key), and pass api_key=... or set {API_KEY_ENV}"
            )
        if not timeout_s > 0:
            raise ConfigError(f"ElectricityMaps timeout_s must be > 0, got {timeout_s!r}")
        if not cache_ttl_s >= 0:
            raise ConfigError(f"ElectricityMaps cache_ttl_s must be >= 0, got {cache_ttl_s!r}")
        self.zone = zone
        self.supports_forecast = use_forecast
        self._key = key
        self._http = CachedJSON(
            "Electricity Maps",
            base_url,
            {"auth-token": key},
            float(timeout_s),
            float(cache_ttl_s),
            clock,
            self._hint,
        )

    def _get(self, endpoint: str, params: dict[str, str]) -> Any:
        return self._http.get(endpoint, params, f"zone {self.zone}")

    def __repr__(self) -> str:
        return f"ElectricityMaps(zone={self.zone!r})"

    def current(self) -> float:
        data = self._get("carbon-intensity/latest", {"zone": self.zone})
        return self._point(data, "latest").g_per_kwh

    def forecast(self, hours: float) -> list[IntensityPoint]:
        horizon = next((h for h in FORECAST_HORIZONS_H if h >= hours), None)
        if horizon is None:
            raise ConfigError(f"Electricity Maps forecasts reach {FORECAST_HORIZONS_H[-1]} h, not {hours:g} h")
        data = self._get("carbon-intensity/forecast", {"zone": self.zone, "horizonHours": str(horizon)})
        points = self._points(data, "forecast")
        end = points[0].timestamp + timedelta(hours=hours)
        return [p for i, p in enumerate(points) if i == 0 or p.timestamp < end]

    def history(self, hours: float = 24.0) -> list[IntensityPoint]:
        if hours > 24:
            raise ConfigError(f"the Electricity Maps history endpoint covers the past 24 h, not {hours:g} h")
        points = self._points(self._get("carbon-intensity/history", {"zone": self.zone}), "history")
        start = points[-1].timestamp - timedelta(hours=hours)
        return [p for p in points if p.timestamp >= start]

    # Parsing
    def _point(self, item: Any, endpoint: str) -> IntensityPoint:
        try:
            value = item["carbonIntensity"]
            stamp = _parse_timestamp(item["datetime"])
            return IntensityPoint(stamp, _check_intensity(value, f"{endpoint} carbonIntensity"))
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise CarbonIntensityError(
                f"Electricity Maps {endpoint} for zone {self.zone}: unexpected data {str(item)[:200]!r} "
                f"(needs numeric 'carbonIntensity' and ISO 'datetime'; {e})"
            ) from None

    def _points(self, data: Any, key: str) -> list[IntensityPoint]:
        items = data.get(key) if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise CarbonIntensityError(
                f"Electricity Maps {key} for zone {self.zone}: the response has no '{key}' list: {str(data)[:200]!r}"
            )
        if not items:
            raise CarbonIntensityError(
                f"Electricity Maps {key} for zone {self.zone}: the '{key}' list is empty (no data for the zone now)"
            )
        return sorted((self._point(item, key) for item in items), key=lambda p: p.timestamp)

    def _hint(self, code: int, endpoint: str, error: urllib.error.HTTPError) -> str:
        if code == 401:
            hint = f"the API key was refused (invalid or expired); check api_key= or {API_KEY_ENV}"
        elif code == 403:
            hint = f"the key's plan does not include {endpoint} for zone {self.zone}"
            if endpoint.endswith("forecast"):
                hint += " (pass use_forecast=False to use the latest value instead)"
        elif code == 404:
            hint = f"unknown zone {self.zone!r} or endpoint"
        elif code == 429:
            hint = _rate_limited(error)
        else:
            hint = "the service failed"
        return hint


def _rate_limited(error: urllib.error.HTTPError) -> str:
    retry = error.headers.get("Retry-After") if error.headers else None
    return "rate limit reached; wait" + (f" {retry} s" if retry else "") + " or raise cache_ttl_s to call less often"


class CarbonAwareSDK(CarbonIntensityProvider):
    """Carbon intensity of one location from the Green Software Foundation's Carbon Aware SDK
    WebApi (the API the Carbon-Aware-Zeus RFC builds on): a server you run, which serves
    WattTime or Electricity Maps data under cloud-region names such as "eastus".

    `current` is the latest value of GET /emissions/bylocation (over the last `lookback_h`
    hours), `forecast` the current forecast of GET /emissions/forecasts/current, `history`
    /emissions/bylocation over the past hours. The URL comes from `url` or
    $PERSEUS_CARBON_AWARE_URL; responses are cached for `cache_ttl_s`.
    """

    def __init__(
        self,
        location: str,
        url: str | None = None,
        *,
        timeout_s: float = 10.0,
        cache_ttl_s: float = 300.0,
        use_forecast: bool = True,
        lookback_h: float = 2.0,
        clock: Clock = REAL_CLOCK,
    ) -> None:
        if not location or not isinstance(location, str):
            raise ConfigError(
                f"CarbonAwareSDK needs a location the WebApi knows (GET /locations), such as 'eastus', got {location!r}"
            )
        url = url or os.environ.get(CARBON_AWARE_URL_ENV)
        if not url:
            raise ConfigError(
                "CarbonAwareSDK needs the URL of a Carbon Aware SDK WebApi you run (its container serves port 80; "
                f"e.g. docker run -p 8090:80 ... then url='http://localhost:8090'): pass url=... or set "
                f"{CARBON_AWARE_URL_ENV}"
            )
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"CarbonAwareSDK url must start with http:// or https://, got {url!r}")
        if not timeout_s > 0:
            raise ConfigError(f"CarbonAwareSDK timeout_s must be > 0, got {timeout_s!r}")
        if not cache_ttl_s >= 0:
            raise ConfigError(f"CarbonAwareSDK cache_ttl_s must be >= 0, got {cache_ttl_s!r}")
        if not lookback_h > 0:
            raise ConfigError(f"CarbonAwareSDK lookback_h must be > 0, got {lookback_h!r}")
        self.location = location
        self.supports_forecast = use_forecast
        self.lookback_h = float(lookback_h)
        self._clock = clock
        self._http = CachedJSON(
            "the Carbon Aware SDK WebApi", url, {}, float(timeout_s), float(cache_ttl_s), clock, self._hint
        )

    def __repr__(self) -> str:
        return f"CarbonAwareSDK(location={self.location!r})"

    def current(self) -> float:
        return self._observed(self.lookback_h, "emissions/bylocation")[-1].g_per_kwh

    def history(self, hours: float = 24.0) -> list[IntensityPoint]:
        return self._observed(hours, "emissions/bylocation (history)")

    def forecast(self, hours: float) -> list[IntensityPoint]:
        data = self._http.get("emissions/forecasts/current", {"location": self.location}, self._what)
        first = data[0] if isinstance(data, list) and data else None
        if not isinstance(first, dict) or not isinstance(first.get("forecastData"), list):
            raise CarbonIntensityError(
                f"Carbon Aware SDK forecast for {self._what}: expected a list of forecasts with 'forecastData', got "
                f"{str(data)[:200]!r}"
            )
        rows = sorted(
            (self._point(item, "forecastData", "timestamp", "value") for item in first["forecastData"]),
            key=lambda row: row[0].timestamp,
        )
        now = datetime.now(timezone.utc)
        # From the point in force now (each holds for its duration) to `hours` ahead.
        ahead = [p for p, minutes in rows if p.timestamp + timedelta(minutes=minutes or 0) > now]
        if not ahead:
            raise CarbonIntensityError(
                f"Carbon Aware SDK forecast for {self._what} ends before now ({rows[-1][0].timestamp.isoformat()} "
                "at the latest): its data source has no current forecast"
                if rows
                else f"Carbon Aware SDK forecast for {self._what} has no data points"
            )
        end = ahead[0].timestamp + timedelta(hours=hours)  # as expected_intensity counts: from the first point
        last, minutes = rows[-1]
        covered = last.timestamp + timedelta(minutes=minutes or 0)
        if covered < end:  # the mean would hold the last value over hours nobody forecast
            reach = (covered - ahead[0].timestamp).total_seconds() / 3600
            raise CarbonIntensityError(
                f"Carbon Aware SDK forecast for {self._what} covers {reach:.3g} h from now (to "
                f"{covered.isoformat()}), not {hours:g} h: ask for at most {reach:.3g} h"
            )
        return [p for i, p in enumerate(ahead) if i == 0 or p.timestamp < end]

    @property
    def _what(self) -> str:
        return f"location {self.location}"

    def _observed(self, hours: float, endpoint: str) -> list[IntensityPoint]:
        now = datetime.now(timezone.utc)
        params = {
            "location": self.location,
            "time": (now - timedelta(hours=hours)).isoformat(timespec="seconds"),
            "toTime": now.isoformat(timespec="seconds"),
        }
        data = self._http.get("emissions/bylocation", params, self._what)
        if not isinstance(data, list):
            raise CarbonIntensityError(
                f"Carbon Aware SDK {endpoint} for {self._what}: expected a list of emissions data, "
                f"got {str(data)[:200]!r}"
            )
        if not data:
            raise CarbonIntensityError(
                f"Carbon Aware SDK {endpoint} for {self._what}: no data in the last {hours:g} h (is the location "
                "covered by the WebApi's data source? raise lookback_h if its data is sparse)"
            )
        return sorted((self._point(item, endpoint, "time", "rating")[0] for item in data), key=lambda p: p.timestamp)

    def _point(self, item: Any, endpoint: str, time_key: str, value_key: str) -> tuple[IntensityPoint, float | None]:
        """(the point, its duration in minutes if given)."""
        try:
            stamp = _parse_timestamp(item[time_key])
            point = IntensityPoint(stamp, _check_intensity(item[value_key], f"{endpoint} {value_key}"))
            duration = item.get("duration")
            return point, float(duration) if isinstance(duration, (int, float)) else None
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            raise CarbonIntensityError(
                f"Carbon Aware SDK {endpoint} for {self._what}: unexpected data {str(item)[:200]!r} "
                f"(needs numeric '{value_key}' and ISO '{time_key}'; {e})"
            ) from None

    def _hint(self, code: int, endpoint: str, error: urllib.error.HTTPError) -> str:
        if code == 400:
            return f"the WebApi refused the request (is {self.location!r} one of its GET /locations?)"
        if code == 404:
            return f"no such endpoint or location {self.location!r}; check the url and GET /locations"
        if code in (401, 403):
            return "the WebApi refused access; check what sits in front of it (a proxy or API gateway)"
        if code == 429:
            return _rate_limited(error)
        return "the WebApi's data source failed (its log says why: often its WattTime or Electricity Maps credentials)"


@dataclass(frozen=True)
class EpochCarbon:
    """Energy, carbon and time of one epoch (or the totals over all, `epoch` = 0). `g_per_kwh`
    and `carbon_g` are None where the provider had given no intensity yet (energy and time are
    always measured)."""

    epoch: int
    time_s: float
    energy_j: float
    g_per_kwh: float | None
    carbon_g: float | None


class CarbonReporter:
    """Per-epoch energy (J), carbon (g) and time (s), logged and appended to a JSON-lines file.

    Hooks: `on_epoch_begin`, `on_epoch_end`, `on_train_end` (writes the totals, with
    "total": true). Use it beside a GlobalPowerLimitOptimizer, or through
    `PowerLimitCallback(carbon_reporter=...)`. The intensity of an epoch is the mean of the
    provider's values at its start and end. It reports what `monitor` measures: give each
    rank of a data-parallel job its own `path`. Each epoch's figures (and the totals) reach
    the user without any logging set-up: one line printed by rank 0 to stderr, or logged at
    INFO where logging shows INFO (perseus.notice); `verbose=False` keeps them to the log.

    `codecarbon_csv`: also append the run's totals at `on_train_end` to a CodeCarbon-style
    `emissions.csv` (CodeCarbon's columns and units: kWh, kg CO2e; see
    perseus.measurement.codecarbon_csv), described by `run_info` (project name, country, ...).

    A provider that fails (a CarbonIntensityError: the service down, an HTTP error) never stops
    training nor loses an epoch's energy: the last intensity read is reused, with a warning;
    before any was read, the epoch's carbon is unknown (None) and the totals count it at the
    first intensity read later.
    """

    def __init__(
        self,
        monitor: Monitor,
        provider: CarbonIntensityProvider,
        path: str | os.PathLike[str] | None = None,
        verbose: bool = True,
        *,
        codecarbon_csv: str | os.PathLike[str] | None = None,
        run_info: RunInfo | None = None,
    ) -> None:
        self.monitor = monitor
        self.provider = provider
        self.path = os.fspath(path) if path is not None else None
        self.verbose = verbose
        self.codecarbon_csv = os.fspath(codecarbon_csv) if codecarbon_csv is not None else None
        self.run_info = run_info or RunInfo()
        self.epochs: list[EpochCarbon] = []
        # Over finished epochs, for the CSV; CPU and RAM stay None unless a counter measured them.
        self._energy_j: dict[str, float | None] = {"gpu": 0.0, "cpu": None, "ram": None}
        self._window = f"perseus.carbon.{id(self)}"
        self._open = False  # an epoch's window is open
        self._begin_intensity: float | None = None
        self._last_intensity: float | None = None  # the provider's last good reading
        self._failing = False  # the last reading failed (warned once per outage)

    def on_epoch_begin(self) -> None:
        if self._open:
            self.monitor.end_window(self._window, cancel=True)
        self._begin_intensity = self._intensity()
        self.monitor.begin_window(self._window)
        self._open = True

    def on_epoch_end(self) -> EpochCarbon:
        if not self._open:
            raise ConfigError("CarbonReporter.on_epoch_end called without on_epoch_begin")
        measurement = self.monitor.end_window(self._window)
        self._open = False
        readings = [g for g in (self._begin_intensity, self._intensity()) if g is not None]
        intensity = sum(readings) / len(readings) if readings else None
        self._begin_intensity = None
        for kind, energies in (
            ("gpu", measurement.gpu_energy_j),
            ("cpu", measurement.cpu_energy_j),
            ("ram", measurement.dram_energy_j),
        ):
            if energies is not None:
                self._energy_j[kind] = (self._energy_j[kind] or 0.0) + sum(energies.values())
        record = EpochCarbon(
            epoch=len(self.epochs) + 1,
            time_s=measurement.time_s,
            energy_j=measurement.total_energy_j,
            g_per_kwh=intensity,
            carbon_g=None if intensity is None else emissions_g(measurement, intensity),
        )
        self.epochs.append(record)
        carbon = (
            "carbon unknown (no intensity read yet)"
            if record.carbon_g is None
            else f"{record.carbon_g:.3f} g CO2e at {record.g_per_kwh:.0f} g/kWh"
        )
        self._tell(f"epoch {record.epoch}: {record.time_s:.1f} s, {record.energy_j:.1f} J, {carbon}")
        self._write(asdict(record))
        return record

    def _intensity(self) -> float | None:
        """The provider's intensity now; if it fails, the last one read (None before any)."""
        try:
            self._last_intensity = self.provider.current()
            self._failing = False
        except CarbonIntensityError as e:
            level = logging.DEBUG if self._failing else logging.WARNING  # once per outage
            self._failing = True
            if self._last_intensity is None:
                logger.log(
                    level,
                    "carbon intensity unavailable (%s); the carbon of epochs until one is read is counted then",
                    e,
                )
            else:
                logger.log(level, "carbon intensity unavailable (%s); reusing %.0f g/kWh", e, self._last_intensity)
        return self._last_intensity

    def _tell(self, line: str) -> None:
        """One line for the user (rank 0 speaks for the job, of its own devices)."""
        gpus = len(self.monitor.gpus)
        where = f"{gpus} GPU{'s' if gpus != 1 else ''}" + (" and CPUs" if self.monitor.cpus else "")
        text = f"{line} ({where}{' of rank 0' if world_size() > 1 else ''})"
        if self.verbose or logs_info(logger):
            notice(logger, text)
        else:
            logger.debug("%s", text)

    def totals(self) -> EpochCarbon:
        """Sums over finished epochs; `g_per_kwh` is the energy-weighted mean. Epochs that ended
        before any intensity was read count at the first one read after them (carbon None while
        none was read)."""
        energy = sum(e.energy_j for e in self.epochs)
        first = next((e.g_per_kwh for e in self.epochs if e.g_per_kwh is not None), self._last_intensity)
        carbon = None
        if first is not None:
            carbon = sum(e.carbon_g if e.carbon_g is not None else emissions_g(e.energy_j, first) for e in self.epochs)
        return EpochCarbon(
            epoch=0,
            time_s=sum(e.time_s for e in self.epochs),
            energy_j=energy,
            g_per_kwh=None if carbon is None else round(carbon / energy * JOULES_PER_KWH, 6) if energy > 0 else first,
            carbon_g=carbon,
        )

    def on_train_end(self) -> EpochCarbon:
        if self._open:
            self.monitor.end_window(self._window, cancel=True)
            self._open = False
            self._begin_intensity = None
        total = self.totals()
        epochs = f"{len(self.epochs)} epoch{'s' if len(self.epochs) != 1 else ''}"
        unknown = sum(e.carbon_g is None for e in self.epochs)
        if total.carbon_g is None:
            carbon = "carbon unknown (the provider gave no intensity)"
        else:
            carbon = f"{total.carbon_g:.3f} g CO2e"
            if unknown:
                carbon += f" ({unknown} epoch{'s' if unknown != 1 else ''} at the first intensity read after it)"
        self._tell(f"training: {epochs}, {total.time_s:.1f} s, {total.energy_j:.1f} J, {carbon}")
        line = asdict(total)
        del line["epoch"]
        self._write({"total": True, "epochs": len(self.epochs), **line})
        if self.codecarbon_csv is not None:
            run = RunEnergy(
                duration_s=total.time_s,
                gpu_energy_j=self._energy_j["gpu"] or 0.0,
                cpu_energy_j=self._energy_j["cpu"],
                ram_energy_j=self._energy_j["ram"],
                carbon_g=total.carbon_g,
                gpu_count=len(self.monitor.gpus),
                gpu_name=self.monitor.gpus[0].name() if self.monitor.gpus else "",
            )
            codecarbon_csv.append_row(self.codecarbon_csv, codecarbon_csv.row(run, self.run_info))
        return total

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
