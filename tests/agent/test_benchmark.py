"""benchmarks/agent.py at a small size: it measures both paths and prints them side by side (its
speed targets are the benchmark's to judge, not this test's)."""

from __future__ import annotations

import re

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.slow
def test_the_agent_benchmark_prints_both_paths(capsys):
    bench = load_benchmark("agent")
    bench.main(["--instructions", "2000", "--calls", "20", "--kills", "1"])
    out = capsys.readouterr().out
    number = r"\s+\d+\.\d+"
    for name in ("controller.before_instruction, direct", "controller.before_instruction, agent"):
        assert re.search(re.escape(name) + number + number, out), out
    for name in ("apply_now", "lock_sm_clock", "set_power_limit_mw"):
        assert re.search(rf"{name} direct{number}{number}", out) and re.search(rf"{name} agent{number}{number}", out)
    # Through the agent a killed or stopped rank's GPU comes back; the direct path's comes back only
    # while its watchdog lives.
    assert re.search(r"agent: rank's process group SIGKILLed" + number + number, out), out
    assert re.search(r"agent: rank SIGSTOPped \(heartbeat timeout 1 s\)" + number + number, out), out
    assert re.search(r"direct \+ watchdog: rank's process group SIGKILLed" + number + number, out), out
    assert re.search(r"direct \+ watchdog: rank and watchdog SIGKILLed\s+never\s+never\s+\(1 of 1 left locked", out)
