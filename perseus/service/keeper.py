"""The service's jobs on disk: each job is saved on every change (rank registrations in batches),
a write that fails is retried, jobs are resumed at startup and an evicted job's state is deleted.

`guard` runs one job's work on the loop with its faults kept to that job: a write error degrades
the job (and marks it unsaved, so the write is retried), any other exception fails the job alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from perseus.service.budget import job_cost_bytes
from perseus.service.job import Job
from perseus.service.state import StateDir
from perseus.service.text import clip
from perseus.wire.spec import JobSpec

log = logging.getLogger(__name__)

SAVE_INTERVAL_S = 0.5  # rank registrations are saved this often (ranks re-register after a crash)
MEASURED_SAVE_S = 10.0  # a job's measured iterations are saved this often (see perseus.service.persistence)


class Keeper:
    """Keeps `jobs` (the service's, by id) in the state directory `state`. `unsaved`: jobs with rank
    registrations (or a failed write) not yet written."""

    def __init__(self, state: StateDir, jobs: dict[str, Job], clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.jobs = jobs
        self._clock = clock
        self.unsaved: set[str] = set()
        self.saved_at = 0.0
        self._measured_saved: dict[str, float] = {}  # job -> when its measurements were last due a save
        self._measured_since: set[str] = set()  # jobs with iterations measured since that

    def guard(self, job: Job, what: str, action: Callable[..., None], *args: Any) -> None:
        """Run one job's `action(*args)` on the loop thread: a write error degrades the job (the
        write is retried), any other exception fails that job alone, and the service keeps serving."""
        try:
            action(*args)
        except OSError as e:
            reason = f"its state could not be saved while {what} ({e.strerror or e}); retrying"
            if job.warning != clip(reason):
                log.error("job %s: %s", job.job_id, reason)
            job.degrade(reason)
            self.unsaved.add(job.job_id)
        except Exception as e:  # fault isolation: the traceback is logged, the job says why it failed
            log.exception(
                "job %s: internal error while %s; the job is failed, its ranks run at maximum clocks", job.job_id, what
            )
            job.fail(f"internal error while {what} ({type(e).__name__}: {e}); the service log has the traceback")

    def save(self, job: Job) -> None:
        self.state.save_job(job.to_record())
        self.unsaved.discard(job.job_id)
        if job.warning:
            log.info("job %s: its state is saved again", job.job_id)
            job.degrade("")

    def measured(self, job: Job) -> None:
        """An iteration of `job` completed: saved at most once per MEASURED_SAVE_S, and once more
        that long after its last (a finished job's final figures are kept too)."""
        self._measured_since.add(job.job_id)
        self._due_measured(self._clock())

    def _due_measured(self, now: float) -> None:
        for job_id in list(self._measured_since):
            if now - self._measured_saved.get(job_id, -MEASURED_SAVE_S) >= MEASURED_SAVE_S:
                self._measured_saved[job_id] = now
                self._measured_since.discard(job_id)
                self.unsaved.add(job_id)

    def save_due(self) -> bool:
        """Whether unsaved jobs wait and the last batch was saved SAVE_INTERVAL_S ago or more."""
        now = self._clock()
        self._due_measured(now)
        return bool(self.unsaved) and now - self.saved_at >= SAVE_INTERVAL_S

    def save_unsaved(self) -> None:
        for job_id in sorted(self.unsaved):
            job = self.jobs.get(job_id)
            if job is None:
                self.unsaved.discard(job_id)
            else:
                self.guard(job, "saving its state", self.save, job)
        self.saved_at = self._clock()

    def save_all(self) -> None:
        """Save every job with something unsaved, measured iterations too (the service stops)."""
        self.unsaved |= self._measured_since
        self._measured_since.clear()
        self.save_unsaved()

    def load_jobs(self) -> Iterator[tuple[Job, int]]:
        """Each job of the state directory that can be resumed, with its estimated memory
        (budget.job_cost_bytes); a record that cannot be resumed is moved to the quarantine folder
        (one log line) and the others load."""
        for folder, record in self.state.load_jobs():
            try:
                spec = JobSpec.from_wire(record["spec"])
                models = ([spec.gpu_model] if record.get("cached") else []) + list(record.get("cached_models", []))
                cached = {
                    m: p
                    for m in models
                    if (p := self.state.load_cached_profile(spec.profile_key(m), spec.signature(m))) is not None
                }
                job = Job.from_record(record, self.state.load_stage_profiles(folder), cached)
                if job.job_id != folder.name:
                    raise ValueError(f"the folder of job {folder.name} holds the record of {job.job_id}")
                cost = job_cost_bytes(spec)
            except Exception as e:  # fault isolation: whatever a damaged file holds, the other jobs resume
                # One WARNING line names the file and the error; the traceback (a bug, not a damaged file?)
                # is logged at debug level.
                log.debug("job folder %s cannot be resumed", folder, exc_info=True)
                self.state.quarantine(folder, f"{type(e).__name__}: {e}")
                continue
            yield job, cost

    def forget(self, job_id: str) -> None:
        """Stop saving an evicted job and delete its state folder (its cached profiles stay)."""
        self.unsaved.discard(job_id)
        self._measured_saved.pop(job_id, None)
        self._measured_since.discard(job_id)
        try:
            self.state.remove_job(job_id)
        except OSError as e:
            log.warning("job %s evicted, but its state folder could not be removed: %s", job_id, e)
