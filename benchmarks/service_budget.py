"""The service's memory per job, measured against the estimate its budget admits jobs by.

    python benchmarks/service_budget.py

For jobs of several shapes (stages, data-parallel pipelines, microbatches), builds the job as
the service holds it -- schedule built, every rank registered, every stage profiled, 300
measured iterations reported by every rank, its record and status made -- and prints
tracemalloc's peak next to `perseus.service.budget.job_cost_bytes`. The estimate should stay
above the measurement (ratio >= 1) so that the memory budget is an upper bound.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_support import PRESET, stage_profile

from perseus.service.budget import job_cost_bytes
from perseus.service.job import Job
from perseus.wire.messages import ReportIteration
from perseus.wire.spec import JobSpec, RankInfo

SHAPES = [(1, 1, 1), (4, 1, 8), (8, 1, 96), (4, 64, 8), (4, 512, 8), (64, 1, 8), (1, 1, 4096), (16, 1, 256)]
ITERATIONS = 300


def measure(pp: int, dp: int, microbatches: int) -> tuple[int, int]:
    """(measured peak bytes, estimated bytes) of one job."""
    spec = JobSpec(pp * dp, pp, dp=dp, schedule_name="1f1b", num_microbatches=microbatches, gpu_model=PRESET.name)
    gc.collect()
    tracemalloc.start()
    job = Job(spec)
    for rank in range(pp * dp):
        job.add_rank(
            RankInfo(rank, rank % pp, dp_index=rank // pp, gpu_model=PRESET.name, frequencies=PRESET.frequencies)
        )
    for stage in range(pp):
        job.add_profile(stage, stage, stage_profile(stage, pp))
    for iteration in range(ITERATIONS):
        for rank in range(pp * dp):
            job.record(ReportIteration(job.job_id, rank, iteration, 1.0, 100.0, compute_time_s=1.0))
    job.to_record()
    job.status()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, job_cost_bytes(spec)


def main() -> int:
    print(
        f"{'stages':>6} {'pipelines':>9} {'microbatches':>12} {'ranks':>6} "
        f"{'measured KiB':>13} {'estimate KiB':>13} {'estimate/measured':>18}"
    )
    worst = float("inf")
    for pp, dp, microbatches in SHAPES:
        measured, estimate = measure(pp, dp, microbatches)
        worst = min(worst, estimate / measured)
        print(
            f"{pp:>6} {dp:>9} {microbatches:>12} {pp * dp:>6} "
            f"{measured / 1024:>13.0f} {estimate / 1024:>13.0f} {estimate / measured:>18.2f}"
        )
    print(f"lowest estimate/measured: {worst:.2f} ({'an upper bound' if worst >= 1 else 'UNDER the measurement'})")
    return 0 if worst >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
