"""What the planner service's loop counts for its metrics, and the snapshot it publishes.

`ServiceMetrics` lives on the loop thread: `handled` counts each request by type and error
code where it is dispatched (and a rank's reported energy by job, pipeline and stage),
`tended` times the loop's work between requests and, when a scrape waits, publishes a
`ServiceSnapshot`: every job's status and counters, frozen, for the scrape thread to read.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from perseus.metrics.board import SnapshotBoard
from perseus.wire.fields import Message
from perseus.wire.messages import JobStatus, ReportIteration

if TYPE_CHECKING:  # annotations only: the service imports this module
    from perseus.service.service import PlannerService

#: Upper bounds (s) of the latency histograms: a loop answers in well under a millisecond when
#: idle; a rank's client times out after a second.
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
UNDECODED = "undecoded"  # the request type of a message that could not be read
OK = "ok"  # the code of a request answered without an error


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per bucket of `LATENCY_BUCKETS_S` (and +Inf last), and the sum."""

    counts: tuple[int, ...]
    sum_s: float


class _Latency:
    """A histogram filled on the loop thread."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self._sum += seconds

    def frozen(self) -> Histogram:
        cumulative, total = [], 0
        for count in self._counts:
            total += count
            cumulative.append(total)
        return Histogram(tuple(cumulative), self._sum)


@dataclass(frozen=True)
class JobFigures:
    """One job: its status and what its ranks reported, per (pipeline, stage)."""

    status: JobStatus
    plan_changes: int  # plan versions published after the first (reference windows, stragglers, restarts...)
    stage_energy_j: Mapping[tuple[int, int], float]
    stage_iterations: Mapping[tuple[int, int], int]  # iteration reports counted per stage (all its ranks)


@dataclass(frozen=True)
class ServiceSnapshot:
    """The service's figures at one loop tick."""

    taken_at: float  # Unix time
    jobs: tuple[JobFigures, ...]
    max_jobs: int
    requests: Mapping[tuple[str, str], int]  # (request type, "ok" or error code) -> count
    request_seconds: Histogram
    tend_seconds: Histogram
    plans_solved: int
    planning_s: float


class ServiceMetrics:
    """The loop's counters (plain Python: the service runs without prometheus-client)."""

    def __init__(self) -> None:
        self.board: SnapshotBoard[ServiceSnapshot] = SnapshotBoard()
        self._requests: dict[tuple[str, str], int] = {}
        self._handle = _Latency()
        self._tend = _Latency()
        self._energy: dict[str, dict[tuple[int, int], float]] = {}
        self._iterations: dict[str, dict[tuple[int, int], int]] = {}
        self._last_report: dict[tuple[str, int], int] = {}  # (job, rank) -> the iteration its last report counted

    def handled(self, service: PlannerService, request: Message | None, code: str, start: float) -> None:
        """One request answered with `code` ("ok" or an ErrorCode value), dispatched at `start`
        (time.perf_counter). A report's energy counts for its rank's pipeline and stage."""
        self._handle.add(time.perf_counter() - start)
        key = (request.TYPE if request is not None else UNDECODED, code)
        self._requests[key] = self._requests.get(key, 0) + 1
        if code == OK and isinstance(request, ReportIteration):
            job = service.jobs.get(request.job_id)
            info = job.ranks.get(request.rank) if job is not None else None
            rank = (request.job_id, request.rank)
            if info is not None and self._last_report.get(rank) != request.iteration:  # a client's retry: once
                self._last_report[rank] = request.iteration
                where = (info.dp_index, info.stage)
                energy = self._energy.setdefault(request.job_id, {})
                energy[where] = energy.get(where, 0.0) + request.energy_j
                counts = self._iterations.setdefault(request.job_id, {})
                counts[where] = counts.get(where, 0) + 1

    def tended(self, service: PlannerService, start: float) -> None:
        """The loop's work between requests took since `start`; publish if a scrape waits."""
        self._tend.add(time.perf_counter() - start)
        if self.board.wanted:
            self.board.publish(self.snapshot(service))

    def snapshot(self, service: PlannerService) -> ServiceSnapshot:
        gone = set(self._energy) - set(service.jobs)  # evicted jobs
        for job_id in gone:
            del self._energy[job_id]
            self._iterations.pop(job_id, None)
        if gone:
            self._last_report = {k: v for k, v in self._last_report.items() if k[0] not in gone}
        jobs = tuple(
            JobFigures(
                status=job.status(),
                plan_changes=max(0, job.plan_book.last_version - 1),
                stage_energy_j=dict(self._energy.get(job_id, {})),
                stage_iterations=dict(self._iterations.get(job_id, {})),
            )
            for job_id, job in sorted(service.jobs.items())
        )
        return ServiceSnapshot(
            taken_at=time.time(),
            jobs=jobs,
            max_jobs=service.budget.max_jobs,
            requests=dict(self._requests),
            request_seconds=self._handle.frozen(),
            tend_seconds=self._tend.frozen(),
            plans_solved=service.results.plans_solved,
            planning_s=service.results.planning_s,
        )
