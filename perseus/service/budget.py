"""What one planner service may hold and do: jobs, their memory, planning work, idle time.

A service runs for a whole cluster, so no client may make it use unbounded memory or time. Every
job is admitted against these budgets at registration (a clear `over_budget` error otherwise),
and jobs idle past their time-to-live are evicted (their cached profiles stay, so a job that
comes back skips profiling). The per-job costs are estimates of the service's own memory,
measured by `benchmarks/service_budget.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from perseus.exceptions import ConfigError
from perseus.wire.spec import JobSpec

# Bytes of service memory per unit of a job, from tracemalloc's peak while a job registers every
# rank, reports iterations and is saved (benchmarks/service_budget.py prints measured against
# estimated). Profiles are estimated at 128 frequencies per instruction kind unless the job
# names its sweep.
BYTES_PER_JOB = 32_000
BYTES_PER_RANK = 1_000
BYTES_PER_PIPELINE = 6_000
BYTES_PER_INSTRUCTION = 250
BYTES_PER_PROFILE_ROW = 150
PROFILED_FREQUENCIES = 128


@dataclass(frozen=True)
class Budget:
    """Limits of one service (`perseus serve --max-jobs ...`).

    `max_jobs`: jobs held at once. `memory_bytes`: the estimated memory of all jobs together.
    `max_job_ranks` / `max_job_pipelines`: one job's world size and data-parallel degree.
    `max_plan_choices`: (instruction, frequency) pairs of one pipeline's planning problem, which
    sizes its planning time (about 1 s per 100,000 on one core; see benchmarks/planner.py).
    `planning_workers`: plans solved at once. `job_ttl_s`: a job idle (no request) this long is
    evicted; `evict_idle_s`: when a budget is full, the least recently active job idle this long
    makes room for a new one.
    """

    max_jobs: int = 1024
    memory_bytes: int = 1 << 30
    max_job_ranks: int = 1 << 16
    max_job_pipelines: int = 1 << 13
    max_plan_choices: int = 2_000_000
    planning_workers: int = 2
    job_ttl_s: float = 7 * 86_400.0
    evict_idle_s: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "max_jobs",
            "memory_bytes",
            "max_job_ranks",
            "max_job_pipelines",
            "max_plan_choices",
            "planning_workers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"budget {name} must be a positive integer, got {value!r}")
        if self.max_jobs > 100_000:
            raise ConfigError(
                f"budget max_jobs is at most 100000 (one status reply lists every job), got {self.max_jobs}"
            )
        for name in ("job_ttl_s", "evict_idle_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"budget {name} must be a positive number of seconds, got {value!r}")


def job_cost_bytes(spec: JobSpec) -> int:
    """Estimated service memory of a job with every rank registered and every stage profiled."""
    if spec.stage_orders is not None:
        instructions = sum(map(len, spec.stage_orders))
    else:
        instructions = (
            3 * spec.pp * spec.num_microbatches * spec.num_chunks
        )  # forward, backward, and weight with zero bubble
    rows = 3 * spec.pp * spec.num_chunks * len(spec.sweep_frequencies or range(PROFILED_FREQUENCIES))
    return (
        BYTES_PER_JOB
        + BYTES_PER_RANK * spec.world_size
        + BYTES_PER_PIPELINE * spec.dp
        + BYTES_PER_INSTRUCTION * instructions
        + BYTES_PER_PROFILE_ROW * rows
    )
