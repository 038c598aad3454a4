"""The promise on measured time, closed loop: each torch schedule, planned and verified on a real run.

    python benchmarks/closed_loop.py [--schedules Schedule1F1B,...] [--planned 30]

For each schedule, a real `perseus serve` and examples/pipeline_emulated.py under torchrun (4
ranks, gloo, simulated A100s, forward 6 ms and backward 12 ms of GPU work at the highest clock,
the later half of the ranks 25% heavier, 8 microbatches). The service calibrates its model on
the job's own baseline timeline, plans, and checks the plan on the measured iterations. Printed
side by side per schedule: the baseline measured on the same run (the iterations at default
clocks, before the plan and once Perseus is closed after it: the median of the slowest rank's
time, the mean of all ranks' energy) against the planned iterations on the final plan (the
same), the model's
fit (the calibrated model against the measured baseline, and the GPU-only profile's share of
it), the saving the plan predicts, and the re-plans verification made. Exits 1 if a schedule's
planned iterations run over 2% slower than its baseline or save under 5% of its energy.

Simulated GPUs are ideal here by default (`--sim-mode`): a realistic one takes 10-30 ms to
change clocks, longer than one instruction, so its plans change clocks only between runs of
instructions that last that long (perseus.planner.switches). Wall-clock
figures: a machine shared with other jobs stretches host work and makes them noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "examples" / "pipeline_emulated.py"
RANKS = 4
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
MAX_SLOWDOWN = 0.02
MIN_SAVING = 0.05
SKIP = 3  # iterations at a window's start left out of a paired comparison (the switch), as verification does
PAIRED = 10  # plan iterations compared with the reference window before them


@dataclass
class Run:
    """One job: every rank's iteration records, the service's status of the job and its log."""

    ranks: list[list[dict]]
    status: dict
    log: str
    job_log: str
    gpus_at_default: bool

    def iterations(self, phases: set[str]) -> list[tuple[float, float, int]]:
        """(time: the slowest rank's, energy: summed over ranks, plan version) of each iteration
        every rank ran in one of `phases`, after the first."""
        out = []
        for records in zip(*self.ranks):
            if records[0]["iteration"] == 0 or any(r["phase"] not in phases for r in records):
                continue
            version = max(r["plan_version"] for r in records)
            out.append((max(r["time_s"] for r in records), sum(r["energy_j"] for r in records), version))
        return out

    def baseline(self) -> tuple[float, float, int]:
        """Median time and mean energy over the iterations at default clocks without profiling,
        before the plan and after Perseus closed (on either side of the planned ones), and how many."""
        rows = self.iterations({"warmup", "planning", "after"})
        if not rows:
            return float("nan"), float("nan"), 0
        return statistics.median(t for t, _, _ in rows), statistics.fmean(e for _, e, _ in rows), len(rows)

    def planned(self) -> tuple[float, float, int]:
        """Median time and mean energy over the planned iterations on the final plan version, and how many."""
        rows = self.iterations({"planned"})
        if not rows:
            return float("nan"), float("nan"), 0
        rows = [row for row in rows if row[2] == rows[-1][2]]
        return statistics.median(t for t, _, _ in rows), statistics.fmean(e for _, e, _ in rows), len(rows)

    def paired(self) -> tuple[float, float, int]:
        """Planned against maximum clocks side by side: each verification reference window (phase
        "reference": maximum clocks for a window while the plan runs) against the plan window
        right after it, less each window's first SKIP iterations (the switch). The mean time
        change and energy saving over those pairs, and how many; a machine whose speed drifts
        over minutes moves both windows of a pair alike."""
        windows: dict[int, list[tuple[float, float]]] = {}
        references = set()
        for phase in ("planned", "reference"):
            for time_s, energy_j, version in self.iterations({phase}):
                windows.setdefault(version, []).append((time_s, energy_j))
                if phase == "reference":
                    references.add(version)
        versions = sorted(windows)
        changes, savings = [], []
        for reference, plan in zip(versions, versions[1:]):
            ref, planned = windows[reference][SKIP:], windows[plan][SKIP : SKIP + PAIRED]
            if reference not in references or plan in references or not ref or not planned:
                continue
            changes.append(statistics.median(t for t, _ in planned) / statistics.median(t for t, _ in ref) - 1)
            savings.append(1 - statistics.fmean(e for _, e in planned) / statistics.fmean(e for _, e in ref))
        if not changes:
            return float("nan"), float("nan"), 0
        return statistics.fmean(changes), statistics.fmean(savings), len(changes)

    @property
    def calibration(self) -> dict:
        calibrations = self.status.get("calibrations") or [{}]
        return calibrations[0]

    @property
    def pipeline(self) -> dict:
        pipelines = self.status.get("pipelines") or [{}]
        return pipelines[0]


def run_job(
    work: Path, schedule: str, *args: str, throttle: tuple[int, float] | None = None, sim_mode: str = "ideal"
) -> Run:
    """Run the client with `schedule` against a fresh service, in folder `work` (an earlier run's
    there is replaced: its service state would resume its job), on simulated GPUs in `sim_mode`
    (perseus.devices.sim_realism); with `throttle` (rank, factor), that rank's GPU is slowed that
    much once the service has checked the plan."""
    from perseus.demo.processes import ServiceProcess, log_tail
    from perseus.devices.sim import SimGPU

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out, sim, service_log, job_log = work / "out", work / "sim", work / "service.log", work / "job.log"
    service = ServiceProcess(str(work / "state"), str(service_log))
    address = service.start()
    env = {
        **os.environ,
        "PERSEUS_GPU": f"sim:a100-sxm:{RANKS}",
        "PERSEUS_SIM_DIR": str(sim),
        "PERSEUS_SIM_MODE": sim_mode,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)]
    cmd += [str(CLIENT), "--schedule", schedule, "--out", str(out), "--planner", address, *args]
    try:
        with open(job_log, "wb") as log:
            job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            if throttle is not None:
                _throttle_once_checked(job, address, sim, *throttle)
            job.wait(timeout=900)
        status = job_status(address)
    finally:
        service.stop()
    text = job_log.read_text(errors="replace")
    if job.returncode != 0:
        raise RuntimeError(f"the job failed ({job.returncode}):\n{text[-4000:]}\n{log_tail(str(service_log))}")
    ranks = [json.loads((out / f"rank{r}.json").read_text())["iterations"] for r in range(RANKS)]
    at_default = all(not os.path.exists(SimGPU("a100-sxm", i, state_dir=str(sim)).state_path) for i in range(RANKS))
    return Run(ranks, status, service_log.read_text(errors="replace"), text, at_default)


def job_status(address: str) -> dict:
    """`perseus status --json` of the service: its one job ({} before it registers)."""
    out = subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", "status", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"perseus status failed: {out.stderr}")
    jobs = json.loads(out.stdout)["jobs"]
    if len(jobs) > 1:
        raise RuntimeError(f"{len(jobs)} jobs on a service started for one")
    return jobs[0] if jobs else {}


def _throttle_once_checked(job: subprocess.Popen, address: str, sim: Path, rank: int, factor: float) -> None:
    from perseus.devices.sim import SimGPU

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and job.poll() is None:
        pipelines = job_status(address).get("pipelines") or [{}]
        if pipelines[0].get("verified_iteration_time_s") is not None:  # a window of the plan was checked
            SimGPU("a100-sxm", rank, state_dir=str(sim)).set_slowdown(factor)
            return
        time.sleep(0.5)
    raise RuntimeError("no plan was checked before the job ended")


def summary(schedule: str, run: Run) -> tuple[str, bool]:
    """One table row, and whether the schedule meets the targets."""
    base_t, base_e, base_n = run.baseline()
    time_s, energy_j, count = run.planned()
    c = run.calibration
    fit = (c["model_s"] / c["measured_s"] - 1) if c.get("model_s") and c.get("measured_s") else float("nan")
    explained = c.get("explained") or float("nan")
    predicted = run.status.get("predicted_energy_j"), run.status.get("predicted_baseline_energy_j")
    saving_p = 1 - predicted[0] / predicted[1] if all(predicted) else float("nan")
    slowdown, saving = time_s / base_t - 1, 1 - energy_j / base_e
    ok = slowdown <= MAX_SLOWDOWN and saving >= MIN_SAVING
    paired_time, paired_saving, pairs = run.paired()
    row = (
        f"{schedule:<30} {base_t:8.4f} {time_s:8.4f} {100 * slowdown:+6.1f}% {base_e:7.1f} {energy_j:7.1f} "
        f"{100 * saving:5.1f}% {100 * saving_p:5.1f}% {100 * fit:+6.2f}% {100 * explained:4.0f}% "
        f"{run.pipeline.get('replans', 0):>3} {base_n:>4} {count:>4} "
        f"{100 * paired_time:+6.1f}% {100 * paired_saving:5.1f}% {pairs:>2}  {'ok' if ok else 'MISSED'}"
    )
    return row, ok


HEADER = (
    f"{'schedule':<30} {'base_s':>8} {'plan_s':>8} {'time':>7} {'base_J':>7} {'plan_J':>7} {'saved':>6} "
    f"{'pred':>6} {'fit':>7} {'gpu':>5} {'re':>3} {'nb':>4} {'np':>4} {'r_time':>7} {'r_sav':>6} {'rp':>2}"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument(
        "--planned",
        type=int,
        default=40,
        help="iterations on the final plan (default 40: verification decides after 23)",
    )
    parser.add_argument("--work-dir", default=None, help="keep each run's logs and records here")
    parser.add_argument("--sim-mode", choices=("ideal", "realistic"), default="ideal", help="simulated GPUs' realism")
    args = parser.parse_args()
    import tempfile

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="perseus-closed-loop-"))
    rows, all_ok = [], True
    for schedule in args.schedules.split(","):
        start = time.monotonic()
        run = run_job(root / schedule, schedule, "--planned", str(args.planned), sim_mode=args.sim_mode)
        row, ok = summary(schedule, run)
        all_ok &= ok and run.gpus_at_default
        rows.append(row)
        print(f"{row}  ({time.monotonic() - start:.0f} s)", flush=True)
    print()
    print(f"simulated A100s ({args.sim_mode});")
    print("baseline and planned: median of the slowest rank's iteration time, mean of all ranks' energy (an energy")
    print("counter that steps every 100 ms makes one iteration's reading jump by a step: a median would be biased);")
    print("time, saved: planned against baseline; pred: the plan's predicted saving; fit: the calibrated model")
    print("against the measured baseline; gpu: the GPU profile's share of it; re: re-plans; nb, np: iterations;")
    print("r_time, r_sav: the plan window right after each of verification's reference windows (maximum clocks,")
    print("minutes apart from the baseline at most seconds) against that window, averaged over rp such pairs")
    print(HEADER)
    print("\n".join(rows))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
