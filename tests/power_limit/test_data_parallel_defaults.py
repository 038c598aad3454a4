"""Data parallelism as a new user meets it, with two real ranks (torchrun, gloo on CPU): each rank
takes its own GPU by default, the sweep stops early and chooses what the full sweep chooses, and a
simulated GPU's sync waits for work another object queued. See dp_rank_worker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")
WORKER = os.path.join(os.path.dirname(__file__), "dp_rank_worker.py")


def torchrun(tmp_path, mode, **env):
    env = dict(os.environ, PERSEUS_SIM_DIR=str(tmp_path / "sim"), OMP_NUM_THREADS="1", **env)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            WORKER,
            mode,
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_each_rank_takes_its_own_gpu_and_waits_for_work_another_object_queued(tmp_path):
    proc, ranks = torchrun(tmp_path, "defaults", PERSEUS_GPU="sim:a100-sxm:2")
    for local, r in enumerate(ranks):
        assert r["monitor_gpus"] == [local] and r["optimizer_gpus"] == [local]
        assert r["num_gpus"] == 2  # one GPU per rank, not every GPU in every rank
        # The Monitor's sync waited for 3 x 50 ms queued through another SimGPU object: the
        # window holds all of it (before the fix: 4-11 ms).
        sync = r["sync"]
        assert sync["time_s"] >= sync["work_time_s"]
        assert sync["energy_j"] >= sync["work_energy_j"]
    assert ranks[0]["selected_mw"] == ranks[1]["selected_mw"] == ranks[0]["applied_mw"] == ranks[1]["applied_mw"]
    assert ranks[0]["skipped_mw"] == ranks[1]["skipped_mw"]
    # One line for the user, from rank 0 alone, with no logging set up.
    lines = [line for line in proc.stderr.splitlines() if "perseus: power limit" in line]
    assert len(lines) == 1 and "for 2 GPU(s)" in lines[0], proc.stderr[-3000:]
    assert "the same GPU" not in proc.stderr


@pytest.mark.slow
def test_two_ranks_on_one_gpu_are_warned_about(tmp_path):
    """One simulated GPU for two ranks: both take it (one visible GPU is a rank's own, as with a
    CUDA_VISIBLE_DEVICES per rank), and each would count all its energy; rank 0 says so."""
    proc, ranks = torchrun(tmp_path, "shared", PERSEUS_GPU="sim:a100-sxm:1")
    assert [r["optimizer_gpus"] for r in ranks] == [[0], [0]]
    assert "ranks 0 and 1 measure and cap the same GPU" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_sweep_stops_early_and_both_ranks_choose_what_the_full_sweep_chooses(tmp_path):
    _, ranks = torchrun(tmp_path, "sweep")
    assert ranks[0].keys() == ranks[1].keys()
    for case in ranks[0]:
        full = [r[case]["full"] for r in ranks]
        early = [r[case]["early"] for r in ranks]
        assert full[0]["selected_mw"] == full[1]["selected_mw"], case  # one choice for the job
        assert early[0]["selected_mw"] == early[1]["selected_mw"] == full[0]["selected_mw"], case
        assert (
            early[0]["measured_mw"] == early[1]["measured_mw"] == full[0]["measured_mw"][: len(early[0]["measured_mw"])]
        )
        assert early[0]["skipped_mw"] == full[0]["measured_mw"][len(early[0]["measured_mw"]) :], case
        assert all(e["steps"] <= f["steps"] and e["energy_j"] <= f["energy_j"] for e, f in zip(early, full)), case
    # The benchmark's own case: memory-bound steps, at most 10% slower.
    case = ranks[0]["alpha 0.3 / MaxSlowdownConstraint(1.1)"]
    assert case["early"]["skipped_mw"] == [150_000, 125_000, 100_000]  # 200 and 175 W: too slow
    assert case["early"]["steps"] == 10 * 7 and case["full"]["steps"] == 13 * 7
    mixed = ranks[0]["mixed 0.3/0.9 / MaxSlowdownConstraint(1.1)"]
    assert len(mixed["early"]["skipped_mw"]) > 0
