"""Two real ranks (torchrun, gloo on CPU) agree on one power limit.

Takes a few seconds: two processes import torch and join a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from perseus.power_limit import MaxSlowdownConstraint, PowerLimitMeasurement, SelectionContext

pytest.importorskip("torch.distributed")
WORKER = os.path.join(os.path.dirname(__file__), "dp_worker.py")


@pytest.mark.slow
def test_ranks_sum_energy_max_time_and_apply_one_limit(tmp_path):
    env = dict(os.environ, PERSEUS_SIM_DIR=str(tmp_path / "sim"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    local = [[PowerLimitMeasurement(*row) for row in r["local"]] for r in ranks]
    combined = [
        PowerLimitMeasurement(a.power_limit_mw, max(a.time_s, b.time_s), a.energy_j + b.energy_j)
        for a, b in zip(*local)
    ]
    for r in ranks:
        got = [PowerLimitMeasurement(*row) for row in r["global"]]
        assert [m.power_limit_mw for m in got] == [m.power_limit_mw for m in combined]
        for g, c in zip(got, combined):
            assert g.time_s == pytest.approx(c.time_s, rel=1e-12)
            assert g.energy_j == pytest.approx(c.energy_j, rel=1e-12)
        assert r["num_gpus"] == 2

    selector = MaxSlowdownConstraint(1.1)
    alone = [selector.select(m, SelectionContext(400_000, 1)) for m in local]
    assert alone[0] != alone[1]  # each rank alone would choose differently...
    together = selector.select(combined, SelectionContext(400_000, 2))
    assert [r["selected_mw"] for r in ranks] == [together, together]  # ...but both apply the global choice
    assert [r["applied_mw"] for r in ranks] == [together, together]
    assert [r["after_close_mw"] for r in ranks] == [400_000, 400_000]

    profile = json.loads((tmp_path / "profile.json").read_text())  # written once, by rank 0
    assert profile["num_gpus"] == 2 and len(profile["measurements"]) == len(combined)
