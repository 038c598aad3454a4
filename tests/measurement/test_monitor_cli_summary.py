"""`perseus monitor`'s text summary: each device's energy and average power, then the sums,
the summed power labelled with what it sums (an outsider read 402.7 W over 2 GPUs as one GPU's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from perseus.cli.monitor import _print_summary
from perseus.measurement import Measurement


def test_a_real_run_shows_each_gpu_and_labels_the_sum(tmp_path):
    env = {**os.environ, "PERSEUS_GPU": "sim:a100-sxm:2", "PERSEUS_SIM_DIR": str(tmp_path / "sim")}
    work = "from perseus.devices import Work, emulate, get_gpus; emulate(get_gpus(), Work(0.3))"
    result = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "monitor", "--", sys.executable, "-c", work],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    time_s = float(re.search(r"time\s+([\d.]+) s", result.stderr).group(1))
    gpus = re.findall(r"GPU (\d)\s+([\d.]+) J\s+average\s+([\d.]+) W", result.stderr)
    assert [g[0] for g in gpus] == ["0", "1"]
    for _, joules, watts in gpus:
        # time is printed to 1 ms: over a run of about 0.3 s that alone moves J / time by up to 0.2%
        assert float(watts) == pytest.approx(float(joules) / time_s, rel=0.005)
    total = re.search(r"average power\s+([\d.]+) W \(all GPUs\)", result.stderr)
    assert total is not None, result.stderr
    assert float(total.group(1)) == pytest.approx(sum(float(w) for _, _, w in gpus), abs=0.3)


def test_cpus_and_dram_are_named_in_the_sum(capsys):
    m = Measurement(2.0, {0: 600.0, 1: 500.0}, cpu_energy_j={0: 200.0}, dram_energy_j={0: 40.0})
    _print_summary(m, ["train"], 0)
    err = capsys.readouterr().err
    for device, joules, watts in (("GPU 1", 500, 250), ("CPU 0", 200, 100), ("DRAM 0", 40, 20)):
        assert re.search(rf"{device}\s+{joules}.0 J\s+average\s+{watts}.0 W", err), (device, err)
    assert re.search(r"average power\s+670.0 W \(sum of 2 GPUs \+ 1 CPU \+ 1 DRAM\)", err), err
