"""A stage profile that never arrives, through a real `perseus serve`: once the stage's uploading
rank runs well past the end of the sweep the service designed, the service asks the stage for a
fresh sweep (a WARNING, `profile_dropped` in its status), and after the last one fails the job
(retryable) with a reason that names the stage and says what to do. Iterations are the ranks'
own counts, sent in the requests: nothing here depends on the wall clock but the waits for the
service's answers."""

from __future__ import annotations

from server_helpers import FREQUENCIES, job_spec, rank_info, request, stage_profile, wait_until
from test_server_calibration import status_cli

from perseus.service.job import Job
from perseus.service.overdue import MAX_SWEEPS, OVERDUE_SLACK
from perseus.wire.limits import SWEEP_VERSION
from perseus.wire.profiles import profile_to_wire

SPEC = job_spec(warmup_iterations=2, iterations_per_frequency=2)
STEPS = len(FREQUENCIES) * 2
FIRST_DEADLINE = 2 + 2 * STEPS + OVERDUE_SLACK  # warmup, the sweep and its repeats, the slack


def ok(reply: dict | None) -> dict:
    assert reply is not None and not isinstance(reply.get("error"), dict), reply
    return reply


def taken(reply: dict | None) -> bool:
    """The service answered and took the request (an upload waits while the schedule builds)."""
    return reply is not None and not isinstance(reply.get("error"), dict)


def table(endpoint: str, rank: int, iteration: int, sweep_version: int = SWEEP_VERSION) -> dict | None:
    return request(
        endpoint, "get_table", job_id=SPEC.job_id(), rank=rank, iteration=iteration, sweep_version=sweep_version
    )


def status(endpoint: str) -> dict:
    return ok(request(endpoint, "status", job_id=SPEC.job_id()))["jobs"][0]


def start_job(endpoint: str) -> None:
    """The job registered, both ranks in and stage 0's profile taken (the schedule is built)."""
    ok(request(endpoint, "register_job", spec=SPEC.to_wire()))
    for r in range(2):
        ok(request(endpoint, "register_rank", job_id=SPEC.job_id(), info=rank_info(r).to_wire()))
    upload = dict(job_id=SPEC.job_id(), rank=0, stage=0, profile=profile_to_wire(stage_profile(0)))
    wait_until(lambda: taken(request(endpoint, "upload_profile", **upload)))


def test_an_overdue_stage_profile_is_asked_again_then_fails_the_job_with_a_clear_reason(serve):
    served = serve()
    endpoint = served.endpoint
    start_job(endpoint)
    assert "sweep_round" not in ok(table(endpoint, 1, FIRST_DEADLINE))  # the sweep may still run
    assert not status(endpoint).get("profile_dropped")  # omitted on the wire when ""

    deadline = FIRST_DEADLINE
    iteration = deadline + 1
    for sweep in range(2, MAX_SWEEPS + 1):  # each late stage is asked again, through either request
        if sweep % 2:
            ok(
                request(
                    endpoint,
                    "report_iteration",
                    job_id=SPEC.job_id(),
                    rank=1,
                    iteration=iteration,
                    time_s=0.1,
                    energy_j=10.0,
                )
            )
            reply = ok(table(endpoint, 1, iteration))
        else:
            reply = ok(table(endpoint, 1, iteration))
        assert (
            reply["sweep_round"] == sweep - 1 and len(reply["sweep_steps"]) == STEPS and reply["phase"] == "profiling"
        )
        assert "sweep_round" not in ok(table(endpoint, 0, iteration))  # stage 0 is profiled: not asked
        dropped = status(endpoint)["profile_dropped"]
        assert f"stage 1 (GPU sim-a100): no profile by iteration {iteration}" in dropped
        assert f"sweep {sweep} of {MAX_SWEEPS}" in dropped
        old = table(endpoint, 1, iteration, sweep_version=2)  # a rank that sweeps once would wait forever
        assert old["error"]["code"] == "bad_version" and "upgrade perseus on the ranks" in old["error"]["message"]
        deadline = iteration + 2 * STEPS + OVERDUE_SLACK
        assert ok(table(endpoint, 1, deadline))["phase"] == "profiling"  # the new sweep's course
        iteration = deadline + 1

    failed = ok(table(endpoint, 1, iteration))
    assert failed["phase"] == "failed" and "sweep_steps" not in failed
    job = status(endpoint)
    assert job["phase"] == "failed"
    assert f"stage 1 (GPU sim-a100): no profile by iteration {iteration}" in job["error"]
    assert f"after {MAX_SWEEPS} sweeps" in job["error"] and "'Perseus failed'" in job["error"]
    text = status_cli(endpoint)
    assert "failed" in text and f"error: no plan: stage 1 (GPU sim-a100): no profile by iteration {iteration}" in text
    log = served.log()
    assert log.count("WARNING") >= MAX_SWEEPS and "asked to profile again (sweep 2 of 3)" in log
    assert f"failed: no plan: stage 1 (GPU sim-a100): no profile by iteration {iteration}" in log

    # Retryable: a new run of the job's ranks gets fresh sweeps, in a later round than any before.
    ok(request(endpoint, "register_job", spec=SPEC.to_wire()))
    rerun = ok(table(endpoint, 1, 0))
    assert rerun["phase"] == "profiling" and rerun["sweep_round"] == MAX_SWEEPS - 1
    ok(
        request(
            endpoint,
            "upload_profile",
            job_id=SPEC.job_id(),
            rank=1,
            stage=1,
            profile=profile_to_wire(stage_profile(1)),
        )
    )
    assert wait_until(lambda: ok(table(endpoint, 1, 1)).get("frequencies"), timeout_s=30)


def test_a_late_profile_in_time_for_its_next_sweep_is_taken_and_rounds_survive_a_restart(serve, tmp_path):
    served = serve()
    start_job(served.endpoint)
    assert ok(table(served.endpoint, 1, FIRST_DEADLINE + 1))["sweep_round"] == 1
    served.stop()
    again = serve()  # the same state: the round the stage's ranks follow is kept
    ok(request(again.endpoint, "register_rank", job_id=SPEC.job_id(), info=rank_info(1).to_wire()))
    assert ok(table(again.endpoint, 1, FIRST_DEADLINE + 2))["sweep_round"] == 1
    wire = profile_to_wire(stage_profile(1))
    upload = dict(job_id=SPEC.job_id(), rank=1, stage=1, profile=wire)
    wait_until(lambda: taken(request(again.endpoint, "upload_profile", **upload)))
    assert status(again.endpoint)["profiled_stages"] == [0, 1]
    assert wait_until(lambda: ok(table(again.endpoint, 1, 10**6)).get("frequencies"), timeout_s=30)
    assert status(again.endpoint)["phase"] == "planned"  # a profiled stage is never overdue


def test_a_dropped_profile_asks_ranks_that_uploaded_for_a_later_round():
    job = Job(SPEC)
    for r in range(2):
        job.add_rank(rank_info(r))
        job.add_profile(r, r, stage_profile(r))
    assert job.profiled_stages == (0, 1) and job.table(1, 40, 0).sweep_round == 0
    job.drop_profiles({"sim-a100"}, "the spans moved 30% from the profile's fit")
    for r in range(2):
        again = job.table(r, 41, 0)
        assert again.sweep_round == 1 and len(again.sweep_steps) == STEPS  # a client that uploaded follows it
    dropped_at = 40  # the latest iteration a rank reached
    assert job.watch_sweep(1, dropped_at + 2 * STEPS + OVERDUE_SLACK) is None  # the new sweep's course
    late = job.watch_sweep(1, dropped_at + 2 * STEPS + OVERDUE_SLACK + 1)
    assert late is not None and late.sweeps == 2 and not late.failed
