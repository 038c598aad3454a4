"""Carbon intensity of the grid, and the emissions of measured energy.

Emissions are energy times the grid's carbon intensity: grams CO2e = J / 3.6e6 * g/kWh.
Intensity comes from a `CarbonIntensityProvider`:
- `ElectricityMaps`: the Electricity Maps v3 API (latest, 24 h history, forecast), cached;
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
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from perseus.clock import REAL_CLOCK, Clock
from perseus.exceptions import CarbonIntensityError, ConfigError
from perseus.measurement.monitor import Measurement, Monitor
from perseus.notice import logs_info, notice, world_size

logger = logging.getLogger(__name__)

JOULES_PER_KWH = 3.6e6
API_KEY_ENV = "PERSEUS_ELECTRICITYMAPS_KEY"
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
        return total / (end - start).total_seconds()


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
    The forecast is the series itself (perfect foresight), which is what a replay needs.
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
        self._clock = clock
        self._speedup = float(speedup)
        self._origin = clock.now() if clock is not None else 0.0

    @classmethod
    def from_csv(
        cls, path: str | os.PathLike[str], clock: Clock | None = None, speedup: float = 1.0
    ) -> IntensityTimeSeries:
        """Read a CSV with the header `timestamp,g_per_kwh` (ISO 8601 times)."""
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
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.cache_ttl_s = float(cache_ttl_s)
        self.supports_forecast = use_forecast
        self._key = key
        self._clock = clock
        self._cache: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()

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
        if not isinstance(items, list) or not items:
            raise CarbonIntensityError(
                f"Electricity Maps {key} for zone {self.zone}: the response has no '{key}' list: {str(data)[:200]!r}"
            )
        return sorted((self._point(item, key) for item in items), key=lambda p: p.timestamp)

    # HTTP
    def _get(self, endpoint: str, params: dict[str, str]) -> Any:
        url = f"{self.base_url}/{endpoint}?{urllib.parse.urlencode(params)}"
        with self._lock:
            hit = self._cache.get(url)
            if hit is not None and self._clock.now() - hit[0] < self.cache_ttl_s:
                return hit[1]
        request = urllib.request.Request(
            url, headers={"auth-token": self._key, "Accept": "application/json", "User-Agent": "perseus"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            raise self._http_error(endpoint, e) from None
        except TimeoutError:
            raise self._timeout(endpoint) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise self._timeout(endpoint) from None
            raise CarbonIntensityError(f"cannot reach Electricity Maps at {self.base_url}: {e.reason}") from None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise CarbonIntensityError(
                f"Electricity Maps {endpoint} for zone {self.zone} returned malformed JSON: {body[:200]!r}"
            ) from None
        with self._lock:
            self._cache[url] = (self._clock.now(), data)
        return data

    def _timeout(self, endpoint: str) -> CarbonIntensityError:
        return CarbonIntensityError(
            f"Electricity Maps {endpoint} timed out after {self.timeout_s:g} s; retry later or raise timeout_s"
        )

    def _http_error(self, endpoint: str, error: urllib.error.HTTPError) -> CarbonIntensityError:
        try:
            detail = error.read()[:200].decode("utf-8", "replace")
        except OSError:
            detail = ""
        if error.code == 401:
            hint = f"the API key was refused (invalid or expired); check api_key= or {API_KEY_ENV}"
        elif error.code == 403:
            hint = f"the key's plan does not include {endpoint} for zone {self.zone}"
            if endpoint.endswith("forecast"):
                hint += " (pass use_forecast=False to use the latest value instead)"
        elif error.code == 404:
            hint = f"unknown zone {self.zone!r} or endpoint"
        elif error.code == 429:
            retry = error.headers.get("Retry-After") if error.headers else None
            hint = (
                "rate limit reached; wait"
                + (f" {retry} s" if retry else "")
                + " or raise cache_ttl_s to call less often"
            )
        else:
            hint = "the service failed"
        return CarbonIntensityError(f"Electricity Maps {endpoint}: HTTP {error.code}: {hint} ({detail.strip()})")


@dataclass(frozen=True)
class EpochCarbon:
    """Energy, carbon and time of one epoch (or the totals over all, `epoch` = 0)."""

    epoch: int
    time_s: float
    energy_j: float
    g_per_kwh: float
    carbon_g: float


class CarbonReporter:
    """Per-epoch energy (J), carbon (g) and time (s), logged and appended to a JSON-lines file.

    Hooks: `on_epoch_begin`, `on_epoch_end`, `on_train_end` (writes the totals, with
    "total": true). Use it beside a GlobalPowerLimitOptimizer, or through
    `PowerLimitCallback(carbon_reporter=...)`. The intensity of an epoch is the mean of the
    provider's values at its start and end. It reports what `monitor` measures: give each
    rank of a data-parallel job its own `path`. Each epoch's figures (and the totals) reach
    the user without any logging set-up: one line printed by rank 0 to stderr, or logged at
    INFO where logging shows INFO (perseus.notice); `verbose=False` keeps them to the log.
    """

    def __init__(
        self,
        monitor: Monitor,
        provider: CarbonIntensityProvider,
        path: str | os.PathLike[str] | None = None,
        verbose: bool = True,
    ) -> None:
        self.monitor = monitor
        self.provider = provider
        self.path = os.fspath(path) if path is not None else None
        self.verbose = verbose
        self.epochs: list[EpochCarbon] = []
        self._window = f"perseus.carbon.{id(self)}"
        self._begin_intensity: float | None = None

    def on_epoch_begin(self) -> None:
        if self._begin_intensity is not None:
            self.monitor.end_window(self._window, cancel=True)
        self._begin_intensity = self.provider.current()
        self.monitor.begin_window(self._window)

    def on_epoch_end(self) -> EpochCarbon:
        if self._begin_intensity is None:
            raise ConfigError("CarbonReporter.on_epoch_end called without on_epoch_begin")
        measurement = self.monitor.end_window(self._window)
        intensity = (self._begin_intensity + self.provider.current()) / 2
        self._begin_intensity = None
        record = EpochCarbon(
            epoch=len(self.epochs) + 1,
            time_s=measurement.time_s,
            energy_j=measurement.total_energy_j,
            g_per_kwh=intensity,
            carbon_g=emissions_g(measurement, intensity),
        )
        self.epochs.append(record)
        self._tell(
            f"epoch {record.epoch}: {record.time_s:.1f} s, {record.energy_j:.1f} J, {record.carbon_g:.3f} g CO2e "
            f"at {record.g_per_kwh:.0f} g/kWh"
        )
        self._write(asdict(record))
        return record

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
        """Sums over finished epochs; `g_per_kwh` is the energy-weighted mean."""
        energy = sum(e.energy_j for e in self.epochs)
        carbon = sum(e.carbon_g for e in self.epochs)
        return EpochCarbon(
            epoch=0,
            time_s=sum(e.time_s for e in self.epochs),
            energy_j=energy,
            g_per_kwh=carbon / energy * JOULES_PER_KWH if energy > 0 else 0.0,
            carbon_g=carbon,
        )

    def on_train_end(self) -> EpochCarbon:
        if self._begin_intensity is not None:
            self.monitor.end_window(self._window, cancel=True)
            self._begin_intensity = None
        total = self.totals()
        self._tell(
            f"training: {len(self.epochs)} epochs, {total.time_s:.1f} s, {total.energy_j:.1f} J, "
            f"{total.carbon_g:.3f} g CO2e"
        )
        line = asdict(total)
        del line["epoch"]
        self._write({"total": True, "epochs": len(self.epochs), **line})
        return total

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
