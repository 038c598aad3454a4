"""GPU metrics: a Monitor's GPUs on a real /metrics endpoint, in process (simulated GPUs on a
virtual clock, so energies are exact) and from `perseus monitor --prometheus-port`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import free_port  # tests/server, on the path by conftest.py

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.measurement import Monitor
from perseus.metrics.collectors import FAMILIES, GPUCollector, exported_metrics
from perseus.metrics.exporter import start_metrics_server


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def parse(text: str) -> dict[tuple[str, str], float]:
    """(sample name, gpu label) -> value, checking the dcgm-exporter labels on the way."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert set(s.labels) == {"gpu", "UUID", "modelName"}, s
            samples[(s.name, s.labels["gpu"])] = s.value
    return samples


def scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def test_energy_power_clock_and_limit_of_each_gpu():
    clock = VirtualClock()
    gpus = sim_gpus("a100-sxm", 2, clock)
    monitor = Monitor(gpus=gpus, cpus=[])
    server = start_metrics_server([GPUCollector(monitor)], 0)
    try:
        monitor.begin_window("check")
        gpus[1].set_power_limit_mw(250_000)
        for gpu in gpus:
            gpu.execute(Work(0.5, alpha=0.7))
        first = scrape(server.url)
        gpus[0].execute(Work(0.25, alpha=0.7))
        clock.advance(0.25)  # GPU 1 idles meanwhile
        second = scrape(server.url)
        m = monitor.end_window("check")
    finally:
        server.close()
    for i in ("0", "1"):
        assert second[("perseus_gpu_energy_joules_total", i)] == pytest.approx(m.gpu_energy_j[int(i)], rel=1e-9)
        assert 0 < first[("perseus_gpu_energy_joules_total", i)] < second[("perseus_gpu_energy_joules_total", i)]
    assert second[("perseus_gpu_power_limit_watts", "0")] == 400.0
    assert second[("perseus_gpu_power_limit_watts", "1")] == 250.0
    assert second[("perseus_gpu_sm_clock_hertz", "0")] == gpus[0].sm_clock() * 1e6
    assert second[("perseus_gpu_power_watts", "1")] == pytest.approx(gpus[1].power_mw() / 1000)
    gpu_families = {n for n in FAMILIES if n.startswith("perseus_gpu_")}
    names = {name for name, _ in second}
    assert names <= exported_metrics()
    assert {n for n in gpu_families if any(s.startswith(n) for s in names)} == gpu_families


def test_perseus_monitor_serves_metrics_while_the_command_runs(tmp_path):
    port = free_port()
    command = textwrap.dedent(
        f"""
        import urllib.request
        print(urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
        """
    )
    env = {**os.environ, "PERSEUS_GPU": "sim:a100-sxm:2", "PERSEUS_SIM_DIR": str(tmp_path / "sim")}
    proc = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "monitor", "--prometheus-port", str(port), "--", sys.executable]
        + ["-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"metrics on http://127.0.0.1:{port}/metrics" in proc.stderr
    samples = parse(proc.stdout)
    assert samples[("perseus_gpu_power_limit_watts", "1")] == 400.0
    assert samples[("perseus_gpu_energy_joules_total", "0")] > 0  # idle power over the command's start-up


@pytest.mark.parametrize(
    "port, host, message",
    [
        (-1, "127.0.0.1", "metrics port must be 0"),
        (70000, "127.0.0.1", "metrics port must be 0"),
        (0, "my host", "metrics host must be an IP address"),
    ],
)
def test_bad_ports_and_hosts_are_clear_errors(port, host, message):
    monitor = Monitor(gpus=sim_gpus("a100-sxm", 1, VirtualClock()), cpus=[])
    with pytest.raises(ConfigError, match=message):
        start_metrics_server([GPUCollector(monitor)], port, host)
