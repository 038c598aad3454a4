"""Carbon intensity providers, emissions and the per-epoch carbon report.

The Electricity Maps client runs against a real HTTP server on loopback that serves
responses in the shape the v3 API returns.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import CarbonIntensityError, ConfigError
from perseus.measurement import Measurement, Monitor
from perseus.measurement.carbon import (
    API_KEY_ENV,
    CarbonReporter,
    ElectricityMaps,
    IntensityPoint,
    IntensityTimeSeries,
    StaticIntensity,
    emissions_g,
)

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)

LATEST = {
    "zone": "DE",
    "carbonIntensity": 322,
    "datetime": "2024-05-01T12:00:00.000Z",
    "updatedAt": "2024-05-01T11:55:21.002Z",
    "emissionFactorType": "lifecycle",
    "isEstimated": True,
    "estimationMethod": "TIME_SLICER_AVERAGE",
}
FORECAST = {
    "zone": "DE",
    "forecast": [
        {"carbonIntensity": 300, "datetime": "2024-05-01T12:00:00.000Z"},
        {"carbonIntensity": 500, "datetime": "2024-05-01T13:00:00.000Z"},
        {"carbonIntensity": 100, "datetime": "2024-05-01T14:00:00.000Z"},
        {"carbonIntensity": 100, "datetime": "2024-05-01T15:00:00.000Z"},
    ],
    "updatedAt": "2024-05-01T11:55:21.002Z",
}
HISTORY = {
    "zone": "DE",
    "history": [
        {"zone": "DE", "carbonIntensity": 410, "datetime": "2024-05-01T09:00:00.000Z", "isEstimated": False},
        {"zone": "DE", "carbonIntensity": 380, "datetime": "2024-05-01T10:00:00.000Z", "isEstimated": False},
        {"zone": "DE", "carbonIntensity": 350, "datetime": "2024-05-01T11:00:00.000Z", "isEstimated": True},
    ],
}
ROUTES = {
    "/v3/carbon-intensity/latest": LATEST,
    "/v3/carbon-intensity/forecast": FORECAST,
    "/v3/carbon-intensity/history": HISTORY,
}
KEY = "test-key-123"


class FakeElectricityMaps:
    """A loopback HTTP server answering like api.electricitymaps.com/v3. `mode` picks a failure."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.requests: list[tuple[str, str | None]] = []
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake.requests.append((self.path, self.headers.get("auth-token")))
                path = self.path.split("?")[0]
                if fake.mode == "timeout":
                    fake.release.wait(5)
                    return
                if self.headers.get("auth-token") != KEY or fake.mode == "401":
                    return self._reply(401, b'{"message": "Unauthorized"}')
                if fake.mode == "429":
                    return self._reply(429, b'{"message": "Too many requests"}', {"Retry-After": "30"})
                if fake.mode == "403":
                    return self._reply(403, b'{"message": "Forbidden: not in plan"}')
                if fake.mode == "malformed":
                    return self._reply(200, b'{"zone": "DE", "carbonIntensity": 3')
                if fake.mode == "204":
                    return self._reply(204, b"")
                if fake.mode == "empty-list":
                    return self._reply(200, b'{"zone": "DE", "forecast": [], "history": []}')
                if fake.mode == "500":
                    return self._reply(500, b'{"message": "internal error"}')
                if fake.mode == "no-intensity":
                    return self._reply(200, b'{"zone": "DE", "datetime": "2024-05-01T12:00:00Z"}')
                if path not in ROUTES:
                    return self._reply(404, b'{"message": "not found"}')
                return self._reply(200, json.dumps(ROUTES[path]).encode())

            def _reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v3"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    fake = FakeElectricityMaps()
    yield fake
    fake.close()


def client(server: FakeElectricityMaps, **kwargs: object) -> ElectricityMaps:
    kwargs.setdefault("api_key", KEY)
    # Generous: the loopback server answers at once, but a loaded machine may be slow to run it.
    return ElectricityMaps("DE", base_url=server.url, timeout_s=30.0, **kwargs)  # type: ignore[arg-type]


# Emissions
def test_emissions_of_joules_and_of_a_measurement():
    assert emissions_g(3.6e6, 500) == pytest.approx(500.0)
    m = Measurement(time_s=10.0, gpu_energy_j={0: 1.8e6, 1: 1.8e6})
    assert emissions_g(m, 250) == pytest.approx(250.0)


# Electricity Maps
def test_latest_sends_the_key_in_the_auth_token_header(server):
    em = client(server)
    assert em.current() == 322.0
    path, token = server.requests[-1]
    assert path == "/v3/carbon-intensity/latest?zone=DE"
    assert token == KEY


def test_forecast_history_and_expected_intensity(server):
    em = client(server)
    points = em.forecast(2)
    assert [p.g_per_kwh for p in points] == [300.0, 500.0]
    assert points[0].timestamp == T0
    assert "horizonHours=6" in server.requests[-1][0]
    # 1.5 h from 12:00: one hour at 300, half an hour at 500.
    assert em.expected_intensity(1.5) == pytest.approx((300 * 1 + 500 * 0.5) / 1.5)
    assert [p.g_per_kwh for p in em.history()] == [410.0, 380.0, 350.0]
    assert [p.g_per_kwh for p in em.history(1)] == [380.0, 350.0]
    with pytest.raises(ConfigError, match="72 h"):
        em.forecast(100)


def test_responses_are_cached_until_the_ttl(server):
    clock = VirtualClock()
    em = client(server, cache_ttl_s=60, clock=clock)
    em.current()
    em.current()
    assert len(server.requests) == 1
    clock.advance(61)
    em.current()
    assert len(server.requests) == 2


def test_without_forecast_expected_intensity_is_the_latest(server):
    em = client(server, use_forecast=False)
    assert em.expected_intensity(3) == 322.0
    assert all("forecast" not in path for path, _ in server.requests)


def test_401_says_the_key_is_invalid(server):
    em = client(server, api_key="wrong")
    with pytest.raises(CarbonIntensityError, match="HTTP 401.*key was refused"):
        em.current()


def test_429_says_rate_limited_and_when_to_retry(server):
    server.mode = "429"
    with pytest.raises(CarbonIntensityError, match="HTTP 429: rate limit reached; wait 30 s"):
        client(server).current()


def test_403_on_forecast_suggests_use_forecast_false(server):
    server.mode = "403"
    with pytest.raises(CarbonIntensityError, match="use_forecast=False"):
        client(server).forecast(1)


def test_timeout_is_a_clear_error(server):
    server.mode = "timeout"
    em = ElectricityMaps("DE", api_key=KEY, base_url=server.url, timeout_s=0.2)
    with pytest.raises(CarbonIntensityError, match="timed out after 0.2 s"):
        em.current()


def test_malformed_json_and_missing_fields_are_clear_errors(server):
    server.mode = "malformed"
    with pytest.raises(CarbonIntensityError, match="malformed JSON"):
        client(server).current()
    server.mode = "no-intensity"
    with pytest.raises(CarbonIntensityError, match="carbonIntensity"):
        client(server).current()
    with pytest.raises(CarbonIntensityError, match="no 'forecast' list"):
        client(server).forecast(1)


def test_no_content_and_empty_lists_say_there_is_no_data(server):
    server.mode = "204"
    with pytest.raises(CarbonIntensityError, match=r"has no data for zone DE \(HTTP 204"):
        client(server).current()
    server.mode = "empty-list"
    with pytest.raises(CarbonIntensityError, match="the 'forecast' list is empty"):
        client(server).forecast(1)


def test_unreachable_server_is_a_clear_error(server):
    url = server.url
    server.close()
    with pytest.raises(CarbonIntensityError, match="cannot reach Electricity Maps"):
        ElectricityMaps("DE", api_key=KEY, base_url=url, timeout_s=1.0).current()


def test_no_key_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"portal.electricitymaps.com.*api_key=.*{API_KEY_ENV}"):
        ElectricityMaps("DE")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ElectricityMaps("DE")._key == "from-env"


# Static and time series
def test_static_intensity():
    s = StaticIntensity(200)
    assert s.current() == 200 and s.expected_intensity(5) == 200
    with pytest.raises(ConfigError):
        StaticIntensity(-1)


def write_csv(tmp_path, text: str):
    path = tmp_path / "grid.csv"
    path.write_text(text)
    return path


def test_time_series_replays_on_a_clock(tmp_path):
    path = write_csv(
        tmp_path, "timestamp,g_per_kwh\n2024-05-01T00:00Z,100\n2024-05-01T01:00Z,700\n2024-05-01T02:00Z,300\n"
    )
    clock = VirtualClock(50.0)
    series = IntensityTimeSeries.from_csv(path, clock=clock, speedup=60.0)  # one clock minute = one hour
    assert series.current() == 100
    clock.advance(30)  # 00:30
    assert series.expected_intensity(1.0) == pytest.approx((100 + 700) / 2)
    assert [p.g_per_kwh for p in series.forecast(2.0)] == [100, 700, 300]
    clock.advance(60)  # 01:30
    assert series.current() == 700
    assert [p.g_per_kwh for p in series.history(2)] == [100, 700]
    clock.advance(600)  # past the end: the last value holds
    assert series.current() == 300


def test_a_stale_series_at_wall_clock_time_is_an_error_not_todays_grid():
    now = datetime.now(timezone.utc)
    hourly = [IntensityPoint(now - timedelta(hours=h), 100.0 * h) for h in (5, 4, 3)]
    with pytest.raises(CarbonIntensityError, match="ends at .* before now .*replay it on a clock"):
        IntensityTimeSeries(hourly).current()
    assert IntensityTimeSeries(hourly[:2] + [IntensityPoint(now - timedelta(minutes=30), 300)]).current() == 300
    assert IntensityTimeSeries([IntensityPoint(now - timedelta(days=9), 250)]).current() == 250  # one point: constant


def test_time_series_before_its_start_is_an_error():
    series = IntensityTimeSeries([IntensityPoint(datetime.now(timezone.utc) + timedelta(days=1), 100)])
    with pytest.raises(CarbonIntensityError, match="starts at"):
        series.current()


@pytest.mark.parametrize(
    "text, message",
    [
        ("time,value\n2024-05-01T00:00Z,1\n", "row 1 must be the header"),
        ("timestamp,g_per_kwh\n2024-05-01T00:00Z,1\nyesterday,2\n", "row 3: 'yesterday' is not an ISO 8601"),
        ("timestamp,g_per_kwh\n2024-05-01T00:00Z,abc\n", "row 2: 'abc' is not a number"),
        ("timestamp,g_per_kwh\n2024-05-01T00:00Z,-5\n", "row 2: carbon intensity must be"),
        ("timestamp,g_per_kwh\n2024-05-01T01:00Z,1\n2024-05-01T00:00Z,1\n", "row 3: timestamps must increase"),
        ("timestamp,g_per_kwh\n2024-05-01T00:00Z,1,2\n", "row 2 must have 2 columns"),
        ("timestamp,g_per_kwh\n", "no data rows"),
    ],
)
def test_time_series_csv_errors_name_the_row(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        IntensityTimeSeries.from_csv(write_csv(tmp_path, text))


# Per-epoch report
def test_reporter_writes_each_epoch_and_the_totals(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", 2, clock)
    series = IntensityTimeSeries(
        [IntensityPoint(T0, 100), IntensityPoint(T0 + timedelta(seconds=10), 500)], clock=clock
    )
    report = tmp_path / "carbon.jsonl"
    reporter = CarbonReporter(Monitor(gpus=gpus, cpus=[]), series, report)
    work = Work(1.0)
    time_s, energy_j = predict("a100-sxm", work, 1410)
    for _ in range(2):
        reporter.on_epoch_begin()
        for _ in range(5):
            for gpu in gpus:
                gpu.execute(work, blocking=False)
            for gpu in gpus:
                gpu.synchronize()
        reporter.on_epoch_end()
    total = reporter.on_train_end()

    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line.get("epoch") for line in lines] == [1, 2, None]
    first, second, totals = lines
    assert first["time_s"] == pytest.approx(5 * time_s)
    assert first["energy_j"] == pytest.approx(2 * 5 * energy_j)
    # Epoch 1 runs 0..5 s at 100 g/kWh; epoch 2 runs 5..10 s, from 100 to 500 at its end.
    assert first["g_per_kwh"] == 100 and second["g_per_kwh"] == 300
    assert first["carbon_g"] == pytest.approx(first["energy_j"] / 3.6e6 * 100)
    assert totals["total"] is True and totals["epochs"] == 2
    assert totals["carbon_g"] == pytest.approx(first["carbon_g"] + second["carbon_g"])
    assert total.energy_j == pytest.approx(totals["energy_j"])


def test_a_failing_provider_loses_no_epoch_and_never_stops_training(tmp_path, monkeypatch, server, caplog):
    """Down before any reading: the epoch's energy is kept, its carbon unknown, and the totals count
    it at the first intensity read later; down later: the last intensity is reused."""
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", 1, clock)
    report = tmp_path / "carbon.jsonl"
    csv_path = tmp_path / "emissions.csv"
    reporter = CarbonReporter(
        Monitor(gpus=gpus, cpus=[]), client(server, cache_ttl_s=0), report, codecarbon_csv=csv_path
    )
    work = Work(1.0)
    epochs = []
    for mode in ("500", "ok", "500"):
        server.mode = mode
        reporter.on_epoch_begin()
        for _ in range(3):
            gpus[0].execute(work)
        epochs.append(reporter.on_epoch_end())
    total = reporter.on_train_end()

    energy = predict("a100-sxm", work, 1410)[1] * 3
    assert [e.energy_j for e in epochs] == pytest.approx([energy] * 3)
    assert epochs[0].carbon_g is None and epochs[0].g_per_kwh is None
    assert epochs[1].g_per_kwh == epochs[2].g_per_kwh == 322.0  # LATEST's value, reused while down
    assert total.energy_j == pytest.approx(3 * energy) and total.carbon_g == pytest.approx(3 * energy / 3.6e6 * 322)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # once per outage
    assert "counted then" in warnings[0] and "reusing 322 g/kWh" in warnings[1]
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert lines[0]["carbon_g"] is None and lines[-1]["carbon_g"] == pytest.approx(total.carbon_g)
    assert "emissions" in csv_path.read_text().splitlines()[0]


def test_a_provider_that_never_answers_leaves_carbon_unknown_and_the_csv_empty_there(tmp_path, monkeypatch, server):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    gpus = sim_gpus("a100-sxm", 1, VirtualClock())
    csv_path = tmp_path / "emissions.csv"
    server.mode = "500"
    reporter = CarbonReporter(Monitor(gpus=gpus, cpus=[]), client(server), codecarbon_csv=csv_path)
    reporter.on_epoch_begin()
    gpus[0].execute(Work(1.0))
    reporter.on_epoch_end()
    total = reporter.on_train_end()
    assert total.carbon_g is None and total.g_per_kwh is None and total.energy_j > 0
    import csv as csv_module

    (row,) = csv_module.DictReader(csv_path.open())
    assert row["emissions"] == "" and row["emissions_rate"] == "" and float(row["gpu_energy"]) > 0
