"""The promise on measured time, for a client written as an outsider: outsider_pipeline.py (public
API only) under torchrun, 4 ranks on gloo, simulated A100s, a real `perseus serve`.

For each of torch's six pipeline schedules: the service calibrates its model on the job's own
baseline timeline (it must reproduce the measured baseline iteration within 1%), plans, and the
planned iterations (median of the last 20 or more on the final plan) take at most 2% longer than
the baseline measured on the same run (median of the iterations at default clocks), for a
measured energy saving of at least 5%. A plan made wrong on purpose (a GPU throttled after
planning) is warned about and corrected; a script that emulates no GPU work gets no plan and a
clear warning. Slow by nature: one torchrun job per case (CI runs them).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from perseus.demo.processes import ServiceProcess, log_tail
from perseus.devices.sim import SimGPU

CLIENT = Path(__file__).with_name("outsider_pipeline.py")
RANKS = 4
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
MIN_PLANNED = 20


@dataclass
class Run:
    """One job: every rank's iteration records, the service's status of the job and its log."""

    ranks: list[list[dict]]
    status: dict
    log: str
    job_log: str

    def iterations(self, phases: set[str]) -> list[tuple[float, float, int]]:
        """(time: the slowest rank's, energy: summed over ranks, plan version) of each iteration
        every rank ran in one of `phases`, after the first."""
        out = []
        for records in zip(*self.ranks):
            if records[0]["iteration"] == 0 or any(r["phase"] not in phases for r in records):
                continue
            versions = {r["plan_version"] for r in records}
            out.append((max(r["time_s"] for r in records), sum(r["energy_j"] for r in records), max(versions)))
        return out

    def baseline(self) -> tuple[float, float]:
        rows = self.iterations({"warmup", "planning"})
        assert len(rows) >= 6, f"only {len(rows)} baseline iterations"
        return statistics.median(t for t, _, _ in rows), statistics.median(e for _, e, _ in rows)

    def planned(self) -> tuple[float, float, int]:
        """Medians over the planned iterations on the final plan version, and how many."""
        rows = self.iterations({"planned"})
        assert rows, "no planned iteration:\n" + self.log[-3000:]
        final = rows[-1][2]
        rows = [row for row in rows if row[2] == final]
        return statistics.median(t for t, _, _ in rows), statistics.median(e for _, e, _ in rows), len(rows)


def run_client(tmp_path: Path, schedule: str, *args: str, throttle: tuple[int, float] | None = None) -> Run:
    """Run outsider_pipeline.py with `schedule` against a fresh service; with `throttle` (rank,
    factor), that rank's GPU is slowed that much once its first plan arrives."""
    state, out, sim = tmp_path / "state", tmp_path / "out", tmp_path / "sim"
    service = ServiceProcess(str(state), str(tmp_path / "service.log"))
    address = service.start()
    env = {
        **os.environ,
        "PERSEUS_GPU": f"sim:a100-sxm:{RANKS}",
        "PERSEUS_SIM_DIR": str(sim),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)]
    cmd += [str(CLIENT), "--schedule", schedule, "--out", str(out), "--planner", address, *args]
    job_log = tmp_path / "job.log"
    try:
        with open(job_log, "wb") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if throttle is not None:
                _throttle_once_planned(job, tmp_path, address, *throttle)
            job.wait(timeout=600)
        status = _status(address)
    finally:
        service.stop()
    text = job_log.read_text(errors="replace")
    assert job.returncode == 0, text[-4000:] + log_tail(str(tmp_path / "service.log"))
    ranks = [json.loads((out / f"rank{r}.json").read_text())["iterations"] for r in range(RANKS)]
    for i in range(RANKS):
        assert not os.path.exists(SimGPU("a100-sxm", i, state_dir=str(sim)).state_path), "a GPU left at a low clock"
    return Run(ranks, status, (tmp_path / "service.log").read_text(errors="replace"), text)


def _status(address: str) -> dict:
    """`perseus status --json` of the service: its one job."""
    out = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "status", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    jobs = json.loads(out.stdout)["jobs"]
    assert len(jobs) == 1
    return jobs[0]


def _throttle_once_planned(job: subprocess.Popen, tmp_path: Path, address: str, rank: int, factor: float) -> None:
    """Wait until the service has published a plan and seen it hold (or not), then throttle `rank`'s GPU."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and job.poll() is None:
        status = _status(address)
        pipelines = status.get("pipelines") or [{}]
        if pipelines[0].get("verification") in ("holds", "replanning"):
            SimGPU("a100-sxm", rank, state_dir=str(tmp_path / "sim")).set_slowdown(factor)
            return
        time.sleep(0.5)
    raise AssertionError("no plan was verified before the job ended")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_planned_iterations_keep_the_measured_baseline(tmp_path, schedule):
    run = run_client(tmp_path, schedule)
    (calibration,) = run.status["calibrations"]
    assert calibration["state"] == "fitted", calibration
    error = calibration["model_s"] / calibration["measured_s"] - 1
    assert abs(error) <= 0.01, calibration
    assert len(calibration["stages"]) == RANKS
    base_time, base_energy = run.baseline()
    time_s, energy_j, count = run.planned()
    assert count >= MIN_PLANNED, f"{count} planned iterations on the final plan"
    assert time_s <= base_time * 1.02, (
        f"{schedule}: planned {time_s:.4f} s against the baseline {base_time:.4f} s "
        f"({100 * (time_s / base_time - 1):+.1f}%)\n" + run.log[-3000:]
    )
    assert energy_j <= base_energy * 0.95, (
        f"{schedule}: planned {energy_j:.1f} J against the baseline {base_energy:.1f} J "
        f"({100 * (energy_j / base_energy - 1):+.1f}%)"
    )
    assert "model calibrated" in run.log and "planned at plan v" in run.job_log


@pytest.mark.slow
def test_a_plan_made_wrong_is_warned_about_and_corrected(tmp_path):
    """Rank 0's GPU throttled by 15% after planning: the stage the plan slowed most has its slack
    used up, so the plan runs over; the service warns, re-plans with a margin, and the planned
    iterations come back within the tolerance of the (throttled stage's) maximum-clock pace."""
    run = run_client(tmp_path, "Schedule1F1B", "--planned", "40", throttle=(0, 1.15))
    assert "WARNING" in run.log and "re-planning" in run.log, run.log[-3000:]
    (pipeline,) = run.status["pipelines"]
    assert pipeline["replans"] >= 1 and pipeline["verification"] in ("holds", "fallback"), pipeline
    assert pipeline["verified_iteration_time_s"] <= pipeline["target_iteration_time_s"] * 1.01 or (
        pipeline["verification"] == "fallback"
    ), pipeline


@pytest.mark.slow
def test_no_emulated_gpu_work_gets_no_plan_and_a_clear_warning(tmp_path):
    run = run_client(tmp_path, "Schedule1F1B", "--work-ms", "0", "--max-iterations", "60", "--planned", "5")
    assert "ran no work on its simulated GPU" in run.job_log
    assert run.status["phase"] == "failed" and "explains only" in run.status["error"], run.status
    assert "no plan" in run.log
    assert not run.iterations({"planned"})
