"""The jobs a service holds, within its `Budget`: a new job is admitted if it fits (the least
recently active idle jobs are evicted to make room), refused with `over_budget` and what to
change if not, and a job idle past the time-to-live is evicted.

A job is active when one of its ranks makes a request; a job whose schedule is being built or
whose plans are being solved (`busy`) is never evicted.
"""

from __future__ import annotations

from collections.abc import Callable

from perseus.exceptions import ServiceError
from perseus.service.budget import Budget, job_cost_bytes
from perseus.service.job import Job
from perseus.wire.envelope import ErrorCode
from perseus.wire.spec import JobSpec


def _over_budget(message: str) -> ServiceError:
    return ServiceError(ErrorCode.OVER_BUDGET.value, message)


class Admission:
    """`jobs` by id with their last activity (`clock` time) and estimated memory. `busy(job_id)`:
    whether the job has work on the service's threads; `evict(job_id, why)`: forget a job
    everywhere (the service's hook; it calls `remove`)."""

    def __init__(
        self, budget: Budget, clock: Callable[[], float], busy: Callable[[str], bool], evict: Callable[[str, str], None]
    ) -> None:
        self.budget = budget
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self._active: dict[str, float] = {}  # job id -> clock time of its latest request
        self._reported: dict[str, float] = {}  # job id -> clock time of its latest iteration report
        self._told_quiet: set[str] = set()  # jobs logged as quiet since their latest report
        self._costs: dict[str, int] = {}  # job id -> estimated memory (budget.job_cost_bytes)
        self._busy = busy
        self._evict = evict

    def get(self, job_id: str) -> Job:
        """The job a request names (now active); ServiceError (unknown_job) if there is none."""
        if job_id not in self.jobs:
            raise ServiceError(
                ErrorCode.UNKNOWN_JOB.value,
                f"no job {job_id} on this service; rank 0 registers the job (register_job) first",
            )
        self.touch(job_id)
        return self.jobs[job_id]

    def touch(self, job_id: str) -> None:
        self._active[job_id] = self.clock()

    def reported(self, job_id: str) -> None:
        self._reported[job_id] = self.clock()
        self._told_quiet.discard(job_id)

    def quiet(self, at_least_s: float) -> list[str]:
        """Jobs whose ranks reported no iteration for `at_least_s`, not yet told since their last."""
        now = self.clock()
        return [j for j, at in self._reported.items() if now - at >= at_least_s and j not in self._told_quiet]

    def told_quiet(self, job_id: str) -> None:
        self._told_quiet.add(job_id)

    def quiet_s(self, job_id: str) -> float | None:
        """Seconds since the job's ranks last reported an iteration (None: none since the service
        started): a status query shows a job that stalls, or whose ranks died before close()."""
        at = self._reported.get(job_id)
        return None if at is None else max(0.0, self.clock() - at)

    def admit(self, spec: JobSpec) -> int:
        """The new job's estimated memory, once it fits the budget (evicting the least recently
        active idle jobs to make room); ServiceError (over_budget) with what to change otherwise."""
        budget = self.budget
        for value, limit, what, flag in (
            (spec.world_size, budget.max_job_ranks, "ranks (world_size)", "--max-job-ranks"),
            (spec.dp, budget.max_job_pipelines, "data-parallel pipelines (dp)", "--max-job-pipelines"),
        ):
            if value > limit:
                raise _over_budget(
                    f"job has {value} {what}; this service admits at most {limit} per job (operator: {flag})"
                )
        cost = job_cost_bytes(spec)
        if cost > budget.memory_bytes:
            raise _over_budget(
                f"job needs about {cost >> 20} MiB of service memory; the budget is {budget.memory_bytes >> 20} MiB "
                "(operator: --memory-budget-mib)"
            )
        now = self.clock()
        while len(self.jobs) >= budget.max_jobs or sum(self._costs.values()) + cost > budget.memory_bytes:
            idle = [(self._active.get(j, now), j) for j in self.jobs if not self._busy(j)]
            oldest = min(idle, default=None)
            if oldest is None or now - oldest[0] < budget.evict_idle_s:
                if len(self.jobs) >= budget.max_jobs:
                    full = f"{len(self.jobs)} jobs (limit {budget.max_jobs})"
                else:
                    full = f"{sum(self._costs.values()) >> 20} MiB of jobs (budget {budget.memory_bytes >> 20} MiB)"
                raise _over_budget(
                    f"the service holds {full} and none has been idle {budget.evict_idle_s:.0f} s; retry later or ask "
                    "the operator to raise --max-jobs / --memory-budget-mib"
                )
            self._evict(oldest[1], f"making room for a new job (idle {now - oldest[0]:.0f} s)")
        return cost

    def add(self, job: Job, cost: int) -> None:
        self.jobs[job.job_id] = job
        self._costs[job.job_id] = cost
        self.touch(job.job_id)

    def remove(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self._active.pop(job_id, None)
        self._reported.pop(job_id, None)
        self._told_quiet.discard(job_id)
        self._costs.pop(job_id, None)

    def evict_idle(self, now: float) -> None:
        """Evict every job idle for the budget's time-to-live."""
        ttl = self.budget.job_ttl_s
        for job_id in [j for j, t in self._active.items() if now - t >= ttl and not self._busy(j)]:
            self._evict(job_id, f"idle for {now - self._active[job_id]:.0f} s (time-to-live {ttl:.0f} s)")
