"""The `serve` fixture: real `perseus serve` processes, killed at the end of each test."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from server_helpers import Served


@pytest.fixture
def serve(tmp_path):
    """Start services (same state dir unless given); every one is stopped at the end."""
    started: list[Served] = []

    def start(
        state_dir: Path | None = None,
        bind: str = "tcp://127.0.0.1:0",
        full_cli: bool = False,
        extra: tuple[str, ...] = (),
    ) -> Served:
        served = Served(state_dir or tmp_path / "state", bind, full_cli, extra)
        started.append(served)
        return served

    yield start
    for served in started:
        if served.proc.poll() is None:
            served.stop(signal.SIGKILL)
