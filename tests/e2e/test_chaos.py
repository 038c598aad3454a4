"""Chaos (issue 6): during a real run -- service, torchrun with 2 ranks, simulated GPUs -- kill
and restart the service three times and SIGKILL one rank once (torchrun restarts the group).
Runs benchmarks/chaos.py's scenario and its checks: no profile lost, the killed rank's GPU
reset, every GPU at default clocks at the end, and no rank waiting on the dead service. About
40 s: two torchrun starts and three service starts.

The benchmark's two wall-clock targets -- no iteration stalled as long as the client's timeout,
the killed rank's GPU reset within 1 s -- are left to `python benchmarks/chaos.py`: a loaded
machine stretches any one iteration or the watchdog's reaction past them. In their place, a
rank that waited on the dead service would stall every iteration of an outage by the client's
timeout, so the median stall over the outages must stay well under it."""

from __future__ import annotations

import statistics

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("torch")


def stalls_during_outages(records, outages: list[dict]) -> list[float]:
    """Each iteration that overlapped an outage: its time over the median of its phase (per
    attempt and rank), as benchmarks/chaos.py's `figures` measures stalls."""
    stalls = []
    for attempt in records.attempts():
        for rank in range(2):
            rows = records.of(attempt, rank)[1:]  # the first iteration of a (re)start warms up
            for phase in {r["phase"] for r in rows}:
                same = [r for r in rows if r["phase"] == phase]
                median = statistics.median(r["end"] - r["start"] for r in same)
                stalls += [
                    r["end"] - r["start"] - median
                    for r in same
                    if any(o["killed"] < r["end"] and r["start"] < o["back"] for o in outages)
                ]
    return stalls


@pytest.mark.slow
def test_service_restarts_and_a_killed_rank_lose_no_profile_and_block_no_rank(tmp_path, monkeypatch):
    chaos = load_benchmark("chaos")
    seen = {}
    figures = chaos.figures

    def keep(records, state_dir, sim_dir, outages, *rest):
        seen.update(records=records, outages=outages)
        return figures(records, state_dir, sim_dir, outages, *rest)

    monkeypatch.setattr(chaos, "figures", keep)
    result = chaos.run_chaos(str(tmp_path), say=lambda _: None)
    # Every check but the two wall-clock targets (see the module docstring).
    log = (tmp_path / "service.log").read_text(errors="replace").splitlines()
    warnings = [line for line in log if "WARNING" in line or "profiled on" in line]  # why, if it fails
    assert chaos.check({**result, "max_stall_s": 0.0, "killed_rank_gpu_reset_s": 0.0}) == [], (result, warnings)
    assert result["service_kills"] == 3 and result["attempts"] == 2
    assert all(o["iterations_trained"] >= 3 for o in result["outages"])  # training went on without the service
    stalls = stalls_during_outages(seen["records"], seen["outages"])
    assert len(stalls) >= 9 and statistics.median(stalls) < result["client_timeout_s"] / 2, stalls
