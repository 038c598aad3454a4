"""`perseus demo` runs its ranks' clock changes through a perseus agent the launcher starts: each
rank leases its own GPU, and every GPU is back at defaults once their leases end."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

pytest.importorskip("torch")

from perseus.demo import launcher
from perseus.demo.launcher import DemoOptions, demo_config, run_demo
from perseus.devices.sim import SimGPU

RANKS = 2


@pytest.mark.slow
def test_the_demo_changes_clocks_through_its_agent(monkeypatch):
    # Room for a loaded machine's slow planning, as tests/e2e/test_demo.py gives it.
    monkeypatch.setattr(
        launcher, "demo_config", lambda *a, **k: dataclasses.replace(demo_config(*a, **k), max_iterations=600)
    )
    options = DemoOptions(
        # GPU work long enough for the service's calibration to fit on a loaded machine (see test_demo.py).
        ranks=RANKS,
        microbatches=4,
        iterations=2,
        sweep_step=8,
        time_scale=0.15,
        timeout_s=600,
        keep_dir=True,
    )
    said: list[str] = []
    result = run_demo(options, said.append)
    work = result["work_dir"]
    try:
        assert result["clocks_reset"] is True
        assert any(line.startswith("perseus agent (pid ") for line in said)
        assert "perseus agent: the ranks' leases ended; GPUs at defaults: yes" in said
        with open(os.path.join(work, "agent.log")) as f:
            log = f.read()
        for index in range(RANKS):
            uuid = SimGPU("a100-sxm", index).uuid()
            assert f"GPU {index} ({uuid}) leased to pid" in log  # the rank on GPU index took it
            assert f"GPU {index} ({uuid}) of pid" in log  # and its lease ended, the GPU reset
        assert "perseus.demo.worker" in log
        assert log.count("the holder exited or was killed (its connection closed)") >= RANKS
    finally:
        shutil.rmtree(work, ignore_errors=True)
