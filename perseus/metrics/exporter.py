"""Serve `/metrics` over HTTP with prometheus-client's own server, on a registry of our collectors."""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from perseus.exceptions import ConfigError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # loopback unless asked: the figures name jobs and GPUs


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint; `port` is the real one (0 asks for a free port)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(collectors: Sequence[Any], port: int, host: str = DEFAULT_HOST) -> MetricsServer:
    """Serve the collectors' families on http://host:port/metrics from a daemon thread."""
    from perseus.metrics import (
        collectors as prometheus,
    )  # raises ConfigError naming the extra if prometheus-client is missing

    registry = prometheus.CollectorRegistry(auto_describe=False)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"the metrics port must be 0 (any free port) to 65535, got {port!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(
                f"the metrics host must be an IP address (e.g. 127.0.0.1 or 0.0.0.0), got {host!r}"
            ) from None
    for collector in collectors:
        registry.register(collector)
    try:
        server, thread = prometheus.start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}; pick another port") from None
    served = MetricsServer(host, server.server_port, server, thread)
    log.info("Prometheus metrics on %s", served.url)
    return served
