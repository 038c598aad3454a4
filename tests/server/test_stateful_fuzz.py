"""The stateful fuzzer (benchmarks/service_stateful_fuzz.py) for a short seeded run: one real
`perseus serve`, several clients sending valid and nearly-valid requests, one disk fault (the
state directory's tmpfs filled up; without mount rights a job folder replaced by a file), one
restart with a corrupted state file, and a last graceful restart. No invariant may break.

About 10-15 s on a loaded 2-core machine (three service starts, the planner's import in the
service, the sentinel job's plan).
"""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

fuzz = load_benchmark("service_stateful_fuzz")

STEPS = 1500


@pytest.mark.slow
def test_a_short_stateful_fuzz_run_breaks_no_invariant():
    report = fuzz.run_fuzz(
        STEPS,
        seed=11,
        clients=3,
        restart_every=0,  # only the forced events below
        fault_every=0,
        forced_faults={150: ("enospc", 100)},  # while jobs register and upload
        forced_restarts={900: ("SIGKILL", True)},  # with a corrupted state file
        plan_timeout_s=60.0,
    )
    problems = "\n".join(f"[{inv}] step {step}: {what}" for inv, step, what in report.violations[:20])
    assert not report.violations, f"{len(report.violations)} violations (seed 11), first:\n{problems}"
    assert report.steps == STEPS
    assert sum(report.faults.values()) == 1, report.faults
    assert report.restarts["SIGKILL"] == 1 and report.restarts["SIGTERM"] == 1 and not report.restarts["crash"], (
        report.restarts
    )
    assert report.sentinel_planned_s is not None
    assert report.ping_ms and report.max_rss_mb > 0


def test_the_request_stream_depends_on_the_seed_only(tmp_path):
    """Replaying a seed sends the same requests, whatever the service answered: a violation's
    seed and step reproduce it."""

    def stream(seed: int) -> list[tuple[str, str]]:
        machine = fuzz.StatefulFuzz(tmp_path, seed=seed)  # no service, no mount: run() does those
        steps = [
            machine.chaos_request() for _ in range(400)
        ]  # a request, or a list (a training iteration: every rank reports)
        return [
            (req.label, repr(req.fields)) for step in steps for req in ([step] if isinstance(step, fuzz.Req) else step)
        ]

    first = stream(5)
    assert first == stream(5)
    assert first != stream(6)
    labels = {label.split("/")[0] for label, _ in first}
    assert labels == {
        "register_job",
        "register_rank",
        "get_table",
        "upload_profile",
        "report_iteration",
        "declare_straggler",
        "status",
        "ping",
        "report_spans",
    }
