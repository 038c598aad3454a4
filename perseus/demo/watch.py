"""Follow the demo job at the planner service while it runs, as `perseus status` would.

What the service's calibration and verification decide is said as it changes, and the plan
version each pipeline's verification decided on (held, or fell back to maximum clocks) is
written for the ranks (`perseus.demo.results.verdicts_path`), which run their plan until theirs
is. The launcher's process asks the service, not a rank: no request sits in a training iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from perseus.atomic import write_json_atomic
from perseus.client.planner_client import PlannerClient
from perseus.demo.results import verdicts_path
from perseus.exceptions import PerseusError

#: Verification states that end a plan's check: the plan holds, or the pipeline is at maximum clocks.
DECIDED = ("holds", "fallback")
#: Seconds between two status requests.
POLL_S = 1.0


class ServiceWatch:
    """The service's status of one job, polled; see the module docstring."""

    def __init__(self, address: str, out_dir: str, say: Callable[[str], None]) -> None:
        self.client = PlannerClient(address, timeout_s=5.0)
        self.out_dir = out_dir
        self.say = say
        self.status: Any = None  # the latest JobStatus
        self._said: dict[str, Any] = {}
        self._verdicts: dict[int, int] = {}
        self._next = 0.0

    def poll(self, job_id: str | None) -> None:
        """Ask the service about `job_id` (None: not registered yet) at most every POLL_S."""
        if job_id is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + POLL_S
        self.fetch(job_id)

    def fetch(self, job_id: str) -> Any:
        """The job's status now (a JobStatus; the latest one if the service does not answer)."""
        try:
            status = self.client.status(job_id)
        except PerseusError:
            return self.status
        if status is None or not status.jobs:
            return self.status
        self.status = job = status.jobs[0]
        for c in job.calibrations:
            self._tell(f"model {c.models}", (c.state, c.iterations), describe_calibration(c.to_wire()))
        for p in job.pipelines:
            if p.plan_version:
                line = describe_verification(p.to_wire())
                self._tell(f"pipeline {p.pipeline}", (p.plan_version, p.verification), line)
        verdicts = {p.pipeline: p.plan_version for p in job.pipelines if p.plan_version and p.verification in DECIDED}
        if verdicts != self._verdicts:
            write_json_atomic(verdicts_path(self.out_dir), {str(k): v for k, v in verdicts.items()}, fsync=False)
            self._verdicts = verdicts
        return job

    def close(self) -> None:
        self.client.close()

    def _tell(self, key: str, state: Any, line: str) -> None:
        if self._said.get(key) != state:
            self._said[key] = state
            self.say(f"service: {line}")


def describe_calibration(c: dict, reason: bool = True) -> str:
    """One line of a CalibrationStatus (its wire form): its state and the fit, and (`reason`) why
    it has none or what re-plans grew its margin."""
    measured, model = c.get("measured_s"), c.get("model_s")
    state = c["state"]
    if state == "collecting" and model is not None:
        state = "missed, collecting more iterations; the last fit"
    line = f"model {state}"
    if measured and model is not None:
        line += (
            f" on {c.get('iterations')} baseline iterations: model {model:.4f} s vs measured {measured:.4f} s "
            f"({100 * (model / measured - 1):+.2f}%"
        )
        line += f", tolerance {100 * c['tolerance']:.1f}%)" if c.get("tolerance") is not None else ")"
        if c.get("explained") is not None and c.get("gpu_only_s") is not None:
            line += f"; GPU profile alone {c['gpu_only_s']:.4f} s ({100 * c['explained']:.0f}% explained)"
        if c.get("host_gap_s") is not None and c.get("hop_s") is not None:
            line += f"; host gap {1000 * c['host_gap_s']:.2f} ms, hop {1000 * c['hop_s']:.2f} ms"
    if c.get("margin"):
        line += f"; margin {100 * c['margin']:.0f}% on slowed instructions"
    if reason and c.get("reason"):
        line += f": {c['reason']}"
    return line


def describe_verification(p: dict, reason: bool = True) -> str:
    """One line of a PipelineStatus (its wire form): what verification says of its plan, and
    (`reason`) why it was last re-planned."""
    state = p.get("verification")
    what = "reference: one window at maximum clocks measures a fresh target" if state == "reference" else state
    line = f"pipeline {p['pipeline']}, plan v{p.get('plan_version', 0)}: {what or 'not checked yet'}"
    measured, target = p.get("verified_iteration_time_s"), p.get("target_iteration_time_s")
    if state in ("verifying", "reference"):
        measured = None  # a window not yet full: what the status holds is an earlier plan's
    if measured is not None and target:
        line += (
            f", {measured:.4f} s measured against a {target:.4f} s target ({100 * (measured / target - 1):+.1f}%; "
            "compute time, median of a window)"
        )
    elif target:
        line += f", target {target:.4f} s"
    if p.get("replans"):
        line += f"; {p['replans']} re-plan(s)"
    if reason and p.get("reason"):
        line += f": {p['reason']}"
    return line
