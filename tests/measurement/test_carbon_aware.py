"""The Carbon Aware SDK WebApi provider against a loopback HTTP server replaying the WebApi's
documented response shapes (EmissionsData lists, EmissionsForecast with forecastData, and
ValidationProblemDetails errors)."""

from __future__ import annotations

import json
import threading
import urllib.parse
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from perseus.clock import VirtualClock
from perseus.exceptions import CarbonIntensityError, ConfigError
from perseus.measurement.carbon import CARBON_AWARE_URL_ENV, CarbonAwareSDK


def stamp(t: datetime) -> str:
    return t.isoformat()


class FakeWebApi:
    """Answers /emissions/bylocation and /emissions/forecasts/current for location "eastus"
    around the real now (the provider asks for the last hours and the forecast from now)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.paths: list[str] = []
        now = datetime.now(timezone.utc).replace(second=0, microsecond=0)
        self.now = now
        hour = now.replace(minute=0)
        self.observed = [
            {"location": "eastus", "time": stamp(hour - timedelta(hours=h)), "rating": r, "duration": "01:00:00"}
            for h, r in ((2, 410.0), (1, 380.5), (0, 350.25))
        ]
        start = now - timedelta(minutes=now.minute % 30)  # a 30-minute forecast step holding now
        self.forecast_start = start
        self.forecast = [
            {
                "requestedAt": stamp(now),
                "generatedAt": stamp(start),
                "location": "eastus",
                "dataStartAt": stamp(start),
                "dataEndAt": stamp(start + timedelta(hours=4)),
                "windowSize": 30,
                "optimalDataPoints": [{"location": "PJM", "timestamp": stamp(start), "duration": 30, "value": 300}],
                "forecastData": [
                    {
                        "location": "PJM",
                        "timestamp": stamp(start + timedelta(minutes=30 * i)),
                        "duration": 30,
                        "value": v,
                    }
                    for i, v in enumerate([300, 500, 100, 100, 200, 200, 200, 200])
                ],
            }
        ]
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake.paths.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                if fake.mode == "500":
                    return self._reply(500, {"title": "InternalServerError", "status": 500, "detail": "WattTime 401"})
                if query.get("location") != ["eastus"]:
                    return self._reply(
                        400,
                        {
                            "type": "https://tools.ietf.org/html/rfc7231#section-6.5.1",
                            "title": "ArgumentException",
                            "status": 400,
                            "detail": f"Unknown location: '{query.get('location')}'",
                        },
                    )
                if url.path == "/emissions/bylocation":
                    rows = [] if fake.mode == "empty" else fake.observed
                    return self._reply(200, rows)
                if url.path == "/emissions/forecasts/current":
                    return self._reply(200, [{"location": "eastus"}] if fake.mode == "bad-forecast" else fake.forecast)
                return self._reply(404, {"title": "Not Found", "status": 404})

            def _reply(self, code: int, data: object) -> None:
                body = json.dumps(data).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webapi():
    fake = FakeWebApi()
    yield fake
    fake.close()


def sdk(webapi: FakeWebApi, location: str = "eastus", **kwargs: object) -> CarbonAwareSDK:
    return CarbonAwareSDK(location, webapi.url, timeout_s=30.0, **kwargs)  # type: ignore[arg-type]


def test_current_is_the_latest_observed_rating(webapi):
    assert sdk(webapi).current() == 350.25
    url = urllib.parse.urlsplit(webapi.paths[-1])
    query = urllib.parse.parse_qs(url.query)
    assert url.path == "/emissions/bylocation" and query["location"] == ["eastus"]
    asked = datetime.fromisoformat(query["toTime"][0]) - datetime.fromisoformat(query["time"][0])
    assert asked == timedelta(hours=2)  # lookback_h


def test_history_oldest_first(webapi):
    assert [p.g_per_kwh for p in sdk(webapi).history(3)] == [410.0, 380.5, 350.25]


def test_forecast_and_expected_intensity(webapi):
    provider = sdk(webapi)
    points = provider.forecast(1.5)
    assert points[0].timestamp == webapi.forecast_start
    assert [p.g_per_kwh for p in points] == [300.0, 500.0, 100.0]
    assert urllib.parse.urlsplit(webapi.paths[-1]).path == "/emissions/forecasts/current"
    # 1 h from the point in force: half an hour at 300, half an hour at 500.
    assert provider.expected_intensity(1.0) == pytest.approx(400.0)
    assert provider.expected_intensity(4.0) == pytest.approx(225.0)  # the whole forecast
    with pytest.raises(CarbonIntensityError, match="covers 4 h from now .*not 5 h: ask for at most 4 h"):
        provider.expected_intensity(5.0)  # not the last value held for an hour nobody forecast


def test_responses_are_cached_until_the_ttl(webapi):
    clock = VirtualClock()
    provider = sdk(webapi, cache_ttl_s=60, clock=clock)
    provider.forecast(1)
    provider.forecast(1)
    assert len(webapi.paths) == 1
    clock.advance(61)
    provider.forecast(1)
    assert len(webapi.paths) == 2


def test_without_forecast_expected_intensity_is_the_current(webapi):
    assert sdk(webapi, use_forecast=False).expected_intensity(3) == 350.25
    assert all("forecasts" not in p for p in webapi.paths)


def test_errors_say_what_to_fix(webapi):
    with pytest.raises(
        CarbonIntensityError, match="HTTP 400: .*'westeurope' one of its GET /locations.*Unknown location"
    ):
        sdk(webapi, "westeurope").current()
    webapi.mode = "empty"
    with pytest.raises(CarbonIntensityError, match="no data in the last 2 h.*raise lookback_h"):
        sdk(webapi).current()
    webapi.mode = "bad-forecast"
    with pytest.raises(CarbonIntensityError, match="expected a list of forecasts with 'forecastData'"):
        sdk(webapi).forecast(1)
    webapi.mode = "500"
    with pytest.raises(CarbonIntensityError, match="HTTP 500: the WebApi's data source failed.*WattTime 401"):
        sdk(webapi).current()


def test_unreachable_webapi_is_a_clear_error(webapi):
    url = webapi.url
    webapi.close()
    with pytest.raises(CarbonIntensityError, match="cannot reach the Carbon Aware SDK WebApi at http://127.0.0.1"):
        CarbonAwareSDK("eastus", url, timeout_s=1.0).current()


def test_configuration_errors(monkeypatch):
    monkeypatch.delenv(CARBON_AWARE_URL_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"url=... or set {CARBON_AWARE_URL_ENV}"):
        CarbonAwareSDK("eastus")
    with pytest.raises(ConfigError, match="http:// or https://"):
        CarbonAwareSDK("eastus", "localhost:8090")
    with pytest.raises(ConfigError, match="location"):
        CarbonAwareSDK("", "http://localhost:8090")
    monkeypatch.setenv(CARBON_AWARE_URL_ENV, "http://localhost:8090/")
    assert CarbonAwareSDK("eastus")._http.base_url == "http://localhost:8090"
