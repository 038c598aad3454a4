"""Chaos (issue 6): during a real run -- service, torchrun with 2 ranks, simulated GPUs -- kill
and restart the service three times and SIGKILL one rank once (torchrun restarts the group).
Runs benchmarks/chaos.py's scenario and its checks: no profile lost, no iteration stalled as
long as the client's timeout, the killed rank's GPU reset within 1 s, every GPU at default
clocks at the end. About 40 s: two torchrun starts and three service starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_chaos():
    spec = importlib.util.spec_from_file_location("chaos", BENCHMARKS / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_service_restarts_and_a_killed_rank_lose_no_profile_and_block_no_rank(tmp_path):
    chaos = _load_chaos()
    result = chaos.run_chaos(str(tmp_path), say=lambda _: None)
    assert chaos.check(result) == [], result
    assert result["service_kills"] == 3 and result["attempts"] == 2
    assert all(o["iterations_trained"] >= 3 for o in result["outages"])  # training went on without the service
